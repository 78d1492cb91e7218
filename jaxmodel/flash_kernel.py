"""This package's own flash attention kernel, in Pallas (Triton on GPUs; Pallas' interpreter on a CPU, for tests).

No kernel of the installed JAX stack takes what context parallelism's chunks need: a query offset (the chunk's
queries start after key 0) with the queries' and the keys' segment ids apart. This one takes, forward and
backward: causal masking from a query offset, packed rows (separate query and key segment ids, 0 padding), grouped
KV heads read as they are (query head j reads KV head j // r; nothing repeated), a sliding window, and the offset and
window as traced values (a layer scan's window, a device's chunk under `cp`). The mask is
`jaxmodel.attention`'s: key j is visible to query i iff `0 <= q_offset + i - j < window` and their segments are
equal and not 0; a query that sees no key gets zeros.

The forward pass: one program a (query block, row, query head) walks the key blocks its queries can see (from the
window's first to the causal diagonal's), with FlashAttention-2's running max, sum and output, and writes the
output and each query's log-sum-exp. The backward pass: delta = rowsum(out * d_out) in XLA, then two kernels: dQ,
one program a (query block, row, query head) walking the same key blocks; dK and dV, one program a (key block, row,
KV head) walking the r query heads of its group and the query blocks that can see the key block (so no atomics and
no per-query-head dK/dV to sum afterwards). Scores and sums are float32, the matmuls' operands the inputs' dtype.

Shapes: b batch, t queries, s keys, n query heads, k kv heads, r = n // k, h head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

# Block sizes (queries x keys) of the forward and backward kernels: powers of two of at least 16 (Triton's dot).
# Untuned: a GPU's measurement should set them.
BLOCK_Q = 64
BLOCK_KV = 64
# The window of a call without one: more keys than any sequence has (and far from int32's end, as the kernels add
# positions to it).
NO_WINDOW = 1 << 30

_NEG = float(jnp.finfo(jnp.float32).min)


def flash_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset=0, window=None, *, scale: float,
                    block_q: int = BLOCK_Q, block_kv: int = BLOCK_KV, interpret: bool | None = None):
    """Causal attention `[b, t, n, h]` under the module docstring's mask. The kernels see sequences padded to whole
    blocks (segment 0) and head_dim padded to a power of two (zeros) where they are not; `interpret` (default: on a
    CPU) runs them in Pallas' interpreter."""
    if q_btnh.shape[2] % k_bskh.shape[2]:
        raise ValueError(f"{q_btnh.shape[2]} query heads are not a multiple of {k_bskh.shape[2]} KV heads")
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    scalars = jnp.stack([jnp.asarray(q_offset, jnp.int32),
                         jnp.asarray(NO_WINDOW if window is None else window, jnp.int32)])
    return _flash(scale, block_q, block_kv, interpret, q_btnh, k_bskh, v_bskh, jnp.asarray(q_seg_bt, jnp.int32),
                  jnp.asarray(kv_seg_bs, jnp.int32), scalars)


# The padding happens inside the custom VJP, so that its residuals are the inputs and the output as the caller has
# them: padded copies would be values of their own, which a remat policy saves (every layer's gathered K/V under cp).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(scale, block_q, block_kv, interpret, q, k, v, q_seg, kv_seg, scalars):
    return _flash_fwd(scale, block_q, block_kv, interpret, q, k, v, q_seg, kv_seg, scalars)[0]


def _flash_fwd(scale, block_q, block_kv, interpret, q, k, v, q_seg, kv_seg, scalars):
    pad_q, pad_kv = _padding(q.shape, block_q), _padding(k.shape, block_kv)
    out, lse = _forward(scale, block_q, block_kv, interpret, pad_q(q), pad_kv(k), pad_kv(v), pad_q(q_seg),
                        pad_kv(kv_seg), scalars)
    out = out[:, :q.shape[1], :, :q.shape[3]] if out.shape != q.shape else out
    return out, (q, k, v, q_seg, kv_seg, scalars, out, lse)


def _flash_bwd(scale, block_q, block_kv, interpret, residuals, d_out):
    q, k, v, q_seg, kv_seg, scalars, out, lse = residuals
    pad_q, pad_kv = _padding(q.shape, block_q), _padding(k.shape, block_kv)
    delta_bnt = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    padded = (scale, block_q, block_kv, interpret, pad_q(q), pad_kv(k), pad_kv(v), pad_q(q_seg), pad_kv(kv_seg),
              scalars, pad_q(d_out.astype(q.dtype)), lse, pad_q(delta_bnt, axis=2))
    dq, (dk, dv) = _dq(*padded), _dkv(*padded)
    t, s, h = q.shape[1], k.shape[1], q.shape[3]
    return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h], None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _padding(shape, block: int):
    """A function padding an array's sequence axis (1, or `axis`) with zeros to whole blocks of `block`, and a
    `[b, t, heads, h]` array's head_dim to a power of two (at least 16, Triton's smallest dot)."""
    length = -(-shape[1] // block) * block
    head_dim = max(16, 1 << (shape[3] - 1).bit_length())

    def pad(x, axis=1):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, length - x.shape[axis])
        if x.ndim == 4:
            widths[3] = (0, head_dim - x.shape[3])
        return x if all(w == (0, 0) for w in widths) else jnp.pad(x, widths)

    return pad


# ----------------------------------------------------------------------------------------------------
# What a block sees


def _dot(a, b, contract_a: int, contract_b: int):
    """`a @ b` contracting the given axes of two 2-D blocks, accumulated in float32."""
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _visible(q_pos, k_pos, q_seg, k_seg, window):
    """`[queries, keys]`: which keys each query sees (the module docstring's mask)."""
    distance = q_pos[:, None] - k_pos[None, :]
    return (distance >= 0) & (distance < window) & (q_seg[:, None] == k_seg[None, :]) & (k_seg[None, :] != 0)


def _key_blocks(first_q, block_q: int, window, block_kv: int, kv_blocks: int):
    """The key blocks `[lo, hi)` that queries at positions `first_q .. first_q + block_q - 1` may see."""
    lo = jnp.maximum(first_q - window + 1, 0) // block_kv
    hi = jnp.minimum((first_q + block_q - 1) // block_kv + 1, kv_blocks)
    return lo, jnp.maximum(lo, hi)


def _query_blocks(first_k, block_kv: int, offset, window, block_q: int, q_blocks: int):
    """The query blocks `[lo, hi)` whose queries may see keys `first_k .. first_k + block_kv - 1`."""
    lo = jnp.minimum(jnp.maximum(first_k - offset, 0) // block_q, q_blocks)
    # the last query that sees the block's last key is at position first_k + block_kv - 1 + window - 1
    last = first_k + block_kv - 2 + window - offset
    hi = jnp.where(last >= 0, jnp.minimum(jnp.maximum(last, 0) // block_q + 1, q_blocks), 0)
    return lo, jnp.maximum(lo, hi)


# ----------------------------------------------------------------------------------------------------
# The kernels


def _forward_kernel(scalars_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, out_ref, lse_ref, *, scale, block_q,
                    block_kv):
    offset, window = scalars_ref[0], scalars_ref[1]
    first_q = offset + pl.program_id(0) * block_q
    q, q_seg = q_ref[...], q_seg_ref[...]
    q_pos = first_q + jnp.arange(block_q)

    def key_block(j, carry):
        m, l, acc = carry
        keys = pl.ds(j * block_kv, block_kv)
        k, v = k_ref[keys, :], v_ref[keys, :]
        visible = _visible(q_pos, j * block_kv + jnp.arange(block_kv), q_seg, kv_seg_ref[keys], window)
        scores = jnp.where(visible, _dot(q, k, 1, 1) * scale, _NEG)
        m_next = jnp.maximum(m, jnp.max(scores, axis=1))
        p = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)
        alpha = jnp.exp(m - m_next)
        return m_next, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + _dot(p.astype(v.dtype), v, 1, 0)

    lo, hi = _key_blocks(first_q, block_q, window, block_kv, k_ref.shape[0] // block_kv)
    start = (jnp.full((block_q,), _NEG, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros(q.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, key_block, start)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    out_ref[...] = jnp.where(seen[:, None], acc / safe_l[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), 0.0)


def _dq_kernel(scalars_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *,
               scale, block_q, block_kv):
    offset, window = scalars_ref[0], scalars_ref[1]
    first_q = offset + pl.program_id(0) * block_q
    q, q_seg, d_out, lse, delta = q_ref[...], q_seg_ref[...], d_out_ref[...], lse_ref[...], delta_ref[...]
    q_pos = first_q + jnp.arange(block_q)

    def key_block(j, dq):
        keys = pl.ds(j * block_kv, block_kv)
        k, v = k_ref[keys, :], v_ref[keys, :]
        visible = _visible(q_pos, j * block_kv + jnp.arange(block_kv), q_seg, kv_seg_ref[keys], window)
        p = jnp.where(visible, jnp.exp(_dot(q, k, 1, 1) * scale - lse[:, None]), 0.0)
        d_scores = p * (_dot(d_out, v, 1, 1) - delta[:, None])
        return dq + _dot(d_scores.astype(k.dtype), k, 1, 0)

    lo, hi = _key_blocks(first_q, block_q, window, block_kv, k_ref.shape[0] // block_kv)
    dq = jax.lax.fori_loop(lo, hi, key_block, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(scalars_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, d_out_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, scale, block_q, block_kv, group):
    offset, window = scalars_ref[0], scalars_ref[1]
    first_k = pl.program_id(0) * block_kv
    k, v, k_seg = k_ref[...], v_ref[...], kv_seg_ref[...]
    k_pos = first_k + jnp.arange(block_kv)
    lo, hi = _query_blocks(first_k, block_kv, offset, window, block_q, q_ref.shape[0] // block_q)

    def query_head(g, carry):
        def query_block(i, carry):
            dk, dv = carry
            rows = pl.ds(i * block_q, block_q)
            q, d_out = q_ref[rows, g, :], d_out_ref[rows, g, :]
            visible = _visible(offset + i * block_q + jnp.arange(block_q), k_pos, q_seg_ref[rows], k_seg, window)
            p = jnp.where(visible, jnp.exp(_dot(q, k, 1, 1) * scale - lse_ref[g, rows][:, None]), 0.0)
            d_scores = p * (_dot(d_out, v, 1, 1) - delta_ref[g, rows][:, None])
            return dk + _dot(d_scores.astype(q.dtype), q, 0, 0), dv + _dot(p.astype(d_out.dtype), d_out, 0, 0)

        return jax.lax.fori_loop(lo, hi, query_block, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, query_head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------
# The calls


def _scalars_spec():
    return pl.BlockSpec((2,), lambda *_: (0,))


def _triton(head_dim: int):
    """Triton's lowering (Pallas' default on a GPU is Mosaic, which wants other kernels), with JAX's own attention
    kernel's warps for a head_dim: 4 up to 64, else 8 (a program's float32 accumulators are block x head_dim)."""
    return pl_triton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _query_program_specs(s: int, h: int, r: int, block_q: int):
    """The blocks of a program a (query block, row, query head): its queries, the row's keys (or values) of its KV
    head, its queries' segment ids, the row's keys' segment ids, a float a query (log-sum-exp, delta)."""
    return (pl.BlockSpec((None, block_q, None, h), lambda i, row, head: (row, i, head, 0)),
            pl.BlockSpec((None, s, None, h), lambda i, row, head: (row, 0, head // r, 0)),
            pl.BlockSpec((None, block_q), lambda i, row, head: (row, i)),
            pl.BlockSpec((None, s), lambda i, row, head: (row, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, row, head: (row, head, i)))


# jitted: a remat's recomputation of the forward kernel whose outputs the backward pass does not use (they are
# saved) is pruned from the jaxpr; a bare pallas_call would stay
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _forward(scale, block_q, block_kv, interpret, q, k, v, q_seg, kv_seg, scalars):
    b, t, n, h = q.shape
    queries, keys, q_segs, kv_segs, per_query = _query_program_specs(k.shape[1], h, n // k.shape[2], block_q)
    return pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, block_q=block_q, block_kv=block_kv),
        grid=(t // block_q, b, n), in_specs=[_scalars_spec(), queries, keys, keys, q_segs, kv_segs],
        out_specs=[queries, per_query],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        name="flash_forward", interpret=interpret, compiler_params=_triton(h),
    )(scalars, q, k, v, q_seg, kv_seg)


def _dq(scale, block_q, block_kv, interpret, q, k, v, q_seg, kv_seg, scalars, d_out, lse, delta):
    b, t, n, h = q.shape
    queries, keys, q_segs, kv_segs, per_query = _query_program_specs(k.shape[1], h, n // k.shape[2], block_q)
    return pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_q=block_q, block_kv=block_kv),
        grid=(t // block_q, b, n),
        in_specs=[_scalars_spec(), queries, keys, keys, q_segs, kv_segs, queries, per_query, per_query],
        out_specs=queries, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_backward_dq", interpret=interpret, compiler_params=_triton(h),
    )(scalars, q, k, v, q_seg, kv_seg, d_out, lse, delta)


def _dkv(scale, block_q, block_kv, interpret, q, k, v, q_seg, kv_seg, scalars, d_out, lse, delta):
    """A program a (key block, row, KV head): the queries (and d_out, log-sum-exp, delta) of the KV head's group of
    r query heads, whole; its keys and values."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    r = n // kv_heads
    group = pl.BlockSpec((None, t, r, h), lambda j, row, kv_head: (row, 0, kv_head, 0))
    group_per_query = pl.BlockSpec((None, r, t), lambda j, row, kv_head: (row, kv_head, 0))
    key_block = pl.BlockSpec((None, block_kv, None, h), lambda j, row, kv_head: (row, j, kv_head, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=block_q, block_kv=block_kv, group=r),
        grid=(s // block_kv, b, kv_heads),
        in_specs=[_scalars_spec(), group, key_block, key_block, pl.BlockSpec((None, t), lambda j, row, _: (row, 0)),
                  pl.BlockSpec((None, block_kv), lambda j, row, _: (row, j)), group, group_per_query,
                  group_per_query],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_backward_dkv", interpret=interpret, compiler_params=_triton(h),
    )(scalars, q, k, v, q_seg, kv_seg, d_out, lse, delta)
