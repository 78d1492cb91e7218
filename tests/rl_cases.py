"""What the online RL tests share: the prompts (sums with their answers), a reward file written for TRL, and the
first step of a run from its first batch of completions (the sampler, the rewards, the advantages, the log-prob pass
and the loss with its LoRA gradients), computed on one device, on a mesh, or across processes
(tests/multihost_worker.py)."""

from __future__ import annotations

import textwrap

import numpy as np

# A TRL-style reward file: a format check on the completion's start and the prompt's own column, with TRL's arguments.
REWARDS = textwrap.dedent('''
    import re

    def starts_with_a_number(completions, **kwargs):
        return [1.0 if re.match(r"^ *[0-9]", c) else 0.0 for c in completions]

    def close(completions, answer, trainer_state, **kwargs):
        numbers = [re.findall(r"[0-9]+", c) for c in completions]
        return [None if not found else 1.0 / (1.0 + abs(int(found[0]) - int(a))) for found, a in zip(numbers, answer)]

    def short(completions, **kwargs):
        return [1.0]

    def fails_on_process_1(completions, **kwargs):
        import jax

        if jax.process_index() == 1:
            raise ValueError("not on this process")
        return [0.0] * len(completions)
''')


# The online RL objectives' options, which other objectives cannot be given: each refused on resuming an RL run
# (tests/test_rl_runs.py::test_resume_refuses_a_changed_rl_option), as (the value given instead of `rl_options`'s,
# "old -> new" of the error line); rloo's own, `normalize_advantages`, by its test alone.
RL_KNOBS = {
    "num_generations": (2, "4 -> 2"),
    "max_completion_length": (5, "6 -> 5"),
    "temperature": (0.9, "0.8 -> 0.9"),
    "top_p": (0.9, "1.0 -> 0.9"),
    "top_k": (5, "0 -> 5"),
    "min_p": (0.1, "0.0 -> 0.1"),
    "reward": (("equals:answer", "regex:x"), "('{rewards}:starts_with_a_number', '{rewards}:close') -> "
                                             "('equals:answer', 'regex:x')"),
    "reward_weights": ("1,1", "1,0.5 -> 1,1"),
    "loss_type": ("dapo", "grpo -> dapo"),
    "scale_rewards": ("batch", "group -> batch"),
    "importance_sampling_level": ("sequence", "token -> sequence"),
    "epsilon": (0.3, "0.2 -> 0.3"),
    "epsilon_high": (0.3, "None -> 0.3"),
    "num_iterations": (1, "2 -> 1"),
    "mask_truncated_completions": (True, "False -> True"),
    "beta": (0.2, "0.1 -> 0.2"),
    "normalize_advantages": None,
}


def prompt_rows(n: int = 24, seed: int = 0) -> list[dict]:
    """Sums to complete, each with its answer (a column the rewards read), some prompts longer than others."""
    rng = np.random.default_rng(seed)
    return [{"prompt": f"add {a} + {b}{' please' * int(rng.integers(0, 3))} =", "answer": str(a + b)}
            for a, b in rng.integers(0, 40, (n, 2))]


def write_rewards(directory) -> str:
    """REWARDS as DIRECTORY/rewards.py; returns its path."""
    path = directory / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


def rl_options(rewards_file: str) -> dict:
    """A GRPO run's options where every part of the step is live: two iterations (old log-probs from a forward pass),
    beta > 0 (the reference's), two reward functions weighted, one of them None for some completions."""
    return {"objective": "grpo", "reward": (f"{rewards_file}:starts_with_a_number", f"{rewards_file}:close"),
            "reward_weights": "1,0.5", "num_generations": 4, "batch_size": 4, "max_completion_length": 6,
            "num_iterations": 2, "beta": 0.1, "loss_type": "grpo", "temperature": 0.8, "targets": "q_proj,v_proj",
            "dtype": "float32", "remat": "none", "seq_len": 32}


def first_rollout_step(config, devices=None) -> dict[str, np.ndarray]:
    """{input_ids, advantage, old_logps, ref_logps (grpo), loss, LoRA gradients by name, and sampler_logps: the
    sampler's log-probabilities of the tokens it drew, laid out as old_logps} of a run's first batch of completions,
    sampled with adapters made nonzero (so that the policy, its old log-probs and the reference differ), every array
    whole on every process."""
    import jax
    from flax import nnx
    from jax.experimental import multihost_utils

    from finetune.rollout.batch import left_padded, prompt_bucket, rollout_rows
    from finetune.rollout.rewards import load_reward
    from finetune.step.policy import PolicyObjective
    from finetune.step.train_step import policy_loss_and_grads
    from finetune.train.build import setup
    from finetune.train.rollouts import Rollouts
    from jaxmodel.generation import sample_arrays

    run = setup(config, devices=devices)
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), run.state.lora)
    state = run.state._replace(lora=lora)
    with jax.set_mesh(run.mesh):
        rollouts = Rollouts(config, run, [load_reward(s) for s in config.reward])
        generation = rollouts.generate(state, 0, 1)
        # the sampler's own log-probabilities of what it drew, where the batch holds the old ones
        rows = np.repeat(run.train_rows.batch_rows(config.seed, 0, config.batch_size), config.value("num_generations"))
        token_ids = run.train_rows.token_ids(rows)
        ids, mask = left_padded(token_ids, prompt_bucket(max(map(len, token_ids))), rollouts.sampling.pad)
        drawn = sample_arrays(run.graphdef, (lora, run.base), *rollouts._global({"i": ids, "m": mask}).values(),
                              rollouts.sampler_key(0), rollouts.sampling)
        n = config.rows_per_step
        fn = jax.jit(lambda lora, base, batch: policy_loss_and_grads(
            run.graphdef, lora, base, batch, PolicyObjective.of(config), n // config.grad_accum, n,
            config.grad_accum))
        loss, _, grads, _ = fn(lora, run.base, generation.batch)
        arrays = {name: generation.batch[name] for name in ("input_ids", "advantage", "old_logps", "ref_logps")
                  if name in generation.batch}  # rloo's reference is in its advantages, not its batch
        gathered = multihost_utils.process_allgather((arrays, loss, grads, drawn), tiled=True) \
            if jax.process_count() > 1 else jax.device_get((arrays, loss, grads, drawn))
    arrays, loss, grads, (tokens, logprobs, lengths) = gathered
    arrays["sampler_logps"] = rollout_rows(ids, mask, np.asarray(tokens), np.asarray(lengths), np.zeros(len(rows)),
                                           np.asarray(logprobs), config.grad_accum)["old_logps"]
    arrays["sampler_logps"] = arrays["sampler_logps"][:, :arrays["input_ids"].shape[1]]  # the rows' completion width
    flat = {".".join(map(str, k)): np.asarray(v[...] if hasattr(v, "get_value") else v)
            for k, v in nnx.to_flat_state(grads)}
    return {**{k: np.asarray(v) for k, v in arrays.items()}, "loss": np.asarray(loss), **flat}
