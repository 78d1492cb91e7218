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

An all-zero block has absmax 0 and decodes to zeros. Dequantization, in float32, is `NF4[code] * absmax`,
resp. `(code * absmax) * float32(1 / 127)` (bitsandbytes' `int8_vectorwise_dequant`: a product, because XLA
turns a division by the constant 127 into that product anyway); callers cast to their compute dtype.

Arrays: `codes` `[..., out, in // block, block // 2]` uint8 (nf4) or `[..., out, in // block, block]` int8;
`scales` `[..., out, in // block]` float32. Blocks have their own axis so that a split of the input
dimension over devices (docs/design.md, "Quantization") always cuts codes and scales at the same blocks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

SCHEMES = ("nf4", "int8")

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


@dataclasses.dataclass(frozen=True)
class Quantization:
    """How the frozen projection weights are stored: `scheme` "nf4" or "int8", `block` values per absmax."""

    scheme: str
    block: int = 64

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r}: expected one of {', '.join(SCHEMES)}")
        if not isinstance(self.block, int) or self.block < 1 or (self.scheme == "nf4" and self.block % 2):
            raise ValueError(f"quantization block {self.block!r}: expected a positive integer"
                             f"{' (even: nf4 packs two codes per byte)' if self.scheme == 'nf4' else ''}")

    @property
    def codes_per_block(self) -> int:
        """Length of a block's axis in `codes`: bytes per block."""
        return self.block // 2 if self.scheme == "nf4" else self.block

    @property
    def codes_dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.scheme == "nf4" else np.dtype(np.int8)

    def shapes(self, weight_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(codes shape, scales shape) for a weight `[..., out, in]`; ValueError if `block` does not divide `in`."""
        *lead, in_features = weight_shape
        if in_features % self.block:
            raise ValueError(f"quantization block {self.block} does not divide the input dimension {in_features}")
        blocks = in_features // self.block
        return (*lead, blocks, self.codes_per_block), (*lead, blocks)

    def to_json(self) -> dict:
        return {"scheme": self.scheme, "block": self.block}


def quantize(w: np.ndarray, quantization: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) of a float weight `[..., out, in]` (see the module docstring); numpy, for the converter."""
    codes_shape, scales_shape = quantization.shapes(w.shape)
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


def dequantize_numpy(codes: np.ndarray, scales: np.ndarray, quantization: Quantization) -> np.ndarray:
    """The float32 weight `[..., out, in]` of `codes` and `scales` (numpy)."""
    values = _values(np, codes, quantization)
    return _scaled(values, scales.astype(np.float32), quantization).reshape(*scales.shape[:-1], -1)


def dequantize(codes, scales, quantization: Quantization, dtype=jnp.float32):
    """The weight `[..., out, in]` of `codes` and `scales` (jax.numpy): float32, then cast to `dtype`."""
    values = _values(jnp, codes, quantization)
    w = _scaled(values, scales.astype(jnp.float32), quantization)
    return w.reshape(*scales.shape[:-1], -1).astype(dtype)


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
