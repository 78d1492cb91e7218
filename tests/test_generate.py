"""KV-cache generation: greedy decode equals the full forward step by step, and transformers' greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from jaxmodel import load_pretrained
from jaxmodel import generate


@pytest.fixture(scope="module")
def model(tiny_converted):
    return load_pretrained(tiny_converted)


@pytest.fixture(scope="module")
def prompts():
    return np.random.default_rng(3).integers(6, 512, (2, 9))


def test_greedy_with_cache_equals_argmax_of_full_forward(model, prompts):
    out = generate(model, prompts, 12, eos_token_id=())
    forward = jax.jit(lambda m, ids: m(ids))
    ids = prompts
    for _ in range(12):  # no cache: rerun the whole sequence, take the argmax of the last position
        next_ids = np.asarray(forward(model, jnp.asarray(ids)))[:, -1].argmax(-1)
        ids = np.concatenate([ids, next_ids[:, None]], axis=1)
    np.testing.assert_array_equal(out, ids)


def test_greedy_equals_transformers_greedy(model, prompts, tiny_checkpoint):
    hf = HFLlamaForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor(prompts), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                               pad_token_id=5).numpy()
    np.testing.assert_array_equal(generate(model, prompts, 16, eos_token_id=()), expected)


def test_left_padded_prompts_decode_as_if_alone(model, prompts):
    short = prompts[1, 4:]
    padded = np.stack([prompts[0], np.concatenate([np.full(4, 5), short])])
    mask = np.array([[1] * 9, [0] * 4 + [1] * 5])
    together = generate(model, padded, 8, attention_mask=mask, eos_token_id=())
    alone = generate(model, short[None], 8, eos_token_id=())
    np.testing.assert_array_equal(together[1, 9:], alone[0, 5:])


def test_rows_stop_at_eos_and_pad_afterwards(model, prompts):
    greedy = generate(model, prompts, 10, eos_token_id=())
    eos = int(greedy[0, 9 + 3])  # make row 0's fourth new token the stop token
    out = generate(model, prompts, 10, eos_token_id=eos, pad_token_id=5)
    np.testing.assert_array_equal(out[0, : 9 + 4], greedy[0, : 9 + 4])
    assert (out[0, 9 + 4:] == 5).all()


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
