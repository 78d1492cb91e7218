"""Preference objectives on chosen/rejected pairs (DPO, IPO, SimPO, ORPO): per-sequence log-probabilities from a
batch of pair rows, each objective's loss per pair, and the metrics people know from TRL.

A pair batch (`finetune.data.pairs.PairRows`) holds, besides the SFT arrays, `sequence` [rows, seq]: each token's
slot within its micro-batch, `2 i` for the chosen and `2 i + 1` for the rejected completion of pair i, -1 on
padding. A sequence's log-probability `logp` is the sum over its trained positions (the loss mask, never a
token id) of log p(target); `a` is its mean over those positions. Sums are float32 segment sums, so a pair's
two sequences may lie in different rows (packing) or on different devices of the batch shard that holds them.

The reference of DPO/IPO is either the base model (the same frozen weights with every LoRA branch contributing
exactly zero: the LoRA state replaced by zeros) or the initial adapter (a frozen copy of it). Either runs in the
same jitted step, under `stop_gradient`: no gradient flows through it, so none of its activations is kept for
the backward pass, and no base weight is ever copied. With --precompute-reference it runs once, before training,
and each batch carries its values instead.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from finetune.config import TrainConfig
from finetune.step.lm_head import batch_token_losses

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    beta: float
    label_smoothing: float
    simpo_gamma: float
    orpo_lambda: float
    reference: str | None  # "base", "init", or None (simpo, orpo)
    precomputed: bool = False  # the reference's values come in the batch (--precompute-reference)

    @classmethod
    def of(cls, config: TrainConfig) -> "Objective":
        return cls(config.objective, config.value("beta"), config.label_smoothing, config.simpo_gamma,
                   config.orpo_lambda, config.reference_model(), config.precompute_reference)

    def metric_names(self) -> tuple[str, ...]:
        """The per-step metrics this objective reports besides `loss` (means over the batch's pairs)."""
        if self.reference is not None:
            return ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                    "logps/rejected")
        names = ("logps/chosen", "logps/rejected", "rewards/accuracies")
        return names + (("nll_loss", "log_odds_ratio", "log_odds_chosen") if self.name == "orpo" else ())


def token_logps(model, batch: dict[str, jax.Array], dropout_key=None, chunk: int = 0
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p(target) [rows, seq] float32, loss mask, sequence slots) with the positions in the model's order; with
    `chunk`, the LM head in chunks of at most that many positions (`finetune.step.lm_head.batch_token_losses`)."""
    losses_bt, mask_bt, slots_bt = batch_token_losses(model, batch, ("loss_mask", "sequence"), dropout_key=dropout_key,
                                                      chunk=chunk)
    return -losses_bt, mask_bt, slots_bt


def sequence_sums(logp_bt: jax.Array, mask_bt: jax.Array, slots_bt: jax.Array,
                  n_slots: int) -> tuple[jax.Array, jax.Array]:
    """(sum of masked log p, number of trained positions) per slot, float32 [n_slots] each."""
    slots = jnp.where(slots_bt < 0, n_slots, slots_bt).reshape(-1)  # padding goes to a bucket that is dropped
    mask = mask_bt.astype(jnp.float32).reshape(-1)
    sums = jax.ops.segment_sum(jnp.where(mask > 0, logp_bt.reshape(-1), 0.0), slots, n_slots + 1)
    counts = jax.ops.segment_sum(mask, slots, n_slots + 1)
    return sums[:n_slots], counts[:n_slots]


def _log1mexp(a: jax.Array) -> jax.Array:
    """log(1 - e^a) for a <= 0 without cancellation or log(0), and with finite gradients on both branches (each
    branch sees only inputs it handles; an input of 0 is taken as the largest float32 below it)."""
    a = jnp.minimum(a, -jnp.finfo(jnp.float32).tiny)
    near = a > -LN2
    return jnp.where(near, jnp.log(-jnp.expm1(jnp.where(near, a, -1.0))),
                     jnp.log1p(-jnp.exp(jnp.where(near, -1.0, a))))


def pair_losses(objective: Objective, logp: jax.Array, count: jax.Array, ref_logp: jax.Array | None
                ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(sum of the losses of the real pairs, number of real pairs, {metric: sum over the real pairs}) for the
    slot sums `logp`/`count` [2 P] of one micro-batch (chosen at even slots, rejected at odd ones) and the
    reference's `ref_logp`. A pair slot holding no trained position on either side is padding, never a pair."""
    b = objective.beta
    lc, lr, nc, nr = logp[0::2], logp[1::2], count[0::2], count[1::2]
    real = (nc > 0) & (nr > 0)
    ac, ar = lc / jnp.maximum(nc, 1.0), lr / jnp.maximum(nr, 1.0)
    log_sigmoid = jax.nn.log_sigmoid
    metrics = {}
    if objective.name in ("dpo", "ipo"):
        rc, rr = ref_logp[0::2], ref_logp[1::2]
        if objective.name == "dpo":
            d = (lc - rc) - (lr - rr)
            e = objective.label_smoothing
            losses = -(1 - e) * log_sigmoid(b * d) - e * log_sigmoid(-b * d)
        else:
            h = (ac - rc / jnp.maximum(nc, 1.0)) - (ar - rr / jnp.maximum(nr, 1.0)) - 1 / (2 * b)
            losses = h * h
        chosen, rejected = b * (lc - rc), b * (lr - rr)
        metrics = {"rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                   "rewards/accuracies": (chosen > rejected).astype(jnp.float32), "logps/chosen": lc,
                   "logps/rejected": lr}
    elif objective.name == "simpo":
        losses = -log_sigmoid(b * (ac - ar) - objective.simpo_gamma)
        metrics = {"logps/chosen": ac, "logps/rejected": ar, "rewards/accuracies": (ac > ar).astype(jnp.float32)}
    elif objective.name == "orpo":
        log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
        ratio = log_sigmoid(log_odds)
        losses = -ac - objective.orpo_lambda * ratio
        metrics = {"logps/chosen": ac, "logps/rejected": ar, "rewards/accuracies": (ac > ar).astype(jnp.float32),
                   "nll_loss": -ac, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    else:
        raise ValueError(f"not a preference objective: {objective.name}")
    total = lambda x: jnp.sum(jnp.where(real, x, 0.0))  # noqa: E731
    return total(losses), jnp.sum(real.astype(jnp.float32)), {k: total(v) for k, v in metrics.items()}
