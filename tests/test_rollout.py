"""Rollout rows (finetune.rollout.batch): completions drawn by the sampler, laid out for the policy-gradient step,
score in the training forward with the log-probabilities they were drawn with, so that a first iteration's ratios
are 1; prompt buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from finetune.rollout.batch import left_padded, prompt_bucket, rollout_rows


@pytest.mark.parametrize("longest, bucket", [(1, 16), (16, 16), (17, 32), (1000, 1024), (1025, 2048), (3000, 3072)])
def test_prompts_pad_to_a_handful_of_lengths(longest, bucket):
    assert prompt_bucket(longest) == bucket


@pytest.mark.slow
def test_the_training_forward_scores_each_sampled_token_as_the_sampler_drew_it(tiny_converted):
    """Three prompts of 1-7 tokens, two completions each at temperature 0.7 with top-k (filtering changes what is
    drawn, not the log-probabilities), one stopping at EOS: the step's log-probabilities at the training forward equal
    the sampler's (2e-5), so the ratios are 1 (no clipping) and the loss is the one without old log-probabilities;
    in two micro-batches (each completion's slot within its own) the loss is the one-batch loss."""
    from flax import nnx

    from finetune.step.policy import PolicyObjective
    from finetune.step.train_step import policy_loss_and_grads, split_model
    from jaxmodel import load_pretrained
    from jaxmodel.generation import Sampling, sample
    from jaxmodel.lora import LoraConfig, apply_lora
    from test_moe_families import _random_adapters

    model = apply_lora(load_pretrained(tiny_converted), LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj")),
                       rngs=nnx.Rngs(0))
    _random_adapters(model, seed=3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(6, 512, n)) for n in (7, 4, 1) for _ in range(2)]  # G = 2
    ids, mask = left_padded(prompts, prompt_bucket(7), pad=5)
    free = sample(model, ids, Sampling(6, 0.7, top_k=30, pad=5), seed=4, attention_mask=mask)
    samples = sample(model, ids, Sampling(6, 0.7, top_k=30, pad=5, eos=(int(free.tokens[1, 2]),)), seed=4,
                     attention_mask=mask)
    assert samples.lengths.min() < 6  # a row stopped early
    advantages = np.array([1.0, -1.0, 0.5, -0.5, 0.0, 2.0], np.float32)
    objective = PolicyObjective("grpo", beta=0.0, temperature=0.7)
    graphdef, lora, base = split_model(model)

    def step(batch, grad_accum):
        return jax.jit(lambda lora, base, batch: policy_loss_and_grads(
            graphdef, lora, base, batch, objective, 6 // grad_accum, 6, grad_accum))(
            lora, base, {k: jnp.asarray(v) for k, v in batch.items()})

    losses = []
    for grad_accum in (1, 2):
        rows = rollout_rows(ids, mask, samples.tokens, samples.lengths, advantages, samples.logprobs, grad_accum)
        assert rows["loss_mask"].sum() == samples.lengths.sum()
        loss, tokens, grads, metrics = step(rows, grad_accum)
        detached, _, detached_grads, _ = step({k: v for k, v in rows.items() if k != "old_logps"}, grad_accum)
        assert float(metrics["clip_ratio/region_mean"]) == 0.0
        assert abs(float(loss) - float(detached)) <= 2e-5 * max(1.0, abs(float(detached)))
        for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(detached_grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(d), rtol=0, atol=1e-4 * max(1.0, np.abs(d).max()))
        losses.append(float(loss))
    assert abs(losses[0]) > 1e-4  # advantages of both signs with unequal lengths: a nonzero loss
    assert abs(losses[1] - losses[0]) <= 1e-6 * abs(losses[0])


def test_rows_keep_the_longest_completions_bucket_and_lose_only_padding():
    """Completions of 3 and 5 tokens drawn with room for 40 keep 16 positions (the smallest bucket): the rows equal
    the whole rows cut there, and nothing cut was a completion token."""
    from finetune.rollout.batch import completion_width

    assert (completion_width(np.array([3, 5]), 40), completion_width(np.array([20]), 24)) == (16, 24)
    assert completion_width(np.array([600, 7]), 2048) == 1024 and completion_width(np.array([0]), 8) == 8
    rng = np.random.default_rng(0)
    ids, mask = left_padded([[5, 6, 7], [8]], 16, pad=0)
    tokens, lengths = rng.integers(1, 100, (2, 40)), np.array([3, 5])
    tokens[np.arange(40)[None, :] >= lengths[:, None]] = 0
    logps = np.where(tokens > 0, -rng.random((2, 40)), 0.0)
    whole = rollout_rows(ids, mask, tokens, lengths, np.array([1.0, -1.0]), logps)
    width = completion_width(lengths, 40)
    cut = rollout_rows(ids, mask, tokens[:, :width], lengths, np.array([1.0, -1.0]), logps[:, :width])
    for name, value in cut.items():
        np.testing.assert_array_equal(value, whole[name][:, :16 + width], err_msg=name)
    assert not whole["loss_mask"][:, 16 + width:].any()
