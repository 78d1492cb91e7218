"""Model structure: the layer scan keeps compile cost flat in depth; remat and dtype options."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodel import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def lowered_text(layers: int, remat: str = "none") -> str:
    config = dataclasses.replace(CONFIG, num_hidden_layers=layers)
    model = LlamaForCausalLM(config, remat=remat, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, ids):
        return nnx.merge(graphdef, state)(ids).mean()

    ids = jnp.zeros((2, 16), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(state, ids).as_text()


def test_program_size_does_not_grow_with_depth():
    shallow, deep = lowered_text(2), lowered_text(30)
    assert len(deep.splitlines()) == len(shallow.splitlines())  # the same program; only stacked shapes differ
    assert deep.count("stablehlo.dot_general") == shallow.count("stablehlo.dot_general")
    assert "stablehlo.while" in deep


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_policies_keep_the_numbers(remat):
    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)), jnp.int32)

    def grads(remat_name):
        def loss(state):
            m = nnx.merge(graphdef, state)
            m.remat = remat_name
            return m(ids).mean()
        return jax.jit(jax.grad(loss))(state)

    plain, rematted = grads("none"), grads(remat)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rematted)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    remat_model = LlamaForCausalLM(CONFIG, remat=remat, rngs=nnx.Rngs(1))
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(ids).mean())(nnx.state(remat_model)))
    assert "remat" not in jaxpr  # the plain model's graphdef
    graphdef_remat, state_remat = nnx.split(remat_model)
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef_remat, s)(ids).mean())(state_remat))
    assert "remat" in jaxpr


def test_unknown_remat_policy_is_rejected():
    with pytest.raises(ValueError, match="remat must be one of"):
        LlamaForCausalLM(CONFIG, remat="sometimes", rngs=nnx.Rngs(0))


def test_bf16_compute_with_f32_params_returns_f32_logits():
    model = LlamaForCausalLM(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert model.layers.mlp.up_proj.weight[...].dtype == jnp.float32
    assert model.layers.mlp.up_proj.weight[...].shape == (2, 48, 32)
    logits = model(jnp.zeros((1, 5), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (1, 5, 64)


def test_causal_query_blocks_keep_the_numbers(monkeypatch):
    """Attention without a cache skips the keys after each query block; logits and gradients must equal
    those of full attention, with packed documents and padding in the row."""
    import jaxmodel.model as model_module

    t = model_module.CAUSAL_BLOCKS * model_module.CAUSAL_BLOCK_MIN
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, t)), jnp.int32)
    segments = np.ones((2, t), np.int32)
    segments[0, t // 3:] = 2  # a second document starting inside a query block
    segments[1, -7:] = 0  # padding at the end
    positions = np.where(segments[0] == 2, np.arange(t) - t // 3, np.arange(t))[None].repeat(2, 0)
    model = LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(2))
    graphdef, state = nnx.split(model)

    def run(blocks):
        monkeypatch.setattr(model_module, "CAUSAL_BLOCKS", blocks)

        def logits(state):
            return nnx.merge(graphdef, state)(ids, positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments))

        def loss(state):
            return (logits(state) * (segments != 0)[..., None]).mean()

        return jax.jit(logits)(state), jax.jit(jax.grad(loss))(state), jax.jit(logits).lower(state).as_text()

    full_logits, full_grads, full_text = run(1)
    blocked_logits, blocked_grads, blocked_text = run(4)
    real = segments != 0
    np.testing.assert_allclose(blocked_logits[real], full_logits[real], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(full_grads), jax.tree.leaves(blocked_grads)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
    # four blocks: four score matmuls per layer instead of one, over shorter key ranges
    assert blocked_text.count("stablehlo.dot_general") == full_text.count("stablehlo.dot_general") + 2 * 3
