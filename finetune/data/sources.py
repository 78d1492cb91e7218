"""Where training rows come from: `open_source(spec)` -> a `DataSource` (rows as a memory-mapped Arrow
`datasets.Dataset`, and the name of each row for reports).

`spec` is, in this order:
- a file: .jsonl, .json, .parquet or .csv, read with `datasets` (converted once to Arrow in its cache);
- a directory: every such file under it, subdirectories included, hidden files and directories (a name
  starting with ".") and files of other kinds left out;
- a glob (`data/*.jsonl`, `shards/**/train-*.parquet`): the files of those kinds it matches;
- otherwise a dataset id (`user/name`) with its subset and split, read from the HF datasets cache only: the
  call runs in offline mode, so nothing is ever downloaded.

The files of a directory or glob are read in plain string order of their paths (`shard-10` before `shard-2`:
zero-pad the numbers, as `train-00002-of-00010` does) and concatenated: the rows, and their order, of one
file holding them all. Files whose columns differ are read with the union of the columns (None where a
file has no such column or struct field; the JSON value where their types cannot be unified, as `datasets`
does for a value whose type varies within one file); kinds may be mixed. Each file is loaded on its own
(about 10 ms per file once `datasets` has cached it), so each row can be named by its file.

A row is named `file:line` for JSONL (blank lines counted, as an editor numbers lines; found by one scan of
the file the first time a row of it is named, which also checks the file holds one JSON object per line),
`file row N` for the other kinds, `id (subset s, split t) row N` for a dataset id. A JSONL line that is not
UTF-8, not JSON or not an object is named the same way with what is wrong with it.

`fingerprint()` keys caches built from the data: for files, each file's resolved path, size and mtime in
nanoseconds (a changed file is a different key; a copy, touch or move rebuilds, which is only slower); for a
dataset id, the id, subset, split and the fingerprint `datasets` gives the cached split.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import glob
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from finetune.data.rows import DataError

KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_KIND_NAMES = ".jsonl, .json, .parquet or .csv"
# Bytes `datasets` parses of a JSON file at a time (its default); the columns are inferred from the first.
JSON_CHUNK_BYTES = 10 << 20
_NOT_FOUND = "not a file, directory, glob or dataset in the HF datasets cache"


@dataclasses.dataclass(frozen=True)
class _File:
    path: Path  # as the user named it (joined to the directory given), for messages
    kind: str
    rows: int
    size: int
    mtime_ns: int


class DataSource:
    """Rows from one `spec`: `dataset` (Arrow, memory-mapped), `where(i)` naming row i, `fingerprint()`."""

    def __init__(self, dataset, description: str, files: list[_File] = (), dataset_id: dict | None = None):
        self.dataset = dataset
        self.description = description
        self._files = list(files)
        self._starts = np.cumsum([0] + [f.rows for f in self._files]).tolist()
        self._dataset_id = dataset_id
        self._lines: dict[Path, list[int]] = {}  # per JSONL file: the rows read before each blank line

    def __len__(self) -> int:
        return len(self.dataset)

    def where(self, i: int) -> str:
        """Row `i` named for a message: `file:line`, `file row N` or `id (subset s, split t) row N`."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        if self._dataset_id is not None:
            return f"{self.description} row {i + 1}"
        k = bisect.bisect_right(self._starts, i) - 1
        file, row = self._files[k], i - self._starts[k]
        if file.kind != "jsonl":
            return f"{file.path} row {row + 1}"
        if file.path not in self._lines:
            self._lines[file.path] = _blank_lines(file)
        return f"{file.path}:{row + 1 + bisect.bisect_right(self._lines[file.path], row)}"

    def fingerprint(self) -> dict[str, Any]:
        """JSON-able identity of the data for cache keys (see the module docstring)."""
        if self._dataset_id is not None:
            return {**self._dataset_id, "fingerprint": self.dataset._fingerprint}
        return {"files": [{"path": str(f.path.resolve()), "size": f.size, "mtime_ns": f.mtime_ns}
                          for f in self._files]}


def open_source(spec: str, *, split: str = "train", subset: str | None = None) -> DataSource:
    """The rows `spec` names: a file, a directory or glob of files, or a cached dataset id (module docstring).
    Raises DataError (one line naming the file, line or id) for anything that cannot be read."""
    if names_files(spec):
        if subset is not None:
            raise DataError(f"{spec}: a subset ({subset!r}) applies only to a dataset id")
        return _open_files(spec, _data_files(spec))
    return _open_dataset_id(spec, split, subset)


def names_files(spec: str) -> bool:
    """Whether `spec` names local files (a file, a directory or a glob) rather than a dataset id."""
    path = Path(spec)
    return path.is_file() or path.is_dir() or _is_glob(spec)


def _is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def _data_files(spec: str) -> list[Path]:
    path = Path(spec)
    if path.is_file():
        if path.suffix not in KINDS:
            raise DataError(f"{path}: unsupported data file (expected {_KIND_NAMES})")
        return [path]
    if path.is_dir():
        found = sorted((p for p in path.rglob("*") if p.suffix in KINDS and p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not found:
            raise DataError(f"{path}: no {_KIND_NAMES} files in the directory")
        return found
    found = [Path(p) for p in sorted(glob.glob(spec, recursive=True))
             if Path(p).suffix in KINDS and Path(p).is_file()]
    if not found:
        raise DataError(f"{spec}: {_NOT_FOUND} (no {_KIND_NAMES} file matches the glob)")
    return found


def _open_files(spec: str, paths: list[Path]) -> DataSource:
    single = len(paths) == 1 and Path(spec).is_file()
    files, parts = [], []
    for path in paths:
        stat = path.stat()
        if not _has_content(path):
            if single:
                raise DataError(f"{path}: no rows (the dataset is empty)")
            continue  # an empty shard holds no rows (and a zero-byte one is no valid parquet file)
        kind = KINDS[path.suffix]
        dataset = _load_file(path, kind)
        if len(dataset) == 0:
            if single:
                raise DataError(f"{path}: no rows (the dataset is empty)")
            continue
        files.append(_File(path, kind, len(dataset), stat.st_size, stat.st_mtime_ns))
        parts.append(dataset)
    if not sum(f.rows for f in files):
        raise DataError(f"{spec}: no rows (the dataset is empty)")
    return DataSource(_concatenate(spec, files, parts), spec, files)


def _has_content(path: Path) -> bool:
    """Whether the file holds anything but whitespace (and a byte order mark)."""
    with open(path, "rb") as f:
        first = f.read(1 << 16)
        if first.startswith(b"\xef\xbb\xbf"):
            first = first[3:]
        while first:
            if first.strip():
                return True
            first = f.read(1 << 16)
    return False


def _concatenate(spec: str, files: list[_File], parts: list):
    """One dataset of `parts` in order; parts whose columns differ are read again with the union of them."""
    import datasets
    import pyarrow

    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError:  # columns datasets cannot align as they are (e.g. a struct with a field more)
        pass
    features = _union_features(parts)
    try:
        parts = [p if p.features == features else _load_file(f.path, f.kind, features) for f, p in zip(files, parts)]
        return datasets.concatenate_datasets(parts)
    except (ValueError, pyarrow.ArrowException) as e:
        raise DataError(f"{spec}: the files' columns do not fit together ({_one_line(e)})") from None


def _union_features(parts: list):
    """Every column of `parts`, each of a type all of them fit: their types unified (struct fields merged), or
    JSON where they cannot be (`datasets` stores as JSON a value whose type varies within one file)."""
    import datasets
    import pyarrow
    from datasets.utils.json import get_json_field_paths_from_feature

    columns: dict[str, list] = {}
    for part in parts:
        for name, feature in part.features.items():
            columns.setdefault(name, []).append(datasets.Features({name: feature}))
    union = {}
    for name, features in columns.items():
        try:
            if any(get_json_field_paths_from_feature(f) for f in features):
                raise TypeError("a JSON column")
            schema = pyarrow.unify_schemas([f.arrow_schema.remove_metadata() for f in features],
                                           promote_options="permissive")
            union[name] = datasets.Features.from_arrow_schema(schema)[name]
        except (pyarrow.ArrowException, TypeError, ValueError):
            union[name] = datasets.Json()
    return datasets.Features(union)


def _load_file(path: Path, kind: str, features=None):
    """The rows of one file as a `datasets.Dataset`; DataError naming the file (and line) if unreadable."""
    import datasets
    import pyarrow

    unreadable = (datasets.exceptions.DatasetsError, pyarrow.ArrowException, UnicodeDecodeError, StopIteration,
                  ValueError, TypeError)
    try:
        return _build(path, kind, features)
    except unreadable as e:
        error = e
    if kind == "jsonl":
        if features is None:  # columns first seen past the first chunk: read again with every chunk's columns
            features = _jsonl_features(path)
            if features is not None:
                with contextlib.suppress(*unreadable):
                    return _build(path, kind, features)
        _raise_for_bad_line(path)
    cause = error.__cause__ or error.__context__ or error
    raise DataError(f"{path}: not a readable {kind} file ({_one_line(cause)})") from None


def _build(path: Path, kind: str, features=None):
    """`datasets.load_dataset` of one file. pyarrow's JSON parser takes any bytes in a string (`datasets` checks
    only a file's first chunk is UTF-8): a JSON file's new Arrow cache is checked whole, and removed if bad."""
    import datasets
    import pyarrow

    name = "json" if kind in ("jsonl", "json") else kind
    options = {"chunksize": JSON_CHUNK_BYTES, "parse_agent_traces": False} if name == "json" else {}
    with _quiet():
        builder = datasets.load_dataset_builder(name, data_files=str(path), features=features, **options)
        new = not os.path.exists(os.path.join(builder.cache_dir, datasets.config.DATASET_INFO_FILENAME))
        builder.download_and_prepare()
        if not builder.info.splits["train"].num_examples:
            return datasets.Dataset.from_dict({})  # `as_dataset` refuses a split with no rows
        dataset = builder.as_dataset(split="train")
    if new and name == "json":
        try:
            dataset.data.validate(full=True)
        except pyarrow.ArrowInvalid:
            shutil.rmtree(builder.cache_dir, ignore_errors=True)
            raise
    return dataset


def _jsonl_features(path: Path):
    """The columns of every chunk of a JSONL file, unified (None if pyarrow cannot read or unify them)."""
    import datasets
    import pyarrow
    import pyarrow.json

    schemas = []
    try:
        for chunk in _line_chunks(path):
            table = pyarrow.json.read_json(io.BytesIO(chunk), read_options=pyarrow.json.ReadOptions(
                block_size=len(chunk) + 1))
            schemas.append(table.schema)
        return datasets.Features.from_arrow_schema(pyarrow.unify_schemas(schemas, promote_options="permissive"))
    except (pyarrow.ArrowException, ValueError, TypeError):
        return None


def _line_chunks(path: Path) -> Iterator[bytes]:
    """The file in pieces of about JSON_CHUNK_BYTES ending at line ends (a leading byte order mark dropped)."""
    with open(path, "rb") as f:
        first = True
        while chunk := f.read(JSON_CHUNK_BYTES):
            chunk += f.readline()
            if first and chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
            first = False
            if chunk.strip():
                yield chunk


def _raise_for_bad_line(path: Path) -> None:
    """DataError naming the first line of a JSONL file that is not UTF-8, not JSON or not a JSON object."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")


def _blank_lines(file: _File) -> list[int]:
    """For each blank line of a JSONL file, how many rows come before it (row r is on line r + 1 + the number
    of blank lines with at most r rows before them)."""
    blanks, rows = [], 0
    with open(file.path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if (raw[3:] if number == 1 and raw.startswith(b"\xef\xbb\xbf") else raw).strip():
                rows += 1
            else:
                blanks.append(rows)
    if rows != file.rows:
        raise DataError(f"{file.path}: expected one JSON object per line ({file.rows} rows were read from {rows} "
                        "non-blank lines)")
    return blanks


# A name the Hub could hold: `name` or `namespace/name`.
_DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _open_dataset_id(spec: str, split: str, subset: str | None) -> DataSource:
    import datasets

    if not _DATASET_ID.fullmatch(spec) or Path(spec).suffix in KINDS:
        raise DataError(f"{spec}: {_NOT_FOUND} (no such file or directory)")
    try:
        with _offline(), _quiet():
            dataset = datasets.load_dataset(spec, subset, split=split)
    except ConnectionError:  # what offline mode leaves of "not in the cache"
        raise DataError(f"{spec}: {_NOT_FOUND} (not in the datasets cache at {datasets.config.HF_DATASETS_CACHE})"
                        ) from None
    except (datasets.exceptions.DatasetsError, OSError, ValueError, RuntimeError, KeyError) as e:
        raise DataError(f"{spec}: {_NOT_FOUND} ({_one_line(e)})") from None
    if len(dataset) == 0:
        raise DataError(f"{spec}: no rows (the dataset is empty)")
    named = ", ".join(([f"subset {subset}"] if subset else []) + [f"split {split}"])
    return DataSource(dataset, f"{spec} ({named})", dataset_id={"dataset": spec, "subset": subset, "split": split})


@contextlib.contextmanager
def _offline():
    """HF Hub offline mode for the call (datasets and huggingface_hub read it once at import: set both)."""
    import datasets.config
    import huggingface_hub.constants

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
             huggingface_hub.constants.HF_HUB_OFFLINE,
             {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")})
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        yield
    finally:
        (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
         huggingface_hub.constants.HF_HUB_OFFLINE, env) = saved
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet():
    """`datasets` without its progress bars and log lines (a failure is reported as one DataError line)."""
    import datasets
    from datasets.utils import logging as datasets_logging

    verbosity, bars = datasets_logging.get_verbosity(), not datasets.are_progress_bars_disabled()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL + 1)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (its lines joined with "; ")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__
