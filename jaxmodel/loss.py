"""Next-token cross-entropy: the masked sums over full logits (the reference), the loss per token, and two
chunked LM heads + losses per token that never hold the `[batch, seq, vocab]` float32 logits (67 GB at 128k tokens
and vocab 128256) at once: one for any head (LoRA on it included), which computes each chunk's logits again in the
backward pass, and one for a frozen head weight, which computes them once."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxmodel.matmul import einsum_acc32, gradient_einsum
from jaxmodel.sharding import DEFAULT_RULES, Rules, constrain, split_ways

# Rows (positions x batch rows) a device computes logits for at once in the frozen-head loss. Why so few: each
# chunk's logits are fresh memory, and the step ran fastest with 256 or 512 rows (SmolLM2-135M's shape, vocab
# 49,152, on a 2-core Xeon; docs/benchmarks.md). At 405B's width a chunk's head matmul is still 2.2 TFLOP.
FROZEN_HEAD_DEVICE_ROWS = 512

# XLA:CPU sums the exponentials of a row of more than this many logits several times slower than of shorter rows:
# the sums of 512 rows of 49,152 float32 logits (SmolLM2-135M's vocabulary) in 46 ms, in two parts of 24,576 each in
# 6.4 ms (2-core Xeon).
CPU_EXP_SUM_ROW = 32768

HeadFn = Callable[[jax.Array], jax.Array]  # hidden states [b, c, d] -> float32 logits [b, c, v]


def cross_entropy_sums(logits_btv: jax.Array, targets_bt: jax.Array,
                       mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token cross-entropies, number of target tokens) from full logits: the reference."""
    losses_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)
    return jnp.sum(losses_bt * mask_bt), jnp.sum(mask_bt)


def token_losses(logits_bcv: jax.Array, targets_bc: jax.Array) -> jax.Array:
    """`logsumexp(logits) - logits[target]` per position, in float32 (`jax.nn.logsumexp` shifts by the max)."""
    log_z_bc, target_logit_bc, _ = _log_z_and_target_logit(logits_bcv.astype(jnp.float32), targets_bc)
    return log_z_bc - target_logit_bc


def _log_z_and_target_logit(logits_bcv: jax.Array, targets_bc: jax.Array):
    """(log-sum-exp of the float32 logits, the target's logit, the one-hot targets) per position."""
    one_hot_bcv = jnp.arange(logits_bcv.shape[-1], dtype=targets_bc.dtype) == targets_bc[..., None]
    # The target's logit by compare-and-sum rather than a gather: elementwise work plus a sum, which a
    # vocab-split logits array partitions as is (one all-reduce); exact, as every other term is zero.
    target_logit_bc = jnp.sum(jnp.where(one_hot_bcv, logits_bcv, 0.0), axis=-1)
    return log_sum_exp(logits_bcv), target_logit_bc, one_hot_bcv


def log_sum_exp(logits_bcv: jax.Array) -> jax.Array:
    """`jax.nn.logsumexp` over the last axis; on the CPU, a row longer than CPU_EXP_SUM_ROW in parts of at most
    that many logits, whose sums are added after."""
    return jax.lax.platform_dependent(logits_bcv, cpu=_log_sum_exp_in_parts,
                                      default=functools.partial(jax.nn.logsumexp, axis=-1))


def _log_sum_exp_in_parts(logits_bcv: jax.Array) -> jax.Array:
    v = logits_bcv.shape[-1]
    if v <= CPU_EXP_SUM_ROW:
        return jax.nn.logsumexp(logits_bcv, axis=-1)
    # the shift by the maximum, as jax.nn.logsumexp (0 for a row without a finite one): the result does not depend
    # on it
    max_bc = jax.lax.stop_gradient(jnp.max(logits_bcv, axis=-1))
    max_bc = jnp.where(jnp.isfinite(max_bc), max_bc, 0.0)

    def exp_sums(x_bc_v):  # the sums over the last axis of `x`, whose leading axes are `[b, c]`
        shift = max_bc.reshape(*max_bc.shape, *[1] * (x_bc_v.ndim - max_bc.ndim))
        # The barrier keeps XLA from merging these sums and the sum over them into one over the whole row.
        return jax.lax.optimization_barrier(jnp.sum(jnp.exp(x_bc_v - shift), axis=-1))

    lead = logits_bcv.shape[:-1]
    row = _exact_part(v)
    if row is not None:
        sums = exp_sums(logits_bcv.reshape(*lead, v // row, row))
    else:  # parts of CPU_EXP_SUM_ROW and the rest: slower than an exact split, whose parts are reshapes
        whole = v // CPU_EXP_SUM_ROW * CPU_EXP_SUM_ROW
        sums = jnp.concatenate([
            exp_sums(logits_bcv[..., :whole].reshape(*lead, whole // CPU_EXP_SUM_ROW, CPU_EXP_SUM_ROW)),
            exp_sums(logits_bcv[..., whole:])[..., None]], axis=-1)
    return jnp.log(jnp.sum(sums, axis=-1)) + max_bc


def _exact_part(v: int, shortest: int = 256) -> int | None:
    """The longest part of at most CPU_EXP_SUM_ROW that divides `v`, if it has at least `shortest` logits."""
    for parts in range(-(-v // CPU_EXP_SUM_ROW), v // shortest + 1):
        if v % parts == 0:
            return v // parts
    return None


def chunked_token_losses(head_fn: HeadFn, h_btd: jax.Array, targets_bt: jax.Array, *, chunk: int,
                         rules: Rules = DEFAULT_RULES) -> jax.Array:
    """`token_losses(head_fn(h_btd), targets_bt)`, float32 `[b, t]`, `chunk` sequence positions at a time.

    `head_fn` maps hidden states `[b, c, d]` to logits `[b, c, v]`; it may close over anything being
    differentiated (an NNX module merged from a traced state, LoRA matrices): the chunks run in a
    `jax.lax.scan` of a `jax.checkpoint`ed step, so the backward pass recomputes one chunk's logits at a
    time and the closed-over values get their gradients as usual. The batch axis stays whole in every
    chunk, so a batch split over devices stays split. A sequence not divisible by `chunk` is padded with
    zero hidden states (`head_fn` must give finite logits for a zero row, as a linear head does); the padded
    positions' losses are dropped. Under a mesh, `rules` pins each chunk like the model's activations (batch
    on dp/fsdp, vocab on mp). A closed-over bfloat16 weight's gradient is summed over chunks in bfloat16 (one
    rounding per chunk).
    """
    _check_chunk(chunk)
    by_chunk, chunk = _chunking(h_btd.shape[1], chunk, rules)

    # Saves only the step's inputs: the backward pass recomputes the chunk's logits from h and the head.
    # Inside a scan the loop itself keeps XLA from merging the recomputation with the forward pass.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_losses(h_bcd, targets_bc):
        logits_bcv = constrain(head_fn(h_bcd), ("act_batch", "act_seq", "act_vocab"), rules)
        return token_losses(logits_bcv, targets_bc)

    def step(_, xs_chunk):
        return None, chunk_losses(*xs_chunk)

    _, losses_nbc = jax.lax.scan(step, None, (by_chunk(h_btd, ("act_embed",)), by_chunk(targets_bt, ())))
    return _unchunked(losses_nbc, h_btd.shape[1])


def frozen_head_token_losses(h_btd: jax.Array, w_vd: jax.Array, targets_bt: jax.Array, *, chunk: int,
                             rules: Rules = DEFAULT_RULES, device_rows: int = FROZEN_HEAD_DEVICE_ROWS) -> jax.Array:
    """`token_losses(einsum_acc32("btd,vd->btv", h_btd, w_vd), targets_bt)`, float32 `[b, t]`, for a head weight
    that is not trained, at most `chunk` sequence positions at a time, each chunk's logits computed once; fewer
    positions when a device's part of a chunk (its batch rows x the positions) would pass `device_rows`.

    A custom VJP: when differentiated, the forward pass computes chunk by chunk the logits, each position's loss
    and its gradient with respect to that position's hidden state, `(softmax - one-hot) @ w` (the `[b, c, v]`
    factor rounded to w's dtype before the product, as `einsum_acc32`'s own gradient does), and keeps only
    those gradients, `[b, t, d]` like h; the backward pass scales each by its position's cotangent. So no logits
    are kept for the backward pass nor computed again there, where `chunked_token_losses` computes every
    chunk's logits twice and the plain loss keeps all of them. `w_vd` gets no gradient (it passes
    `stop_gradient`). Chunks, padding and `rules` as in `chunked_token_losses`.
    """
    _check_chunk(chunk)
    rows = h_btd.shape[0] // split_ways("act_batch", h_btd.shape[0], rules)
    chunk = min(chunk, max(1, device_rows // rows))
    # The weight whole along d before the scan, where the policy's and the reference's passes share one gather
    w_vd = constrain(jax.lax.stop_gradient(w_vd), ("act_vocab", "act_embed"), rules)
    return _frozen_head_losses(h_btd, w_vd, targets_bt, chunk, tuple(rules))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _frozen_head_losses(h_btd, w_vd, targets_bt, chunk: int, rules: Rules) -> jax.Array:
    return _frozen_head_walk(h_btd, w_vd, targets_bt, chunk, rules, with_gradient=False)[0]


def _frozen_head_fwd(h_btd, w_vd, targets_bt, chunk: int, rules: Rules):
    return _frozen_head_walk(h_btd, w_vd, targets_bt, chunk, rules, with_gradient=True)


def _frozen_head_bwd(chunk: int, rules: Rules, dh_btd, g_bt):
    return dh_btd * g_bt[..., None].astype(dh_btd.dtype), None, None


_frozen_head_losses.defvjp(_frozen_head_fwd, _frozen_head_bwd)


def _frozen_head_walk(h_btd, w_vd, targets_bt, chunk: int, rules: Rules, *, with_gradient: bool):
    """(token losses, d loss_t / d h_t or None) over the chunks of the sequence, in one scan."""
    t = h_btd.shape[1]
    by_chunk, chunk = _chunking(t, chunk, rules)

    def step(_, xs_chunk):
        h_bcd, targets_bc = xs_chunk
        logits_bcv = constrain(einsum_acc32("bcd,vd->bcv", h_bcd, w_vd), ("act_batch", "act_seq", "act_vocab"),
                               rules)
        log_z_bc, target_logit_bc, one_hot_bcv = _log_z_and_target_logit(logits_bcv, targets_bc)
        losses_bc = log_z_bc - target_logit_bc
        if not with_gradient:
            return None, (losses_bc, None)
        dlogits_bcv = jnp.exp(logits_bcv - log_z_bc[..., None]) - one_hot_bcv
        dh_bcd = gradient_einsum("bcv,vd->bcd", dlogits_bcv.astype(w_vd.dtype), w_vd).astype(h_bcd.dtype)
        return None, (losses_bc, constrain(dh_bcd, ("act_batch", "act_seq", "act_embed"), rules))

    _, (losses_nbc, dh_nbcd) = jax.lax.scan(step, None, (by_chunk(h_btd, ("act_embed",)), by_chunk(targets_bt, ())))
    losses_bt = _unchunked(losses_nbc, t)
    if not with_gradient:
        return losses_bt, None
    return losses_bt, constrain(_unchunked(dh_nbcd, t), ("act_batch", "act_seq", "act_embed"), rules)


def _check_chunk(chunk: int) -> None:
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of sequence positions, got {chunk}")


def _chunking(t: int, chunk: int, rules: Rules):
    """(by_chunk, chunk): `by_chunk(x_bt, axes)` lays `[b, t, ...]` out as `[n, b, chunk, ...]`, positions
    t.. padded with zeros, pinned like the model's activations; `chunk` at most t."""
    chunk = min(chunk, t)
    n = -(-t // chunk)
    pad = n * chunk - t

    def by_chunk(x_bt, axes):
        b = x_bt.shape[0]
        x_bt = jnp.pad(x_bt, [(0, 0), (0, pad)] + [(0, 0)] * (x_bt.ndim - 2))
        x_nbc = x_bt.reshape(b, n, chunk, *x_bt.shape[2:]).swapaxes(0, 1)
        return constrain(x_nbc, (None, "act_batch", "act_seq", *axes), rules)

    return by_chunk, chunk


def _unchunked(x_nbc: jax.Array, t: int) -> jax.Array:
    """`[n, b, chunk, ...]` back to `[b, t, ...]`, the padding dropped: `_chunking`'s layout undone."""
    n, b, chunk = x_nbc.shape[:3]
    return x_nbc.swapaxes(0, 1).reshape(b, n * chunk, *x_nbc.shape[3:])[:, :t]
