"""The PEFT LoRA adapter format: write ours for `PeftModel.from_pretrained`, and read PEFT's into the JAX model.

Key names come from the model family's name table (`jaxmodel.formats.hf_names`): `base_model.model.` + the module's
name in transformers' class (`runtime_module`) + `.lora_A.weight` / `.lora_B.weight`. PEFT stores `lora_A: [r, in]`
and `lora_B: [out, r]`; the JAX model keeps `A: [in, r]`, `B: [r, out]`, so each is transposed (they are small).
PEFT loads adapters with `strict=False`, silently skipping unknown keys: the tests compare outputs.

The routed experts' adapters are PEFT's `target_parameters` layout on transformers 5's fused parameters (the
module `mlp.experts`, its parameters `gate_up_proj` and `down_proj`): `lora_A` `[e * r, in]`, rows expert-major (row
`e * r + k`), and `lora_B` `[out, e * r]`, columns rank-major (column `k * e_count + e`). PEFT wraps the parameters
of one module in nested wrappers, gate_up innermost: with both adapted, gate_up's keys are the module's
`base_layer.lora_A/B` and down's its own `lora_A/B`; with one, that one's are the module's own. A sparse layer's
router (target `gate`) is transformers 5's bare parameter `mlp.gate.weight`, adapted as a `target_parameters` too,
its keys those of a linear layer's adapter.

The per-expert layout (`expert_layout="per-expert"`) holds the same adapters as transformers 4 modules under the
hub's names, vLLM's MoE LoRA format on these classes: each expert's gate and up (`experts.{e}.gate_proj`/`up_proj`,
Mixtral's `experts.{e}.w1`/`w3`) with the fused adapter's `[r, in]` A as both As and its B's rows of that part, down
its own (`w2`); the router under the checkpoint's name (Mixtral's `block_sparse_moe.gate`). Exact: each expert's delta
is the fused one's. PEFT reads it as it reads any transformers-4 adapter, gate and up at rank 2r.

PEFT's `rank_pattern` and `alpha_pattern` map regexes to ranks and alphas, matched against each adapted module's
name (a parameter's: `...mlp.experts.gate_up_proj`, `...mlp.gate.weight`) as PEFT matches them; each target must
come out with one value in every layer (its layers are one stacked array), which this port keeps per target
(`LoraConfig.rank_pattern`) and writes back as one escaped key a target (`pattern_key`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from flax import nnx
from scipy.linalg import block_diag

from jaxmodel.errors import UserError
from jaxmodel.formats.atomic import atomic_directory
from jaxmodel.formats.hf_names import names_of
from jaxmodel.formats.io import read_json
from jaxmodel.lora import (EXPERT_TARGETS, PARAMETER_TARGETS, ROUTER_TARGET, LoraConfig, apply_lora,
                           is_expert_projection, target_linears, target_name)
from jaxmodel.formats.safetensors_file import DTYPES

PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# The PEFT release whose adapter_config.json field set adapter_config() writes (tests compare with its own).
PEFT_VERSION = "0.21.2"
EXPORT_DTYPES = {"float32": DTYPES["F32"], "bfloat16": DTYPES["BF16"], "float16": DTYPES["F16"]}
# the routed experts' layouts an adapter is written in: transformers 5's fused parameters, or each expert's modules
EXPERT_LAYOUTS = ("fused", "per-expert")


# PEFT's `target_parameters` entry of each target it adapts as a parameter
TARGET_PARAMETERS = {**{t: f"mlp.{t}" for t in EXPERT_TARGETS}, ROUTER_TARGET: f"mlp.{ROUTER_TARGET}.weight"}


def pattern_key(target: str) -> str:
    """The `rank_pattern`/`alpha_pattern` key that matches `target` in every layer (PEFT matches a key at the end of
    each adapted name: `q_proj` matches every `...self_attn.q_proj`, never `...k_proj`)."""
    return re.escape(TARGET_PARAMETERS.get(target, target))


def parameter_target(name: str) -> str | None:
    """The target of a `target_parameters` entry (`mlp.experts.down_proj`, `model.layers.0.mlp.gate.weight`, ...),
    None for one this port does not adapt."""
    def matches(entry):  # as PEFT matches an entry: by its end, `mlp.` and all
        tail = entry.removeprefix("mlp.")
        return name == tail or name.endswith("." + tail)

    return next((t for t, entry in TARGET_PARAMETERS.items() if matches(entry)), None)


class AdapterError(ValueError, UserError):
    """An adapter this toolkit cannot use; the message names the file/field and what was expected."""


def peft_tensors(lora: nnx.State, model_config, dtype=np.float32, *,
                 per_expert: bool = False) -> dict[str, np.ndarray]:
    """PEFT's state dict for a LoRA state of a model of `model_config` (a `jaxmodel.config.ModelConfig`): one
    `[r, in]` A and `[out, r]` B per adapted module and layer; an experts' projection's `[e * r, in]` and
    `[out, e * r]` per layer, or with `per_expert` an `[r, in]` and `[out / parts, r]` per expert and part under the
    hub's names (the router's under the checkpoint's name too)."""
    names = names_of(model_config)
    tensors: dict[str, np.ndarray] = {}
    flat = {".".join(map(str, path)): np.asarray(var[...]) for path, var in nnx.to_flat_state(lora)}
    for path, a in flat.items():
        if not path.endswith(".lora_a"):
            continue
        module = path[: -len(".lora_a")]
        b = flat[module + ".lora_b"]
        if is_expert_projection(module) and per_expert:
            tensors.update(_per_expert_tensors(names, module, a, b, dtype))
            continue
        if is_expert_projection(module):  # [layers, e, r, in] and [layers, e, out, r]
            for layer in range(a.shape[0]):
                name = expert_adapter_key(names, module, layer, _adapted_experts(flat, module))
                tensors[name + ".lora_A.weight"] = expert_a(a[layer]).astype(dtype)
                tensors[name + ".lora_B.weight"] = expert_b(b[layer]).astype(dtype)
            continue
        layers = [(i, a[i], b[i]) for i in range(a.shape[0])] if a.ndim == 3 else [(None, a, b)]
        for layer, a_ir, b_ro in layers:
            name = PREFIX + names.runtime_module(module, layer, checkpoint_names=per_expert)
            tensors[name + ".lora_A.weight"] = np.ascontiguousarray(a_ir.T).astype(dtype)
            tensors[name + ".lora_B.weight"] = np.ascontiguousarray(b_ro.T).astype(dtype)
    return tensors


def _per_expert_tensors(names, module: str, a: np.ndarray, b: np.ndarray, dtype) -> dict[str, np.ndarray]:
    """An experts' projection's adapters (`a` `[layers, e, r, in]`, `b` `[layers, e, out, r]`) as each expert's
    modules under the hub's names: every part (gate, up) with the expert's A and its own rows of the expert's B."""
    tensors = {}
    for row in names.expert_tensors(module + ".weight"):
        rows = b.shape[-2] // row.parts
        for layer in range(a.shape[0]):
            for expert in range(a.shape[1]):
                name = PREFIX + names.expert_name(row, layer, expert).removesuffix(".weight")
                tensors[name + ".lora_A.weight"] = a[layer, expert].astype(dtype)
                tensors[name + ".lora_B.weight"] = b[layer, expert, row.part * rows:(row.part + 1) * rows].astype(dtype)
    return tensors


def per_expert_modules(lora_config: LoraConfig, model_config) -> list[str]:
    """The `target_modules` of `lora_config`'s adapter in the per-expert layout: its modules, each adapted experts'
    projection as the hub names its experts' modules (`gate_proj`, `up_proj`; Mixtral's `w1`, `w3`), the router as
    `gate`."""
    experts = {row.hf.split(".")[-2] for row in model_config.family.experts
               if "{e}" in row.hf and target_name(row.jax.rsplit(".", 1)[0]) in lora_config.targets}
    return sorted((set(lora_config.targets) - set(EXPERT_TARGETS)) | experts)


def unservable_targets(lora_config: LoraConfig, model_config) -> list[str]:
    """The targets of `lora_config` that PEFT cannot attach on the class of `model_config`'s family."""
    return sorted(set(lora_config.targets) & set(model_config.family.unservable_targets))


def unservable_message(targets: list[str], model_config) -> str:
    return (f"LoRA targets {', '.join(targets)}: PEFT {PEFT_VERSION} attaches no adapter to them on "
            f"{model_config.family.architecture} (it takes those names for the experts), so their adapters would be "
            "dropped when it loads the adapter")


def expert_a(a_eri: np.ndarray) -> np.ndarray:
    """One layer's experts' A `[e, r, in]` as PEFT's `lora_A` `[e * r, in]` (row e * r + k)."""
    return np.ascontiguousarray(a_eri.reshape(-1, a_eri.shape[-1]))


def expert_b(b_eor: np.ndarray) -> np.ndarray:
    """One layer's experts' B `[e, out, r]` as PEFT's `lora_B` `[out, e * r]` (column k * e_count + e)."""
    return np.ascontiguousarray(b_eor.transpose(1, 2, 0).reshape(b_eor.shape[1], -1))


def expert_adapter_key(names, module: str, layer: int, both: bool) -> str:
    """The PEFT key prefix of an experts' projection's adapter (`module`, e.g. `moe_layers.mlp.experts.down_proj`):
    the experts module's runtime name, under `base_layer` for gate_up when down is adapted too."""
    experts, param = module.rsplit(".", 1)
    inner = both and param == "gate_up_proj"
    return PREFIX + names.runtime_module(experts, layer) + (".base_layer" if inner else "")


def _adapted_experts(flat: Mapping[str, np.ndarray], module: str) -> bool:
    """Whether both of the experts' projections beside `module` carry adapters."""
    experts = module.rsplit(".", 1)[0]
    return all(f"{experts}.{param}.lora_a" in flat for param in ("gate_up_proj", "down_proj"))


def adapter_config(lora_config: LoraConfig, base_model: str, revision: str | None = None,
                   exclude_modules: str | None = None, modules: list[str] | None = None) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a LoRA on a causal LM (sorted keys, every field). `base_model`
    and `revision` are what `AutoPeftModelForCausalLM` loads the base from; `exclude_modules` the regex of the
    base's modules outside the decoder (a multimodal family's `adapter_excludes`); `modules`, every target as a
    module (the per-expert layout's `per_expert_modules`), else the experts and the router as parameters."""
    parameters = []
    if modules is None:
        modules = sorted(set(lora_config.targets) - set(PARAMETER_TARGETS))
        parameters = [TARGET_PARAMETERS[t] for t in lora_config.targets if t in PARAMETER_TARGETS]
    return {
        "alora_invocation_tokens": None,
        "alpha_pattern": {pattern_key(t): alpha for t, alpha in lora_config.alpha_pattern}, "arrow_config": None,
        "auto_mapping": None,
        "base_model_name_or_path": base_model, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
        "eva_config": None, "exclude_modules": exclude_modules, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None, "loftq_config": {}, "lora_alpha": lora_config.alpha, "lora_bias": False,
        "lora_dropout": lora_config.dropout, "lora_ga_config": None, "megatron_config": None,
        "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None, "peft_type": "LORA",
        "peft_version": PEFT_VERSION, "qalora_group_size": 16, "r": lora_config.rank,
        "rank_pattern": {pattern_key(t): rank for t, rank in lora_config.rank_pattern},
        "revision": revision, "target_modules": modules, "target_parameters": sorted(parameters) or None,
        "task_type": "CAUSAL_LM", "trainable_token_indices": None, "use_bdlora": None, "use_dora": False,
        "use_qalora": False, "use_rslora": lora_config.rslora, "velora_config": None,
    }


def save_peft_adapter(out: str | Path, lora: nnx.State, lora_config: LoraConfig, *, model_config, base_model: str,
                      dtype: str = "float32", card: Mapping[str, Any] | None = None,
                      revision: str | None = None, expert_layout: str = "fused") -> Path:
    """Write `adapter_model.safetensors`, `adapter_config.json` and a README.md model card into `out`,
    atomically (a temporary directory renamed into place). `model_config` is the adapted model's `ModelConfig`;
    `base_model` (a hub id or HF directory) and its `revision` go into adapter_config.json and the card;
    `expert_layout` is one of `EXPERT_LAYOUTS`."""
    from safetensors.numpy import save_file

    if dtype not in EXPORT_DTYPES:
        raise AdapterError(f"--dtype {dtype!r}: expected one of {', '.join(EXPORT_DTYPES)}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise AdapterError(f"--expert-layout {expert_layout!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    per_expert = expert_layout == "per-expert"
    if per_expert and model_config.num_experts and (lora_config.rank_pattern or lora_config.alpha_pattern):
        raise AdapterError("--expert-layout per-expert: the adapter has ranks or alphas of its own on some targets "
                           "(rank_pattern/alpha_pattern), which PEFT's reading of per-expert adapters replaces on "
                           "the experts; export the fused layout")
    unservable = unservable_targets(lora_config, model_config)
    if unservable:
        raise AdapterError(unservable_message(unservable, model_config) + ": export a merged checkpoint (--merge) "
                           "instead, or train without them")
    tensors = peft_tensors(lora, model_config, EXPORT_DTYPES[dtype], per_expert=per_expert)
    if not tensors:
        raise AdapterError("no LoRA parameters to export")
    out = Path(out)
    with atomic_directory(out, "exporting") as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(lora_config, base_model, revision, model_config.family.adapter_excludes,
                                per_expert_modules(lora_config, model_config) if per_expert else None)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        details = {**({"base revision": revision} if revision else {}), **(card or {})}
        (tmp / "README.md").write_text(model_card(lora_config, base_model, details))
    return out


def model_card(lora_config: LoraConfig, base_model: str, details: Mapping[str, Any]) -> str:
    lines = [
        "---", f"base_model: {base_model}", "library_name: peft", "tags:", "- lora", "- llama-jax", "---", "",
        f"# LoRA adapter for {base_model}", "",
        "Trained with llama-jax (JAX, LoRA) and exported in PEFT's format:", "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base_model}"), "ADAPTER_DIR")',
        "```", "",
        "| setting | value |", "|---|---|",
        f"| rank r | {lora_config.rank} |", f"| alpha | {lora_config.alpha:g} |",
        f"| scaling | {'alpha / sqrt(r) (rsLoRA)' if lora_config.rslora else 'alpha / r'} = {lora_config.scale:g} |",
        f"| target modules | {', '.join(sorted(lora_config.targets))} |",
        *([f"| rank of | {', '.join(f'{t}: {r}' for t, r in lora_config.rank_pattern)} |"]
          if lora_config.rank_pattern else []),
        *([f"| alpha of | {', '.join(f'{t}: {a:g}' for t, a in lora_config.alpha_pattern)} |"]
          if lora_config.alpha_pattern else []),
        f"| dropout | {lora_config.dropout:g} |",
    ]
    lines += [f"| {key} | {value} |" for key, value in details.items()]
    return "\n".join(lines) + "\n"


def read_adapter(adapter_dir: str | Path, model_config=None) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """The LoraConfig and tensors of a PEFT LoRA adapter directory, refusing variants we cannot run. Given the
    model's config, a transformers-4 adapter of per-expert modules is read as PEFT reads it (`_from_per_expert`)."""
    from safetensors.numpy import load_file

    adapter_dir = Path(adapter_dir)
    config_path = adapter_dir / ADAPTER_CONFIG
    try:
        raw = read_json(config_path, AdapterError)
    except FileNotFoundError:
        raise AdapterError(f"{config_path}: not found (expected a PEFT adapter directory)") from None
    if raw.get("peft_type") != "LORA":
        raise AdapterError(f"{config_path}: field 'peft_type' is {raw.get('peft_type')!r}; only 'LORA' is supported")
    # PEFT variants this port does not run: each field must keep its plain-LoRA value.
    plain = {"use_dora": (False,), "modules_to_save": (None, []), "layers_to_transform": (None,), "bias": ("none",),
             "fan_in_fan_out": (False,), "lora_bias": (False,), "use_qalora": (False,)}
    for field, allowed in plain.items():
        if raw.get(field, allowed[0]) not in allowed:
            raise AdapterError(f"{config_path}: field '{field}' is {raw[field]!r}; not supported "
                               f"(expected {allowed[0]!r})")
    targets = raw.get("target_modules") or []
    if isinstance(targets, str):
        raise AdapterError(f"{config_path}: field 'target_modules' is a regex; an explicit list is supported")
    parameters = raw.get("target_parameters") or []
    for name in parameters:
        if not isinstance(name, str) or parameter_target(name) is None:
            raise AdapterError(f"{config_path}: field 'target_parameters' names {name!r}; supported: "
                               f"{', '.join(TARGET_PARAMETERS.values())}")
    targets = [*targets, *(parameter_target(name) for name in parameters)]
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{weights}: not found")
    tensors = load_file(str(weights))
    try:
        rank, alpha = int(raw["r"]), float(raw["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"{config_path}: {e}") from None
    if model_config is not None and model_config.num_experts and any(_PER_EXPERT.search(k) for k in tensors):
        if raw.get("rank_pattern") or raw.get("alpha_pattern"):
            raise AdapterError(f"{config_path}: a per-expert adapter with rank_pattern or alpha_pattern is not "
                               "supported (PEFT's conversion of it to fused experts keeps neither)")
        targets, tensors, patterns = _from_per_expert(targets, tensors, rank, alpha, model_config, weights)
    else:
        keys = _adapted_keys(tensors, targets)
        patterns = {field: _per_target(raw.get(field), field, keys, default, config_path)
                    for field, default in (("rank_pattern", rank), ("alpha_pattern", alpha))}
    try:
        lora_config = LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets),
                                 rslora=bool(raw.get("use_rslora", False)), dropout=float(raw.get("lora_dropout", 0.0)),
                                 **patterns)
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{config_path}: {e}") from None
    return lora_config, tensors


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # a transformers-4 adapter's key of one expert's module


def _from_per_expert(targets: list[str], tensors: Mapping[str, np.ndarray], rank: int, alpha: float, model_config,
                     where: Path) -> tuple[list[str], dict[str, np.ndarray], dict[str, dict[str, float]]]:
    """A transformers-4 adapter of each expert's modules (`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's
    `experts.{e}.w1/w3/w2`, `[r, in]` and `[out, r]` each) as PEFT 0.21.2 converts it to transformers 5's fused
    experts: gate and up become `experts.gate_up_proj` of rank 2r and alpha 2 alpha, A the two As stacked (the
    gate's first) and B the two Bs block-diagonal, so that each expert's delta is the two it had; down becomes
    `experts.down_proj`. The other modules' keys take their runtime names (the router's hub name, Mixtral's
    `block_sparse_moe.gate`, is `mlp.gate`). Returns the targets, the tensors in the fused layout, and the ranks and
    alphas of the fused targets (`LoraConfig`'s patterns)."""
    names = names_of(model_config)
    rows = {row.hf.split(".")[-2]: row for row in model_config.family.experts if "{e}" in row.hf}
    fused = {short: target_name(row.jax.rsplit(".", 1)[0]) for short, row in rows.items()}
    for target in sorted(set(fused.values())):
        shorts = sorted(short for short, t in fused.items() if t == target)
        present = [short for short in shorts if short in targets]
        if 0 < len(present) < len(shorts):
            raise AdapterError(f"{where.parent / ADAPTER_CONFIG}: target_modules names {', '.join(present)} without "
                               f"{', '.join(sorted(set(shorts) - set(present)))}: they are fused into {target}, so "
                               "each needs the other (as PEFT requires)")
    adapted = sorted({fused[t] for t in targets if t in fused})
    pieces: dict[tuple[str, int], dict[tuple[int, int, str], np.ndarray]] = {}
    converted = {}
    for key, value in tensors.items():
        module, _, kind = key.removeprefix(PREFIX).rpartition(".lora_")
        found = names.locate(module + ".weight") if key.startswith(PREFIX) else None
        if not _PER_EXPERT.search(key):
            runtime = None if found is None else names.runtime_module(found.path.rsplit(".", 1)[0], found.layer)
            converted[key if runtime is None else f"{PREFIX}{runtime}.lora_{kind}"] = value
            continue
        if found is None or found.expert is None or kind not in ("A.weight", "B.weight") or \
                target_name(found.path.rsplit(".", 1)[0]) not in adapted:
            raise AdapterError(f"{where}: tensor '{key}' is not an adapter of this model's adapted experts")
        pieces.setdefault((found.path, found.layer), {})[(found.expert, found.part, kind[0])] = value
    ranks = {}
    for (path, layer), parts in sorted(pieces.items()):
        row = next(r for r in rows.values() if r.jax == path)
        a_e, b_e = [], []
        for expert in range(model_config.num_experts):
            try:
                a_parts = [parts[(expert, part, "A")] for part in range(row.parts)]
                b_parts = [parts[(expert, part, "B")] for part in range(row.parts)]
            except KeyError:
                raise AdapterError(f"{where}: no adapter of expert {expert}'s parts of {path} in the sparse layer "
                                   f"{layer}, which its other experts have") from None
            a_e.append(np.concatenate(a_parts, axis=0))
            b_e.append(block_diag(*b_parts))
        a, b = np.stack(a_e), np.stack(b_e)  # [e, parts * r, in], [e, out, parts * r]
        name = expert_adapter_key(names, path.rsplit(".", 1)[0], layer, len(adapted) == 2)
        converted[name + ".lora_A.weight"], converted[name + ".lora_B.weight"] = expert_a(a), expert_b(b)
        ranks[target_name(path.rsplit(".", 1)[0])] = row.parts
    targets = [t for t in targets if t not in fused] + adapted
    grown = {t: parts for t, parts in ranks.items() if parts > 1}
    patterns = {"rank_pattern": {t: parts * rank for t, parts in grown.items()},
                "alpha_pattern": {t: parts * alpha for t, parts in grown.items()}}
    return targets, converted, patterns


def _adapted_keys(tensors: Mapping[str, np.ndarray], targets) -> dict[str, list[str]]:
    """Each target's adapted names as PEFT matches a pattern against them (a module's name; a parameter's, for
    `target_parameters`), from the adapter's keys."""
    both = set(EXPERT_TARGETS) <= set(targets)
    keys: dict[str, list[str]] = {}
    for name in tensors:
        if not (name.startswith(PREFIX) and name.endswith(".lora_A.weight")):
            continue
        module = name[len(PREFIX):-len(".lora_A.weight")]
        if module.endswith(".experts.base_layer"):  # gate_up, with down adapted too
            target, key = EXPERT_TARGETS[0], module[:-len(".base_layer")] + ".gate_up_proj"
        elif module.endswith(".experts"):
            target = EXPERT_TARGETS[1] if both else next((t for t in EXPERT_TARGETS if t in targets), "")
            key = module + "." + target.rsplit(".", 1)[-1]
        elif module.endswith(f".{ROUTER_TARGET}") and ROUTER_TARGET in targets:
            target, key = ROUTER_TARGET, module + ".weight"
        else:
            target, key = module.rsplit(".", 1)[-1], module
        keys.setdefault(target, []).append(key)
    return keys


def _per_target(pattern, field: str, keys: Mapping[str, list[str]], default, config_path: Path) -> dict:
    """A `rank_pattern`/`alpha_pattern` as one value a target where it is not `default`, matched as PEFT matches
    it (`(.*[.])?(key)$` on each adapted name, the first key that matches); one line naming the target when its
    layers would take different values."""
    if not pattern:
        return {}
    if not isinstance(pattern, dict):
        raise AdapterError(f"{config_path}: field '{field}' must map patterns to values, got {pattern!r}")
    resolved = {}
    for target, names in keys.items():
        values = set()
        for name in names:
            try:
                key = next((k for k in pattern if re.match(rf"(.*\.)?({k})$", name)), None)
            except re.error as e:
                raise AdapterError(f"{config_path}: field '{field}' holds a key that is not a regex ({e})") from None
            values.add(pattern[key] if key is not None else default)
        if len(values) > 1:
            raise AdapterError(f"{config_path}: field '{field}' gives {target}'s layers different values "
                               f"({', '.join(map(str, sorted(values)))}); supported: one value a target (its "
                               "layers are one stacked array)")
        value = values.pop()
        if value != default:
            resolved[target] = value
    return resolved


def load_peft_adapter(model, adapter_dir: str | Path):
    """Attach a PEFT LoRA adapter to `model` (in place): rank, alpha, rsLoRA and targets from its config."""
    lora_config, tensors = read_adapter(adapter_dir, model.config)
    apply_lora(model, lora_config, rngs=nnx.Rngs(0))
    where = Path(adapter_dir) / ADAPTER_WEIGHTS
    used = set()
    names = names_of(model.config)
    adapted = {path for path, _ in target_linears(model, lora_config.targets)}
    for path, linear in target_linears(model, lora_config.targets):
        if is_expert_projection(path):
            experts = path.rsplit(".", 1)[0]
            both = {experts + ".gate_up_proj", experts + ".down_proj"} <= adapted
            used |= _load_expert_adapter(linear, tensors, names, path, both, where)
            continue
        a = linear.lora_a[...]
        layers = range(a.shape[0]) if a.ndim == 3 else [None]
        values_a, values_b = [], []
        for layer in layers:
            name = PREFIX + names.runtime_module(path, layer)
            try:
                a_ri, b_or = tensors[name + ".lora_A.weight"], tensors[name + ".lora_B.weight"]
            except KeyError:
                raise AdapterError(f"{where}: no '{name}.lora_A/B.weight', which adapter_config.json implies") from None
            want_a, want_b = a.shape[-2:][::-1], linear.lora_b[...].shape[-2:][::-1]
            if a_ri.shape != want_a or b_or.shape != want_b:
                raise AdapterError(f"{where}: '{name}' has lora_A {list(a_ri.shape)} / lora_B {list(b_or.shape)}, "
                                   f"this model needs {list(want_a)} / {list(want_b)} (adapter for another model?)")
            values_a.append(a_ri.T.astype(np.float32))
            values_b.append(b_or.T.astype(np.float32))
            used.update((name + ".lora_A.weight", name + ".lora_B.weight"))
        stack = (lambda v: np.stack(v)) if a.ndim == 3 else (lambda v: v[0])
        linear.lora_a.set_value(stack(values_a))
        linear.lora_b.set_value(stack(values_b))
    unused = sorted(set(tensors) - used)
    if unused:
        raise AdapterError(f"{where}: tensor '{unused[0]}' does not belong to this model's adapted layers")
    return model



def _load_expert_adapter(linear, tensors: Mapping[str, np.ndarray], names, path: str, both: bool,
                         where: Path) -> set[str]:
    """Set an experts' projection's adapters from PEFT's `target_parameters` tensors; returns the keys used."""
    a, b = linear.lora_a[...], linear.lora_b[...]
    experts, rank, in_features = a.shape[-3:]
    out_features = b.shape[-2]
    values_a, values_b, used = [], [], set()
    for layer in range(a.shape[0]):
        name = expert_adapter_key(names, path, layer, both)
        try:
            a_ri, b_or = tensors[name + ".lora_A.weight"], tensors[name + ".lora_B.weight"]
        except KeyError:
            raise AdapterError(f"{where}: no '{name}.lora_A/B.weight', which adapter_config.json implies") from None
        want_a, want_b = (experts * rank, in_features), (out_features, experts * rank)
        if a_ri.shape != want_a or b_or.shape != want_b:
            raise AdapterError(f"{where}: '{name}' has lora_A {list(a_ri.shape)} / lora_B {list(b_or.shape)}, "
                               f"this model needs {list(want_a)} / {list(want_b)} (adapter for another model?)")
        values_a.append(a_ri.reshape(experts, rank, in_features).astype(np.float32))
        values_b.append(b_or.reshape(out_features, rank, experts).transpose(2, 0, 1).astype(np.float32))
        used.update((name + ".lora_A.weight", name + ".lora_B.weight"))
    linear.lora_a.set_value(np.stack(values_a))
    linear.lora_b.set_value(np.stack(values_b))
    return used
