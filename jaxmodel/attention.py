"""Causal softmax attention with grouped-query heads: the plain (dense) path and a blockwise,
memory-efficient one (FlashAttention-2's algorithm in pure JAX, with its own backward pass).

Shapes: b batch, t query positions, s key positions, n query heads, k kv heads, r = n // k query heads
per kv head, h head_dim. Query head j uses kv head j // r, as transformers' repeat_kv does; neither path
repeats K/V: the r query heads of a kv head and the query positions form one row axis (`q` rows), so
attention is batched matmuls over (batch, kv head).

The mask: key j is visible to query i iff `j <= q_offset + i` (keys indexed from 0), with a sliding
`window` also `q_offset + i - j < window` (the query and the `window - 1` keys before it, as transformers'
sliding-window layers), and either `mask_bts[b, i, j]` (a dense mask, plain path only) or
`q_segment_ids[b, i] == kv_segment_ids[b, j] != 0` (segment 0 is padding). A query that sees no key (padding)
gets zeros and passes no gradient in the blockwise path, and the mean of all values in the plain one.
Scores are `scale * q . k`, `scale` head_dim ** -0.5 unless given.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxmodel.fused_attention import FUSED_IMPLS, fused_attention
from jaxmodel.matmul import einsum_acc32, gradient_einsum, saved_as_dot, saved_residual

PORTABLE_IMPLS = ("xla", "blockwise")
ATTENTION_IMPLS = PORTABLE_IMPLS + FUSED_IMPLS

# Query blocks of the plain path (see xla_attention), used from CAUSAL_BLOCK_MIN positions per block on:
# below that attention costs little and the extra matmuls only lengthen compilation.
CAUSAL_BLOCKS = 4
CAUSAL_BLOCK_MIN = 64

# Blockwise defaults, from the forward + backward of one call with b=1, n=16, k=4, h=64, float32 on a
# 2-core CPU (fastest of interleaved runs, seq 2048 / 4096 / 8192): 256x256 blocks 1.05 / 3.7 / 17 s,
# 512x512 1.37 / 4.7 / 16 s, 1024x1024 2.3 s at 2048; the plain path 1.25 / 6.9 / 49 s. These are CPU
# figures: on other backends measure and pass block_q / block_kv.
BLOCK_Q = 256
BLOCK_KV = 256

_NEG = float(jnp.finfo(jnp.float32).min)


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *, q_segment_ids: jax.Array | None = None,
              kv_segment_ids: jax.Array | None = None, q_offset: int | jax.Array = 0,
              mask_bts: jax.Array | None = None, window: int | jax.Array | None = None, impl: str = "xla",
              dtype=None, block_q: int | None = None, block_kv: int | None = None,
              scale: float | None = None) -> jax.Array:
    """Causal attention `[b, t, n, h]` by `impl`: "xla" (dense scores), "blockwise" (memory O(t)) or a fused
    kernel (`jaxmodel.fused_attention`).

    `mask_bts` replaces the segment ids (plain path only). `window` (None: none) may be traced. `dtype`
    (default q's) is the compute dtype.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {list(ATTENTION_IMPLS)}, got {impl!r}")
    if impl != "xla" and mask_bts is not None:
        raise ValueError(f"{impl} attention takes segment ids, not a dense mask_bts")
    if impl in FUSED_IMPLS:
        return fused_attention(impl, q_btnh, k_bskh, v_bskh, q_segment_ids=q_segment_ids,
                               kv_segment_ids=kv_segment_ids, q_offset=q_offset, window=window, dtype=dtype,
                               scale=scale)
    if impl == "blockwise":
        return blockwise_attention(q_btnh, k_bskh, v_bskh, q_segment_ids=q_segment_ids,
                                   kv_segment_ids=kv_segment_ids, q_offset=q_offset, window=window, dtype=dtype,
                                   block_q=block_q, block_kv=block_kv, scale=scale)
    b, t, s = q_btnh.shape[0], q_btnh.shape[1], k_bskh.shape[1]
    visible_bts = dense_mask(b, t, s, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             q_offset=q_offset, mask_bts=mask_bts, window=window)
    # Query blocks may drop the keys after their end only when those are hidden by index from query 0 on.
    aligned = isinstance(q_offset, int) and q_offset == 0 and t == s
    return xla_attention(q_btnh, k_bskh, v_bskh, visible_bts, dtype=dtype, causal_blocks=aligned, scale=scale)


def cached_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, k_cache_bksh: jax.Array,
                     v_cache_bksh: jax.Array, *, mask_bts: jax.Array, q_offset, window=None, dtype=None,
                     scale: float | None = None, impl: str = "xla") -> jax.Array:
    """Causal attention `[b, t, n, h]` of `t` new tokens at cache slots `[q_offset, q_offset + t)` over the cache's
    slots before them (`[b, k, s, h]`, read as they are: the new tokens' keys and values are written into the
    cache afterwards, by the caller) and over the new tokens themselves (`[b, t, k, h]`): both parts' float32
    scores in one softmax. `mask_bts` marks the slots holding real tokens (False for left padding); `window` as
    in `attention`. Writing the new tokens into a layer's cache before attending copied the layer's whole cache at
    each decode step."""
    if impl != "xla":
        raise ValueError(f"attention over a KV cache takes the xla path, got {impl!r}")
    t = q_btnh.shape[1]
    if isinstance(q_offset, int) and q_offset == 0:  # a prefill: no earlier slot, so the new tokens alone
        return attention(q_btnh, k_btkh, v_btkh, mask_bts=mask_bts[:, :, :t], window=window, dtype=dtype,
                         scale=scale)
    dtype = q_btnh.dtype if dtype is None else dtype
    b, _, n, h = q_btnh.shape
    k, s = k_cache_bksh.shape[1:3]
    r = n // k
    scale = h ** -0.5 if scale is None else scale
    q_bkqh = q_btnh.astype(dtype).reshape(b, t, k, r, h).transpose(0, 2, 1, 3, 4).reshape(b, k, t * r, h)
    k_bkth, v_bkth = (x.astype(dtype).transpose(0, 2, 1, 3) for x in (k_btkh, v_btkh))
    slots = jnp.arange(s)
    cached_bts = mask_bts & (_visible_by_index(jnp.arange(t), slots, q_offset, window) & (slots < q_offset))[None]
    new_bts = jax.lax.dynamic_slice_in_dim(mask_bts, q_offset, t, axis=2) & _visible_by_index(
        jnp.arange(t), jnp.arange(t), 0, window)[None]
    scores_bkqs = jnp.concatenate([einsum_acc32("bkqh,bksh->bkqs", q_bkqh, k_cache_bksh.astype(dtype)),
                                   einsum_acc32("bkqh,bkth->bkqt", q_bkqh, k_bkth)], axis=-1) * scale
    visible_bts = jnp.concatenate([cached_bts, new_bts], axis=-1)
    mask_bkqs = jnp.broadcast_to(visible_bts[:, None, :, None, :], (b, k, t, r, s + t)).reshape(b, k, t * r, s + t)
    probs_bkqs = jax.nn.softmax(jnp.where(mask_bkqs, scores_bkqs, jnp.finfo(jnp.float32).min), axis=-1).astype(dtype)
    out_bkqh = (einsum_acc32("bkqs,bksh->bkqh", probs_bkqs[..., :s], v_cache_bksh.astype(dtype))
                + einsum_acc32("bkqt,bkth->bkqh", probs_bkqs[..., s:], v_bkth)).astype(dtype)
    return out_bkqh.reshape(b, k, t, r, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def dense_mask(b: int, t: int, s: int, *, q_segment_ids=None, kv_segment_ids=None, q_offset=0,
               mask_bts=None, window=None) -> jax.Array:
    """The boolean `[b, t, s]` mask of the module docstring."""
    causal_ts = _visible_by_index(jnp.arange(t), jnp.arange(s), q_offset, window)
    visible_bts = jnp.broadcast_to(causal_ts, (b, t, s))
    if mask_bts is not None:
        return visible_bts & mask_bts
    if q_segment_ids is None and kv_segment_ids is None:
        return visible_bts
    q_seg_bt, kv_seg_bs = _segments_or_ones(q_segment_ids, kv_segment_ids, b, t, s)
    same_bts = q_seg_bt[:, :, None] == kv_seg_bs[:, None, :]
    return visible_bts & same_bts & (kv_seg_bs != 0)[:, None, :]


def _visible_by_index(q_index, kv_index, q_offset, window):
    """`[t, s]`: key index `kv_index[j]` visible to query index `q_offset + q_index[i]` by causality and the window."""
    distance_ts = q_offset + q_index[:, None] - kv_index[None, :]
    visible_ts = distance_ts >= 0
    return visible_ts if window is None else visible_ts & (distance_ts < window)


def _segments_or_ones(q_segment_ids, kv_segment_ids, b: int, t: int, s: int):
    q_seg_bt = jnp.ones((b, t), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
    kv_seg_bs = jnp.ones((b, s), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    return q_seg_bt, kv_seg_bs


# ----------------------------------------------------------------------------------------------------
# The plain path


def xla_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array, *, dtype=None,
                  causal_blocks: bool = False, scale: float | None = None) -> jax.Array:
    """Attention with dense float32 scores `[b, k, t*r, s]` under a boolean `mask_bts`.

    `causal_blocks` says that `mask_bts` hides every key after its query (`t == s`): then, from
    CAUSAL_BLOCKS * CAUSAL_BLOCK_MIN positions on, query block j attends only keys up to the block's
    end, which skips 3/8 of the scores with four blocks (masked keys add exact zeros to the softmax).
    """
    dtype = q_btnh.dtype if dtype is None else dtype
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    r = n // k
    scale = h ** -0.5 if scale is None else scale
    # 4-D batched matmuls over (batch, kv head): the CPU backend runs them with fewer transposing copies
    # than a 5-D einsum (bench/train.py).
    q_bkqh = q_btnh.reshape(b, t, k, r, h).transpose(0, 2, 1, 3, 4).reshape(b, k, t * r, h)
    k_bksh = k_bskh.astype(dtype).transpose(0, 2, 1, 3)
    v_bksh = v_bskh.astype(dtype).transpose(0, 2, 1, 3)
    if causal_blocks and t % CAUSAL_BLOCKS == 0 and t // CAUSAL_BLOCKS >= CAUSAL_BLOCK_MIN:
        tb = t // CAUSAL_BLOCKS
        # One split rather than a slice per block: its gradient is one concatenation of the blocks' query
        # gradients, where slices' would be each padded to the whole length and added.
        q_blocks = jnp.split(q_bkqh, CAUSAL_BLOCKS, axis=2)
        # The blocks' key prefixes are sliced from float32 copies, so that their gradients are summed in float32
        # and rounded once (in bf16 each add would round, and XLA:CPU converts around it).
        k32_bksh, v32_bksh = k_bksh.astype(jnp.float32), v_bksh.astype(jnp.float32)
        out_bkqh = jnp.concatenate([
            _attend(q_blocks[j], k32_bksh[:, :, :(j + 1) * tb].astype(dtype),
                    v32_bksh[:, :, :(j + 1) * tb].astype(dtype), mask_bts[:, j * tb:(j + 1) * tb, :(j + 1) * tb], r,
                    dtype, scale)
            for j in range(CAUSAL_BLOCKS)], axis=2)
    else:
        out_bkqh = _attend(q_bkqh, k_bksh, v_bksh, mask_bts, r, dtype, scale)
    return out_bkqh.reshape(b, k, t, r, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def _attend(q_bkqh, k_bksh, v_bksh, mask_bts, r: int, dtype, scale: float):
    """Softmax attention of query rows `(t, r)` over keys `s`, float32 scores and softmax."""
    b, k, q, h = q_bkqh.shape
    t, s = mask_bts.shape[1:]
    # Both matmuls take operands of the compute dtype and accumulate in float32 (jaxmodel.matmul), their
    # gradients too; the scores stay float32, the output is rounded to the compute dtype.
    scores_bkqs = einsum_acc32("bkqh,bksh->bkqs", q_bkqh, k_bksh) * scale
    mask_bkqs = jnp.broadcast_to(mask_bts[:, None, :, None, :], (b, k, t, r, s)).reshape(b, k, q, s)
    scores_bkqs = jnp.where(mask_bkqs, scores_bkqs, jnp.finfo(jnp.float32).min)
    probs_bkqs = _probabilities(scores_bkqs, dtype)
    return saved_as_dot(einsum_acc32("bkqs,bksh->bkqh", probs_bkqs, v_bksh).astype(dtype), batched=True)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _probabilities(scores_bkqs: jax.Array, dtype) -> jax.Array:
    """The softmax over keys of float32 scores, rounded to `dtype`; the `dots` remat policy keeps it.

    Why: the backward pass needs only the probabilities (softmax's gradient is `p * (g - rowsum(g * p))`).
    Kept, they spare the backward pass the softmax's recomputation from the scores, three passes over the
    largest tensor of the layer (bench/train.py's float32 step on a 2-core Xeon: 0.97 of the time); in bf16
    they take half the memory that the float32 scores would."""
    return jax.nn.softmax(scores_bkqs, axis=-1).astype(dtype)


def _probabilities_fwd(scores_bkqs, dtype):
    probs_bkqs = saved_residual(_probabilities(scores_bkqs, dtype), batched=True)
    return probs_bkqs, probs_bkqs


def _probabilities_bwd(dtype, probs_bkqs, g_bkqs):
    p_bkqs, g_bkqs = probs_bkqs.astype(jnp.float32), g_bkqs.astype(jnp.float32)
    return (p_bkqs * (g_bkqs - jnp.sum(g_bkqs * p_bkqs, axis=-1, keepdims=True)),)


_probabilities.defvjp(_probabilities_fwd, _probabilities_bwd)


# ----------------------------------------------------------------------------------------------------
# The blockwise path


def blockwise_attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
                        q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                        q_offset: int | jax.Array = 0, window: int | jax.Array | None = None, dtype=None,
                        block_q: int | None = None, block_kv: int | None = None,
                        scale: float | None = None) -> jax.Array:
    """Attention `[b, t, n, h]` computed `block_q` query positions by `block_kv` keys at a time (default
    BLOCK_Q, BLOCK_KV), keeping only the output and per-row log-sum-exp; key blocks wholly after a query
    block, or wholly before its window, are never computed."""
    dtype = q_btnh.dtype if dtype is None else dtype
    b, t, n, h = q_btnh.shape
    s, k = k_bskh.shape[1], k_bskh.shape[2]
    r = n // k
    bq, bk = min(block_q or BLOCK_Q, t), min(block_kv or BLOCK_KV, s)
    nq, nk = -(-t // bq), -(-s // bk)
    q_seg_bt, kv_seg_bs = _segments_or_ones(q_segment_ids, kv_segment_ids, b, t, s)
    # Padded positions get segment 0, so no query sees a padded key and padded query rows stay zero.
    q_btnh = _pad_axis1(q_btnh.astype(dtype), nq * bq)
    q_seg_bt = _pad_axis1(q_seg_bt, nq * bq)
    k_bskh, v_bskh = _pad_axis1(k_bskh.astype(dtype), nk * bk), _pad_axis1(v_bskh.astype(dtype), nk * bk)
    kv_seg_bs = _pad_axis1(kv_seg_bs, nk * bk)
    # Block axis first, so each loop step takes one contiguous block; rows of a query block are (t, r).
    q_nbkqh = q_btnh.reshape(b, nq, bq, k, r, h).transpose(1, 0, 3, 2, 4, 5).reshape(nq, b, k, bq * r, h)
    k_mbksh = k_bskh.reshape(b, nk, bk, k, h).transpose(1, 0, 3, 2, 4)
    v_mbksh = v_bskh.reshape(b, nk, bk, k, h).transpose(1, 0, 3, 2, 4)
    q_seg_nbt = q_seg_bt.reshape(b, nq, bq).transpose(1, 0, 2)
    kv_seg_mbs = kv_seg_bs.reshape(b, nk, bk).transpose(1, 0, 2)
    # No window: one wider than every key distance (at most q_offset + nq * bq - 1), so that one set of block ranges
    # serves both.
    window = jnp.asarray(max(nq * bq, nk * bk) + q_offset + 1 if window is None else window, jnp.int32)
    scale = h ** -0.5 if scale is None else float(scale)
    out_nbkqh = _flash(q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, jnp.asarray(q_offset, jnp.int32), window, t,
                       scale)
    out_btnh = out_nbkqh.reshape(nq, b, k, bq, r, h).transpose(1, 0, 3, 2, 4, 5).reshape(b, nq * bq, n, h)
    return out_btnh[:, :t]


def _pad_axis1(x, size: int):
    return jnp.pad(x, [(0, 0), (0, size - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _block_ranges(q_offset, window, nq: int, bq: int, nk: int, bk: int, q_len: int):
    """Key blocks `[kv_start_n[i], kv_count_n[i])` for query block i and query blocks `[q_start_m[j], q_end_m[j])`
    for key block j, from two tests shared by both (the block's first key is not after the query block's last
    query; its last key is within the window of the query block's first query), so that the forward and
    backward passes skip the same blocks."""
    first_query_n = q_offset + jnp.arange(nq) * bq
    last_query_n = q_offset + jnp.minimum((jnp.arange(nq) + 1) * bq, q_len) - 1  # a key index limit
    kv_count_n = jnp.clip(last_query_n // bk + 1, 0, nk)
    kv_start_n = jnp.clip((first_query_n - window + 1) // bk, 0, nk)
    first_key_m = jnp.arange(nk) * bk
    last_key_m = first_key_m + bk - 1
    q_start_m = jnp.sum(last_query_n[None, :] < first_key_m[:, None], axis=1)
    q_end_m = jnp.sum(first_query_n[None, :] - window + 1 <= last_key_m[:, None], axis=1)
    return (kv_start_n.astype(jnp.int32), kv_count_n.astype(jnp.int32), q_start_m.astype(jnp.int32),
            q_end_m.astype(jnp.int32))


def _masked_scores(q_bkqh, k_bksh, q_seg_bt, kv_seg_bs, i, j, q_offset, window, scale: float):
    """float32 scores `[b, k, q, s]` of query block i against key block j, hidden keys set to NEG."""
    b, k, rows, h = q_bkqh.shape
    bq, bk = q_seg_bt.shape[1], kv_seg_bs.shape[1]
    scores_bkqs = jnp.einsum("bkqh,bksh->bkqs", q_bkqh, k_bksh, preferred_element_type=jnp.float32) * scale
    causal_ts = _visible_by_index(i * bq + jnp.arange(bq), j * bk + jnp.arange(bk), q_offset, window)
    visible_bts = (q_seg_bt[:, :, None] == kv_seg_bs[:, None, :]) & (kv_seg_bs != 0)[:, None, :] & causal_ts
    # The mask is per position; the rows (t, r) of a kv head share it.
    scores_bktrs = scores_bkqs.reshape(b, k, bq, rows // bq, bk)
    scores_bktrs = jnp.where(visible_bts[:, None, :, None, :], scores_bktrs, _NEG)
    return scores_bktrs.reshape(b, k, rows, bk)


def _flash_forward(q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, q_len: int, scale: float):
    """Online softmax over key blocks: output `[nq, b, k, q, h]` and float32 log-sum-exp `[nq, b, k, q]`."""
    nq, b, k, rows, h = q_nbkqh.shape
    nk, bq, bk = k_mbksh.shape[0], q_seg_nbt.shape[2], k_mbksh.shape[3]
    dtype = q_nbkqh.dtype
    kv_start_n, kv_count_n, _, _ = _block_ranges(q_offset, window, nq, bq, nk, bk, q_len)

    def query_block(_, xs):
        q_bkqh, q_seg_bt, kv_start, kv_count, i = xs

        def key_block(j, carry):
            max_bkq, sum_bkq, acc_bkqh = carry
            scores_bkqs = _masked_scores(q_bkqh, k_mbksh[j], q_seg_bt, kv_seg_mbs[j], i, j, q_offset, window, scale)
            new_max_bkq = jnp.maximum(max_bkq, scores_bkqs.max(axis=-1))
            # A row with no visible key yet is shifted by 0, not NEG, so that its exp(NEG - shift) is 0.
            shift_bkq = jnp.where(new_max_bkq == _NEG, 0.0, new_max_bkq)
            p_bkqs = jnp.exp(scores_bkqs - shift_bkq[..., None])
            rescale_bkq = jnp.exp(max_bkq - shift_bkq)
            sum_bkq = sum_bkq * rescale_bkq + p_bkqs.sum(axis=-1)
            pv_bkqh = jnp.einsum("bkqs,bksh->bkqh", p_bkqs.astype(dtype), v_mbksh[j],
                                 preferred_element_type=jnp.float32)
            return new_max_bkq, sum_bkq, acc_bkqh * rescale_bkq[..., None] + pv_bkqh

        init = (jnp.full((b, k, rows), _NEG, jnp.float32), jnp.zeros((b, k, rows), jnp.float32),
                jnp.zeros((b, k, rows, h), jnp.float32))
        max_bkq, sum_bkq, acc_bkqh = jax.lax.fori_loop(kv_start, kv_count, key_block, init)
        # A row that sees no key (padding) has sum 0: output 0, and log-sum-exp 0, so that the backward's
        # exp(NEG - 0) makes its probabilities 0 as well.
        seen_bkq = sum_bkq > 0
        safe_sum_bkq = jnp.where(seen_bkq, sum_bkq, 1.0)
        out_bkqh = (acc_bkqh / safe_sum_bkq[..., None]).astype(dtype)
        lse_bkq = jnp.where(seen_bkq, max_bkq + jnp.log(safe_sum_bkq), 0.0)
        return None, (out_bkqh, lse_bkq)

    _, (out_nbkqh, lse_nbkq) = jax.lax.scan(query_block, None,
                                            (q_nbkqh, q_seg_nbt, kv_start_n, kv_count_n, jnp.arange(nq)))
    return out_nbkqh, lse_nbkq


def _flash_backward(q_len: int, scale: float, residuals, dout_nbkqh):
    """FlashAttention-2's backward: per key block, the query blocks that see it recompute their scores."""
    q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, out_nbkqh, lse_nbkq = residuals
    nq, b, k, rows, h = q_nbkqh.shape
    nk, bq, bk = k_mbksh.shape[0], q_seg_nbt.shape[2], k_mbksh.shape[3]
    dtype = q_nbkqh.dtype
    _, _, q_start_m, q_end_m = _block_ranges(q_offset, window, nq, bq, nk, bk, q_len)
    dout_nbkqh = dout_nbkqh.astype(dtype)
    # D = rowsum(dO * O) = sum_j P_ij dP_ij, the softmax backward's row term.
    delta_nbkq = jnp.sum(dout_nbkqh.astype(jnp.float32) * out_nbkqh.astype(jnp.float32), axis=-1)

    def key_block(dq_nbkqh, xs):
        k_bksh, v_bksh, kv_seg_bs, q_start, q_end, j = xs

        def query_block(i, carry):
            dq_nbkqh, dk_bksh, dv_bksh = carry
            q_bkqh, dout_bkqh = q_nbkqh[i], dout_nbkqh[i]
            scores_bkqs = _masked_scores(q_bkqh, k_bksh, q_seg_nbt[i], kv_seg_bs, i, j, q_offset, window, scale)
            p_bkqs = jnp.exp(scores_bkqs - lse_nbkq[i][..., None])
            dv_bksh += gradient_einsum("bkqs,bkqh->bksh", p_bkqs.astype(dtype), dout_bkqh)
            dp_bkqs = jnp.einsum("bkqh,bksh->bkqs", dout_bkqh, v_bksh, preferred_element_type=jnp.float32)
            ds_bkqs = (p_bkqs * (dp_bkqs - delta_nbkq[i][..., None]) * scale).astype(dtype)
            dk_bksh += gradient_einsum("bkqs,bkqh->bksh", ds_bkqs, q_bkqh)
            dq_bkqh = jnp.einsum("bkqs,bksh->bkqh", ds_bkqs, k_bksh, preferred_element_type=jnp.float32)
            return dq_nbkqh.at[i].add(dq_bkqh), dk_bksh, dv_bksh

        zeros_bksh = jnp.zeros(k_bksh.shape, jnp.float32)
        dq_nbkqh, dk_bksh, dv_bksh = jax.lax.fori_loop(q_start, q_end, query_block,
                                                       (dq_nbkqh, zeros_bksh, zeros_bksh))
        return dq_nbkqh, (dk_bksh, dv_bksh)

    dq_nbkqh = jnp.zeros(q_nbkqh.shape, jnp.float32)
    dq_nbkqh, (dk_mbksh, dv_mbksh) = jax.lax.scan(
        key_block, dq_nbkqh, (k_mbksh, v_mbksh, kv_seg_mbs, q_start_m, q_end_m, jnp.arange(nk)))
    return (dq_nbkqh.astype(q_nbkqh.dtype), dk_mbksh.astype(k_mbksh.dtype), dv_mbksh.astype(v_mbksh.dtype),
            None, None, None, None)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _flash(q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, q_len: int, scale: float):
    return _flash_forward(q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, q_len, scale)[0]


def _flash_fwd(q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, q_len: int, scale: float):
    out_nbkqh, lse_nbkq = _flash_forward(q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, q_len,
                                         scale)
    # Named like the plain path's batched dots: under `dots` a remat'd layer keeps the output and log-sum-exp
    # instead of running the whole forward loop again to rebuild them for the backward's residuals.
    out_nbkqh, lse_nbkq = saved_residual(out_nbkqh, batched=True), saved_residual(lse_nbkq, batched=True)
    return out_nbkqh, (q_nbkqh, k_mbksh, v_mbksh, q_seg_nbt, kv_seg_mbs, q_offset, window, out_nbkqh, lse_nbkq)


_flash.defvjp(_flash_fwd, _flash_backward)
