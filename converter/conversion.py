"""`convert()`: stream a HuggingFace Llama checkpoint into this port's checkpoint format.

Plan first (headers only: every tensor named, shaped and accounted for before a byte is written), then
copy tensor by tensor into a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
from pathlib import Path

import numpy as np

from converter.errors import ConversionError
from converter.hub import resolve_source
from jaxmodel.formats.hf_names import IGNORED, hf_to_jax, is_stacked, jax_to_hf
from jaxmodel.formats.hf_checkpoint import (AUX_FILES, HFCheckpointError, SourceTensor, close_file, iter_chunks,
                                            list_tensors, open_file)
from jaxmodel.formats.atomic import atomic_directory
from jaxmodel.formats.checkpoint import CheckpointError, param_specs, verify_checkpoint
from jaxmodel.formats.checkpoint_writer import CheckpointWriter
from jaxmodel.formats.markers import CONVERTED_CHECKPOINT
from jaxmodel.formats.output_dir import check_output_dir
from jaxmodel.config import LlamaConfig
from jaxmodel.formats.safetensors_file import DTYPES

DTYPE_CHOICES = {"keep": None, "bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"], "float16": DTYPES["F16"]}


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    out: Path
    tensors: int
    bytes: int
    seconds: float

    def __str__(self) -> str:
        rate = self.bytes / max(self.seconds, 1e-9)
        return (f"converted {self.tensors} tensors, {_human(self.bytes)}B in {self.seconds:.2f} s "
                f"({_human(rate)}B/s) -> {self.out}")


def _human(n: float) -> str:
    for unit in ("", "k", "M", "G"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} T"


def convert(src: str | Path, out: str | Path, *, dtype: str = "keep", revision: str | None = None,
            overwrite: bool = False, verify: bool = False, progress: bool = True) -> ConversionSummary:
    """Convert the HF Llama checkpoint `src` (directory or hub id) into `out`.

    `dtype`: one of bfloat16, float32, float16, or keep (each tensor as stored).
    """
    start = time.perf_counter()
    if dtype not in DTYPE_CHOICES:
        raise ConversionError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPE_CHOICES)}")
    out = Path(out)
    # Before anything is read. A hub id's snapshot in the HF cache is protected by its kind (a HF checkpoint).
    target = _check_destination(out, src if Path(src).expanduser().exists() else None, overwrite)
    source_dir = resolve_source(str(src), revision)
    config = LlamaConfig.from_hf(source_dir)
    kind, tensors = list_tensors(source_dir)
    plan = _plan(config, tensors, source_dir, DTYPE_CHOICES[dtype])
    try:
        with atomic_directory(target, "converting") as tmp:
            total = _copy(plan, tensors, kind, tmp, progress)
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
    return ConversionSummary(out, len(plan.sources), total, time.perf_counter() - start)


@dataclasses.dataclass
class _Plan:
    specs: dict[str, tuple[tuple[int, ...], np.dtype, bool]]  # JAX path -> (shape, dtype, stacked)
    sources: dict[str, tuple[str, int]]  # HF name -> (JAX path, slice index)


def _plan(config: LlamaConfig, tensors: list[SourceTensor], source_dir: Path, dtype: np.dtype | None) -> _Plan:
    expected = param_specs(config)
    by_path: dict[str, dict[int, SourceTensor]] = {}
    sources: dict[str, tuple[str, int]] = {}
    for t in tensors:
        mapped = hf_to_jax(t.name)
        if mapped is None:
            if IGNORED.fullmatch(t.name):
                continue
            raise ConversionError(f"{t.file}: unexpected tensor '{t.name}' (not part of a Llama checkpoint)")
        path, layer = mapped
        if path not in expected:
            if path == "lm_head.weight" and config.tie_word_embeddings:
                continue  # a tied checkpoint that also stores the head: the embedding is the head
            raise ConversionError(f"{t.file}: tensor '{t.name}' does not belong to the model config.json describes")
        shape, _ = expected[path]
        slice_shape = shape[1:] if layer is not None else shape
        if layer is not None and layer >= shape[0]:
            raise ConversionError(f"{t.file}: tensor '{t.name}' is beyond num_hidden_layers={shape[0]}")
        if tuple(t.shape) != tuple(slice_shape):
            raise ConversionError(
                f"{t.file}: tensor '{t.name}' has shape {list(t.shape)}, config.json implies {list(slice_shape)}"
            )
        by_path.setdefault(path, {})[layer or 0] = t
        sources[t.name] = (path, layer or 0)
    specs = {}
    for path, (shape, _) in expected.items():
        stacked = is_stacked(path)
        have = by_path.get(path, {})
        for index in range(shape[0] if stacked else 1):
            if index not in have:
                name = jax_to_hf(path, index if stacked else None)
                raise ConversionError(f"{source_dir}: missing tensor '{name}', which config.json implies")
        first = have[0].dtype
        specs[path] = (shape, dtype if dtype is not None else first, stacked)
    return _Plan(specs, sources)


def _copy(plan: _Plan, tensors: list[SourceTensor], kind: str, tmp: Path, progress: bool) -> int:
    """Stream every planned tensor into its slice, file by file; returns bytes written."""
    from tqdm import tqdm

    writer = CheckpointWriter(tmp, plan.specs)
    todo = [t for t in tensors if t.name in plan.sources]
    total_bytes = sum(writer.slice_nbytes(plan.sources[t.name][0]) for t in todo)
    written = 0
    try:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="convert", disable=not progress) as bar:
            for file in dict.fromkeys(t.file for t in todo):
                handle = open_file(file, kind)
                try:
                    for t in (t for t in todo if t.file == file):
                        path, index = plan.sources[t.name]
                        target = plan.specs[path][1]
                        if t.offset is not None and t.dtype == target:  # a byte copy: let the kernel do it
                            n = writer.copy_slice(path, index, handle, t.offset)
                        else:
                            chunks = (c if c.dtype == target else c.astype(target) for c in iter_chunks(t, handle))
                            n = writer.write_slice(path, index, (memoryview(c.view(np.uint8)) for c in chunks))
                        written += n
                        bar.update(n)
                finally:
                    close_file(handle)
        writer.finish({"layout": "torch: Linear weights [out, in]; per-layer tensors stacked on axis 0"})
    finally:
        writer.close()
    return written


def _check_destination(out: Path, src: str | Path | None, overwrite: bool) -> Path:
    """`out` resolved, unless converting into it could lose anything (jaxmodel.formats.output_dir's rule)."""
    return check_output_dir(out, option="--out", writes=CONVERTED_CHECKPOINT, overwrite=overwrite,
                            inputs=[("--src", src)] if src is not None else [], error=ConversionError)
