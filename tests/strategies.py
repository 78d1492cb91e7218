"""Hypothesis strategies for Llama configs and inputs, shared by the test modules."""

from hypothesis import strategies as st


@st.composite
def llama_configs(draw, max_layers: int = 3) -> dict:
    """A transformers config dict over the space the port must match: GQA ratios, head_dim override,
    biases, tying, and llama3 RoPE scaling whose original context is short enough to bite."""
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([4, 8, 16, 32]))
    override = draw(st.booleans())
    # transformers requires hidden % heads == 0 even when head_dim is given explicitly.
    hidden = heads * draw(st.sampled_from([4, 8, 12, 16, 24])) if override else heads * head_dim
    if draw(st.booleans()):
        rope = {"rope_type": "llama3", "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
                "factor": draw(st.floats(1.0, 32.0)), "low_freq_factor": (low := draw(st.floats(0.5, 2.0))),
                "high_freq_factor": low + draw(st.floats(0.5, 6.0)),
                "original_max_position_embeddings": draw(st.sampled_from([8, 32, 128, 512]))}
    else:
        rope = {"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 500000.0]))}
    config = {
        "model_type": "llama",
        "vocab_size": draw(st.integers(16, 300)),
        "hidden_size": hidden,
        "intermediate_size": draw(st.integers(8, 160)),
        "num_hidden_layers": draw(st.integers(1, max_layers)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 1024,
        "rms_norm_eps": draw(st.sampled_from([1e-5, 1e-6])),
        "rope_parameters": rope,
        "tie_word_embeddings": draw(st.booleans()),
        "attention_bias": draw(st.booleans()),
        "mlp_bias": draw(st.booleans()),
        # Larger than transformers' 0.02 so attention and RoPE move the logits well above the tolerance.
        "initializer_range": draw(st.sampled_from([0.05, 0.1, 0.2])),
    }
    if override:
        config["head_dim"] = head_dim
    return config


def batches(max_seq: int = 520):
    """(batch, seq) pairs; long sequences are drawn often enough that RoPE scaling is exercised."""
    return st.tuples(st.integers(1, 3), st.one_of(st.integers(1, 24), st.integers(max_seq * 3 // 4, max_seq)))


# Sequence lengths on the model's causal query-block path without a cache: a multiple of 4 blocks with at
# least 64 positions per block (jaxmodel's CAUSAL_BLOCKS, CAUSAL_BLOCK_MIN).
BLOCKED_LENGTHS = (256, 320, 512)


@st.composite
def left_padded_batches(draw, max_short: int = 40) -> tuple[int, list[int]]:
    """(seq, real lengths of the rows): rows left-padded to `seq`, the first one full. Half the draws take
    a length from BLOCKED_LENGTHS, so that padding meets the query blocks."""
    seq = draw(st.one_of(st.integers(2, max_short), st.sampled_from(BLOCKED_LENGTHS)))
    others = draw(st.lists(st.integers(1, seq), min_size=1, max_size=2))
    return seq, [seq, *others]


@st.composite
def family_configs(draw, model_type: str, max_layers: int = 3) -> dict:
    """A transformers config dict of `model_type` ("llama", "mistral", "qwen2", "qwen3", "gemma3_text") with its
    own switches drawn: Mistral's window on every layer or none; Qwen's windows honoured only with
    `use_sliding_window`, on the layers from `max_window_layers` on; Qwen3's `attention_bias`; Gemma 3's layer
    types, its two RoPEs (the global one linearly scaled or not), `query_pre_attn_scalar` and activation. Windows
    short enough to bite on drawn lengths."""
    base = draw(llama_configs(max_layers=max_layers))
    if model_type == "llama":
        return base
    config = {k: v for k, v in base.items() if k not in ("attention_bias", "mlp_bias")}
    config["model_type"] = model_type
    if model_type == "gemma3_text":
        return _gemma3(draw, config)
    config["rope_parameters"] = {**draw(st.one_of(st.just({"rope_type": "default"}), yarn_ropes())),
                                 "rope_theta": draw(st.sampled_from([10000.0, 1e6]))}
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    if model_type == "mistral":
        config["sliding_window"] = window
    else:
        config.update(use_sliding_window=window is not None, sliding_window=window or 4096,
                      max_window_layers=draw(st.integers(0, config["num_hidden_layers"])))
    if model_type == "qwen2":  # head_dim is hidden / heads there
        config.pop("head_dim", None)
        config["hidden_size"] = config["num_attention_heads"] * draw(st.sampled_from([4, 8, 16]))
    if model_type == "qwen3":
        config["attention_bias"] = draw(st.booleans())
    return config


@st.composite
def yarn_ropes(draw) -> dict:
    """YaRN's `rope_parameters` (without `rope_theta`): an original context short enough that the ramp bites, the
    attention factor from the factor alone, from two mscales or given."""
    rope = {"rope_type": "yarn", "factor": draw(st.floats(1.5, 40.0)),
            "original_max_position_embeddings": draw(st.sampled_from([8, 32, 128]))}
    scaling = draw(st.sampled_from(["factor", "mscales", "given"]))
    if scaling == "mscales":
        rope.update(mscale=draw(st.floats(0.5, 1.5)), mscale_all_dim=draw(st.floats(0.5, 1.5)))
    if scaling == "given":
        rope["attention_factor"] = draw(st.floats(0.8, 1.5))
    return rope


def _gemma3(draw, config: dict) -> dict:
    layers = config["num_hidden_layers"]
    config["head_dim"] = head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    full = draw(st.sampled_from([{"rope_type": "default"}, {"rope_type": "linear", "factor": 8.0}]))
    config["rope_parameters"] = {
        "full_attention": {**full, "rope_theta": draw(st.sampled_from([1e6, 500000.0]))},
        "sliding_attention": {"rope_type": "default", "rope_theta": draw(st.sampled_from([10000.0, 1000.0]))},
    }
    if draw(st.booleans()):
        config["layer_types"] = draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                              min_size=layers, max_size=layers))
    else:
        config["sliding_window_pattern"] = draw(st.integers(1, 3))
    config["sliding_window"] = draw(st.integers(1, 40))
    config["query_pre_attn_scalar"] = draw(st.sampled_from([head_dim, 2 * head_dim, 12]))
    config["hidden_activation"] = draw(st.sampled_from(["gelu_pytorch_tanh", "silu"]))
    config["attention_bias"] = draw(st.booleans())
    return config


@st.composite
def moe_configs(draw, model_type: str, max_layers: int = 3) -> dict:
    """A transformers config dict of a mixture of experts ("qwen3_moe", "mixtral"): 2-6 experts, 1-4 of them a
    token, Qwen3-MoE's `norm_topk_prob` either way and its dense layers (`mlp_only_layers`, `decoder_sparse_step`)
    mixed with the sparse ones, over drawn attention shapes (Qwen3-MoE's window on every layer or none)."""
    base = draw(llama_configs(max_layers=max_layers))
    config = {k: v for k, v in base.items() if k not in ("attention_bias", "mlp_bias", "rope_parameters")}
    config.update(model_type=model_type, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    experts = draw(st.integers(2, 6))
    config["num_experts_per_tok"] = draw(st.integers(1, min(4, experts)))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    config["sliding_window"] = window
    if model_type == "mixtral":
        return {**config, "num_local_experts": experts}
    layers = config["num_hidden_layers"]
    config.update(num_experts=experts, moe_intermediate_size=draw(st.integers(4, 40)),
                  norm_topk_prob=draw(st.booleans()), attention_bias=draw(st.booleans()),
                  use_sliding_window=window is not None, decoder_sparse_step=draw(st.sampled_from([1, 1, 2])),
                  mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=layers - 1, unique=True)))
    return config
