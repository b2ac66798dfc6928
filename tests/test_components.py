"""Component identities of the model's building blocks, on fresh random inputs."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax import config, mhc
from redknot_jax.mhc import HyperConnection, sinkhorn
from redknot_jax.rope import apply_rope, inv_freq
from redknot_jax.ring import ring_read, ring_write


def test_rope_tables_match_transformers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    cfg = config.flash()
    rot = DeepseekV4RotaryEmbedding(DeepseekV4Config(**cfg.to_hf_dict()))
    np.testing.assert_allclose(inv_freq(cfg, False), rot.main_inv_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(inv_freq(cfg, True), rot.compress_inv_freq.numpy(), rtol=1e-6)
    f = inv_freq(cfg, True)
    base = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(f[:15], base[:15], rtol=1e-5)  # pairs below lo = 15 unscaled
    np.testing.assert_allclose(f[25:], base[25:] / 16, rtol=1e-5)  # pairs from hi = 25 divided by 16


def test_rope_relative_and_inverse():
    """<R(t) q, R(p) k> depends on t - p only, and R^-1(t) R(t) = I."""
    rng = np.random.default_rng(0)
    freqs = inv_freq(config.tiny(), True)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 32)), jnp.float32) for _ in range(2))
    dot = lambda t, p: float(jnp.sum(apply_rope(q, jnp.array([[t]]), freqs) * apply_rope(k, jnp.array([[p]]), freqs)))
    assert abs(dot(50, 20) - dot(130, 100)) < 1e-4
    back = apply_rope(apply_rope(q, jnp.array([[77]]), freqs), jnp.array([[77]]), freqs, inverse=True)
    np.testing.assert_allclose(back, q, atol=1e-5)
    np.testing.assert_array_equal(apply_rope(q, jnp.array([[9]]), freqs)[..., :24], q[..., :24])  # nope dims


def test_sinkhorn_doubly_stochastic_in_every_form():
    """Unrolled and as a loop (training's): the same matrices, those of the reductions written as
    reduce ops (jax.nn.softmax, jnp.sum), which `fold` replaces."""
    logits = jax.random.normal(jax.random.key(0), (5, 4, 4))
    c = sinkhorn(logits, iters=20, eps=1e-6)
    np.testing.assert_allclose(c.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(c.sum(-1), 1.0, atol=1e-3)
    np.testing.assert_allclose(sinkhorn(logits, iters=20, eps=1e-6, unroll=False), c, rtol=1e-6, atol=1e-7)
    ref = jax.nn.softmax(logits, axis=-1) + 1e-6
    ref = ref / (ref.sum(-2, keepdims=True) + 1e-6)
    for _ in range(19):
        ref = ref / (ref.sum(-1, keepdims=True) + 1e-6)
        ref = ref / (ref.sum(-2, keepdims=True) + 1e-6)
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("r,pos0,n", [(8, 0, 5), (8, 13, 8), (8, 21, 0), (256, 300, 40)])
def test_ring_round_trip(r, pos0, n):
    """Writing the positions ending at pos0+n then reading at pos0+n returns them in order."""
    b = 2
    start = pos0 - r
    ext = jnp.arange(start, pos0 + n)[None, :, None].repeat(b, 0).astype(jnp.float32)
    ring = ring_write(ext, jnp.full((b,), start), jnp.full((b,), pos0 + n), r)
    got = ring_read(ring, jnp.full((b,), pos0 + n))
    np.testing.assert_array_equal(got[0, :, 0], np.arange(pos0 + n - r, pos0 + n))


def test_mhc_forms_equal_the_forms_they_replaced():
    """`HyperConnection.post` (the stream sum written out) equals the batched-matmul form it
    replaced, in fp32 exactly up to summation order and in bf16 within one rounding;
    `mhc.mix_logits` (the norm as a row scale after the projection) equals the normalise-then-
    project form in fp32 up to summation order and for bf16 streams within fn's split into two
    bf16 parts; `launch/bench_mhc.py` (which times both pairs) runs."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("bench_mhc", pathlib.Path(__file__).parents[1] / "launch/bench_mhc.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ks = jax.random.split(jax.random.key(7), 4)
    for dt, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        x = jax.random.normal(ks[0], (2, 5, 4, 32), dt)
        y = jax.random.normal(ks[1], (2, 5, 32), dt)
        post = jax.random.uniform(ks[2], (2, 5, 4))
        comb = jax.nn.softmax(jax.random.normal(ks[3], (2, 5, 4, 4)), -1)
        got = HyperConnection.post(x, y, post, comb)
        want = bench.post_matmul(x, y, post, comb)
        assert got.dtype == want.dtype == dt
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    for dt, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-4)):  # mix_logits: the norm applied after the projection
        x = jax.random.normal(ks[0], (2, 5, 4, 32), dt) * 3.0
        fn = jax.random.normal(ks[1], (24, 128), jnp.float32)
        got, want = mhc.mix_logits(x, fn, 1e-6), bench.mix_logits_normalized(x, fn, 1e-6)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * float(jnp.max(jnp.abs(want))))
    res = bench.main(["--rows", "16", "--hidden", "64", "--iters", "2"])
    assert res["post_streams_max_rel_diff"] < 1e-2 and res["pre_ms"] > 0 and res["logits_scaled_max_rel_diff"] < 1e-4
    assert res["command"] == "python launch/bench_mhc.py --rows 16 --hidden 64 --iters 2"


def test_bench_moe_runs_and_chunking_changes_nothing():
    """`launch/bench_moe.py` times one routed MoE layer per token chunk; every chunk gives the
    first chunk's output exactly (tokens are independent)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("bench_moe", pathlib.Path(__file__).parents[1] / "launch/bench_moe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = bench.main(["--tokens", "48", "--experts", "8,16", "--chunks", "16,48", "--kernels", "xla", "--hidden", "64",
                      "--inter", "32", "--iters", "1"])
    assert [(r["experts"], r["chunk"]) for r in res["rows"]] == [(8, 16), (8, 48), (16, 16), (16, 48)]
    assert all(r["max_rel_diff"] == 0.0 and r["ms"] > 0 for r in res["rows"])
    assert res["command"].startswith("python launch/bench_moe.py --tokens 48")
