"""Model structure: the layer scan keeps compile cost flat in depth; remat and dtype options."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmodel.attention as attention_module
from jaxmodel import ModelConfig, CausalLM
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import ALL_TARGETS, LoraConfig, apply_lora, target_linears

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def lowered_text(layers: int, remat: str = "none") -> str:
    config = dataclasses.replace(CONFIG, num_hidden_layers=layers)
    model = CausalLM(config, remat=remat, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, ids):
        return nnx.merge(graphdef, state)(ids).mean()

    ids = jnp.zeros((2, 16), jnp.int32)
    return jax.jit(jax.grad(loss)).lower(state, ids).as_text()


@pytest.mark.slow
def test_program_size_does_not_grow_with_depth():
    shallow, deep = lowered_text(2), lowered_text(30)
    assert len(deep.splitlines()) == len(shallow.splitlines())  # the same program; only stacked shapes differ
    assert deep.count("stablehlo.dot_general") == shallow.count("stablehlo.dot_general")
    assert "stablehlo.while" in deep


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_policies_keep_the_numbers(remat):
    model = CausalLM(CONFIG, rngs=nnx.Rngs(1))
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
    remat_model = CausalLM(CONFIG, remat=remat, rngs=nnx.Rngs(1))
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(ids).mean())(nnx.state(remat_model)))
    assert "remat" not in jaxpr  # the plain model's graphdef
    graphdef_remat, state_remat = nnx.split(remat_model)
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef_remat, s)(ids).mean())(state_remat))
    assert "remat" in jaxpr


def test_unknown_remat_policy_is_rejected():
    with pytest.raises(ValueError, match="remat must be one of"):
        CausalLM(CONFIG, remat="sometimes", rngs=nnx.Rngs(0))


def test_unknown_attention_is_rejected():
    expected = f"attention must be one of {list(attention_module.ATTENTION_IMPLS)}, got 'flash'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        CausalLM(CONFIG, attention="flash", rngs=nnx.Rngs(0))
    model = CausalLM(CONFIG, rngs=nnx.Rngs(0))
    model.attention = "flash"  # set after construction: refused when called
    with pytest.raises(ValueError, match="attention must be one of"):
        model(jnp.zeros((1, 4), jnp.int32))


def packed_and_padded_batch(t: int):
    """Two rows: two documents with positions restarting, then padding marked in both segment_ids and
    attention_mask; left padding marked only in attention_mask (the model combines them)."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, t)), jnp.int32)
    segments = np.ones((2, t), np.int32)
    segments[0, t // 3:] = 2
    segments[0, -5:] = 0
    segments[1, t // 2:] = 2
    attention_mask = (segments != 0).astype(np.int32)
    attention_mask[1, :4] = 0
    positions = np.zeros((2, t), np.int32)
    for row in range(2):
        for doc in (1, 2):
            in_doc = segments[row] == doc
            positions[row, in_doc] = np.arange(in_doc.sum())
    real = (segments != 0) & (attention_mask != 0)
    return ids, jnp.asarray(segments), jnp.asarray(attention_mask), jnp.asarray(positions), real


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_blockwise_attention_keeps_logits_and_lora_gradients(monkeypatch, remat):
    """attention="blockwise" against "xla" on packed documents with padding, blocks smaller than the
    sequence: logits of real tokens and LoRA gradients of a loss over real tokens equal within 1e-5 of
    the largest entry."""
    monkeypatch.setattr(attention_module, "BLOCK_Q", 8)
    monkeypatch.setattr(attention_module, "BLOCK_KV", 16)
    t = 45
    ids, segments, attention_mask, positions, real = packed_and_padded_batch(t)
    model = apply_lora(CausalLM(CONFIG, rngs=nnx.Rngs(2)), LoraConfig(), rngs=nnx.Rngs(3))
    for i, (_, linear) in enumerate(target_linears(model, ALL_TARGETS)):  # B = 0 would leave A's gradient 0
        linear.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(i), linear.lora_b[...].shape))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, t, 64)), jnp.float32) * real[..., None]

    def logits(lora, impl):
        m = nnx.merge(graphdef, lora, rest)
        m.attention, m.remat = impl, remat
        return m(ids, positions=positions, segment_ids=segments, attention_mask=attention_mask)

    def run(impl):
        grads = jax.jit(jax.grad(lambda lora: (logits(lora, impl) * weights).sum()))(lora)
        return np.asarray(jax.jit(logits, static_argnums=1)(lora, impl)), jax.tree.leaves(grads)

    xla_logits, xla_grads = run("xla")
    block_logits, block_grads = run("blockwise")
    scale = np.abs(xla_logits[real]).max()
    np.testing.assert_allclose(block_logits[real], xla_logits[real], rtol=1e-5, atol=1e-5 * scale)
    grad_scale = max(float(np.abs(g).max()) for g in xla_grads)
    assert grad_scale > 0 and len(xla_grads) == 14  # lora_a, lora_b of 7 targets
    for got, want in zip(block_grads, xla_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * grad_scale)


def test_blockwise_attention_builds_no_sequence_by_sequence_array(monkeypatch):
    """No `[.., t, .., t]` array (the dense mask, the scores) anywhere in the blockwise model's gradient."""
    monkeypatch.setattr(attention_module, "BLOCK_Q", 8)
    monkeypatch.setattr(attention_module, "BLOCK_KV", 16)
    t = 45
    ids, segments, attention_mask, positions, _ = packed_and_padded_batch(t)
    graphdef, state = nnx.split(CausalLM(CONFIG, attention="blockwise", remat="dots", rngs=nnx.Rngs(0)))

    def loss(state):
        return nnx.merge(graphdef, state)(ids, positions=positions, segment_ids=segments,
                                          attention_mask=attention_mask).sum()

    shapes = re.findall(r"\[([0-9,]+)\]", str(jax.make_jaxpr(jax.grad(loss))(state)))
    assert shapes and not [s for s in shapes if s.split(",").count(str(t)) >= 2]
    graphdef_xla, _ = nnx.split(CausalLM(CONFIG, rngs=nnx.Rngs(0)))  # the check sees the plain path's
    shapes = re.findall(r"\[([0-9,]+)\]", str(jax.make_jaxpr(jax.grad(
        lambda s: nnx.merge(graphdef_xla, s)(ids, segment_ids=segments).sum()))(state)))
    assert [s for s in shapes if s.split(",").count(str(t)) >= 2]


def test_bf16_compute_with_f32_params_returns_f32_logits():
    model = CausalLM(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert model.layers.mlp.up_proj.weight[...].dtype == jnp.float32
    assert model.layers.mlp.up_proj.weight[...].shape == (2, 48, 32)
    logits = model(jnp.zeros((1, 5), jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (1, 5, 64)


def test_bf16_weight_stacks_are_never_converted_whole():
    """The layer scan slices each frozen bf16 weight stack as its bits: XLA:CPU would otherwise run the bf16
    dynamic-slice in float32 and convert the whole [layers, out, in] stack at every step (the compiled LoRA
    gradient holds no float32 array of a stack's shape)."""
    config = dataclasses.replace(CONFIG, num_hidden_layers=3)
    model = CausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat="dots", rngs=nnx.Rngs(0))
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("q_proj", "up_proj")), rngs=nnx.Rngs(1))
    graphdef, lora, base = nnx.split(model, LoRAParam, ...)
    ids = jnp.zeros((2, 16), jnp.int32)
    text = jax.jit(jax.grad(lambda lora: nnx.merge(graphdef, lora, base)(ids).mean())).lower(lora).compile().as_text()
    stacks = {f"f32[3,{o},{i}]" for o, i in ((32, 32), (16, 32), (32, 32), (48, 32), (32, 48))}
    assert "bf16[3,48,32]" in text or "u16[3,48,32]" in text  # the stack is there, in 16 bits
    assert not [s for s in stacks if s in text]


@pytest.mark.slow
def test_causal_query_blocks_keep_the_numbers(monkeypatch):
    """Attention without a cache skips the keys after each query block; logits and gradients must equal
    those of full attention, with packed documents and padding in the row."""
    t = attention_module.CAUSAL_BLOCKS * attention_module.CAUSAL_BLOCK_MIN
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, t)), jnp.int32)
    segments = np.ones((2, t), np.int32)
    segments[0, t // 3:] = 2  # a second document starting inside a query block
    segments[1, -7:] = 0  # padding at the end
    positions = np.where(segments[0] == 2, np.arange(t) - t // 3, np.arange(t))[None].repeat(2, 0)
    model = CausalLM(CONFIG, rngs=nnx.Rngs(2))
    graphdef, state = nnx.split(model)

    def run(blocks):
        monkeypatch.setattr(attention_module, "CAUSAL_BLOCKS", blocks)

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


def bf16_ulps_from_exact(ours, exact: np.ndarray) -> float:
    """The largest |ours - exact| in units of bf16's spacing at `exact` (a value rounded once is within 0.5)."""
    ours = np.asarray(jnp.asarray(ours, jnp.float32), np.float64)
    spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - 7)
    return float(np.max(np.abs(ours - exact) / spacing))


def test_bf16_swiglu_is_the_float32_product_rounded_once():
    """silu(gate) * up of bf16 projections in float32, rounded once (within half a bf16 spacing of the exact value,
    where rounding silu's output first is off by up to a whole one): XLA:CPU runs each bf16 operation between two
    conversions, in the forward pass, its recomputation under remat and the backward pass."""
    from jaxmodel.layers import swiglu

    rng = np.random.default_rng(0)
    gate, up = (jnp.asarray(rng.normal(size=(256, 256)) * 3, jnp.bfloat16) for _ in range(2))
    g, u = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (gate, up))
    ours = swiglu(gate, up)
    assert ours.dtype == jnp.bfloat16
    assert bf16_ulps_from_exact(ours, g / (1 + np.exp(-g)) * u) <= 0.501
    np.testing.assert_array_equal(swiglu(gate.astype(jnp.float32), up.astype(jnp.float32)),
                                  jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32))


def test_bf16_rmsnorm_scales_in_float32_and_rounds_once():
    """transformers' LlamaRMSNorm rounds the normalised value to the input dtype and then the product with the
    weight; here the product is computed in float32 and rounded once (within half a bf16 spacing of the exact)."""
    from jaxmodel.layers import RMSNorm

    rng = np.random.default_rng(1)
    norm = RMSNorm(512, eps=1e-5, param_dtype=jnp.bfloat16)
    norm.weight.set_value(jnp.asarray(rng.normal(size=512), jnp.bfloat16))
    x = jnp.asarray(rng.normal(size=(128, 512)), jnp.bfloat16)
    ours = norm(x)
    assert ours.dtype == jnp.bfloat16
    x64, w64 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, norm.weight[...]))
    exact = w64 * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-5)
    assert bf16_ulps_from_exact(ours, exact) <= 0.501
