"""`convert()`: stream a HuggingFace Llama checkpoint into this port's checkpoint format.

Plan first (headers only: every tensor named, shaped and accounted for before a byte is written), then
copy tensor by tensor into a temporary directory that is renamed into place only when complete. With
`quantize`, the seven projections are quantized chunk by chunk as they stream (`jaxmodel.quantization`).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from converter.errors import ConversionError, ConversionUsageError
from converter.hub import resolve_source, source_record
from jaxmodel.formats.hf_names import names_of
from jaxmodel.formats.hf_checkpoint import (AUX_FILES, HFCheckpointError, SourceTensor, close_file, iter_chunks,
                                            list_tensors, open_file)
from jaxmodel.formats.atomic import atomic_directory
from jaxmodel.formats.checkpoint import (CheckpointError, in_prediction_layer, fp8_scales_offset, hf_tensors_by_param,
                                         param_specs, verify_checkpoint)
from jaxmodel.formats.checkpoint_writer import CheckpointWriter
from jaxmodel.formats.io import read_json
from jaxmodel.formats.markers import CONVERTED_CHECKPOINT, directory_kind
from jaxmodel.formats.output_dir import check_output_dir
from jaxmodel.config import ModelConfig
from jaxmodel.formats.safetensors_file import DTYPES
from jaxmodel.quantization import SCHEMES, Quantization, quantize

DTYPE_CHOICES = {"keep": None, "bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"], "float16": DTYPES["F16"]}
QUANTIZE_CHOICES = SCHEMES


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    out: Path
    tensors: int
    bytes: int
    seconds: float
    skipped: int = 0  # tensors of the layers past the model's last (multi-token prediction)

    def __str__(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9)
        skipped = (f"; skipped the {self.skipped} tensors of the multi-token-prediction layers past num_hidden_layers "
                   "(transformers does not load them either)") if self.skipped else ""
        return (f"converted {self.tensors} tensors, {_human(self.bytes)}B in {self.seconds:.2f} s "
                f"({_human(rate)}B/s) -> {self.out}{skipped}")


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} T"


def convert(src: str | Path, out: str | Path, *, dtype: str = "keep", quantize: str | None = None,
            quant_block: int | None = None, revision: str | None = None, overwrite: bool = False,
            verify: bool = False, progress: bool = True) -> ConversionSummary:
    """Convert the HF Llama checkpoint `src` (directory or hub id) into `out`.

    `dtype`: one of bfloat16, float32, float16, or keep (each tensor as stored); with `quantize` ("nf4" or
    "int8") it applies to the unquantized tensors (embeddings, norms, LM head). `quant_block`: values per
    scale (default 64), only with `quantize`.
    """
    start = time.perf_counter()
    if dtype not in DTYPE_CHOICES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    quantization = _quantization(quantize, quant_block)
    out = Path(out)
    # Before anything is read. A hub id's snapshot in the HF cache is protected by its kind (a HF checkpoint).
    target = _check_destination(out, src if Path(src).expanduser().exists() else None, overwrite)
    source_dir = resolve_source(str(src), revision)
    stored = _source_quantization(source_dir)
    if stored is not None:
        quantization = _kept_quantization(stored, quantization, source_dir)
    config = ModelConfig.from_hf(source_dir)
    kind, tensors = list_tensors(source_dir)
    plan = _plan(config, tensors, source_dir, DTYPE_CHOICES[dtype], quantization, stored)
    source = source_record(src, source_dir)
    try:
        with atomic_directory(target, "converting") as tmp:
            total = _copy(plan, tensors, kind, tmp, progress, source)
            for name in AUX_FILES:
                if (source_dir / name).is_file():
                    shutil.copyfile(source_dir / name, tmp / name)
            if verify:
                verify_checkpoint(tmp)
    except (CheckpointError, HFCheckpointError) as e:  # name the destination, not the temporary directory
        raise ConversionError(re.sub(rf"{re.escape(str(target.parent))}/\.{re.escape(target.name)}\.converting-\d+",
                                     str(out), str(e))) from None
    except OSError as e:  # the disk or filesystem refused: nothing is left at `out`
        raise ConversionError(f"{e.filename or out}: {e.strerror or e}") from None
    return ConversionSummary(out, len(plan.sources), total, time.perf_counter() - start, plan.skipped)


def _quantization(scheme: str | None, block: int | None) -> Quantization | None:
    if scheme is None:
        if block is not None:
            raise ConversionUsageError(f"--quant-block needs --quantize ({', '.join(QUANTIZE_CHOICES)})")
        return None
    if scheme not in QUANTIZE_CHOICES:
        raise ConversionUsageError(f"--quantize {scheme!r}: expected one of {', '.join(QUANTIZE_CHOICES)}")
    try:
        return Quantization(scheme, block)
    except ValueError as e:
        raise ConversionUsageError(f"--quant-block {block}: {e}") from None


def _source_quantization(source_dir: Path) -> Quantization | None:
    """The FP8 blocks an FP8 HF checkpoint stores (None for an unquantized one); ConversionError for a converted
    checkpoint and for any other quantized one."""
    if directory_kind(source_dir) == CONVERTED_CHECKPOINT:
        raise ConversionError(f"--src {source_dir}: a converted checkpoint, not a HF checkpoint (convert-llama reads "
                              f"the HF checkpoint it came from)")
    config_file = source_dir / "config.json"
    raw = read_json(config_file, ConversionError) if config_file.is_file() else {}
    found = raw.get("quantization_config") if isinstance(raw, dict) else None
    if found is None:
        return None
    method = found.get("quant_method", "unknown method") if isinstance(found, dict) else found
    if method != "fp8":
        raise ConversionError(f"{config_file}: 'quantization_config' ({method}): the checkpoint is already quantized; "
                              f"convert-llama needs unquantized or FP8 weights (use --quantize on unquantized ones)")
    blocks, fmt = found.get("weight_block_size"), found.get("fmt", "e4m3")
    if fmt != "e4m3" or not (isinstance(blocks, list) and len(blocks) == 2 and blocks[0] == blocks[1]
                             and isinstance(blocks[0], int) and blocks[0] > 0):
        raise ConversionError(f"{config_file}: 'quantization_config': expected FP8 of fmt \"e4m3\" in square blocks "
                              f"('weight_block_size' [n, n]), found fmt {fmt!r}, weight_block_size {blocks!r}")
    return Quantization("fp8", blocks[0])


def _kept_quantization(stored: Quantization, asked: Quantization | None, source_dir: Path) -> Quantization:
    """An FP8 checkpoint converts as it is: `--quantize` may only name the same."""
    if asked is not None and asked != stored:
        raise ConversionUsageError(f"--quantize {asked.scheme} --quant-block {asked.block}: {source_dir} is FP8 in "
                                   f"blocks of {stored.block}, kept as it is (leave out --quantize)")
    return stored


class _Source(NamedTuple):
    """Where a HF tensor goes: parameter `path` (a quantized one's `.weight` when the tensor is quantized while it
    streams), slice `layer`, `start` elements into it; for an FP8 weight quantized while it streams, where its scales
    start in the `.scales` slice."""

    path: str
    layer: int
    start: int
    quantize: bool = False
    scales_start: int = 0


@dataclasses.dataclass
class _Plan:
    specs: dict[str, tuple[tuple[int, ...], np.dtype, bool]]  # JAX path -> (shape, dtype, stacked)
    sources: dict[str, _Source]  # HF name -> where it goes
    quantization: Quantization | None = None
    skipped: int = 0  # tensors of the layers past the model's (multi-token prediction), not converted


def _plan(config: ModelConfig, tensors: list[SourceTensor], source_dir: Path, dtype: np.dtype | None,
          quantization: Quantization | None = None, stored: Quantization | None = None) -> _Plan:
    """What goes where. An FP8 checkpoint's (`stored`) FP8 weights and scales are copied as they are; its other
    projections, like every projection of an unquantized checkpoint with `quantization`, quantized as they stream."""
    expected = param_specs(config)
    quantized = set() if quantization is None else set(_quantized_paths(config, expected, quantization, source_dir))
    by_path = hf_tensors_by_param(config, tensors, source_dir, ConversionError, stored and stored.block)
    stacked = names_of(config).is_stacked
    specs = {path: (shape, dtype if dtype is not None else by_path[path][0][0].tensor.dtype, stacked(path))
             for path, (shape, _) in expected.items()}
    for path in quantized:
        shape, _, stacked = specs.pop(path)
        codes_shape, scales_shape = quantization.shapes(shape)
        module = path.removesuffix(".weight")
        specs[module + ".codes"] = (codes_shape, quantization.codes_dtype, stacked)
        specs[module + ".scales"] = (scales_shape, np.dtype(np.float32), stacked)
    sources = {}
    for path, layers in by_path.items():
        module = path.removesuffix(".weight")
        for layer, pieces in layers.items():
            for piece in pieces:
                name = piece.tensor.name
                if piece.scales is not None:
                    if path not in quantized:
                        raise ConversionError(f"{piece.tensor.file}: tensor '{name}' is FP8, but the model keeps "
                                              f"'{path}' unquantized")
                    sources[name] = _Source(module + ".codes", layer, piece.offset)
                    scales, start = piece.scales
                    sources[scales.name] = _Source(module + ".scales", layer, start)
                elif path in quantized:
                    scales_start = 0 if not quantization.two_dimensional else fp8_scales_offset(
                        piece, expected[path][0], quantization.block)
                    sources[name] = _Source(path, layer, piece.offset, True, scales_start)
                else:
                    sources[name] = _Source(path, layer, piece.offset)
    skipped = sum(1 for t in tensors if config.prediction_layers and in_prediction_layer(config, t.name))
    return _Plan(specs, sources, quantization, skipped)


def _quantized_paths(config: ModelConfig, expected: dict, quantization: Quantization, source_dir: Path) -> list[str]:
    """The weight paths the quantized model holds as codes and scales; each input dimension checked against
    the block, naming the tensor."""
    # Which Linears the model quantizes does not depend on the block: ask it with a block that divides all.
    structure = param_specs(config, quantization=Quantization("int8", 1))
    paths = [p.removesuffix(".codes") + ".weight" for p in structure if p.endswith(".codes")]
    if quantization.two_dimensional:  # partial blocks at the edges; a fused expert weight's parts whole blocks
        names = names_of(config)
        for path in paths:
            rows, parts = expected[path][0][-2], max((t.parts for t in names.expert_tensors(path)), default=1)
            if parts > 1 and rows // parts % quantization.block:
                raise ConversionError(f"{source_dir}: FP8 blocks of {quantization.block} straddle the {parts} fused "
                                      f"parts of '{names.jax_to_hf(path, 0)}' ({rows} rows)")
        return paths
    for path in paths:
        shape, _ = expected[path]
        if shape[-1] % quantization.block:
            names = names_of(config)
            name = names.jax_to_hf(path, 0 if names.is_stacked(path) else None)
            raise ConversionError(f"{source_dir}: --quant-block {quantization.block} does not divide the input "
                                  f"dimension {shape[-1]} of '{name}' (shape [out, in] = {list(shape[-2:])})")
    return paths


def _copy(plan: _Plan, tensors: list[SourceTensor], kind: str, tmp: Path, progress: bool,
          source: dict | None = None) -> int:
    """Stream every planned tensor into its slice, file by file; returns bytes written."""
    from tqdm import tqdm

    writer = CheckpointWriter(tmp, plan.specs, plan.quantization)
    todo = [t for t in tensors if t.name in plan.sources]
    total_bytes = sum(writer.slice_nbytes(path) for path, (shape, _, stacked) in plan.specs.items()
                      for _ in range(shape[0] if stacked else 1))
    written = 0
    try:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
            for file in dict.fromkeys(t.file for t in todo):
                handle = open_file(file, kind)
                try:
                    for t in (t for t in todo if t.file == file):
                        path, index, start, quantize_it, scales_start = plan.sources[t.name]
                        if quantize_it:
                            write = _write_fp8 if plan.quantization.two_dimensional else _write_quantized
                            n = write(writer, path, index, t, handle, plan.quantization, start, scales_start)
                            written += n
                            bar.update(n)
                            continue
                        target = plan.specs[path][1]
                        # an expert's tensor fills its part of the slice: `start` elements in, its own size
                        part = dict(start=start * target.itemsize, nbytes=int(np.prod(t.shape)) * target.itemsize)
                        if t.offset is not None and t.dtype == target:  # a byte copy: let the kernel do it
                            n = writer.copy_slice(path, index, handle, t.offset, **part)
                        else:
                            chunks = (c if c.dtype == target else c.astype(target) for c in iter_chunks(t, handle))
                            n = writer.write_slice(path, index, (memoryview(c.view(np.uint8)) for c in chunks),
                                                   **part)
                        written += n
                        bar.update(n)
                finally:
                    close_file(handle)
        writer.finish({"layout": "torch: Linear weights [out, in]; per-layer tensors stacked on axis 0",
                       **({"source": source} if source else {})})
    finally:
        writer.close()
    return written


def _write_quantized(writer: CheckpointWriter, path: str, index: int, tensor: SourceTensor, handle,
                     quantization: Quantization, start: int = 0, scales_start: int = 0) -> int:
    """Quantize one source slice (or an expert's part of it, from element `start`) chunk by chunk into its `.codes`
    and `.scales` slices; returns bytes written.

    Blocks run along the flattened weight (the input dimension is a multiple of the block), so each chunk
    of whole blocks gives a contiguous run of codes and of scales: memory stays a few chunks, whatever the
    tensor's size; an expert's part, whole rows, is a whole number of blocks at a whole block's offset."""
    module = path.removesuffix(".weight")
    blocks, first = int(np.prod(tensor.shape)) // quantization.block, start // quantization.block
    codes_bytes = quantization.codes_per_block * quantization.codes_dtype.itemsize
    codes_out = writer.open_slice(module + ".codes", index, first * codes_bytes, blocks * codes_bytes)
    scales_out = writer.open_slice(module + ".scales", index, first * 4, blocks * 4)
    where = f"'{tensor.name}' in {tensor.file}"
    for chunk in _whole_blocks(iter_chunks(tensor, handle), quantization.block):
        try:
            codes, scales = quantize(chunk.reshape(-1, quantization.block), quantization)
        except ValueError as e:
            raise ConversionError(f"{where}: {e}") from None
        codes_out.write(memoryview(codes.reshape(-1)))
        scales_out.write(memoryview(scales.reshape(-1).view(np.uint8)))
    return codes_out.close() + scales_out.close()


def _write_fp8(writer: CheckpointWriter, path: str, index: int, tensor: SourceTensor, handle,
               quantization: Quantization, start: int = 0, scales_start: int = 0) -> int:
    """As `_write_quantized`, in FP8's blocks of `block x block`: the tensor `[..., rows, cols]` streams a band of
    `block` rows at a time (fewer for a matrix's last band), each band's codes and one row of scales contiguous."""
    module = path.removesuffix(".weight")
    *lead, rows, cols = tensor.shape
    block = quantization.block
    bands = [min(block, rows - r) for r in range(0, rows, block)] * int(np.prod(lead, dtype=np.int64))
    scale_cols = -(-cols // block)
    codes_out = writer.open_slice(module + ".codes", index, start, int(np.prod(tensor.shape)))
    scales_out = writer.open_slice(module + ".scales", index, scales_start * 4, len(bands) * scale_cols * 4)
    for band in _pieces(iter_chunks(tensor, handle), [n * cols for n in bands]):
        try:
            codes, scales = quantize(band.reshape(-1, cols), quantization)
        except ValueError as e:
            raise ConversionError(f"'{tensor.name}' in {tensor.file}: {e}") from None
        codes_out.write(memoryview(codes.reshape(-1).view(np.uint8)))
        scales_out.write(memoryview(scales.reshape(-1).view(np.uint8)))
    return codes_out.close() + scales_out.close()


def _pieces(chunks, sizes: list[int]):
    """The elements of `chunks` again, as consecutive flat arrays of `sizes` elements."""
    buffered, held = [], 0
    sizes = iter(sizes)
    size = next(sizes, None)
    for chunk in chunks:
        buffered.append(chunk.copy())  # the source may reuse its buffer
        held += chunk.size
        while size is not None and held >= size:
            joined = np.concatenate(buffered) if len(buffered) > 1 else buffered[0]
            yield joined[:size]
            rest = joined[size:]
            buffered, held = ([rest] if rest.size else []), rest.size
            size = next(sizes, None)


def _whole_blocks(chunks, block: int):
    """The elements of `chunks` again, regrouped into flat arrays of whole blocks (a few values carried over)."""
    carry = None
    for chunk in chunks:
        if carry is not None:
            chunk = np.concatenate([carry, chunk])
        whole = chunk.size - chunk.size % block
        if whole:
            yield chunk[:whole]
        carry = chunk[whole:].copy() if whole < chunk.size else None  # the source may reuse its buffer
    if carry is not None:
        raise ValueError(f"a tensor of {carry.size} values beyond whole blocks of {block}")  # the plan rules it out


def _check_destination(out: Path, src: str | Path | None, overwrite: bool) -> Path:
    """`out` resolved, unless converting into it could lose anything (jaxmodel.formats.output_dir's rule)."""
    return check_output_dir(out, option="--out", writes=CONVERTED_CHECKPOINT, overwrite=overwrite,
                            inputs=[("--src", src)] if src is not None else [], error=ConversionError)
