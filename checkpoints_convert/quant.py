"""Block-scaled FP8 / FP4 weights of the DeepSeek-V4 hub checkpoints (spec §7.3), numpy only.

* FP8: ``q`` float8_e4m3fn [out, in] with an e8m0 scale per 128 x 128 block,
  shape [ceil(out/128), ceil(in/128)]; W[o, i] = q[o, i] * S[o // 128, i // 128].
* FP4 (routed experts): int8 [out, in/2] holding two e2m1 codes per byte (low nibble = input
  2k, high nibble = 2k+1) with an e8m0 scale per 32 consecutive inputs of a row,
  shape [out, in/32]; W[o, i] = code(o, i) * S[o, i // 32].
* e8m0 byte b encodes 2^(b - 127); b = 255 is NaN.

Edge blocks are the true 128 x 128 (or 1 x 32) tiles cut off at the matrix border. transformers
5.24 ``Fp8Dequantize`` instead infers the block as ``rows // scale_rows``, which is wrong
whenever a dimension is not a multiple of 128 (spec §13.1); every product here is an exact
power-of-two rescaling, so dequantisation is bit-exact.

The quantisers are the inverse encoders used to build test fixtures: power-of-two scales
chosen as small as possible with max |w / scale| within the format's range.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from checkpoints_convert.safetensors_io import E8M0_DTYPE, CheckpointError

__all__ = [
    "FP4_BLOCK",
    "FP4_E2M1_MAX",
    "FP4_E2M1_TABLE",
    "FP8_BLOCK",
    "FP8_E4M3_MAX",
    "dequant_fp4_blockwise",
    "dequant_fp8_blockwise",
    "e8m0_to_float32",
    "quantize_fp4_blockwise",
    "quantize_fp8_blockwise",
    "unpack_fp4_e2m1",
]

FP8_BLOCK = (128, 128)
FP4_BLOCK = 32  # inputs per scale, along a row
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

# e2m1 code (nibble) -> value. Bit 3 is the sign, so codes 8..15 mirror 0..7 (8 is -0.0).
FP4_E2M1_TABLE = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
# byte -> (value of low nibble, value of high nibble): one gather unpacks a whole row.
_FP4_PAIR_TABLE = np.stack(
    [FP4_E2M1_TABLE[np.arange(256) & 0xF], FP4_E2M1_TABLE[np.arange(256) >> 4]], axis=-1
)
_FP4_PAIR_TABLE_U64 = np.ascontiguousarray(_FP4_PAIR_TABLE.astype(np.float32)).view(np.uint64).reshape(256)
# byte -> 2^(b - 127), computed in float64 and cast: every entry, including the float32
# subnormal 2^-127 for b = 0, is exactly representable. Byte 255 (which would be 2^128,
# beyond float32) is NaN.
_E8M0_TABLE = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)

_FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127  # byte 0 .. 254


def _label(name: str | None) -> str:
    return name if name is not None else "<unnamed tensor>"


def _as_block(block: int | tuple[int, int]) -> tuple[int, int]:
    b0, b1 = (block, block) if isinstance(block, int) else tuple(block)
    if b0 < 1 or b1 < 1:
        raise ValueError(f"block sizes must be positive, got {block!r}")
    return int(b0), int(b1)


def e8m0_to_float32(scale: np.ndarray, *, name: str | None = None) -> np.ndarray:
    """Decode e8m0 scales (ml_dtypes.float8_e8m0fnu, or their raw uint8 bytes) to float32.

    Byte b -> 2^(b - 127) exactly; b = 255 -> NaN.
    """
    scale = np.asarray(scale)
    if scale.dtype not in (E8M0_DTYPE, np.dtype(np.uint8)):
        raise CheckpointError(f"{_label(name)}: e8m0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    return _E8M0_TABLE[scale.view(np.uint8)]


def unpack_fp4_e2m1(packed: np.ndarray, *, name: str | None = None) -> np.ndarray:
    """Unpack two e2m1 codes per byte: int8/uint8 [..., n] -> float32 [..., 2n].

    The low nibble of byte k is element 2k, the high nibble element 2k + 1.
    """
    packed = np.asarray(packed)
    if packed.dtype not in (np.dtype(np.int8), np.dtype(np.uint8)):
        raise CheckpointError(f"{_label(name)}: packed FP4 must be int8 or uint8, got {packed.dtype}")
    if packed.ndim < 1:
        raise CheckpointError(f"{_label(name)}: packed FP4 needs at least one dimension, got a scalar")
    # One 8-byte gather per input byte (both floats of the pair at once) is ~8x faster than
    # fancy-indexing the [256, 2] table; the bytes are the same float32 pairs.
    pairs = np.take(_FP4_PAIR_TABLE_U64, packed.view(np.uint8))  # [..., n] uint64
    return pairs.view(np.float32).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _check_scale_shape(
    weight_shape: tuple[int, int], scale: np.ndarray, block: tuple[int, int], name: str | None
) -> None:
    want = (math.ceil(weight_shape[0] / block[0]), math.ceil(weight_shape[1] / block[1]))
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"{_label(name)}: scale shape {tuple(scale.shape)} does not match weight shape {weight_shape} "
            f"with block {block}: expected {want}"
        )


def _scale_blocks_inplace(w: np.ndarray, s: np.ndarray, block: tuple[int, int]) -> None:
    """w[o, i] *= s[o // b0, i // b1] in place, edge blocks cut at the border (s shape already checked)."""
    rows, cols = w.shape
    b0, b1 = block
    full, rem = divmod(cols, b1)
    s_rows = np.repeat(s, b0, axis=0)[:rows]  # [rows, ceil(cols / b1)]: small next to w for b1 >= 32
    # No overflow warning: the dequantisers check finiteness afterwards and raise naming the key.
    with np.errstate(over="ignore", invalid="ignore"):
        if full:
            # copy=False: the multiply must land in w itself, so refuse to work on a silent copy.
            body = np.reshape(w[:, : full * b1], (rows, full, b1), copy=False)
            body *= s_rows[:, :full, None]
        if rem:
            w[:, full * b1 :] *= s_rows[:, full : full + 1]


def _check_finite(w: np.ndarray, name: str | None) -> None:
    bad = ~np.isfinite(w)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(
            f"{_label(name)}: {int(bad.sum())} non-finite values after dequantisation "
            f"(first at {first}: {w[first]}); NaN weight code or e8m0 scale byte 255?"
        )


def dequant_fp8_blockwise(
    q: np.ndarray,
    scale: np.ndarray,
    block: int | tuple[int, int] = FP8_BLOCK,
    *,
    name: str | None = None,
) -> np.ndarray:
    """Dequantise float8_e4m3fn [out, in] with e8m0 block scales [ceil(out/b0), ceil(in/b1)] to float32.

    Exact (each product is a power-of-two rescaling of an e4m3 value); ragged edge blocks are
    handled as the true cut-off tiles. Raises CheckpointError naming ``name`` on a dtype or
    scale-shape mismatch or when the result contains NaN/Inf.
    """
    q = np.asarray(q)
    scale = np.asarray(scale)
    if q.dtype != _FP8_DTYPE:
        raise CheckpointError(f"{_label(name)}: FP8 weight must be float8_e4m3fn, got {q.dtype}")
    if q.ndim != 2 or scale.ndim != 2:
        raise CheckpointError(f"{_label(name)}: expected 2-D weight and scale, got {q.shape} and {scale.shape}")
    block = _as_block(block)
    _check_scale_shape(q.shape, scale, block, name)
    w = q.astype(np.float32)
    _scale_blocks_inplace(w, e8m0_to_float32(scale, name=name), block)
    _check_finite(w, name)
    return w


def dequant_fp4_blockwise(
    packed: np.ndarray,
    scale: np.ndarray,
    block: int = FP4_BLOCK,
    *,
    name: str | None = None,
) -> np.ndarray:
    """Dequantise packed e2m1 int8 [out, in/2] with e8m0 scales [out, ceil(in/block)] to float32 [out, in].

    Exact. Raises CheckpointError naming ``name`` on a dtype or scale-shape mismatch or when
    the result contains NaN/Inf.
    """
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    if packed.ndim != 2 or scale.ndim != 2:
        raise CheckpointError(
            f"{_label(name)}: expected 2-D packed weight and scale, got {packed.shape} and {scale.shape}"
        )
    _check_scale_shape((packed.shape[0], 2 * packed.shape[1]), scale, (1, block), name)
    w = unpack_fp4_e2m1(packed, name=name)
    _scale_blocks_inplace(w, e8m0_to_float32(scale, name=name), (1, block))
    _check_finite(w, name)
    return w


# --------------------------------------------------------------------------------------------
# Encoders (test fixtures)


def _checked_weight(w: np.ndarray) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError(f"weight contains {int((~np.isfinite(w)).sum())} non-finite values")
    return w


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    rows, cols = w.shape
    b0, b1 = block
    grid = (math.ceil(rows / b0), math.ceil(cols / b1))
    # Zero padding cannot raise a block's max |w|, and makes every block full-sized.
    padded = np.zeros((grid[0] * b0, grid[1] * b1), dtype=np.float32)
    padded[:rows, :cols] = np.abs(w)
    return padded.reshape(grid[0], b0, grid[1], b1).max(axis=(1, 3))


def _pow2_exponents(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest e with amax <= qmax * 2^e (0 for all-zero blocks), clamped to the e8m0 range."""
    a = amax.astype(np.float64)
    mant, exp = np.frexp(a / qmax)  # a / qmax = mant * 2^exp, mant in [0.5, 1)
    e = np.where(mant == 0.5, exp - 1, exp)
    # a / qmax is rounded, so the guess may be off by one next to a power of two; these
    # comparisons are exact (qmax * 2^e is exact in float64).
    e = e + (a > np.ldexp(qmax, e))
    e = e - (a <= np.ldexp(qmax, e - 1))
    e = np.where(a == 0, 0, e)
    return np.clip(e, _E8M0_MIN_EXP, _E8M0_MAX_EXP).astype(np.int32)


def _pow2_scales(w: np.ndarray, block: tuple[int, int], qmax: float) -> tuple[np.ndarray, np.ndarray]:
    """Block scales as (e8m0 array, w divided by them as float32)."""
    exps = _pow2_exponents(_block_amax(w, block), qmax)
    scaled = w.copy()
    # Multiplying by 2^-e is exact (no rounding) and reuses the dequantiser's block walk.
    _scale_blocks_inplace(scaled, np.ldexp(np.float32(1.0), -exps).astype(np.float32), block)
    return (exps + 127).astype(np.uint8).view(E8M0_DTYPE), scaled


def quantize_fp8_blockwise(
    w: np.ndarray, block: int | tuple[int, int] = FP8_BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Encode float32 [out, in] as (float8_e4m3fn [out, in], e8m0 scale [ceil(out/b0), ceil(in/b1)]).

    Each block's scale is the smallest power of two with max |w / scale| <= 448; values are
    rounded to nearest-even e4m3. Inputs already representable (e4m3 values times a
    power-of-two per block) round-trip exactly.
    """
    w = _checked_weight(w)
    block = _as_block(block)
    scale, scaled = _pow2_scales(w, block, FP8_E4M3_MAX)
    return scaled.astype(_FP8_DTYPE), scale


def quantize_fp4_blockwise(w: np.ndarray, block: int = FP4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Encode float32 [out, in] (in even) as (packed int8 [out, in/2], e8m0 scale [out, ceil(in/block)]).

    Each block's scale is the smallest power of two with max |w / scale| <= 6; values are
    rounded to the nearest e2m1 grid point (ties to even mantissa, as ml_dtypes casts).
    """
    w = _checked_weight(w)
    if w.shape[1] % 2:
        raise ValueError(f"FP4 packs two inputs per byte: input dim must be even, got shape {w.shape}")
    scale, scaled = _pow2_scales(w, (1, block), FP4_E2M1_MAX)
    # ml_dtypes keeps a float4_e2m1fn value in the low 4 bits of its byte, laid out as the
    # checkpoint's code (sign bit 3), so the cast yields the nibble directly.
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8).view(np.int8), scale
