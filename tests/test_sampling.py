"""The sampler (jaxmodel.generation.sample): each token's log-probability is the full forward's on the same tokens
(through a live LoRA adapter, on a float32 and an NF4 base), rows stop at EOS or a stop sequence and the loop ends
when every row has, the same key draws the same tokens, and top-k and min-p filter as transformers' warpers do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper

from jaxmodel import CausalLM, load_pretrained
from jaxmodel.generation import Sampling, _draw, sample, warped
from jaxmodel.lora import LoraConfig, apply_lora
from test_moe_families import _random_adapters


@pytest.fixture(scope="module")
def adapted(tiny_converted):
    """The tiny Llama with a drawn adapter on its attention and MLP: every draw goes through it."""
    model = apply_lora(load_pretrained(tiny_converted), LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj",
                                                                                              "down_proj")),
                       rngs=nnx.Rngs(0))
    _random_adapters(model, seed=2)
    return model


@pytest.fixture
def decode_steps(monkeypatch):
    """A list that gains an item at each run of `CausalLM.decode` (the prefill and every decode step) from now on."""
    steps = []
    decode = CausalLM.decode

    def counted(self, *args, **kwargs):
        jax.debug.callback(lambda: steps.append(1))
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "decode", counted)
    return steps


def left_padded_prompts():
    """Three prompts of 7, 4 and 1 tokens, left-padded with 5 to 7."""
    rng = np.random.default_rng(4)
    lengths = [7, 4, 1]
    ids = np.full((3, 7), 5, np.int32)
    mask = np.zeros((3, 7), np.int32)
    for row, n in enumerate(lengths):
        ids[row, 7 - n:] = rng.integers(6, 512, n)
        mask[row, 7 - n:] = 1
    return ids, mask


def forward_logprobs(model: CausalLM, ids, mask, samples, temperature: float) -> np.ndarray:
    """Each completion token's log-probability from one full forward over prompt and completion (no cache), the
    logits divided by the temperature: `[b, n]`, 0 past a row's length."""
    n = samples.tokens.shape[1]
    real = np.arange(n)[None, :] < samples.lengths[:, None]
    full_ids = np.concatenate([ids, samples.tokens], axis=1)
    full_mask = np.concatenate([mask, real.astype(np.int32)], axis=1)
    positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)
    logits = model(jnp.asarray(full_ids), attention_mask=jnp.asarray(full_mask), positions=jnp.asarray(positions))
    scaled = np.asarray(logits, np.float64)[:, ids.shape[1] - 1:-1] / (temperature or 1.0)
    logprobs = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - scaled.max(-1, keepdims=True)
    picked = np.take_along_axis(logprobs, samples.tokens[:, :, None], axis=2)[:, :, 0]
    return np.where(real, picked, 0.0)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.7, 20, 0.9, 0.05), (0.0, 0, 1.0,
                                                                                                       0.0)])
def test_each_tokens_logprob_is_the_full_forwards_through_the_live_adapter(adapted, temperature, top_k, top_p,
                                                                             min_p):
    """Under the logits / temperature and no filtering (TRL's log-probs), from the adapter as it is: changing it
    changes the draws' log-probs, with no merge or copy to redo."""
    ids, mask = left_padded_prompts()
    sampling = Sampling(12, temperature, top_p, top_k, min_p, pad=5)
    samples = sample(adapted, ids, sampling, seed=3, attention_mask=mask)
    assert (samples.lengths == 12).all() and samples.logprobs.dtype == np.float32
    np.testing.assert_allclose(samples.logprobs, forward_logprobs(adapted, ids, mask, samples, temperature),
                               rtol=0, atol=2e-5)
    assert (samples.logprobs <= 0).all() and (samples.logprobs < -1e-3).any()


def test_a_changed_adapter_is_read_where_it_lies(tiny_converted):
    model = apply_lora(load_pretrained(tiny_converted), LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj")),
                       rngs=nnx.Rngs(0))
    ids, mask = left_padded_prompts()
    sampling = Sampling(6, 0.0, pad=5)
    before = sample(model, ids, sampling, attention_mask=mask)
    _random_adapters(model, seed=5)
    after = sample(model, ids, sampling, attention_mask=mask)
    assert not np.array_equal(before.tokens, after.tokens)
    np.testing.assert_allclose(after.logprobs, forward_logprobs(model, ids, mask, after, 0.0), rtol=0, atol=2e-5)


def test_an_nf4_base_samples_with_the_dequantized_forwards_logprobs(tiny_checkpoint, tmp_path):
    from converter import convert

    convert(tiny_checkpoint, tmp_path / "nf4", quantize="nf4", quant_block=16, progress=False)
    model = load_pretrained(tmp_path / "nf4")
    ids, mask = left_padded_prompts()
    samples = sample(model, ids, Sampling(8, 1.0, pad=5), seed=1, attention_mask=mask)
    np.testing.assert_allclose(samples.logprobs, forward_logprobs(model, ids, mask, samples, 1.0), rtol=0, atol=2e-5)


def test_rows_stop_at_eos_or_a_stop_sequence_and_the_loop_ends_when_all_have(adapted, decode_steps):
    """A row's length counts its stop token (or sequence); after it the row holds pad and log-prob 0; the loop
    runs as many decode steps as the longest row needs, not max_new_tokens."""
    ids, mask = left_padded_prompts()
    free = sample(adapted, ids, Sampling(16, 0.0, pad=5), attention_mask=mask)
    eos = int(free.tokens[0, 2])  # row 0 stops at its third token
    stop = tuple(int(t) for t in free.tokens[1, 4:6])  # row 1 at its sixth
    first = [list(row).index(eos) if eos in row else 99 for row in free.tokens.tolist()]
    decode_steps.clear()
    got = sample(adapted, ids, Sampling(16, 0.0, eos=(eos,), pad=5, stop=(stop,)), attention_mask=mask)
    expected = [min(first[0], 99) + 1, min(first[1] + 1, 6), min(first[2] + 1, 16)]
    assert got.lengths.tolist() == expected and expected[0] == 3
    for row, n in enumerate(expected):
        np.testing.assert_array_equal(got.tokens[row, :n], free.tokens[row, :n])
        assert (got.tokens[row, n:] == 5).all() and (got.logprobs[row, n:] == 0).all()
        np.testing.assert_array_equal(got.logprobs[row, :n], free.logprobs[row, :n])
    assert len(decode_steps) == max(expected)  # the prefill and a step for each token after the first


def test_rows_that_all_stop_early_end_the_loop_early(adapted, decode_steps):
    ids, mask = left_padded_prompts()
    free = sample(adapted, ids, Sampling(3, 0.0, pad=5), attention_mask=mask)
    decode_steps.clear()
    got = sample(adapted, ids, Sampling(40, 0.0, eos=tuple(int(t) for t in free.tokens[:, 1]), pad=5),
                 attention_mask=mask)
    assert got.lengths.max() <= 2 and len(decode_steps) == got.lengths.max()


def test_the_same_key_draws_the_same_tokens_whatever_else_the_batch_needs(adapted):
    """Step i draws from fold_in(key, i): a row's tokens do not depend on how long the loop ran."""
    ids, mask = left_padded_prompts()
    key = jax.random.key(11)
    a = sample(adapted, ids, Sampling(10, 1.0, pad=5), seed=key, attention_mask=mask)
    b = sample(adapted, ids, Sampling(10, 1.0, pad=5), seed=key, attention_mask=mask)
    c = sample(adapted, ids, Sampling(10, 1.0, pad=5), seed=jax.random.key(12), attention_mask=mask)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    # row 0 stopped after its fourth token: the other rows draw as before
    stopped = sample(adapted, ids, Sampling(10, 1.0, eos=(int(a.tokens[0, 3]),), pad=5), seed=key, attention_mask=mask)
    np.testing.assert_array_equal(stopped.tokens[0, :4], a.tokens[0, :4])
    for row in (1, 2):
        n = stopped.lengths[row]
        np.testing.assert_array_equal(stopped.tokens[row, :n], a.tokens[row, :n])


LOGITS = (2.0 * np.random.default_rng(13).standard_normal((3, 24))).astype(np.float32)


@pytest.mark.parametrize("temperature, top_k, min_p", [(0.7, 5, 0.0), (1.3, 0, 0.1), (1.0, 8, 0.3)])
def test_top_k_and_min_p_keep_what_transformers_warpers_keep(temperature, top_k, min_p):
    """The renormalised distribution after temperature, top-k and min-p equals transformers' after its warpers in
    its order; the sampler draws only kept tokens."""
    scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(LOGITS))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    theirs = torch.softmax(scores, dim=-1).numpy()
    sampling = Sampling(1, temperature, top_k=top_k, min_p=min_p)
    ours = np.asarray(jax.nn.softmax(warped(jnp.asarray(LOGITS) / temperature, sampling), axis=-1))
    np.testing.assert_array_equal(ours == 0, theirs == 0)
    assert (theirs == 0).any(axis=-1).all()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=0)
    tokens, _ = _draw(jnp.tile(jnp.asarray(LOGITS[:1]), (2000, 1)), jax.random.key(0), sampling)
    assert set(np.asarray(tokens).tolist()) == set(np.flatnonzero(theirs[0]).tolist())


@pytest.mark.parametrize("fields, message", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(top_k=-1), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(temperature=-0.1), "temperature"), (dict(stop=((),)), "stop sequence")])
def test_bad_sampling_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**{"max_new_tokens": 4, **fields})


@pytest.mark.slow
def test_the_sampler_on_the_training_mesh_draws_what_one_device_draws(adapted):
    """The model's weights and adapter laid out over dp=2, fsdp=2, mp=2 by the training rules, the prompts over the
    batch axes: the same tokens (greedy and sampled from the same key) and log-probabilities (2e-5)."""
    from finetune.step.mesh import make_mesh
    from jaxmodel.generation import sample_arrays
    from jaxmodel.sharding import named_sharding, variable_sharding

    ids, mask = left_padded_prompts()
    ids, mask = np.tile(ids, (4, 1)), np.tile(mask, (4, 1))  # 12 rows: over the 4 batch devices
    graphdef, state = nnx.split(adapted)
    mesh = make_mesh("dp=2,fsdp=2,cp=1,mp=2")
    placed = jax.tree.map(lambda v: v.replace(jax.device_put(v[...], variable_sharding(v, mesh))), state,
                          is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert any(len(set(leaf.sharding.spec) - {None}) > 0 for leaf in jax.tree.leaves(placed))
    for sampling in (Sampling(8, 0.0, pad=5), Sampling(8, 0.9, top_p=0.95, pad=5)):
        one = sample_arrays(graphdef, state, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(2), sampling)
        with jax.set_mesh(mesh):
            rows = named_sharding(("act_batch", None), ids.shape, mesh)
            got = sample_arrays(graphdef, placed, jax.device_put(ids, rows), jax.device_put(mask, rows),
                                jax.random.key(2), sampling)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(one[0]))
        np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(one[2]))
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(one[1]), rtol=0, atol=2e-5)
