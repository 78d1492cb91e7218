"""LoRA adapters: PEFT's forward, initialisation, scaling, targets, dropout, dtypes."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmodel import ModelConfig, CausalLM
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import ALL_TARGETS, LoraConfig, apply_lora, target_linears

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)


def lora_model(**kw) -> CausalLM:
    model = CausalLM(CONFIG, rngs=nnx.Rngs(0))
    return apply_lora(model, LoraConfig(**kw), rngs=nnx.Rngs(1))


@pytest.mark.slow
def test_fresh_adapters_leave_the_output_unchanged_and_init_like_peft():
    plain = CausalLM(CONFIG, rngs=nnx.Rngs(0))(IDS)
    model = lora_model()
    np.testing.assert_array_equal(model(IDS), plain)  # B = 0
    a = model.layers.mlp.down_proj.lora_a[...]
    assert a.shape == (2, 48, 8) and a.dtype == jnp.float32
    bound = 1 / math.sqrt(48)  # kaiming_uniform(a=sqrt(5)) on torch's [r, in]
    assert float(jnp.abs(a).max()) <= bound and float(jnp.abs(a).max()) > 0.8 * bound
    assert {path for path, _ in target_linears(model, ALL_TARGETS)} == {
        f"layers.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.mark.parametrize("rslora, scale", [(False, 16 / 8), (True, 16 / math.sqrt(8))])
def test_forward_is_peft_formula(rslora, scale):
    model = lora_model(rslora=rslora)
    q = model.layers.self_attn.q_proj
    q.lora_b.set_value(jax.random.normal(jax.random.key(2), q.lora_b[...].shape))
    x = jax.random.normal(jax.random.key(3), (3, 5, 32))
    w, a, b = (np.asarray(v[...][0]) for v in (q.weight, q.lora_a, q.lora_b))
    expected = np.asarray(x) @ w.T + scale * (np.asarray(x) @ a) @ b
    graphdef, state = nnx.split(q)  # stacked over layers: run layer 0's slice
    one_layer = nnx.merge(graphdef, jax.tree.map(lambda v: v[0], state))
    np.testing.assert_allclose(np.asarray(one_layer(x)), expected, atol=1e-5)
    assert q.lora_scale == pytest.approx(scale)


def test_subset_of_targets_and_lm_head():
    model = lora_model(targets=("q_proj", "v_proj", "lm_head"))
    lora = nnx.state(model, LoRAParam)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(lora)}
    assert names == {"layers.self_attn.q_proj.lora_a", "layers.self_attn.q_proj.lora_b",
                     "layers.self_attn.v_proj.lora_a", "layers.self_attn.v_proj.lora_b",
                     "lm_head.lora_a", "lm_head.lora_b"}
    tied = CausalLM(ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("not layers of this model (tied embeddings have no lm_head)")):
        apply_lora(tied, LoraConfig(targets=("lm_head",)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("LoRA targets ['gate'] are not layers of this model (a model "
                                                   "without experts has no router or experts)")):
        apply_lora(CausalLM(CONFIG, rngs=nnx.Rngs(0)), LoraConfig(targets=("q_proj", "gate")), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kw, message", [({"rank": 0}, "rank must be a positive integer"),
                                         ({"targets": ("qkv",)}, "LoRA targets ['qkv']"),
                                         ({"dropout": 1.0}, "dropout must be in")])
def test_bad_lora_configs(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LoraConfig(**kw)


@pytest.mark.slow
def test_dropout_touches_only_the_lora_branch_and_only_with_a_key():
    model = lora_model(dropout=0.5)
    plain = model(IDS)
    np.testing.assert_array_equal(model(IDS, dropout_key=jax.random.key(0)), plain)  # B = 0: nothing to drop
    for linear in (m for _, m in target_linears(model, ALL_TARGETS)):
        linear.lora_b.set_value(0.1 * jnp.ones_like(linear.lora_b[...]))
    no_key = model(IDS)
    a, b = model(IDS, dropout_key=jax.random.key(0)), model(IDS, dropout_key=jax.random.key(1))
    assert not np.allclose(a, no_key) and not np.allclose(a, b)
    np.testing.assert_array_equal(a, model(IDS, dropout_key=jax.random.key(0)))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_is_inverted_dropout_of_the_lora_input(p):
    """With a key, a layer computes `x W^T + scale * ((keep * x / (1 - p)) A) B`, where `keep` is the
    Bernoulli(1 - p) mask drawn from that key over the layer's input flattened to `[tokens, in]`; without
    a key it computes the same with nothing dropped."""
    model = lora_model(dropout=p)
    q = model.layers.self_attn.q_proj
    q.lora_b.set_value(jax.random.normal(jax.random.key(2), q.lora_b[...].shape))
    graphdef, state = nnx.split(q)  # stacked over layers: run layer 0's slice
    one_layer = nnx.merge(graphdef, jax.tree.map(lambda v: v[0], state))
    x = jax.random.normal(jax.random.key(3), (3, 5, 32))
    key = jax.random.key(4)
    keep = np.asarray(jax.random.bernoulli(key, 1.0 - p, (3 * 5, 32))).reshape(3, 5, 32)
    assert 0 < keep.mean() < 1
    w, a, b = (np.asarray(v[...][0], np.float64) for v in (q.weight, q.lora_a, q.lora_b))
    x64 = np.asarray(x, np.float64)
    scale = 16 / 8
    dropped = x64 @ w.T + scale * ((keep * x64 / (1 - p)) @ a) @ b
    plain = x64 @ w.T + scale * (x64 @ a) @ b
    for got, expected in ((one_layer(x, key), dropped), (one_layer(x), plain)):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.slow
def test_lora_stays_float32_on_a_bf16_base():
    model = CausalLM(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    apply_lora(model, LoraConfig(), rngs=nnx.Rngs(1))
    assert model.layers.self_attn.q_proj.weight[...].dtype == jnp.bfloat16
    assert model.layers.self_attn.q_proj.lora_a[...].dtype == jnp.float32
    assert model(IDS).dtype == jnp.float32


@pytest.mark.parametrize("rank, expected_b", [
    (8, P(None, "fsdp", "mp")),  # r carries the fsdp split, the output dimension the mp one
    (2, P(None, None, ("mp", "fsdp"))),  # r = 2 cannot be split 4 ways: the output dimension takes both
])
@pytest.mark.slow
def test_lora_b_is_split_over_fsdp_even_when_the_rank_is_not(rank, expected_b):
    from jaxmodel.sharding import partition_spec

    mesh = jax.make_mesh((1, 4, 2), ("dp", "fsdp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = apply_lora(CausalLM(config, rngs=nnx.Rngs(0)), LoraConfig(rank=rank, alpha=16), rngs=nnx.Rngs(1))
    up = model.layers.mlp.up_proj
    spec = partition_spec(up.lora_b.get_metadata()["axes"], up.lora_b[...].shape, mesh)
    assert spec == expected_b
    weight = up.weight
    assert partition_spec(weight.get_metadata()["axes"], weight[...].shape, mesh) == P(None, "mp", "fsdp")
    # A [in, r] of a layer whose input is on mp (down_proj) takes fsdp on its input dimension
    down_a = model.layers.mlp.down_proj.lora_a
    assert partition_spec(down_a.get_metadata()["axes"], down_a[...].shape, mesh) == P(None, ("mp", "fsdp"), None)


def test_experts_and_router_take_no_lora_dropout_as_peft_gives_them_none():
    with pytest.raises(ValueError, match="LoRA dropout 0.1 on experts.down_proj: PEFT adapts the experts and the "
                                         "router without dropout"):
        LoraConfig(targets=("q_proj", "experts.down_proj"), dropout=0.1)
    with pytest.raises(ValueError, match="LoRA dropout 0.1 on gate: "):
        LoraConfig(targets=("q_proj", "gate"), dropout=0.1)
    assert LoraConfig(targets=("q_proj",), dropout=0.1).dropout == 0.1
