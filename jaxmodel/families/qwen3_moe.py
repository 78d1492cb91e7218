"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, one `attention_bias`) over a mixture
of experts: `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` a token, renormalised when
`norm_topk_prob`, on every layer but those of `mlp_only_layers` and of a `decoder_sparse_step` > 1 (a dense MLP
of `intermediate_size` there). A window, when `use_sliding_window`, on every layer; `head_dim` defaults to
hidden / heads (not dense Qwen3's 128)."""

from __future__ import annotations

from jaxmodel.families.family import ExpertTensor, Family, read_experts, read_window
from jaxmodel.families.qwen3 import MODULES as QWEN3_MODULES

MODULES = QWEN3_MODULES + (
    ("model.layers.{i}.mlp.gate",     "moe_layers.mlp.gate"),
    ("model.layers.{i}.mlp.experts",  "moe_layers.mlp.experts"),  # the module of the fused experts (adapters' keys)
)  # fmt: skip
_HUB = "model.layers.{i}.mlp.experts"
_JAX = "moe_layers.mlp.experts"
EXPERTS = (
    ExpertTensor(_HUB + ".{e}.gate_proj.weight",  _JAX + ".gate_up_proj.weight", 0, 2),
    ExpertTensor(_HUB + ".{e}.up_proj.weight",    _JAX + ".gate_up_proj.weight", 1, 2),
    ExpertTensor(_HUB + ".{e}.down_proj.weight",  _JAX + ".down_proj.weight"),
    ExpertTensor(_HUB + ".gate_up_proj",          _JAX + ".gate_up_proj.weight"),
    ExpertTensor(_HUB + ".down_proj",             _JAX + ".down_proj.weight"),
)  # fmt: skip


def _read(fields) -> dict:
    bias = fields.get("attention_bias", bool, False)
    layers = fields.raw["num_hidden_layers"]
    window = read_window(fields) if fields.get("use_sliding_window", bool, False) else None
    count = fields.get("num_experts", int, None)
    count = fields.get("num_local_experts", int, 128) if count is None else count
    common = dict(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True, sliding_window=window,
                  sliding_layers=(True,) * layers if window else ())
    if count <= 0:  # transformers' Qwen3-MoE without experts: every layer dense
        return common
    step = fields.positive("decoder_sparse_step", 1)
    dense = fields.get("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise fields.error(f"field 'mlp_only_layers' must list layer indices, got {dense!r}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return dict(**common, **read_experts(fields, count), moe_intermediate_size=fields.positive("moe_intermediate_size"),
                norm_topk_prob=fields.get("norm_topk_prob", bool, False), round_router_weights=True,
                sparse_layers=sparse)


def _write(config) -> dict:
    if config.qkv_bias != config.o_bias or config.mlp_bias or not config.qk_norm:
        raise ValueError("Qwen3-MoE has q/k norms, one attention_bias for q, k, v and o, and no MLP bias")
    if config.sliding_window is not None and not all(config.sliding_layers):
        raise ValueError("Qwen3-MoE's sliding window is on every layer or none")
    sparse = config.sparse_layers or (False,) * config.num_hidden_layers
    return {"attention_bias": config.qkv_bias, "use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window, "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "router_aux_loss_coef": config.router_aux_loss_coef, "moe_intermediate_size": config.moe_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, s in enumerate(sparse) if not s]}


# transformers' Qwen3MoeConfig values for fields config.json may leave out
DEFAULTS = (("num_experts_per_tok", 8), ("moe_intermediate_size", 768))

# PEFT 0.21.2 rewrites target_modules gate_proj/up_proj/down_proj to the experts on Qwen3MoeForCausalLM: the dense
# layers' MLPs (mlp_only_layers) take no adapter, and their tensors in an adapter are dropped without a word.
FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", MODULES, _read, _write, defaults=DEFAULTS, experts=EXPERTS,
                unservable_targets=("gate_proj", "up_proj", "down_proj"))
