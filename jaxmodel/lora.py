"""LoRA adapters on the model's linear layers, with PEFT's semantics.

`y = x W + scale * (x A) B`, `A: [in, r]` kaiming-uniform (a = sqrt(5), as PEFT initialises it),
`B: [r, out]` zeros, `scale = alpha / r` (rsLoRA: `alpha / sqrt(r)`). Adapters are `LoRAParam`
variables, float32 whatever the base dtype, and carry logical axes consistent with their base weight
(A's input axis is the weight's input axis, B's output axis its output axis), so the sharding rules
split them the same way.
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

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS
    rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank}")
        unknown = sorted(set(self.targets) - set(ALL_TARGETS) - {"lm_head"})
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {unknown or '(none)'}: expected names from "
                             f"{', '.join(ALL_TARGETS + ('lm_head',))}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def target_linears(model: CausalLM, targets: tuple[str, ...]) -> Iterator[tuple[str, Linear]]:
    """(NNX module path, Linear) for every linear layer whose HF module name is in `targets`."""
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[-1] in targets:
            yield ".".join(map(str, path)), module


def apply_lora(model: CausalLM, config: LoraConfig, *, rngs: nnx.Rngs) -> CausalLM:
    """Attach fresh adapters to `model`'s target layers, in place; returns the model."""
    found = list(target_linears(model, config.targets))
    missing = set(config.targets) - {path.rsplit(".", 1)[-1] for path, _ in found}
    if missing:
        raise ValueError(f"LoRA targets {sorted(missing)} are not layers of this model (tied embeddings have no lm_head)")
    for _, linear in found:
        *lead, out_features, in_features = linear.weight_shape
        *lead_axes, out_axis, in_axis = linear.weight_axes
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on torch's [r, in] lora_A
        a = jax.random.uniform(rngs.params(), (*lead, in_features, config.rank), jnp.float32, -bound, bound)
        linear.lora_a = LoRAParam(a, axes=(*lead_axes, (in_axis, "lora_rank"), "lora_rank"))
        linear.lora_b = LoRAParam(jnp.zeros((*lead, config.rank, out_features), jnp.float32),
                                  axes=(*lead_axes, "lora_rank", (out_axis, "lora_rank")))
        linear.lora_scale = config.scale
        linear.lora_dropout = config.dropout
    return model
