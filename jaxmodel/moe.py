"""Mixture-of-experts parts: the router's choice of experts, and the routed rows grouped by expert so that each
expert's weights multiply only the rows sent to it.

Dropless: every token reaches each of its `k` experts (no capacity, nothing dropped), as transformers, PEFT and
vLLM compute these models; a run then trains the model it serves. A layer's `t` tokens make `a = t * k` routed rows,
sorted by expert (`group_rows`); a grouped matmul multiplies each expert's rows by that expert's weight
(`grouped_matmul`), in one of three ways:

- "blocks" (the default, any backend): each expert's rows padded to whole blocks of `block` rows, and a loop over
  the blocks, each multiplied by its one expert's weight. The work is the routed rows plus at most `block - 1` rows
  of padding an expert, whatever the backend; the padded length has a static bound, `a + min(e, a) * (block - 1)`.
- "ragged": `jax.lax.ragged_dot`, for the backends that lower it to a grouped GEMM. XLA:CPU lowers it to a masked
  dot over every expert, `e` times the work.
- "dense": every row through every expert, the others' products masked: the reference the tests compare with.

Shapes: t tokens, d hidden, e experts, k experts a token, a = t * k routed rows, f an expert's intermediate size,
o and i a weight's output and input sizes (torch's `[out, in]` layout, as `jaxmodel.layers.Linear`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmodel import scopes
from jaxmodel.fp8_matmul import fp8_product
from jaxmodel.layers import Linear, LoRAParam, _stacked, frozen_weight, swiglu
from jaxmodel.matmul import saved_as_dot
from jaxmodel.quantization import Quantization, dequantize
from jaxmodel.sharding import DEFAULT_RULES, Rules, partition_spec

GROUPED_MATMULS = ("blocks", "ragged", "dense")
# the rows of a block of the "blocks" path lie within these (`block_rows`)
MIN_BLOCK, MAX_BLOCK = 64, 256


def route(logits_te: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's `top_k` experts and their weights from the router's logits: a softmax over all experts in
    float32, the `top_k` largest, renormalised to sum to 1 when `normalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral
    always). Returns float32 weights `[t, k]` and int32 experts `[t, k]`, largest weight first."""
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if normalize:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return weights_tk, experts_tk.astype(jnp.int32)


def grouped_sigmoid_route(logits_te: jax.Array, bias_e: jax.Array, top_k: int, groups: int, top_groups: int,
                          normalize: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """Each token's `top_k` experts and their weights as DeepSeek-V3 routes: sigmoid scores in float32; the
    correction bias `bias_e` added for choosing only; the experts in `groups` equal groups, each group scored by the
    sum of its two best biased scores and the best `top_groups` groups kept; the `top_k` best biased scores among
    their experts; weights the unbiased scores of those, renormalised when `normalize` (`norm_topk_prob`) and
    times `scale` (`routed_scaling_factor`). Returns float32 weights `[t, k]` and int32 experts `[t, k]`, largest
    biased score first."""
    scores_te = jax.nn.sigmoid(logits_te.astype(jnp.float32))
    choice_te = scores_te + bias_e.astype(jnp.float32)
    t, e = choice_te.shape
    group_scores_tg = jnp.sum(jax.lax.top_k(choice_te.reshape(t, groups, e // groups), 2)[0], axis=-1)
    kept_tg = jax.lax.top_k(group_scores_tg, top_groups)[1]
    keep_tg = jnp.zeros((t, groups), bool).at[jnp.arange(t)[:, None], kept_tg].set(True)
    choice_te = jnp.where(jnp.repeat(keep_tg, e // groups, axis=1), choice_te, -jnp.inf)
    experts_tk = jax.lax.top_k(choice_te, top_k)[1]
    weights_tk = jnp.take_along_axis(scores_te, experts_tk, axis=1)
    if normalize:  # transformers' 1e-20 keeps a row of zero scores finite
        weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + 1e-20)
    return weights_tk * scale, experts_tk.astype(jnp.int32)


class RouterStats(NamedTuple):
    """What the load-balancing loss needs of a batch's routing, summed over its real tokens (and over layers):
    transformers' `load_balancing_loss_func` pools every sparse layer's tokens before it divides."""

    routed: jax.Array  # [e] float32: routes to each expert (k a token), never differentiated
    probs: jax.Array  # [e] float32: the router's probabilities of each expert
    tokens: jax.Array  # float32 scalar: the real tokens


def router_stats(logits_te: jax.Array, experts_tk: jax.Array, real_t: jax.Array) -> RouterStats:
    """One layer's `RouterStats` from its router's logits, each token's experts and which tokens are real (padding
    left out, as transformers leaves out what its `attention_mask` masks)."""
    real_t = real_t.astype(jnp.float32)
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    routed = jnp.zeros(logits_te.shape[-1], jnp.float32).at[experts_tk.reshape(-1)].add(
        jnp.repeat(real_t, experts_tk.shape[1]))
    return RouterStats(jax.lax.stop_gradient(routed), jnp.sum(probs_te * real_t[:, None], axis=0), jnp.sum(real_t))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """Switch Transformer's load-balancing loss as transformers computes it for Qwen3-MoE and Mixtral: `e` times
    the sum over the experts of (routes to it / tokens) times (its mean probability), the tokens every sparse
    layer's real ones: `k` for a routing spread evenly, at most `e`. float32 scalar."""
    n = jnp.maximum(stats.tokens, 1.0)
    return stats.routed.shape[0] * jnp.sum((stats.routed / n) * (stats.probs / n))


class GroupedRows(NamedTuple):
    """The routed rows of a layer's tokens sorted by expert: row `j` of the sorted order is token
    `token_a[j]`'s route to expert `expert_a[j]`, which `order[j]` numbers in the `[t, k]` routes flattened. Under
    expert parallelism the experts are those held on this device, numbered from 0, and a row whose `expert_a` is
    their count (`len(group_sizes)`) is a route to an expert held elsewhere: it takes no work and gives nothing."""

    order: jax.Array  # [a] int32: flattened route (token * k + slot) of each sorted row
    token_a: jax.Array  # [a] int32
    expert_a: jax.Array  # [a] int32, non-decreasing
    group_sizes: jax.Array  # [e] int32: rows of each expert


def group_rows(experts_tk: jax.Array, num_experts: int, first: jax.Array | int = 0,
               bound: int | None = None, start: jax.Array | int = 0) -> GroupedRows:
    """The routes of `experts_tk` to the `num_experts` experts from `first` on, sorted by expert (stable: a token's
    rows keep the token order within an expert) and numbered from 0; the routes to other experts sorted after
    them. Every route by default; with `bound`, the `bound` sorted rows from row `start` on, `group_sizes` counting
    those (rows past the last route are routes elsewhere, with no token: route index `t * k`). A bound of at least
    the routes that can reach the experts held loses none of theirs (`held_rows`); a smaller one takes them a
    window at a time (`Experts._dispatched`)."""
    t, k = experts_tk.shape
    held_a = experts_tk.reshape(-1) - first
    held_a = jnp.where((held_a >= 0) & (held_a < num_experts), held_a, num_experts)
    order = jnp.argsort(held_a, stable=True).astype(jnp.int32)
    counts = jnp.bincount(held_a, length=num_experts).astype(jnp.int32)  # routes elsewhere not counted
    if bound is None:
        return GroupedRows(order, order // k, held_a[order], counts)
    order = jax.lax.dynamic_slice_in_dim(jnp.concatenate([order, jnp.full((bound,), t * k, jnp.int32)]), start, bound)
    ends = jnp.cumsum(counts)
    group_sizes = jnp.clip(ends - start, 0, bound) - jnp.clip(ends - counts - start, 0, bound)
    expert_a = jnp.where(order < t * k, held_a[jnp.minimum(order, t * k - 1)], num_experts)
    return GroupedRows(order, jnp.minimum(order // k, t - 1), expert_a, group_sizes)


# Under expert parallelism a device's experts are given room for this many times the rows a balanced routing sends
# them; a routing that sends more runs in further passes of that many rows (dropless either way).
CAPACITY_FACTOR = 2


def dispatch_bounds(tokens: int, top_k: int, held: int, ways: int) -> tuple[int, int]:
    """(the rows a device's `held` experts take a pass at a time, the most they can receive) when each of the
    `ways` devices sends `tokens` tokens, `top_k` routes each (`Experts._dispatched`)."""
    worst = held_rows(ways * tokens, top_k, held)
    return min(worst, CAPACITY_FACTOR * tokens * top_k), worst


def held_rows(tokens: int, top_k: int, held: int) -> int:
    """The most routed rows `tokens` tokens can send to `held` of the experts: a token's `top_k` experts are
    distinct, so at most `min(top_k, held)` of them are among those held."""
    return tokens * min(top_k, held)


def block_rows(rows: int, experts: int) -> int:
    """The rows of a block of the "blocks" path when `rows` sorted rows go to `experts` experts: a quarter of their
    average share (half a balanced routing's under expert parallelism, whose passes have room for twice that:
    CAPACITY_FACTOR), a power of two within [MIN_BLOCK, MAX_BLOCK]. Each block reads its expert's weight whole: a
    block of b rows does b FLOPs a byte of a 16-bit weight (the matmuls of an MI300X or H100 need about 250 to
    outrun their memory), while each expert's last block is padded, by up to a block's rows."""
    share = max(rows // max(experts, 1) // 4, 1)
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (share.bit_length() - 1)))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["a", "b"], meta_fields=["scale"])
@dataclasses.dataclass(frozen=True)
class ExpertAdapter:
    """A rank-r LoRA adapter on each expert of a grouped projection: `a` `[e, r, in]`, `b` `[e, out, r]`, adding
    `scale * (x A_e^T) B_e^T` to each row routed to expert e, in float32 (`GroupedLinear`). The scale is static."""

    a: jax.Array
    b: jax.Array
    scale: float


def grouped_matmul(x_ai: jax.Array, w_eoi: jax.Array | None, rows: GroupedRows, impl: str = "blocks",
                   block: int | None = None, adapter: ExpertAdapter | None = None) -> jax.Array:
    """`x_ai[j] @ w_eoi[expert of row j].T` for the sorted rows `x_ai`, accumulated and returned in float32; the
    "blocks" path in blocks of `block` rows (default `block_rows`). With `adapter`, plus its low-rank product on each
    row (`x_ai` taken in float32; `w_eoi` None: the adapter's alone), on the blocks path in the same pass over the
    blocks as the weight's: one padded copy of the rows and one gather back for the three products."""
    if impl not in GROUPED_MATMULS:
        raise ValueError(f"grouped matmul must be one of {GROUPED_MATMULS}, got {impl!r}")
    if impl == "blocks":
        weights = () if w_eoi is None else (w_eoi,)
        scale = None if adapter is None else adapter.scale
        weights += () if adapter is None else (adapter.a, adapter.b)
        return _blocks_matmul(x_ai, weights, rows, block or block_rows(x_ai.shape[0], weights[0].shape[0]), scale)
    y_ao = None if w_eoi is None else _whole_grouped_matmul(x_ai, w_eoi, rows, impl)
    if adapter is None:
        return y_ao
    xa_ar = saved_as_dot(_whole_grouped_matmul(x_ai.astype(jnp.float32), adapter.a, rows, impl) * adapter.scale)
    delta_ao = saved_as_dot(_whole_grouped_matmul(xa_ar, adapter.b, rows, impl))
    return delta_ao if y_ao is None else y_ao + delta_ao


def _whole_grouped_matmul(x_ai, w_eoi, rows: GroupedRows, impl: str):
    """The "ragged" and "dense" paths of `grouped_matmul`, each one operation over all the rows."""
    if impl == "ragged":
        return jax.lax.ragged_dot(x_ai, jnp.swapaxes(w_eoi, 1, 2), rows.group_sizes,
                                  preferred_element_type=jnp.float32)
    y_aeo = jnp.einsum("ai,eoi->aeo", x_ai, w_eoi, preferred_element_type=jnp.float32)
    expert_a = jnp.minimum(rows.expert_a, w_eoi.shape[0] - 1)  # routes elsewhere: dropped by `combine`
    return jnp.take_along_axis(y_aeo, expert_a[:, None, None], axis=1)[:, 0]


# The "blocks" path has its own VJP so that the loop over the blocks runs without tangents, its products never
# saved: differentiated through, a remat policy that saves matmul outputs (`dots`) kept every block's product, and
# each block's slice of the weight, for the backward pass. Its residuals are its inputs; the backward pass walks
# the blocks again, each block's gradients those of its own product (`jax.vjp`), the trained weights' (an
# adapter's; a frozen base gets none) summed by expert. `weights` are `(w,)` with `lora_scale` None, else `(a, b)` or
# `(w, a, b)` (`_block_product`).
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _blocks_matmul(x_ai, weights, rows, block, lora_scale):
    return _blocks_forward(x_ai, weights, rows, block, lora_scale)


def _blocks_matmul_fwd(x_ai, weights, rows, block, lora_scale):
    trained = tuple((True,) if w.perturbed else () for w in weights)  # static, in the residuals' structure
    x_ai, weights, rows = x_ai.value, tuple(w.value for w in weights), jax.tree.map(lambda v: v.value, rows)
    return _blocks_forward(x_ai, weights, rows, block, lora_scale), (x_ai, weights, rows, trained)


def _blocks_matmul_bwd(block, lora_scale, residuals, dy_ao):
    x_ai, weights, rows, trained = residuals
    trained = [j for j, mark in enumerate(trained) if mark]
    positions, block_expert, used = _block_layout(rows, block)
    (a, i), n, o = x_ai.shape, block_expert.shape[0], weights[-1].shape[1]
    dy_ao = jnp.zeros((a, o), jnp.float32) if isinstance(dy_ao, jax.custom_derivatives.SymbolicZero) else dy_ao
    x_nbi = _padded(x_ai, positions, n, block)
    dy_nbo = _padded(dy_ao.astype(jnp.float32), positions, n, block)
    varying = tuple(_varying_axes(x_ai).union(*map(_varying_axes, weights)) | _varying_axes(dy_ao))

    def block_grads(dws, x_bi, dy_bo, expert):
        slices = [jax.lax.dynamic_index_in_dim(w, expert, axis=0, keepdims=False) for w in weights]

        def of_trained(x_bi, *changing):
            taken = list(slices)
            for j, value in zip(trained, changing):
                taken[j] = value
            return _block_product(x_bi, tuple(taken), lora_scale)

        _, vjp = jax.vjp(of_trained, x_bi, *(slices[j] for j in trained))
        dx_bi, *dslices = vjp(dy_bo)
        dws = tuple(jax.lax.dynamic_update_index_in_dim(
            dw, jax.lax.dynamic_index_in_dim(dw, expert, 0, keepdims=False) + ds, expert, 0)
            for dw, ds in zip(dws, dslices))
        return dws, dx_bi

    def skip(dws, x_bi, dy_bo, expert):
        return dws, _varying(jnp.zeros_like(x_bi), varying)

    def step(dws, xs):
        x_bi, dy_bo, expert, index = xs
        with jax.named_scope(scopes.EXPERT_BLOCK):
            return jax.lax.cond(index < used, block_grads, skip, dws, x_bi, dy_bo, expert)

    dws0 = tuple(_varying(jnp.zeros(weights[j].shape, weights[j].dtype), varying) for j in trained)
    dws, dx_nbi = jax.lax.scan(step, dws0, (x_nbi, dy_nbo, block_expert, jnp.arange(n, dtype=jnp.int32)))
    dx_ai = dx_nbi.reshape(n * block, i).at[positions].get(mode="fill", fill_value=0)
    found = dict(zip(trained, dws))
    return dx_ai, tuple(found.get(j) for j in range(len(weights))), None


_blocks_matmul.defvjp(_blocks_matmul_fwd, _blocks_matmul_bwd, symbolic_zeros=True)


def _block_product(x_bi, weights, lora_scale):
    """float32 `[block, out]`: a block's rows times its expert's slices of `weights` (`_blocks_matmul`); the
    adapter's product in float32, as `jaxmodel.layers.Linear`'s."""
    if lora_scale is None:
        (w_oi,) = weights
        return jnp.einsum("bi,oi->bo", x_bi, w_oi, preferred_element_type=jnp.float32)
    *base, a_ri, b_or = weights
    xa_br = jnp.einsum("bi,ri->br", x_bi.astype(jnp.float32), a_ri, preferred_element_type=jnp.float32) * lora_scale
    delta_bo = jnp.einsum("br,or->bo", xa_br, b_or, preferred_element_type=jnp.float32)
    return _block_product(x_bi, tuple(base), None) + delta_bo if base else delta_bo


def _padded(x_ai, positions, n: int, block: int):
    """The sorted rows `[a, i]` in the padded layout `[n, block, i]` (`_block_layout`)."""
    return jnp.zeros((n * block, x_ai.shape[1]), x_ai.dtype).at[positions].set(x_ai, mode="drop").reshape(
        n, block, -1)


def _varying(x, axes: tuple[str, ...]):
    """`x` marked as differing over the mesh axes `axes` (inside shard_map; as it is without any)."""
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _blocks_forward(x_ai, weights, rows, block, lora_scale):
    def product(x_bi, expert):
        taken = tuple(jax.lax.dynamic_index_in_dim(w, expert, axis=0, keepdims=False) for w in weights)
        return _block_product(x_bi, taken, lora_scale)

    return _over_blocks(x_ai, rows, block, weights[-1].shape[1], frozenset().union(*map(_varying_axes, weights)),
                        product)


def _over_blocks(x_ai, rows, block: int, out: int, weight_varying: frozenset[str], product):
    """float32 `[a, out]`: `product(x_bi, expert)` `[block, out]` of each block of the sorted rows `x_ai` in the
    padded layout (`_block_layout`), the blocks past the last one holding rows skipped; `weight_varying` the mesh
    axes the weights differ over inside `shard_map`."""
    positions, block_expert, used = _block_layout(rows, block)
    n = block_expert.shape[0]
    x_nbi = _padded(x_ai, positions, n, block)
    varying = tuple(_varying_axes(x_ai) | weight_varying)  # inside shard_map, as the products are

    def skip(x_bi, expert):
        return _varying(jnp.zeros((block, out), jnp.float32), varying)

    def one_block(xs):
        x_bi, expert, index = xs
        # the blocks past the last one holding rows are skipped: the static length is the worst routing's
        with jax.named_scope(scopes.EXPERT_BLOCK):
            return jax.lax.cond(index < used, product, skip, x_bi, expert)

    y_nbo = jax.lax.map(one_block, (x_nbi, block_expert, jnp.arange(n, dtype=jnp.int32)))
    return y_nbo.reshape(n * block, out).at[positions].get(mode="fill", fill_value=0)


def _varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes over which `x` differs from device to device inside `shard_map` (none outside)."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):  # jax < 0.10
        return frozenset(aval.vma)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def balanced_block_share(tokens: int, top_k: int, num_experts: int, ways: int = 1,
                         block: int | None = None) -> float:
    """The share of a "blocks" loop's blocks that hold rows when each of `ways` devices' `tokens` tokens route
    evenly over the `num_experts` experts, held `num_experts / ways` a device (`Experts._dispatched`, which then
    takes its first bound, `dispatch_bounds`; `ways` 1: every device all of them): what a grouped GEMM's work is on
    average, where the loop's static length is its bound's. Each expert receives `ways * tokens * top_k /
    num_experts` rows, padded to whole blocks."""
    held = num_experts // ways
    capacity = dispatch_bounds(tokens, top_k, held, ways)[0]
    block = block or block_rows(capacity, held)
    blocks = padded_rows(capacity, held, block) // block
    used = held * math.ceil(ways * tokens * top_k / num_experts / block)
    return min(1.0, used / blocks)


def padded_rows(routed: int, num_experts: int, block: int) -> int:
    """The static length of the "blocks" layout: `routed` rows, each expert's padded to whole blocks."""
    return -(-(routed + min(num_experts, routed) * (block - 1)) // block) * block


def _block_layout(rows: GroupedRows, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each sorted row goes in the padded layout `[a]` (past its end for a route to an expert held
    elsewhere), the expert of each block `[n]` (blocks past the last expert's hold only zeros and take the last
    expert), and how many blocks hold rows."""
    a, e = rows.expert_a.shape[0], rows.group_sizes.shape[0]
    padded_e = -(-rows.group_sizes // block) * block
    start_e = jnp.cumsum(rows.group_sizes) - rows.group_sizes
    padded_start_e = jnp.cumsum(padded_e) - padded_e
    held = rows.expert_a < e
    expert_a = jnp.minimum(rows.expert_a, e - 1)
    rank_a = jnp.arange(a, dtype=jnp.int32) - start_e[expert_a]
    n = padded_rows(a, e, block) // block
    positions = jnp.where(held, padded_start_e[expert_a] + rank_a, n * block)
    block_start = jnp.arange(n, dtype=jnp.int32) * block
    block_expert = jnp.searchsorted(jnp.cumsum(padded_e), block_start, side="right")
    return positions, jnp.minimum(block_expert, e - 1).astype(jnp.int32), jnp.sum(padded_e) // block


def combine(y_ad: jax.Array, rows: GroupedRows, weights_tk: jax.Array) -> jax.Array:
    """Each token's output `[t, d]`: its routed rows' outputs `y_ad` (sorted) weighted by the router and summed over
    its `k` experts in slot order, in float32; a route to an expert held elsewhere, or left out of the rows, adds
    nothing."""
    t, k = weights_tk.shape
    a = y_ad.shape[0]
    y_ad = jnp.where((rows.expert_a < rows.group_sizes.shape[0])[:, None], y_ad.astype(jnp.float32), 0.0)
    # each route's sorted row, or one past the rows
    row_tk = jnp.full((t * k,), a, jnp.int32).at[rows.order].set(jnp.arange(a, dtype=jnp.int32)).reshape(t, k)
    weights_tk = weights_tk.astype(jnp.float32)
    # a slot at a time: [t, d] gathered at once, never [t, k, d]
    out_td = jnp.zeros((t, y_ad.shape[1]), jnp.float32)
    for slot in range(k):
        out_td = out_td + y_ad.at[row_tk[:, slot]].get(mode="fill", fill_value=0) * weights_tk[:, slot, None]
    return out_td


def routed_experts(x_td: jax.Array, weights_tk: jax.Array, experts_tk: jax.Array, gate_up_efd: jax.Array,
                   down_edf: jax.Array, activation: str = "silu", impl: str = "blocks",
                   block: int | None = None) -> jax.Array:
    """The experts' gated MLPs on the routed rows, weighted and summed per token: float32 `[t, d]`. `gate_up_efd`
    is transformers 5's fused `[e, 2f, d]` (the gate's rows first), `down_edf` `[e, d, f]`; products in the
    weights' dtype are accumulated in float32 and rounded to it (as `jaxmodel.layers.Linear`)."""
    dtype = gate_up_efd.dtype

    def project(w_eoi):
        return lambda x_ai, rows: grouped_matmul(x_ai, w_eoi, rows, impl, block)

    return _gated_experts(x_td, weights_tk, experts_tk, project(gate_up_efd), project(down_edf), gate_up_efd.shape[0],
                          dtype, activation)


def _gated_experts(x_td, weights_tk, experts_tk, gate_up, down, num_experts: int, dtype, activation: str,
                   first: jax.Array | int = 0, bound: int | None = None, start: jax.Array | int = 0):
    """`routed_experts` with the two projections as functions of (sorted rows, `GroupedRows`) giving float32, over
    the `num_experts` experts from `first` on, the `bound` sorted rows from `start` on (`group_rows`)."""
    rows = group_rows(experts_tk, num_experts, first, bound, start)
    x_ad = x_td.astype(dtype)[rows.token_a]
    h_a2f = gate_up(x_ad, rows).astype(dtype)
    f = h_a2f.shape[1] // 2
    y_ad = down(swiglu(h_a2f[:, :f], h_a2f[:, f:], activation), rows)
    return combine(y_ad.astype(dtype), rows, weights_tk)


class GroupedLinear(nnx.Module):
    """One projection of every expert, `weight` `[e, out, in]` (torch's `[out, in]` for each expert: transformers 5's
    fused parameter), each routed row times its own expert's weight (`grouped_matmul`), accumulated in float32. With
    `quantization` the frozen weight is held as `codes` and `scales` instead (`jaxmodel.quantization`, blocks along
    each expert's input dimension), dequantized on each call. With a LoRA adapter attached
    (`jaxmodel.lora.apply_lora`), one of rank r for each expert, as PEFT's `target_parameters` adapts the parameter:
    `lora_a` `[e, r, in]` and `lora_b` `[e, out, r]`, adding `scale * (x A_e^T) B_e^T` on the rows routed to expert e,
    in float32 (the rows routed, never a dense delta of every expert)."""

    def __init__(self, experts: int, in_features: int, out_features: int, *, axes: tuple[str, str],
                 layers: int | None, dtype, param_dtype, rngs: nnx.Rngs, grouped: str = "blocks",
                 block: int | None = None, quantization: Quantization | None = None):
        shape, names = _stacked(layers, (experts, out_features, in_features), ("experts", *axes))
        self.weight_shape, self.weight_axes = shape, names
        self.quantization = quantization
        self.weight, self.codes, self.scales = frozen_weight(shape, names, param_dtype, quantization, rngs)
        self.dtype, self.grouped, self.block = dtype, grouped, block
        self.lora_a: LoRAParam | None = nnx.data(None)  # set by jaxmodel.lora.apply_lora
        self.lora_b: LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0

    def __call__(self, x_ai: jax.Array, rows: GroupedRows) -> jax.Array:
        """float32 `[a, out]` for the sorted routed rows `x_ai`. The products are named for the `dots` remat
        policies (`jaxmodel.matmul.saved_as_dot`), as a Linear's are: the blocks path's own VJP hides its matmuls
        from them, and without the names a layer's backward pass computed its experts' forward again (the
        experts' part of a Mixtral step 1.4x slower under `dots`). Under expert parallelism nothing of it is saved
        (`recomputed_in_backward`). The adapter's products are taken in the same pass over the rows as the
        weight's (`grouped_matmul`); as their own two passes, each with its copy of the rows padded and gathered
        back, they made one Mixtral-sized layer's experts ~25% slower on a CPU."""
        x_ai = x_ai.astype(self.dtype)
        adapter = None if self.lora_a is None else ExpertAdapter(
            self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32), self.lora_scale)
        if self.quantization is None:
            y_ao = grouped_matmul(x_ai, self.weight[...].astype(self.dtype), rows, self.grouped, self.block, adapter)
        elif self.quantization.matmul is not None:
            y_ao = _fp8_grouped_matmul(x_ai, self.codes[...], self.scales[...], rows, self.quantization, self.dtype,
                                       self.grouped, self.block)
            if adapter is not None:
                y_ao = y_ao + grouped_matmul(x_ai, None, rows, self.grouped, self.block, adapter)
        else:
            y_ao = _dequantized_grouped_matmul(x_ai, self.codes[...], self.scales[...], rows, self.quantization,
                                               self.dtype, self.grouped, self.block, adapter)
        return saved_as_dot(y_ao)


# As `jaxmodel.layers._dequantized_matmul`: nothing inside is saved for the backward pass, which dequantizes again,
# so that no layer's dequantized experts are kept until then.
@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False,
                   static_argnums=(4, 5, 6, 7))
def _dequantized_grouped_matmul(x_ai, codes, scales, rows, quantization: Quantization, dtype, impl: str, block: int,
                                adapter: ExpertAdapter | None = None):
    return grouped_matmul(x_ai, dequantize(codes, scales, quantization, dtype), rows, impl, block, adapter)


# An fp8 base multiplied in FP8 (`Quantization.matmul`): each block of rows against its expert's codes as stored
# (`jaxmodel.fp8_matmul`), on the blocks path whatever `impl`; the backward pass is the dequantized grouped matmul's,
# whose weight stays frozen.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fp8_grouped_matmul(x_ai, codes, scales, rows, quantization: Quantization, dtype, impl: str, block: int | None):
    def product(x_bi, expert):
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=expert, axis=0, keepdims=False)
        return fp8_product(x_bi, take(codes), take(scales), quantization)

    return _over_blocks(x_ai, rows, block or block_rows(x_ai.shape[0], codes.shape[0]), codes.shape[1],
                        _varying_axes(codes) | _varying_axes(scales), product)


def _fp8_grouped_matmul_fwd(x_ai, codes, scales, rows, quantization, dtype, impl, block):
    return _fp8_grouped_matmul(x_ai, codes, scales, rows, quantization, dtype, impl, block), (x_ai, codes, scales,
                                                                                               rows)


def _fp8_grouped_matmul_bwd(quantization, dtype, impl, block, residuals, dy_ao):
    x_ai, codes, scales, rows = residuals
    _, vjp = jax.vjp(lambda x: _dequantized_grouped_matmul(x, codes, scales, rows, quantization, dtype, impl, block),
                     x_ai)
    no_gradient = functools.partial(np.zeros, dtype=jax.dtypes.float0)  # the codes and the routes: integers
    return (vjp(dy_ao)[0], no_gradient(codes.shape), jnp.zeros_like(scales),
            jax.tree.map(lambda r: no_gradient(r.shape), rows))


_fp8_grouped_matmul.defvjp(_fp8_grouped_matmul_fwd, _fp8_grouped_matmul_bwd)


class Experts(nnx.Module):
    """The routed experts' gated MLPs: `gate_up_proj` `[e, 2f, d]` (the gate's rows first) and `down_proj` `[e, d, f]`
    (`GroupedLinear`s), as transformers 5 holds them (`mlp.experts` of Qwen3-MoE and Mixtral); with `layers=L` a
    leading `[L]` axis. `grouped` and `block` choose the grouped matmul (`grouped_matmul`)."""

    def __init__(self, config, *, layers: int | None, dtype, param_dtype, rngs: nnx.Rngs, grouped: str = "blocks",
                 block: int | None = None, quantization: Quantization | None = None):
        e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        kw = dict(layers=layers, dtype=dtype, param_dtype=param_dtype, rngs=rngs, grouped=grouped, block=block,
                  quantization=quantization)
        self.gate_up_proj = GroupedLinear(e, d, 2 * f, axes=("mlp", "embed"), **kw)
        self.down_proj = GroupedLinear(e, f, d, axes=("embed", "mlp"), **kw)
        self.num_experts, self.activation, self.dtype = e, config.hidden_act, dtype

    def __call__(self, x_td: jax.Array, weights_tk: jax.Array, experts_tk: jax.Array,
                 rules: Rules = DEFAULT_RULES) -> jax.Array:
        """Each token's weighted sum of its experts' outputs, float32 `[t, d]`.

        Under a mesh each device computes the rows of its own tokens (`shard_map` over the axes the tokens are split
        over, and over `mp`, which takes its part of each device's tokens). Where the rules split the experts over
        mesh axes the tokens are split over too (`expert_axes`: `fsdp`'s devices own the experts), the devices of
        those axes gather each other's tokens, each multiplies the rows routed to the experts it holds, and the
        partial sums go back to their tokens' devices (`_dispatched`); the experts never move. Otherwise the layer's
        experts are gathered whole onto every device (as the fully sharded dense weights are, layer by layer).
        Left to the partitioner, the sort over all tokens was replicated and each block of rows reduced its partial
        products over the split hidden dimension: Qwen3-30B-A3B at 16 x 2048 on fsdp=8 planned 2.0M all-gathers a
        step."""
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else _token_axes(mesh, rules, x_td.shape[0])
        if not axes:
            return self._local(x_td, weights_tk, experts_tk)
        owners = tuple(a for a in expert_axes(mesh, rules, self.num_experts) if a in axes)
        graphdef, state = nnx.split(self)
        mp = mesh.shape.get("mp", 1)
        mp = mp if x_td.shape[0] // math.prod(mesh.shape[a] for a in axes) % mp == 0 else 1

        def per_device(state, x_td, weights_tk, experts_tk):
            # The weights and adapters marked as differing per device once, here: their gradients are then summed
            # over the devices once a layer, where left to each use in the blocks loop they were summed at each block.
            # (Over the experts' owners they differ already: each device holds its own experts.)
            varying = tuple(a for a in axes if a not in owners) + (("mp",) if mp > 1 else ())
            if varying:
                state = jax.tree.map(lambda v: jax.lax.pcast(v, varying, to="varying"), state)
            experts = nnx.merge(graphdef, state)
            if mp == 1:
                return experts._dispatched(x_td, weights_tk, experts_tk, owners)
            part = x_td.shape[0] // mp  # mp's devices share this device's tokens
            start = jax.lax.axis_index("mp") * part
            y_td = experts._dispatched(*(jax.lax.dynamic_slice_in_dim(v, start, part) for v in
                                         (x_td, weights_tk, experts_tk)), owners)
            # put back together as a sum, which leaves the result the same on every mp device (as its spec says),
            # where an all-gather's would count as differing: the bytes of the dense MLP's own mp reduction
            whole = jnp.zeros((x_td.shape[0], y_td.shape[1]), y_td.dtype)
            return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(whole, y_td, start, 0), "mp")

        rows = P(axes)
        return jax.shard_map(per_device, mesh=mesh, in_specs=(P(owners or None), rows, rows, rows), out_specs=rows)(
            state, x_td, weights_tk, experts_tk)

    def _dispatched(self, x_td, weights_tk, experts_tk, owners: tuple[str, ...]):
        """Inside `shard_map`: this device's tokens' outputs, float32 `[t, d]`, with the experts split over the mesh
        axes `owners` (each device holding `e / ways` of them, in the order of its index over `owners`).

        The dispatch, dropless and static in shape: the tokens, weights and routes of the `ways` devices gathered
        (`[ways * t]` rows each), this device's experts' routed rows sorted first and taken `capacity` at a time
        (`dispatch_bounds`: `CAPACITY_FACTOR` times the rows a balanced routing sends them): one pass, and, when more
        are routed to them, further passes of as many rows, up to the most they can receive (`ways * t *
        min(k, e / ways)`), so that no routing drops a row and none needs room for the worst case at once; the blocks
        past the rows routed are skipped (`grouped_matmul`). Each device's partial sums over the experts it holds are
        then summed onto the devices whose tokens they are (a reduce-scatter, float32). Per layer and pass: an
        all-gather of the hidden states and a reduce-scatter of the outputs over `owners`; no expert leaves its
        owners (with cp or mp, a device's own experts are gathered over them: their hidden and intermediate
        dimensions lie there)."""
        if not owners:
            return self._local(x_td, weights_tk, experts_tk)
        ways = math.prod(jax.lax.axis_size(a) for a in owners)
        held, tokens, top_k = self.num_experts // ways, x_td.shape[0], weights_tk.shape[1]
        capacity, worst = dispatch_bounds(tokens, top_k, held, ways)
        gather = functools.partial(jax.lax.all_gather, axis_name=owners, axis=0, tiled=True)
        x_td, weights_tk, experts_tk = gather(x_td), gather(weights_tk), gather(experts_tk)
        first = jax.lax.axis_index(owners) * held
        graphdef, state = nnx.split(self)

        def window(state, x_td, weights_tk, experts_tk, first, start):
            experts = nnx.merge(graphdef, state)
            return _gated_experts(x_td, weights_tk, experts_tk, experts.gate_up_proj, experts.down_proj, held,
                                  experts.dtype, experts.activation, first, capacity, start)

        def held_experts(state, x_td, weights_tk, experts_tk, first):
            y_td = window(state, x_td, weights_tk, experts_tk, first, 0)
            if capacity == worst:
                return y_td
            routed_here = jnp.sum((experts_tk >= first) & (experts_tk < first + held))

            def further(y_td, start):
                def run():
                    return window(state, x_td, weights_tk, experts_tk, first, start)

                # the branch a balanced routing takes first (the plan counts it: finetune/planning/hlo_cost.py)
                with jax.named_scope(scopes.EXPERT_DISPATCH):
                    return y_td + jax.lax.cond(start >= routed_here, lambda: jnp.zeros_like(y_td), run), None

            # a pass at a time, each recomputed in the backward pass: one pass's rows are held at a time
            further = jax.checkpoint(further, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
            starts = jnp.arange(1, -(-worst // capacity), dtype=jnp.int32) * capacity
            return jax.lax.scan(further, y_td, starts)[0]

        # The rows are sized for more than a device's experts receive on average: none of them is kept for the
        # backward pass, whatever the remat policy (with the worst case's room, `dots` kept the products of every
        # layer: Qwen3-30B-A3B at 16 x 2048 on fsdp=8 planned 208 GB of temporaries a device, 19 GB with `full`).
        y_td = recomputed_in_backward(held_experts, state, x_td, weights_tk, experts_tk, first)
        return jax.lax.psum_scatter(y_td, owners, scatter_dimension=0, tiled=True)

    def _local(self, x_td, weights_tk, experts_tk):
        return _gated_experts(x_td, weights_tk, experts_tk, self.gate_up_proj, self.down_proj, self.num_experts,
                              self.dtype, self.activation)


def recomputed_in_backward(fn, *args):
    """`fn(*args)` (one array) whose backward pass computes it again: its residuals are its arguments, nothing it
    computes inside, whatever the remat policy around it (a policy's choice reaches inside `jax.checkpoint` and
    loops; not inside a custom VJP's backward). Gradients only for the arguments being differentiated."""
    leaves, treedef = jax.tree.flatten(args)

    def flat(*leaves):
        return fn(*jax.tree.unflatten(treedef, leaves))

    @jax.custom_vjp
    def call(*leaves):
        return flat(*leaves)

    def forward(*primals):
        values = [p.value for p in primals]
        # which arguments are differentiated, held in the residuals' structure (static)
        return flat(*values), (values, tuple((True,) if p.perturbed else () for p in primals))

    def backward(residuals, dy):
        values, marks = residuals
        perturbed = [bool(m) for m in marks]
        if isinstance(dy, jax.custom_derivatives.SymbolicZero):
            dy = jnp.zeros(dy.shape, dy.dtype)

        def of_perturbed(*changing):
            it = iter(changing)
            return flat(*(next(it) if p else v for v, p in zip(values, perturbed)))

        _, vjp = jax.vjp(of_perturbed, *(v for v, p in zip(values, perturbed) if p))
        grads = iter(vjp(dy))
        return tuple(next(grads) if p else None for p in perturbed)

    call.defvjp(forward, backward, symbolic_zeros=True)
    return call(*leaves)


def expert_axes(mesh, rules: Rules, num_experts: int) -> tuple[str, ...]:
    """The mesh axes the rules split a layer's `num_experts` experts over (their owners); () when none."""
    entry = partition_spec(("experts",), (num_experts,), mesh, rules)[0]
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _token_axes(mesh, rules: Rules, tokens: int) -> tuple[str, ...]:
    """The mesh axes a layer's `[b * t]` tokens are split over (the batch's, then the sequence's, as the rules lay
    them), when they split them evenly; () when there are none or they do not divide."""
    table = dict(rules)
    axes = []
    for logical in ("act_batch", "act_seq"):
        found = table.get(logical)
        axes += [found] if isinstance(found, str) else list(found or ())
    axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
    ways = math.prod(mesh.shape[a] for a in axes)
    return () if tokens % ways else axes


class BiasedRouter(Linear):
    """DeepSeek-V3's router: its `[e, d]` weight and `e_score_correction_bias` `[e]`, a frozen buffer added to the
    scores for choosing the experts only (`grouped_sigmoid_route`). Both are float32 and the logits are computed in
    float32 whatever the model's dtypes, as transformers keeps them (`_keep_in_fp32_modules_strict`): a bf16 bias
    would move the scores that choose the experts."""

    def __init__(self, in_features: int, experts: int, *, layers: int | None, rngs: nnx.Rngs):
        super().__init__(in_features, experts, axes=("experts", "embed"), layers=layers, dtype=jnp.float32,
                         param_dtype=jnp.float32, rngs=rngs)
        shape, axes = _stacked(layers, (experts,), ("experts",))
        self.e_score_correction_bias = nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


class SparseMoeBlock(nnx.Module):
    """A sparse layer's MLP: the router `gate` (`[e, d]`, a Linear) choosing each token's experts (`route`;
    DeepSeek-V3's `BiasedRouter` and `grouped_sigmoid_route` with `router_groups`) and the `experts` (`Experts`),
    transformers 5's `mlp` of Qwen3-MoE and Mixtral; with `shared_experts`, an MLP every token runs beside them
    (DeepSeek-V3's `shared_experts`, the decoder's MLP module, given). With `quantization` the experts hold their
    weights quantized; the router, small and deciding which experts run, does not."""

    def __init__(self, config, *, layers: int | None, dtype, param_dtype, rngs: nnx.Rngs, grouped: str = "blocks",
                 block: int | None = None, quantization: Quantization | None = None,
                 shared_experts: nnx.Module | None = None):
        c = config
        if c.router_groups:
            self.gate = BiasedRouter(c.hidden_size, c.num_experts, layers=layers, rngs=rngs)
        else:
            self.gate = Linear(c.hidden_size, c.num_experts, axes=("experts", "embed"), layers=layers, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(c, layers=layers, dtype=dtype, param_dtype=param_dtype, rngs=rngs, grouped=grouped,
                               block=block, quantization=quantization)
        self.shared_experts = shared_experts
        self.top_k, self.normalize, self.round_weights = c.num_experts_per_tok, c.norm_topk_prob, c.round_router_weights
        self.groups, self.top_groups, self.scale = c.router_groups, c.router_top_groups, c.routed_scaling_factor
        self.dtype = dtype

    def __call__(self, x_btd: jax.Array, rules: Rules = DEFAULT_RULES,
                 real_bt: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RouterStats | None]:
        """The block's output `[b, t, d]`, each token's experts `[b, t, k]` (int32, largest weight first) and, given
        which tokens are real (`real_bt`), the routing's `RouterStats` (else None)."""
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        logits_te = self.gate(x_td)
        if self.groups:
            weights_tk, experts_tk = grouped_sigmoid_route(logits_te, self.gate.e_score_correction_bias[...],
                                                           self.top_k, self.groups, self.top_groups, self.normalize,
                                                           self.scale)
        else:
            weights_tk, experts_tk = route(logits_te, self.top_k, self.normalize)
        stats = None if real_bt is None else router_stats(logits_te, experts_tk, real_bt.reshape(b * t))
        if self.round_weights:  # as transformers' Qwen3-MoE router casts them to the hidden states' dtype
            weights_tk = weights_tk.astype(self.dtype).astype(jnp.float32)
        y_btd = self.experts(x_td, weights_tk, experts_tk, rules).astype(self.dtype).reshape(b, t, d)
        if self.shared_experts is not None:
            y_btd = y_btd + self.shared_experts(x_btd, rules=rules)
        return y_btd, experts_tk.reshape(b, t, -1), stats


def reference_experts(x_td: np.ndarray, weights_tk: np.ndarray, experts_tk: np.ndarray, gate_up_efd: np.ndarray,
                      down_edf: np.ndarray, activation=lambda g: g / (1 + np.exp(-g))) -> np.ndarray:
    """numpy, float64, one token at a time: `sum_k weight * down_e(act(gate_e(x)) * up_e(x))`, the fused `gate_up`
    `[e, 2f, d]` holding the gate's rows first (transformers 5's layout)."""
    f = down_edf.shape[2]
    out = np.zeros(x_td.shape, np.float64)
    for token, (ws, es) in enumerate(zip(weights_tk, experts_tk)):
        for w, e in zip(ws, es):
            h = gate_up_efd[e].astype(np.float64) @ x_td[token].astype(np.float64)
            out[token] += w * (down_edf[e].astype(np.float64) @ (activation(h[:f]) * h[f:]))
    return out
