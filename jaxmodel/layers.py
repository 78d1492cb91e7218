"""Leaf modules: Linear, Embed, RMSNorm, with torch's parameter layout.

Weights keep HF's `[out, in]` layout so that converting a checkpoint is a byte copy and exporting one is
a rename (docs/design.md, "Layout"); the matmul contracts the last axis of both operands and XLA picks the
physical layout. Every parameter carries `axes`, its logical axis names, for the sharding rules.
A module built with `layers=L` holds parameters with a leading `[L]` axis ("layers"); the stack is run
with `jax.lax.scan` over that axis, where each step sees a module holding one layer's slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodel import scopes
from jaxmodel.context_parallel import cp_size
from jaxmodel.fp8_matmul import fp8_matmul
from jaxmodel.matmul import einsum_acc32, saved_as_dot
from jaxmodel.quantization import Quantization, dequantize
from jaxmodel.sharding import DEFAULT_RULES, Rules, constrain

INIT_STD = 0.02  # transformers' initializer_range for Llama


def _stacked(layers: int | None, shape: tuple[int, ...], axes: tuple[str | None, ...]):
    if layers is None:
        return shape, axes
    return (layers, *shape), ("layers", *axes)


class LoRAParam(nnx.Variable):
    """A LoRA adapter matrix: the only trainable variable type, so "trainable" is a type filter."""


class QuantizedParam(nnx.Param):
    """The codes or scales of a quantized frozen weight (`jaxmodel.quantization`): stored and loaded as they
    are, never cast to the parameter dtype."""


class Linear(nnx.Module):
    """`y = x @ weight.T + bias` with `weight: [out, in]` as torch stores it, plus, once a LoRA adapter is
    attached (`jaxmodel.lora.apply_lora`), `scale * (x @ lora_a) @ lora_b` with `lora_a: [in, r]`,
    `lora_b: [r, out]`, computed in float32 as PEFT does.

    With `quantization`, the frozen weight is held as `codes` and `scales` instead of `weight`
    (`jaxmodel.quantization`); each call dequantizes it and then computes exactly as with `weight`.
    `weight_shape` and `weight_axes` describe the weight either way."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str, str],
        use_bias: bool = False,
        layers: int | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        quantization: Quantization | None = None,
        rngs: nnx.Rngs,
    ):
        shape, names = _stacked(layers, (out_features, in_features), axes)
        self.weight_shape, self.weight_axes = shape, names
        self.quantization = quantization
        self.weight, self.codes, self.scales = frozen_weight(shape, names, param_dtype, quantization, rngs)
        if use_bias:
            bshape, bnames = _stacked(layers, (out_features,), axes[:1])
            self.bias = nnx.Param(jnp.zeros(bshape, param_dtype), axes=bnames)
        else:
            self.bias = None
        self.dtype = dtype
        self.lora_a: LoRAParam | None = nnx.data(None)  # set by jaxmodel.lora.apply_lora
        self.lora_b: LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0
        self.lora_dropout = 0.0

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """`dropout_key` switches on dropout of the LoRA branch's input (training only)."""
        # Tokens are flattened to one axis: the CPU backend's matmuls (and their gradients) run
        # markedly faster on 2-D operands than with batch and sequence kept apart (bench/train.py). Not
        # under `cp`: a device's `[rows, seq / cp]` tokens are then no single tile of the flattened axis, and
        # XLA gathers every projection's input and output over `cp` (and reduces LoRA's products) instead.
        with jax.named_scope(scopes.PROJECTION):
            *lead, in_features = x.shape
            x_ni = (x if cp_size() > 1 else x.reshape(-1, in_features)).astype(self.dtype)
            if self.quantization is None:
                y_no = _matmul(x_ni, self.weight[...].astype(self.dtype))
            elif self.quantization.matmul is not None:  # in FP8 against the codes as they are
                y_no = fp8_matmul(x_ni, self.codes[...], self.scales[...], self.quantization)
            else:
                # The dequantized weight is what XLA gathers over fsdp: pinning the codes and scales whole along the
                # hidden axis here gathers 9/32 of those bytes in NF4, but XLA then copies every layer's codes into
                # the layout that gather wants, one more copy of the quantized base on each device.
                y_no = _dequantized_matmul(x_ni, self.codes[...], self.scales[...], self.quantization, self.dtype)
            # y is float32 (jaxmodel.matmul): the bias and the adapter are added to it and the sum rounded once.
            if self.bias is not None:
                y_no = y_no + self.bias[...].astype(jnp.float32)
            if self.lora_a is not None:
                y_no = y_no + self.lora_delta(x_ni, dropout_key)
            y_no = saved_as_dot(y_no.astype(self.dtype))
            return y_no.reshape(*lead, y_no.shape[-1])

    def lora_delta(self, x_ni: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """The LoRA branch `scale * (dropout(x) A) B`, float32 `[..., out]` for tokens `x_ni` `[..., in]`."""
        with jax.named_scope(scopes.LORA):
            # Scale the small [n, r] product, not the [n, out] one: its gradient is then cheap too.
            x_lora = x_ni.astype(jnp.float32)
            if dropout_key is not None and self.lora_dropout > 0:
                keep = jax.random.bernoulli(dropout_key, 1.0 - self.lora_dropout, x_lora.shape)
                x_lora = jnp.where(keep, x_lora / (1.0 - self.lora_dropout), 0.0)
            # einsum_acc32 for its gradients' layout on the CPU (jaxmodel.matmul), on float32 operands; `xa` is
            # kept by the dot remat policies as a plain dot's output would be.
            xa_nr = einsum_acc32("...i,ir->...r", x_lora, self.lora_a[...].astype(jnp.float32))
            xa_nr = saved_as_dot(xa_nr * self.lora_scale)
            return einsum_acc32("...r,ro->...o", xa_nr, self.lora_b[...].astype(jnp.float32))


def _matmul(x_ni: jax.Array, w_oi: jax.Array) -> jax.Array:
    """`x @ w.T` `[..., out]`, accumulated and returned in float32: the form of a bf16 matmul that XLA:CPU
    runs in bf16 (`jaxmodel.matmul`)."""
    return einsum_acc32("...i,oi->...o", x_ni, w_oi)


# Nothing inside is saved for the backward pass, which dequantizes again: saved, the dequantized weight of
# every layer of the scanned stack would be kept until the backward pass (remat "none"), i.e. the whole
# model in the compute dtype. Every use is inside the layer scan, where CSE cannot merge the two.
@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False,
                   static_argnums=(3, 4))
def _dequantized_matmul(x_ni, codes, scales, quantization: Quantization, dtype) -> jax.Array:
    return _matmul(x_ni, dequantize(codes, scales, quantization, dtype))


def frozen_weight(shape, axes, param_dtype, quantization: Quantization | None, rngs: nnx.Rngs):
    """(weight, codes, scales) of a frozen weight of `shape` and logical `axes`: a drawn `weight` (the others None),
    or with `quantization` drawn `codes` and `scales` (`weight` None)."""
    if quantization is None:
        return nnx.Param(INIT_STD * jax.random.normal(rngs.params(), shape, param_dtype), axes=axes), None, None
    return None, *_random_quantized(quantization, shape, axes, rngs)


def _random_quantized(quantization: Quantization, shape, axes, rngs: nnx.Rngs):
    """Codes drawn uniformly and absmax INIT_STD: a random model (tests, shapes); real ones are converted."""
    codes_shape, scales_shape = quantization.shapes(shape)
    scales = jnp.full(scales_shape, INIT_STD, jnp.float32)
    if quantization.two_dimensional:  # codes of a standard normal: weights of deviation INIT_STD
        codes = jax.lax.bitcast_convert_type(jax.random.normal(rngs.params(), codes_shape, jnp.float32).astype(
            quantization.codes_dtype), quantization.held_dtype)
        codes_units, scales_units = quantization.split_units(shape)
        return (QuantizedParam(codes, axes=axes, split_units=codes_units),
                QuantizedParam(scales, axes=axes, split_units=scales_units))
    if quantization.scheme == "nf4":
        codes = jax.random.randint(rngs.params(), codes_shape, 0, 256, jnp.int32).astype(jnp.uint8)
    else:
        codes = jax.random.randint(rngs.params(), codes_shape, -127, 128, jnp.int32).astype(jnp.int8)
    # blocks get their own axis, unsplit: a split of the input dimension then cuts at whole blocks
    return QuantizedParam(codes, axes=(*axes, None)), QuantizedParam(scales, axes=axes)


class Embed(nnx.Module):
    """Token embedding table `weight: [vocab, hidden]` (also the LM head when embeddings are tied)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 scale: float | None = None, rngs: nnx.Rngs):
        """`scale` multiplies the looked-up rows (rounded to the table's dtype first, as Gemma does), not the
        table when it serves as the tied LM head."""
        self.weight = nnx.Param(
            INIT_STD * jax.random.normal(rngs.params(), (vocab_size, hidden_size), param_dtype),
            axes=("vocab", "embed"),
        )
        self.dtype = dtype
        self.scale = scale

    def __call__(self, ids_bt: jax.Array, rules: Rules = DEFAULT_RULES) -> jax.Array:
        # Rows gathered from a table split along both dimensions come out split along the hidden one, and
        # on some meshes (e.g. dp=2,fsdp=2,mp=2) the partitioner can only move them to the batch split by
        # replicating the whole table. Gathering the hidden dimension first leaves a lookup in a
        # vocab-split table: a masked gather plus an all-reduce over `mp`.
        with jax.named_scope(scopes.EMBEDDING):
            table = constrain(self.weight[...], ("vocab", None), rules)
            rows = jnp.take(table, ids_bt, axis=0)
            if self.scale is not None:
                rows = rows * jnp.asarray(self.scale, rows.dtype)
            return rows.astype(self.dtype)


class RMSNorm(nnx.Module):
    """transformers' LlamaRMSNorm: normalise in float32, cast back to the input dtype, then scale. With
    `unit_offset` the scale is `1 + weight` (Gemma's RMSNorm; its weight starts at 0)."""

    def __init__(self, size: int, *, eps: float, layers: int | None = None, param_dtype=jnp.float32,
                 unit_offset: bool = False):
        shape, names = _stacked(layers, (size,), ("norm",))
        init = jnp.zeros if unit_offset else jnp.ones
        self.weight = nnx.Param(init(shape, param_dtype), axes=names)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        # transformers rounds the normalised value to x's dtype before scaling it; here the scaling is in float32
        # too and the result is rounded once (`swiglu` says why)
        with jax.named_scope(scopes.RMS_NORM):
            h = x.astype(jnp.float32)
            h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
            scale = self.weight[...].astype(jnp.float32)
            if self.unit_offset:
                scale = 1.0 + scale
            return (scale * h).astype(x.dtype)


# The MLP gate's activations by transformers' ACT2FN name (`jaxmodel.families.family.SUPPORTED_ACTIVATIONS`).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def swiglu(gate: jax.Array, up: jax.Array, activation: str = "silu") -> jax.Array:
    """`act(gate) * up` (`silu` by default: SwiGLU; GeGLU with "gelu_pytorch_tanh"), computed in float32 and rounded
    once to the inputs' dtype.

    Why float32 inside: XLA:CPU runs each bf16 operation as a float32 one between two conversions, so the product's
    operations, their recomputation under remat and their gradients cost more in bf16 than in float32. Rounding
    once is what a fused GPU kernel does, and is within half a bf16 spacing of the exact product."""
    with jax.named_scope(scopes.SWIGLU):
        g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
        return (ACTIVATIONS[activation](g) * u).astype(jnp.promote_types(gate.dtype, up.dtype))
