"""This port's checkpoint directory: write it slice by slice, verify it, load it onto a mesh.

Layout (docs/design.md, "Checkpoint format"):

    config.json                  the HF config, verbatim (plus generation/tokenizer files)
    jax_checkpoint.json          manifest: format, and per parameter its file, shape, dtype, crc32s
    params/<path>.safetensors    one tensor per parameter, named by its NNX path (`layers.mlp.up_proj.weight`),
                                 torch layout; per-layer parameters stacked on a leading [layers] axis

Each stacked parameter records one crc32 per layer slice, so a writer can fill slices in any order and a
reader can check exactly what it read.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodel.config import LlamaConfig
from jaxmodel.model import LlamaForCausalLM
from jaxmodel.safetensors_file import DTYPES, SafetensorsError, TensorLocation, read_header, write_header
from jaxmodel.sharding import DEFAULT_RULES, Rules, named_sharding

MANIFEST = "jax_checkpoint.json"
FORMAT = "jaxmodel-safetensors"
FORMAT_VERSION = 1
_VERIFY_CHUNK = 64 << 20


class CheckpointError(ValueError):
    """A directory that is not a complete converted checkpoint; the message names the file and what is wrong."""


def param_specs(config: LlamaConfig, param_dtype=jnp.float32) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Every parameter of the model for `config`: NNX path -> (shape, logical axes). No weights are made."""
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
    return {
        ".".join(map(str, path)): (tuple(var.shape), var.get_metadata()["axes"])
        for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    }


def _file_for(path: str) -> str:
    return f"params/{path}.safetensors"


class CheckpointWriter:
    """Creates every parameter file up front (header written, data region sized), then takes slices.

    `slices` of a parameter is its leading-axis length for stacked parameters, else 1.
    """

    def __init__(self, directory: Path, tensors: Mapping[str, tuple[tuple[int, ...], np.dtype, bool]]):
        self.directory = directory
        (directory / "params").mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, dict] = {}
        self._fds: dict[str, int] = {}
        self._locations: dict[str, TensorLocation] = {}
        for path, (shape, dtype, stacked) in tensors.items():
            fd = os.open(directory / _file_for(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[path] = fd
            self._locations[path] = write_header(fd, [(path, np.dtype(dtype), shape)], {"format": "np"})[path]
            n = shape[0] if stacked else 1
            self._entries[path] = {"file": _file_for(path), "shape": list(shape), "dtype": np.dtype(dtype).name,
                                   "stacked": stacked, "crc32": [None] * n}

    def slice_nbytes(self, path: str) -> int:
        entry = self._entries[path]
        return self._locations[path].nbytes // len(entry["crc32"])

    def write_slice(self, path: str, index: int, chunks: Iterable[memoryview | bytes]) -> int:
        """Write slice `index` of `path` from `chunks` (in order); returns the bytes written."""
        expected = self.slice_nbytes(path)
        fd, offset = self._fds[path], self._locations[path].offset + index * expected
        written, crc = 0, 0
        for chunk in chunks:
            n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
            if written + n > expected:
                raise CheckpointError(f"{path}[{index}]: more than the {expected} bytes its shape holds")
            done = 0
            while done < n:  # pwrite may write less than asked
                done += os.pwrite(fd, chunk[done:], offset + written + done)
            crc = zlib.crc32(chunk, crc)
            written += n
        if written != expected:
            raise CheckpointError(f"{path}[{index}]: got {written} bytes, its shape holds {expected}")
        self._entries[path]["crc32"][index] = crc
        return written

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
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, **(info or {}),
                    "tensors": dict(sorted(self._entries.items()))}
        (self.directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a converted checkpoint (no {MANIFEST}; run convert-llama first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} v{manifest.get('version')}, expected {FORMAT!r} v{FORMAT_VERSION}"
        )
    return manifest


def open_tensor(directory: Path, path: str, entry: Mapping) -> np.memmap:
    """A read-only memory map of one stored parameter, checked against its manifest entry."""
    file = directory / entry["file"]
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (listed in {MANIFEST} for '{path}')")
    try:
        locations, _ = read_header(file)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
    loc = locations.get(path)
    if loc is None or list(loc.shape) != list(entry["shape"]) or loc.dtype.name != entry["dtype"]:
        raise CheckpointError(f"{file}: does not hold '{path}' as {entry['dtype']}{entry['shape']}")
    return np.memmap(file, dtype=loc.dtype, mode="r", offset=loc.offset, shape=loc.shape)


def verify_checkpoint(directory: str | Path) -> int:
    """Re-read every stored byte and check it against the manifest's crc32s; returns bytes checked."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    checked = 0
    for path, entry in manifest["tensors"].items():
        flat = open_tensor(directory, path, entry).reshape(-1).view(np.uint8)
        slices = len(entry["crc32"])
        step = flat.size // slices
        for index, expected in enumerate(entry["crc32"]):
            crc = 0
            for start in range(index * step, (index + 1) * step, _VERIFY_CHUNK):
                crc = zlib.crc32(flat[start:min(start + _VERIFY_CHUNK, (index + 1) * step)], crc)
            if crc != expected:
                where = f" layer {index}" if entry.get("stacked") else ""
                raise CheckpointError(f"{directory / entry['file']}: checksum mismatch in '{path}'{where}")
        checked += flat.size
    return checked


def load_pretrained(path: str | Path, *, mesh: jax.sharding.Mesh | None = None, dtype=None, param_dtype=None,
                    rules: Rules = DEFAULT_RULES, remat: str = "none") -> LlamaForCausalLM:
    """Build the model from a converted checkpoint.

    With a mesh, each parameter is placed straight onto its sharding (from its logical axes and `rules`)
    and each process reads only the bytes of the shards its devices hold. `param_dtype` casts the stored
    weights (default: as stored); `dtype` is the compute dtype (default: the embedding's dtype).
    """
    directory = Path(path)
    config = LlamaConfig.from_hf(directory)
    manifest = read_manifest(directory)
    stored = manifest["tensors"]
    if dtype is None:
        dtype = param_dtype or DTYPES_BY_NAME[stored.get("embed_tokens.weight", {}).get("dtype", "float32")]
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=dtype, param_dtype=param_dtype or dtype,
                                                       remat=remat, rngs=nnx.Rngs(0)))
    for names, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name = ".".join(map(str, names))
        entry = stored.get(name)
        if entry is None:
            raise CheckpointError(f"{directory / MANIFEST}: no tensor '{name}', which config.json implies")
        if tuple(entry["shape"]) != tuple(var.shape):
            raise CheckpointError(
                f"{directory / MANIFEST}: '{name}' has shape {entry['shape']}, config.json implies {list(var.shape)}"
            )
        stored_array = open_tensor(directory, name, entry)
        target = np.dtype(param_dtype) if param_dtype is not None else stored_array.dtype
        var.set_value(_place(stored_array, target, None if mesh is None else
                           named_sharding(var.get_metadata()["axes"], var.shape, mesh, rules)))
    return abstract


DTYPES_BY_NAME = {dtype.name: dtype for dtype in DTYPES.values()}


def _place(stored: np.memmap, dtype: np.dtype, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(np.asarray(stored).astype(dtype, copy=False))
    # Called once per addressable device with that device's index: only those bytes are read.
    return jax.make_array_from_callback(
        stored.shape, sharding, lambda index: np.ascontiguousarray(stored[index]).astype(dtype, copy=False)
    )
