"""The check a fused attention kernel (`jaxmodel.fused_attention`) passes before a run takes it: its output and
gradients against the blockwise path's on a small input of the run's heads, in the run's dtype, with a query offset
and a sliding window where the run has them."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodel.attention import blockwise_attention
from jaxmodel.fused_attention import AttentionCall, fused_attention

# A kernel agrees with the portable path where its error against a float32 reference (the blockwise path in
# float32) is at most this many times the blockwise path's own error in the kernel's dtype, in the output and each
# of the three gradients (max abs difference over max abs reference).
AGREEMENT_FACTOR = 2.0
CHECK_LEN = 256


def check_rows(call: AttentionCall, t: int = CHECK_LEN):
    """The segment ids `[2, t]` of the check: row 0 one sequence and its padding; row 1 two documents and padding
    (one sequence again where the call's rows are not packed)."""
    seg_bt = np.ones((2, t), np.int32)
    seg_bt[0, t - t // 8:] = 0
    if call.packed is not False:
        seg_bt[1, t // 3:] = 2
    seg_bt[1, t - t // 16:] = 0
    return jnp.asarray(seg_bt)


def check_positions(call: AttentionCall, t: int = CHECK_LEN) -> dict:
    """The check's query offset (where the run's calls have one, the second half of the keys' positions are the
    queries) and window (where the run has one, a quarter of the keys)."""
    return dict(q_offset=t // 2 if call.q_offset else 0, window=t // 4 if call.window else None)


def disagreement(impl: str, call: AttentionCall, attend: Callable | None = None, seed: int = 0) -> str | None:
    """Where kernel `impl` (or `attend`, a function of `attention`'s arguments standing in for it) disagrees with
    the portable path on a small input of `call`'s heads: the output or a gradient whose error exceeds
    AGREEMENT_FACTOR times the blockwise path's, or the error the kernel raised; None where it agrees."""
    dtype = jnp.dtype(call.dtype)
    seg_bt = check_rows(call)
    positions = check_positions(call)
    first = positions["q_offset"]
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = ((2, CHECK_LEN - first, call.heads, call.head_dim), (2, CHECK_LEN, call.kv_heads, call.head_dim))
    q, k, v = (jax.random.normal(key, shapes[min(i, 1)], jnp.float32) for i, key in enumerate(keys[:3]))
    cotangent = jax.random.normal(keys[3], shapes[0], jnp.float32)
    if attend is None:
        attend = partial_attention(impl)

    def values_and_grads(fn, dtype):
        def loss(q, k, v):
            out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), q_segment_ids=seg_bt[:, first:],
                     kv_segment_ids=seg_bt, **positions)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [out, *grads]

    try:
        reference = values_and_grads(blockwise_attention, jnp.float32)
        portable = values_and_grads(blockwise_attention, dtype)
        kernel = values_and_grads(attend, dtype)
    except Exception as error:  # noqa: BLE001 - whatever a kernel raises is the reason it is not taken
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    for name, ref, port, kern in zip(("output", "dq", "dk", "dv"), reference, portable, kernel):
        # in numpy, whose max propagates a NaN
        ref, port, kern = (np.asarray(x, np.float32) for x in (ref, port, kern))
        scale = float(np.max(np.abs(ref))) or 1.0
        port_error = float(np.max(np.abs(port - ref))) / scale
        kernel_error = float(np.max(np.abs(kern - ref))) / scale
        if not kernel_error <= AGREEMENT_FACTOR * max(port_error, float(jnp.finfo(dtype).eps)):
            return (f"its {name} is off the float32 reference by {kernel_error:.2e} (relative), more than "
                    f"{AGREEMENT_FACTOR:g}x the blockwise path's {port_error:.2e} in {call.dtype}")
    return None


def partial_attention(impl: str) -> Callable:
    """`fused_attention` by `impl`, a function of the arrays, segment ids, query offset and window."""
    def attend(q, k, v, *, q_segment_ids, kv_segment_ids, q_offset=0, window=None):
        return fused_attention(impl, q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                               q_offset=q_offset, window=window)
    return attend
