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

import errno
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Mapping

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
_CHUNK = 64 << 20
DTYPES_BY_NAME = {dtype.name: dtype for dtype in DTYPES.values()}


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
        self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="crc32")
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

    def copy_slice(self, path: str, index: int, src_fd: int, src_offset: int) -> int:
        """Write slice `index` of `path` from the bytes at `src_offset` of another open file, unchanged.

        The kernel copies (`copy_file_range`, as fast as `cp`) while a second thread checksums the same
        bytes from the page cache; where the kernel cannot copy between these files, chunks go through
        user space instead. Returns the bytes written.
        """
        nbytes = self.slice_nbytes(path)
        crc = self._checksummer.submit(_crc32_of_range, src_fd, src_offset, nbytes)
        dst_fd, dst_offset = self._fds[path], self._locations[path].offset + index * nbytes
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
            _copy_through_user_space(src_fd, src_offset, dst_fd, dst_offset, nbytes)
        self._entries[path]["crc32"][index] = crc.result()
        return nbytes

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
        self._checksummer.shutdown()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _read_chunks(fd: int, offset: int, nbytes: int) -> Iterator[memoryview]:
    """The `nbytes` at `offset` of an open file, in chunks of one reused buffer (no memory mapping, so
    reading a 200 GB file does not grow the process's RSS)."""
    buffer = memoryview(bytearray(max(1, min(nbytes, _CHUNK))))
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [buffer[: min(len(buffer), nbytes - done)]], offset + done)
        if n == 0:
            raise CheckpointError(f"file ended {nbytes - done} bytes before the expected end")
        yield buffer[:n]
        done += n


def _crc32_of_range(fd: int, offset: int, nbytes: int) -> int:
    crc = 0
    for chunk in _read_chunks(fd, offset, nbytes):
        crc = zlib.crc32(chunk, crc)
    return crc


def _copy_through_user_space(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int) -> None:
    for chunk in _read_chunks(src_fd, src_offset, nbytes):
        written = 0
        while written < len(chunk):
            written += os.pwrite(dst_fd, chunk[written:], dst_offset + written)
        dst_offset += len(chunk)


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


def _locate(directory: Path, path: str, entry: Mapping) -> tuple[Path, TensorLocation]:
    """The file and byte range of one stored parameter, checked against its manifest entry."""
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
    return file, loc


def open_tensor(directory: Path, path: str, entry: Mapping) -> np.memmap:
    """A read-only memory map of one stored parameter."""
    file, loc = _locate(directory, path, entry)
    return np.memmap(file, dtype=loc.dtype, mode="r", offset=loc.offset, shape=loc.shape)


def verify_checkpoint(directory: str | Path) -> int:
    """Re-read every stored byte and check it against the manifest's crc32s; returns bytes checked."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    checked = 0
    for path, entry in manifest["tensors"].items():
        file, loc = _locate(directory, path, entry)
        step = loc.nbytes // len(entry["crc32"])
        fd = os.open(file, os.O_RDONLY)
        try:
            for index, expected in enumerate(entry["crc32"]):
                if _crc32_of_range(fd, loc.offset + index * step, step) != expected:
                    where = f" layer {index}" if entry.get("stacked") else ""
                    raise CheckpointError(f"{file}: checksum mismatch in '{path}'{where}")
        finally:
            os.close(fd)
        checked += loc.nbytes
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
                                                       remat=remat, rules=rules, rngs=nnx.Rngs(0)))
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


def _place(stored: np.memmap, dtype: np.dtype, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(np.asarray(stored).astype(dtype, copy=False))
    # Called once per addressable device with that device's index: only those bytes are read.
    return jax.make_array_from_callback(
        stored.shape, sharding, lambda index: np.ascontiguousarray(stored[index]).astype(dtype, copy=False)
    )
