"""LoRA adapters on the model's linear layers, with PEFT's semantics.

`y = x W + scale * (x A) B`, `A: [in, r]` kaiming-uniform (a = sqrt(5), as PEFT initialises it),
`B: [r, out]` zeros, `scale = alpha / r` (rsLoRA: `alpha / sqrt(r)`). Adapters are `LoRAParam`
variables, float32 whatever the base dtype, and carry logical axes consistent with their base weight
(A's input axis is the weight's input axis, B's output axis its output axis), so the sharding rules
split them the same way.

The routed experts' projections (`jaxmodel.moe.GroupedLinear`, targets `experts.gate_up_proj` and
`experts.down_proj`) take one adapter of rank r for each expert, as PEFT's `target_parameters` adapts a fused expert
parameter: `A: [e, r, in]` (kaiming-uniform, as PEFT's `[e * r, in]`) and `B: [e, out, r]` zeros. PEFT gives them no
dropout, and neither does this port.

The router of a sparse layer (target `gate`, a `jaxmodel.layers.Linear` `[e, d]`) is frozen unless named: PEFT
adapts transformers 5's router, a bare parameter, as `target_parameters` `mlp.gate.weight`, with a plain `[r, d]` A
and `[e, r]` B and no dropout. Training it adds the load-balancing loss to the objective (`jaxmodel.moe`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodel.layers import Linear, LoRAParam
from jaxmodel.model import CausalLM
from jaxmodel.moe import GroupedLinear

MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj") + MLP_TARGETS
# multi-head latent attention's projections beside q_proj (when it has no query bottleneck) and o_proj (DeepSeek-V3)
LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# the routed experts' fused projections, by their module path's last two names
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
ROUTER_TARGET = "gate"  # a sparse layer's router
# the targets PEFT adapts as parameters (`target_parameters`), which it gives no dropout
PARAMETER_TARGETS = EXPERT_TARGETS + (ROUTER_TARGET,)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """An adapter's shape: rank r and alpha for every target, but the targets `rank_pattern` and `alpha_pattern`
    give their own (PEFT's patterns, each resolved to one value a target: a target's layers are one stacked array,
    so they take one rank; pairs of (target, value), or a dict)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS
    rslora: bool = False
    dropout: float = 0.0
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank}")
        for name, kind in (("rank_pattern", int), ("alpha_pattern", float)):
            pairs = getattr(self, name)
            pairs = tuple(sorted((pairs.items() if isinstance(pairs, dict) else pairs)))
            for target, value in pairs:
                if target not in self.targets:
                    raise ValueError(f"LoRA {name} names {target!r}, which is not among the targets")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                        kind is int and value != int(value)):
                    raise ValueError(f"LoRA {name} gives {target!r} {value!r}: expected a positive "
                                     f"{'integer' if kind is int else 'number'}")
            object.__setattr__(self, name, tuple((target, kind(value)) for target, value in pairs))
        known = ALL_TARGETS + LATENT_TARGETS + ("lm_head",) + PARAMETER_TARGETS
        unknown = sorted(set(self.targets) - set(known))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {unknown or '(none)'}: expected names from {', '.join(known)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        without = sorted(set(self.targets) & set(PARAMETER_TARGETS))
        if self.dropout and without:
            raise ValueError(f"LoRA dropout {self.dropout:g} on {', '.join(without)}: PEFT adapts the experts and "
                             "the router without dropout (set it to 0, or leave them out of the targets)")

    def rank_of(self, target: str) -> int:
        return int(dict(self.rank_pattern).get(target, self.rank))

    def alpha_of(self, target: str) -> float:
        return float(dict(self.alpha_pattern).get(target, self.alpha))

    def scale_of(self, target: str) -> float:
        """The adapter's factor on `target`: alpha / r (alpha / sqrt(r) with rsLoRA), each the target's own."""
        rank = self.rank_of(target)
        return self.alpha_of(target) / (math.sqrt(rank) if self.rslora else rank)

    @property
    def scale(self) -> float:
        """The factor of the targets without a pattern of their own."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def max_rank(self) -> int:
        return max(self.rank_of(t) for t in self.targets)


def attention_targets(config) -> tuple[str, ...]:
    """The attention projections of a model of `config` (a `ModelConfig`), as targets name them."""
    if not config.kv_lora_rank:
        return ALL_TARGETS[:4]
    queries = ("q_a_proj", "q_b_proj") if config.q_lora_rank else ("q_proj",)
    return (*queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def target_linears(model: CausalLM, targets: tuple[str, ...]) -> Iterator[tuple[str, Linear | GroupedLinear]]:
    """(NNX module path, module) for every linear layer whose HF module name is in `targets`, and every experts'
    projection whose `experts.<name>` is."""
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[-1] in targets:
            yield ".".join(map(str, path)), module
        if isinstance(module, GroupedLinear) and ".".join(map(str, path[-2:])) in targets:
            yield ".".join(map(str, path)), module


def target_name(path: str) -> str:
    """The target naming the module at `path` (`layers.self_attn.q_proj` -> `q_proj`, an experts' projection
    `moe_layers.mlp.experts.down_proj` -> `experts.down_proj`)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if is_expert_projection(path) else parts[-1]


def is_expert_projection(path: str) -> bool:
    """Whether the module at `path` is an experts' projection (`...mlp.experts.gate_up_proj`)."""
    return path.split(".")[-2:-1] == ["experts"]


def apply_lora(model: CausalLM, config: LoraConfig, *, rngs: nnx.Rngs) -> CausalLM:
    """Attach fresh adapters to `model`'s target layers, in place; returns the model."""
    found = list(target_linears(model, config.targets))
    missing = set(config.targets) - {target_name(path) for path, _ in found}
    if missing:
        attention = ", ".join(attention_targets(model.config))
        why = [why for names, why in ((("lm_head",), "tied embeddings have no lm_head"),
                                      (PARAMETER_TARGETS, "a model without experts has no router or experts"),
                                      (("q_proj", "k_proj", "v_proj") + LATENT_TARGETS,
                                       f"its attention's projections are {attention}"))
               if missing & set(names)]
        raise ValueError(f"LoRA targets {sorted(missing)} are not layers of this model"
                         + (f" ({'; '.join(why)})" if why else ""))
    for path, linear in found:
        rank, scale = config.rank_of(target_name(path)), config.scale_of(target_name(path))
        if isinstance(linear, GroupedLinear):
            _expert_adapters(linear, rank, scale, rngs)
            continue
        *lead, out_features, in_features = linear.weight_shape
        *lead_axes, out_axis, in_axis = linear.weight_axes
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on torch's [r, in] lora_A
        a = jax.random.uniform(rngs.params(), (*lead, in_features, rank), jnp.float32, -bound, bound)
        linear.lora_a = LoRAParam(a, axes=(*lead_axes, (in_axis, "lora_rank"), "lora_rank"))
        linear.lora_b = LoRAParam(jnp.zeros((*lead, rank, out_features), jnp.float32),
                                  axes=(*lead_axes, "lora_rank", (out_axis, "lora_rank")))
        linear.lora_scale = scale
        linear.lora_dropout = config.dropout
    return model


def _expert_adapters(linear: GroupedLinear, rank: int, scale: float, rngs: nnx.Rngs) -> None:
    *lead, experts, out_features, in_features = linear.weight_shape
    *lead_axes, expert_axis, out_axis, in_axis = linear.weight_axes
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on PEFT's [e * r, in] lora_A
    a = jax.random.uniform(rngs.params(), (*lead, experts, rank, in_features), jnp.float32, -bound, bound)
    linear.lora_a = LoRAParam(a, axes=(*lead_axes, expert_axis, "lora_rank", (in_axis, "lora_rank")))
    linear.lora_b = LoRAParam(jnp.zeros((*lead, experts, out_features, rank), jnp.float32),
                              axes=(*lead_axes, expert_axis, (out_axis, "lora_rank"), "lora_rank"))
    linear.lora_scale = scale
