"""The LM head: its LoRA adapter counts (as PEFT's on lm_head does), and the hidden-state / head split
the chunked loss uses gives the model's logits."""

import pytest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodel import ModelConfig, CausalLM
from jaxmodel.lora import LoraConfig, apply_lora

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.mark.slow
def test_lm_head_adapter_equals_merged_weight():
    model = CausalLM(CONFIG, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    plain = np.asarray(model(ids))
    lora = LoraConfig(rank=4, alpha=8.0, targets=("lm_head",))
    apply_lora(model, lora, rngs=nnx.Rngs(1))
    head = model.lm_head
    head.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(2), head.lora_b[...].shape))
    adapted = np.asarray(model(ids))
    assert np.abs(adapted - plain).max() > 1e-2
    a, b = np.asarray(head.lora_a[...]), np.asarray(head.lora_b[...])
    head.weight.set_value(head.weight[...] + lora.scale * (a @ b).T)
    head.lora_a, head.lora_b = None, None
    np.testing.assert_allclose(adapted, np.asarray(model(ids)), atol=1e-5 * np.abs(adapted).max())


@pytest.mark.slow
def test_head_of_hidden_states_is_the_forward():
    model = CausalLM(CONFIG, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)), jnp.int32)
    assert model.sequence_order(12) is None
    np.testing.assert_array_equal(np.asarray(model.head(model.hidden_states(ids))), np.asarray(model(ids)))
