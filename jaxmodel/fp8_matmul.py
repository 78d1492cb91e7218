"""Matmuls in FP8 against an fp8 base (`jaxmodel.quantization`'s `block x block` blocks of e4m3 codes), for backends
with FP8 matrix units (H100, H200: e4m3fn; MI300X: e4m3fnuz), instead of dequantizing each weight to the compute
dtype first.

The activations `x [..., in]` are quantized per `1 x block` tile of the input dimension, as DeepSeek-V3 trains: a
tile's float32 `scale = amax / FP8 max` (1 for an all-zero tile) and `code = fp8(clip(x / scale, ±max))`, rounded to
nearest even. Each `block` of the input dimension is then one FP8 product (float32 accumulation), scaled by its
activation tile's scale and its weight block's scale and summed in float32:

    y[n, o] = sum_k  sx[n, k] * sw[o // block, k] * sum_{j in block k}  qx[n, j] * qw[o, j]

The weights' codes are used as stored: the same products as the dequantized path on the quantized activations.
With e4m3fnuz the codes are `quantization.fnuz_codes`'s (the bits kept, the scales doubled, -0 made 0: every value
kept) and the activations are quantized to e4m3fnuz (largest 240). Against the dequantized path each activation moves
by its rounding only: at most 2^-4 of its magnitude (three mantissa bits, round to nearest) or, below the smallest
normal, half the smallest subnormal times its tile's scale (`activation_error_bound`), so that
`|y_fp8 - y| <= sum_j bound_j * |w_oj|` (tests/test_fp8_matmul.py). The input dimension goes through in chunks of
`CHUNK_BLOCKS` blocks, so that no `[..., in / block, out]` float32 product of all blocks is ever held.

The backward pass multiplies by the dequantized weight (the gradient of the dequantized path, the activations'
rounding passed straight through): the base is frozen, so only the activations' gradient is needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxmodel.quantization import FP8, FP8_FNUZ, FP8_MATMULS, Quantization, dequantize, fnuz_codes

FORMATS = dict(zip(FP8_MATMULS, (FP8, FP8_FNUZ)))
CHUNK_BLOCKS = 8  # blocks of the input dimension a step of the loop multiplies (at most): 1024 values at 128


def fp8_max(fmt: str) -> np.float32:
    return np.float32(ml_dtypes.finfo(FORMATS[fmt]).max)


def quantize_tiles(x: jax.Array, block: int, fmt: str) -> tuple[jax.Array, jax.Array]:
    """(codes `[..., in / block, block]` in `fmt`, float32 scales `[..., in / block]`) of `x [..., in]` per
    `1 x block` tile; the input dimension zero-padded to whole tiles."""
    *lead, i = x.shape
    tiles = -(-i // block)
    x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, tiles * block - i)]).reshape(*lead, tiles, block)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / fp8_max(fmt), jnp.float32(1))
    scaled = jnp.clip(x / scale[..., None], -fp8_max(fmt), fp8_max(fmt))
    # A value that rounds to zero made +0 first: e4m3fnuz has no -0, and XLA:CPU's unfused conversion (its quick
    # compile flags) wrote a negative value rounding to zero as 0x80, e4m3fnuz's NaN.
    half_tiny = np.float32(ml_dtypes.finfo(FORMATS[fmt]).smallest_subnormal) / 2
    codes = jnp.where(jnp.abs(scaled) <= half_tiny, jnp.float32(0), scaled).astype(FORMATS[fmt])
    return codes, scale


def activation_error_bound(x: np.ndarray, block: int, fmt: str) -> np.ndarray:
    """The most each value of `x [..., in]` moves when `quantize_tiles` rounds it (numpy, float64)."""
    *lead, i = x.shape
    tiles = -(-i // block)
    padded = np.zeros((*lead, tiles * block))
    padded[..., :i] = x
    tiled = padded.reshape(*lead, tiles, block)
    amax = np.abs(tiled).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / float(fp8_max(fmt)), 1.0)
    info = ml_dtypes.finfo(FORMATS[fmt])
    relative = 2.0 ** -(info.nmant + 1)  # half an ulp of a normal value, relative to it
    absolute = float(info.smallest_subnormal) / 2 * scale  # half the smallest subnormal, scaled
    return np.maximum(np.abs(tiled) * relative, absolute).reshape(*lead, tiles * block)[..., :i]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array, quantization: Quantization) -> jax.Array:
    """float32 `x @ w.T` `[..., out]` for the fp8 weight `w [out, in]` held as `codes` (uint8 bits, as the model
    holds them) and `scales` `[ceil(out / block), ceil(in / block)]`, multiplied in `quantization.matmul`'s FP8."""
    return fp8_product(x, codes, scales, quantization)


def fp8_product(x, codes, scales, quantization: Quantization):
    """`fp8_matmul`'s forward alone, for callers with a backward pass of their own."""
    fmt, block = quantization.matmul, quantization.block
    out, i = codes.shape
    if fmt == "e4m3fnuz":
        codes, scales = fnuz_codes(codes, scales, xp=jnp)
    tiles = -(-i // block)
    per_chunk = min(CHUNK_BLOCKS, tiles)
    chunks = -(-tiles // per_chunk)
    padded_tiles = chunks * per_chunk  # zero blocks (codes 0) past the last: they add nothing
    qx, sx = quantize_tiles(x, block, fmt)
    *lead, _, _ = qx.shape
    qx = jnp.pad(qx, [(0, 0)] * len(lead) + [(0, padded_tiles - tiles), (0, 0)])
    sx = jnp.pad(sx, [(0, 0)] * len(lead) + [(0, padded_tiles - tiles)])
    qw = jax.lax.bitcast_convert_type(jnp.pad(jax.lax.bitcast_convert_type(codes, jnp.uint8),
                                              [(0, 0), (0, padded_tiles * block - i)]), FORMATS[fmt])
    qw = qw.reshape(out, padded_tiles, block)
    # each output row's scale of each block of the input dimension
    sw = jnp.pad(jnp.repeat(scales.astype(jnp.float32), block, axis=0)[:out], [(0, 0), (0, padded_tiles - tiles)])

    def chunk(c):
        start = c * per_chunk
        qx_c = jax.lax.dynamic_slice_in_dim(qx, start, per_chunk, axis=-2)
        products = jnp.einsum("...kb,okb->...ko", qx_c, jax.lax.dynamic_slice_in_dim(qw, start, per_chunk, 1),
                              preferred_element_type=jnp.float32)
        sx_c = jax.lax.dynamic_slice_in_dim(sx, start, per_chunk, axis=-1)
        sw_c = jax.lax.dynamic_slice_in_dim(sw, start, per_chunk, axis=1)
        return jnp.einsum("...ko,...k,ok->...o", products, sx_c, sw_c)

    # the first chunk outside the loop: the sum carried through it then has the products' type (inside shard_map,
    # the mesh axes they vary over), which zeros would not
    y = chunk(0)
    return y if chunks == 1 else jax.lax.fori_loop(1, chunks, lambda c, y: y + chunk(c), y)


def _fp8_matmul_fwd(x, codes, scales, quantization):
    # an empty array of x's dtype: the dtype the gradient is returned in
    return fp8_product(x, codes, scales, quantization), (codes, scales, jnp.zeros((0,), x.dtype))


def _fp8_matmul_bwd(quantization, residuals, dy):
    codes, scales, like_x = residuals
    x_dtype = like_x.dtype
    w = dequantize(codes, scales, quantization, x_dtype)
    dx = jnp.einsum("...o,oi->...i", dy.astype(x_dtype), w, preferred_element_type=jnp.float32).astype(x_dtype)
    # the frozen codes and scales get no gradient
    return dx, np.zeros(codes.shape, jax.dtypes.float0), jnp.zeros_like(scales)


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)
