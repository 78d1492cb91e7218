"""A merged HuggingFace checkpoint: the base with `W + scale * (A B)^T` folded in, as safetensors shards
+ `model.safetensors.index.json` + config and tokenizer files, that transformers' `AutoModelForCausalLM.from_pretrained` loads.

Streams like the converter: the shard layout is planned from shapes, then each tensor is read from the
base (memory-mapped, or in bounded chunks), merged if adapted, and written at its offset, one at a time.

The base is unquantized weights: the converted checkpoint a run trained on, or, for a run on a quantized
base (`convert-llama --quantize`), the weights it was quantized from (`--merge-base`: a converted unquantized
checkpoint or the HF checkpoint directory). Folding adapters into dequantized 4- or 8-bit weights would
bake the quantization error into every merged weight. An FP8 base is the model itself (DeepSeek-V3 ships in FP8):
its weights are dequantized, merged in float32, and written in FP8 again, in the same blocks by the same formula
(`jaxmodel.quantization`), or, with `dtype` bfloat16, as bf16.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from jaxmodel.config import ModelConfig
from jaxmodel.errors import UsageError, UserError
from jaxmodel.formats.atomic import atomic_directory
from jaxmodel.formats.checkpoint import (DTYPES_BY_NAME, MANIFEST, checkpoint_quantization, hf_tensors_by_param,
                                        open_tensor, read_manifest)
from jaxmodel.formats.hf_checkpoint import AUX_FILES, close_file, iter_chunks, list_tensors, open_file
from jaxmodel.formats.hf_names import names_of
from jaxmodel.formats.io import pwrite_all
from jaxmodel.formats.safetensors_file import write_header
from jaxmodel.lora import LoraConfig, is_expert_projection, target_name
from jaxmodel.quantization import FP8, Quantization, dequantize_numpy, quantize
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)B?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `1.5G` or a byte count -> bytes (decimal units, as transformers reads them)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise UsageError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or a byte count")
    return int(float(match.group(1)) * 1000 ** " KMGT".index(match.group(2).upper() or " "))


class MergeBaseError(ValueError, UserError):
    """Base weights a merge cannot use; the message names the directory and what is wrong."""


# Config fields that fix the shapes of the weights: a merge base must agree with the run's base on each.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "model_type", "qkv_bias", "o_bias", "mlp_bias",
                "qk_norm", "num_experts", "moe_intermediate_size", "sparse_layers")


@dataclasses.dataclass(frozen=True)
class BaseTensor:
    """One HF tensor of the base: its HF name, the JAX parameter and layer it is, dtype and shape; an expert's tensor
    also its `part` of the layer's `[e, out, in]` slice: (expert, first row, rows)."""

    name: str
    path: str
    layer: int | None
    dtype: np.dtype
    shape: tuple[int, ...]
    part: tuple[int, int, int] | None = None
    written: np.dtype | None = None  # the dtype a merge writes it in (None: `dtype`)

    @property
    def fp8(self) -> bool:
        """Whether the base holds this weight in FP8 (its codes; `MergeBase.read` gives it dequantized)."""
        return self.dtype == FP8

    @property
    def out_dtype(self) -> np.dtype:
        return self.dtype if self.written is None else self.written


class MergeBase:
    """The unquantized weights a merge folds adapters into, tensor by tensor, in HF order: a converted checkpoint
    (read through its manifest) or a HF checkpoint directory (read from its safetensors or `.bin` files)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.config = ModelConfig.from_hf(self.directory)
        if self.config.family.other_tensors is not None:
            raise MergeBaseError(f"{self.directory / 'config.json'}: a {self.config.family.architecture} base has "
                                 "weights outside its decoder (a vision tower) that a merge does not carry over: "
                                 "export the adapter (without --merge) and serve it on the base")
        self.converted = (self.directory / MANIFEST).is_file()
        self._handles: dict[Path, object] = {}
        self.fp8: Quantization | None = None  # the blocks of an FP8 base
        if self.converted:
            manifest = read_manifest(self.directory)
            quantization = checkpoint_quantization(manifest, self.directory / MANIFEST)
            if quantization is not None and not quantization.two_dimensional:
                raise MergeBaseError(f"{self.directory}: quantized {quantization.scheme} (block {quantization.block}): "
                                     "a merge needs unquantized weights")
            self.fp8 = quantization
            self._manifest = manifest["tensors"]
            names = names_of(self.config)
            tensors = []
            for stored, entry in self._manifest.items():
                if stored.endswith(".scales"):
                    continue  # read with their codes
                path = stored.removesuffix(".codes") + ".weight" if stored.endswith(".codes") else stored
                dtype = DTYPES_BY_NAME[entry["dtype"]]
                if names.expert_tensors(path):  # written under the hub's per-expert names
                    tensors += _expert_tensors(names, path, dtype, tuple(entry["shape"]))
                elif names.is_stacked(path):
                    tensors += [BaseTensor(names.jax_to_hf(path, i), path, i, dtype, tuple(entry["shape"][1:]))
                                for i in range(entry["shape"][0])]
                else:
                    tensors.append(BaseTensor(names.jax_to_hf(path), path, None, dtype, tuple(entry["shape"])))
        else:
            if _quantization_config(self.directory) is not None:
                raise MergeBaseError(f"{self.directory / 'config.json'}: 'quantization_config': a merge reads "
                                     "unquantized HF weights (an FP8 checkpoint merges from its conversion: leave out "
                                     "--merge-base)")
            self._kind, found = list_tensors(self.directory)
            self._sources = {t.name: t for t in found}
            tensors = self._hf_tensors(found)
        self.tensors = sorted(tensors, key=lambda t: _hf_order(t.name))

    def _hf_tensors(self, found) -> list[BaseTensor]:
        """The HF checkpoint's tensors checked against its config.json, as the converter checks them."""
        by_path = hf_tensors_by_param(self.config, found, self.directory, MergeBaseError)
        stacked = names_of(self.config).is_stacked
        return [BaseTensor(t.name, path, layer if stacked(path) else None, np.dtype(t.dtype), tuple(t.shape), part)
                for path, layers in by_path.items() for layer, pieces in layers.items() for t, _, part, _ in pieces]

    def check_matches(self, config: ModelConfig, what: str) -> None:
        """MergeBaseError unless this base has the shapes of `config` (`what` names where that comes from)."""
        for field in SHAPE_FIELDS:
            ours, theirs = getattr(self.config, field), getattr(config, field)
            if ours != theirs:
                raise MergeBaseError(f"{self.directory / 'config.json'}: {field} is {ours}, {what} has {theirs}: "
                                     "not the weights of that model")

    def read(self, tensor: BaseTensor) -> np.ndarray:
        """The tensor's values as stored (its own dtype); an FP8 weight's dequantized, in float32."""
        if self.converted and tensor.fp8:
            module = tensor.path.removesuffix(".weight")
            codes, scales = (self._stored(module + part, tensor, block) for part, block in
                             ((".codes", 1), (".scales", self.fp8.block)))
            return dequantize_numpy(codes, scales, self.fp8)
        if self.converted:
            return self._stored(tensor.path, tensor)

        source = self._sources[tensor.name]
        if source.file not in self._handles:
            self._handles[source.file] = open_file(source.file, self._kind)
        values = np.empty(math.prod(source.shape), source.dtype)
        done = 0
        for chunk in iter_chunks(source, self._handles[source.file]):
            values[done:done + chunk.size] = chunk
            done += chunk.size
        return values.reshape(source.shape)

    def _stored(self, path: str, tensor: BaseTensor, block: int = 1) -> np.ndarray:
        """`tensor`'s slice of the stored parameter `path`; an expert's part in rows of `block` (FP8 scales)."""
        stored = open_tensor(self.directory, path, self._manifest[path])
        if tensor.part is not None:
            expert, first, rows = tensor.part
            return np.asarray(stored[tensor.layer, expert, first // block:-(-(first + rows) // block)])
        return np.asarray(stored[tensor.layer] if tensor.layer is not None else stored)

    def close(self) -> None:
        for handle in self._handles.values():
            close_file(handle)
        self._handles.clear()


def merge_base_for(base_model: str | Path, merge_base: str | Path | None) -> MergeBase:
    """The weights a merge of a run on `base_model` folds into: `merge_base` (checked to be the same model), or
    `base_model` itself, which must then be unquantized; one-line errors otherwise."""
    manifest = read_manifest(base_model)
    quantization = checkpoint_quantization(manifest, Path(base_model) / MANIFEST)
    if merge_base is None:
        if quantization is not None and not quantization.two_dimensional:  # an FP8 base is the model itself
            raise UsageError(f"--merge: the run's base {base_model} is quantized {quantization.scheme} (block "
                             f"{quantization.block}); merging needs its unquantized weights: add --merge-base DIR "
                             "(a converted unquantized checkpoint, or the HF checkpoint it was converted from)")
        return MergeBase(base_model)
    base = MergeBase(merge_base)
    base.check_matches(ModelConfig.from_hf(base_model), f"the run's base ({base_model})")
    return base


MERGE_DTYPES = ("keep", "bfloat16")


def save_merged(out: str | Path, base: str | Path | MergeBase, lora: nnx.State, lora_config: LoraConfig, *,
                max_shard_size: int = 5 * 10**9, name_or_path: str | None = None, card: str | None = None,
                dtype: str = "keep") -> Path:
    """Write `base` (a MergeBase, or the directory of one) with the adapters folded in to `out` (atomically);
    returns `out`. The merged tensors keep the base's names, dtypes (an FP8 base's FP8 weights FP8, with their
    scales; `dtype` bfloat16: every floating tensor bf16) and HF order. `name_or_path` is recorded as config.json's
    `_name_or_path`; `card` is written as README.md."""
    out = Path(out)
    base = base if isinstance(base, MergeBase) else MergeBase(base)
    adapters = {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(lora)}
    fp8 = base.fp8 if dtype == "keep" else None
    shards: list[list[BaseTensor]] = [[]]
    size = 0
    for tensor in base.tensors:
        if dtype == "bfloat16" and (tensor.fp8 or np.issubdtype(tensor.dtype, np.floating)):
            tensor = dataclasses.replace(tensor, written=np.dtype(ml_dtypes.bfloat16))
        nbytes = math.prod(tensor.shape) * tensor.out_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes

    try:
        with atomic_directory(out, "merging") as tmp:
            weight_map, total = {}, 0
            for number, shard in enumerate(shards, 1):
                file = "model.safetensors" if len(shards) == 1 else \
                    f"model-{number:05d}-of-{len(shards):05d}.safetensors"
                total += _write_shard(tmp / file, shard, base, adapters, lora_config, fp8)
                weight_map.update({name: file for t in shard for name in _written(t)})
            if len(shards) > 1:
                (tmp / "model.safetensors.index.json").write_text(json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
            for name in AUX_FILES:
                if (base.directory / name).is_file():
                    shutil.copyfile(base.directory / name, tmp / name)
            if (tmp / "config.json").is_file() and (name_or_path is not None or base.fp8 is not None):
                config = json.loads((tmp / "config.json").read_text())
                if name_or_path is not None:
                    config["_name_or_path"] = name_or_path
                config.pop("quantization_config", None)
                if fp8 is not None:  # kept, or added to a base `--quantize fp8` made
                    config["quantization_config"] = _quantization_config(base.directory) or {
                        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                        "weight_block_size": [fp8.block, fp8.block]}
                (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if card is not None:
                (tmp / "README.md").write_text(card)
    finally:
        base.close()
    return out


def _written(tensor: BaseTensor) -> tuple[str, ...]:
    """The names a merged tensor is written under: an FP8 weight's and its scales'."""
    return (tensor.name, tensor.name + "_scale_inv") if tensor.out_dtype == FP8 else (tensor.name,)


def _write_shard(file: Path, shard: list[BaseTensor], base: MergeBase, adapters, lora_config: LoraConfig,
                 fp8: Quantization | None = None) -> int:
    fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        header = [(t.name, t.out_dtype, t.shape) for t in shard]
        header += [(t.name + "_scale_inv", np.dtype(np.float32), fp8.shapes(t.shape)[1]) for t in shard
                   if t.out_dtype == FP8]
        locations = write_header(fd, sorted(header, key=lambda h: _hf_order(h[0])), {"format": "pt"})
        for tensor in shard:
            weight = base.read(tensor)
            module = tensor.path.rsplit(".", 1)[0]
            if tensor.path.endswith(".weight") and module + ".lora_a" in adapters:
                a, b = adapters[module + ".lora_a"], adapters[module + ".lora_b"]
                a, b = (a[tensor.layer], b[tensor.layer]) if tensor.layer is not None else (a, b)
                a, b = a.astype(np.float32), b.astype(np.float32)
                if not is_expert_projection(module):
                    delta = (a @ b).T
                elif tensor.part is None:  # a layer's fused experts: B_e A_e for each, [e, out, in]
                    delta = np.einsum("eor,eri->eoi", b, a)
                else:  # one expert's rows: [rows, in]
                    expert, first, rows = tensor.part
                    delta = b[expert, first:first + rows] @ a[expert]
                scale = lora_config.scale_of(target_name(module))
                weight = weight.astype(np.float32) + scale * delta
            if tensor.out_dtype == FP8:
                weight, scales = quantize(weight, fp8)
                pwrite_all(fd, scales.view(np.uint8).reshape(-1), locations[tensor.name + "_scale_inv"].offset)
            weight = weight.astype(tensor.out_dtype)
            pwrite_all(fd, np.ascontiguousarray(weight).view(np.uint8).reshape(-1), locations[tensor.name].offset)
        os.fsync(fd)
        return sum(loc.nbytes for loc in locations.values())
    finally:
        os.close(fd)


def _expert_tensors(names, path: str, dtype, shape: tuple[int, ...]) -> list[BaseTensor]:
    """A converted experts' parameter `[layers, e, out, in]` as the hub's per-expert tensors."""
    layers, experts, out, cols = shape
    return [BaseTensor(names.expert_name(row, layer, expert), path, layer, dtype, (out // row.parts, cols),
                       (expert, row.part * out // row.parts, out // row.parts))
            for layer in range(layers) for expert in range(experts) for row in names.expert_tensors(path)]


def _quantization_config(directory: Path) -> dict | None:
    """The `quantization_config` of a directory's config.json, if any."""
    found = json.loads((directory / "config.json").read_text()).get("quantization_config")
    return found if isinstance(found, dict) or found is None else {"quant_method": found}


def _hf_order(name: str) -> tuple:
    """embed_tokens, then layers by number, then norm, then lm_head (the order HF writes)."""
    match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if match:
        return (1, int(match.group(1)), match.group(2))
    return (0 if "embed_tokens" in name else 2 if name.startswith("model.norm") else 3, 0, name)
