"""The precomputed reference of a preference run (`--precompute-reference`): the reference model's log-probability
of each sequence of a tokenized store, kept in the store's cache entry beside it.

Values: float32 `[examples]`, example e's sum over its trained positions within `--seq-len` of log p(target) under
the reference model (NaN for an example not computed: one of a pair that trains nothing within `--seq-len`). They
depend on the tokens, on `--seq-len` (where a sequence is cut), on the model (its manifest, which holds a crc32 of
every weight slice and the quantization, and its config), on the reference (`--reference`: base, or init and then
the initial adapter's files), and on `--dtype` and `--param-dtype`: all of it is the key, with `--max-prompt-len`
when set (the tokens' digest already tells bounded prompts apart; a key without a bound stays as it was). A file
`reference-KEY.npy` holds the values and `reference-KEY.json` the key's parts; written under the entry's lock with
the JSON last, so values are read only once whole, and a key that changed in any part names another file. Nothing
of the store itself changes (its digest stays the tokens').
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from finetune.config import TrainConfig
from finetune.data.cache import entry_lock, hash_files, key_name
from finetune.data.rows import DataError

# Raised whenever the values stored for the same key would differ (how they are computed or laid out).
REFERENCE_VERSION = 1
MODEL_FILES = ("config.json", "jax_checkpoint.json")


def reference_key(config: TrainConfig, tokens_digest: str) -> dict[str, Any]:
    """The parts of the key of the reference values of a store whose tokens have `tokens_digest`, for `config`'s
    run (a dpo/ipo objective)."""
    reference = config.reference_model()
    if reference is None:
        raise ValueError(f"--objective {config.objective} has no reference model")
    model = Path(config.model)
    return {"tokens": tokens_digest, "seq_len": config.seq_len, "model": _files_digest(model, MODEL_FILES),
            "reference": reference,
            "init_adapter": _files_digest(Path(config.init_adapter)) if reference == "init" else None,
            "dtype": config.dtype, "param_dtype": config.param_dtype, "version": REFERENCE_VERSION,
            **({"max_prompt_len": config.max_prompt_len} if config.max_prompt_len else {})}


def _files_digest(directory: Path, names: tuple[str, ...] | None = None) -> str:
    """sha256 of the named files of `directory` (default: every regular file at its top), names and contents."""
    paths = sorted(directory / n for n in names) if names else sorted(p for p in directory.iterdir() if p.is_file())
    digest = hashlib.sha256()
    hash_files(digest, paths)
    return f"sha256:{digest.hexdigest()}"


def _paths(entry: Path, key: dict[str, Any]) -> tuple[Path, Path]:
    name = key_name(key)
    return entry / f"reference-{name}.npy", entry / f"reference-{name}.json"


def load_reference(entry: str | Path, key: dict[str, Any], examples: int) -> np.ndarray | None:
    """The values stored in cache entry `entry` for `key` (float32 [examples]), or None when there are none
    whole for exactly that key."""
    values_path, key_path = _paths(Path(entry), key)
    try:
        if json.loads(key_path.read_text()) != key:
            return None
        values = np.load(values_path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if values.dtype != np.float32 or values.shape != (examples,):
        return None
    return values


def store_reference(entry: str | Path, key: dict[str, Any], values: np.ndarray) -> None:
    """Keep `values` in cache entry `entry` under `key`, replacing any stored for it; DataError naming the file
    when it cannot be written."""
    entry = Path(entry)
    values_path, key_path = _paths(entry, key)
    suffix = f".tmp-{os.getpid()}"
    with entry_lock(entry.parent, entry.name):
        try:
            key_path.unlink(missing_ok=True)  # no key, no values: a reader never pairs this key with half a file
            with open(values_path.with_name(values_path.name + suffix), "wb") as f:
                np.save(f, np.asarray(values, np.float32), allow_pickle=False)
            os.replace(values_path.with_name(values_path.name + suffix), values_path)
            key_path.with_name(key_path.name + suffix).write_text(json.dumps(key, sort_keys=True) + "\n")
            os.replace(key_path.with_name(key_path.name + suffix), key_path)
        except OSError as e:
            for path in (values_path, key_path):
                path.with_name(path.name + suffix).unlink(missing_ok=True)
            raise DataError(f"{values_path}: cannot store the reference's log-probabilities "
                            f"({e.strerror or e}); choose another directory with --data-cache") from None
