"""Fused attention kernels of the installed JAX stack, as further `impl`s of `jaxmodel.attention.attention`.

The portable paths (xla, blockwise) serve every call on every backend; a kernel here serves only the calls it can
take, and `refusal` says, from a call's static facts, why one cannot (the caller then takes a portable path):

- `cudnn`: cuDNN's flash attention through `jax.nn.dot_product_attention(implementation="cudnn")` (NVIDIA GPUs):
  16-bit operands, grouped KV heads as they are, head_dim a multiple of 8 up to 128, no window. Its public API
  takes padding as per-row lengths, not segments: every row must be one sequence followed by its padding
  (segment ids `c..c 0..0`). A row that is not (packed documents, left padding) cannot be seen at trace time; its
  output is NaN, so that a run fed such rows fails at its first loss instead of training on a wrong mask.
- `pallas-triton`: JAX's Pallas flash attention for GPUs (`jax.experimental.pallas.ops.gpu.attention.mha`,
  Triton, sm80 and later): segment ids as they are, K/V repeated to the query heads (the kernel takes one KV head
  per query head), 16-bit operands, head_dim up to 256, no window. On a CPU it runs in Pallas' interpreter:
  correct and slow, for tests.
- `pallas-flash`: this package's own Pallas flash attention (`jaxmodel.flash_kernel`, Triton): what the two above
  do not take besides, a query offset (context parallelism's chunks, q_len < kv_len), query and key segment ids
  apart, grouped KV heads read as they are, a sliding window; 16-bit operands, head_dim up to 256. Interpreted on a
  CPU as Pallas' is.
- `aiter` (AMD GPUs): AITER's flash attention through the `jax_aiter` package (ROCm/jax-aiter's
  `jax_aiter.mha.flash_attn_func`): grouped KV heads as they are, 16-bit operands, head_dim up to 256; rows of one
  sequence and their padding as for cudnn (a row that is not is NaN); no window (the package takes it as a static
  argument, a layer scan's is traced) and no query offset. Untested: no ROCm machine has run it.

`KERNELS_ON` lists the kernels a GPU platform (`kernel_platform`: "cuda" or "rocm") may run, in the order `auto`
tries them.

The rows of padding (segment 0) get zeros, as on the blockwise path.

Under `jax.checkpoint` a kernel's output and log-sum-exp are named as the blockwise path's saved values are
(`jaxmodel.matmul.saved_residual`), so the dot policies keep them and the backward pass does not run the forward
kernel again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmodel.matmul import saved_residual

CUDNN = "cudnn"
PALLAS_TRITON = "pallas-triton"
PALLAS_FLASH = "pallas-flash"
AITER = "aiter"
FUSED_IMPLS = (CUDNN, PALLAS_TRITON, PALLAS_FLASH, AITER)

# The kernels each GPU platform may run, in the order `auto` tries them: the vendor's or JAX's own first; this
# package's (which also takes cp's offsets and windows) where they cannot take the run.
KERNELS_ON = {"cuda": (CUDNN, PALLAS_TRITON, PALLAS_FLASH), "rocm": (AITER, PALLAS_FLASH)}


def kernel_platform(device=None) -> str:
    """"cuda" or "rocm" for a GPU (JAX names both "gpu"; the client's platform version says which), else the
    device's platform: the key of KERNELS_ON."""
    device = device or jax.devices()[0]
    if device.platform not in ("gpu", "cuda", "rocm"):
        return device.platform
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" if device.platform == "rocm" or "rocm" in version or "hip" in version else "cuda"

_SIXTEEN_BIT = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The static facts of an attention call a kernel's support depends on."""

    dtype: str
    head_dim: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    q_offset: bool  # the queries start after key 0 (a context-parallel chunk)
    window: bool  # a sliding window (on some layer)
    packed: bool | None = None  # rows may hold several documents (None: not known)

    @classmethod
    def of(cls, q_btnh, k_bskh, *, dtype, q_offset, window, packed: bool | None = None) -> AttentionCall:
        return cls(dtype=jnp.dtype(dtype or q_btnh.dtype).name, head_dim=q_btnh.shape[3], heads=q_btnh.shape[2],
                   kv_heads=k_bskh.shape[2], q_len=q_btnh.shape[1], kv_len=k_bskh.shape[1],
                   q_offset=not (isinstance(q_offset, int) and q_offset == 0), window=window is not None,
                   packed=packed)


def refusal(impl: str, call: AttentionCall) -> str | None:
    """Why kernel `impl` cannot take `call` (None: it can)."""
    return KERNELS[impl].refusal(call)


def fused_attention(impl: str, q_btnh, k_bskh, v_bskh, *, q_segment_ids=None, kv_segment_ids=None, q_offset=0,
                    window=None, dtype=None, scale: float | None = None) -> jax.Array:
    """Causal attention `[b, t, n, h]` by kernel `impl`, the arguments as `jaxmodel.attention.attention`'s; a
    ValueError where the kernel cannot take the call (`refusal`)."""
    call = AttentionCall.of(q_btnh, k_bskh, dtype=dtype, q_offset=q_offset, window=window)
    reason = refusal(impl, call)
    if reason is not None:
        raise ValueError(f"attention {impl} cannot take this call: {reason}")
    dtype = q_btnh.dtype if dtype is None else dtype
    b, t, s = q_btnh.shape[0], q_btnh.shape[1], k_bskh.shape[1]
    q_seg_bt = jnp.ones((b, t), jnp.int32) if q_segment_ids is None else jnp.asarray(q_segment_ids, jnp.int32)
    kv_seg_bs = jnp.ones((b, s), jnp.int32) if kv_segment_ids is None else jnp.asarray(kv_segment_ids, jnp.int32)
    scale = q_btnh.shape[3] ** -0.5 if scale is None else float(scale)
    positions = jnp.asarray(q_offset, jnp.int32), None if window is None else jnp.asarray(window, jnp.int32)
    out_btnh = _kept_for_backward(KERNELS[impl].attend, scale, q_btnh.astype(dtype), k_bskh.astype(dtype),
                                  v_bskh.astype(dtype), q_seg_bt, kv_seg_bs, *positions)
    return jnp.where((q_seg_bt != 0)[:, :, None, None], out_btnh, 0).astype(dtype)


# ----------------------------------------------------------------------------------------------------
# Keeping a kernel's residuals under remat


def _kept_for_backward(attend: Callable, scale: float, q, k, v, q_seg, kv_seg, q_offset, window):
    return _kept(attend, scale, q, k, v, q_seg, kv_seg, q_offset, window)


def _kept_fwd(attend, scale, q, k, v, q_seg, kv_seg, q_offset, window):
    out, backward = jax.vjp(lambda q, k, v: attend(q, k, v, q_seg, kv_seg, q_offset, window, scale), q, k, v)
    # The output (which o_proj's backward needs) and the residuals the kernel computed (its log-sum-exp) are named
    # for the dot policies; its inputs are not, so that a policy keeps them (or recomputes them) as it would
    # without the kernel.
    named = saved_residual(out, batched=True)
    inputs = {id(x) for x in (q, k, v, q_seg, kv_seg, q_offset, window)}
    leaves, tree = jax.tree_util.tree_flatten(backward)
    leaves = [named if x is out else x if id(x) in inputs or not jnp.issubdtype(x.dtype, jnp.floating)
              else saved_residual(x, batched=True) for x in leaves]
    return named, jax.tree_util.tree_unflatten(tree, leaves)


def _kept_bwd(attend, scale, backward, g):
    dq, dk, dv = backward(g)
    return dq, dk, dv, None, None, None, None


_kept = jax.custom_vjp(lambda attend, scale, q, k, v, q_seg, kv_seg, q_offset, window:
                       attend(q, k, v, q_seg, kv_seg, q_offset, window, scale), nondiff_argnums=(0, 1))
_kept.defvjp(_kept_fwd, _kept_bwd)


# ----------------------------------------------------------------------------------------------------
# The kernels


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    refusal: Callable[[AttentionCall], str | None]
    attend: Callable  # (q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window, scale) -> out_btnh


def _common_refusal(call: AttentionCall, max_head_dim: int) -> str | None:
    if call.dtype not in _SIXTEEN_BIT:
        return f"computes in bfloat16 or float16, not {call.dtype}"
    if call.heads % call.kv_heads:
        return f"{call.heads} query heads are not a multiple of {call.kv_heads} KV heads"
    if call.head_dim > max_head_dim or call.head_dim % 8:
        return f"head_dim {call.head_dim} is not a multiple of 8 up to {max_head_dim}"
    return None


def _offset_or_window_refusal(call: AttentionCall) -> str | None:
    if call.q_offset:
        return "no query offset (context parallelism's chunks)"
    if call.window:
        return "no sliding window"
    if call.q_len != call.kv_len:
        return "as many queries as keys"
    return None


def _cudnn_refusal(call: AttentionCall) -> str | None:
    if call.packed:
        return "rows of one sequence each (padding as lengths): packed rows (--pack) need segments"
    return _common_refusal(call, 128) or _offset_or_window_refusal(call)


def _one_sequence_lengths(seg_bt):
    """Each row's length, where the row is one sequence followed by padding; -1 where it is not."""
    t = seg_bt.shape[1]
    length_b = jnp.sum(seg_bt != 0, axis=1, dtype=jnp.int32)
    prefix_bt = jnp.arange(t)[None, :] < length_b[:, None]
    one_sequence_b = jnp.all((seg_bt != 0) == prefix_bt, axis=1) & jnp.all(
        (seg_bt == seg_bt[:, :1]) | (seg_bt == 0), axis=1)
    return jnp.where(one_sequence_b, length_b, -1)


def cudnn_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window, scale: float, *,
                    implementation: str = "cudnn"):
    """`jax.nn.dot_product_attention` with causal masking and per-row lengths from the segment ids; NaN rows where
    a row is not one sequence and its padding. `implementation="xla"` is the same call on JAX's own path."""
    del q_offset, window  # refused: 0 and none
    valid_b, safe_b = _one_sequence_rows(q_btnh, q_seg_bt, kv_seg_bs)
    out_btnh = jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, scale=scale, is_causal=True,
                                            query_seq_lengths=safe_b, key_value_seq_lengths=safe_b,
                                            implementation=implementation)
    return jnp.where(valid_b[:, None, None, None], out_btnh, jnp.nan).astype(q_btnh.dtype)


def _one_sequence_rows(q_btnh, q_seg_bt, kv_seg_bs):
    """(whether each row is one sequence and its padding, the same for queries and keys; each row's length, the
    whole row where it is not)."""
    lengths_b = _one_sequence_lengths(q_seg_bt)
    valid_b = (lengths_b >= 0) & (lengths_b == _one_sequence_lengths(kv_seg_bs))
    return valid_b, jnp.where(valid_b, lengths_b, q_btnh.shape[1])


def _aiter_refusal(call: AttentionCall) -> str | None:
    if call.packed:
        return "rows of one sequence each: packed rows (--pack) need segments"
    return _common_refusal(call, 256) or _offset_or_window_refusal(call)


def aiter_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window, scale: float, *,
                    flash_attn_func=None):
    """AITER's flash attention (`jax_aiter.mha.flash_attn_func`, or `flash_attn_func` standing in for it), causal;
    NaN rows where a row is not one sequence and its padding. Padding only at a row's end: a real query sees no
    padding key by causality, so the kernel needs no lengths (with as many queries as keys its bottom-right causal
    mask is the usual one)."""
    if flash_attn_func is None:
        from jax_aiter.mha import flash_attn_func
    del q_offset, window  # refused: 0 and none
    valid_b, _ = _one_sequence_rows(q_btnh, q_seg_bt, kv_seg_bs)
    out_btnh = flash_attn_func(q_btnh, k_bskh, v_bskh, softmax_scale=scale, causal=True)
    return jnp.where(valid_b[:, None, None, None], out_btnh, jnp.nan).astype(q_btnh.dtype)


def _pallas_refusal(call: AttentionCall) -> str | None:
    return _common_refusal(call, 256) or _offset_or_window_refusal(call)


# Pallas' default blocks; sequences are padded to a multiple of the query and key blocks.
PALLAS_BLOCK = 128


def pallas_triton_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window, scale: float):
    """Pallas' Triton flash attention (interpreted on a CPU), K/V repeated to the query heads, the sequence padded
    to a multiple of PALLAS_BLOCK with segment 0."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    # self-attention: the kernel takes one set of segment ids for queries and keys; offset 0 and no window (refused)
    del kv_seg_bs, q_offset, window
    b, t, n, h = q_btnh.shape
    r = n // k_bskh.shape[2]
    k_btnh, v_btnh = (jnp.repeat(x, r, axis=2) for x in (k_bskh, v_bskh))
    padded = -(-t // PALLAS_BLOCK) * PALLAS_BLOCK
    pad = [(0, 0), (0, padded - t), (0, 0), (0, 0)]
    q_btnh, k_btnh, v_btnh = (jnp.pad(x, pad) for x in (q_btnh, k_btnh, v_btnh))
    seg_bt = jnp.pad(q_seg_bt, [(0, 0), (0, padded - t)])
    out = pallas_attention.mha(q_btnh, k_btnh, v_btnh, seg_bt, sm_scale=scale, causal=True,
                               interpret=jax.default_backend() == "cpu")
    return out[:, :t]


def pallas_flash_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window, scale: float):
    """`jaxmodel.flash_kernel.flash_attention` (interpreted on a CPU), imported at the first call: Pallas' Triton
    modules add a tenth of a second to every command's start."""
    from jaxmodel.flash_kernel import flash_attention

    return flash_attention(q_btnh, k_bskh, v_bskh, q_seg_bt, kv_seg_bs, q_offset, window, scale=scale)


KERNELS = {
    CUDNN: Kernel(CUDNN, _cudnn_refusal, cudnn_attention),
    PALLAS_TRITON: Kernel(PALLAS_TRITON, _pallas_refusal, pallas_triton_attention),
    PALLAS_FLASH: Kernel(PALLAS_FLASH, lambda call: _common_refusal(call, 256), pallas_flash_attention),
    AITER: Kernel(AITER, _aiter_refusal, aiter_attention),
}

