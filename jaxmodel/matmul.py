"""Contractions accumulated and returned in float32, whose backward pass keeps its matmuls on operands of
the forward's dtype; and the names under which the remat policies keep their outputs.

Why: XLA:CPU's `float-normalization-bf16` pass rewrites a bf16 x bf16 -> bf16 dot into an f32 x f32 dot on
converted operands; the one bf16 dot it keeps, and hands to YNNPACK's bf16 kernels, has bf16 operands and a
float32 result ([2048, 512] x [512, 1536] on a 2-core Zen 4: f32 30.4 ms, bf16 -> bf16 31.9 ms, bf16 -> f32
15.4 ms). JAX's own transpose of such a dot contracts the float32 cotangent with a bf16 operand, a mixed dot
that runs in float32 again, so `einsum_acc32` has its own VJP that rounds the cotangent to the operands'
dtype first. On GPUs and TPUs a bf16 matmul accumulating in float32 is what the matrix units do anyway, so the
same code is right on every backend; in float32 it is the plain float32 contraction and its gradients.

Under `jax.checkpoint` a custom VJP is opaque: the dot policies (`checkpoint_dots`, ...) see no `dot_general`
and would recompute every projection in the backward pass. Callers therefore mark the values those policies
should keep with `saved_as_dot` (after rounding to the compute dtype, so bf16 activations are kept in 16 bits),
and `DOT_POLICIES` are the dot policies that keep them too (`saved_residual` inside a custom VJP's forward
rule). `remat_name` saves 16-bit values as integers, which the layer scan stacks in place on XLA:CPU.

The backward pass's dots are `gradient_einsum`s: laid out on the CPU so that XLA:CPU runs every one of them
with YNNPACK; elsewhere the plain einsums.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# checkpoint_name tags of contraction outputs: without batch dimensions (projections) and with them (attention)
DOT = "dot"
BATCHED_DOT = "batched_dot"

DOT_POLICIES = {
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, jax.checkpoint_policies.save_only_these_names(DOT, BATCHED_DOT)),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, jax.checkpoint_policies.save_only_these_names(DOT)),
}


def saved_as_dot(x: jax.Array, *, batched: bool = False) -> jax.Array:
    """`x`, a value computed by `einsum_acc32` (rounded, maybe with a bias added), tagged for DOT_POLICIES."""
    return remat_name(x, _dot_name(batched))


def saved_residual(x: jax.Array, *, batched: bool = False) -> jax.Array:
    """`saved_as_dot` for a residual of a custom VJP's forward rule, which is never differentiated: a 16-bit
    `x` is named as its bits directly, since the policies do not see a name inside the custom JVP call that
    `remat_name` wraps it in."""
    name = _dot_name(batched)
    return _through_bits(x, name) if jnp.dtype(x.dtype).itemsize == 2 else checkpoint_name(x, name)


def _dot_name(batched: bool) -> str:
    return BATCHED_DOT if batched else DOT


def remat_name(x: jax.Array, name: str) -> jax.Array:
    """`checkpoint_name(x, name)`, with a 16-bit float `x` saved as the integers of its bits.

    Why: a value the layer scan saves is written into a `[layers, ...]` buffer by a dynamic-update-slice,
    which XLA:CPU's float normalization runs in float32 for a bf16 buffer: the whole buffer converted to
    float32 and back at every layer. An integer buffer is written in place."""
    if jnp.dtype(x.dtype).itemsize != 2:
        return checkpoint_name(x, name)
    return _saved_as_bits(x, name)


@partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saved_as_bits(x: jax.Array, name: str) -> jax.Array:
    return _through_bits(x, name)


@_saved_as_bits.defjvp
def _saved_as_bits_jvp(name: str, primals, tangents):
    # the identity, whose tangent the integer detour would otherwise lose
    return _through_bits(primals[0], name), tangents[0]


def _through_bits(x: jax.Array, name: str) -> jax.Array:
    bits = checkpoint_name(jax.lax.bitcast_convert_type(x, jnp.uint16), name)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


def einsum_acc32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, a, b)` of two operands, accumulated and returned in float32.

    Every axis of an operand must appear in the other operand or in the output (so that each gradient is a
    contraction too); `...` stands for the same leading axes wherever it appears."""
    spec = _explicit(spec, a.ndim, b.ndim)
    _operand_axes(spec)  # checked here, where the caller is, rather than in the backward pass
    return _einsum_acc32(spec, a, b)


def _explicit(spec: str, a_ndim: int, b_ndim: int) -> str:
    """`spec` with `...` replaced by letters it does not use, one per axis it stands for."""
    spec = spec.replace(" ", "")
    if "..." not in spec:
        return spec
    inputs = spec.split("->")[0].split(",")
    counts = {ndim - len(axes.replace("...", "")) for axes, ndim in zip(inputs, (a_ndim, b_ndim)) if "..." in axes}
    if len(counts) != 1:
        raise ValueError(f"einsum_acc32: `...` must stand for as many axes in each operand: {spec!r}")
    unused = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in spec]
    return spec.replace("...", "".join(unused[:counts.pop()]))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_acc32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_acc32_fwd(spec: str, a: jax.Array, b: jax.Array):
    return _einsum_acc32(spec, a, b), (a, b)


def _einsum_acc32_bwd(spec: str, residuals, g_out):
    a, b = residuals
    a_axes, b_axes, out_axes = _operand_axes(spec)
    # In the operands' dtype, so that both dots take operands of that dtype (float32: a no-op).
    g_out = g_out.astype(jnp.promote_types(a.dtype, b.dtype))
    g_a = gradient_einsum(f"{out_axes},{b_axes}->{a_axes}", g_out, b)
    g_b = gradient_einsum(f"{out_axes},{a_axes}->{b_axes}", g_out, a)
    return g_a.astype(a.dtype), g_b.astype(b.dtype)


def gradient_einsum(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, y)` accumulated in float32, on the CPU with the contracted axes minor in the first
    operand (`_minor_contraction`); the plain einsum elsewhere. For the dots of backward passes, whose weight
    gradients contract the major axis of both operands."""
    plain = partial(jnp.einsum, spec, preferred_element_type=jnp.float32)
    return jax.lax.platform_dependent(x, y, cpu=partial(_minor_contraction, spec), default=plain)


def _minor_contraction(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`jnp.einsum(spec, x, y)` accumulated in float32, as a dot whose first operand contracts its minor axes.

    Why: a weight's gradient contracts the tokens (or the queries), the major axis of both operands. XLA:CPU
    hands such a dot to Eigen rather than YNNPACK; Eigen packs both operands and its work runs on the same
    threads as the YNNPACK matmul issued beside it (bench/train.py's LoRA step in float32 on a 2-core Zen 4:
    the down projection's input gradient 20.0 ms instead of 15.1, the attention's key and value gradients
    at half the matmul peak; docs/benchmarks.md has the whole step). Here the smaller operand (a LoRA
    `[n, r]` factor, a query block) is transposed, behind an optimization barrier so that XLA cannot fold
    the transpose back into the dot, and the product too when its axes come out in another order."""
    inputs, out = spec.split("->")
    x_axes, y_axes = inputs.split(",")
    contracted = [c for c in x_axes if c in y_axes and c not in out]
    if not contracted or x_axes.endswith("".join(contracted)):
        return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)
    batch = [c for c in x_axes if c in y_axes and c in out]
    (lhs_axes, lhs), (rhs_axes, rhs) = ((x_axes, x), (y_axes, y)) if x.size <= y.size else ((y_axes, y), (x_axes, x))
    lhs_free = [c for c in lhs_axes if c not in batch and c not in contracted]
    rhs_free = [c for c in rhs_axes if c not in batch and c not in contracted]
    lhs_t_axes = "".join(batch + lhs_free + contracted)
    lhs_t = jax.lax.optimization_barrier(jnp.einsum(f"{lhs_axes}->{lhs_t_axes}", lhs))
    product_axes = "".join(batch + lhs_free + rhs_free)
    product = jnp.einsum(f"{lhs_t_axes},{rhs_axes}->{product_axes}", lhs_t, rhs, preferred_element_type=jnp.float32)
    if product_axes == out:
        return product
    return jnp.einsum(f"{product_axes}->{out}", jax.lax.optimization_barrier(product))


_einsum_acc32.defvjp(_einsum_acc32_fwd, _einsum_acc32_bwd)


def _operand_axes(spec: str) -> tuple[str, str, str]:
    """The axis letters of `a`, `b` and the output of a two-operand `spec` ("ni,oi->no")."""
    inputs, out_axes = spec.split("->")
    a_axes, b_axes = inputs.split(",")
    for own, other in ((a_axes, b_axes), (b_axes, a_axes)):
        if not set(own) <= set(other) | set(out_axes):
            raise ValueError(f"einsum_acc32: each axis of an operand must be in the other one or the output: {spec!r}")
    return a_axes, b_axes, out_axes
