"""Policy-gradient objectives on sampled completions (GRPO and its loss types, GSPO's sequence-level ratio, RLOO), as
TRL 1.16's `GRPOTrainer` and `RLOOTrainer` compute them: the advantages of a generation batch from its rewards, and
the clipped surrogate loss with (GRPO) the k3 KL to a reference.

A rollout batch holds, besides the SFT arrays (`targets`, `loss_mask` on the completion tokens), per target token:
`sequence` (the completion's slot within its micro-batch, -1 on padding), `advantage` (its completion's advantage),
`old_logps` (the log-probability the policy gave the token when the batch was sampled, or at the iteration before:
`num_iterations`) and, when `beta` > 0 and the reference is precomputed, `ref_logps`. A completion whose tokens are
all masked (`mask_truncated_completions`) still counts as a sequence, as in TRL.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from finetune.config import TrainConfig
from finetune.step.preference import sequence_sums

# GRPOTrainer's loss types, and "rloo": RLOOTrainer's (its ratio a completion's summed log-ratio, its loss the mean
# over completions; its KL to the reference is in the rewards, `leave_one_out_advantages`, not the loss)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "rloo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """TRL's knobs under its names: `loss_type` (how the per-token losses are averaged), `epsilon` and
    `epsilon_high` (the clip range [1 - epsilon, 1 + epsilon_high]; `epsilon_high` None: `epsilon`), `beta` (the
    weight of the k3 KL to the reference; 0: none), `importance_sampling_level` ("sequence": GSPO's ratio, the
    exponentiated mean log-ratio of a completion), `max_completion_length` (dr_grpo's constant normaliser) and
    the sampling `temperature` the log-probabilities are computed at (logits / temperature);
    `use_bias_correction_kl` weighs each token's KL by its ratio to the old policy (TRL's default: the KL is an
    expectation under the current policy, the tokens were drawn from the old one)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int = 256
    temperature: float = 1.0
    use_bias_correction_kl: bool = True

    # whether the old log-probabilities are the sampling policy's from a forward pass at sampling time (else the
    # step's own, detached: a ratio of 1), as TRL keeps them for num_iterations > 1 and for RLOO's KL
    old_from_forward: bool = False

    @classmethod
    def of(cls, config: TrainConfig) -> "PolicyObjective":
        """A run's objective, as its --objective grpo or rloo and TRL's options say."""
        rloo = config.objective == "rloo"
        beta = config.value("beta")
        return cls("rloo" if rloo else config.loss_type, config.epsilon, config.epsilon_high, beta,
                   "token" if rloo else config.importance_sampling_level, config.max_completion_length,
                   config.temperature, old_from_forward=config.num_iterations > 1 or (rloo and beta > 0))

    @property
    def scored_logps(self) -> tuple[str, ...]:
        """The log-probabilities a run computes for each batch of completions when it samples them: the old ones
        (`old_from_forward`) and, with `beta` > 0, the reference's."""
        return (("old_logps",) if self.old_from_forward else ()) + (("ref_logps",) if self.beta else ())

    @property
    def logps_in_batch(self) -> tuple[str, ...]:
        """Those of `scored_logps` the step reads (RLOO's reference goes into its rewards instead)."""
        return tuple(name for name in self.scored_logps if name != "ref_logps" or self.loss_type != "rloo")

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got "
                             f"{self.importance_sampling_level!r}")

    @property
    def clip_range(self) -> tuple[float, float]:
        return 1 - self.epsilon, 1 + (self.epsilon if self.epsilon_high is None else self.epsilon_high)


def group_advantages(rewards_per_function: np.ndarray, weights: np.ndarray, num_generations: int,
                     scale_rewards: str = "group") -> tuple[np.ndarray, np.ndarray]:
    """(advantages `[n]`, whether each completion's group or batch has zero reward spread `[n]`) of `n` completions,
    `num_generations` consecutive ones a prompt, from each reward function's rewards `[n, functions]` (NaN: the
    function does not apply): TRL's "sum_then_normalize": the weighted sum (NaN ignored; a completion no function
    scores is left out of its group's baseline and gets advantage 0), minus its group's mean, divided by the
    group's ("group") or the whole batch's ("batch") standard deviation (n - 1 in the denominator) plus 1e-4, or
    not divided ("none"). In float32, as TRL computes it."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = weighted_rewards(rewards_per_function, weights)
    grouped = rewards.reshape(-1, num_generations)
    with warnings.catch_warnings():  # a group no function scores has a NaN mean and spread
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(grouped, axis=1), num_generations).astype(np.float32)
        if scale_rewards == "batch":
            std = np.full_like(rewards, nanstd(rewards) if rewards.size > 1 else 0.0)
        elif num_generations > 1:
            std = np.repeat(nanstd(grouped, axis=1), num_generations).astype(np.float32)
        else:
            std = np.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + np.float32(1e-4))
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), np.isclose(std, 0.0)


def leave_one_out_advantages(rewards_per_function: np.ndarray, weights: np.ndarray, num_generations: int,
                             kl: np.ndarray | None = None, beta: float = 0.0, normalize: bool = False,
                             clip_range: tuple[float, float] | None = None) -> np.ndarray:
    """RLOO's advantages `[n]` (TRL 1.16's `RLOOTrainer`): each completion's weighted reward (clipped to
    `clip_range`; minus `beta` times its `kl`, the sum over its tokens of old minus reference log-probabilities)
    minus the mean of its group's other scorable completions' rewards; with `normalize`, then standardised over the
    batch; 0 for a completion no function scores or the only scorable one of its group."""
    rewards = weighted_rewards(rewards_per_function, weights)
    if clip_range is not None:
        rewards = np.clip(rewards, *clip_range)
    if beta:
        rewards = rewards - np.float32(beta) * np.asarray(kl, np.float32)
    grouped = rewards.reshape(-1, num_generations)
    with warnings.catch_warnings():  # a group with one scorable completion: 0 / 0
        warnings.simplefilter("ignore", RuntimeWarning)
        if num_generations > 1:
            scorable = np.sum(~np.isnan(grouped), axis=1, keepdims=True)
            baselines = (np.nansum(grouped, axis=1, keepdims=True) - grouped) / (scorable - 1)
            advantages = (grouped - baselines).reshape(-1).astype(np.float32)
        else:
            advantages = np.zeros_like(rewards)
        if normalize:
            advantages = (advantages - np.nanmean(advantages)) / (nanstd(advantages) + np.float32(1e-4))
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32)


def weighted_rewards(rewards_per_function: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """float32 `[n]`: each completion's rewards `[n, functions]` weighted and summed, the functions that do not apply
    to it (NaN) left out; NaN where none applies (TRL's "unscorable")."""
    per_function = np.asarray(rewards_per_function, np.float32)
    rewards = np.nansum(per_function * np.asarray(weights, np.float32)[None, :], axis=1, dtype=np.float32)
    rewards[np.isnan(per_function).all(axis=1)] = np.nan
    return rewards


def nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """TRL's `nanstd`: over the non-NaN values, with Bessel's correction (NaN for fewer than two)."""
    variance = np.nanmean((x - np.nanmean(x, axis=axis, keepdims=True)) ** 2, axis=axis)
    count = np.sum(~np.isnan(x), axis=axis)
    correction = np.where(count > 1, count / np.maximum(count - 1, 1), np.nan)
    return np.sqrt(variance * correction).astype(np.float32)


def token_losses(objective: PolicyObjective, logp_bt: jax.Array, micro: dict[str, jax.Array], slots: int
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(each target token's loss `[rows, seq]` before masking, {metric: per-token values, whose masked sums are
    counts over the trained tokens, or with a sequence-level ratio, the clip ratios' counts over the completions})
    of one micro-batch from
    the policy's log-probabilities `logp_bt` of its targets: `-min(r A, clip(r) A)` plus `beta` times the k3 KL
    `exp(ref - logp) - (ref - logp) - 1`, r the token's ratio to `old_logps` (or, at the sequence level, its
    completion's exponentiated mean log-ratio over its trained tokens); the KL weighed by r with
    `use_bias_correction_kl`."""
    mask_bt = micro["loss_mask"].astype(jnp.float32)
    old_bt = micro.get("old_logps")
    old_bt = jax.lax.stop_gradient(logp_bt) if old_bt is None else old_bt
    log_ratio_bt = logp_bt - old_bt
    rloo = objective.loss_type == "rloo"
    per_sequence = rloo or objective.importance_sampling_level == "sequence"
    if per_sequence:
        sums, counts = sequence_sums(log_ratio_bt, mask_bt, micro["sequence"], slots)
        log_ratio_bt = _at_tokens(sums if rloo else sums / jnp.maximum(counts, 1.0), micro["sequence"])
        token_share_bt = 1.0 / jnp.maximum(_at_tokens(counts, micro["sequence"]), 1.0)
    ratio_bt = jnp.exp(log_ratio_bt)
    low, high = objective.clip_range
    advantage_bt = micro["advantage"]
    losses_bt = -jnp.minimum(ratio_bt * advantage_bt, jnp.clip(ratio_bt, low, high) * advantage_bt)
    metrics = {"clip_ratio/low_mean": ((ratio_bt < low) & (advantage_bt < 0)).astype(jnp.float32),
               "clip_ratio/high_mean": ((ratio_bt > high) & (advantage_bt > 0)).astype(jnp.float32)}
    metrics["clip_ratio/region_mean"] = jnp.maximum(metrics["clip_ratio/low_mean"], metrics["clip_ratio/high_mean"])
    if per_sequence:  # one ratio a completion: its clipping counted once (each token a 1 / length share)
        metrics = {name: v * token_share_bt for name, v in metrics.items()}
    if objective.beta and not rloo:
        delta_bt = micro["ref_logps"] - logp_bt
        kl_bt = jnp.exp(delta_bt) - delta_bt - 1
        if objective.use_bias_correction_kl:
            kl_bt = kl_bt * ratio_bt
        losses_bt = losses_bt + objective.beta * kl_bt
        metrics["kl"] = kl_bt
    return losses_bt, metrics


def micro_batch_loss(objective: PolicyObjective, losses_bt: jax.Array, micro: dict[str, jax.Array], slots: int,
                     sequences: int, tokens: jax.Array, grad_accum: int) -> jax.Array:
    """This micro-batch's share of the step's loss, so that the shares of the `grad_accum` micro-batches sum to
    TRL's loss over the generation batch of `sequences` completions and `tokens` trained tokens: grpo, each
    completion's mean over its tokens, averaged over the completions; bnpo, the micro-batch's token mean, averaged
    over the micro-batches; dr_grpo, the sum over `sequences * max_completion_length`; dapo, the token mean over the
    whole batch."""
    mask_bt = micro["loss_mask"].astype(jnp.float32)
    masked = losses_bt * mask_bt
    if objective.loss_type in ("grpo", "rloo"):  # rloo's per-token losses are its completion's loss at each token
        sums, counts = sequence_sums(losses_bt, mask_bt, micro["sequence"], slots)
        return jnp.sum(sums / jnp.maximum(counts, 1.0)) / sequences
    if objective.loss_type == "bnpo":
        return jnp.sum(masked) / jnp.maximum(jnp.sum(mask_bt), 1.0) / grad_accum
    if objective.loss_type == "dr_grpo":
        return jnp.sum(masked) / (sequences * objective.max_completion_length)
    return jnp.sum(masked) / jnp.maximum(tokens, 1.0)


def _at_tokens(per_slot: jax.Array, slots_bt: jax.Array) -> jax.Array:
    """A per-slot value `[slots]` at each of its tokens `[rows, seq]` (0 on padding)."""
    return jnp.where(slots_bt < 0, 0.0, per_slot[jnp.maximum(slots_bt, 0)])
