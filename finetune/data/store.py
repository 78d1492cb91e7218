"""The tokenized-data store: one directory of memory-mapped arrays, written once in pieces.

`ids.npy` int32 [tokens] every example's ids concatenated, `trained.npy` bool [tokens], `starts.npy` int64
[examples + 1] (example e is `ids[starts[e]:starts[e + 1]]` and comes from row e; in a store of preference
pairs, meta.json's `examples_per_row` 2, from row e // 2: chosen at 2r, rejected at 2r + 1), `meta.json` (counts
and what the store was built from) written last.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from finetune.data.rows import Example

STORE_VERSION = 1
STORE_FILES = ("ids.npy", "trained.npy", "starts.npy", "meta.json")


@dataclasses.dataclass(frozen=True)
class TokenizedData:
    """A store of tokenized examples, its arrays memory-mapped (read-only)."""

    directory: Path
    ids: np.ndarray  # int32 [tokens]
    trained: np.ndarray  # bool [tokens]: whether each token is a training target
    starts: np.ndarray  # int64 [examples + 1]
    meta: dict

    @classmethod
    def open(cls, directory: str | Path) -> "TokenizedData":
        """The store in `directory`; ValueError when it is incomplete or of another version."""
        directory = Path(directory)
        try:
            meta = json.loads((directory / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{directory}: not a complete tokenized-data store ({e})") from None
        if meta.get("store_version") != STORE_VERSION:
            raise ValueError(f"{directory}: tokenized-data store version {meta.get('store_version')}, "
                             f"expected {STORE_VERSION}")
        ids, trained, starts = (_load(directory / name) for name in ("ids.npy", "trained.npy", "starts.npy"))
        if not (ids.dtype == np.int32 and trained.dtype == np.bool_ and starts.dtype == np.int64
                and len(ids) == len(trained) == starts[-1] == meta["tokens"] and len(starts) == meta["examples"] + 1):
            raise ValueError(f"{directory}: tokenized-data store arrays disagree with its meta.json")
        return cls(directory=directory, ids=ids, trained=trained, starts=starts, meta=meta)

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def examples_per_row(self) -> int:
        """Examples each row gave: 2 for preference pairs (chosen, rejected), else 1."""
        return int(self.meta.get("examples_per_row", 1))

    def lengths(self) -> np.ndarray:
        """int64 [examples]: each example's number of tokens."""
        return np.diff(self.starts)

    def example(self, e: int, where: str = "") -> Example:
        lo, hi = int(self.starts[e]), int(self.starts[e + 1])
        return Example(np.asarray(self.ids[lo:hi]), np.asarray(self.trained[lo:hi]), where)


def _load(path: Path) -> np.ndarray:
    with open(path, "rb") as f:  # mmap cannot map zero bytes: an empty array is read instead
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, _ = read(f)
    return np.load(path, mmap_mode="r" if math.prod(shape) else None)


class NpyAppender:
    """A 1-D .npy file written in pieces; the header is rewritten with the final length on `close` (numpy
    pads every header so that a length can grow to 21 digits in place)."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype, self.length = path, np.dtype(dtype), 0
        self.file = open(path, "wb")
        self.header_size = self._write_header()

    def _write_header(self) -> int:
        self.file.seek(0)
        np.lib.format.write_array_header_1_0(self.file, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                         "fortran_order": False, "shape": (self.length,)})
        return self.file.tell()

    def append(self, values: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(values, self.dtype).tobytes())
        self.length += len(values)

    def close(self) -> None:
        end = self.file.tell()
        if self._write_header() != self.header_size:
            raise RuntimeError(f"{self.path}: the .npy header changed size")
        self.file.seek(end)
        self.file.close()


