"""The tokenized-data cache: one TokenizedData store per (data, tokenizer, layout, seq_len, version), reused by
reruns, resumes and other runs on the same data.

The key hashes the data's fingerprint (each file's path, size and mtime, or a cached dataset's fingerprint),
what decides how the tokenizer tokenizes (its whole serialized pipeline: vocabulary, merges, added and special
tokens, normalizer, pre-tokenizer; its chat template; BOS and EOS; whether special tokens are split), the
row layout, the sequence length (a long row is tokenized only as far as it needs) and CACHE_VERSION. An entry
is built in a temporary sibling directory and renamed into place with its `meta.json` written last, so a
half-written entry is never used; the temporaries of a build that was killed are removed by the next build of
that key. An exclusive lock (`flock` on `KEY.lock`) per key makes processes sharing the directory build an
entry once: the others wait, then reuse it.
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

from finetune.data import DataError
from finetune.tokenization import STORE_VERSION, TokenizedData, default_workers, tokenize_to_store
from jaxmodel.formats.atomic import atomic_directory

# Raised whenever what a stored entry holds for the same key would differ (tokenization or store format).
CACHE_VERSION = 1


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
    digest.update(json.dumps({"chat_template": getattr(tokenizer, "chat_template", None),
                              "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                              "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))},
                             sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(data: dict[str, Any], tokenizer, layout: str, seq_len: int | None) -> dict[str, Any]:
    """The parts of an entry's key (JSON-able; stored in its meta.json)."""
    return {"data": data, "tokenizer": tokenizer_digest(tokenizer), "layout": layout, "seq_len": seq_len,
            "cache_version": CACHE_VERSION, "store_version": STORE_VERSION}


def key_name(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class CachedData:
    data: TokenizedData
    hit: bool  # the entry existed (built earlier, or by another process while this one waited)
    directory: Path


def cached_tokenization(root: str | Path, parts: dict[str, Any], build: Callable[[Path], Any]) -> CachedData:
    """The entry for key `parts` under `root`, built by `build(directory)` (which writes a store into the empty
    `directory`) when there is none. DataError naming `root` when it cannot be created or written."""
    root = Path(root)
    entry = root / key_name(parts)
    with _locked(root, entry.name):
        try:
            return CachedData(TokenizedData.open(entry), True, entry)
        except ValueError:  # none yet, or one that is not whole (replaced below)
            pass
        with atomic_directory(entry, "building") as directory:
            build(directory)
            TokenizedData.open(directory)  # a build that did not finish its store leaves no entry
        return CachedData(TokenizedData.open(entry), False, entry)


def load_tokenized(source, tokenizer, seq_len: int | None, layout: str, *, cache: str | None = None,
                   workers: int = 0, progress: bool = False) -> CachedData:
    """`source`'s rows (a finetune.data_sources.DataSource) tokenized with `layout`: the cached store, or one
    built now with `workers` processes (0: one per core, fewer for little data) and a progress bar."""
    parts = cache_key(source.fingerprint(), tokenizer, layout, seq_len)

    def build(directory: Path) -> None:
        tokenize_to_store(source.dataset, tokenizer, seq_len, directory, layout=layout, where=source.where,
                          workers=default_workers(workers, len(source)), progress=progress, meta={"key": parts})

    return cached_tokenization(cache_root(cache), parts, build)


@contextmanager
def _locked(root: Path, name: str) -> Iterator[None]:
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{name}.lock", "a")
    except OSError as e:
        raise DataError(f"{root}: cannot create or write the tokenized-data cache here ({e.strerror or e}); "
                        "choose another directory with --data-cache") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or when this process dies
        yield
