"""`--eval-generate N` for the objectives that do not sample (sft and the preference ones): at each evaluation the
first N held-out prompts are completed greedily by the run's sampler (the live adapters on the run's mesh, as an
online RL run samples; `finetune.train.rollouts.sample_rows`), and each completion is written beside the prompt's
own reply (`finetune.data.prompts.held_out_prompts`) with the evaluation's metrics."""

from __future__ import annotations

import jax

from finetune.train.rollouts import run_sampling, sample_rows
from jaxmodel.sharding import batch_ways


def eval_generations(run, state) -> list[dict[str, str]]:
    """[{prompt, completion, reference}] of the run's held-out prompts (`Run.eval_prompts`), decoded."""
    prompts = run.eval_prompts
    ways = batch_ways(run.mesh)
    padded = prompts + prompts[-1:] * (-len(prompts) % ways)  # whole rows a device: the last one repeated
    sampling = run_sampling(run, run.config, temperature=0)
    _, _, tokens, lengths = sample_rows(run, state, [p for p, _ in padded], sampling, jax.random.key(0))
    decode = run.tokenizer.decode
    return [{"prompt": decode(prompt), "completion": decode(tokens[i, :lengths[i]], skip_special_tokens=True),
             "reference": decode(reference, skip_special_tokens=True)}
            for i, (prompt, reference) in enumerate(prompts)]
