"""Block-wise weight quantization of a frozen base (QLoRA): NF4 as bitsandbytes stores it, and int8.

A Linear weight `[..., out, in]` is cut into blocks of `block` consecutive values along its input dimension;
each block keeps one float32 `absmax` (its largest magnitude) and one code per value:

- **nf4**: the value scaled into [-1, 1] (`x * (1 / absmax)` in float32, clamped) takes the index of the
  nearest of the 16 NF4 values; a value exactly at the midpoint of two neighbours takes the lower one
  (bitsandbytes' `torch.bucketize` against the float32 midpoints). Two codes per byte, the first of a pair
  in the high nibble, as bitsandbytes packs them: the bytes of a weight, flattened, are bitsandbytes'
  `quantize_4bit(w, quant_type="nf4", blocksize=block)` output.
- **int8**: `code = rint(x * (127 / absmax))` in float32 (`127 / absmax` once per block, each operation
  rounded to nearest, `rint` rounding halves to even), so `|code| <= 127`: bitsandbytes' LLM.int8()
  formula, applied per block rather than per row.

- **fp8** (DeepSeek-V3's hub layout): blocks of `block x block` values (partial ones at the right and bottom edges);
  each block's float32 `scale = (1 / absmax) * 448` (1 for an all-zero block), `code = e4m3fn(clamp(x * scale, ±448))`
  rounded to nearest even, and the stored scale is `1 / scale` (the hub's `weight_scale_inv`): transformers'
  `Fp8Quantize` formula, extended to partial blocks as the hub's checkpoints have them.

An all-zero block has absmax 0 and decodes to zeros. Dequantization, in float32, is `NF4[code] * absmax`,
resp. `(code * absmax) * float32(1 / 127)` (bitsandbytes' `int8_vectorwise_dequant`: a product, because XLA
turns a division by the constant 127 into that product anyway); callers cast to their compute dtype.

Dequantization of fp8 is `float32(code) * scale_inv` over each block.

Arrays: `codes` `[..., out, in // block, block // 2]` uint8 (nf4) or `[..., out, in // block, block]` int8;
`scales` `[..., out, in // block]` float32. Blocks have their own axis so that a split of the input
dimension over devices (docs/design.md, "Quantization") always cuts codes and scales at the same blocks.
fp8 keeps the hub's arrays: `codes` `[..., out, in]` float8_e4m3fn, `scales` `[..., ceil(out / block),
ceil(in / block)]` float32; `split_units` says where a split cuts whole blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

SCHEMES = ("nf4", "int8", "fp8")

# The NF4 values of QLoRA (arXiv:2305.14314, Appendix E) as bitsandbytes' `get_4bit_type("nf4")` lists them.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
NF4 = np.array(NF4_VALUES, np.float32)
# Decision boundaries, computed in float32 as bitsandbytes does: (code[i] + code[i + 1]) / 2.
NF4_MIDPOINTS = (NF4[:-1] + NF4[1:]) / np.float32(2)
INT8_MAX = 127
INT8_STEP = np.float32(1 / INT8_MAX)  # 7.874015718698502e-3, as bitsandbytes writes it
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = np.float32(ml_dtypes.finfo(FP8).max)  # 448
FP8_FNUZ = np.dtype(ml_dtypes.float8_e4m3fnuz)  # MI300X's FP8: bias 8, largest 240, 0x80 its only NaN
DEFAULT_BLOCKS = {"nf4": 64, "int8": 64, "fp8": 128}
FP8_MATMULS = ("e4m3fn", "e4m3fnuz")  # H100/H200's FP8, MI300X's


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How the frozen projection weights are stored: `scheme` "nf4", "int8" (`block` values per absmax) or "fp8"
    (`block x block` values per scale); and, for fp8, how they are multiplied: `matmul` None dequantizes each weight
    to the compute dtype first, "e4m3fn" or "e4m3fnuz" multiplies in that FP8 (`jaxmodel.fp8_matmul`). `matmul` is a
    choice of the run, not of the checkpoint: `to_json` leaves it out."""

    scheme: str
    block: int | None = None  # DEFAULT_BLOCKS[scheme]
    matmul: str | None = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r}: expected one of {', '.join(SCHEMES)}")
        if self.block is None:
            object.__setattr__(self, "block", DEFAULT_BLOCKS[self.scheme])
        if not isinstance(self.block, int) or self.block < 1 or (self.scheme == "nf4" and self.block % 2):
            raise ValueError(f"quantization block {self.block!r}: expected a positive integer"
                             f"{' (even: nf4 packs two codes per byte)' if self.scheme == 'nf4' else ''}")
        if self.matmul is not None and (self.scheme != "fp8" or self.matmul not in FP8_MATMULS):
            raise ValueError(f"FP8 matmuls {self.matmul!r}: expected one of {', '.join(FP8_MATMULS)}, on an fp8 base "
                             f"(this one is {self.scheme})")

    @property
    def two_dimensional(self) -> bool:
        """Whether blocks are `block x block` squares of the `[out, in]` weight (fp8) rather than runs of its rows."""
        return self.scheme == "fp8"

    @property
    def codes_per_block(self) -> int:
        """Length of a block's axis in `codes`: bytes per block."""
        return self.block // 2 if self.scheme == "nf4" else self.block

    @property
    def codes_dtype(self) -> np.dtype:
        return {"nf4": np.dtype(np.uint8), "int8": np.dtype(np.int8), "fp8": FP8}[self.scheme]

    @property
    def held_dtype(self) -> np.dtype:
        """The dtype a model holds its codes in: `codes_dtype`, but fp8's bits as uint8. XLA:CPU, which has no FP8
        arithmetic, converted a whole stacked FP8 parameter to float16 outside the layer scan (a second, wider copy
        of the base in a plan's temporaries); the bits, decoded per layer (`dequantize`), leave nothing to hoist."""
        return np.dtype(np.uint8) if self.two_dimensional else self.codes_dtype

    @property
    def bytes_per_value(self) -> float:
        """Stored bytes per weight value, codes and float32 scales, for weights of whole blocks."""
        if self.two_dimensional:
            return self.codes_dtype.itemsize + 4 / self.block**2
        return (self.codes_per_block * self.codes_dtype.itemsize + 4) / self.block

    def shapes(self, weight_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(codes shape, scales shape) for a weight `[..., out, in]`; ValueError if `block` does not divide `in`
        (nf4, int8)."""
        if self.two_dimensional:
            *lead, out, in_features = weight_shape
            return tuple(weight_shape), (*lead, -(-out // self.block), -(-in_features // self.block))
        *lead, in_features = weight_shape
        if in_features % self.block:
            raise ValueError(f"quantization block {self.block} does not divide the input dimension {in_features}")
        blocks = in_features // self.block
        return (*lead, blocks, self.codes_per_block), (*lead, blocks)

    def split_units(self, weight_shape: tuple[int, ...]) -> tuple[tuple, tuple]:
        """fp8: (codes', scales') `split_units` (`jaxmodel.sharding.partition_spec`) for a weight `[..., out, in]`: a
        split of `out` or `in` gives each device whole blocks, or none where that dimension ends in a partial block."""
        *lead, out, in_features = weight_shape
        whole = [n % self.block == 0 for n in (out, in_features)]
        return ((*(1,) * len(lead), *(self.block if w else None for w in whole)),
                (*(1,) * len(lead), *(1 if w else None for w in whole)))

    def to_json(self) -> dict:
        return {"scheme": self.scheme, "block": self.block}


def quantize(w: np.ndarray, quantization: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of a float weight `[..., out, in]` (see the module docstring); numpy, for the converter."""
    codes_shape, scales_shape = quantization.shapes(w.shape)
    if quantization.two_dimensional:
        return _quantize_fp8(np.asarray(w).astype(np.float32), quantization.block)
    x_kb = np.asarray(w).astype(np.float32).reshape(-1, quantization.block)  # k blocks of b values
    if not np.isfinite(x_kb).all():
        raise ValueError("weights with NaN or infinite values cannot be quantized")
    absmax_k = np.abs(x_kb).max(axis=1)
    if quantization.scheme == "nf4":
        # bitsandbytes: clamp(x * (1 / max(absmax, 1e-38)), -1, 1), then bucketize (right=False)
        inv_k = np.float32(1.0) / np.maximum(absmax_k, np.float32(1e-38))
        scaled_kb = np.clip(x_kb * inv_k[:, None], np.float32(-1), np.float32(1))
        index_kb = np.searchsorted(NF4_MIDPOINTS, scaled_kb, side="left").astype(np.uint8)
        codes = (index_kb[:, 0::2] << 4) | index_kb[:, 1::2]
    else:
        # an all-zero block keeps codes 0 (factor 0 instead of 127 / 0)
        factor_k = np.divide(np.float32(INT8_MAX), absmax_k, out=np.zeros_like(absmax_k), where=absmax_k > 0)
        codes = np.rint(x_kb * factor_k[:, None]).astype(np.int8)
    return codes.reshape(codes_shape), absmax_k.reshape(scales_shape)


def _quantize_fp8(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    if not np.isfinite(x).all():
        raise ValueError("weights with NaN or infinite values cannot be quantized")
    *lead, out, in_features = x.shape
    rows, cols = -(-out // block), -(-in_features // block)
    padded = np.zeros((*lead, rows * block, cols * block), np.float32)  # zeros leave a partial block's absmax
    padded[..., :out, :in_features] = x
    x_rbcb = padded.reshape(*lead, rows, block, cols, block)
    absmax_rc = np.abs(x_rbcb).max(axis=(-3, -1))
    nonzero = absmax_rc > 0
    # torch's `448 / absmax` (a Python number over a tensor) is `reciprocal(absmax) * 448`: two roundings
    scale_rc = np.where(nonzero, (np.float32(1) / np.where(nonzero, absmax_rc, np.float32(1))) * FP8_MAX,
                        np.float32(1))
    # clamped first: ml_dtypes' cast does not saturate (a value past 448 would become NaN)
    scaled = np.clip(x_rbcb * scale_rc[..., :, None, :, None], -FP8_MAX, FP8_MAX)
    codes = scaled.astype(FP8).reshape(*lead, rows * block, cols * block)[..., :out, :in_features]
    return np.ascontiguousarray(codes), (np.float32(1) / scale_rc).astype(np.float32)


def fnuz_codes(codes, scales, xp=np):
    """fp8 `codes` (float8_e4m3fn, or their bits as uint8) and their block `scales` as float8_e4m3fnuz codes and
    scales: the FP8 of MI300X's matrix cores, whose exponent bias is 8, not 7, so that the same bits mean half the
    value. The bits are kept and the scales doubled, which keeps every finite value exactly (e4m3fn's largest, 448,
    bits 0x7e, is e4m3fnuz's 224 times 2); -0 (0x80, e4m3fnuz's NaN) becomes 0. Cast as values instead, every code
    past 240 would become NaN. `xp` numpy or jax.numpy; numpy raises ValueError for a NaN code (0x7f, 0xff), which no
    quantized weight holds."""
    bits = np.asarray(codes).view(np.uint8) if xp is np else jax.lax.bitcast_convert_type(codes, jnp.uint8)
    if xp is np and ((bits & 0x7F) == 0x7F).any():
        count = int(((bits & 0x7F) == 0x7F).sum())
        raise ValueError(f"{count} fp8 codes are NaN (0x7f or 0xff): not the codes of a quantized weight")
    kept = xp.where(bits == 0x80, xp.uint8(0), bits)
    fnuz = kept.view(FP8_FNUZ) if xp is np else jax.lax.bitcast_convert_type(kept, FP8_FNUZ)
    return fnuz, xp.asarray(scales, xp.float32) * np.float32(2)


def dequantize_numpy(codes: np.ndarray, scales: np.ndarray, quantization: Quantization) -> np.ndarray:
    """The float32 weight `[..., out, in]` of `codes` and `scales` (numpy)."""
    if quantization.two_dimensional:
        return _blockwise_scaled(np, codes, scales, quantization.block)
    values = _values(np, codes, quantization)
    return _scaled(values, scales.astype(np.float32), quantization).reshape(*scales.shape[:-1], -1)


def dequantize(codes, scales, quantization: Quantization, dtype=jnp.float32):
    """The weight `[..., out, in]` of `codes` and `scales` (jax.numpy): float32, then cast to `dtype`."""
    if quantization.two_dimensional:
        return _blockwise_scaled(jnp, codes, scales, quantization.block).astype(dtype)
    values = _values(jnp, codes, quantization)
    w = _scaled(values, scales.astype(jnp.float32), quantization)
    return w.reshape(*scales.shape[:-1], -1).astype(dtype)


def _blockwise_scaled(xp, codes, scales, block: int):
    """float32 `codes * scale` with each scale over its `block x block` block of `codes` `[..., out, in]` (FP8, or
    its bits as uint8: `Quantization.held_dtype`)."""
    if codes.dtype == np.uint8:
        codes = codes.view(FP8) if xp is np else jax.lax.bitcast_convert_type(codes, FP8)
    out, in_features = codes.shape[-2:]
    scale = xp.repeat(xp.repeat(scales.astype(xp.float32), block, axis=-2), block, axis=-1)
    return codes.astype(xp.float32) * scale[..., :out, :in_features]


def _values(xp, codes, quantization: Quantization):
    """float32 code values `[..., blocks, block]` before scaling."""
    if quantization.scheme == "int8":
        return codes.astype(xp.float32)
    high, low = codes >> 4, codes & 0xF  # the first code of a pair is the high nibble
    index = xp.stack([high, low], axis=-1).reshape(*codes.shape[:-1], quantization.block)
    return xp.asarray(NF4)[index.astype(xp.int32)]


def _scaled(values, scales, quantization: Quantization):
    if quantization.scheme == "int8":
        return values * scales[..., None] * INT8_STEP
    return values * scales[..., None]
