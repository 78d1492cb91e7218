"""The batches of an online RL run (--objective grpo, rloo): completions sampled from the policy on the run's mesh,
scored by the reward functions, laid out as rollout rows with their advantages and the log-probabilities the step
reads; and the evaluation of a policy by the rewards of its completions of the held-out prompts.

Generation batch `k` serves steps `k*I + 1 .. k*I + I` (`I` = --num-iterations): its --batch-size prompts (the
seeded epochs, `finetune.data.prompts`) each get --num-generations completions, drawn with the policy as it is at
the first of those steps, from the key `fold_in(sampler key, k)`: a pure function of the seed, the generation and
the policy, so a resumed run draws what the uninterrupted one drew. The sampler reads the run's LoRA parameters
where they lie (`jaxmodel.generation.sample_arrays`); nothing is copied or merged.

Each process scores the completions of the rows its own devices hold (it calls the reward functions on them, TRL's
way: each process its own completions), and the rewards of every row are then gathered, so that every process
computes the same advantages.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from finetune.config import TrainConfig
from finetune.data.layouts import NOT_PASSED_TO_REWARDS
from finetune.rollout.batch import completion_width, left_padded, prompt_bucket, rollout_rows
from finetune.rollout.rewards import Reward, RewardError, TrainerState, score
from finetune.step.policy import (PolicyObjective, group_advantages, leave_one_out_advantages, nanstd,
                                  weighted_rewards)
from finetune.train.batches import local_row_range
from jaxmodel.generation import Sampling, sample_arrays

# Folded into the run's seed for the sampler's keys, so that they are not the dropout stream's (`TrainState.rng`).
SAMPLER_STREAM = 0x5A3
# Folded in for evaluation's draws: the same key at every evaluation, so that evaluations differ by the policy alone.
EVAL_STREAM = 0xE7A1
# Sampled completions written to metrics.jsonl and TensorBoard with each logged step.
LOGGED_COMPLETIONS = 4


@dataclasses.dataclass
class Generation:
    """One generation batch: the step's batch (global arrays on the mesh) and what the run logs of it."""

    k: int
    batch: dict[str, jax.Array]
    metrics: dict[str, Any]


class Rollouts:
    """Each step's batch for an online RL run (see the module docstring)."""

    def __init__(self, config: TrainConfig, run, rewards: list[Reward]):
        self.config, self.run, self.rewards = config, run, rewards
        self.objective = PolicyObjective.of(config)
        self.weights = np.asarray(config.reward_weight_values(), np.float32)
        self.generations = config.value("num_generations")
        self.sampling = run_sampling(run, config)
        self.key = jax.random.fold_in(jax.random.key(config.seed), SAMPLER_STREAM)
        self.current: Generation | None = None

    def generation_of(self, step: int) -> int:
        """The generation batch step `step` (counted from 1) trains on."""
        return (step - 1) // self.config.num_iterations

    def samples_at(self, step: int) -> bool:
        """Whether step `step` (counted from 1) starts with a new generation batch (its sampling waits for the step
        before)."""
        return self.current is None or self.current.k != self.generation_of(step)

    def batch_for(self, state, step: int) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """(batch, metrics) of step `step`, sampling a new generation batch with `state`'s policy at the first step
        of each; the generation's rewards and completions on each of its steps, its seconds (`time/`) on the one
        that sampled."""
        if self.samples_at(step):
            self.current = self.generate(state, self.generation_of(step), step)
            return self.current.batch, self.current.metrics
        return self.current.batch, {k: v for k, v in self.current.metrics.items() if not k.startswith("time/")}

    def sampler_key(self, k: int) -> jax.Array:
        """The key generation batch `k` draws its completions from."""
        return jax.random.fold_in(self.key, k)

    def generate(self, state, k: int, step: int) -> Generation:
        """Generation batch `k`, drawn at step `step` with `state`'s policy: sampled, laid out, its log-prob passes
        run, scored, its advantages computed, and its metrics (module docstring)."""
        config, run = self.config, self.run
        prompts, g = run.train_rows, self.generations
        rows = np.repeat(prompts.batch_rows(config.seed, k, config.batch_size), g)  # completion i: prompt i // G
        jax.block_until_ready(state.lora)  # the step before, finished: the clock times the sampler alone
        began = time.perf_counter()
        ids, mask, tokens, lengths = self._sample(state, prompts, rows, self.sampler_key(k))
        sampled = time.perf_counter()
        stopped = _stopped(tokens, lengths, self.sampling.eos)
        trained = stopped if config.mask_truncated_completions else None
        tokens = tokens[:, :completion_width(lengths, self.sampling.max_new_tokens)]  # nothing real is cut
        layout = rollout_rows(ids, mask, tokens, lengths, np.zeros(len(rows), np.float32),
                              grad_accum=config.grad_accum, trained=trained)
        batch = self._global(layout)
        scores = {}
        if self.run.policy_logps is not None:
            scores = self.run.policy_logps(state.lora, run.base, run.reference, batch)
            jax.block_until_ready(scores)
        scored = time.perf_counter()
        per_function, texts = self._rewards(prompts, rows, tokens, lengths, TrainerState(
            global_step=step - 1, max_steps=config.steps, epoch=k * config.batch_size / max(len(prompts), 1)))
        rewarded = time.perf_counter()
        weighted = weighted_rewards(per_function, self.weights)
        metrics = {}
        if self.objective.loss_type == "rloo":
            beta, kl = self.objective.beta, None
            if beta:  # RLOO's KL, in its rewards: each completion's summed old-minus-reference log-ratio
                kl = _gathered(jnp.sum(scores["old_logps"] - scores["ref_logps"], axis=1))
                metrics["kl"] = float(kl.sum() / max(layout["loss_mask"].sum(), 1.0))
            advantages = leave_one_out_advantages(per_function, self.weights, g, kl, beta, config.normalize_advantages)
            penalised = weighted - np.float32(beta) * kl if beta else weighted
            with warnings.catch_warnings():  # a group no function scores: NaN, which is not a zero spread (TRL's)
                warnings.simplefilter("ignore", RuntimeWarning)
                spread_zero = np.repeat(np.isclose(nanstd(penalised.reshape(-1, g), axis=1), 0.0), g)
        else:
            advantages, spread_zero = group_advantages(per_function, self.weights, g, config.scale_rewards)
        layout["advantage"] = np.where(layout["loss_mask"] > 0, advantages[:, None], 0.0).astype(np.float32)
        batch["advantage"] = self._global({"advantage": layout["advantage"]})["advantage"]
        batch.update({name: scores[name] for name in self.objective.logps_in_batch})
        metrics.update(self._metrics(per_function, weighted, spread_zero, lengths, stopped))
        metrics.update({"time/sample_s": sampled - began, "time/logps_s": scored - sampled,
                        "time/rewards_s": rewarded - scored,
                        "_positions": int(np.prod(layout["input_ids"].shape)),
                        "completions": [{"prompt": p, "completion": c, "reward": float(weighted[i])}
                                        for p, c, i in texts]})
        return Generation(k, batch, metrics)

    def _sample(self, state, prompts, rows: np.ndarray, key) -> tuple[np.ndarray, ...]:
        """(prompt ids, prompt mask, tokens, lengths) of one completion a row of `rows` (dataset rows of `prompts`),
        on every process."""
        return sample_rows(self.run, state, prompts.token_ids(rows), self.sampling, key)

    def _global(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return global_rows(self.run, arrays)

    def _rewards(self, prompts, rows: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, trainer_state,
                 shown: int = LOGGED_COMPLETIONS) -> tuple[np.ndarray, list[tuple[Any, str, int]]]:
        """(each reward function's rewards `[n, functions]` of every completion, the first `shown` completions'
        (prompt, text, row) of this process's rows): this process scores the rows its devices hold, then every
        process gathers every row's."""
        n = len(rows)
        lo, hi = local_row_range(self.run.batch_sharding, n, tokens.shape[1])
        mine = rows[lo:hi]
        columns = prompts.columns(mine)
        prompt_values = columns.pop("prompt")
        for name in NOT_PASSED_TO_REWARDS:
            columns.pop(name, None)
        completion_ids = [tokens[i, :lengths[i]].tolist() for i in range(lo, hi)]
        texts = self.run.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                       for prompt, text in zip(prompt_values, texts)]
        where = [prompts.where(r) for r in mine]
        error, local = None, np.zeros((hi - lo, len(self.rewards)), np.float32)
        try:
            local = score(self.rewards, prompt_values, completions, completion_ids, columns, trainer_state, where)
        except RewardError as e:  # every process stops with it, rather than the others waiting for its rewards
            error = e
        _raise_on_every_process(error)
        every = _gathered_rows(local, lo, hi, n)
        return every, list(zip(prompt_values, texts, range(lo, hi)))[:max(shown, 0)]

    def _metrics(self, per_function: np.ndarray, weighted: np.ndarray, spread_zero: np.ndarray, lengths: np.ndarray,
                 stopped: np.ndarray) -> dict[str, float]:
        """TRL's names: each function's reward mean and spread over the completions it scores, the weighted reward's
        (`weighted`), the share of prompts whose rewards are all equal (`spread_zero`, per completion), completion
        lengths and the share cut at max_completion_length."""
        out = {}
        with warnings.catch_warnings():  # a function that scores no completion: NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            for i, reward in enumerate(self.rewards):
                out[f"rewards/{reward.short_name}/mean"] = float(np.nanmean(per_function[:, i]))
                out[f"rewards/{reward.short_name}/std"] = float(nanstd(per_function[:, i]))
            out["reward"] = float(np.nanmean(weighted))
            out["reward_std"] = float(nanstd(weighted))
        out["frac_reward_zero_std"] = float(np.mean(spread_zero.reshape(-1, self.generations)[:, 0]))
        out["completions/mean_length"] = float(np.mean(lengths))
        out["completions/min_length"] = float(np.min(lengths))
        out["completions/max_length"] = float(np.max(lengths))
        out["completions/clipped_ratio"] = float(np.mean(~stopped))
        return out

    def evaluate(self, state) -> dict[str, Any]:
        """The held-out prompts' mean rewards (`eval_reward`, and each function's), one completion each, drawn as
        training draws them from the same key at every evaluation: the policy's score on prompts it never trains
        on."""
        config, prompts = self.config, self.run.eval_rows
        rows_all = prompts.eval_rows()
        chunk = config.rows_per_step
        sums, counts, lengths = np.zeros(len(self.rewards)), np.zeros(len(self.rewards)), []
        weighted_sum = weighted_count = 0.0
        written = []  # --eval-generate's: the first prompts' completions and rewards
        key = jax.random.fold_in(self.key, EVAL_STREAM)
        trainer_state = TrainerState(global_step=int(jax.device_get(state.step)), max_steps=config.steps, epoch=0.0)
        for start in range(0, len(rows_all), chunk):
            real = rows_all[start:start + chunk]
            rows = np.concatenate([real, np.repeat(real[-1:], chunk - len(real))])  # whole batches: padding repeats
            ids, mask, tokens, row_lengths = self._sample(state, prompts, rows, jax.random.fold_in(key, start))
            per_function, texts = self._rewards(prompts, rows, tokens, row_lengths, trainer_state,
                                                shown=config.eval_generate - len(written))
            per_function = per_function[:len(real)]
            weighted = weighted_rewards(per_function, self.weights)
            written += [{"prompt": p, "completion": c, "reward": float(weighted[i])} for p, c, i in texts
                        if i < len(real)]
            sums += np.nansum(per_function, axis=0)
            counts += (~np.isnan(per_function)).sum(axis=0)
            weighted_sum += float(np.nansum(weighted))
            weighted_count += int(np.sum(~np.isnan(weighted)))
            lengths.extend(row_lengths[:len(real)].tolist())
        out = {"eval_reward": weighted_sum / max(weighted_count, 1)}
        for i, reward in enumerate(self.rewards):
            out[f"eval_rewards/{reward.short_name}/mean"] = float(sums[i] / max(counts[i], 1))
        out["eval_completions/mean_length"] = float(np.mean(lengths)) if lengths else 0.0
        if config.eval_generate:
            out["eval_generations"] = written
        return out


def run_sampling(run, config: TrainConfig, temperature: float | None = None) -> Sampling:
    """How a run draws completions: at most --max-completion-length tokens, stopping at the model's and the
    tokenizer's EOS, with the run's sampling options (or at `temperature`, 0: greedy)."""
    tokenizer, model = run.tokenizer, run.llama
    eos = tuple(dict.fromkeys([*model.eos_token_ids] + ([tokenizer.eos_token_id]
                                                         if tokenizer.eos_token_id is not None else [])))
    pad = next(p for p in (tokenizer.pad_token_id, model.pad_token_id, *eos, 0) if p is not None)
    if temperature == 0:
        return Sampling(config.max_completion_length, 0.0, eos=eos, pad=int(pad))
    return Sampling(config.max_completion_length, config.temperature, config.top_p, config.top_k, config.min_p,
                    eos=eos, pad=int(pad))


def sample_rows(run, state, token_ids: list[list[int]], sampling: Sampling, key) -> tuple[np.ndarray, ...]:
    """(prompt ids, prompt mask, tokens, lengths) of one completion of each prompt of `token_ids` (every process
    gives all of them; their number a multiple of the batch's ways), drawn on the run's mesh from the policy in
    `state`, whole on every process."""
    ids, mask = left_padded(token_ids, prompt_bucket(max(map(len, token_ids))), sampling.pad)
    arrays = global_rows(run, {"ids": ids, "mask": mask})
    tokens, _, lengths = sample_arrays(run.graphdef, (state.lora, run.base), arrays["ids"], arrays["mask"], key,
                                       sampling)
    return ids, mask, _gathered(tokens), _gathered(lengths)


def global_rows(run, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host arrays `[n, ...]` (every process holds all of them) as global arrays over the run's batch sharding,
    each process placing its own devices' rows."""
    sharding = run.batch_sharding
    out = {}
    for name, value in arrays.items():
        lo, hi = local_row_range(sharding, value.shape[0], value.shape[1])
        out[name] = jax.make_array_from_process_local_data(sharding, value[lo:hi], value.shape)
    return out


def _stopped(tokens: np.ndarray, lengths: np.ndarray, eos: tuple[int, ...]) -> np.ndarray:
    """Whether each completion ended with an EOS token (else it was cut at max_completion_length)."""
    last = tokens[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    return (lengths > 0) & np.isin(last, np.asarray(eos or (-1,)))


def _raise_on_every_process(error: RewardError | None) -> None:
    """`error` raised on the process that met it, and on every other one a RewardError saying so."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None)))
        if error is None and failed.any():
            error = RewardError(f"a reward function failed on process {int(np.argmax(failed))} (see its error)")
    if error is not None:
        raise error


def _gathered(x: jax.Array) -> np.ndarray:
    """A global array, whole, on every process."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _gathered_rows(local: np.ndarray, lo: int, hi: int, n: int) -> np.ndarray:
    """Rows `[lo, hi)` of an `[n, ...]` array from each process, put together on every process."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    padded = np.zeros((n, *local.shape[1:]), local.dtype)
    padded[lo:hi] = local
    have = np.zeros(n, np.int32)
    have[lo:hi] = 1
    every = np.asarray(multihost_utils.process_allgather(padded))  # [processes, n, ...]
    owners = np.asarray(multihost_utils.process_allgather(have))  # [processes, n]
    return every[np.argmax(owners, axis=0), np.arange(n)]
