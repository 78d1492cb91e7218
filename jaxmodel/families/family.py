"""`Family`: what one HuggingFace `model_type` adds to the one decoder, and its tensor names; `read_window`,
the `sliding_window` field as the windowed families read it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: the one decoder (`jaxmodel.model.CausalLM`) with the switches its config.json sets.

    `modules` is the family's table between HF module names and this port's module paths (`{i}` marks a
    per-layer module, whose parameters are stacked on a leading [layers] axis). `read(fields)` gives the
    `ModelConfig` fields the family decides from its config.json, over the common reading's (`fields`:
    `jaxmodel.config.Fields`); `write(config)` gives them back as the family's config.json spells them.

    `defaults` are transformers' values for config.json fields it leaves out, where the common reading has none.
    A multimodal class whose decoder this port runs (Gemma 3 from 4B up) also has `text_config`: the key of the
    part of its config.json that describes the decoder, read as the family's; `runtime_prefixes`: where the module
    names of transformers' class (which PEFT and vLLM adapters use) differ from its checkpoint's tensor names, as
    (checkpoint prefix, module prefix) pairs, and `runtime_modules` the rows of `modules`' kind naming a module as
    the class runs it where the checkpoint names it otherwise (Mixtral's router, `block_sparse_moe.gate` in its
    checkpoint, runs as `mlp.gate`), read in conversion too;
    and `other_tensors`: a regex of the checkpoint's tensors outside the
    decoder (the vision tower), which conversion leaves out; `adapter_excludes`: a regex of the class's modules
    an adapter leaves alone (PEFT's `exclude_modules`), so that its target names match in the decoder only.

    A family with mixtures of experts also has `experts`: where each HF tensor of a sparse layer's experts goes in
    the stacked `[e, ...]` parameters (`ExpertTensor`); its router and every sparse layer's module sit under the
    `moe_layers` stack (`jaxmodel.formats.hf_names`). `unservable_targets` are LoRA targets PEFT cannot attach on
    the family's class (on Qwen3-MoE it rewrites the MLP's names to the experts, so a dense layer's MLP takes no
    adapter): a run may train them, an export to PEFT refuses them."""

    model_type: str
    architecture: str  # transformers' class, written into converted and merged configs
    modules: tuple[tuple[str, str], ...]
    read: Callable[[Any], dict[str, Any]]
    write: Callable[[Any], dict[str, Any]]
    defaults: tuple[tuple[str, Any], ...] = ()
    text_config: str | None = None
    text_model_type: str | None = None  # the model_type written under text_config
    runtime_prefixes: tuple[tuple[str, str], ...] = ()
    runtime_modules: tuple[tuple[str, str], ...] = ()
    other_tensors: str | None = None
    adapter_excludes: str | None = None
    experts: tuple["ExpertTensor", ...] = ()
    unservable_targets: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ExpertTensor:
    """A HF tensor name of a sparse layer's experts (`{i}` the layer, `{e}` the expert) and the JAX parameter it fills:
    with `{e}`, rows `part` of `parts` equal blocks of expert e's `[out, in]` slice (the gate and up projections are
    the two halves of the fused gate_up, the gate's first); without, the layer's whole `[e, out, in]` slice (the fused
    names transformers 5 holds at run time). The first row naming a parameter is the name a merge writes."""

    hf: str
    jax: str
    part: int = 0
    parts: int = 1


# transformers' ACT2FN names of the MLP gate's activations the decoder runs (`jaxmodel.layers.ACTIVATIONS`)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# the names of `layer_types` in transformers' configs (Qwen2, Qwen3, Gemma 3)
LAYER_TYPES = ("full_attention", "sliding_attention")


def read_layer_types(fields) -> tuple[bool, ...] | None:
    """`layer_types` as one flag per layer, True for a sliding-window layer; None when absent."""
    layers = fields.raw["num_hidden_layers"]
    types = fields.get("layer_types", list, None)
    if types is None:
        return None
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise fields.error(f"field 'layer_types' must list {layers} of {', '.join(LAYER_TYPES)}")
    return tuple(t == "sliding_attention" for t in types)


# transformers' MistralConfig and Qwen2/Qwen3Config default, when config.json has no sliding_window (null: none)
DEFAULT_WINDOW = 4096


def read_experts(fields, count: int) -> dict[str, Any]:
    """The experts' common fields: `count` experts, `num_experts_per_tok` of them a token, the load-balancing
    loss's `router_aux_loss_coef` (transformers' default 0.001; a nonzero `router_jitter_noise`, a perturbation of
    the router in training, refused)."""
    top_k = fields.positive("num_experts_per_tok")
    if top_k > count:
        raise fields.error(f"field 'num_experts_per_tok' ({top_k}) must not exceed the {count} experts")
    jitter = fields.get("router_jitter_noise", (int, float), 0)
    if jitter:
        raise fields.error(f"field 'router_jitter_noise' is {jitter}: training with a perturbed router is not "
                           "supported (set it to 0)")
    coef = fields.get("router_aux_loss_coef", (int, float), 0.001)
    if coef < 0:
        raise fields.error(f"field 'router_aux_loss_coef' must not be negative, got {coef}")
    return dict(num_experts=count, num_experts_per_tok=top_k, router_aux_loss_coef=float(coef))


def read_window(fields) -> int | None:
    """`sliding_window`: DEFAULT_WINDOW when absent, None when null, else a positive integer."""
    if "sliding_window" not in fields.raw:
        return DEFAULT_WINDOW
    window = fields.get("sliding_window", int, None)
    if window is not None and window <= 0:
        raise fields.error(f"field 'sliding_window' must be a positive integer or null, got {window!r}")
    return window
