"""Artifact codecs (reuse/codec.py): FP8 (e4m3 + e8m0 block scales) and NVFP4 (e2m1 + e4m3
block scales + an fp32 row scale) against numpy / ml_dtypes, the latents' exact RoPE part, the
narrow top-k ids, the bytes each codec stores, and clear errors."""

import ml_dtypes
import numpy as np
import jax.numpy as jnp
import pytest

from redknot_jax.reuse import codec


def _rows(shape, seed=0):
    rng = np.random.default_rng(seed)  # rows of very different magnitudes, one all-zero row
    x = rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape[:-1] + (1,)))
    x[0] = 0
    return x.astype(np.float32)


def test_fp8_is_e4m3_of_the_value_over_its_power_of_two_block_scale():
    x = _rows((6, 3, 448))  # 448 columns: Flash's NoPE part, blocks of 64
    e = codec.encode_fp8(jnp.asarray(x))
    assert e["e4m3"].dtype == jnp.float8_e4m3fn and e["e8m0"].shape == (6, 3, 7)
    scale = np.ldexp(1.0, np.asarray(e["e8m0"], np.int32) - 127)  # exact powers of two
    xb = x.reshape(6, 3, 7, 64)
    amax = np.abs(xb).max(-1)
    # the smallest power of two keeping the block within 448 (zero blocks: the smallest scale)
    assert (amax <= 448 * scale).all() and ((amax > 224 * scale) | (amax == 0)).all()
    want = (xb / scale[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale[..., None]
    got = np.asarray(codec.decode_fp8(e, jnp.float32))
    np.testing.assert_array_equal(got, want.reshape(x.shape))
    assert (got[0] == 0).all()
    nz = np.abs(x) > 1e-30
    assert np.max(np.abs(got - x)[nz] / np.abs(x)[nz]) <= 2 ** -4 + 1e-6  # e4m3: 3 mantissa bits (normals)


def test_fp4_values_and_error():
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    x = np.concatenate([grid, -grid[::-1]])[None].repeat(2, 0) * np.float32(3.0)  # exact on the grid x 3
    e = codec.encode_fp4(jnp.asarray(x))
    assert e["e2m1"].dtype == jnp.uint8 and e["e2m1"].shape == (2, 8) and e["e4m3"].shape == (2, 1)
    np.testing.assert_array_equal(np.asarray(codec.decode_fp4(e, jnp.float32)), x)
    # each value decodes to its nearest point of the block's scaled e2m1 grid
    x = _rows((5, 2, 64), seed=1)
    e = codec.encode_fp4(jnp.asarray(x))
    got = np.asarray(codec.decode_fp4(e, jnp.float32))
    eff = (np.asarray(e["e4m3"]).astype(np.float32) * np.asarray(e["fp32"]))[..., None]  # [5, 2, 4, 1]
    pts = np.concatenate([grid, -grid[1:]])
    cand = (pts * eff)  # [5, 2, 4, 15]
    xb = x.reshape(5, 2, 4, 16)
    best = np.abs(xb[..., None] - cand[..., None, :]).min(-1)
    np.testing.assert_allclose(np.abs(got.reshape(xb.shape) - xb), best, rtol=1e-5, atol=1e-30)
    assert (got[0] == 0).all()
    rel = np.linalg.norm(got - x) / np.linalg.norm(x)
    assert 0.02 < rel < 0.15  # NVFP4 on Gaussian rows: ~9 % (a lossy format, not a no-op)


def test_layer_codecs_bytes_and_round_trip():
    n, k, r, g, o, d, K = 40, 64, 16, 2, 64, 192, 8
    rng = np.random.default_rng(2)
    layer = {"kv": _rows((n, k)), "zl": _rows((n, g, o)), "ffn": _rows((n, d)), "entries": _rows((n // 4, k)),
             "idx_entries": _rows((n // 4, 32)), "far": rng.random(n).astype(np.float32),
             "topk": rng.integers(-1, n // 4, (n, K)).astype(np.int32)}
    layer = {name: jnp.asarray(v) for name, v in layer.items()}
    nbytes = lambda t: sum(np.asarray(a).nbytes for a in __import__("jax").tree.leaves(t))
    sizes = {}
    for c in codec.CODECS:
        enc = codec.encode_layer(layer, c, rope_dim=r)
        sizes[c] = nbytes(enc)
        dec = codec.dense(enc)
        assert codec.produced_dtype(enc) == jnp.float32
        for name in ("far", "idx_entries"):  # never quantised
            np.testing.assert_array_equal(dec[name], layer[name])
        np.testing.assert_array_equal(dec["topk"], layer["topk"])
        assert dec["topk"].dtype == jnp.int32
        for name in ("kv", "entries"):  # the RoPE part exact, the NoPE part within FP8
            np.testing.assert_array_equal(dec[name][:, -r:], layer[name][:, -r:])
            assert codec.shape(enc[name]) == layer[name].shape
        for name, tol in (("kv", 0.04), ("zl", 0.04 if c != "fp4" else 0.15), ("ffn", 0.04 if c != "fp4" else 0.15)):
            err = float(jnp.linalg.norm(dec[name] - layer[name]) / jnp.linalg.norm(layer[name]))
            assert (err == 0) == (c == "dense") and err < tol, (c, name, err)
        if c != "dense":
            assert enc["topk"].dtype == jnp.int16 and enc["kv"]["rope"].dtype == jnp.float32
        idx = jnp.asarray([[3, 0], [7, 3]])  # rows gathered encoded, then decoded: the same values
        for name in ("kv", "zl", "ffn", "idx_entries"):
            np.testing.assert_array_equal(codec.rows(enc[name], idx, jnp.float32), dec[name][idx])
    assert sizes["dense"] > sizes["fp8"] > sizes["fp4"]
    assert codec.topk_dtype(32768) == jnp.int16 and codec.topk_dtype(32769) == jnp.int32


def test_errors_name_the_codec_and_field():
    with pytest.raises(codec.CodecError, match="expected one of .*'int8'"):
        codec.encode_layer({}, "int8", rope_dim=8)
    with pytest.raises(codec.CodecError, match="field 'zl' has 24 columns, not a multiple of the NVFP4 block 16"):
        codec.encode_layer({"zl": jnp.zeros((4, 2, 24))}, "fp4", rope_dim=8)
    with pytest.raises(codec.CodecError, match="field 'kv' has 8 columns, rope_dim 8 leaves no NoPE part"):
        codec.encode_layer({"kv": jnp.zeros((4, 8))}, "fp8", rope_dim=8)
    with pytest.raises(codec.CodecError, match="rows of an encoded field without an exact part need a dtype"):
        codec.rows(codec.encode_fp8(jnp.ones((4, 16))), jnp.asarray([0]))
    with pytest.raises(codec.CodecError, match="not an encoded field"):
        codec.decode({"q": jnp.zeros(3)}, jnp.float32)
