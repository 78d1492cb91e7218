"""Masked next-token cross-entropy: the plain sums over full logits, and a chunked LM head + loss that
never holds the `[batch, seq, vocab]` float32 logits (67 GB at 128k tokens and vocab 128256) at once."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxmodel.sharding import DEFAULT_RULES, Rules, constrain

HeadFn = Callable[[jax.Array], jax.Array]  # hidden states [b, c, d] -> float32 logits [b, c, v]


def cross_entropy_sums(logits_btv: jax.Array, targets_bt: jax.Array,
                       mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of masked token cross-entropies, number of target tokens) from full logits: the reference."""
    losses_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv.astype(jnp.float32), targets_bt)
    return jnp.sum(losses_bt * mask_bt), jnp.sum(mask_bt)


def token_losses(logits_bcv: jax.Array, targets_bc: jax.Array) -> jax.Array:
    """`logsumexp(logits) - logits[target]` per position, in float32 (`jax.nn.logsumexp` shifts by the max)."""
    logits_bcv = logits_bcv.astype(jnp.float32)
    vocab_v = jnp.arange(logits_bcv.shape[-1], dtype=targets_bc.dtype)
    # The target's logit by compare-and-sum rather than a gather: elementwise work plus a sum, which a
    # vocab-split logits array partitions as is (one all-reduce); exact, as every other term is zero.
    target_logit_bc = jnp.sum(jnp.where(vocab_v == targets_bc[..., None], logits_bcv, 0.0), axis=-1)
    return jax.nn.logsumexp(logits_bcv, axis=-1) - target_logit_bc


def chunked_cross_entropy_sums(head_fn: HeadFn, h_btd: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array, *,
                               chunk: int, rules: Rules = DEFAULT_RULES) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy_sums(head_fn(h_btd), targets_bt, mask_bt)`, `chunk` sequence positions at a time.

    `head_fn` maps hidden states `[b, c, d]` to logits `[b, c, v]`; it may close over anything being
    differentiated (an NNX module merged from a traced state, LoRA matrices): the chunks run in a
    `jax.lax.scan` of a `jax.checkpoint`ed step, so the backward pass recomputes one chunk's logits at a
    time and the closed-over values get their gradients as usual. The batch axis stays whole in every
    chunk, so a batch split over devices stays split. A sequence not divisible by `chunk` is padded with
    zero hidden states and mask 0 (`head_fn` must give finite logits for a zero row, as a linear head does).
    Under a mesh, `rules` pins each chunk like the model's activations (batch on dp/fsdp, vocab on mp).
    A closed-over bfloat16 weight's gradient is summed over chunks in bfloat16 (one rounding per chunk).
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of sequence positions, got {chunk}")
    b, t = h_btd.shape[:2]
    chunk = min(chunk, t)
    n = -(-t // chunk)
    pad = n * chunk - t

    def by_chunk(x_bt, axes):  # [b, t, ...] -> [n, b, chunk, ...], positions t.. padded with zeros
        x_bt = jnp.pad(x_bt, [(0, 0), (0, pad)] + [(0, 0)] * (x_bt.ndim - 2))
        x_nbc = x_bt.reshape(b, n, chunk, *x_bt.shape[2:]).swapaxes(0, 1)
        return constrain(x_nbc, (None, "act_batch", "act_seq", *axes), rules)

    xs = (by_chunk(h_btd, ("act_embed",)), by_chunk(targets_bt, ()), by_chunk(mask_bt, ()))

    # Saves only the step's inputs: the backward pass recomputes the chunk's logits from h and the head.
    # Inside a scan the loop itself keeps XLA from merging the recomputation with the forward pass.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk_loss_sum(h_bcd, targets_bc, mask_bc):
        logits_bcv = constrain(head_fn(h_bcd), ("act_batch", "act_seq", "act_vocab"), rules)
        return jnp.sum(token_losses(logits_bcv, targets_bc) * mask_bc)

    def step(loss_sum, xs_chunk):
        return loss_sum + chunk_loss_sum(*xs_chunk), None

    loss_sum, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), xs)
    return loss_sum, jnp.sum(mask_bt)
