"""A merged HuggingFace checkpoint: the base with `W + scale * (A B)^T` folded in, as safetensors shards
+ `model.safetensors.index.json` + config and tokenizer files, that `LlamaForCausalLM.from_pretrained` loads.

Streams like the converter: the shard layout is planned from shapes, then each tensor is read from the
converted checkpoint (memory-mapped), merged if adapted, and written at its offset, one at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
from flax import nnx

from jaxmodel.errors import UsageError
from jaxmodel.formats.atomic import atomic_directory
from jaxmodel.formats.checkpoint import DTYPES_BY_NAME, open_tensor, read_manifest
from jaxmodel.formats.hf_checkpoint import AUX_FILES
from jaxmodel.formats.hf_names import is_stacked, jax_to_hf
from jaxmodel.formats.io import pwrite_all
from jaxmodel.formats.safetensors_file import write_header
from jaxmodel.lora import LoraConfig

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `1.5G` or a byte count -> bytes (decimal units, as transformers reads them)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UsageError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or a byte count")
    return int(float(match.group(1)) * 1000 ** " KMGT".index(match.group(2).upper() or " "))


def save_merged(out: str | Path, converted_dir: str | Path, lora: nnx.State, lora_config: LoraConfig, *,
                max_shard_size: int = 5 * 10**9) -> Path:
    """Write the merged model to `out` (atomically); returns `out`."""
    converted_dir, out = Path(converted_dir), Path(out)
    manifest = read_manifest(converted_dir)["tensors"]
    adapters = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(lora)}
    # Every HF tensor: (name, JAX path, layer), in the order HF checkpoints list them.
    tensors = []
    for path, entry in manifest.items():
        layers = range(entry["shape"][0]) if is_stacked(path) else [None]
        tensors += [(jax_to_hf(path, layer), path, layer) for layer in layers]
    tensors.sort(key=lambda t: _hf_order(t[0]))
    shards: list[list[tuple[str, str, int | None]]] = [[]]
    size = 0
    for item in tensors:
        entry = manifest[item[1]]
        nbytes = math.prod(entry["shape"][1:] if item[2] is not None else entry["shape"]) * \
            DTYPES_BY_NAME[entry["dtype"]].itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes

    with atomic_directory(out, "merging") as tmp:
        weight_map, total = {}, 0
        for number, shard in enumerate(shards, 1):
            file = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            total += _write_shard(tmp / file, shard, converted_dir, manifest, adapters, lora_config.scale)
            weight_map.update({name: file for name, _, _ in shard})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        for name in AUX_FILES:
            if (converted_dir / name).is_file():
                shutil.copyfile(converted_dir / name, tmp / name)
    return out


def _write_shard(file: Path, shard, converted_dir: Path, manifest, adapters, scale: float) -> int:
    specs = []
    for name, path, layer in shard:
        entry = manifest[path]
        shape = tuple(entry["shape"][1:] if layer is not None else entry["shape"])
        specs.append((name, DTYPES_BY_NAME[entry["dtype"]], shape))
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        locations = write_header(fd, specs, {"format": "pt"})
        for name, path, layer in shard:
            stored = open_tensor(converted_dir, path, manifest[path])
            weight = np.asarray(stored[layer] if layer is not None else stored)
            module = path.rsplit(".", 1)[0]
            if path.endswith(".weight") and module + ".lora_a" in adapters:
                a, b = adapters[module + ".lora_a"], adapters[module + ".lora_b"]
                a, b = (a[layer], b[layer]) if layer is not None else (a, b)
                merged = weight.astype(np.float32) + scale * (a.astype(np.float32) @ b.astype(np.float32)).T
                weight = merged.astype(weight.dtype)
            pwrite_all(fd, np.ascontiguousarray(weight).view(np.uint8).reshape(-1), locations[name].offset)
        os.fsync(fd)
        return sum(loc.nbytes for loc in locations.values())
    finally:
        os.close(fd)


def _hf_order(name: str) -> tuple:
    """embed_tokens, then layers by number, then norm, then lm_head (the order HF writes)."""
    match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if match:
        return (1, int(match.group(1)), match.group(2))
    return (0 if "embed_tokens" in name else 2 if name.startswith("model.norm") else 3, 0, name)
