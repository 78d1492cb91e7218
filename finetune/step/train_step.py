"""The jit-compiled train and eval steps: masked next-token loss (or a preference objective,
`finetune.step.preference`, or a policy-gradient one on sampled completions, `finetune.step.policy`), gradients
for LoRA parameters only, gradient accumulation over micro-batches, and the optax update."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from finetune.config import TrainConfig
from finetune.step.lm_head import batch_token_losses
from finetune.step.policy import PolicyObjective, micro_batch_loss
from finetune.step.policy import token_losses as policy_token_losses
from finetune.step.preference import Objective, pair_losses, sequence_sums, token_logps
from jaxmodel import scopes
from jaxmodel.layers import LoRAParam
from jaxmodel.moe import load_balancing_loss
from jaxmodel.sharding import Rules, batch_sharding

BATCH_KEYS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")
PAIR_BATCH_KEYS = BATCH_KEYS + ("sequence",)
ROLLOUT_BATCH_KEYS = BATCH_KEYS + ("sequence", "advantage")
REFERENCE_FIELD = "reference_logp"  # as finetune.data.pairs lays it out (data/ imports no step/)
# The float32 arrays of a batch (the others are int32)
FLOAT_BATCH_KEYS = ("loss_mask", REFERENCE_FIELD, "advantage", "old_logps", "ref_logps")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def batch_keys(config: TrainConfig) -> tuple[str, ...]:
    """The arrays of a step's batch: a pair batch's carry each token's sequence slot, and with
    --precompute-reference the reference's values (`finetune.data.pairs.REFERENCE_FIELD`, float32)."""
    if config.policy:
        return ROLLOUT_BATCH_KEYS + PolicyObjective.of(config).logps_in_batch
    if not config.preference:
        return BATCH_KEYS
    return PAIR_BATCH_KEYS + ((REFERENCE_FIELD,) if config.precompute_reference else ())


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    lora: nnx.State  # the trainable LoRAParam variables
    opt_state: Any
    rng: jax.Array  # dropout key stream


def make_optimizer(config: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Clip by global norm, then AdamW on a warm-up + cosine/linear/constant schedule."""
    lr = config.value("lr")
    decay_steps = max(config.steps - config.warmup_steps, 1)
    end = lr * config.min_lr_ratio
    decay = {
        "cosine": optax.cosine_decay_schedule(lr, decay_steps, alpha=config.min_lr_ratio),
        "linear": optax.linear_schedule(lr, end, decay_steps),
        "constant": optax.constant_schedule(lr),
    }[config.schedule]
    if config.warmup_steps:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, config.warmup_steps), decay],
                                        [config.warmup_steps])
    else:
        schedule = decay
    adamw = optax.adamw(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps,
                        weight_decay=config.weight_decay)
    chain = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm > 0 else []
    return optax.chain(*chain, adamw), schedule


def loss_sums(model, batch: dict[str, jax.Array], dropout_key=None, chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """(sum of masked next-token cross-entropy, number of target tokens) over a batch; with `chunk`, the LM head in
    chunks of at most that many positions (`finetune.step.lm_head.batch_token_losses`)."""
    losses_bt, mask_bt = batch_token_losses(model, batch, ("loss_mask",), dropout_key=dropout_key, chunk=chunk)
    return jnp.sum(losses_bt * mask_bt), jnp.sum(mask_bt)


def loss_and_grads(graphdef, lora: nnx.State, base: nnx.State, batch: dict[str, jax.Array], grad_accum: int = 1,
                   dropout_key=None, loss_chunk: int = 0):
    """(mean loss, target tokens, d mean loss / d LoRA) over a global batch, one micro-batch at a time.

    Sums of per-token losses and gradients are divided once by the batch's target-token count, so the
    result does not depend on how the batch is split over micro-batches or devices. A model training its routers
    (`CausalLM.trains_router`) adds `router_aux_loss_coef` times the load-balancing loss (`sft_terms`).
    """
    return sft_terms(graphdef, lora, base, batch, grad_accum, dropout_key, loss_chunk)[:3]


def sft_terms(graphdef, lora: nnx.State, base: nnx.State, batch: dict[str, jax.Array], grad_accum: int = 1,
              dropout_key=None, loss_chunk: int = 0):
    """`loss_and_grads` and the mean load-balancing loss of its micro-batches (None unless the routers train).

    transformers adds `router_aux_loss_coef` times the load-balancing loss of each forward pass (its
    `output_router_logits` run): here each micro-batch's, over its real tokens, averaged over the micro-batches. Its
    own gradient is scaled to the batch's target tokens before the sums are divided by them, so that the mean loss
    is the cross-entropy's mean plus the coefficient times that average, whatever the devices."""
    denom = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    model = nnx.merge(graphdef, base, lora)
    router, coef = model.trains_router, model.config.router_aux_loss_coef

    def micro_loss(lora, micro, key):  # (loss sum, (target tokens, load-balancing loss))
        model = nnx.merge(graphdef, base, lora)
        if not router:
            loss_sum, tokens = loss_sums(model, micro, key, loss_chunk)
            return loss_sum, (tokens, jnp.float32(0))
        losses_bt, mask_bt, stats = batch_token_losses(model, micro, ("loss_mask",), dropout_key=key,
                                                       chunk=loss_chunk, router_stats=True)
        balance = load_balancing_loss(stats)
        return jnp.sum(losses_bt * mask_bt) + coef * balance * denom / grad_accum, (jnp.sum(mask_bt), balance)

    loss_sum, (tokens, balance), grads = summed_over_micro_batches(micro_loss, lora, batch, grad_accum, dropout_key,
                                                                   (jnp.float32(0), jnp.float32(0)))
    return loss_sum / denom, tokens, jax.tree.map(lambda g: g / denom, grads), balance / grad_accum if router else None


def summed_over_micro_batches(loss_fn, lora: nnx.State, batch: dict[str, jax.Array], grad_accum: int, dropout_key,
                              aux_zeros):
    """(loss sum, aux sums, d loss sum / d LoRA) of `loss_fn(lora, micro_batch, key) -> (loss sum, aux)` summed
    over the `grad_accum` micro-batches of `batch` in one scan: the gradient accumulation of every objective.
    `aux_zeros`: zeros shaped like `aux` (a pytree of counts and metric sums)."""
    grad_of = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(carry, xs):
        grads, loss_sum, aux = carry
        mb, key = xs
        (l, a), g = grad_of(lora, mb, key)
        return (jax.tree.map(jnp.add, grads, g), loss_sum + l, jax.tree.map(jnp.add, aux, a)), None

    zeros = jax.tree.map(jnp.zeros_like, lora)
    keys = None if dropout_key is None else jax.random.split(dropout_key, grad_accum)
    (grads, loss_sum, aux), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0), aux_zeros),
                                             (micro_batches(batch, grad_accum), keys))
    return loss_sum, aux, grads


def policy_loss_and_grads(graphdef, lora: nnx.State, base: nnx.State, batch: dict[str, jax.Array],
                          objective: PolicyObjective, slots: int, sequences: int, grad_accum: int = 1,
                          dropout_key=None, loss_chunk: int = 0):
    """(loss, trained tokens, d loss / d LoRA, {metric: mean over the trained tokens, or the completions}) of a
    rollout batch (`finetune.step.policy`) of `sequences` completions, at most `slots` a micro-batch, in `grad_accum`
    micro-batches: the sum of each micro-batch's share (`policy.micro_batch_loss`), which does not depend on the split
    for grpo, dr_grpo and dapo (bnpo averages each micro-batch's token mean, as TRL's accumulation does)."""
    tokens = jnp.sum(batch["loss_mask"])
    names = ("loss_mask", "sequence", "advantage") + tuple(k for k in ("old_logps", "ref_logps") if k in batch)
    metric_names = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean") + (
        ("kl",) if objective.beta and objective.loss_type != "rloo" else ())

    def micro_loss(lora, micro, key):  # (loss share, metric sums over the trained tokens)
        model = nnx.merge(graphdef, base, lora)
        losses_bt, *arrays = batch_token_losses(model, micro, names, dropout_key=key, chunk=loss_chunk,
                                                temperature=objective.temperature)
        ordered = dict(zip(names, arrays))
        per_token, metrics = policy_token_losses(objective, -losses_bt, ordered, slots)
        mask_bt = ordered["loss_mask"].astype(jnp.float32)
        share = micro_batch_loss(objective, per_token, ordered, slots, sequences, tokens, grad_accum)
        return share, {name: jnp.sum(metrics[name] * mask_bt) for name in metric_names}

    loss, sums, grads = summed_over_micro_batches(micro_loss, lora, batch, grad_accum, dropout_key,
                                                  {name: jnp.float32(0) for name in metric_names})
    per_sequence = objective.importance_sampling_level == "sequence" or objective.loss_type == "rloo"
    return loss, tokens, grads, {name: v / (sequences if per_sequence and name.startswith("clip_ratio/")
                                            else jnp.maximum(tokens, 1.0)) for name, v in sums.items()}


def policy_logps(graphdef, lora: nnx.State, base: nnx.State, reference: nnx.State | None, batch: dict[str, jax.Array],
                 names: tuple[str, ...], temperature: float, grad_accum: int = 1, loss_chunk: int = 0
                 ) -> dict[str, jax.Array]:
    """The log-probabilities of a rollout batch's completions that its policy step reads beside its own, float32
    `[B, T]` at each trained target (0 elsewhere), one micro-batch at a time, under `stop_gradient`: `old_logps`,
    the policy's (`lora`) when the completions were drawn, and `ref_logps`, the reference's (`reference`, the frozen
    initial adapter, or None for the base model: a LoRA state of zeros), for those of `names`. TRL computes both
    so, in one forward pass each when it samples: the training forward's numerics, at the sampling `temperature`."""
    adapters = {"old_logps": lora, "ref_logps": jax.tree.map(jnp.zeros_like, lora) if reference is None else reference}

    def one(micro):
        out = {}
        for name in names:
            model = nnx.merge(graphdef, base, jax.lax.stop_gradient(adapters[name]))
            losses_bt, mask_bt = batch_token_losses(model, micro, ("loss_mask",), chunk=loss_chunk,
                                                    temperature=temperature)
            out[name] = jnp.where(mask_bt > 0, -jax.lax.stop_gradient(losses_bt), 0.0)
        return out

    per_micro = jax.lax.map(one, micro_batches(batch, grad_accum))
    return {k: v.swapaxes(0, 1).reshape(-1, *v.shape[2:]) for k, v in per_micro.items()}  # micro_batches undone


def micro_batches(batch: dict[str, jax.Array], grad_accum: int) -> dict[str, jax.Array]:
    """[B, T] -> [accum, B / accum, T]; micro-batch k takes rows k, k + accum, ...: every device's block of rows
    feeds every micro-batch."""
    return {k: v.reshape(v.shape[0] // grad_accum, grad_accum, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}


def preference_sums(graphdef, lora: nnx.State, base: nnx.State, reference: nnx.State | None, micro,
                    objective: Objective, slots: int, dropout_key=None, loss_chunk: int = 0):
    """(sum of the pair losses, (pairs, {metric: sum})) of one micro-batch of pair rows with `slots` sequence
    slots. The reference (DPO/IPO) comes precomputed in the batch (`objective.precomputed`), or runs on the same
    base under `stop_gradient` (`reference_sums`)."""
    logp_bt, mask_bt, slots_bt = token_logps(nnx.merge(graphdef, base, lora), micro, dropout_key, loss_chunk)
    logp, count = sequence_sums(logp_bt, mask_bt, slots_bt, slots)
    ref_logp = None
    if objective.reference is not None and objective.precomputed:
        # each sequence's value sits on its first trained position: its masked sum is that value, exactly
        ref_logp, _ = sequence_sums(micro[REFERENCE_FIELD], micro["loss_mask"], micro["sequence"], slots)
    elif objective.reference is not None:
        ref_logp = reference_sums(graphdef, lora, base, reference, micro, slots, loss_chunk)
    loss_sum, pairs, metrics = pair_losses(objective, logp, count, ref_logp)
    return loss_sum, (pairs, {"tokens": jnp.sum(count), **metrics})


def reference_sums(graphdef, lora: nnx.State, base: nnx.State, reference: nnx.State | None, micro, slots: int,
                   loss_chunk: int = 0) -> jax.Array:
    """float32 [slots]: the reference's log-probability of each sequence slot of a micro-batch, under
    `stop_gradient`. `reference` is the frozen initial adapter, or None for the base model itself (a LoRA state
    of zeros, shaped like `lora`, adds exactly nothing)."""
    off = jax.tree.map(jnp.zeros_like, lora) if reference is None else reference
    ref_bt, mask_bt, slots_bt = token_logps(nnx.merge(graphdef, base, jax.lax.stop_gradient(off)), micro, None,
                                            loss_chunk)
    return sequence_sums(jax.lax.stop_gradient(ref_bt), mask_bt, slots_bt, slots)[0]


def reference_batch_sums(graphdef, lora, base, reference, batch, pairs: int, grad_accum: int,
                         loss_chunk: int = 0) -> jax.Array:
    """float32 [grad_accum, slots]: `reference_sums` of each micro-batch of a batch of `pairs` pair slots (the
    pass of --precompute-reference)."""
    slots = 2 * pairs // grad_accum
    return jax.lax.map(lambda mb: reference_sums(graphdef, lora, base, reference, mb, slots, loss_chunk),
                       micro_batches(batch, grad_accum))


def preference_loss_and_grads(graphdef, lora: nnx.State, base: nnx.State, reference: nnx.State | None, batch,
                              objective: Objective, pairs: int, grad_accum: int = 1, dropout_key=None,
                              loss_chunk: int = 0):
    """(mean pair loss, {metric: mean over the pairs}, d mean loss / d LoRA) over a global batch of `pairs` pair
    slots, one micro-batch at a time; sums divided once by the number of real pairs in the whole batch, so the
    result does not depend on how the pairs are split over micro-batches, devices or processes."""
    slots = 2 * pairs // grad_accum

    def micro_loss(lora, micro, key):  # (pair loss sum, (pairs, metric sums))
        return preference_sums(graphdef, lora, base, reference, micro, objective, slots, key, loss_chunk)

    metric_zeros = {k: jnp.float32(0) for k in ("tokens", *objective.metric_names())}
    loss_sum, (n, sums), grads = summed_over_micro_batches(micro_loss, lora, batch, grad_accum, dropout_key,
                                                           (jnp.float32(0), metric_zeros))
    denom = jnp.maximum(n, 1.0)
    metrics = {k: (v if k == "tokens" else v / denom) for k, v in sums.items()}
    return loss_sum / denom, {"pairs": n, **metrics}, jax.tree.map(lambda g: g / denom, grads)


def preference_eval_sums(graphdef, lora, base, reference, batch, objective: Objective, pairs: int, grad_accum: int,
                         loss_chunk: int = 0) -> dict[str, jax.Array]:
    """{"loss": sum of the pair losses, "pairs": real pairs, metric: sum} over one eval batch."""
    slots = 2 * pairs // grad_accum

    def one(carry, mb):
        l, (p, m) = preference_sums(graphdef, lora, base, reference, mb, objective, slots, None, loss_chunk)
        return jax.tree.map(jnp.add, carry, {"loss": l, "pairs": p, **m}), None

    zeros = {k: jnp.float32(0) for k in ("loss", "pairs", "tokens", *objective.metric_names())}
    return jax.lax.scan(one, zeros, micro_batches(batch, grad_accum))[0]


def build_steps(graphdef, schedule, tx: optax.GradientTransformation, grad_accum: int, dropout: bool = False,
                loss_chunk: int = 0):
    """Pure train/eval step functions over (state, frozen base, batch); the caller jits them.

    With `dropout`, each step draws its LoRA dropout masks from the state's key stream; `loss_chunk` as
    in `loss_sums`.
    """

    def train_step(state: TrainState, base, batch):
        rng, step_key = jax.random.split(state.rng)
        loss, tokens, grads, balance = sft_terms(graphdef, state.lora, base, batch, grad_accum,
                                                 step_key if dropout else None, loss_chunk)
        lora, opt_state = optimizer_update(tx, grads, state)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step), "tokens": tokens}
        if balance is not None:  # the routers train: their load-balancing loss, unweighted
            metrics["router_balance_loss"] = balance
        return TrainState(state.step + 1, lora, opt_state, rng), metrics

    def eval_step(lora, base, batch):
        return loss_sums(nnx.merge(graphdef, base, lora), batch, chunk=loss_chunk)

    return train_step, eval_step


def optimizer_update(tx: optax.GradientTransformation, grads, state: TrainState) -> tuple[nnx.State, Any]:
    """(the adapters after one optimizer step on `grads`, the optimizer's new state)."""
    with jax.named_scope(scopes.OPTIMIZER):
        updates, opt_state = tx.update(grads, state.opt_state, state.lora)
        return optax.apply_updates(state.lora, updates), opt_state


def build_preference_steps(graphdef, schedule, tx: optax.GradientTransformation, objective: Objective, pairs: int,
                           grad_accum: int, dropout: bool = False, loss_chunk: int = 0):
    """`build_steps` for a preference objective: the steps take (state, frozen, batch) with frozen =
    (base, reference adapter or None) and a batch of pair rows holding `pairs` pair slots."""

    def train_step(state: TrainState, frozen, batch):
        base, reference = frozen
        rng, step_key = jax.random.split(state.rng)
        loss, metrics, grads = preference_loss_and_grads(graphdef, state.lora, base, reference, batch, objective,
                                                         pairs, grad_accum, step_key if dropout else None, loss_chunk)
        lora, opt_state = optimizer_update(tx, grads, state)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step), **metrics}
        return TrainState(state.step + 1, lora, opt_state, rng), metrics

    def eval_step(lora, frozen, batch):
        base, reference = frozen
        return preference_eval_sums(graphdef, lora, base, reference, batch, objective, pairs, grad_accum, loss_chunk)

    return train_step, eval_step


def build_policy_steps(graphdef, schedule, tx: optax.GradientTransformation, objective: PolicyObjective,
                       sequences: int, grad_accum: int, dropout: bool = False, loss_chunk: int = 0):
    """`build_steps` for an online RL objective: the train step takes (state, base, rollout batch of `sequences`
    completions, `finetune.rollout.batch.rollout_rows`); no eval step (a policy is evaluated by sampling)."""

    def train_step(state: TrainState, base, batch):
        rng, step_key = jax.random.split(state.rng)
        loss, tokens, grads, metrics = policy_loss_and_grads(graphdef, state.lora, base, batch, objective,
                                                             sequences // grad_accum, sequences, grad_accum,
                                                             step_key if dropout else None, loss_chunk)
        lora, opt_state = optimizer_update(tx, grads, state)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step), "tokens": tokens,
                   **metrics}
        return TrainState(state.step + 1, lora, opt_state, rng), metrics

    return train_step, None


def jit_policy_logps(graphdef, config: TrainConfig, state: TrainState, base, reference, mesh: Mesh, rules: Rules):
    """`policy_logps` jitted for a run (the log-probabilities it computes for its completions as it samples them:
    `PolicyObjective.scored_logps`), or None when it needs none: (lora, base, reference, batch) -> {name: [B, T]}."""
    objective = PolicyObjective.of(config)
    names = objective.scored_logps
    if not names:
        return None
    batch = batch_sharding(mesh, rules)
    shardings = jax.tree.map(lambda x: x.sharding, (state.lora, base, reference))
    return jax.jit(lambda lora, base, reference, rows: policy_logps(graphdef, lora, base, reference, rows, names,
                                                                   objective.temperature, config.grad_accum,
                                                                   config.loss_chunk),
                   in_shardings=(*shardings, batch), out_shardings=batch)


def jit_steps(graphdef, config: TrainConfig, tx: optax.GradientTransformation, schedule, state: TrainState, base,
              mesh: Mesh, rules: Rules):
    """The jitted train and eval steps of a run, for `state` and `base` as they lie on `mesh` (arrays, or
    ShapeDtypeStructs with shardings when planning): the one definition used by training and `--plan`.

    The train step donates the state; the batch is split as `jaxmodel.sharding.batch_sharding` says. With a
    preference objective `base` is (base, reference adapter or None) and the batch holds pair rows.
    """
    if config.policy:
        train_fn, eval_fn = build_policy_steps(graphdef, schedule, tx, PolicyObjective.of(config),
                                               config.rows_per_step, config.grad_accum,
                                               dropout=config.lora_dropout > 0, loss_chunk=config.loss_chunk)
    elif config.preference:
        train_fn, eval_fn = build_preference_steps(graphdef, schedule, tx, Objective.of(config), config.batch_size,
                                                   config.grad_accum, dropout=config.lora_dropout > 0,
                                                   loss_chunk=config.loss_chunk)
    else:
        train_fn, eval_fn = build_steps(graphdef, schedule, tx, config.grad_accum, dropout=config.lora_dropout > 0,
                                        loss_chunk=config.loss_chunk)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = batch_sharding(mesh, rules)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    base_shardings = jax.tree.map(lambda x: x.sharding, base)
    train_step = jax.jit(train_fn, in_shardings=(state_shardings, base_shardings, batch),
                         out_shardings=(state_shardings, replicated), donate_argnums=0)
    eval_step = None if eval_fn is None else jax.jit(eval_fn, in_shardings=(state_shardings.lora, base_shardings,
                                                                            batch), out_shardings=replicated)
    return train_step, eval_step


def optimizer_shardings(tx: optax.GradientTransformation, lora, replicated):
    """Shardings of `tx`'s state for `lora` (arrays or ShapeDtypeStructs with shardings): every moment
    takes its parameter's sharding, counters and scalars are replicated."""
    return optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, lora),
                                 jax.tree.map(lambda x: x.sharding, lora), transform_non_params=lambda _: replicated)


def split_model(model) -> tuple[Any, nnx.State, nnx.State]:
    """(graphdef, LoRA state, frozen rest): what is trainable is exactly the LoRAParam variables."""
    return nnx.split(model, LoRAParam, ...)
