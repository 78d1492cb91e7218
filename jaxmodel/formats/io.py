"""Positioned file I/O shared by the writers: whole writes at an offset, and bounded chunked reads."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterator

from jaxmodel.errors import UserError

CHUNK_BYTES = 64 << 20


class ShortFileError(UserError):
    """A file ended before the bytes its header promises."""


def read_json(path: str | Path, error: type[UserError]) -> Any:
    """The JSON document in `path`; malformed JSON raises `error` naming the file (missing files raise as usual)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg})") from None


def pwrite_all(fd: int, data, offset: int) -> int:
    """Write all of `data` (bytes-like) at `offset`; `os.pwrite` may write less than asked. Returns its size."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
    return view.nbytes


def read_chunks(fd: int, offset: int, nbytes: int) -> Iterator[memoryview]:
    """The `nbytes` at `offset` of an open file, in chunks of one reused buffer (no memory mapping, so
    reading a 200 GB file does not grow the process's RSS)."""
    buffer = memoryview(bytearray(max(1, min(nbytes, CHUNK_BYTES))))
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [buffer[: min(len(buffer), nbytes - done)]], offset + done)
        if n == 0:
            raise ShortFileError(f"file ended {nbytes - done} bytes before the expected end")
        yield buffer[:n]
        done += n


def crc32_of_range(fd: int, offset: int, nbytes: int) -> int:
    crc = 0
    for chunk in read_chunks(fd, offset, nbytes):
        crc = zlib.crc32(chunk, crc)
    return crc


def copy_range(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> None:
    """Copy bytes between open files through user space, a chunk at a time."""
    for chunk in read_chunks(src_fd, src_offset, nbytes):
        dst_offset += pwrite_all(dst_fd, chunk, dst_offset)
