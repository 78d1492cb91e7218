"""RoPE frequencies against transformers' own computation."""

import numpy as np
import pytest
from hypothesis import given
from strategies import llama_configs
from transformers import LlamaConfig as HFLlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jaxmodel.config import ModelConfig
from jaxmodel.rope import inv_freq

REAL = {  # (head_dim, rope) of the Llama 3.x family, from their published config.json files
    "3.1-8B/70B/405B": (128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "3.2-1B": (64, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "3.2-3B": (128, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "3-8B": (128, {"rope_type": "default", "rope_theta": 500000.0}),
}
YARN = {  # (head_dim, rope): DeepSeek-V3's (its rotary part of 64), and Qwen2.5's long-context setting
    "DeepSeek-V3": (64, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    "Qwen2.5 at 128k": (128, {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                              "original_max_position_embeddings": 32768}),
    "mscales apart": (32, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "mscale": 0.707,
                           "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "beta_fast": 8}),
    "untruncated": (16, {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 2.5, "truncate": False,
                         "original_max_position_embeddings": 128, "attention_factor": 1.25}),
}


def both(head_dim: int, rope: dict, scaling: bool = False):
    raw = {"model_type": "llama", "vocab_size": 8, "hidden_size": head_dim * 2, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": head_dim, "rope_parameters": rope,
           "max_position_embeddings": 131072}
    rotary = LlamaRotaryEmbedding(HFLlamaConfig(**raw))
    ours = ModelConfig.from_hf(raw).rope
    if scaling:
        return (inv_freq(ours, head_dim), ours.attention_scaling), (rotary.inv_freq.numpy(), rotary.attention_scaling)
    return inv_freq(ours, head_dim), rotary.inv_freq.numpy()


@pytest.mark.parametrize("name", YARN)
def test_yarn_frequencies_and_attention_factor_are_transformers(name):
    """YaRN's frequencies within torch's float32 pow (bit for bit on DeepSeek-V3's; one ulp where torch's pow is
    not correctly rounded, as at theta 1e6) and its cos/sin scaling (from the factor and mscales, or given)."""
    (ours, our_scaling), (theirs, their_scaling) = both(*YARN[name], scaling=True)
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32).astype(np.int64))
    assert ulps.max() <= (0 if name == "DeepSeek-V3" else 1)
    plain, _ = both(YARN[name][0], {"rope_type": "default", "rope_theta": YARN[name][1]["rope_theta"]})
    assert not np.array_equal(ours, plain) and our_scaling == pytest.approx(their_scaling, rel=1e-12)
    assert (our_scaling == 1.0) == (name == "DeepSeek-V3")  # equal mscales: 1 (its softmax scale takes mscale^2)


@pytest.mark.parametrize("name", REAL)
def test_real_configs_match_bit_for_bit(name):
    ours, theirs = both(*REAL[name])
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, theirs)


def test_llama3_scaling_changes_the_low_frequencies():
    scaled, _ = both(*REAL["3.1-8B/70B/405B"])
    plain, _ = both(128, {"rope_type": "default", "rope_theta": 500000.0})
    assert np.array_equal(scaled[:10], plain[:10]) and not np.array_equal(scaled[-10:], plain[-10:])


@pytest.mark.slow
@given(llama_configs())
def test_drawn_configs_within_one_ulp(raw):
    """torch's float32 pow is not correctly rounded, so a drawn theta/head_dim may differ in the last bit."""
    config = HFLlamaConfig(**raw)
    ours, theirs = both(config.head_dim, raw["rope_parameters"])
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1


def test_a_16_bit_rotation_is_the_float32_one_rounded_once():
    """In bf16 the rotation is computed in float32 from the bf16 inputs and rounded once (numpy's float32 computation
    rounded, bit for bit), as a fused kernel does: XLA:CPU would otherwise run each bf16 operation as a float32 one
    between two conversions, in the forward pass, its recomputation and the backward pass of the layer scan."""
    import jax.numpy as jnp
    import ml_dtypes

    from jaxmodel.rope import apply_rope, cos_sin

    rng = np.random.default_rng(0)
    b, t, n, h = 2, 64, 4, 32
    x = rng.normal(size=(b, t, n, h)).astype(ml_dtypes.bfloat16)
    positions = np.broadcast_to(np.arange(t), (b, t))
    cos, sin = cos_sin(jnp.asarray(positions), inv_freq(ModelConfig.from_hf(
        {"model_type": "llama", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "head_dim": h}).rope, h), jnp.bfloat16)
    ours = apply_rope(jnp.asarray(x), cos, sin)
    assert ours.dtype == jnp.bfloat16

    x32, c32, s32 = (np.asarray(a, np.float32) for a in (x, cos, sin))
    rotated = np.concatenate([-x32[..., h // 2:], x32[..., :h // 2]], axis=-1)
    expected = (x32 * c32[:, :, None, :] + rotated * s32[:, :, None, :]).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint16), expected.view(np.uint16))
