"""DeepSeek-V3 (and the models built on its architecture): multi-head latent attention (`q_lora_rank`, null for one
`q_proj`; `kv_lora_rank`; queries and keys `qk_nope_head_dim` + `qk_rope_head_dim` wide, values `v_head_dim`; RoPE,
usually YaRN, on the `qk_rope_head_dim` part only, in interleaved pairs when `rope_interleave`, its default) and, from
layer `first_k_dense_replace` on, mixtures of experts. config.json's `head_dim` is the rotary part's width, as
transformers sets it. This port runs the dense layers so far: a config with sparse layers is refused in one line."""

from __future__ import annotations

from jaxmodel.families.family import Family
from jaxmodel.families.llama import MODULES as LLAMA_MODULES

_ATTENTION = tuple((f"model.layers.{{i}}.self_attn.{name}", f"layers.self_attn.{name}") for name in (
    "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"))
MODULES = LLAMA_MODULES[:2] + _ATTENTION + LLAMA_MODULES[6:]


def _read(fields) -> dict:
    layers = fields.raw["num_hidden_layers"]
    dense = fields.get("first_k_dense_replace", int, 3)
    if dense < layers and fields.get("n_routed_experts", int, 256) > 0:
        raise fields.error(f"field 'first_k_dense_replace' is {dense}, below the {layers} layers: DeepSeek-V3's "
                           "mixtures of experts are not supported yet (only its dense layers run)")
    bias = fields.get("attention_bias", bool, False)
    q_lora_rank = fields.get("q_lora_rank", int, None)
    if q_lora_rank is not None and q_lora_rank <= 0:
        raise fields.error(f"field 'q_lora_rank' must be a positive integer or null, got {q_lora_rank!r}")
    return dict(head_dim=fields.positive("qk_rope_head_dim", 64), qk_nope_head_dim=fields.positive(
                    "qk_nope_head_dim", 128), v_head_dim=fields.positive("v_head_dim", 128),
                q_lora_rank=q_lora_rank or 0, kv_lora_rank=fields.positive("kv_lora_rank", 512),
                rope_interleave=fields.get("rope_interleave", bool, True), qkv_bias=bias, o_bias=bias, mlp_bias=False)


def _write(config) -> dict:
    if config.qkv_bias != config.o_bias or config.mlp_bias or config.qk_norm or not config.kv_lora_rank:
        raise ValueError("DeepSeek-V3 has latent attention, one attention_bias and no MLP bias or q/k norms")
    return {"attention_bias": config.qkv_bias, "q_lora_rank": config.q_lora_rank or None,
            "kv_lora_rank": config.kv_lora_rank, "qk_nope_head_dim": config.qk_nope_head_dim,
            "qk_rope_head_dim": config.head_dim, "v_head_dim": config.v_head_dim,
            "rope_interleave": config.rope_interleave, "first_k_dense_replace": config.num_hidden_layers}


# transformers' DeepseekV3Config values for fields config.json may leave out, where the common reading has none
DEFAULTS = (("bos_token_id", 0), ("eos_token_id", 1))

FAMILY = Family("deepseek_v3", "DeepseekV3ForCausalLM", MODULES, _read, _write, defaults=DEFAULTS)
