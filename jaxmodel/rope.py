"""Rotary position embeddings in the rotate-half layout HF Llama checkpoints use."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodel import scopes
from jaxmodel.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 inverse frequencies `[head_dim // 2]`, as transformers computes them.

    Every step is the float32 op transformers' `_compute_llama3_parameters` performs, in its order. The
    one op numpy cannot reproduce is torch's float32 `pow`: it is taken in float64 and rounded, which
    equals torch for the real Llama configs (theta 1e4 or 5e5, head_dim 64/128) and is within 1 ulp of
    it elsewhere (tests/test_rope.py).
    """
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
    base_pow = np.power(np.float64(f32(rope.theta)), exponent.astype(np.float64)).astype(f32)
    inv = f32(1.0) / base_pow
    if rope.type == "default":
        return inv
    if rope.type == "linear":
        return inv / f32(rope.factor)
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim, base_pow)
    # Python-number arithmetic happens in float64 as in transformers; `scalar / tensor` is torch's
    # `tensor.reciprocal() * scalar`.
    factor = f32(rope.factor)
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = f32(old_len / low)
    high_freq_wavelen = f32(old_len / high)
    wavelen = (f32(1) / inv) * f32(2 * math.pi)
    inv_llama = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = ((f32(1) / wavelen) * f32(old_len) - f32(low)) / f32(high - low)
    smoothed = (f32(1) - smooth) * inv_llama / factor + smooth * inv_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_llama).astype(f32)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, base_pow: np.ndarray) -> np.ndarray:
    """YaRN's frequencies as transformers' `_compute_yarn_parameters` computes them: each frequency between its
    extrapolated value (`1 / theta^(2i/d)`) and its value interpolated `factor` times, by a linear ramp over the
    dimensions whose wavelengths turn between `beta_fast` and `beta_slow` times in the original context."""
    f32 = np.float32
    old_len = rope.original_max_position_embeddings

    def correction_dim(rotations):  # Python floats, as transformers' math
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
    extrapolation = f32(1) - ramp
    inv_extrapolated = f32(1.0) / base_pow
    inv_interpolated = f32(1.0) / (f32(rope.factor) * base_pow)
    return (inv_interpolated * (f32(1) - extrapolation) + inv_extrapolated * extrapolation).astype(f32)


def cos_sin(positions_bt: jnp.ndarray, inv_freq_f: np.ndarray, dtype,
            scale: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin `[batch, seq, head_dim]` for integer positions, computed in float32, times `scale` (YaRN's
    `RopeConfig.attention_scaling`), cast to `dtype`."""
    freqs_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_f)
    emb_btd = jnp.concatenate([freqs_btf, freqs_btf], axis=-1)
    cos, sin = jnp.cos(emb_btd), jnp.sin(emb_btd)
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x_btnd: jnp.ndarray, cos_btd: jnp.ndarray, sin_btd: jnp.ndarray) -> jnp.ndarray:
    """`x * cos + rotate_half(x) * sin` with cos/sin broadcast over the heads axis, computed in float32 and rounded
    once to x's dtype: in bf16, XLA:CPU would run each of the rotation's operations (and their recomputation and
    gradients) between two conversions (docs/design.md, "Numerics"; `jaxmodel.layers.swiglu` likewise)."""
    with jax.named_scope(scopes.ROPE):
        half = x_btnd.shape[-1] // 2
        x32 = x_btnd.astype(jnp.float32)
        cos32, sin32 = (c.astype(jnp.float32)[:, :, None, :] for c in (cos_btd, sin_btd))
        rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
        return (x32 * cos32 + rotated * sin32).astype(x_btnd.dtype)
