"""KV-cache generation: greedy decode equals the full forward step by step, and transformers' greedy;
sampling draws from the distribution transformers' temperature and top-p warpers give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from jaxmodel import generate, load_pretrained
from jaxmodel.generation import Sampling, _draw


def _sample(logits_bv, key, temperature: float, top_p: float):
    """The sampler's draw of one token a row."""
    return _draw(logits_bv, key, Sampling(1, temperature, top_p))[0]


@pytest.fixture(scope="module")
def model(tiny_converted):
    return load_pretrained(tiny_converted)


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(3).integers(6, 512, (2, 9))


@pytest.mark.slow
def test_greedy_with_cache_equals_argmax_of_full_forward(model, prompts):
    out = generate(model, prompts, 12, eos_token_id=())
    forward = jax.jit(lambda m, ids: m(ids))
    ids = prompts
    for _ in range(12):  # no cache: rerun the whole sequence, take the argmax of the last position
        next_ids = np.asarray(forward(model, jnp.asarray(ids)))[:, -1].argmax(-1)
        ids = np.concatenate([ids, next_ids[:, None]], axis=1)
    np.testing.assert_array_equal(out, ids)


@pytest.mark.slow
def test_greedy_equals_transformers_greedy(model, prompts, tiny_checkpoint):
    hf = HFLlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompts), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                               pad_token_id=5).numpy()
    np.testing.assert_array_equal(generate(model, prompts, 16, eos_token_id=()), expected)


@pytest.mark.slow
def test_left_padded_prompts_decode_as_if_alone(model, prompts):
    short = prompts[1, 4:]
    padded = np.stack([prompts[0], np.concatenate([np.full(4, 5), short])])
    mask = np.array([[1] * 9, [0] * 4 + [1] * 5])
    together = generate(model, padded, 8, attention_mask=mask, eos_token_id=())
    alone = generate(model, short[None], 8, eos_token_id=())
    np.testing.assert_array_equal(together[1, 9:], alone[0, 5:])


@pytest.mark.slow
def test_rows_stop_at_eos_and_pad_afterwards(model, prompts):
    greedy = generate(model, prompts, 10, eos_token_id=())
    eos = int(greedy[0, 9 + 3])  # make row 0's fourth new token the stop token
    out = generate(model, prompts, 10, eos_token_id=eos, pad_token_id=5)
    np.testing.assert_array_equal(out[0, : 9 + 4], greedy[0, : 9 + 4])
    assert (out[0, 9 + 4:] == 5).all()


@pytest.mark.slow
def test_sampling_is_seeded_and_top_p_narrows_to_greedy(model, prompts):
    a = generate(model, prompts, 10, temperature=1.0, seed=7, eos_token_id=())
    b = generate(model, prompts, 10, temperature=1.0, seed=7, eos_token_id=())
    c = generate(model, prompts, 10, temperature=1.0, seed=8, eos_token_id=())
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # a nucleus smaller than any single token's probability keeps only the most likely token
    nucleus = generate(model, prompts, 10, temperature=1.0, top_p=1e-6, seed=9, eos_token_id=())
    np.testing.assert_array_equal(nucleus, generate(model, prompts, 10, eos_token_id=()))


def test_bad_arguments_are_rejected(model, prompts):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompts, 0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompts, 3, top_p=0.0)


# Fixed logits, three rows over a 24-token vocabulary: distinct values, so no ties at the nucleus edge.
SAMPLING_LOGITS = (2.0 * np.random.default_rng(11).standard_normal((3, 24))).astype(np.float32)
SAMPLING = [(0.7, 0.9), (0.7, 0.5), (1.3, 1.0)]  # (temperature, top_p)


def transformers_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The distribution transformers samples from: temperature, then top-p, then softmax (float32)."""
    scores = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits))
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).numpy()


def nucleus_margin(logits: np.ndarray, temperature: float, top_p: float) -> float:
    """How far `top_p` is from every cumulative probability of the sorted tokens (float64): a margin
    far above float32 rounding means both implementations must cut at the same token."""
    z = np.sort(logits.astype(np.float64) / temperature, axis=-1)[:, ::-1]
    probs = np.exp(z - z.max(-1, keepdims=True))
    cumulative = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    return float(np.abs(cumulative - top_p).min())


@pytest.mark.parametrize("temperature, top_p", SAMPLING)
def test_sampler_draws_from_transformers_warped_distribution(temperature, top_p):
    """The distribution the sampler draws from (the softmax of its warped logits) is exactly transformers'
    filtered, renormalised one: the same tokens have probability zero, the others equal within float32."""
    from jaxmodel.generation import warped

    assert top_p == 1.0 or nucleus_margin(SAMPLING_LOGITS, temperature, top_p) > 1e-3
    sampling = Sampling(1, temperature, top_p)
    ours = np.asarray(jax.nn.softmax(warped(jnp.asarray(SAMPLING_LOGITS) / temperature, sampling), axis=-1))
    theirs = transformers_distribution(SAMPLING_LOGITS, temperature, top_p)
    np.testing.assert_array_equal(ours == 0, theirs == 0)
    if top_p < 1.0:
        assert (theirs == 0).any(axis=-1).all()  # the nucleus is a strict subset in every row
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=0)


@pytest.mark.parametrize("temperature, top_p", SAMPLING)
def test_sampled_frequencies_match_transformers_warped_distribution(temperature, top_p):
    """N = 20000 draws per row: the tokens drawn are exactly the nucleus, and each token's frequency is
    within 5 binomial standard deviations (+ 1/N) of transformers' probability. The draws are fixed by the
    key, so the test is deterministic; the bound says why it holds."""
    n = 20000
    theirs = transformers_distribution(SAMPLING_LOGITS, temperature, top_p)
    for row, probs in enumerate(theirs):
        logits_nv = jnp.tile(jnp.asarray(SAMPLING_LOGITS[row]), (n, 1))
        tokens = np.asarray(_sample(logits_nv, jax.random.key(row), temperature, top_p))
        assert set(tokens.tolist()) == set(np.flatnonzero(probs).tolist())
        frequencies = np.bincount(tokens, minlength=probs.size) / n
        bound = 5 * np.sqrt(probs * (1 - probs) / n) + 1 / n
        np.testing.assert_array_less(np.abs(frequencies - probs), bound)
