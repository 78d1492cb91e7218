"""Contractions accumulated in float32 (jaxmodel/matmul.py): their gradients are those of the plain
contraction (within float32 summation error of the exact ones in float32, within bf16 rounding of autodiff's
in bf16); in bf16 every matmul of a layer's forward and backward pass takes bf16 operands with a float32
result, the one bf16 dot XLA:CPU keeps in bf16 rather than running it in float32 on converted operands; and
on the CPU every matmul of a LoRA step, gradients included, is one that XLA:CPU gives to YNNPACK."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodel import ModelConfig, CausalLM
from jaxmodel.attention import xla_attention
from jaxmodel.layers import Linear, LoRAParam
from jaxmodel.lora import LoraConfig, apply_lora
from jaxmodel.matmul import DOT_POLICIES, _explicit, _operand_axes, einsum_acc32

# (spec, a's shape, b's shape): Linear's projection, attention's two matmuls, the LM head, LoRA's two factors
CONTRACTIONS = [
    ("ni,oi->no", (24, 16), (12, 16)),
    ("bkqh,bksh->bkqs", (2, 3, 20, 8), (2, 3, 12, 8)),
    ("bkqs,bksh->bkqh", (2, 3, 20, 12), (2, 3, 12, 8)),
    ("...d,vd->...v", (2, 5, 16), (40, 16)),
    ("ni,ir->nr", (24, 16), (16, 3)),
    ("nr,ro->no", (24, 3), (3, 12)),
]
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits
F32_UNIT_ROUNDOFF = 2.0 ** -24

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
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


def _terms_per_entry(spec: str, a_shape, b_shape) -> tuple[int, int]:
    """How many products each entry of a's gradient and of b's gradient sums."""
    a_axes, b_axes, out_axes = _operand_axes(_explicit(spec, len(a_shape), len(b_shape)))
    size = {**dict(zip(a_axes, a_shape)), **dict(zip(b_axes, b_shape))}
    terms = lambda own, other: int(np.prod([size[c] for c in set(out_axes + other) - set(own)] or [1]))
    return terms(a_axes, b_axes), terms(b_axes, a_axes)


@pytest.mark.parametrize("spec, a_shape, b_shape", CONTRACTIONS)
def test_float32_values_equal_plain_einsum_and_gradients_the_exact_ones_within_summation_error(spec, a_shape, b_shape):
    """The forward is the plain einsum, bit for bit. The gradients may be computed as a differently laid out
    dot (on the CPU: jaxmodel.matmul._minor_contraction), so they are held to the exact gradients (float64)
    within the error bound of any float32 sum of K products: K u times the sum of the products' magnitudes."""
    a, b, c = _operands(spec, a_shape, b_shape, jnp.float32)
    plain = lambda a, b: jnp.einsum(spec, a, b)
    ours = lambda a, b: einsum_acc32(spec, a, b)
    np.testing.assert_array_equal(jax.jit(ours)(a, b), jax.jit(plain)(a, b))
    with jax.enable_x64():
        exact = _grads(plain, *(jnp.asarray(x, jnp.float64) for x in (a, b, c)))
        magnitude = _grads(plain, *(jnp.abs(jnp.asarray(x, jnp.float64)) for x in (a, b, c)))
    for got, want, bound, terms in zip(_grads(ours, a, b, c), exact, magnitude,
                                       _terms_per_entry(spec, a_shape, b_shape)):
        assert got.dtype == jnp.float32
        error = np.abs(np.asarray(got, np.float64) - np.asarray(want))
        assert np.all(error <= terms * F32_UNIT_ROUNDOFF * np.asarray(bound)), error.max()


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
    model = CausalLM(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    h = jnp.ones((2, 5, 32), jnp.bfloat16)
    assert model.head(h).dtype == jnp.float32
    assert _dot_types(jax.grad(lambda h: jnp.sum(model.head(h) ** 2)), h) == [("bf16", "bf16", "f32")] * 2


def _dot_count(remat: str, dtype) -> int:
    """dot_generals in a LoRA gradient of the model with `remat` (recomputed forward matmuls add some)."""
    model = CausalLM(CONFIG, dtype=dtype, param_dtype=dtype, remat=remat, rngs=nnx.Rngs(0))
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


# ---- which kernels XLA:CPU runs the matmuls of a LoRA step with ----------------------------------------------

def _dots_outside_ynnpack(hlo: str) -> tuple[list[str], int]:
    """The dots of compiled XLA:CPU `hlo` that no YNNPACK fusion holds, and the number of YNNPACK fusions."""
    ynnpack = set(re.findall(r'calls=%([\w.\-]+), [^\n]*"kind":"__ynn_fusion"', hlo))
    outside = []
    for computation in re.split(r"\n(?=\S)", hlo):
        name = re.match(r"(?:ENTRY )?%([\w.\-]+)", computation)
        if not (name and name.group(1) in ynnpack):
            outside += [line.strip()[:160] for line in computation.splitlines() if re.search(r"= \S+ dot\(", line)]
    return outside, len(ynnpack)


@pytest.mark.parametrize("dtype, attention", [(jnp.float32, "xla"), (jnp.bfloat16, "xla"),
                                              (jnp.float32, "blockwise")])
def test_every_matmul_of_a_lora_step_on_the_cpu_runs_in_ynnpack(dtype, attention):
    """The weight gradients (LoRA's A and B, attention's keys and values) contract the tokens or queries, the
    major axis of both operands: as such XLA:CPU gives them to Eigen, which runs beside the YNNPACK matmuls
    on the same threads and slows them (jaxmodel.matmul._minor_contraction)."""
    model = CausalLM(CONFIG, dtype=dtype, param_dtype=dtype, remat="dots", attention=attention,
                             rngs=nnx.Rngs(0))
    apply_lora(model, LoraConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(1))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora, ids):
        return jnp.sum(nnx.merge(graphdef, lora, rest)(ids))

    hlo = jax.jit(jax.grad(loss)).lower(lora, jnp.zeros((2, 16), jnp.int32)).compile().as_text()
    outside, fusions = _dots_outside_ynnpack(hlo)
    if not fusions:
        pytest.skip("this jaxlib's XLA:CPU runs no matmul with YNNPACK")
    assert outside == []
