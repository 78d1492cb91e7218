"""Mixtral (8x7B, 8x22B): Mistral's attention over a mixture of experts on every layer: `num_local_experts` experts
of `intermediate_size`, `num_experts_per_tok` a token, their weights always renormalised and kept float32. The
checkpoint names the MLP `block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and w2 (down);
`sliding_window` defaults to none (not Mistral's 4096)."""

from __future__ import annotations

from jaxmodel.families.family import ExpertTensor, Family, read_experts
from jaxmodel.families.llama import MODULES as LLAMA_MODULES

ATTENTION = tuple(row for row in LLAMA_MODULES if ".mlp." not in row[0])
MODULES = ATTENTION + (
    ("model.layers.{i}.block_sparse_moe.gate",  "moe_layers.mlp.gate"),
    ("model.layers.{i}.mlp.experts",            "moe_layers.mlp.experts"),  # the fused experts (adapters' keys)
)  # fmt: skip
# transformers 5's names at run time where the checkpoint's differ (adapters' keys; a state dict saved as it runs)
RUNTIME_MODULES = (("model.layers.{i}.mlp.gate", "moe_layers.mlp.gate"),)
_HUB = "model.layers.{i}.block_sparse_moe.experts.{e}"
EXPERTS = (
    ExpertTensor(_HUB + ".w1.weight",                        "moe_layers.mlp.experts.gate_up_proj.weight", 0, 2),
    ExpertTensor(_HUB + ".w3.weight",                        "moe_layers.mlp.experts.gate_up_proj.weight", 1, 2),
    ExpertTensor(_HUB + ".w2.weight",                        "moe_layers.mlp.experts.down_proj.weight"),
    ExpertTensor("model.layers.{i}.mlp.experts.gate_up_proj", "moe_layers.mlp.experts.gate_up_proj.weight"),
    ExpertTensor("model.layers.{i}.mlp.experts.down_proj",    "moe_layers.mlp.experts.down_proj.weight"),
)  # fmt: skip


def _read(fields) -> dict:
    window = fields.get("sliding_window", int, None)
    if window is not None and window <= 0:
        raise fields.error(f"field 'sliding_window' must be a positive integer or null, got {window!r}")
    layers = fields.raw["num_hidden_layers"]
    size = fields.positive("intermediate_size")
    return dict(**read_experts(fields, fields.positive("num_local_experts", 8)), moe_intermediate_size=size,
                norm_topk_prob=True, sliding_window=window, sliding_layers=(True,) * layers if window else (),
                sparse_layers=(True,) * layers)


def _write(config) -> dict:
    if config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm:
        raise ValueError("Mixtral has no biases and no q/k norms")
    if config.sliding_window is not None and not all(config.sliding_layers):
        raise ValueError("Mixtral's sliding window is on every layer or none")
    if not config.sparse_layers or not all(config.sparse_layers) or not config.norm_topk_prob or \
            config.round_router_weights:
        raise ValueError("Mixtral's layers are all sparse, their router weights renormalised and float32")
    return {"sliding_window": config.sliding_window, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "router_aux_loss_coef": config.router_aux_loss_coef, "intermediate_size": config.moe_intermediate_size}


FAMILY = Family("mixtral", "MixtralForCausalLM", MODULES, _read, _write, defaults=(("num_experts_per_tok", 2),),
                experts=EXPERTS, runtime_modules=RUNTIME_MODULES)
