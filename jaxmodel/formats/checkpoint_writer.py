"""Writes a converted checkpoint slice by slice: every parameter file created up front (header written,
data region sized), slices filled in any order with their crc32s, the manifest written last. A slice may also be
filled in parts (a layer's experts, each from its own tensor): its crc32 is then read back once every part is in."""

from __future__ import annotations

import errno
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from jaxmodel.formats.checkpoint import FORMAT, MANIFEST, CheckpointError, file_for, manifest_version
from jaxmodel.formats.io import copy_range, crc32_of_range, pwrite_all
from jaxmodel.formats.safetensors_file import TensorLocation, write_header
from jaxmodel.quantization import Quantization


class CheckpointWriter:
    """Creates every parameter file up front (header written, data region sized), then takes slices.

    `slices` of a parameter is its leading-axis length for stacked parameters, else 1. A `quantization`
    is recorded in the manifest (which makes it version 2, `jaxmodel.formats.checkpoint`).
    """

    def __init__(self, directory: Path, tensors: Mapping[str, tuple[tuple[int, ...], np.dtype, bool]],
                 quantization: Quantization | None = None):
        self.directory = directory
        self.quantization = quantization
        (directory / "params").mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, dict] = {}
        self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="crc32")
        self._fds: dict[str, int] = {}
        self._locations: dict[str, TensorLocation] = {}
        self._filled: dict[tuple[str, int], int] = {}  # bytes written so far of slices filled in parts
        for path, (shape, dtype, stacked) in tensors.items():
            fd = os.open(directory / file_for(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[path] = fd
            self._locations[path] = write_header(fd, [(path, np.dtype(dtype), shape)], {"format": "np"})[path]
            n = shape[0] if stacked else 1
            self._entries[path] = {"file": file_for(path), "shape": list(shape), "dtype": np.dtype(dtype).name,
                                   "stacked": stacked, "crc32": [None] * n}

    def slice_nbytes(self, path: str) -> int:
        entry = self._entries[path]
        return self._locations[path].nbytes // len(entry["crc32"])

    def write_slice(self, path: str, index: int, chunks: Iterable[memoryview | bytes], start: int = 0,
                    nbytes: int | None = None) -> int:
        """Write slice `index` of `path` from `chunks` (in order), or its part of `nbytes` bytes from byte `start`;
        returns the bytes written."""
        part = self.open_slice(path, index, start, nbytes)
        for chunk in chunks:
            part.write(chunk)
        return part.close()

    def open_slice(self, path: str, index: int, start: int = 0, nbytes: int | None = None) -> "SliceWriter":
        """A writer of slice `index` of `path` (or its part of `nbytes` from byte `start`) taking its bytes in order
        over several calls (e.g. two slices filled side by side from one source); `close()` checks the length and
        records the crc32."""
        return SliceWriter(self, path, index, start, nbytes)

    def copy_slice(self, path: str, index: int, src_fd: int, src_offset: int, start: int = 0,
                   nbytes: int | None = None) -> int:
        """Write slice `index` of `path` (or its part of `nbytes` from byte `start`) from the bytes at `src_offset`
        of another open file, unchanged.

        The kernel copies (`copy_file_range`, as fast as `cp`) while a second thread checksums the same
        bytes from the page cache; where the kernel cannot copy between these files, chunks go through
        user space instead. Returns the bytes written.
        """
        whole = self.slice_nbytes(path)
        nbytes = whole if nbytes is None else nbytes
        crc = self._checksummer.submit(crc32_of_range, src_fd, src_offset, nbytes) if nbytes == whole else None
        dst_fd, dst_offset = self._fds[path], self._locations[path].offset + index * whole + start
        try:
            done = 0
            while done < nbytes:
                n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
                if n == 0:
                    raise CheckpointError(f"{path}[{index}]: source ended before {nbytes} bytes")
                done += n
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            copy_range(src_fd, src_offset, dst_fd, dst_offset, nbytes)
        if crc is None:
            self._part_written(path, index, nbytes)
        else:
            self._entries[path]["crc32"][index] = crc.result()
        return nbytes

    def _part_written(self, path: str, index: int, nbytes: int) -> None:
        """Count a part of a slice in; once the parts fill it, its crc32 from the bytes written."""
        whole = self.slice_nbytes(path)
        filled = self._filled.get((path, index), 0) + nbytes
        self._filled[(path, index)] = filled
        if filled == whole:
            offset = self._locations[path].offset + index * whole
            self._entries[path]["crc32"][index] = crc32_of_range(self._fds[path], offset, whole)

    def missing(self) -> list[tuple[str, int]]:
        return [(p, i) for p, e in self._entries.items() for i, c in enumerate(e["crc32"]) if c is None]

    def finish(self, info: Mapping[str, object] | None = None) -> None:
        """Flush the data and write the manifest, which marks the directory complete."""
        if self.missing():
            path, index = self.missing()[0]
            raise CheckpointError(f"{path}[{index}] was never written")
        for fd in self._fds.values():
            os.fsync(fd)
        self.close()
        quantized = {} if self.quantization is None else {"quantization": self.quantization.to_json()}
        manifest = {"format": FORMAT, "version": manifest_version(self.quantization), **(info or {}), **quantized,
                    "tensors": dict(sorted(self._entries.items()))}
        (self.directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    def close(self) -> None:
        self._checksummer.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class SliceWriter:
    """One slice of a `CheckpointWriter`'s parameter, written in order by `write` calls with a running crc32."""

    def __init__(self, writer: CheckpointWriter, path: str, index: int, start: int = 0, nbytes: int | None = None):
        self._writer, self._path, self._index = writer, path, index
        whole = writer.slice_nbytes(path)
        self._expected = whole if nbytes is None else nbytes
        self._part = self._expected != whole
        self._fd = writer._fds[path]
        self._offset = writer._locations[path].offset + index * whole + start
        self._written, self._crc = 0, 0

    def write(self, chunk: memoryview | bytes) -> None:
        n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
        if self._written + n > self._expected:
            raise CheckpointError(f"{self._path}[{self._index}]: more than the {self._expected} bytes its shape holds")
        pwrite_all(self._fd, chunk, self._offset + self._written)
        self._crc = zlib.crc32(chunk, self._crc)
        self._written += n

    def close(self) -> int:
        """Check that the slice is complete and record its crc32; returns the bytes written."""
        if self._written != self._expected:
            raise CheckpointError(f"{self._path}[{self._index}]: got {self._written} bytes, its shape holds "
                                  f"{self._expected}")
        if self._part:
            self._writer._part_written(self._path, self._index, self._written)
        else:
            self._writer._entries[self._path]["crc32"][self._index] = self._crc
        return self._written
