"""DeepSeek-V3 (and the models built on its architecture): multi-head latent attention (`q_lora_rank`, null for one
`q_proj`; `kv_lora_rank`; queries and keys `qk_nope_head_dim` + `qk_rope_head_dim` wide, values `v_head_dim`; RoPE,
usually YaRN, on the `qk_rope_head_dim` part only, in interleaved pairs when `rope_interleave`, its default) and, from
layer `first_k_dense_replace` on, mixtures of experts: `n_routed_experts` of `moe_intermediate_size`, routed by
sigmoid scores with a selection bias (`e_score_correction_bias`), `n_group` groups of which `topk_group` are kept,
`num_experts_per_tok` a token, renormalised when `norm_topk_prob` and times `routed_scaling_factor`, beside
`n_shared_experts` shared experts every token runs. config.json's `head_dim` is the rotary part's width, as
transformers sets it."""

from __future__ import annotations

from jaxmodel.families.family import Family, read_experts
from jaxmodel.families.llama import MODULES as LLAMA_MODULES
from jaxmodel.families.qwen3_moe import EXPERTS  # the same per-expert hub names and fused ones

_ATTENTION = tuple((f"model.layers.{{i}}.self_attn.{name}", f"layers.self_attn.{name}") for name in (
    "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
_MOE = (
    ("model.layers.{i}.mlp.gate",                      "moe_layers.mlp.gate"),
    ("model.layers.{i}.mlp.experts",                   "moe_layers.mlp.experts"),
    ("model.layers.{i}.mlp.shared_experts.gate_proj",  "moe_layers.mlp.shared_experts.gate_proj"),
    ("model.layers.{i}.mlp.shared_experts.up_proj",    "moe_layers.mlp.shared_experts.up_proj"),
    ("model.layers.{i}.mlp.shared_experts.down_proj",  "moe_layers.mlp.shared_experts.down_proj"),
)  # fmt: skip
MODULES = LLAMA_MODULES[:2] + _ATTENTION + LLAMA_MODULES[6:] + _MOE


def _read(fields) -> dict:
    layers = fields.raw["num_hidden_layers"]
    dense = fields.get("first_k_dense_replace", int, 3)
    if dense < 0:
        raise fields.error(f"field 'first_k_dense_replace' must not be negative, got {dense}")
    count = fields.get("n_routed_experts", int, 256)
    experts = {}
    if count > 0 and dense < layers:
        experts = dict(**read_experts(fields, count), moe_intermediate_size=fields.positive("moe_intermediate_size"),
                       norm_topk_prob=fields.get("norm_topk_prob", bool, True),
                       router_groups=fields.positive("n_group", 8), router_top_groups=fields.positive("topk_group", 4),
                       routed_scaling_factor=float(fields.get("routed_scaling_factor", (int, float), 2.5)),
                       shared_experts=fields.get("n_shared_experts", int, 1),
                       sparse_layers=tuple(i >= dense for i in range(layers)))
    bias = fields.get("attention_bias", bool, False)
    q_lora_rank = fields.get("q_lora_rank", int, None)
    if q_lora_rank is not None and q_lora_rank <= 0:
        raise fields.error(f"field 'q_lora_rank' must be a positive integer or null, got {q_lora_rank!r}")
    return dict(head_dim=fields.positive("qk_rope_head_dim", 64), qk_nope_head_dim=fields.positive(
                    "qk_nope_head_dim", 128), v_head_dim=fields.positive("v_head_dim", 128),
                q_lora_rank=q_lora_rank or 0, kv_lora_rank=fields.positive("kv_lora_rank", 512),
                rope_interleave=fields.get("rope_interleave", bool, True), qkv_bias=bias, o_bias=bias, mlp_bias=False,
                prediction_layers=fields.get("num_nextn_predict_layers", int, 1), **experts)


def _write(config) -> dict:
    if config.qkv_bias != config.o_bias or config.mlp_bias or config.qk_norm or not config.kv_lora_rank:
        raise ValueError("DeepSeek-V3 has latent attention, one attention_bias and no MLP bias or q/k norms")
    return {"attention_bias": config.qkv_bias, "q_lora_rank": config.q_lora_rank or None,
            "kv_lora_rank": config.kv_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
            "qk_rope_head_dim": config.head_dim, "v_head_dim": config.v_head_dim,
            "rope_interleave": config.rope_interleave, "num_nextn_predict_layers": config.prediction_layers,
            **_write_experts(config)}


def _write_experts(config) -> dict:
    sparse = config.sparse_layers or (False,) * config.num_hidden_layers
    dense = sparse.index(True) if True in sparse else config.num_hidden_layers
    if any(not s for s in sparse[dense:]) or (config.num_experts and not config.router_groups) or \
            config.round_router_weights:
        raise ValueError("DeepSeek-V3's dense layers come first, then sparse ones routed by groups")
    if not config.num_experts:
        return {"first_k_dense_replace": dense, "n_routed_experts": 0}
    return {"first_k_dense_replace": dense, "n_routed_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok, "moe_intermediate_size": config.moe_intermediate_size,
            "norm_topk_prob": config.norm_topk_prob, "n_group": config.router_groups,
            "topk_group": config.router_top_groups, "routed_scaling_factor": config.routed_scaling_factor,
            "n_shared_experts": config.shared_experts, "router_aux_loss_coef": config.router_aux_loss_coef}


# transformers' DeepseekV3Config values for fields config.json may leave out, where the common reading has none
DEFAULTS = (("bos_token_id", 0), ("eos_token_id", 1))

# PEFT 0.21.2 on DeepseekV3ForCausalLM takes these names for the routed experts, also for the shared experts and the
# dense layers' MLPs
FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", MODULES, _read, _write, defaults=DEFAULTS, experts=EXPERTS,
                unservable_targets=("gate_proj", "up_proj", "down_proj"))
