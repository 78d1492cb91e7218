"""Llama (2, 3.x): the decoder without switches; one `attention_bias` for q, k, v and o, and `mlp_bias`."""

from __future__ import annotations

from jaxmodel.families.family import Family

#   HF module                                    JAX module
MODULES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens",                         "embed_tokens"),
    ("model.layers.{i}.input_layernorm",           "layers.input_layernorm"),
    ("model.layers.{i}.self_attn.q_proj",          "layers.self_attn.q_proj"),
    ("model.layers.{i}.self_attn.k_proj",          "layers.self_attn.k_proj"),
    ("model.layers.{i}.self_attn.v_proj",          "layers.self_attn.v_proj"),
    ("model.layers.{i}.self_attn.o_proj",          "layers.self_attn.o_proj"),
    ("model.layers.{i}.post_attention_layernorm",  "layers.post_attention_layernorm"),
    ("model.layers.{i}.mlp.gate_proj",             "layers.mlp.gate_proj"),
    ("model.layers.{i}.mlp.up_proj",               "layers.mlp.up_proj"),
    ("model.layers.{i}.mlp.down_proj",             "layers.mlp.down_proj"),
    ("model.norm",                                 "norm"),
    ("lm_head",                                    "lm_head"),
)  # fmt: skip


def _read(fields) -> dict:
    bias = fields.get("attention_bias", bool, False)
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=fields.get("mlp_bias", bool, False))


def _write(config) -> dict:
    if config.qkv_bias != config.o_bias:
        raise ValueError("Llama's config.json has one attention_bias for q, k, v and o")
    return {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}


FAMILY = Family("llama", "LlamaForCausalLM", MODULES, _read, _write)
