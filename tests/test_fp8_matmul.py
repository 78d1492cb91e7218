"""Matmuls in FP8 against an fp8 base (jaxmodel.fp8_matmul): the products of the weights' own codes with the
activations quantized per 1 x block tile, equal to an independent numpy computation of that formula, within the
documented bound of the dequantized path, in e4m3fn (H100, H200) and e4m3fnuz (MI300X) alike, and a model that takes
the option computes its loss and LoRA gradients close to the dequantized one's."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxmodel import CausalLM, ModelConfig
from jaxmodel.fp8_matmul import FORMATS, activation_error_bound, fp8_matmul, fp8_max, quantize_tiles
from jaxmodel.layers import LoRAParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.model import quantize_model
from jaxmodel import layers as layers_module, moe as moe_module
from jaxmodel.moe import GroupedLinear, group_rows
from jaxmodel.quantization import Quantization, dequantize, dequantize_numpy, quantize
from test_fp8 import DEEPSEEK
from tiny_moe import DEEPSEEK_MESH_TARGETS


def weights(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-2, 2, shape)).astype(np.float32)


def activations(shape, seed=1) -> np.ndarray:
    """Normal values over six orders of magnitude, with an all-zero tile and values in e4m3's subnormal range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, shape)
    x[..., 0, :4] = 0
    x[..., 1, 0] = 1e4  # the tile's other values fall to subnormal codes or zero
    return x.astype(np.float32)


def numpy_fp8_product(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, block: int, fmt: str) -> np.ndarray:
    """The module docstring's formula, by ml_dtypes' casts in float64: the activations' tiles rounded to `fmt`, the
    weights' codes as e4m3fn values (e4m3fnuz's bits mean half of them: the scales doubled), summed per block."""
    n, i = x.shape
    tiles = -(-i // block)
    xp = np.zeros((n, tiles * block))
    xp[:, :i] = x
    xt = xp.reshape(n, tiles, block)
    amax = np.abs(xt).max(axis=-1).astype(np.float32)
    sx = np.where(amax > 0, amax / fp8_max(fmt), np.float32(1)).astype(np.float32)
    qx = np.clip(xt.astype(np.float32) / sx[..., None], -fp8_max(fmt), fp8_max(fmt)).astype(FORMATS[fmt])
    w = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    wp = np.zeros((w.shape[0], tiles * block))
    wp[:, :i] = w
    sw = np.repeat(scales.astype(np.float64), block, axis=0)[: w.shape[0]]
    products = np.einsum("nkb,okb->nko", qx.astype(np.float64), wp.reshape(-1, tiles, block))
    return np.einsum("nko,nk,ok->no", products, sx.astype(np.float64), sw)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("n, out, i, block", [(5, 12, 40, 8), (3, 9, 20, 4), (4, 16, 96, 4)])
def test_fp8_products_are_the_formula_and_within_the_bound_of_the_dequantized_path(fmt, n, out, i, block):
    """Partial blocks at both edges of the weight, and (96 / 4 = 24 blocks) several chunks of the input dimension.
    The reference multiplies the e4m3fn codes' own values: in e4m3fnuz, equal products say that the converted codes
    (`fnuz_codes`, inside the step) kept every weight's value."""
    quantization = Quantization("fp8", block)
    codes, scales = quantize(weights((out, i)), quantization)
    x = activations((n, i))
    got = np.asarray(jax.jit(fp8_matmul, static_argnums=3)(
        jnp.asarray(x), jnp.asarray(codes.view(np.uint8)), jnp.asarray(scales),
        dataclasses.replace(quantization, matmul=fmt)), np.float64)
    want = numpy_fp8_product(x, codes, scales, block, fmt)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    w = dequantize_numpy(codes, scales, quantization).astype(np.float64)
    plain = x.astype(np.float64) @ w.T
    bound = activation_error_bound(x.astype(np.float64), block, fmt) @ np.abs(w).T
    assert np.all(np.abs(got - plain) <= bound * (1 + 1e-5) + 1e-6 * np.abs(plain).max())
    assert np.abs(got - plain).max() > 0  # the activations were rounded: a bound that could fail


def test_activation_tiles_are_rounded_to_nearest_within_their_scale():
    x = jnp.asarray(activations((2, 3, 16)))
    for fmt in FORMATS:
        codes, scales = quantize_tiles(x, 8, fmt)
        assert codes.shape == (2, 3, 2, 8) and codes.dtype == FORMATS[fmt] and scales.shape == (2, 3, 2)
        back = np.asarray(codes, np.float64) * np.asarray(scales, np.float64)[..., None]
        error = np.abs(back.reshape(2, 3, 16) - np.asarray(x, np.float64))
        assert np.all(error <= activation_error_bound(np.asarray(x, np.float64), 8, fmt) * (1 + 1e-6))
        assert np.abs(np.asarray(codes, np.float64)).max() == fp8_max(fmt)  # each tile's amax at the format's top


def test_an_fp8_matmul_on_a_base_of_another_scheme_is_refused():
    with pytest.raises(ValueError, match="on an fp8 base"):
        Quantization("nf4", 64, matmul="e4m3fn")
    with pytest.raises(ValueError, match="expected one of e4m3fn, e4m3fnuz"):
        Quantization("fp8", 128, matmul="e5m2")
    assert Quantization("fp8", 128, matmul="e4m3fnuz").to_json() == {"scheme": "fp8", "block": 128}


LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["e4m3fn"])  # e4m3fnuz: the DeepSeek case below
def test_a_model_multiplying_in_fp8_is_the_dequantized_model_on_rounded_activations(fmt, monkeypatch):
    """The tiny Llama on an fp8 base (blocks of 8), LoRA (random A and B) on every projection: the loss and LoRA
    gradients with FP8 matmuls equal those of the model whose every projection (and expert) multiplies the
    dequantized weight in float32 by the activations rounded as `quantize_tiles` rounds them, their gradient passed
    straight through (the FP8 path's definition, forward and backward, computed apart with jax's own autodiff), and
    differ from the plain dequantized model's."""
    base = CausalLM(ModelConfig.from_hf(LLAMA), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)), jnp.int32)
    _assert_fp8_is_rounded_activations(base, 8, fmt, ids, LoraConfig.targets, monkeypatch)


def _assert_fp8_is_rounded_activations(base, block, fmt, ids, targets, monkeypatch):
    quantization = Quantization("fp8", block, matmul=fmt)
    fp8_loss, fp8_grads = _lora_loss_and_grads(base, quantization, ids, targets)
    plain_loss, _ = _lora_loss_and_grads(base, dataclasses.replace(quantization, matmul=None), ids, targets)

    def rounded(x, quantization):  # the activations as the FP8 path rounds them, their gradient passed through
        q, scale = quantize_tiles(x, quantization.block, quantization.matmul)
        x_rounded = (q.astype(jnp.float32) * scale[..., None]).reshape(*x.shape[:-1], -1)[..., :x.shape[-1]]
        return x + jax.lax.stop_gradient(x_rounded.astype(x.dtype) - x)

    def projection(x, codes, scales, quantization):
        return rounded(x, quantization) @ dequantize(codes, scales, quantization).T

    def experts(x_ai, codes, scales, rows, quantization, dtype, impl, block):
        return moe_module._dequantized_grouped_matmul(rounded(x_ai, quantization), codes, scales, rows,
                                                      dataclasses.replace(quantization, matmul=None), dtype, impl,
                                                      block)

    monkeypatch.setattr(layers_module, "fp8_matmul", projection)
    monkeypatch.setattr(moe_module, "_fp8_grouped_matmul", experts)
    loss, grads = _lora_loss_and_grads(base, quantization, ids, targets)
    np.testing.assert_allclose(float(fp8_loss), float(loss), rtol=1e-6)
    leaves, fp8_leaves = jax.tree.leaves(grads), jax.tree.leaves(fp8_grads)
    assert len(leaves) == len(fp8_leaves) >= 2 * len(targets)  # A and B of each target (of each stack of layers)
    for g, f in zip(leaves, fp8_leaves):
        np.testing.assert_allclose(np.asarray(f), np.asarray(g), rtol=1e-4, atol=1e-5 * float(jnp.abs(g).max()))
    assert fp8_loss != plain_loss


def _lora_loss_and_grads(base, quantization, ids, targets=LoraConfig.targets):
    """The next-token loss and its LoRA gradients of `base` quantized by `quantization`, with random A and B on
    `targets` (the same for every quantization)."""
    model = quantize_model(base, quantization)
    apply_lora(model, LoraConfig(rank=4, alpha=8, targets=targets), rngs=nnx.Rngs(1))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    lora = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape, x.dtype) * 0.1, lora)
    return jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)(graphdef, lora, rest, ids)


def _loss(graphdef, lora, rest, ids):
    logits = nnx.merge(graphdef, lora, rest)(ids)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_the_experts_multiply_each_routed_row_in_fp8_against_its_own_experts_codes(fmt):
    """The routed experts' FP8 path (blocks of rows, each against its expert's codes): each row's output equals that
    row multiplied alone by `fp8_matmul` against its expert's codes and scales (a row's tiles are its own; float32
    sums in another order), in rows
    sorted by expert with partial blocks of rows and an expert that no row reaches; the input's gradient is the
    dequantized path's."""
    experts, i, out = 4, 20, 12
    layer = GroupedLinear(experts, i, out, axes=("embed", "mlp"), layers=None, dtype=jnp.float32,
                          param_dtype=jnp.float32, rngs=nnx.Rngs(0), block=4,
                          quantization=Quantization("fp8", 8, matmul=fmt))
    codes, scales = quantize(weights((experts, out, i)), Quantization("fp8", 8))
    layer.codes.set_value(jnp.asarray(codes.view(np.uint8)))
    layer.scales.set_value(jnp.asarray(scales))
    experts_tk = jnp.asarray([[0, 2], [2, 0], [2, 0], [0, 2], [2, 2], [0, 0], [2, 0]], jnp.int32)  # 1 and 3: none
    rows = group_rows(experts_tk, experts)
    x_ai = jnp.asarray(activations((len(rows.token_a), i)))
    got = np.asarray(layer(x_ai, rows))
    for j, e in enumerate(np.asarray(rows.expert_a)):
        alone = fp8_matmul(x_ai[j:j + 1], layer.codes[...][e], layer.scales[...][e], layer.quantization)
        np.testing.assert_allclose(got[j], np.asarray(alone)[0], rtol=1e-6, atol=1e-6 * np.abs(got[j]).max())
    plain = dataclasses.replace(layer.quantization, matmul=None)
    grad = jax.grad(lambda x: jnp.sum(layer(x, rows) ** 2))(x_ai)
    layer.quantization = plain
    y = layer(x_ai, rows)
    want = jax.vjp(lambda x: layer(x, rows), x_ai)[1](2 * jnp.asarray(got))[0]
    assert not np.array_equal(np.asarray(y), got)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["e4m3fnuz"])  # e4m3fn: the Llama case above
def test_a_deepseek_multiplying_in_fp8_is_the_dequantized_model_on_rounded_activations(fmt, monkeypatch):
    """As the Llama test, on DeepSeek-V3 (latent attention, a dense layer, a shared expert, routed experts: the
    experts' FP8 path too) on an fp8 base of 4 x 4 blocks with partial ones, LoRA on every target."""
    base = CausalLM(ModelConfig.from_hf(DEEPSEEK), rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 40, (2, 7)), jnp.int32)
    _assert_fp8_is_rounded_activations(base, 4, fmt, ids, tuple(DEEPSEEK_MESH_TARGETS.split(",")), monkeypatch)
