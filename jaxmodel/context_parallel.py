"""Context parallelism: the sequence split over the mesh axis `cp`, with causal work balanced across it.

A row of `t` tokens is cut into `2 cp` chunks of `c = t / (2 cp)`; device `i` of the `cp` axis holds chunks
`i` and `2 cp - 1 - i` (the "cp layout"), so every device has one early and one late chunk and the causal
attention work is equal on all of them. Everything but attention is per token and runs in the cp layout
as it is (RoPE takes each token's own position). Attention all-gathers K/V over `cp` once per layer (as
Llama 3's own long-context training did): each device attends its two query chunks to the whole key
sequence, with the chunks' true offsets for the causal mask; the all-gather's transpose in the backward
pass reduce-scatters dK/dV (in float32).

Shapes: b batch, t positions, n query heads, k kv heads, h head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxmodel.attention import attention
from jaxmodel.sharding import Rules

AXIS = "cp"


def cp_size() -> int:
    """The size of the `cp` axis of the mesh set with `jax.set_mesh` (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else int(mesh.shape.get(AXIS, 1))


def cp_order(t: int, cp: int) -> np.ndarray:
    """`order[p]` = the original position of the token at position `p` of the cp layout."""
    if t % (2 * cp):
        raise ValueError(f"a sequence of {t} tokens cannot be split into 2 x cp = {2 * cp} equal chunks")
    c = t // (2 * cp)
    chunks = [j for i in range(cp) for j in (i, 2 * cp - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks])


@jax.custom_vjp
def _gather_sequence(x_bs):
    """All of the sequence `x_bs[:, s]` from every device of `cp` (tiled, in device order)."""
    return jax.lax.all_gather(x_bs, AXIS, axis=1, tiled=True)


def _gather_fwd(x_bs):
    return _gather_sequence(x_bs), None


def _gather_bwd(_, grad_bs):
    # dK/dV summed over the devices that read them, in float32: more exact than a bf16 sum, and XLA:CPU
    # (jax 0.10) aborts compiling the bf16 reduce-scatter that all_gather's own transpose makes here.
    summed = jax.lax.psum_scatter(grad_bs.astype(jnp.float32), AXIS, scatter_dimension=1, tiled=True)
    return (summed.astype(grad_bs.dtype),)


_gather_sequence.defvjp(_gather_fwd, _gather_bwd)


def context_parallel_attention(q_btnh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array, *, segment_ids_bt,
                               impl: str, window=None, dtype=None, scale: float | None = None) -> jax.Array:
    """Causal attention of a cp-layout sequence split over `cp`; `segment_ids_bt` (0 = padding), `window` and
    `scale` as in `jaxmodel.attention.attention`. Returns `[b, t, n, h]` in the cp layout."""
    cp = cp_size()
    t = q_btnh.shape[1]
    back_to_original = np.argsort(cp_order(t, cp))  # gathered (cp layout) -> original order
    chunk = t // (2 * cp)

    def local(q_btnh, k_btkh, v_btkh, seg_bt):
        # This device's two chunks against every key, in original order.
        i = jax.lax.axis_index(AXIS)
        k_all, v_all = (jnp.take(_gather_sequence(x), back_to_original, axis=1) for x in (k_btkh, v_btkh))
        seg_all = jnp.take(jax.lax.all_gather(seg_bt, AXIS, axis=1, tiled=True), back_to_original, axis=1)
        halves = []
        for half, chunk_index in enumerate((i, 2 * cp - 1 - i)):
            rows = slice(half * chunk, (half + 1) * chunk)
            halves.append(attention(q_btnh[:, rows], k_all, v_all, q_segment_ids=seg_bt[:, rows],
                                    kv_segment_ids=seg_all, q_offset=chunk_index * chunk, window=window, impl=impl,
                                    dtype=dtype, scale=scale))
        return jnp.concatenate(halves, axis=1)

    spec = PartitionSpec(None, AXIS)
    # check_vma off: the attention loops start from constants that do not vary over `cp` and carry values
    # that do; the replication checker would need every initial carry cast by hand.
    return jax.shard_map(local, in_specs=(spec,) * 4, out_specs=spec, axis_names={AXIS}, check_vma=False)(
        q_btnh, k_btkh, v_btkh, segment_ids_bt)


def rows_over_cp(rules: Rules) -> Rules:
    """`rules` for `[batch x cp, seq / cp]` rows, each device's part of a sequence made a row of its own (as the
    losses take them: a sum over tokens does not care about their order): the rows split over the batch axes
    and `cp`, each row whole."""
    table = dict(rules)
    batch = table.get("act_batch")
    batch = (batch,) if isinstance(batch, str) else tuple(batch or ())
    return tuple(rules) + (("act_batch", (*batch, "cp")), ("act_seq", None))
