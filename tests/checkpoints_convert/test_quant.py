"""checkpoints_convert.quant: exact FP8/FP4 block dequantisation, checked against per-element
references, ml_dtypes, torch and transformers 5.24's own dequantisers (code nobody here wrote),
plus quantise -> dequantise error bounds."""

import itertools
import re

import ml_dtypes
import numpy as np
import pytest
import torch

from checkpoints_convert.quant import (
    FP4_E2M1_MAX,
    FP8_E4M3_MAX,
    dequant_fp4_blockwise,
    dequant_fp8_blockwise,
    e8m0_to_float32,
    quantize_fp4_blockwise,
    quantize_fp8_blockwise,
    unpack_fp4_e2m1,
)
from checkpoints_convert.safetensors_io import E8M0_DTYPE, CheckpointError

E4M3_NAN_BYTES = (0x7F, 0xFF)


@pytest.fixture(scope="module")
def hf_fp8():
    """transformers' FP8 integration module (slow import, so only for the tests that use it)."""
    return pytest.importorskip("transformers.integrations.finegrained_fp8")


def random_fp8(shape, rng, scale_bytes=(100, 150), block=128):
    """Random finite e4m3 codes and e8m0 scales for a [out, in] FP8 weight."""
    q = rng.integers(0, 256, shape, dtype=np.uint8)
    q[np.isin(q, E4M3_NAN_BYTES)] = 0x38  # 1.0
    grid = (-(-shape[0] // block), -(-shape[1] // block))
    s = rng.integers(*scale_bytes, grid, dtype=np.uint8)
    return q.view(ml_dtypes.float8_e4m3fn), s.view(E8M0_DTYPE)


def random_fp4(shape, rng, scale_bytes=(100, 150)):
    """Random packed e2m1 bytes and per-32 e8m0 scales for a logical [out, in] FP4 weight."""
    packed = rng.integers(-128, 128, (shape[0], shape[1] // 2), dtype=np.int8)
    s = rng.integers(*scale_bytes, (shape[0], -(-shape[1] // 32)), dtype=np.uint8)
    return packed, s.view(E8M0_DTYPE)


def to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bytes of a 1-byte numpy array as a torch tensor of ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).copy()).view(dtype)


def assert_bits_equal(got: np.ndarray, want: np.ndarray):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # -0.0 vs 0.0 matters


# --------------------------------------------------------------------------------------------
# e8m0


def test_e8m0_all_bytes():
    b = np.arange(256, dtype=np.uint8)
    got = e8m0_to_float32(b)
    assert got.dtype == np.float32
    want = np.array([2.0 ** (int(x) - 127) for x in range(255)])
    assert np.array_equal(got[:255].astype(np.float64), want)  # exact, incl. subnormal 2^-127
    assert np.isnan(got[255])
    assert_bits_equal(e8m0_to_float32(b.view(E8M0_DTYPE)), got)
    # Two independent decoders of the same bytes.
    np.testing.assert_array_equal(b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), got)
    np.testing.assert_array_equal(to_torch(b, torch.float8_e8m0fnu).float().numpy(), got)


def test_e8m0_rejects_other_dtypes():
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_a\.scale.*float32"):
        e8m0_to_float32(np.ones(3, np.float32), name="layers.0.attn.wq_a.scale")


# --------------------------------------------------------------------------------------------
# FP4 unpack


def e2m1_reference(nibble: int) -> float:
    """e2m1 from its bit fields (sign | 2-bit exponent, bias 1 | 1-bit mantissa), not the table."""
    sign = -1.0 if nibble & 0b1000 else 1.0
    exp, man = (nibble >> 1) & 0b11, nibble & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def test_unpack_fp4_all_bytes():
    packed = np.arange(256, dtype=np.uint8).view(np.int8).reshape(16, 16)
    got = unpack_fp4_e2m1(packed)
    assert got.shape == (16, 32) and got.dtype == np.float32
    want = np.empty((16, 32), np.float32)
    for r, k in itertools.product(range(16), range(16)):
        byte = int(packed.view(np.uint8)[r, k])
        want[r, 2 * k] = e2m1_reference(byte & 0xF)  # low nibble first
        want[r, 2 * k + 1] = e2m1_reference(byte >> 4)
    assert_bits_equal(got, want)
    # ml_dtypes' float4_e2m1fn holds the same code in the low nibble of a byte.
    low = (packed.view(np.uint8) & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert_bits_equal(got[:, 0::2], low)
    assert_bits_equal(unpack_fp4_e2m1(packed.view(np.uint8)), got)


def test_unpack_fp4_matches_transformers(hf_fp8):
    packed = np.arange(256, dtype=np.uint8).view(np.int8).reshape(4, 64)
    theirs = hf_fp8.Fp8Dequantize(hf_quantizer=None)._unpack_fp4(torch.from_numpy(packed.copy())).numpy()
    assert_bits_equal(unpack_fp4_e2m1(packed), theirs)


def test_unpack_fp4_rejects_other_dtypes():
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*float32"):
        unpack_fp4_e2m1(np.zeros((2, 2), np.float32), name="experts.0.w1.weight")


# --------------------------------------------------------------------------------------------
# FP8 dequantisation


def fp8_reference(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Slow per-element W[o, i] = q[o, i] * 2^(byte[o // 128, i // 128] - 127), in float64."""
    qf = q.astype(np.float64)
    sb = s.view(np.uint8)
    out = np.empty(q.shape, np.float64)
    for o, i in itertools.product(range(q.shape[0]), range(q.shape[1])):
        out[o, i] = qf[o, i] * 2.0 ** (int(sb[o // 128, i // 128]) - 127)
    return out


@pytest.mark.parametrize("shape", [(200, 300), (129, 127), (1, 1), (128, 256), (300, 130)], ids=str)
def test_fp8_dequant_matches_per_element_reference(shape):
    rng = np.random.default_rng(sum(shape))
    q, s = random_fp8(shape, rng)
    got = dequant_fp8_blockwise(q, s, name="w")
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got.astype(np.float64), fp8_reference(q, s))  # exact


def test_fp8_dequant_non_square_block():
    rng = np.random.default_rng(5)
    q, _ = random_fp8((10, 12), rng)
    s = rng.integers(120, 135, (4, 3), dtype=np.uint8).view(E8M0_DTYPE)  # block (3, 5)
    want = q.astype(np.float64) * np.repeat(np.repeat(e8m0_to_float32(s), 3, 0), 5, 1)[:10, :12]
    np.testing.assert_array_equal(dequant_fp8_blockwise(q, s, block=(3, 5)), want)


@pytest.mark.parametrize("shape", [(256, 384), (128, 128)], ids=str)
def test_fp8_dequant_matches_transformers_fp8dequantize(hf_fp8, shape):
    """Fp8Dequantize._dequantize_one is what from_pretrained(dequantize=True) runs per (weight, scale)."""
    q, s = random_fp8(shape, np.random.default_rng(7))
    theirs = hf_fp8.Fp8Dequantize(hf_quantizer=None)._dequantize_one(
        to_torch(q, torch.float8_e4m3fn), to_torch(s, torch.float8_e8m0fnu), output_dtype=torch.float32
    )
    assert_bits_equal(dequant_fp8_blockwise(q, s), theirs.numpy())


@pytest.mark.parametrize("shape", [(200, 300), (256, 384), (129, 1)], ids=str)
def test_fp8_dequant_matches_transformers_explicit_block(hf_fp8, shape):
    """_dequantize_fp8_weight (transformers' backward-pass dequantiser) takes the block size
    explicitly and cuts edge blocks at the border, so it must agree with us on ragged shapes too."""
    if not hasattr(hf_fp8, "_dequantize_fp8_weight"):  # added after transformers 5.17 (the GPU image's)
        pytest.skip("this transformers has no finegrained_fp8._dequantize_fp8_weight")
    q, s = random_fp8(shape, np.random.default_rng(11))
    theirs = hf_fp8._dequantize_fp8_weight(
        to_torch(q, torch.float8_e4m3fn), to_torch(s, torch.float8_e8m0fnu), [128, 128], torch.float32
    )
    assert_bits_equal(dequant_fp8_blockwise(q, s), theirs.numpy())


def test_transformers_fp8dequantize_ragged_blocks_differ(hf_fp8):
    """Pins spec §13.1 for transformers 5.24: on [200, 300] with a [2, 3] scale grid,
    Fp8Dequantize infers 100 x 100 blocks and silently disagrees with the true 128 x 128 tiling.
    If this starts failing, transformers fixed it: update §13.1 and turn this into an equality test."""
    q, s = random_fp8((200, 300), np.random.default_rng(13))
    theirs = hf_fp8.Fp8Dequantize(hf_quantizer=None)._dequantize_one(
        to_torch(q, torch.float8_e4m3fn), to_torch(s, torch.float8_e8m0fnu), output_dtype=torch.float32
    ).numpy()
    ours = dequant_fp8_blockwise(q, s)
    np.testing.assert_array_equal(ours[:100, :100], theirs[:100, :100])  # first true block agrees
    assert not np.array_equal(ours, theirs)


def test_fp8_scale_shape_mismatch_names_key():
    q, s = random_fp8((200, 300), np.random.default_rng(0))
    name = "layers.3.attn.wq_b.weight"
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_b\.weight.*\(2, 2\).*\(200, 300\).*\(2, 3\)"):
        dequant_fp8_blockwise(q, s[:, :2], name=name)
    with pytest.raises(CheckpointError, match=r"layers\.3\.attn\.wq_b\.weight.*\(2, 3\).*\(200, 256\)"):
        dequant_fp8_blockwise(q[:, :256], s, name=name)


@pytest.mark.parametrize(
    "poison, first_bad",
    [("q_nan", "(129, 139)"), ("scale_nan", "(128, 128)"), ("overflow", "(129, 139)")],
)
def test_fp8_non_finite_result_names_key(poison, first_bad):
    q, s = random_fp8((130, 140), np.random.default_rng(1))
    qb, sb = q.view(np.uint8).copy(), s.view(np.uint8).copy()
    if poison == "q_nan":
        qb[129, 139] = 0x7F
    elif poison == "scale_nan":
        sb[1, 1] = 255  # poisons the whole edge block starting at (128, 128)
    else:
        qb[128:, 128:] = 0
        qb[129, 139], sb[1, 1] = 0x7E, 254  # 448 * 2^127 overflows float32
    with pytest.raises(CheckpointError, match=rf"layers\.1\.attn\.wo_b\.weight.*non-finite.*{re.escape(first_bad)}"):
        dequant_fp8_blockwise(qb.view(ml_dtypes.float8_e4m3fn), sb.view(E8M0_DTYPE), name="layers.1.attn.wo_b.weight")


def test_fp8_rejects_wrong_weight_dtype():
    _, s = random_fp8((4, 4), np.random.default_rng(0))
    with pytest.raises(CheckpointError, match=r"w\.weight.*float8_e4m3fn.*float32"):
        dequant_fp8_blockwise(np.zeros((4, 4), np.float32), s, name="w.weight")


# --------------------------------------------------------------------------------------------
# FP4 dequantisation


def test_fp4_dequant_matches_per_element_reference():
    packed, s = random_fp4((8, 96), np.random.default_rng(3))
    pb, sb = packed.view(np.uint8), s.view(np.uint8)
    want = np.empty((8, 96), np.float64)
    for o, i in itertools.product(range(8), range(96)):
        nibble = (pb[o, i // 2] >> (4 * (i % 2))) & 0xF
        want[o, i] = e2m1_reference(int(nibble)) * 2.0 ** (int(sb[o, i // 32]) - 127)
    got = dequant_fp4_blockwise(packed, s)
    assert got.shape == (8, 96) and got.dtype == np.float32
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_fp4_dequant_ragged_input_dim():
    """in = 40: one full 32-block and an 8-wide edge block with its own scale."""
    packed, s = random_fp4((3, 40), np.random.default_rng(4))
    assert s.shape == (3, 2)
    sf = e8m0_to_float32(s)
    want = unpack_fp4_e2m1(packed) * np.concatenate([np.repeat(sf[:, :1], 32, 1), np.repeat(sf[:, 1:], 8, 1)], 1)
    np.testing.assert_array_equal(dequant_fp4_blockwise(packed, s), want)


@pytest.mark.parametrize("shape", [(256, 512), (128, 64)], ids=str)
def test_fp4_dequant_matches_transformers(hf_fp8, shape):
    """Expert weights: int8 [out, in/2] with [out, in/32] e8m0 scales, as Fp8Dequantize sees them."""
    packed, s = random_fp4(shape, np.random.default_rng(9))
    theirs = hf_fp8.Fp8Dequantize(hf_quantizer=None)._dequantize_one(
        torch.from_numpy(packed.copy()), to_torch(s, torch.float8_e8m0fnu), output_dtype=torch.float32
    )
    assert_bits_equal(dequant_fp4_blockwise(packed, s), theirs.numpy())


def test_fp4_scale_shape_mismatch_and_non_finite_name_key():
    packed, s = random_fp4((4, 64), np.random.default_rng(2))
    name = "layers.5.ffn.experts.7.w2.weight"
    with pytest.raises(CheckpointError, match=r"experts\.7\.w2\.weight.*\(4, 1\).*\(4, 64\).*\(4, 2\)"):
        dequant_fp4_blockwise(packed, s[:, :1], name=name)
    sb = s.view(np.uint8).copy()
    sb[3, 1] = 255
    with pytest.raises(CheckpointError, match=r"experts\.7\.w2\.weight.*non-finite.*\(3, 32\)"):
        dequant_fp4_blockwise(packed, sb.view(E8M0_DTYPE), name=name)


# --------------------------------------------------------------------------------------------
# Quantise -> dequantise


def spread_weight(shape, rng) -> np.ndarray:
    """Normal values with row magnitudes spread over 2^-20 .. 2^20, plus an all-zero row."""
    w = rng.standard_normal(shape).astype(np.float32)
    w *= np.exp2(rng.integers(-20, 21, (shape[0], 1))).astype(np.float32)
    w[0] = 0.0
    return w


def block_max(x: np.ndarray, block) -> np.ndarray:
    rows, cols = x.shape
    return np.array(
        [
            [np.abs(x[r : r + block[0], c : c + block[1]]).max() for c in range(0, cols, block[1])]
            for r in range(0, rows, block[0])
        ]
    )


@pytest.mark.parametrize("shape", [(200, 300), (256, 128)], ids=str)
def test_fp8_round_trip_error_bound(shape):
    w = spread_weight(shape, np.random.default_rng(21))
    q, s = quantize_fp8_blockwise(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == E8M0_DTYPE
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    sf = e8m0_to_float32(s).astype(np.float64)
    # Scale is the smallest power of two that fits: block max lands in (224, 448].
    amax = block_max(w, (128, 128))
    ratio = amax / sf
    assert np.all(ratio <= FP8_E4M3_MAX) and np.all((ratio > FP8_E4M3_MAX / 2) | (amax == 0))
    d = dequant_fp8_blockwise(q, s)
    s_elem = np.repeat(np.repeat(sf, 128, 0), 128, 1)[: shape[0], : shape[1]]
    # Round-to-nearest e4m3: half an ulp, i.e. 2^-4 relative for normals, 2^-10 * scale below.
    bound = np.maximum(np.abs(w) * 2.0**-4, 2.0**-10 * s_elem)
    assert np.all(np.abs(d.astype(np.float64) - w) <= bound)
    assert np.max(np.abs(d - w) / np.maximum(np.abs(w), 1e-30)) > 1e-3  # it really was lossy


def test_fp4_round_trip_is_nearest_grid_point():
    w = spread_weight((16, 96), np.random.default_rng(22))
    packed, s = quantize_fp4_blockwise(w)
    assert packed.dtype == np.int8 and packed.shape == (16, 48) and s.shape == (16, 3)
    sf = e8m0_to_float32(s).astype(np.float64)
    amax = block_max(w, (1, 32))
    ratio = amax / sf
    assert np.all(ratio <= FP4_E2M1_MAX) and np.all((ratio > FP4_E2M1_MAX / 2) | (amax == 0))
    d = dequant_fp4_blockwise(packed, s).astype(np.float64)
    s_elem = np.repeat(sf, 32, 1)
    grid = np.unique(np.abs(unpack_fp4_e2m1(np.arange(256, dtype=np.uint8).view(np.int8))))
    all_points = np.concatenate([grid, -grid])[None, None, :] * s_elem[..., None]
    nearest = np.min(np.abs(all_points - w[..., None].astype(np.float64)), axis=-1)
    np.testing.assert_array_equal(np.abs(d - w), nearest)


def test_quantizers_are_exact_on_grid():
    rng = np.random.default_rng(23)
    q, s = random_fp8((200, 300), rng)
    w = dequant_fp8_blockwise(q, s)
    np.testing.assert_array_equal(dequant_fp8_blockwise(*quantize_fp8_blockwise(w)), w)
    packed, s4 = random_fp4((12, 80), rng)
    w4 = dequant_fp4_blockwise(packed, s4)
    np.testing.assert_array_equal(dequant_fp4_blockwise(*quantize_fp4_blockwise(w4)), w4)


def test_quantizers_reject_bad_input():
    with pytest.raises(ValueError, match="even"):
        quantize_fp4_blockwise(np.zeros((2, 31), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8_blockwise(np.array([[1.0, np.inf]], np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blockwise(np.zeros(4, np.float32))
