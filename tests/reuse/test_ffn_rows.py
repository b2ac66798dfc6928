"""`ffn_rows` (DESIGN §4): the FFN sub-layer of an unprotected document row of a reusable layer
is omitted ("omit") or restored from the artifact ("restore"), and the MoE runs over the
protected rows only, gathered. The jitted consumer equals the eager reference (which masks
instead of gathering) in prefill, in a batch and in decode; with every row protected and
latents refreshed every mode is the Recomputed arm; a count of the rows handed to the MoE
shows that the omitted rows really skip it ("run" is every other reuse test's default)."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from redknot_jax import config
from redknot_jax.init import random_model
from redknot_jax.attention import Attention
from redknot_jax.moe import MoE
from redknot_jax.reuse.artifact import stored_bytes
from redknot_jax.reuse.planner import Request, plan_request
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.reuse.runtime import ReuseRuntime
from tests.reuse.test_consumer import _request
from tests.tolerances import TOL, rel_err


@pytest.fixture(scope="module")
def model():
    cfg = config.tiny("mixed")
    return cfg, random_model(cfg, seed=7, dtype=jnp.float32)


def _profile(cfg, mode, **kw):
    kw = {"budget_override": 0.2, "tail_rows": 8, "fanout_mode": "tau", "tau": 0.8, "fanout_min": 2, **kw}
    return dataclasses.replace(tiny_profile(cfg.num_layers), ffn_rows=mode, **kw)


@pytest.mark.parametrize("mode,codec", [("omit", "fp8"), ("restore", "fp4")])
def test_consumer_equals_reference_and_skips_the_rows(model, mode, codec, monkeypatch):
    """Also: artifacts in a compact codec (reuse/codec.py), which the consumer dequantises in its
    layer programs and the eager reference through `Artifact.layer`: the same arithmetic."""
    cfg, m = model
    prof = _profile(cfg, mode, artifact_codec=codec)
    req, arts = _request(cfg, prof, m, 3)
    assert all(a.certificate.codec == codec for a in arts)
    # the byte count by shape alone (launch/artifact_bytes.py) is what the producer wrote
    held = sum(np.asarray(v).nbytes for v in arts[0].payload().values())
    assert stored_bytes(cfg, prof, arts[0].length, jnp.float32)["total"] == held
    if mode == "restore":
        assert all(a.layer(i)["ffn"].shape == (a.length, cfg.hidden_size) for a in arts
                   for i in prof.reusable_layers(cfg.num_layers))
    rt = ReuseRuntime(m, prof, "fp")
    ref = rt.prefill(req, "redknot", require_reuse=True, path="reference")
    # count the rows each MoE call is handed (traced once per program: fresh caches)
    # and the rows whose latent is computed
    seen, call = [], MoE.__call__
    monkeypatch.setattr(MoE, "__call__", lambda self, x, *a, **k: seen.append(x.shape[1]) or call(self, x, *a, **k))
    latent_rows, latent = [], Attention.latent
    monkeypatch.setattr(Attention, "latent", lambda self, x, *a, **k: latent_rows.append(x.shape[1])
                        or latent(self, x, *a, **k))
    jax.clear_caches()
    pool = rt.consumer.pool(arts)
    fast = rt.prefill(req, "redknot", require_reuse=True, pool=pool, decode_rows=4)
    monkeypatch.setattr(MoE, "__call__", call)
    monkeypatch.setattr(Attention, "latent", latent)
    host = rt.prefill(req, "redknot", require_reuse=True, pool=rt.consumer.pool(arts, resident="host"))
    assert rel_err(host.logits, fast.logits) == 0  # the host tier streams the encoded arrays, the same programs
    plan = fast.plan
    assert (plan.protected == ref.plan.protected).all() and 0 < plan.fraction_protected() < 1
    assert rel_err(fast.logits, ref.logits) < TOL["consumer_vs_reference"][0]
    np.testing.assert_array_equal(fast.fanout_hist, ref.fanout_hist)
    n_reusable = len(rt.reusable)
    # every row that ran the MoE counted once per reusable layer: the protected rows only
    assert fast.fanout_hist.sum() == n_reusable * int(plan.protected.sum()) < n_reusable * plan.n_rows
    prot_padded = rt.consumer.buckets(int(plan.protected.sum()), rt.consumer.block)
    t_padded = rt.consumer._rows(plan.n_rows - plan.prefix)
    assert prot_padded < t_padded and prot_padded in seen  # the reusable layers' MoE: gathered rows
    assert plan.prefix and set(seen) == {t_padded, prot_padded}  # fences: every row after the exact prefix
    # latents: the fences' computed rows, and in reusable layers the own rows only (new rows and the
    # rows online entries pool), not the unprotected document rows
    own_padded = rt.consumer.buckets(fast.decode.own, rt.consumer.block)
    assert own_padded < t_padded and set(latent_rows) == {t_padded, own_padded}
    # the mode changes the answer (a negative control against a silently ignored field)
    run = ReuseRuntime(m, dataclasses.replace(prof, ffn_rows="run"), "fp").prefill(req, "redknot", pool=pool)
    assert rel_err(fast.logits, run.logits) > 1e-4
    # decode: each generated row (protected, so it runs the MoE) equals re-running the extended
    # request with the plan frozen
    full = rt.prefill(req, "redknot", require_reuse=True, pool=pool)
    gen = [5, 9, 11]
    for s in range(len(gen)):
        a = rt.next_logits(req, fast, gen[:s + 1])
        b = rt.next_logits(req, full, gen[:s + 1], pool=pool)
        assert rel_err(a, b) < TOL["consumer_vs_reference"][0], s
    if mode == "omit":  # a batch (one program per layer, the MoE over both requests' protected rows)
        short = Request(req.segments[:3])
        ones = [rt.prefill(r, "redknot", pool=pool) for r in (req, short)]
        for o, b in zip(ones, rt.prefill_batch([req, short], "redknot")):
            assert b.arm == "redknot" and rel_err(b.logits, o.logits) < TOL["consumer_vs_reference"][0]
            np.testing.assert_array_equal(b.fanout_hist, o.fanout_hist)


def test_every_row_protected_is_the_recomputed_arm(model):
    """Budget 100 %, latents refreshed, native MoE: every mode is the Recomputed arm (no row is
    left to omit or restore)."""
    cfg, m = model
    for mode in ("omit", "restore"):
        prof = _profile(cfg, mode, budget_override=1.0, latent_refresh="protected", fanout_mode="native")
        req, arts = _request(cfg, prof, m, 3)
        rt = ReuseRuntime(m, prof, "fp")
        red = rt.prefill(req, "redknot", require_reuse=True, pool=rt.consumer.pool(arts))
        assert red.plan.fraction_protected() == 1.0
        assert rel_err(red.logits, rt.prefill(req, "recompute").logits) < TOL["consumer_vs_reference"][0], mode


def test_restore_needs_the_artifacts_ffn(model):
    """A pool of artifacts without canonical FFN outputs cannot serve "restore": a clear error
    (certification refuses them earlier, by profile digest)."""
    cfg, m = model
    built = _profile(cfg, "omit")
    req, arts = _request(cfg, built, m, 3)
    rt = ReuseRuntime(m, dataclasses.replace(built, ffn_rows="restore"), "fp")
    with pytest.raises(ValueError, match="ffn_rows='restore': the pool holds no canonical FFN outputs"):
        rt.consumer.redknot(plan_request(req, rt.profile), req.tokens, rt.consumer.pool(arts))
