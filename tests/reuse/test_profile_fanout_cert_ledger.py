"""Profiles, MoE fan-out, certificates and ledgers of the reuse runtime (DESIGN.md §2, §4-§6)."""

import dataclasses
import json
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from redknot_jax import config
from redknot_jax.moe import MoE, swiglu
from redknot_jax.reuse import ledger
from redknot_jax.reuse.certificate import (FORMAT_VERSION, CertCounters, Certificate, CertificateError,
                                           FallbackReason, TPGeometry, explain, payload_digest,
                                           token_digest, validate)
from redknot_jax.reuse.fanout import fanout_histogram, fanout_keep, make_keep_fn, mean_kept
from redknot_jax.reuse.profile import (ProfileError, RedKnotProfile, flash_profile, head_row_ceiling,
                                       pro_profile, tiny_profile)
from tests.tolerances import TOL, rel_err


# =============================================================================== profile
def test_head_row_ceilings():
    # Flash 37 reusable x 56 Local / (43 x 64) = 2072 / 2752; Pro 55 x 112 / (61 x 128) = 6160 / 7808
    flash = head_row_ceiling(config.flash(), flash_profile())
    pro = head_row_ceiling(config.pro(), pro_profile())
    assert round(flash, 4) == 0.7529 and flash == 2072 / 2752
    assert round(pro, 4) == 0.7889 and pro == 6160 / 7808


def test_flash_pro_layouts():
    f, p = flash_profile(), pro_profile()
    assert f.reusable_layers(43) == range(3, 40) and len(f.reusable_layers(43)) == 37
    assert len(p.reusable_layers(61)) == 55
    assert [f.is_fence(i, 43) for i in (0, 2, 3, 39, 40, 42)] == [True, True, False, False, True, True]
    for cfg, prof, n_local in ((config.flash(), f, 56), (config.pro(), p, 112)):
        local = prof.local_heads(cfg.heads_per_group)
        assert local == tuple(range(1, 8))  # default Global head: the group's first
        assert cfg.o_groups * len(local) == n_local
        assert cfg.num_heads - cfg.o_groups * len(local) == cfg.o_groups


def test_local_heads_follow_global_head():
    assert RedKnotProfile("x", global_head=2).local_heads(8) == (0, 1, 3, 4, 5, 6, 7)
    with pytest.raises(ProfileError, match="global_head.*heads_per_group 8.*got 8"):
        RedKnotProfile("x", global_head=8).local_heads(8)


def test_tiny_profile():
    t = tiny_profile(6)
    assert t.reusable_layers(6) == range(1, 5) and (t.boundary_rows, t.tail_rows) == (8, 8)
    assert head_row_ceiling(config.tiny("mixed"), t) == 4 * 6 / (6 * 8)  # 4 reusable x 6 Local
    assert tiny_profile(4).reusable_layers(4) == range(1, 3)
    with pytest.raises(ProfileError, match="n_layers.*got 2"):
        tiny_profile(2)


@pytest.mark.parametrize("field,value,match", [
    ("name", "", "name"),
    ("fence_first", -1, "fence_first.*-1"),
    ("fence_last", 1.5, "fence_last.*1.5"),
    ("global_head", True, "global_head.*True"),
    ("latent_refresh", "all", "latent_refresh.*'all'"),
    ("itop_rank", "random", "itop_rank.*'random'"),
    ("boundary_rows", -3, "boundary_rows.*-3"),
    ("tail_rows", "big", "tail_rows.*'big'"),
    ("budgets", (), r"budgets.*\(\)"),
    ("budgets", (0.2, 0.1, 0.3), r"budgets.*\(0.2, 0.1, 0.3\)"),
    ("budgets", (0.1, 0.2, 1.5), "budgets.*1.5"),
    ("budgets", "0.1", "budgets.*'0.1'"),
    ("concentration_thresholds", (0.5,), r"concentration_thresholds.*expected 2 entries.*\(0.5,\)"),
    ("concentration_thresholds", (0.5, 0.8), r"concentration_thresholds.*\(0.5, 0.8\)"),
    ("concentration_thresholds", (1.2, 0.5), "concentration_thresholds.*1.2"),
    ("fanout_mode", "top2", "fanout_mode.*'top2'"),
    ("ffn_rows", "skip", "ffn_rows.*'skip'"),
    ("artifact_codec", "int8", "artifact_codec.*'int8'"),
    ("tau", 0.0, "tau.*0.0"),
    ("tau", 1.5, "tau.*1.5"),
    ("tau", float("nan"), "tau.*nan"),
    ("fanout_min", 0, "fanout_min.*0"),
    ("budget_override", 0.0, "budget_override.*0.0"),
    ("budget_override", 2, "budget_override.*2"),
])
def test_profile_validation(field, value, match):
    with pytest.raises(ProfileError, match=match):
        RedKnotProfile(**{"name": "x", field: value})


def test_profile_layer_errors():
    p = flash_profile()
    with pytest.raises(ProfileError, match="fences 3\\+3 exceed n_layers 5"):
        p.reusable_layers(5)
    with pytest.raises(ProfileError, match="layer.*got 43"):
        p.is_fence(43, 43)


# every field -> another valid value (the digest-sensitivity test fails if a new field is missing)
PROFILE_ALTERNATIVES = dict(
    name="other", fence_first=2, fence_last=4, global_head=3, latent_refresh="protected", itop_rank="deviation",
    boundary_rows=64, tail_rows=4096, budgets=(0.05, 0.20, 0.25), concentration_thresholds=(0.9, 0.5),
    fanout_mode="k3", tau=0.8, fanout_min=4, budget_override=1.0, ffn_rows="omit", artifact_codec="fp4")


def test_profile_round_trip():
    custom = RedKnotProfile(**PROFILE_ALTERNATIVES)
    for p in (flash_profile(), pro_profile(), tiny_profile(5), custom):
        assert RedKnotProfile.from_dict(p.to_dict()) == p
        back = RedKnotProfile.from_dict(json.loads(json.dumps(p.to_dict())))  # lists, not tuples
        assert back == p and isinstance(back.budgets, tuple) and hash(back) == hash(p)
    with pytest.raises(ProfileError, match=r"unknown profile fields \['taus'\]"):
        RedKnotProfile.from_dict({"name": "x", "taus": 0.9})
    with pytest.raises(ProfileError, match="missing required field 'name'"):
        RedKnotProfile.from_dict({"tau": 0.9})


def test_profile_digest_stable_and_sensitive():
    base = dataclasses.replace(flash_profile(), artifact_codec="dense")
    d = base.digest()
    assert len(d) == 64 and int(d, 16) >= 0
    assert dataclasses.replace(flash_profile(), artifact_codec="dense").digest() == d
    assert RedKnotProfile.from_dict(json.loads(json.dumps(base.to_dict()))).digest() == d
    # numerically equal inputs give one digest (JSON would write 1 and 1.0 differently)
    assert RedKnotProfile("x", budget_override=1).digest() == RedKnotProfile("x", budget_override=1.0).digest()
    assert set(PROFILE_ALTERNATIVES) == {f.name for f in dataclasses.fields(RedKnotProfile)}
    seen = {d}
    for field, value in PROFILE_ALTERNATIVES.items():
        changed = dataclasses.replace(base, **{field: value})
        assert changed.digest() not in seen, f"digest blind to {field}"
        seen.add(changed.digest())
    # a dense profile hashes as before the codec field existed (stored artifacts stay valid)
    assert "artifact_codec" not in base.to_dict()


def test_controller_rule():
    p = flash_profile()  # budgets (0.10, 0.20, 0.25), thresholds (0.8, 0.5)
    assert [p.choose_budget(c) for c in (1.0, 0.95, 0.8)] == [0.10] * 3      # concentrated
    assert [p.choose_budget(c) for c in (0.79, 0.6, 0.5)] == [0.20] * 3
    assert [p.choose_budget(c) for c in (0.49, 0.1, 0.0)] == [0.25] * 3      # diffuse
    grid = [p.choose_budget(c) for c in np.linspace(0, 1, 101)]
    assert all(a >= b for a, b in zip(grid, grid[1:]))  # more concentrated -> never a larger budget
    assert dataclasses.replace(p, budget_override=1.0).choose_budget(0.99) == 1.0
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ProfileError, match="concentration"):
            p.choose_budget(bad)


# =============================================================================== fan-out
def _keep(w, mode="tau", tau=0.9, k_min=3):
    return np.asarray(fanout_keep(jnp.asarray([w], jnp.float32), mode, tau, k_min))[0]


def test_fanout_concentrated_keeps_three():
    # top-1 already holds 0.9 of the mass, but never fewer than k_min = 3
    assert _keep([0.90, 0.05, 0.02, 0.01, 0.01, 0.01]).tolist() == [1, 1, 1, 0, 0, 0]


def test_fanout_ambiguous_keeps_more():
    # flat: the first five hold 5/6 = 0.83 < 0.9, so all six are needed
    assert _keep([1 / 6] * 6).all()
    # cumulative 0.30, 0.55, 0.75, 0.90 -> tau 0.85 is reached at 4 experts
    w = [0.30, 0.25, 0.20, 0.15, 0.06, 0.04]
    assert _keep(w, tau=0.85).tolist() == [1, 1, 1, 1, 0, 0]
    # any order in, the mask follows the weights; the routed scale does not change the count
    perm = [4, 0, 5, 2, 1, 3]
    assert _keep([w[i] for i in perm], tau=0.85).tolist() == [int(i < 4) for i in perm]
    assert _keep([1.5 * x for x in w], tau=0.85).tolist() == [1, 1, 1, 1, 0, 0]


def test_fanout_floor_and_modes():
    w = [0.30, 0.25, 0.20, 0.15, 0.06, 0.04]
    assert _keep(w, tau=0.01).sum() == 3                 # never below k_min
    assert _keep(w, tau=0.01, k_min=4).sum() == 4
    assert _keep(w, tau=1.0).sum() == 6
    # "reaches tau" is inclusive: binary-exact masses 0.5, 0.75, 0.875 meet tau = 0.875 at 3
    assert _keep([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], tau=0.875, k_min=1).sum() == 3
    assert _keep([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], tau=0.75, k_min=1).sum() == 2
    flat = [1 / 6] * 6
    assert _keep(flat, mode="k3").tolist() == [1, 1, 1, 0, 0, 0]   # ties: lower column first
    assert _keep([0.01, 0.5, 0.02, 0.3, 0.1, 0.07], mode="k3").tolist() == [0, 1, 0, 1, 1, 0]
    assert _keep([0.9, 0.1, 0, 0, 0, 0], mode="native").all()
    # fewer native experts than k_min (tiny configs): keep them all
    assert np.asarray(fanout_keep(jnp.asarray([[0.9, 0.1]]), "tau", 0.5, 3)).all()


def test_fanout_jit_with_traced_tau():
    f = jax.jit(fanout_keep, static_argnames=("mode", "k_min"))
    w = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(6) * 0.5, size=256), jnp.float32)
    for tau in (0.5, 0.9, 0.99):
        assert np.array_equal(f(w, "tau", tau, 3), fanout_keep(w, "tau", tau, 3))
    counts = [np.asarray(f(w, "tau", jnp.float32(t), 3)).sum() for t in (0.5, 0.99)]
    assert counts[0] < counts[1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="top2"), "mode.*'top2'"), (dict(tau=0.0), "tau.*0.0"), (dict(tau=1.2), "tau.*1.2"),
    (dict(k_min=0), "k_min.*0")])
def test_fanout_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fanout_keep(jnp.ones((2, 6)), **{"mode": "tau", "tau": 0.9, "k_min": 3, **kwargs})


def test_fanout_histogram():
    keep = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0] * 6], bool)
    hist = fanout_histogram(keep)
    assert hist.tolist() == [1, 0, 0, 2, 0, 0, 1]
    assert mean_kept(hist) == (0 + 3 + 3 + 6) / 4
    assert fanout_histogram(np.ones((2, 5, 6), bool)).tolist() == [0, 0, 0, 0, 0, 0, 10]


def _random_moe():
    # top-6 over 8 experts so the fan-out has something to trim (tiny("mixed") routes top-3)
    cfg = config.tiny("mixed", experts_per_tok=6)
    moe = MoE(cfg, layer=4, dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(7), 6)
    d, f = cfg.hidden_size, cfg.moe_inter_dim
    for key, (name, std) in zip(keys, [("gate", 1.0), ("bias", 0.1), ("w1", d ** -0.5), ("w3", d ** -0.5),
                                       ("w2", f ** -0.5), ("s1", d ** -0.5)]):
        setattr(moe, name, nnx.Param(jax.random.normal(key, getattr(moe, name).shape, jnp.float32) * std))
    return cfg, moe


def test_fanout_keeps_original_weights_through_moe():
    cfg, moe = _random_moe()
    x = jax.random.normal(jax.random.key(1), (64, cfg.hidden_size), jnp.float32)
    sel, wts, _ = moe.route(x, jnp.zeros(64, jnp.int32))
    keep = fanout_keep(wts, "tau", 0.9, 3)
    hist = fanout_histogram(keep)
    assert hist[:3].sum() == 0 and np.count_nonzero(hist[3:]) >= 2, f"fan-out did not vary: {hist}"
    out = np.asarray(moe.experts(x, sel, wts, keep))

    w1, w3, w2 = (np.asarray(getattr(moe, n)[...], np.float64) for n in ("w1", "w3", "w2"))
    xs, sel_np, w_np, k_np = np.asarray(x, np.float64), np.asarray(sel), np.asarray(wts), np.asarray(keep)

    def manual(weights):
        y = np.zeros_like(xs)
        for i in range(xs.shape[0]):
            for j in np.flatnonzero(k_np[i]):
                e = sel_np[i, j]
                h = np.asarray(swiglu(xs[i] @ w1[e], xs[i] @ w3[e], cfg.swiglu_limit), np.float64)
                y[i] += weights[i, j] * (h @ w2[e])
        return y

    # summation order is the only difference (grouped ragged_dot vs per-token loop)
    tol = TOL["chunked_vs_oneshot"][0]
    assert rel_err(out, manual(w_np)) <= tol
    renormed = w_np * k_np * (w_np.sum(-1, keepdims=True) / (w_np * k_np).sum(-1, keepdims=True))
    assert rel_err(out, manual(renormed)) > 100 * tol       # renormalising would be visible
    assert rel_err(out, np.asarray(moe.experts(x, sel, wts))) > 100 * tol  # and so is the trimming
    # the profile's hook into MoE.__call__ applies the same mask
    prof = tiny_profile(6)
    hooked = moe(x[None], jnp.zeros((1, 64), jnp.int32), keep_fn=make_keep_fn(prof))[0]
    assert rel_err(hooked, out + np.asarray(moe.shared(x))) <= tol


# =============================================================================== certificate
TP = TPGeometry(tp_size=8, rank=3, channel_ranges=((3072, 4096),))
H = lambda c: c * 64  # a syntactically valid SHA-256 hex digest


def _cert(**over):
    base = dict(checkpoint_fingerprint="ckpt-A", token_digest=token_digest([5, 6, 7]),
                profile_digest=flash_profile().digest(), model_digest=config.tiny("mixed").fingerprint(),
                tp=TP, generation=4, format_version=FORMAT_VERSION, layers=(3, 4, 5), payload_digest=H("a"))
    return Certificate(**{**base, **over})


def _expect(**over):
    c = _cert()
    base = dict(expected_tokens_digest=c.token_digest, profile_digest=c.profile_digest,
                model_digest=c.model_digest, checkpoint_fingerprint=c.checkpoint_fingerprint, tp=TP,
                min_generation=4, required_layers=[3, 4, 5], actual_payload_digest=c.payload_digest)
    return {**base, **over}


def test_certificate_accepts_matching():
    assert validate(_cert(), **_expect()) is None
    assert validate(_cert(generation=9), **_expect()) is None          # newer than required
    assert validate(_cert(), **_expect(required_layers=[4])) is None    # a subset suffices
    assert validate(_cert(format_version=3), **_expect()) is None       # an older format still relocates
    assert validate(_cert(parts=("ffn", "prefix")), **_expect(required_parts=["ffn"])) is None
    assert validate(_cert(codec="fp4"), **_expect(codec="fp4")) is None


@pytest.mark.parametrize("cert_over,expect_over,reason", [
    ({}, dict(expected_tokens_digest=token_digest([5, 6, 8])), FallbackReason.TOKEN_MISMATCH),
    ({}, dict(profile_digest=pro_profile().digest()), FallbackReason.PROFILE_MISMATCH),
    ({}, dict(model_digest=config.tiny("csa").fingerprint()), FallbackReason.CONFIG_MISMATCH),
    ({}, dict(checkpoint_fingerprint="ckpt-B"), FallbackReason.CHECKPOINT_MISMATCH),
    ({}, dict(tp=TPGeometry(8, 2, ((2048, 3072),))), FallbackReason.TP_GEOMETRY),
    ({}, dict(tp=TPGeometry(8, 3, ((3072, 4095),))), FallbackReason.TP_GEOMETRY),
    ({}, dict(tp=TPGeometry(4, 3, ((3072, 4096),))), FallbackReason.TP_GEOMETRY),
    ({}, dict(min_generation=5), FallbackReason.STALE_GENERATION),
    ({}, dict(required_layers=[3, 4, 5, 6]), FallbackReason.MISSING_LAYERS),
    ({}, dict(actual_payload_digest=H("b")), FallbackReason.CHECKSUM),
    (dict(format_version=FORMAT_VERSION + 1), {}, FallbackReason.UNKNOWN_ARTIFACT),
    (dict(format_version=2), {}, FallbackReason.UNKNOWN_ARTIFACT),
    (dict(parts=("prefix",)), dict(required_parts=["ffn"]), FallbackReason.MISSING_PART),
    (dict(format_version=3), dict(required_parts=["ffn"]), FallbackReason.MISSING_PART),
    (dict(codec="fp8"), {}, FallbackReason.CODEC_MISMATCH),
    ({}, dict(codec="fp4"), FallbackReason.CODEC_MISMATCH),
    (dict(format_version=4), dict(codec="fp8"), FallbackReason.CODEC_MISMATCH),  # format 4 is dense
])
def test_certificate_each_check(cert_over, expect_over, reason):
    assert validate(_cert(**cert_over), **_expect(**expect_over)) is reason


def test_certificate_check_order_and_messages():
    assert validate(None, **_expect()) is FallbackReason.UNKNOWN_ARTIFACT
    # several failures: the first in the documented order wins
    both = _expect(expected_tokens_digest=H("c"), actual_payload_digest=H("b"))
    assert validate(_cert(), **both) is FallbackReason.TOKEN_MISMATCH
    assert validate(_cert(), **_expect(profile_digest=H("c"), required_layers=[9])) is FallbackReason.PROFILE_MISMATCH
    assert validate(_cert(), **_expect(min_generation=7, required_layers=[9])) is FallbackReason.STALE_GENERATION
    reason, msg = explain(_cert(), **_expect(required_layers=[2, 3, 6]))
    assert reason is FallbackReason.MISSING_LAYERS and "[2, 6]" in msg
    reason, msg = explain(_cert(), **_expect(min_generation=7))
    assert ">= 7" in msg and "got 4" in msg


# every field -> another valid value (the test fails if a new field is missing here)
CERT_ALTERNATIVES = dict(
    checkpoint_fingerprint="ckpt-B", token_digest=token_digest([5, 6]), profile_digest=H("1"),
    model_digest=H("2"), tp=TPGeometry(8, 3, ((3072, 4095),)), generation=5,
    format_version=FORMAT_VERSION + 1, layers=(3, 4), payload_digest=H("3"), parts=("prefix",), codec="fp8")


def test_certificate_digest_stable_and_sensitive():
    c = _cert()
    assert c.digest() == _cert().digest() and len(c.digest()) == 64
    back = Certificate.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c and back.digest() == c.digest()
    old = _cert(format_version=4)  # before format 5 no codec field: older certificates keep their digests
    assert "codec" not in old.to_dict() and Certificate.from_dict(old.to_dict()) == old
    assert set(CERT_ALTERNATIVES) == {f.name for f in dataclasses.fields(Certificate)}
    seen = {c.digest()}
    for field, value in CERT_ALTERNATIVES.items():
        d = dataclasses.replace(c, **{field: value}).digest()
        assert d not in seen, f"digest blind to {field}"
        seen.add(d)
    for tp in (TPGeometry(4, 3, TP.channel_ranges), TPGeometry(8, 2, TP.channel_ranges),
               TPGeometry(8, 3, ((3072, 3584), (3584, 4096)))):
        assert dataclasses.replace(c, tp=tp).digest() not in seen


@pytest.mark.parametrize("over,match", [
    (dict(token_digest="abc"), "token_digest.*'abc'"),
    (dict(payload_digest=H("A")), "payload_digest"),
    (dict(checkpoint_fingerprint=""), "checkpoint_fingerprint"),
    (dict(generation=-1), "generation.*-1"),
    (dict(format_version=0), "format_version.*0"),
    (dict(layers=(4, 3)), r"layers.*\(4, 3\)"),
    (dict(tp=(8, 3)), "tp"),
    (dict(parts=("zl",)), "parts"),
    (dict(parts=("prefix", "ffn")), "parts"),  # sorted
    (dict(format_version=3, parts=("prefix",)), "format 3"),
    (dict(codec="int8"), "codec.*'int8'"),
    (dict(format_version=4, codec="fp8"), "format 4 is dense only"),
])
def test_certificate_malformed(over, match):
    with pytest.raises(CertificateError, match=match):
        _cert(**over)


@pytest.mark.parametrize("args,match", [
    ((8, 8, ((0, 1),)), "rank.*tp_size 8.*got 8"), ((0, 0, ()), "tp_size.*0"),
    ((2, 0, ((0, 10), (5, 20))), "channel_ranges"), ((2, 0, ((10, 10),)), "channel_ranges"),
    ((2, 0, (1, 2)), "channel_ranges")])
def test_tp_geometry_malformed(args, match):
    with pytest.raises(CertificateError, match=match):
        TPGeometry(*args)


def test_token_digest():
    ids = [0, 5, 129279, 7]
    assert token_digest(ids) == token_digest(np.array(ids, np.int32)) == token_digest(np.array(ids, np.uint64))
    for other in ([0, 5, 129279], [5, 0, 129279, 7], [0, 5, 129279, 8], []):
        assert token_digest(other) != token_digest(ids)
    with pytest.raises(CertificateError, match="integer.*float"):
        token_digest([1.0, 2.0])
    with pytest.raises(CertificateError, match=r"1-D.*\(2, 2\)"):
        token_digest([[1, 2], [3, 4]])


def test_payload_digest():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6)).astype(np.float32)
    b = rng.integers(0, 100, (5,)).astype(np.int32)
    d = payload_digest({"z_L": a, "ids": b})
    assert d == payload_digest({"ids": b, "z_L": a.copy()})                 # insertion order
    assert d == payload_digest({"ids": b, "z_L": np.asfortranarray(a)})     # memory layout
    assert d == payload_digest({"ids": b.astype(">i4"), "z_L": a})          # byte order
    changed = a.copy()
    changed[2, 3] = np.nextafter(changed[2, 3], np.float32(np.inf))
    variants = [
        {"z_L": changed, "ids": b},                                         # one ulp
        {"z_L": a.reshape(6, 4), "ids": b},                                 # shape, same bytes
        {"z_L": a.view(np.int32), "ids": b},                                # dtype, same bytes
        {"z_l": a, "ids": b},                                               # name
        {"z_L": a},                                                         # a missing array
    ]
    digests = {payload_digest(v) for v in variants} | {d}
    assert len(digests) == len(variants) + 1
    # same bits, different float types; bfloat16 and float8_e4m3fn both report an opaque
    # dtype.str ('<V2', '<V1'), so only the dtype name tells them from other opaque types
    h = np.arange(8, dtype=np.uint16)
    assert payload_digest({"x": h.view(ml_dtypes.bfloat16)}) != payload_digest({"x": h.view(np.float16)})
    u = np.arange(8, dtype=np.uint8)
    assert payload_digest({"x": u.view(ml_dtypes.float8_e4m3fn)}) != \
        payload_digest({"x": u.view(ml_dtypes.float8_e4m3b11fnuz)})


def test_payload_digest_chunks(monkeypatch):
    """Chunked digest: spelled out by hand for tiny chunks, the same on one thread or many,
    and a change in any chunk (last, partial one included) changes it."""
    import hashlib

    from redknot_jax.reuse import certificate as cert
    monkeypatch.setattr(cert, "PAYLOAD_CHUNK", 16)
    a = np.arange(10, dtype=np.float32)  # 40 bytes: chunks of 16, 16, 8
    b = np.arange(3, dtype=np.int8)

    def framed(h, data):
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    h = hashlib.sha256(b"payload:chunked:")
    framed(h, (16).to_bytes(8, "little"))
    for name, arr in (("a", a), ("b", b)):
        raw = arr.tobytes()
        framed(h, name.encode())
        framed(h, arr.dtype.name.encode())
        framed(h, json.dumps(list(arr.shape)).encode())
        framed(h, b"".join(hashlib.sha256(raw[i:i + 16]).digest() for i in range(0, len(raw), 16)))
    assert cert.payload_digest({"b": b, "a": a}) == h.hexdigest()
    monkeypatch.setattr(cert, "_HASH_THREADS", 4)
    d = cert.payload_digest({"b": b, "a": a})
    monkeypatch.setattr(cert, "_HASH_THREADS", 1)
    assert cert.payload_digest({"b": b, "a": a}) == d == h.hexdigest()
    for i in (0, 5, 9):  # first, middle, last (partial) chunk
        c = a.copy()
        c[i] += 1
        assert cert.payload_digest({"b": b, "a": c}) != d


def test_cert_counters_threads():
    c = CertCounters()
    reasons = [FallbackReason.CHECKSUM, FallbackReason.TOKEN_MISMATCH]

    def work(i):
        for _ in range(2000):
            c.record_ok()
            c.record_fallback(reasons[i % 2])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.validated == 16000
    assert c.fallback[FallbackReason.CHECKSUM] == c.fallback[FallbackReason.TOKEN_MISMATCH] == 8000
    snap = c.snapshot()
    assert snap["validated"] == 16000 and snap["fallback"]["checksum"] == 8000
    assert set(snap["fallback"]) == {r.value for r in FallbackReason}
    assert snap["fallback"]["rank_disagreement"] == 0
    json.dumps(snap)
    with pytest.raises(TypeError, match="'checksum'"):
        c.record_fallback("checksum")


# =============================================================================== ledgers
# Hand-computed plan on tiny("mixed") with tiny_profile(6):
#   layers 0 S | 1 C | 2 H | 3 C | 4 H | 5 C  (S sliding, C CSA rate 4, H HCA rate 16); fences 0, 5
#   D=64 H=8 heads k=32 Rq=32 g=2 Ro=16 (4 heads/group: 2 Global, 6 Local) E=8 top-3 f=32
#   window 8, index_topk 4, indexer 16 heads x 16 dims
#   plan: n = 16 rows, P = 4 protected (charged as the last 4 rows), 2.0 kept experts/row
# Per-row FLOPs: wq_a 2*64*32 = 4096; wq_b 2*32*32 = 2048 per head (16384 all);
#   wkv 2*64*32 = 4096; wo_a 2*32*16 = 1024 per head (8192 all); wo_b 2*32*64 = 4096;
#   compressor C: main 2 x [64, 64] + indexer 2 x [32, 64] -> 2*(128+64)*64 = 24576; H: 2 x [32, 64] -> 8192
#   indexer_proj (C): 2*32*256 + 2*64*16 = 18432; router 2*64*8 = 1024;
#   one expert 3*2*64*32 = 12288; attention 4*32 = 128 per (head, key); scoring 2*16*16 = 512 per entry
# Keys (rows p = 1..16 counted 1-based): sliding sum min(8, p) = 36 + 8*8 = 100, last 4 rows: 32
#   CSA entries floor(p/4): 0,0,0,1,1,1,1,2,2,2,2,3,3,3,3,4 = 28 (top-4 cap not hit), last 4: 3+3+3+4 = 13
#   HCA entries floor(p/16): only p=16 -> 1, last 4: 1
#   keys per layer: S 100, C 100+28 = 128, H 100+1 = 101; protected part C 32+13 = 45, H 32+1 = 33
RECOMPUTE = {
    "wq_a": 6 * 16 * 4096,                               # 393216
    "wq_b": 6 * 16 * 16384,                              # 1572864
    "wkv": 6 * 16 * 4096,                                # 393216
    "wo_a": 6 * 16 * 8192,                               # 786432
    "wo_b": 6 * 16 * 4096,                               # 393216
    "compressor": 3 * 16 * 24576 + 2 * 16 * 8192,        # 1179648 + 262144 = 1441792
    "indexer_proj": 3 * 16 * 18432,                      # 884736
    "attention": (100 + 3 * 128 + 2 * 101) * 8 * 128,    # 686 * 1024 = 702464
    "indexer_scoring": 3 * 28 * 512,                     # 43008
    "router": 6 * 16 * 1024,                             # 98304
    "moe_routed": 6 * 16 * 3 * 12288,                    # 3538944
    "moe_shared": 6 * 16 * 12288,                        # 1179648
}
REDKNOT = {
    "wq_a": 393216, "wkv": 393216, "wo_b": 393216, "compressor": 1441792, "router": 98304,
    "moe_shared": 1179648,                               # all rows, every layer: unchanged
    # fences 2*16*16384 = 524288; reusable 4 x (2 Global x 16 rows + 6 Local x 4 rows) x 2048
    "wq_b": 524288 + 4 * (2 * 16 + 6 * 4) * 2048,        # 524288 + 458752 = 983040
    "wo_a": 2 * 16 * 8192 + 4 * (2 * 16 + 6 * 4) * 1024,  # 262144 + 229376 = 491520
    # fence layer 5 all 16 rows; reusable CSA layers 1, 3 only the 4 protected rows
    "indexer_proj": 16 * 18432 + 2 * 4 * 18432,          # 294912 + 147456 = 442368
    # fences: S 100*8*128 = 102400, C 128*8*128 = 131072;
    # C reusable (2*128 + 6*45)*128 = 67328 (x2); H reusable (2*101 + 6*33)*128 = 51200 (x2)
    "attention": 102400 + 131072 + 2 * 67328 + 2 * 51200,  # 470528
    "indexer_scoring": 28 * 512 + 2 * 13 * 512,          # 14336 + 13312 = 27648
    "moe_routed": 2 * 16 * 3 * 12288 + 4 * 16 * 2 * 12288,  # 1179648 + 1572864 = 2752512
}


def test_ledgers_hand_computed_plan():
    cfg, prof = config.tiny("mixed"), tiny_profile(6)
    # head-row: 4 reusable layers x 6 Local x (16 - 4) = 288 of 6 x 8 x 16 = 768 pairs
    assert ledger.head_row_ledger(cfg, prof, 16, 4) == {
        "restored_pairs": 288, "total_pairs": 768, "saving": 288 / 768, "ceiling": 0.5}
    # token-row: 16 rows, 14 candidate rows, 2 of them protected. Under ffn_rows="run" only an
    # exact prefix saves rows (3 rows x 6 layers = 18 of 6 x 16 = 96 pairs); under "omit" also
    # 4 reusable layers x 12 unprotected rows = 48
    run = ledger.token_row_ledger(cfg, prof, 16, 14, 2)
    assert (run["omitted_rows"], run["total_rows"], run["saving"]) == (0, 96, 0.0)
    assert ledger.token_row_ledger(cfg, prof, 16, 10, 2, prefix_rows=3)["omitted_rows"] == 18
    omit = ledger.token_row_ledger(cfg, dataclasses.replace(prof, ffn_rows="omit"), 16, 10, 2, prefix_rows=3)
    assert (omit["omitted_rows"], omit["saving"]) == (18 + 4 * 8, (18 + 32) / 96)
    # omission takes the router and experts of the unprotected rows out of the operator ledger
    omit_ops = ledger.operator_flops(cfg, dataclasses.replace(prof, ffn_rows="omit"), 16, 4, 2.0, "redknot")
    run_ops = ledger.operator_flops(cfg, prof, 16, 4, 2.0, "redknot")
    assert omit_ops["wq_b"] == run_ops["wq_b"] and omit_ops["moe_shared"] < run_ops["moe_shared"]
    # an exact prefix of 5 rows is charged in no layer: the router (every row under "run") sees 11
    # rows per layer; the Recomputed arm is unchanged
    pre = ledger.operator_flops(cfg, prof, 16, 4, 2.0, "redknot", prefix_rows=5)
    assert pre["router"] == 2.0 * cfg.hidden_size * cfg.n_routed_experts * 11 * 6
    assert all(pre[op] <= run_ops[op] for op in pre) and pre["attention"] < run_ops["attention"]
    assert ledger.operator_flops(cfg, prof, 16, 4, 2.0, "recompute", prefix_rows=5) == \
        ledger.operator_flops(cfg, prof, 16, 4, 2.0, "recompute")

    ops = ledger.operator_ledger(cfg, prof, 16, 4, 2.0)
    assert ops["recompute"] == pytest.approx(RECOMPUTE, rel=1e-12)
    assert ops["redknot"] == pytest.approx(REDKNOT, rel=1e-12)
    assert ops["saving"]["wq_b"] == pytest.approx(1 - 983040 / 1572864)
    assert ops["saving"]["wq_a"] == 0.0
    rec, red = sum(RECOMPUTE.values()), sum(REDKNOT.values())  # 11428864 and 9068224
    assert ops["total"] == pytest.approx({"recompute": rec, "redknot": red, "saving": 1 - red / rec})
    assert ops["groups"]["attention"]["saving"] == pytest.approx(1 - 470528 / 702464)
    assert ops["groups"]["moe"]["redknot"] == pytest.approx(98304 + 2752512 + 1179648)


@pytest.mark.parametrize("kind", ["mixed", "hca2", "csa"])
def test_key_sums_match_brute_force(kind):
    cfg = config.tiny(kind)
    for layer in range(cfg.num_layers):
        m = cfg.compress_ratio(layer)
        for x in (0, 1, 3, 7, 8, 9, 16, 17, 63, 100):
            want = 0
            for p in range(1, x + 1):
                want += min(cfg.sliding_window, p)
                if m == cfg.csa_rate:
                    want += min(cfg.index_topk, p // m)
                elif m == cfg.hca_rate:
                    want += p // m
            assert ledger._key_sum(cfg, layer, x) == want, (kind, layer, x)


def test_full_protection_is_recompute():
    # every row protected, native MoE, latents recomputed: the RedKnot arm does native work
    for cfg, prof, n in ((config.flash(), flash_profile(), 5000), (config.tiny("csa"), tiny_profile(4), 37)):
        ops = ledger.operator_ledger(cfg, prof, n, n, float(cfg.experts_per_tok))
        assert ops["redknot"] == pytest.approx(ops["recompute"], rel=1e-12)
        assert ops["total"]["saving"] == pytest.approx(0.0, abs=1e-12)
        assert ledger.head_row_ledger(cfg, prof, n, n)["saving"] == 0.0
        # no protection at all: the head-row saving reaches the structural ceiling
        hr = ledger.head_row_ledger(cfg, prof, n, 0)
        assert hr["saving"] == pytest.approx(hr["ceiling"])


def test_operator_ledger_monotone_and_per_layer():
    cfg, prof = config.flash(), flash_profile()
    n = 65536
    totals = [ledger.operator_ledger(cfg, prof, n, p, 6.0)["total"]["redknot"] for p in (0, 4096, 16384, n)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    one = ledger.operator_flops(cfg, prof, n, 4096, 4.0, "redknot")
    assert ledger.operator_flops(cfg, prof, n, [4096] * 37, 4.0, "redknot") == one
    # fewer latent rows (canonical latents from the artifact) only lowers wkv / compressor
    fewer = ledger.operator_flops(cfg, prof, n, 4096, 4.0, "redknot", latent_rows=1024)
    assert fewer["wkv"] < one["wkv"] and fewer["compressor"] < one["compressor"]
    assert {k: v for k, v in fewer.items() if k not in ("wkv", "compressor")} == \
        {k: v for k, v in one.items() if k not in ("wkv", "compressor")}


def test_operator_ledger_trimmed_last_layer():
    """out_rows: the native last layer's queries, attention, wo and MoE for the latest rows only,
    its latents for every row; both arms alike, so full protection still equals Recomputed."""
    cfg, prof, n = config.flash(), flash_profile(), 65536
    full = ledger.operator_flops(cfg, prof, n, 4096, 4.0, "recompute")
    cut = ledger.operator_flops(cfg, prof, n, 4096, 4.0, "recompute", out_rows=256)
    assert cut["wkv"] == full["wkv"] and cut["compressor"] == full["compressor"]
    f = 3 * 2.0 * cfg.hidden_size * cfg.moe_inter_dim
    assert full["moe_shared"] - cut["moe_shared"] == f * (n - 256)
    assert all(cut[op] < full[op] for op in ("wq_a", "wq_b", "wo_a", "wo_b", "attention", "router"))
    ops = ledger.operator_ledger(cfg, prof, 5000, 5000, 6.0, out_rows=256)
    assert ops["redknot"] == pytest.approx(ops["recompute"], rel=1e-12)
    with pytest.raises(ValueError, match=r"out_rows: expected in \[1, 100\]"):
        ledger.operator_flops(cfg, prof, n, 0, 4.0, "redknot", prefix_rows=n - 100, out_rows=256)


@pytest.mark.parametrize("call,match", [
    (lambda c, p: ledger.head_row_ledger(c, p, 16, 17), r"protected_rows.*\[0, 16\].*17"),
    (lambda c, p: ledger.head_row_ledger(c, p, 16, [1, 2]), "protected_rows.*4 entries.*got 2"),
    (lambda c, p: ledger.token_row_ledger(c, p, 16, -1, 0), "candidate_rows.*-1"),
    (lambda c, p: ledger.token_row_ledger(c, p, 16, 14, 0, prefix_rows=3), "exceed n_rows 16"),
    (lambda c, p: ledger.operator_flops(c, p, 16, 4, 2.0, "fast"), "arm.*'fast'"),
    (lambda c, p: ledger.operator_flops(c, p, 16, 4, 3.5, "redknot"), r"kept_experts_per_row.*\[0, 3\].*3.5"),
    (lambda c, p: ledger.operator_flops(c, p, 16, 4, 2.0, "redknot", prefix_rows=17), "prefix_rows 17 exceed"),
    (lambda c, p: ledger.operator_flops(c, p, 16, 14, 2.0, "redknot", prefix_rows=3), r"protected_rows.*\[0, 13\]"),
    (lambda c, p: ledger.wallclock_ledger(0.0, 1.0), "ttft_recompute_s.*0.0"),
    (lambda c, p: ledger.wallclock_ledger(1.0, float("inf")), "ttft_redknot_s.*inf"),
])
def test_ledger_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(config.tiny("mixed"), tiny_profile(6))


def test_wallclock_and_bundle_keep_ledgers_apart():
    wc = ledger.wallclock_ledger(2.0, 0.5)
    assert wc == {"ttft_recompute_s": 2.0, "ttft_redknot_s": 0.5, "speedup": 4.0, "saving": 0.75}
    cfg, prof = config.tiny("mixed"), tiny_profile(6)
    counters = CertCounters()
    counters.record_ok()
    counters.record_fallback(FallbackReason.STALE_GENERATION)
    head = ledger.head_row_ledger(cfg, prof, 16, 4)
    bundle = ledger.Ledgers(head_row=head, token_row=ledger.token_row_ledger(cfg, prof, 16, 14, 2),
                            operator=ledger.operator_ledger(cfg, prof, 16, 4, 2.0), wallclock=wc,
                            cert=counters)
    counters.record_ok()      # later activity does not leak into a built bundle
    head["saving"] = -1.0
    d = bundle.to_dict()
    assert set(d) == {"head_row", "token_row", "operator", "wallclock", "cert"}  # nothing summed
    assert d["cert"] == {"validated": 1, "fallback": {**{r.value: 0 for r in FallbackReason}, "stale_generation": 1}}
    assert d["head_row"]["saving"] == 288 / 768
    json.dumps(d)
    d["head_row"]["saving"] = 0.0
    assert bundle.head_row["saving"] == 288 / 768
    with pytest.raises(dataclasses.FrozenInstanceError):
        bundle.head_row = {}
    assert ledger.Ledgers(head, head, head, None, {}).wallclock is None
