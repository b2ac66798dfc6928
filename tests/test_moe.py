"""MoE: the tiled grouped matmul against jax.lax.ragged_dot (its reference), and the layer
against a per-token loop over the chosen experts."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.init import random_model
from redknot_jax.moe import swiglu
from redknot_jax.pallas.ragged_dot import grouped_matmul
from tests.tolerances import rel_err


@pytest.mark.parametrize("sizes,tile", [([5, 0, 17, 3], 4), ([0, 0, 32, 0], 8), ([1, 2, 3, 4], 16), ([7, 9, 0, 2], 1)])
def test_grouped_matmul_matches_ragged_dot(sizes, tile):
    rng = np.random.default_rng(sum(sizes) + tile)
    m = sum(sizes) + 3  # trailing rows outside every group come back zero
    x = jnp.asarray(rng.normal(size=(m, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 6, 5)), jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, s, tile)
    ref = jax.lax.ragged_dot(x, w, s)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[sum(sizes):], 0)


def test_moe_layer_matches_per_token_loop():
    cfg = config.tiny("mixed")
    model = random_model(cfg, seed=3, dtype=jnp.float32)
    moe = model.layers[4].ffn  # a learned-router layer
    x = jax.random.normal(jax.random.key(1), (2, 9, cfg.hidden_size))
    ids = jnp.zeros((2, 9), jnp.int32)
    y = np.asarray(moe(x, ids)).reshape(-1, cfg.hidden_size)
    xf = np.asarray(x).reshape(-1, cfg.hidden_size)
    sel, wts, _ = moe.route(jnp.asarray(xf), jnp.zeros(18, jnp.int32))
    w1, w3, w2 = (np.asarray(v[...]) for v in (moe.w1, moe.w3, moe.w2))
    for n in range(18):
        ref = np.asarray(moe.shared(jnp.asarray(xf[n:n + 1])))[0]
        for j in range(cfg.experts_per_tok):
            e = int(sel[n, j])
            h = np.asarray(swiglu(xf[n] @ w1[e], xf[n] @ w3[e], cfg.swiglu_limit))
            ref = ref + float(wts[n, j]) * (h @ w2[e])
        assert rel_err(y[n], ref) < 1e-5, n


def test_keep_mask_comes_back_from_the_chunked_path():
    """The fan-out mask the MoE applied is returned, also when tokens run in chunks."""
    from redknot_jax.reuse.fanout import fanout_keep

    cfg = config.tiny("mixed", experts_per_tok=6)
    moe = random_model(cfg, seed=5, dtype=jnp.float32).layers[4].ffn
    x = jax.random.normal(jax.random.key(2), (1, 20, cfg.hidden_size))
    ids = jnp.zeros((1, 20), jnp.int32)
    keep_fn = lambda s, w, sc: fanout_keep(w, "k3")
    y1, k1 = moe(x, ids, keep_fn, with_keep=True)
    y2, k2 = moe(x, ids, keep_fn, chunk=8, with_keep=True)  # 3 chunks, padded
    np.testing.assert_array_equal(k1, k2)
    assert k1.shape == (1, 20, 6) and (k1.sum(-1) == 3).all()
    assert rel_err(y2, y1) < 1e-6
    _, none = moe(x, ids, with_keep=True)
    assert none.all()


def test_token_chunk_grows_with_the_expert_count(monkeypatch):
    """4096 tokens up to 64 experts, then 64 tokens per expert (Flash's 256: 16384, Pro's 384:
    24576). `tp._moe` asks for the rank's count times tp (here tp = 1, outside shard_map)."""
    from redknot_jax import moe as moe_mod
    from redknot_jax.sharding import tp as tpmod

    assert [moe_mod.token_chunk(e) for e in (8, 16, 64, 256, 384)] == [4096, 4096, 4096, 16384, 24576]
    seen = []
    monkeypatch.setattr(tpmod, "token_chunk", lambda e: seen.append(e) or moe_mod.token_chunk(e))
    cfg = config.tiny("mixed")
    layer = random_model(cfg, seed=1, dtype=jnp.float32).layers[4].ffn
    x = jnp.zeros((1, 4, cfg.hidden_size))
    tpmod._moe(layer, x, jnp.zeros((1, 4), jnp.int32), 1)
    assert seen == [cfg.n_routed_experts]  # tp = 1: the rank holds every expert
