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

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmodel import scopes
from jaxmodel.layers import Linear, LoRAParam, _stacked, frozen_weight, swiglu
from jaxmodel.quantization import Quantization, dequantize
from jaxmodel.sharding import DEFAULT_RULES, Rules

GROUPED_MATMULS = ("blocks", "ragged", "dense")


def route(logits_te: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Each token's `top_k` experts and their weights from the router's logits: a softmax over all experts in
    float32, the `top_k` largest, renormalised to sum to 1 when `normalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral
    always). Returns float32 weights `[t, k]` and int32 experts `[t, k]`, largest weight first."""
    probs_te = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights_tk, experts_tk = jax.lax.top_k(probs_te, top_k)
    if normalize:
        weights_tk = weights_tk / jnp.sum(weights_tk, axis=-1, keepdims=True)
    return weights_tk, experts_tk.astype(jnp.int32)


class GroupedRows(NamedTuple):
    """The routed rows of a layer's tokens sorted by expert: row `j` of the sorted order is token
    `token_a[j]`'s route to expert `expert_a[j]`, which `order[j]` numbers in the `[t, k]` routes flattened."""

    order: jax.Array  # [a] int32: flattened route (token * k + slot) of each sorted row
    token_a: jax.Array  # [a] int32
    expert_a: jax.Array  # [a] int32, non-decreasing
    group_sizes: jax.Array  # [e] int32: rows of each expert


def group_rows(experts_tk: jax.Array, num_experts: int) -> GroupedRows:
    """The routes of `experts_tk` sorted by expert (stable: a token's rows keep the token order within an expert)."""
    t, k = experts_tk.shape
    flat_a = experts_tk.reshape(-1)
    order = jnp.argsort(flat_a, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat_a, length=num_experts).astype(jnp.int32)
    return GroupedRows(order, order // k, flat_a[order], group_sizes)


def grouped_matmul(x_ai: jax.Array, w_eoi: jax.Array, rows: GroupedRows, impl: str = "blocks",
                   block: int = 64) -> jax.Array:
    """`x_ai[j] @ w_eoi[expert of row j].T` for the sorted rows `x_ai`, accumulated and returned in float32."""
    if impl == "ragged":
        return jax.lax.ragged_dot(x_ai, jnp.swapaxes(w_eoi, 1, 2), rows.group_sizes,
                                  preferred_element_type=jnp.float32)
    if impl == "dense":
        y_aeo = jnp.einsum("ai,eoi->aeo", x_ai, w_eoi, preferred_element_type=jnp.float32)
        return jnp.take_along_axis(y_aeo, rows.expert_a[:, None, None], axis=1)[:, 0]
    if impl != "blocks":
        raise ValueError(f"grouped matmul must be one of {GROUPED_MATMULS}, got {impl!r}")
    positions, block_expert = _block_layout(rows, block)
    i, n = x_ai.shape[1], block_expert.shape[0]
    x_nbi = jnp.zeros((n * block, i), x_ai.dtype).at[positions].set(x_ai).reshape(n, block, i)

    def one_block(xs):
        x_bi, expert = xs
        w_oi = jax.lax.dynamic_index_in_dim(w_eoi, expert, axis=0, keepdims=False)
        return jnp.einsum("bi,oi->bo", x_bi, w_oi, preferred_element_type=jnp.float32)

    y_nbo = jax.lax.map(one_block, (x_nbi, block_expert))
    return y_nbo.reshape(n * block, -1)[positions]


def padded_rows(routed: int, num_experts: int, block: int) -> int:
    """The static length of the "blocks" layout: `routed` rows, each expert's padded to whole blocks."""
    return -(-(routed + min(num_experts, routed) * (block - 1)) // block) * block


def _block_layout(rows: GroupedRows, block: int) -> tuple[jax.Array, jax.Array]:
    """Where each sorted row goes in the padded layout `[a]`, and the expert of each block `[n]` (blocks past the
    last expert's hold only zeros and take the last expert)."""
    a, e = rows.expert_a.shape[0], rows.group_sizes.shape[0]
    padded_e = -(-rows.group_sizes // block) * block
    start_e = jnp.cumsum(rows.group_sizes) - rows.group_sizes
    padded_start_e = jnp.cumsum(padded_e) - padded_e
    rank_a = jnp.arange(a, dtype=jnp.int32) - start_e[rows.expert_a]
    positions = padded_start_e[rows.expert_a] + rank_a
    n = padded_rows(a, e, block) // block
    block_start = jnp.arange(n, dtype=jnp.int32) * block
    block_expert = jnp.searchsorted(jnp.cumsum(padded_e), block_start, side="right")
    return positions, jnp.minimum(block_expert, e - 1).astype(jnp.int32)


def combine(y_ad: jax.Array, rows: GroupedRows, weights_tk: jax.Array) -> jax.Array:
    """Each token's output `[t, d]`: its routed rows' outputs `y_ad` (sorted) weighted by the router and summed over
    its `k` experts, in float32."""
    t, k = weights_tk.shape
    y_tkd = jnp.zeros_like(y_ad, jnp.float32).at[rows.order].set(y_ad.astype(jnp.float32)).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y_tkd, weights_tk.astype(jnp.float32))


def routed_experts(x_td: jax.Array, weights_tk: jax.Array, experts_tk: jax.Array, gate_up_efd: jax.Array,
                   down_edf: jax.Array, activation: str = "silu", impl: str = "blocks", block: int = 64) -> jax.Array:
    """The experts' gated MLPs on the routed rows, weighted and summed per token: float32 `[t, d]`. `gate_up_efd`
    is transformers 5's fused `[e, 2f, d]` (the gate's rows first), `down_edf` `[e, d, f]`; products in the
    weights' dtype are accumulated in float32 and rounded to it (as `jaxmodel.layers.Linear`)."""
    dtype = gate_up_efd.dtype

    def project(w_eoi):
        return lambda x_ai, rows: grouped_matmul(x_ai, w_eoi, rows, impl, block)

    return _gated_experts(x_td, weights_tk, experts_tk, project(gate_up_efd), project(down_edf), gate_up_efd.shape[0],
                          dtype, activation)


def _gated_experts(x_td, weights_tk, experts_tk, gate_up, down, num_experts: int, dtype, activation: str):
    """`routed_experts` with the two projections as functions of (sorted rows, `GroupedRows`) giving float32."""
    rows = group_rows(experts_tk, num_experts)
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
                 layers: int | None, dtype, param_dtype, rngs: nnx.Rngs, grouped: str = "blocks", block: int = 64,
                 quantization: Quantization | None = None):
        shape, names = _stacked(layers, (experts, out_features, in_features), ("experts", *axes))
        self.weight_shape, self.weight_axes = shape, names
        self.quantization = quantization
        self.weight, self.codes, self.scales = frozen_weight(shape, names, param_dtype, quantization, rngs)
        self.dtype, self.grouped, self.block = dtype, grouped, block
        self.lora_a: LoRAParam | None = nnx.data(None)  # set by jaxmodel.lora.apply_lora
        self.lora_b: LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0

    def __call__(self, x_ai: jax.Array, rows: GroupedRows) -> jax.Array:
        """float32 `[a, out]` for the sorted routed rows `x_ai`."""
        x_ai = x_ai.astype(self.dtype)
        if self.quantization is None:
            y_ao = grouped_matmul(x_ai, self.weight[...].astype(self.dtype), rows, self.grouped, self.block)
        else:
            y_ao = _dequantized_grouped_matmul(x_ai, self.codes[...], self.scales[...], rows, self.quantization,
                                               self.dtype, self.grouped, self.block)
        if self.lora_a is None:
            return y_ao
        with jax.named_scope(scopes.LORA):
            xa_ar = grouped_matmul(x_ai.astype(jnp.float32), self.lora_a[...].astype(jnp.float32), rows, self.grouped,
                                   self.block)
            return y_ao + grouped_matmul(xa_ar * self.lora_scale, self.lora_b[...].astype(jnp.float32), rows,
                                         self.grouped, self.block)


# As `jaxmodel.layers._dequantized_matmul`: nothing inside is saved for the backward pass, which dequantizes again,
# so that no layer's dequantized experts are kept until then.
@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False,
                   static_argnums=(4, 5, 6, 7))
def _dequantized_grouped_matmul(x_ai, codes, scales, rows, quantization: Quantization, dtype, impl: str, block: int):
    return grouped_matmul(x_ai, dequantize(codes, scales, quantization, dtype), rows, impl, block)


class Experts(nnx.Module):
    """The routed experts' gated MLPs: `gate_up_proj` `[e, 2f, d]` (the gate's rows first) and `down_proj` `[e, d, f]`
    (`GroupedLinear`s), as transformers 5 holds them (`mlp.experts` of Qwen3-MoE and Mixtral); with `layers=L` a
    leading `[L]` axis. `grouped` and `block` choose the grouped matmul (`grouped_matmul`)."""

    def __init__(self, config, *, layers: int | None, dtype, param_dtype, rngs: nnx.Rngs, grouped: str = "blocks",
                 block: int = 64, quantization: Quantization | None = None):
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
        over, and over `mp`, which takes its part of each device's tokens): the layer's experts are gathered whole
        onto every device once (as the fully sharded dense weights are, layer by layer), and the routed rows are
        sorted and multiplied where their tokens are. Left to the partitioner, the sort over all tokens was
        replicated and each block of rows reduced its partial products over the split hidden dimension: Qwen3-30B-A3B
        at 16 x 2048 on fsdp=8 planned 2.0M all-gathers a step."""
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else _token_axes(mesh, rules, x_td.shape[0])
        if not axes:
            return self._local(x_td, weights_tk, experts_tk)
        graphdef, state = nnx.split(self)
        mp = mesh.shape.get("mp", 1)
        mp = mp if x_td.shape[0] // math.prod(mesh.shape[a] for a in axes) % mp == 0 else 1

        def per_device(state, x_td, weights_tk, experts_tk):
            # The weights and adapters marked as differing per device once, here: their gradients are then summed
            # over the devices once a layer, where left to each use in the blocks loop they were summed at each block.
            varying = axes + (("mp",) if mp > 1 else ())
            state = jax.tree.map(lambda v: jax.lax.pcast(v, varying, to="varying"), state)
            experts = nnx.merge(graphdef, state)
            if mp == 1:
                return experts._local(x_td, weights_tk, experts_tk)
            part = x_td.shape[0] // mp  # mp's devices share this device's tokens
            start = jax.lax.axis_index("mp") * part
            y_td = experts._local(*(jax.lax.dynamic_slice_in_dim(v, start, part) for v in
                                    (x_td, weights_tk, experts_tk)))
            # put back together as a sum, which leaves the result the same on every mp device (as its spec says),
            # where an all-gather's would count as differing: the bytes of the dense MLP's own mp reduction
            whole = jnp.zeros((x_td.shape[0], y_td.shape[1]), y_td.dtype)
            return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(whole, y_td, start, 0), "mp")

        rows = P(axes)
        return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), rows, rows, rows), out_specs=rows)(
            state, x_td, weights_tk, experts_tk)

    def _local(self, x_td, weights_tk, experts_tk):
        return _gated_experts(x_td, weights_tk, experts_tk, self.gate_up_proj, self.down_proj, self.num_experts,
                              self.dtype, self.activation)


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


class SparseMoeBlock(nnx.Module):
    """A sparse layer's MLP: the router `gate` (`[e, d]`, a Linear) choosing each token's experts (`route`) and the
    `experts` (`Experts`), transformers 5's `mlp` of Qwen3-MoE and Mixtral. With `quantization` the experts hold
    their weights quantized; the router, small and deciding which experts run, does not."""

    def __init__(self, config, *, layers: int | None, dtype, param_dtype, rngs: nnx.Rngs, grouped: str = "blocks",
                 block: int = 64, quantization: Quantization | None = None):
        c = config
        self.gate = Linear(c.hidden_size, c.num_experts, axes=("experts", "embed"), layers=layers, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(c, layers=layers, dtype=dtype, param_dtype=param_dtype, rngs=rngs, grouped=grouped,
                               block=block, quantization=quantization)
        self.top_k, self.normalize, self.round_weights = c.num_experts_per_tok, c.norm_topk_prob, c.round_router_weights
        self.dtype = dtype

    def __call__(self, x_btd: jax.Array, rules: Rules = DEFAULT_RULES) -> tuple[jax.Array, jax.Array]:
        """The block's output `[b, t, d]` and each token's experts `[b, t, k]` (int32, largest weight first)."""
        b, t, d = x_btd.shape
        x_td = x_btd.reshape(b * t, d)
        weights_tk, experts_tk = route(self.gate(x_td), self.top_k, self.normalize)
        if self.round_weights:  # as transformers' Qwen3-MoE router casts them to the hidden states' dtype
            weights_tk = weights_tk.astype(self.dtype).astype(jnp.float32)
        y_btd = self.experts(x_td, weights_tk, experts_tk, rules).astype(self.dtype).reshape(b, t, d)
        return y_btd, experts_tk.reshape(b, t, -1)


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
