"""The tokenized-data cache: one TokenizedData store per (data, tokenizer, layout, seq_len, version), reused by
reruns, resumes and other runs on the same data.

The key hashes the data's fingerprint (each file's path, size and mtime, or a cached dataset's fingerprint),
what decides how the tokenizer tokenizes (its whole serialized pipeline: vocabulary, merges, added and special
tokens, normalizer, pre-tokenizer; or, for a tokenizer loaded unchanged from a directory, that directory's
files and the library versions; its chat template; BOS and EOS; whether special tokens are split), the
row layout (which also tells preference pairs, two examples a row, from SFT rows), the sequence length (a long
row is tokenized only as far as it needs), the prompt bound (`--max-prompt-len`: a part of the key only when
set, so the entries built without one keep their keys) and CACHE_VERSION. An entry is built in a temporary sibling directory
and renamed into place with its `meta.json` written last, so a half-written entry is never used; the temporaries
of a build that was killed are removed by the next build of that key. An exclusive lock (`flock` on `KEY.lock`)
per key makes processes sharing the directory build an entry once: the others wait, then reuse it.

Each entry also holds `digest.json`: a sha256 of its tokens (example boundaries, ids, training targets), the same
for the same tokens however they were built (any number of workers, any cache directory, any path or mtime of
the data), so a resumed run can tell whether it would train on the examples it started with. It is computed
once, as the entry is built (its files still in the page cache), or at the first use of an entry built without
it, under the entry's lock.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from finetune.data.rows import DataError
from finetune.data.store import STORE_VERSION, TokenizedData
from finetune.data.workers import default_workers, tokenize_to_store
from jaxmodel.formats.atomic import atomic_directory

# Raised whenever what a stored entry holds for the same key would differ (tokenization or store format).
CACHE_VERSION = 3
DIGEST_FILE = "digest.json"
# Bytes of an array hashed at a time: the memory-mapped store is read in pieces, never whole.
HASH_CHUNK_BYTES = 1 << 24


def cache_root(option: str | None = None) -> Path:
    """--data-cache, else $XDG_CACHE_HOME/llama-jax/data, else ~/.cache/llama-jax/data."""
    if option:
        return Path(option).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama-jax" / "data"


def tokenizer_digest(tokenizer) -> str:
    """sha256 of everything that decides how `tokenizer` tokenizes rows (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"caching tokenized data needs a fast tokenizer, got {type(tokenizer).__name__}")
    digest = hashlib.sha256(backend.to_str().encode())
    digest.update(_settings(tokenizer))
    return digest.hexdigest()


def loaded_tokenizer_digest(directory: str | Path, tokenizer) -> str:
    """The digest of `tokenizer` as `AutoTokenizer.from_pretrained(directory)` loaded it, nothing changed since:
    sha256 of the regular files at the top of `directory` (names and contents: a converted checkpoint keeps its
    weights in a subdirectory), the versions of transformers and tokenizers that built the tokenizer from them,
    and the settings `tokenizer_digest` adds. Serializing Llama 3's tokenizer for `tokenizer_digest` takes
    0.2 s, more than a whole warm start otherwise; its files hash in a hundredth of that."""
    import tokenizers
    import transformers

    digest = hashlib.sha256(f"transformers {transformers.__version__} tokenizers {tokenizers.__version__}\n".encode())
    hash_files(digest, sorted(p for p in Path(directory).iterdir() if p.is_file()))
    digest.update(_settings(tokenizer))
    return f"files:{digest.hexdigest()}"


def hash_files(digest, paths) -> None:
    """Add each file of `paths` to `digest`, in order: a line of its name and size, then its bytes, read
    HASH_CHUNK_BYTES at a time."""
    for path in paths:
        path = Path(path)
        digest.update(f"{path.name} {path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(HASH_CHUNK_BYTES), b""):
                digest.update(chunk)


def _settings(tokenizer) -> bytes:
    return json.dumps({"chat_template": getattr(tokenizer, "chat_template", None),
                       "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                       "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))},
                      sort_keys=True, default=str).encode()


def cache_key(data: dict[str, Any], tokenizer, layout: str, seq_len: int | None,
              tokenizer_key: str | None = None, max_prompt: int | None = None) -> dict[str, Any]:
    """The parts of an entry's key (JSON-able; stored in its meta.json). `tokenizer_key`: the tokenizer's digest
    when the caller knows it (`loaded_tokenizer_digest`), else `tokenizer_digest(tokenizer)`. `max_prompt`: the
    prompt bound, a part only when set."""
    bound = {} if max_prompt is None else {"max_prompt_len": max_prompt}
    return {"data": data, "tokenizer": tokenizer_key or tokenizer_digest(tokenizer), "layout": layout,
            "seq_len": seq_len, **bound, "cache_version": CACHE_VERSION, "store_version": STORE_VERSION}


def key_name(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def tokens_digest(data: TokenizedData) -> str:
    """`sha256:HEX` of the store's `starts`, `ids` and `trained` (each after a line naming it, its dtype and
    length), read a chunk of the memory-mapped arrays at a time."""
    digest = hashlib.sha256()
    for name, array, dtype in (("starts", data.starts, "<i8"), ("ids", data.ids, "<i4"),
                               ("trained", data.trained, "|b1")):
        digest.update(f"{name} {dtype} {len(array)}\n".encode())
        step = max(1, HASH_CHUNK_BYTES // np.dtype(dtype).itemsize)
        for lo in range(0, len(array), step):
            digest.update(np.ascontiguousarray(array[lo:lo + step], dtype))
    return f"sha256:{digest.hexdigest()}"


@dataclasses.dataclass(frozen=True)
class CachedData:
    data: TokenizedData
    hit: bool  # the entry existed (built earlier, or by another process while this one waited)
    directory: Path
    digest: str  # tokens_digest(data)
    key: dict[str, Any]  # the parts of the entry's key


def cached_tokenization(root: str | Path, parts: dict[str, Any], build: Callable[[Path], Any]) -> CachedData:
    """The entry for key `parts` under `root`, built by `build(directory)` (which writes a store into the empty
    `directory`) when there is none. DataError naming `root` when it cannot be created or written."""
    root = Path(root)
    entry = root / key_name(parts)
    with entry_lock(root, entry.name):
        try:
            data = TokenizedData.open(entry)
        except ValueError:  # none yet, or one that is not whole (replaced below)
            pass
        else:
            return CachedData(data, True, entry, _stored_digest(data), parts)
        with atomic_directory(entry, "building") as directory:
            build(directory)
            _write_digest(directory, tokens_digest(TokenizedData.open(directory)))  # no whole store, no entry
        data = TokenizedData.open(entry)
        return CachedData(data, False, entry, _stored_digest(data), parts)


def _stored_digest(data: TokenizedData) -> str:
    """The entry's digest.json; computed now for an entry that has none (the caller holds the entry's lock)."""
    try:
        digest = json.loads((data.directory / DIGEST_FILE).read_text())["digest"]
        if isinstance(digest, str) and digest.startswith("sha256:"):
            return digest
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = tokens_digest(data)
    _write_digest(data.directory, digest)
    return digest


def _write_digest(directory: Path, digest: str) -> None:
    path, tmp = directory / DIGEST_FILE, directory / f".{DIGEST_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"digest": digest}) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"{path}: cannot write the tokenized data's digest ({e.strerror or e}); choose another "
                        "directory with --data-cache") from None


def load_tokenized(source, tokenizer, seq_len: int | None, layout: str, *, cache: str | None = None,
                   workers: int = 0, progress: bool = False, tokenizer_key: str | None = None,
                   max_prompt: int | None = None) -> CachedData:
    """`source`'s rows (a finetune.data.sources.DataSource) tokenized with `layout` (and prompts bounded to
    `max_prompt` tokens): the cached store, or one built now with `workers` processes (0: one per core, fewer
    for little data) and a progress bar. `tokenizer_key`: see `cache_key`."""
    parts = cache_key(source.fingerprint(), tokenizer, layout, seq_len, tokenizer_key, max_prompt)

    def build(directory: Path) -> None:
        tokenize_to_store(source.dataset, tokenizer, seq_len, directory, layout=layout, where=source.where,
                          workers=default_workers(workers, len(source)), progress=progress, meta={"key": parts},
                          max_prompt=max_prompt)

    return cached_tokenization(cache_root(cache), parts, build)


@contextmanager
def entry_lock(root: Path, name: str) -> Iterator[None]:
    """Exclusive, across processes and hosts sharing `root`: held while entry `name` is built, or while a file is
    added beside its store (its digest, `finetune.data.reference_logps`)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{name}.lock", "a")
    except OSError as e:
        raise DataError(f"{root}: cannot create or write the tokenized-data cache here ({e.strerror or e}); "
                        "choose another directory with --data-cache") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or when this process dies
        yield
