"""Gemma 3 (text): every RMSNorm scales by `1 + weight`; norms on attention's and the MLP's outputs too (sandwich
norms); per-head q/k norms; embeddings times sqrt(hidden_size); a GELU (tanh) gate; scores scaled by
`query_pre_attn_scalar`; windowed (local) and global layers by `layer_types`, each kind with its own RoPE."""

from __future__ import annotations

from jaxmodel.families.family import LAYER_TYPES, SUPPORTED_ACTIVATIONS, Family, read_layer_types
from jaxmodel.families.llama import MODULES as LLAMA_MODULES

#   HF module                                     JAX module
MODULES: tuple[tuple[str, str], ...] = (
    *LLAMA_MODULES[:6],
    ("model.layers.{i}.self_attn.q_norm",           "layers.self_attn.q_norm"),
    ("model.layers.{i}.self_attn.k_norm",           "layers.self_attn.k_norm"),
    # Gemma's post_attention_layernorm norms attention's output; its pre_feedforward_layernorm is the norm
    # before the MLP, which Llama (and this port) calls post_attention_layernorm.
    ("model.layers.{i}.post_attention_layernorm",   "layers.attn_output_norm"),
    ("model.layers.{i}.pre_feedforward_layernorm",  "layers.post_attention_layernorm"),
    ("model.layers.{i}.post_feedforward_layernorm", "layers.mlp_output_norm"),
    *LLAMA_MODULES[7:],
)  # fmt: skip

# transformers' Gemma3TextConfig defaults where config.json leaves a field out
DEFAULTS = (("vocab_size", 262_208), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
            ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
            ("max_position_embeddings", 131_072), ("tie_word_embeddings", True), ("bos_token_id", 2),
            ("eos_token_id", 1), ("pad_token_id", 0))
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
DEFAULT_PATTERN = 6  # every sixth layer global


def _read(fields) -> dict:
    raw = fields.raw
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(name) is not None:
            raise fields.error(f"field '{name}' is {raw[name]!r}; Gemma 3 has none (null)")
    if raw.get("use_bidirectional_attention"):
        raise fields.error("field 'use_bidirectional_attention' is true; only causal attention is supported")
    act = fields.get("hidden_activation", str, "gelu_pytorch_tanh")
    if act not in SUPPORTED_ACTIVATIONS:
        raise fields.error(f"field 'hidden_activation' is {act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    scalar = fields.get("query_pre_attn_scalar", (int, float), 256)
    if scalar <= 0:
        raise fields.error(f"field 'query_pre_attn_scalar' must be positive, got {scalar!r}")
    sliding = read_layer_types(fields)
    if sliding is None:
        pattern = fields.positive("sliding_window_pattern", DEFAULT_PATTERN)
        sliding = tuple(bool((i + 1) % pattern) for i in range(fields.raw["num_hidden_layers"]))
    if "sliding_window" in raw and raw["sliding_window"] is None:  # transformers' Gemma 3 cannot run without one
        raise fields.error("field 'sliding_window' must be a positive integer, got None")
    window = fields.positive("sliding_window", 4096)
    global_rope, local_rope = _ropes(fields)
    bias = fields.get("attention_bias", bool, False)
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_act=act,
        query_pre_attn_scalar=float(scalar),
        sliding_window=window if any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
        rope=global_rope,
        local_rope=local_rope,
    )


def _ropes(fields):
    """The global and local layers' RoPE, as transformers' Gemma3TextConfig reads them: `rope_parameters` by layer
    type, or the older `rope_theta` (global), `rope_local_base_freq` (local) and `rope_scaling` (global)."""
    raw = fields.raw
    nested = raw.get("rope_parameters")
    if nested is not None and not (isinstance(nested, dict) and set(nested) <= set(LAYER_TYPES)):
        raise fields.error(f"field 'rope_parameters' must map {' and '.join(LAYER_TYPES)} to their RoPE")
    nested = {kind: dict((nested or {}).get(kind) or {"rope_type": "default"}) for kind in LAYER_TYPES}
    if isinstance(raw.get("rope_scaling"), dict):
        nested["full_attention"].update(raw["rope_scaling"])
    nested["full_attention"].setdefault("rope_theta", raw.get("rope_theta", DEFAULT_THETA["full_attention"]))
    nested["sliding_attention"].setdefault(
        "rope_theta", raw.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"]))
    return tuple(fields.rope(nested[kind], f"rope_parameters.{kind}") for kind in LAYER_TYPES)


def _write(config) -> dict:
    if (config.qkv_bias != config.o_bias or config.mlp_bias or not config.qk_norm or not config.norm_unit_offset
            or not config.sandwich_norms or not config.scale_embeddings):
        raise ValueError("Gemma 3 has q/k norms, sandwich norms of 1 + weight, scaled embeddings and no MLP bias")
    sliding = config.sliding_layers or (False,) * config.num_hidden_layers
    return {
        "hidden_activation": config.hidden_act,
        "attention_bias": config.qkv_bias,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "sliding_window": config.sliding_window or 4096,
        "layer_types": [LAYER_TYPES[s] for s in sliding],
        "rope_parameters": {"full_attention": config.rope.to_hf(),
                            "sliding_attention": (config.local_rope or config.rope).to_hf()},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


FAMILY = Family("gemma3_text", "Gemma3ForCausalLM", MODULES, _read, _write, DEFAULTS)


# Gemma3ForConditionalGeneration (4B and up): the same decoder under `text_config`, its tensors under
# `language_model.` in the checkpoint (`model.language_model.` in the class as it runs), beside a vision tower.
MULTIMODAL_MODULES = tuple((f"language_model.{hf}", jax) for hf, jax in MODULES)
MULTIMODAL = Family("gemma3", "Gemma3ForConditionalGeneration", MULTIMODAL_MODULES, _read, _write, DEFAULTS,
                    text_config="text_config", text_model_type="gemma3_text",
                    runtime_prefixes=(("language_model.model.", "model.language_model."),
                                      ("language_model.lm_head", "lm_head")),
                    other_tensors=r"(vision_tower|multi_modal_projector)\..*",
                    adapter_excludes=r"model\.(vision_tower|multi_modal_projector)\..*")
