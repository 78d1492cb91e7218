"""The converted checkpoint format: its layout, manifest, per-slice checksums, and verification.

Layout (docs/design.md, "Checkpoint format"):

    config.json                  the HF config, verbatim (plus generation/tokenizer files)
    jax_checkpoint.json          manifest: format, version, and per parameter its file, shape, dtype, crc32s
    params/<path>.safetensors    one tensor per parameter, named by its NNX path (`layers.mlp.up_proj.weight`),
                                 torch layout; per-layer parameters stacked on a leading [layers] axis

Each stacked parameter records one crc32 per layer slice, so a writer (`checkpoint_writer.py`) can fill
slices in any order and a reader can check exactly what it read.

A quantized checkpoint (version 2) also records `"quantization": {"scheme": ..., "block": ...}` and holds
each projection as `<module>.codes` and `<module>.scales` (`jaxmodel.quantization`) instead of
`<module>.weight`. Unquantized checkpoints stay version 1, so readers that predate quantization keep
reading them and refuse a quantized one by its version rather than by a missing tensor.

The manifest may also record where the weights came from, `"source"` (`checkpoint_source`): `{"hub_id", "revision"}`
for a hub id (the commit of the snapshot converted) or `{"path"}` (the HF directory, absolute), both with
`"config_sha256"` and `"converter_version"`. It is optional and adds no version: checkpoints converted before it
have none, and readers that predate it ignore it.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodel.config import ModelConfig
from jaxmodel.errors import UserError
from jaxmodel.formats.io import ShortFileError, crc32_of_range, read_json
from jaxmodel.formats.safetensors_file import DTYPES, SafetensorsError, TensorLocation, read_header
from jaxmodel.model import CausalLM
from jaxmodel.quantization import FP8, Quantization
MANIFEST = "jax_checkpoint.json"
FORMAT = "jaxmodel-safetensors"
FORMAT_VERSION = 1  # unquantized
QUANTIZED_FORMAT_VERSION = 2  # with "quantization" and codes/scales tensors
DTYPES_BY_NAME = {dtype.name: dtype for dtype in DTYPES.values()}


class CheckpointError(ValueError, UserError):
    """A directory that is not a complete converted checkpoint; the message names the file and what is wrong."""


def param_specs(config: ModelConfig, param_dtype=jnp.float32,
                quantization: Quantization | None = None) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Every parameter of the model for `config`: NNX path -> (shape, logical axes). No weights are made."""
    abstract = nnx.eval_shape(lambda: CausalLM(config, param_dtype=param_dtype, quantization=quantization,
                                                       rngs=nnx.Rngs(0)))
    return {
        ".".join(map(str, path)): (tuple(var.shape), var.get_metadata()["axes"])
        for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    }


class Piece(NamedTuple):
    """A HF tensor (`hf_checkpoint.SourceTensor`) and where its values start in its slice, in elements: 0 for a
    tensor that is the whole slice, an expert's part's first element for an expert's tensor, whose `part` is then
    (expert, first row, rows) of the slice's `[e, out, in]`. An FP8 tensor's `scales` are its `weight_scale_inv`
    tensor and their first element in the slice of the parameter's `.scales` (`jaxmodel.quantization`)."""

    tensor: object
    offset: int
    part: tuple[int, int, int] | None = None
    scales: tuple[object, int] | None = None


FP8_SCALES = "weight_scale_inv"  # the hub's name of an FP8 weight's block scales, beside `weight`


def hf_tensors_by_param(config: ModelConfig, tensors, source_dir: Path, error: type[Exception],
                        fp8_block: int | None = None) -> dict[str, dict]:
    """An HF checkpoint's tensors by NNX path and slice (0 for an unstacked parameter), each slice's `Piece`s in
    order, checked against `config`: every tensor a parameter (or an expert's part) of its shape (known extras such
    as rotary caches, a multimodal model's vision tower and the layers past the model's that predict further tokens
    skipped, a tied model's stored head dropped) and every slice filled exactly once, by one tensor or by each of its
    experts' parts; `error(message)` else. With `fp8_block`, an FP8 checkpoint's: each FP8 weight with its scales
    (blocks of `fp8_block` squared), in its piece."""
    from jaxmodel.formats.hf_names import IGNORED, names_of

    expected = param_specs(config)
    names = names_of(config)
    by_path: dict[str, dict[int, list[Piece]]] = {}
    scales: dict[str, object] = {}  # weight name -> its scales tensor
    for t in tensors:
        if config.prediction_layers and in_prediction_layer(config, t.name):
            continue
        found = names.locate(t.name)
        if found is None:
            if IGNORED.fullmatch(t.name) or names.is_other(t.name):
                continue
            raise error(f"{t.file}: unexpected tensor '{t.name}' (not part of a {config.model_type} checkpoint)")
        if found.path.endswith("." + FP8_SCALES):
            if fp8_block is None:
                raise error(f"{t.file}: tensor '{t.name}' holds FP8 scales, but config.json has no fp8 "
                            "'quantization_config'")
            scales[t.name.removesuffix("_scale_inv")] = t
            continue
        path, layer = found.path, found.layer
        if path not in expected:
            if path == "lm_head.weight" and config.tie_word_embeddings:
                continue  # a tied checkpoint that also stores the head: the embedding is the head
            raise error(f"{t.file}: tensor '{t.name}' does not belong to the model config.json describes")
        shape, _ = expected[path]
        slice_shape = shape[1:] if layer is not None else shape
        if layer is not None and (found.hf_layer >= config.num_hidden_layers or layer >= shape[0]):
            raise error(f"{t.file}: tensor '{t.name}' is beyond num_hidden_layers={config.num_hidden_layers}")
        offset, part = 0, None
        if found.expert is not None:  # one expert's rows of the [e, out, in] slice
            experts, rows, cols = slice_shape
            if found.expert >= experts:
                raise error(f"{t.file}: tensor '{t.name}' is beyond the {experts} experts config.json implies")
            slice_shape = (rows // found.parts, cols)
            part = (found.expert, found.part * slice_shape[0], slice_shape[0])
            offset = (found.expert * rows + part[1]) * cols
        if tuple(t.shape) != tuple(slice_shape):
            raise error(f"{t.file}: tensor '{t.name}' has shape {list(t.shape)}, config.json implies {list(slice_shape)}")
        by_path.setdefault(path, {}).setdefault(layer or 0, []).append(Piece(t, offset, part))
    if fp8_block is not None:
        _pair_fp8_scales(by_path, scales, expected, fp8_block, source_dir, error)
    for path, (shape, _) in expected.items():
        stacked = names.is_stacked(path)
        for index in range(shape[0] if stacked else 1):
            pieces = sorted(by_path.get(path, {}).get(index, []), key=lambda p: p.offset)
            size = math.prod(shape[1:] if stacked else shape)
            if not pieces:
                name = names.jax_to_hf(path, index if stacked else None)
                if names.expert_tensors(path):
                    name = names.expert_name(names.expert_tensors(path)[0], index, 0)
                raise error(f"{source_dir}: missing tensor '{name}', which config.json implies")
            ends = [p.offset + math.prod(p.tensor.shape) for p in pieces]
            gap = next((k for k, p in enumerate(pieces) if p.offset != (ends[k - 1] if k else 0)), None)
            if gap is not None or ends[-1] != size:  # an expert's part missing, or given twice
                twice = gap is not None and pieces[gap].offset < ends[gap - 1]
                if twice:
                    raise error(f"{source_dir}: tensors '{pieces[gap - 1].tensor.name}' and "
                                f"'{pieces[gap].tensor.name}' both hold part of '{path}' [{index}]")
                raise error(f"{source_dir}: missing tensor '{_missing_part(names, path, index, shape, pieces)}', "
                            "which config.json implies")
            by_path[path][index] = pieces
    return by_path


def in_prediction_layer(config: ModelConfig, name: str) -> bool:
    """Whether tensor `name` belongs to a layer past the model's last (DeepSeek-V3's multi-token prediction, which
    transformers does not load either)."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    return found is not None and 0 <= int(found[1]) - config.num_hidden_layers < config.prediction_layers


def _pair_fp8_scales(by_path: dict, scales: dict, expected: dict, block: int, source_dir: Path,
                     error: type[Exception]) -> None:
    """Give each FP8 weight's piece its scales (`Piece.scales`), checked: shaped as its blocks, whole blocks of an
    expert's part; `error(message)` for FP8 weights without scales and scales without an FP8 weight."""
    for path, layers in by_path.items():
        for index, pieces in layers.items():
            for k, piece in enumerate(pieces):
                t = piece.tensor
                found = scales.pop(t.name, None)
                if t.dtype != FP8:
                    if found is not None:
                        raise error(f"{found.file}: tensor '{found.name}' holds FP8 scales of '{t.name}', which is "
                                    f"{t.dtype}, not FP8")
                    continue
                if found is None:
                    raise error(f"{source_dir}: missing tensor '{t.name}_scale_inv', the scales of FP8 '{t.name}'")
                *_, rows, cols = t.shape
                want = (-(-rows // block), -(-cols // block))
                if tuple(found.shape) != want:
                    raise error(f"{found.file}: tensor '{found.name}' has shape {list(found.shape)}; '{t.name}' "
                                f"{list(t.shape)} in blocks of {block} x {block} implies {list(want)}")
                pieces[k] = piece._replace(scales=(found, fp8_scales_offset(piece, expected[path][0], block)))
    for name, t in scales.items():
        raise error(f"{t.file}: tensor '{t.name}' holds FP8 scales of '{name}', which the checkpoint lacks")


def fp8_scales_offset(piece: Piece, shape, block: int) -> int:
    """Where `piece`'s FP8 scales start in its slice of the parameter's `.scales` (the parameter `shape`), in elements
    (a fused expert weight's parts are whole blocks: the converter checks it)."""
    if piece.part is None:
        return 0
    expert, first, _ = piece.part
    slice_rows, cols = shape[-2:]
    return (expert * -(-slice_rows // block) + first // block) * -(-cols // block)


def _missing_part(names, path: str, index: int, shape, pieces: list[Piece]) -> str:
    """The hub name of the first expert's part of slice `index` of `path` that no piece holds."""
    experts, rows, cols = shape[1:]
    held = {p.offset for p in pieces}
    for expert in range(experts):
        for row in names.expert_tensors(path):
            if (expert * rows + row.part * rows // row.parts) * cols not in held:
                return names.expert_name(row, index, expert)
    return names.jax_to_hf(path, index)


def file_for(path: str) -> str:
    return f"params/{path}.safetensors"


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a converted checkpoint (no {MANIFEST}; run convert-llama first)")
    manifest = read_json(path, CheckpointError)
    versions = (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION)
    if manifest.get("format") != FORMAT or manifest.get("version") not in versions:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} v{manifest.get('version')}, expected "
                              f"{FORMAT!r} v{FORMAT_VERSION} or v{QUANTIZED_FORMAT_VERSION}")
    checkpoint_quantization(manifest, path)
    checkpoint_source(manifest, path)
    return manifest


SOURCE_FIELDS = ("hub_id", "revision", "path", "config_sha256", "converter_version")


def checkpoint_source(manifest: Mapping, path: str | Path = MANIFEST) -> dict | None:
    """The HF checkpoint a manifest records it was converted from (None when it records none: an older
    conversion); CheckpointError naming `path` if malformed."""
    return check_source(manifest.get("source"), f"{path}: 'source'", CheckpointError)


def check_source(source, where: str, error: type[Exception]) -> dict | None:
    """`source` (None, or an object naming a hub id or a path, `SOURCE_FIELDS` as strings) checked; `error(message)`
    naming `where` otherwise."""
    if source is None:
        return None
    if not isinstance(source, dict) or not all(isinstance(v, str) for v in source.values()) or \
            ("hub_id" in source) == ("path" in source):
        raise error(f"{where}: expected {{\"hub_id\": ..., \"revision\": ...}} or {{\"path\": ...}} with string "
                    f"values, found {source!r}")
    return dict(source)


def source_reference(source: Mapping) -> tuple[str, str | None]:
    """(what `from_pretrained` takes, the revision) for a recorded source: the hub id and its commit, or the
    HF directory's path and None."""
    if "hub_id" in source:
        return source["hub_id"], source.get("revision")
    return source["path"], None


def checkpoint_quantization(manifest: Mapping, path: str | Path = MANIFEST) -> Quantization | None:
    """The quantization a manifest records (None for version 1); CheckpointError naming `path` if malformed."""
    entry = manifest.get("quantization")
    if manifest.get("version") == FORMAT_VERSION:
        if entry is not None:
            raise CheckpointError(f"{path}: 'quantization' needs version {QUANTIZED_FORMAT_VERSION}, found version 1")
        return None
    if not isinstance(entry, dict) or set(entry) != {"scheme", "block"}:
        raise CheckpointError(f"{path}: 'quantization' should be {{\"scheme\": ..., \"block\": ...}}, found {entry!r}")
    try:
        return Quantization(entry["scheme"], entry["block"])
    except ValueError as e:
        raise CheckpointError(f"{path}: 'quantization': {e}") from None


def manifest_version(quantization: Quantization | None) -> int:
    """The format version a checkpoint with `quantization` is written as."""
    return FORMAT_VERSION if quantization is None else QUANTIZED_FORMAT_VERSION


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
                try:
                    actual = crc32_of_range(fd, loc.offset + index * step, step)
                except ShortFileError as e:
                    raise CheckpointError(f"{file}: {e}") from None
                if actual != expected:
                    where = f" layer {index}" if entry.get("stacked") else ""
                    raise CheckpointError(f"{file}: checksum mismatch in '{path}'{where}")
        finally:
            os.close(fd)
        checked += loc.nbytes
    return checked


