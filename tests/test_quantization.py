"""Quantized frozen weights: NF4 equal to bitsandbytes byte for byte, int8 against its definition, and a
quantized model computing exactly "dequantize, then the usual layer"."""

import bitsandbytes.functional as bnb
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxmodel import ModelConfig, CausalLM
from jaxmodel.layers import Linear, LoRAParam, QuantizedParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.model import quantize_model
from jaxmodel.quantization import NF4, Quantization, dequantize, dequantize_numpy, quantize
from jaxmodel.sharding import partition_spec

# QLoRA (arXiv:2305.14314), Appendix E: the NF4 data type, as published.
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
IDS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def bnb_nf4(w: np.ndarray, block: int, dtype=torch.float32):
    """bitsandbytes' packed codes (flat bytes), absmax and dequantized weight (float32) of `w`."""
    t = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(dtype)
    packed, state = bnb.quantize_4bit(t, quant_type="nf4", blocksize=block)
    deq = bnb.dequantize_4bit(packed, state, quant_type="nf4")
    return packed.numpy().reshape(-1), state.absmax.numpy(), deq


def as_bits(x) -> np.ndarray:
    """Bit patterns, so that -0.0 != 0.0 and bf16 compare exactly."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_nf4_equals_bitsandbytes(w: np.ndarray, block: int, dtype=torch.float32):
    """Codes byte-equal, absmax equal and dequantized values bit-equal (numpy and JAX, in `dtype`)."""
    quantization = Quantization("nf4", block)
    source = torch.from_numpy(np.ascontiguousarray(w, np.float32)).to(dtype).float().numpy()  # the input as bnb sees it
    codes, scales = quantize(source, quantization)
    want_codes, want_absmax, want_deq = bnb_nf4(w, block, dtype)
    assert codes.dtype == np.uint8 and scales.dtype == np.float32
    np.testing.assert_array_equal(codes.reshape(-1), want_codes)
    np.testing.assert_array_equal(as_bits(scales.reshape(-1)), as_bits(want_absmax))
    out = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]
    want = want_deq.view(torch.int16).numpy() if dtype == torch.bfloat16 else as_bits(want_deq.numpy())
    ours = dequantize_numpy(codes, scales, quantization).astype(out)
    np.testing.assert_array_equal(as_bits(ours).reshape(w.shape), want.reshape(w.shape).view(as_bits(ours).dtype))
    jax_ours = dequantize(jnp.asarray(codes), jnp.asarray(scales), quantization, out)
    np.testing.assert_array_equal(as_bits(jax_ours), as_bits(ours))


def test_nf4_code_book_is_the_published_one_and_bitsandbytes():
    np.testing.assert_array_equal(NF4, np.array(PUBLISHED_NF4, np.float32))
    np.testing.assert_array_equal(NF4, bnb.get_4bit_type("nf4", device="cpu").numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, block", [((48, 256), 64), ((3, 16, 128), 64), ((8, 64), 32), ((4, 512), 128)])
def test_nf4_equals_bitsandbytes_on_random_weights(shape, block, dtype):
    rng = np.random.default_rng(hash((shape, block)) % 2**32)
    w = rng.standard_normal(shape).astype(np.float32) * rng.choice([0.02, 1.0, 30.0])
    assert_nf4_equals_bitsandbytes(w, block, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_edge_cases_equal_bitsandbytes(dtype):
    block = 64
    rng = np.random.default_rng(1)
    rows = [np.zeros(block), np.full(block, -0.0), rng.standard_normal(block) * 1e-3,
            rng.standard_normal(block) * 1e-30, rng.standard_normal(block) * 1e-40]  # ..., tiny, subnormal
    huge = rng.standard_normal(block) * 1e-3
    huge[17] = 3e38  # one value near float32's largest: everything else rounds to code 0
    rows.append(huge)
    mixed = rng.standard_normal(block)
    mixed[::2] = -0.0
    rows.append(mixed)
    # values exactly at the float32 midpoints of neighbouring codes (absmax 1 and 2: scaling is exact), and
    # one float32 step either side of each: bitsandbytes gives a tie the lower code
    mid = (NF4[:-1] + NF4[1:]) / np.float32(2)
    for absmax in (1.0, 2.0):
        for values in (mid, np.nextafter(mid, np.float32(-2)), np.nextafter(mid, np.float32(2))):
            row = np.zeros(block, np.float32)
            row[0] = absmax
            row[1:1 + len(values)] = values * np.float32(absmax)
            rows.append(row)
    rows += order_sensitive_rows(block)
    w = np.stack(rows).astype(np.float32)
    if dtype == torch.bfloat16:  # keep only rows bf16 holds exactly (midpoints are not bf16 numbers)
        w = w[[np.array_equal(r.astype(ml_dtypes.bfloat16).astype(np.float32), r) for r in w]]
    assert_nf4_equals_bitsandbytes(w, block, dtype)


def order_sensitive_rows(block: int) -> list[np.ndarray]:
    """Per midpoint, a block (absmax a, value x) where x * (1 / a) and x / a round to different sides of the
    midpoint: only bitsandbytes' order of operations gives its code."""
    mid = (NF4[:-1] + NF4[1:]) / np.float32(2)
    a = np.random.default_rng(0).uniform(1, 2, 20000).astype(np.float32)
    rows = []
    for m in mid:
        for x in ((m * a).astype(np.float32), np.nextafter((m * a).astype(np.float32), np.float32(9)),
                  np.nextafter((m * a).astype(np.float32), np.float32(-9))):
            differ = np.nonzero(np.searchsorted(mid, x * (np.float32(1) / a)) != np.searchsorted(mid, x / a))[0]
            if differ.size:
                row = np.zeros(block, np.float32)
                row[0], row[1] = a[differ[0]], x[differ[0]]  # |x| < a: a is the absmax
                rows.append(row)
                break
    assert len(rows) >= 12
    return rows


def test_nf4_ties_take_the_lower_code():
    quantization = Quantization("nf4", 4)
    m = (NF4[7] + NF4[8]) / np.float32(2)  # between 0 and 0.0796
    codes, _ = quantize(np.array([[1.0, m, -1.0, (NF4[0] + NF4[1]) / 2]], np.float32), quantization)
    assert codes.reshape(-1).tolist() == [(15 << 4) | 7, (0 << 4) | 0]


def int8_reference(w: np.ndarray, block: int):
    """int8 from its definition, block by block and value by value in float32 scalars."""
    flat = w.astype(np.float32).reshape(-1)
    codes, scales = [], []
    for start in range(0, flat.size, block):
        values = flat[start:start + block]
        absmax = max(abs(v) for v in values)  # a float32 scalar
        scales.append(absmax)
        factor = np.float32(127) / absmax if absmax else None  # float32 division
        codes += [0 if factor is None else int(np.rint(v * factor)) for v in values]
    step = np.float32(7.874015718698502e-3)  # bitsandbytes' 1/127
    deq = [np.float32(np.float32(c) * scales[i // block]) * step for i, c in enumerate(codes)]
    return np.array(codes, np.int8), np.array(scales, np.float32), np.array(deq, np.float32)


def test_int8_equals_its_definition():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = -0.0
    w[2, 5] = 1e30  # one huge value
    w[3, :32] = np.arange(-16, 16) / np.float32(2)  # absmax 127: x * 1 lands on halves, rounded to even
    w[3, 0] = 127.0
    quantization = Quantization("int8", 32)
    codes, scales = quantize(w, quantization)
    want_codes, want_scales, want_deq = int8_reference(w, 32)
    assert codes.shape == (6, 3, 32) and codes.dtype == np.int8 and scales.shape == (6, 3)
    np.testing.assert_array_equal(codes.reshape(-1), want_codes)
    np.testing.assert_array_equal(scales.reshape(-1), want_scales)
    deq = dequantize_numpy(codes, scales, quantization)
    np.testing.assert_array_equal(as_bits(deq.reshape(-1)), as_bits(want_deq))
    np.testing.assert_array_equal(as_bits(dequantize(jnp.asarray(codes), jnp.asarray(scales), quantization)),
                                  as_bits(deq))
    assert np.abs(codes).max() == 127
    assert codes[3, 0, :5].tolist() == [127, -8, -7, -6, -6]  # -7.5 -> -8, -6.5 -> -6: halves to even


def test_bad_quantization_settings():
    with pytest.raises(ValueError, match="scheme"):
        Quantization("int4")
    with pytest.raises(ValueError, match="even"):
        Quantization("nf4", 33)
    with pytest.raises(ValueError, match="divide the input dimension 48"):
        Quantization("nf4", 32).shapes((16, 48))
    with pytest.raises(ValueError, match="NaN"):
        quantize(np.array([[np.nan, 1.0]], np.float32), Quantization("int8", 2))


# --- the model ---------------------------------------------------------------------------------------------

def dequantized_reference(quantized: CausalLM) -> CausalLM:
    """An unquantized model of `quantized`'s config holding its weights: each quantized one dequantized (numpy), the
    others as they are, in the parameter dtype of its embedding."""
    param_dtype = quantized.embed_tokens.weight[...].dtype
    reference = CausalLM(quantized.config, dtype=quantized.dtype, param_dtype=param_dtype, rngs=nnx.Rngs(9))
    held = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(nnx.state(quantized, nnx.Param))}
    state = nnx.state(reference, nnx.Param)
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if name in held:
            var.set_value(held[name])
            continue
        module = name.removesuffix(".weight")
        w = dequantize_numpy(np.asarray(held[module + ".codes"]), np.asarray(held[module + ".scales"]),
                             quantized.quantization)
        assert w.shape == var.shape
        var.set_value(jnp.asarray(w, param_dtype))
    nnx.update(reference, state)
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("scheme, block", [("nf4", 8), ("nf4", 16), ("int8", 16)])
def test_quantized_model_is_the_dequantized_model(scheme, block):
    plain = CausalLM(CONFIG, rngs=nnx.Rngs(0))
    model = quantize_model(plain, Quantization(scheme, block))
    state = nnx.state(model, nnx.Param)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(state)}
    assert {n for n in names if n.endswith((".codes", ".scales"))} == {
        f"layers.{p}.{part}" for p in PROJECTIONS for part in ("codes", "scales")}
    assert not any(n.startswith("layers.") and n.endswith("proj.weight") for n in names)
    assert "lm_head.weight" in names and "embed_tokens.weight" in names
    q = model.layers.mlp.down_proj
    assert q.codes[...].shape == (3, 32, 48 // block, block // 2 if scheme == "nf4" else block)
    assert q.scales[...].shape == (3, 32, 48 // block) and q.scales[...].dtype == jnp.float32
    reference = dequantized_reference(model)
    got, want = np.asarray(model(IDS)), np.asarray(reference(IDS))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    assert np.abs(got - np.asarray(plain(IDS))).max() > 1e-4  # quantization did change the weights


@pytest.mark.slow
def test_quantized_model_with_lora_and_bf16_compute_is_the_dequantized_model():
    model = quantize_model(CausalLM(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                            rngs=nnx.Rngs(0)), Quantization("nf4", 16))
    reference = dequantized_reference(model)  # the bf16 path on bf16 dequantized weights
    for m in (model, reference):
        apply_lora(m, LoraConfig(rank=4), rngs=nnx.Rngs(1))
        for path in PROJECTIONS:
            linear = m.layers
            for part in path.split("."):
                linear = getattr(linear, part)
            linear.lora_b.set_value(0.1 * jax.random.normal(jax.random.key(3), linear.lora_b[...].shape))
            assert linear.lora_a[...].dtype == jnp.float32

    def grads(m):
        graphdef, lora, rest = nnx.split(m, LoRAParam, ...)

        def loss(lora):
            return jnp.mean(nnx.merge(graphdef, lora, rest)(IDS) ** 2)
        return jax.jit(jax.value_and_grad(loss))(lora)

    (loss_q, grads_q), (loss_r, grads_r) = grads(model), grads(reference)
    assert float(loss_q) == float(loss_r)
    for g_q, g_r in zip(jax.tree.leaves(grads_q), jax.tree.leaves(grads_r)):
        np.testing.assert_allclose(np.asarray(g_q), np.asarray(g_r), rtol=0, atol=1e-6 * np.abs(g_r).max())
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_q)) > 0


@pytest.mark.slow
def test_quantized_linear_computes_dequantize_then_matmul():
    layer = Linear(64, 24, axes=("heads", "embed"), quantization=Quantization("nf4", 16), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 64))
    w = dequantize_numpy(np.asarray(layer.codes[...]), np.asarray(layer.scales[...]), layer.quantization)
    np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(x) @ w.T, rtol=1e-6, atol=1e-6)
    assert isinstance(layer.codes, QuantizedParam) and layer.weight is None
    assert layer.weight_shape == (24, 64) and layer.weight_axes == ("heads", "embed")
    with pytest.raises(ValueError, match="does not divide the input dimension 48"):
        Linear(48, 8, axes=("heads", "embed"), quantization=Quantization("nf4", 32), rngs=nnx.Rngs(0))


def test_codes_and_scales_shard_like_the_weight_at_whole_blocks():
    """fsdp splits the input dimension by blocks; when the blocks do not divide, neither array is split."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 4, 1, 2), ("dp", "fsdp", "cp", "mp"))
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = nnx.eval_shape(lambda: CausalLM(config, quantization=Quantization("nf4", 16),
                                                    rngs=nnx.Rngs(0)))

    def specs(linear):
        return tuple(partition_spec(v.get_metadata()["axes"], v.shape, mesh) for v in (linear.codes, linear.scales))

    # q_proj [64 out, 64 in]: 4 blocks of the input over fsdp=4, heads over mp
    assert specs(model.layers.self_attn.q_proj) == (P(None, "mp", "fsdp", None), P(None, "mp", "fsdp"))
    # down_proj [64 out (embed), 96 in (mlp)]: 6 blocks of the input over mp=2, the output over fsdp
    assert specs(model.layers.mlp.down_proj) == (P(None, "fsdp", "mp", None), P(None, "fsdp", "mp"))
    model = nnx.eval_shape(lambda: CausalLM(config, quantization=Quantization("nf4", 32),
                                                    rngs=nnx.Rngs(0)))
    # 2 blocks of the input do not divide over fsdp=4: codes and scales both keep it whole
    assert specs(model.layers.self_attn.q_proj) == (P(None, "mp", None, None), P(None, "mp", None))


def grad_temp_bytes(model: CausalLM) -> int:
    """Compiled temporaries of a LoRA gradient through `model` (remat "none")."""
    apply_lora(model, LoraConfig(rank=4), rngs=nnx.Rngs(1))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)
    ids = jnp.zeros((1, 16), jnp.int32)

    def loss(lora, rest):
        return jnp.mean(nnx.merge(graphdef, lora, rest)(ids) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(lora, rest).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_backward_does_not_keep_every_layers_dequantized_weights():
    config = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    plain = grad_temp_bytes(CausalLM(config, rngs=nnx.Rngs(0)))
    quantized = grad_temp_bytes(CausalLM(config, quantization=Quantization("nf4", 64), rngs=nnx.Rngs(0)))
    d, f, kv = 128, 256, 2 * 32
    layer_weights = 4 * (d * d * 2 + 2 * d * kv + 3 * d * f)  # float32 bytes of one layer's projections
    # kept for the backward pass, the dequantized weights of all 4 layers would add 4 x layer_weights
    assert quantized <= plain + 2 * layer_weights, (plain, quantized, layer_weights)
