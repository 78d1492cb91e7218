"""The HuggingFace checkpoint directory: its weight files (safetensors, single or sharded with an index, or
torch `.bin`), the auxiliary files beside them, and reading it tensor by tensor.

A source lists its tensors (name, dtype, shape, file) from headers alone, then streams each tensor's
bytes in bounded chunks, one file at a time, so host memory never holds more than a chunk (safetensors)
or one memory-mapped tensor (`.bin`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxmodel.errors import UserError
from jaxmodel.formats.safetensors_file import SafetensorsError, read_header

CHUNK_BYTES = 64 << 20

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
WEIGHT_FILES = (SAFETENSORS_SINGLE, SAFETENSORS_INDEX, BIN_SINGLE, BIN_INDEX)
# Files a HF model directory holds beside its weights (config, generation config, tokenizer, chat template);
# copied along wherever a tool writes a directory meant to serve as the model's home.
AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")


class HFCheckpointError(ValueError, UserError):
    """A HF checkpoint that cannot be read; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    name: str
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int | None  # byte offset in a safetensors file; None for torch pickles


def find_weight_files(directory: Path) -> tuple[str, list[Path], dict[str, str] | None]:
    """The checkpoint's kind ("safetensors" or "bin"), its weight files (checked to exist), and the
    index's name -> shard map when it is sharded."""
    for index_name, single, kind in ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "safetensors"),
                                     (BIN_INDEX, BIN_SINGLE, "bin")):
        index = directory / index_name
        if index.is_file():
            weight_map = _read_index(index)
            return kind, [directory / name for name in sorted(set(weight_map.values()))], weight_map
        if (directory / single).is_file():
            return kind, [directory / single], None
    raise HFCheckpointError(
        f"{directory}: no checkpoint found (expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, "
        f"{BIN_SINGLE} or {BIN_INDEX})"
    )


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = set(weight_map.values())
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise HFCheckpointError(f"{index}: malformed index (expected {{\"weight_map\": {{name: file}}}})") from None
    for name in sorted(shards):
        if not isinstance(name, str) or not (index.parent / name).is_file():
            raise HFCheckpointError(f"{index}: lists shard '{name}', which is missing from {index.parent}")
    return weight_map


def list_tensors(directory: Path) -> tuple[str, list[SourceTensor]]:
    """All tensors of the checkpoint in `directory`, from file headers (no tensor data is read)."""
    kind, files, index_map = find_weight_files(directory)
    tensors: list[SourceTensor] = []
    for file in files:
        tensors.extend(_safetensors_listing(file) if kind == "safetensors" else _bin_listing(file))
    if index_map is not None:
        found = {t.name: t.file.name for t in tensors}
        for name, shard in index_map.items():
            if found.get(name) != shard:
                raise HFCheckpointError(f"{directory / shard}: does not hold '{name}', which the index places there")
    return kind, tensors


def _safetensors_listing(file: Path) -> list[SourceTensor]:
    try:
        locations, _ = read_header(file)
    except SafetensorsError as e:
        raise HFCheckpointError(str(e)) from None
    return [SourceTensor(loc.name, file, loc.dtype, loc.shape, loc.offset)
            for loc in sorted(locations.values(), key=lambda loc: loc.offset)]


def _bin_listing(file: Path) -> list[SourceTensor]:
    state = _torch_load(file)
    return [SourceTensor(name, file, _numpy_dtype(t, file, name), tuple(t.shape), None) for name, t in state.items()]


def iter_chunks(tensor: SourceTensor, handle) -> Iterator[np.ndarray]:
    """The tensor's elements in order, as flat arrays of its dtype, at most CHUNK_BYTES each.

    `handle` comes from `open_file(tensor.file)`.
    """
    per_chunk = max(1, CHUNK_BYTES // tensor.dtype.itemsize)
    count = int(np.prod(tensor.shape))
    if tensor.offset is not None:
        buffer = np.empty(min(per_chunk, count), tensor.dtype)
        for start in range(0, count, per_chunk):
            part = buffer[: min(per_chunk, count - start)]
            view = memoryview(part.view(np.uint8))
            _pread_exact(handle, view, tensor.offset + start * tensor.dtype.itemsize, tensor.file)
            yield part
    else:
        flat = _torch_to_numpy(handle[tensor.name]).reshape(-1)
        for start in range(0, count, per_chunk):
            yield flat[start:start + per_chunk]


def open_file(file: Path, kind: str):
    """A file descriptor (safetensors) or a memory-mapped state dict (`.bin`); close with `close_file`."""
    return os.open(file, os.O_RDONLY) if kind == "safetensors" else _torch_load(file)


def close_file(handle) -> None:
    if isinstance(handle, int):
        os.close(handle)


def _pread_exact(fd: int, view: memoryview, offset: int, file: Path) -> None:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise HFCheckpointError(f"{file}: truncated while reading (file changed during conversion?)")
        done += n


def _torch_load(file: Path) -> dict:
    try:
        import torch
    except ImportError:
        raise HFCheckpointError(
            f"{file}: a PyTorch pickle checkpoint; reading it needs torch (pip install 'llama-jax[torch]'), "
            "or convert from safetensors"
        ) from None
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises several types for a bad pickle or zip
        raise HFCheckpointError(f"{file}: cannot be read as a PyTorch checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise HFCheckpointError(f"{file}: expected a state dict of tensors, found {type(state).__name__}")
    return state


def _numpy_dtype(tensor, file: Path, name: str) -> np.dtype:
    import ml_dtypes
    import torch

    table = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
             torch.float64: np.float64}
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in table:
        raise HFCheckpointError(f"{file}: '{name}' is not a floating-point tensor")
    return np.dtype(table[tensor.dtype])


def _torch_to_numpy(tensor) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
