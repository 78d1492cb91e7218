"""The JAX port against transformers' LlamaForCausalLM: save_pretrained -> convert -> load -> logits."""

import dataclasses
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import BLOCKED_LENGTHS, batches, left_padded_batches, llama_configs
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from converter import convert
from jaxmodel import load_pretrained
from jaxmodel.rope import RopeConfig

# float32: 1e-4 absolute for logits up to 1 in size, relative beyond. Rounding error grows with the
# activations: on a drawn config with logits up to 6.9 (init std 0.2, head_dim 4, 390 tokens) both sides
# were 1e-4 from a float64 run of transformers (HF 1.04e-4, JAX 0.87e-4) and 1.9e-4 from each other.
F32_TOL = 1e-4


def f32_tolerance(expected: np.ndarray) -> float:
    return F32_TOL * max(1.0, float(np.abs(expected).max()))

# bf16: the two sides round activations at different points, so they are compared through a float64
# run of transformers on the same bf16 weights: the port's error must stay within 2x transformers' own
# bf16 error. Measured over 12 drawn configs: ratio 0.57-1.34 (the port keeps scores and logits in
# float32, transformers rounds them to bf16).
BF16_ERROR_RATIO = 2.0


def hf_and_jax(config: dict, dtype: str = "float32", seed: int = 0):
    """Build the HF model with a seed, save_pretrained it, convert, load it in JAX."""
    torch.manual_seed(seed)
    hf = HFLlamaForCausalLM(HFLlamaConfig(**config))
    inv_freq = hf.model.rotary_emb.inv_freq.clone()
    hf = hf.to(getattr(torch, dtype)).eval()
    # `.to(bfloat16)` also rounds the RoPE frequencies, which `from_pretrained(dtype=...)` keeps in float32;
    # with rounded ones the float64 reference itself drifts with position (found by hypothesis at seq 120).
    hf.model.rotary_emb.inv_freq = inv_freq
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(Path(tmp) / "hf")
        convert(Path(tmp) / "hf", Path(tmp) / "jax", progress=False)
        model = load_pretrained(Path(tmp) / "jax")
    return hf, model


def hf_logits(hf, ids, attention_mask=None) -> np.ndarray:
    with torch.no_grad():
        mask = None if attention_mask is None else torch.tensor(attention_mask)
        return hf(torch.tensor(ids), attention_mask=mask).logits.float().numpy()


def left_padded_generations(hf, model, vocab: int, lengths=(9, 5), new: int = 12, seed: int = 6, pad: int = 0):
    """Greedy continuations of `new` tokens of random prompts of `lengths`, left-padded with `pad`, by
    transformers' `generate` and by this port's (EOS never stops them): (ours, theirs)."""
    from jaxmodel import generate

    seq = max(lengths)
    mask = np.array([[0] * (seq - n) + [1] * n for n in lengths])
    ids = np.where(mask == 1, np.random.default_rng(seed).integers(1, vocab, (len(lengths), seq)), pad)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=pad).numpy()
    return generate(model, ids, new, attention_mask=mask, eos_token_id=(), pad_token_id=pad), theirs


@jax.jit
def jax_logits(model, ids, attention_mask=None):
    return model(ids, attention_mask=attention_mask)


@pytest.mark.slow
@settings(max_examples=25)
@given(config=llama_configs(), shape=batches(), seed=st.integers(0, 2**16))
def test_float32_logits_match_transformers(config, shape, seed):
    hf, model = hf_and_jax(config, seed=seed)
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], shape)
    expected = hf_logits(hf, ids)
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    assert got.dtype == np.float32 and got.shape == (*shape, config["vocab_size"])
    assert np.abs(got - expected).max() <= f32_tolerance(expected)


@pytest.mark.slow
@settings(max_examples=6)
@given(config=llama_configs(max_layers=2), shape=batches(max_seq=160), seed=st.integers(0, 2**16))
def test_bfloat16_logits_match_transformers_within_documented_bound(config, shape, seed):
    hf, model = hf_and_jax(config, dtype="bfloat16", seed=seed)
    assert model.embed_tokens.weight[...].dtype == jnp.bfloat16
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], shape)
    theirs = hf_logits(hf, ids)
    with torch.no_grad():
        exact = hf.double()(torch.tensor(ids)).logits.numpy()
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32)))
    assert got.dtype == np.float32
    their_error = np.abs(theirs - exact).max()
    floor = 1e-3 * max(1.0, np.abs(exact).max())  # where transformers happens to be almost exact
    assert np.abs(got - exact).max() <= BF16_ERROR_RATIO * their_error + floor


def left_padded(seq: int, lengths: list[int]) -> np.ndarray:
    """attention_mask `[len(lengths), seq]` with each row's real tokens at the end."""
    return np.array([[0] * (seq - n) + [1] * n for n in lengths])


def assert_real_positions_match(hf, model, ids: np.ndarray, mask: np.ndarray):
    expected = hf_logits(hf, ids, mask)
    got = np.asarray(jax_logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask)))
    real = mask.astype(bool)  # padded query positions are garbage on both sides
    assert np.abs(got[real] - expected[real]).max() <= f32_tolerance(expected[real])


@pytest.mark.slow
@settings(max_examples=6)
@given(config=llama_configs(max_layers=2), seed=st.integers(0, 2**16), batch=left_padded_batches())
def test_padding_mask_matches_transformers(config, seed, batch):
    hf, model = hf_and_jax(config, seed=seed)
    seq, lengths = batch
    ids = np.random.default_rng(seed).integers(0, config["vocab_size"], (len(lengths), seq))
    assert_real_positions_match(hf, model, ids, left_padded(seq, lengths))


# GQA, llama3 RoPE whose original context (32) the sequences exceed, init large enough that attention
# moves the logits.
BLOCKED_CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "initializer_range": 0.1, "max_position_embeddings": 1024,
                  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32}}


@pytest.mark.slow
@pytest.mark.parametrize("seq", BLOCKED_LENGTHS)
def test_left_padding_on_the_query_block_path_matches_transformers(seq):
    """Left padding of less than one block, of more than one block (the first query block is all
    padding), and of all but the last two tokens, on the causal query-block path."""
    hf, model = hf_and_jax(BLOCKED_CONFIG, seed=seq)
    block = seq // 4
    lengths = [seq, seq - block // 2, seq - block - 7, 2]
    ids = np.random.default_rng(seq).integers(0, BLOCKED_CONFIG["vocab_size"], (len(lengths), seq))
    assert_real_positions_match(hf, model, ids, left_padded(seq, lengths))


@pytest.mark.slow
def test_wrong_rope_scaling_is_caught_by_the_tolerance():
    """The parity tolerance is meaningful: dropping Llama 3.1's RoPE scaling (the reference run's bug)
    moves the logits far beyond it."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "initializer_range": 0.05, "max_position_embeddings": 1024,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}}
    hf, model = hf_and_jax(config)
    ids = np.random.default_rng(0).integers(0, 64, (1, 300))
    expected = hf_logits(hf, ids)
    assert np.abs(np.asarray(jax_logits(model, jnp.asarray(ids))) - expected).max() <= F32_TOL
    model.config = dataclasses.replace(model.config, rope=RopeConfig(type="default", theta=500000.0))
    assert np.abs(np.asarray(jax_logits(model, jnp.asarray(ids))) - expected).max() > 100 * F32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_sharded_load_gives_the_same_logits(tiny_converted, mesh_shape):
    mesh = jax.make_mesh(mesh_shape, ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    plain = load_pretrained(tiny_converted)
    sharded = load_pretrained(tiny_converted, mesh=mesh)
    q = sharded.layers.self_attn.q_proj.weight[...]
    assert q.sharding.mesh.shape == dict(zip(("dp", "fsdp", "mp"), mesh_shape))
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // mesh_shape[2],
                                                             q.shape[2] // mesh_shape[1])}
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 512, (2, 33)), jnp.int32)
    # Sharded matmuls sum in another order: float32 rounding, as in the parity tolerance.
    expected = np.asarray(jax_logits(plain, ids))
    np.testing.assert_allclose(np.asarray(jax_logits(sharded, ids)), expected, atol=f32_tolerance(expected))
