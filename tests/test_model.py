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
