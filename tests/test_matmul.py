"""Contractions accumulated in float32 (jaxmodel/matmul.py): their gradients are those of the plain
contraction (bit for bit in float32, within bf16 rounding in bf16), and in bf16 every matmul of a layer's
forward and backward pass takes bf16 operands with a float32 result, the one bf16 dot XLA:CPU keeps in bf16
rather than running it in float32 on converted operands."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodel import LlamaConfig, LlamaForCausalLM
from jaxmodel.attention import xla_attention
from jaxmodel.layers import Linear, LoRAParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.matmul import DOT_POLICIES, einsum_acc32

# (spec, a's shape, b's shape): Linear's projection, attention's two matmuls, the LM head
CONTRACTIONS = [
    ("ni,oi->no", (24, 16), (12, 16)),
    ("bkqh,bksh->bkqs", (2, 3, 20, 8), (2, 3, 12, 8)),
    ("bkqs,bksh->bkqh", (2, 3, 20, 12), (2, 3, 12, 8)),
    ("...d,vd->...v", (2, 5, 16), (40, 16)),
]
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _operands(spec, a_shape, b_shape, dtype, seed=0):
    """Drawn operands and a drawn cotangent `c` of the output (float32)."""
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(a_shape), dtype)
    b = jnp.asarray(rng.standard_normal(b_shape), dtype)
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, a, b)).shape
    return a, b, jnp.asarray(rng.standard_normal(out_shape), jnp.float32)


def _grads(contract, a, b, c):
    """Gradients of `sum(contract(a, b) * c)`: the cotangent of the contraction's output is `c`."""
    return jax.jit(jax.grad(lambda a, b: jnp.sum(contract(a, b).astype(jnp.float32) * c), (0, 1)))(a, b)


@pytest.mark.parametrize("spec, a_shape, b_shape", CONTRACTIONS)
def test_float32_values_and_gradients_equal_plain_einsum_bit_for_bit(spec, a_shape, b_shape):
    a, b, c = _operands(spec, a_shape, b_shape, jnp.float32)
    plain = lambda a, b: jnp.einsum(spec, a, b)
    ours = lambda a, b: einsum_acc32(spec, a, b)
    np.testing.assert_array_equal(jax.jit(ours)(a, b), jax.jit(plain)(a, b))
    for got, want in zip(_grads(ours, a, b, c), _grads(plain, a, b, c)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("spec, a_shape, b_shape", CONTRACTIONS)
def test_bfloat16_gradients_equal_autodiff_within_bfloat16_rounding(spec, a_shape, b_shape):
    """Autodiff of the float32-accumulating einsum contracts the float32 cotangent; ours rounds it to bf16
    first. Per entry that costs at most one rounding of each product (u |c| |b| summed) plus the two
    roundings of the results to bf16 (u |grad| each): a bound of 3u (|c| |b|), taken as 4u."""
    a, b, c = _operands(spec, a_shape, b_shape, jnp.bfloat16)
    plain = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    ours = lambda a, b: einsum_acc32(spec, a, b)
    np.testing.assert_array_equal(jax.jit(ours)(a, b), jax.jit(plain)(a, b))
    # the same gradients taken in float32 on magnitudes: |c| contracted with |b| (and |a|)
    magnitude = _grads(lambda x, y: jnp.einsum(spec, x, y), jnp.abs(a).astype(jnp.float32),
                       jnp.abs(b).astype(jnp.float32), jnp.abs(c))
    for got, want, bound in zip(_grads(ours, a, b, c), _grads(plain, a, b, c), magnitude):
        assert got.dtype == want.dtype == jnp.bfloat16
        error = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
        assert np.all(error <= 4 * BF16_UNIT_ROUNDOFF * np.asarray(bound)), error.max()


def test_an_axis_in_one_operand_only_is_refused():
    with pytest.raises(ValueError, match="each axis of an operand"):
        einsum_acc32("ij,jk->k", jnp.ones((2, 3)), jnp.ones((3, 4)))


# ---- the compiled matmuls of bf16 layers ----------------------------------------------------------------

_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")


def _dot_types(fn, *args) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general of `jax.jit(fn)` as lowered."""
    text = jax.jit(fn).lower(*args).as_text()
    return [tuple(t.split("x")[-1] for t in m.groups()) for m in _DOT.finditer(text)]


def test_bfloat16_linear_forward_dot_takes_bf16_operands_and_returns_float32():
    layer = Linear(32, 24, axes=("mlp", "embed"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 5, 32), jnp.bfloat16)
    assert _dot_types(lambda x: layer(x), x) == [("bf16", "bf16", "f32")]
    assert layer(x).dtype == jnp.bfloat16


def test_bfloat16_linear_backward_dots_take_bf16_operands():
    layer = Linear(32, 24, axes=("mlp", "embed"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

    x = jnp.ones((2, 5, 32), jnp.bfloat16)
    # the forward, the input's gradient and the weight's
    assert _dot_types(jax.grad(loss, (0, 1)), params, x) == [("bf16", "bf16", "f32")] * 3


def test_bfloat16_attention_forward_and_backward_dots_take_bf16_operands():
    q, k, v = (jnp.ones((1, 16, n, 8), jnp.bfloat16) for n in (4, 2, 2))
    mask = jnp.ones((1, 16, 16), bool)

    def loss(q, k, v):
        return jnp.sum(xla_attention(q, k, v, mask).astype(jnp.float32) ** 2)

    # scores and output forward; two gradients of each in the backward pass
    assert _dot_types(jax.grad(loss, (0, 1, 2)), q, k, v) == [("bf16", "bf16", "f32")] * 6


def test_bfloat16_lm_head_and_its_gradient_take_bf16_operands():
    model = LlamaForCausalLM(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    h = jnp.ones((2, 5, 32), jnp.bfloat16)
    assert model.head(h).dtype == jnp.float32
    assert _dot_types(jax.grad(lambda h: jnp.sum(model.head(h) ** 2)), h) == [("bf16", "bf16", "f32")] * 2


def _dot_count(remat: str, dtype) -> int:
    """dot_generals in a LoRA gradient of the model with `remat` (recomputed forward matmuls add some)."""
    model = LlamaForCausalLM(CONFIG, dtype=dtype, param_dtype=dtype, remat=remat, rngs=nnx.Rngs(0))
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "down_proj")), rngs=nnx.Rngs(1))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora, ids):
        return jnp.sum(nnx.merge(graphdef, lora, rest)(ids))

    ids = jnp.zeros((1, 8), jnp.int32)
    return len(_dot_types(jax.grad(loss), lora, ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_remat_dots_keeps_every_matmul_output(dtype):
    """`dots` recomputes no matmul: the custom VJPs' outputs are kept by name (jaxmodel.matmul.DOT_POLICIES)."""
    assert _dot_count("dots", dtype) == _dot_count("none", dtype)


def test_bfloat16_matmul_outputs_kept_by_remat_are_saved_as_their_bits(capsys):
    """An integer buffer is written in place by the layer scan; a bf16 one is converted whole to float32 and
    back at every layer on XLA:CPU (jaxmodel.matmul.remat_name). The values and gradients are unchanged."""
    layer = Linear(32, 24, axes=("mlp", "embed"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((10, 32)), jnp.bfloat16)

    def loss(x):
        return jnp.sum(jax.nn.silu(layer(x)).astype(jnp.float32))

    kept = jax.checkpoint(loss, policy=DOT_POLICIES["dots"])
    jax.ad_checkpoint.print_saved_residuals(kept, x)
    assert "u16[10,24] named 'dot'" in capsys.readouterr().out
    np.testing.assert_array_equal(jax.jit(jax.grad(kept))(x), jax.jit(jax.grad(loss))(x))
