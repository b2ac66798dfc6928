"""RedKnot runtime: the identities it rests on, on fresh random inputs, and the arm API.

(a) relocation, (b) LSE merge with the sink once, (c) Eq. 4, (d) full protection with latent
refresh and native MoE equals the Recomputed arm, (e) prefix-only requests are exact at any
budget, (g) every certificate failure falls back and is counted, (h) Local rows are replaced
exactly once, (i) ledgers come back with every prefill, never summed.
"""

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.attention import sink_softmax_attend
from redknot_jax.init import random_model
from redknot_jax.reuse.artifact import build_artifact, local_head_mask, project_heads
from redknot_jax.reuse.certificate import FallbackReason, TPGeometry
from redknot_jax.reuse.ledger import operator_flops
from redknot_jax.reuse.planner import Request, RequestError, Segment
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.relocation import merge_partials, partial_attention, rotate
from redknot_jax.reuse.runtime import ReuseFallback, ReuseRuntime
from redknot_jax.rope import apply_rope, inv_freq
from tests.tolerances import rel_err

CFG = config.tiny("mixed")
FP = "random-seed-7"


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=7, dtype=jnp.float32)


def docs(seed, lens=(40, 33, 29)):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, n) for n in lens]


# The tests are compile-bound: one program per layer and distinct (padded rows, protected rows,
# fan-out) shapes. Their requests are therefore all 97-128 rows (padded to 128 rows) and their
# documents at most 64 rows (artifacts of widths 32 and 64), so they share programs; what each
# checks does not depend on the request's length.


def test_a_relocation_rotated_query_equals_rotated_keys():
    """<R(t-D) q, R(p) k> attention with output turned by R(D) == attention on keys at p + D."""
    rng = np.random.default_rng(0)
    f = inv_freq(CFG, True)
    t, s, h, k, d = 5, 9, 3, 32, 57
    q = apply_rope(jnp.asarray(rng.normal(size=(t, h, k)), jnp.float32), jnp.arange(70, 75), f)
    raw = jnp.asarray(rng.normal(size=(s, k)), jnp.float32)
    canon, absolute = apply_rope(raw, jnp.arange(s), f), apply_rope(raw, jnp.arange(s) + d, f)
    mask = jnp.asarray(rng.random((t, 1, s)) > 0.3)
    o1, l1 = partial_attention(rotate(q, -d, f), canon, mask, 0.2)
    o2, l2 = partial_attention(q, absolute, mask, 0.2)
    assert rel_err(rotate(o1, d, f), o2) < 1e-5 and rel_err(l1, l2) < 1e-6


def test_b_lse_merge_with_sink_equals_one_attention():
    rng = np.random.default_rng(1)
    t, h, k = 4, 3, 16
    q = jnp.asarray(rng.normal(size=(t, h, k)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(20, k)), jnp.float32)
    mask = jnp.asarray(rng.random((t, 1, 20)) > 0.4)
    sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    parts = [partial_attention(q, keys[a:b], mask[..., a:b], 0.25) for a, b in ((0, 7), (7, 8), (8, 20))]
    merged, _ = merge_partials(parts, sink)
    ref, _ = sink_softmax_attend(q[None], [(keys[None], mask[None], "bthk,bsk->bths")], sink, 0.25)
    assert rel_err(merged, ref[0]) < 1e-5


def test_c_eq4_local_plus_global_is_the_native_projection(model):
    attn = model.layers[2].attn
    o = jax.random.normal(jax.random.key(3), (6, CFG.num_heads, CFG.head_dim))
    local = local_head_mask(model, tiny_profile(CFG.num_layers))
    assert local.sum() == CFG.num_heads - CFG.o_groups  # 1 Global head per group
    z = project_heads(attn, o, local) + project_heads(attn, o, ~local)
    native = attn.wo_b_apply(attn.wo_a_apply(o[None]))[0]
    assert rel_err(attn.wo_b_apply(z[None])[0], native) < 1e-5


def build(model, profile, toks, **kw):
    return build_artifact(model, profile, toks, checkpoint_fingerprint=FP, **kw)


def test_d_full_protection_equals_recompute(model):
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), latent_refresh="protected", budget_override=1.0,
                               fanout_mode="native")
    rt = ReuseRuntime(model, prof, FP)
    d = docs(0)
    arts = [build(model, prof, x) for x in d]
    q = np.random.default_rng(9).integers(2, CFG.vocab_size, 11)
    for order in ([0, 1, 2], [2, 0, 1]):
        req = Request([Segment(d[j], arts[j]) for j in order] + [Segment(q)])
        red = rt.prefill(req, "redknot", require_reuse=True)
        rec = rt.prefill(req, "recompute")
        assert red.arm == "redknot" and red.plan.fraction_protected() == 1.0
        assert rel_err(red.logits, rec.logits) < 1e-5, order


@pytest.mark.parametrize("budget", [0.1, 0.25])
def test_e_prefix_only_exact_at_any_budget(model, budget):
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), budget_override=budget, fanout_mode="native")
    rt = ReuseRuntime(model, prof, FP)
    pre = docs(1, (61,))[0]
    art = build(model, prof, pre)
    req = Request([Segment(pre, art), Segment(np.random.default_rng(2).integers(2, CFG.vocab_size, 40))])
    red = rt.prefill(req, "redknot", require_reuse=True)
    assert red.plan.fraction_protected() < 1.0  # rows really were restored
    rec = rt.prefill(req, "recompute")
    assert rel_err(red.logits, rec.logits) < 1e-5


def test_relocated_documents_are_approximate_but_close(model):
    """Not an identity: relocated documents differ from recomputation (the approximation the
    report measures), but stay finite and ranked similarly: much closer to the Recomputed
    logits, in value and in the rank order of the vocabulary, than the same question after
    other documents of the same lengths (random weights: 0.49 vs 0.91 relative error, rank
    correlation 0.88 vs 0.61)."""
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), budget_override=0.25)
    rt = ReuseRuntime(model, prof, FP)
    d = docs(3)
    req = Request([Segment(x, build(model, prof, x)) for x in d] + [Segment(d[0][:9])])
    red, rec = rt.prefill(req, "redknot"), rt.prefill(req, "recompute")
    other = rt.prefill(Request([Segment(x) for x in docs(11)] + [Segment(d[0][:9])]), "recompute")

    def rank_corr(a, b):  # Spearman's correlation of two logit rows, averaged over query rows
        ra, rb = (np.argsort(np.argsort(np.asarray(v), -1), -1) for v in (a, b))
        return float(np.mean([np.corrcoef(x, y)[0, 1] for x, y in zip(ra, rb)]))

    err, err_other = rel_err(red.logits, rec.logits), rel_err(other.logits, rec.logits)
    assert np.isfinite(red.logits).all() and 0 < err < 0.5 and err < err_other - 0.2, (err, err_other)
    corr, corr_other = rank_corr(red.logits, rec.logits), rank_corr(other.logits, rec.logits)
    assert corr > 0.8 and corr > corr_other + 0.15, (corr, corr_other)


def test_g_every_certificate_failure_falls_back_and_is_counted(model, monkeypatch):
    from redknot_jax.reuse import artifact

    prof = tiny_profile(CFG.num_layers)
    d = docs(4, (30, 70))
    good = build(model, prof, d[0])
    with monkeypatch.context() as m:  # the builder's hash is kept: certification hashes nothing again
        m.setattr(artifact, "payload_digest", lambda a: pytest.fail("a built artifact was hashed again"))
        assert good.digest() == good.certificate.payload_digest
    tail = Segment(d[1])  # new rows

    def run(rt, seg):
        return rt.prefill(Request([seg, tail]), "redknot")

    rt = ReuseRuntime(model, prof, FP)
    cases = {
        FallbackReason.TOKEN_MISMATCH: (rt, Segment(d[0][::-1].copy(), good)),  # same length, other tokens
        FallbackReason.PROFILE_MISMATCH: (rt, Segment(d[0], build(model, dataclasses.replace(prof, tau=0.5), d[0]))),
        FallbackReason.CHECKPOINT_MISMATCH: (ReuseRuntime(model, prof, "other-ckpt"), Segment(d[0], good)),
        FallbackReason.TP_GEOMETRY: (ReuseRuntime(model, prof, FP, tp=TPGeometry(2, 0, ((0, 1),))), Segment(d[0], good)),
        FallbackReason.STALE_GENERATION: (ReuseRuntime(model, prof, FP, min_generation=2), Segment(d[0], good)),
    }
    layers = {i: dict(v) for i, v in good.layers.items()}  # a changed copy: an artifact object is immutable
    layers[2]["zl"] = layers[2]["zl"].at[3, 0, 0].add(1e-3)  # (its digest is hashed once, by the builder)
    corrupt = dataclasses.replace(good, layers=layers)
    cases[FallbackReason.CHECKSUM] = (rt, Segment(d[0], corrupt))
    missing = dataclasses.replace(good, layers={i: v for i, v in good.layers.items() if i != 3})
    cases[FallbackReason.MISSING_LAYERS] = (rt, Segment(d[0], missing))
    for reason, (r, seg) in cases.items():
        res = run(r, seg)
        assert res.arm == "recompute" and res.fallback == reason, (reason, res.fallback, res.fallback_detail)
        assert r.counters.fallback[reason] >= 1
        with pytest.raises(ReuseFallback, match=reason.value):
            r.prefill(Request([seg, tail]), "redknot", require_reuse=True)
    ok = run(rt, Segment(d[0], good))
    assert ok.arm == "redknot" and rt.counters.validated >= 1


def test_h_local_rows_replaced_exactly_once(model):
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), budget_override=0.1)
    rt = ReuseRuntime(model, prof, FP)
    d = docs(5, (48, 50))
    art = build(model, prof, d[0])
    req = Request([Segment(d[1]), Segment(d[0], art), Segment(d[1][:6])])
    res = rt.prefill(req, "redknot", require_reuse=True)
    plan = res.plan
    z_online = jax.random.normal(jax.random.key(0), (plan.n_rows, CFG.o_groups, CFG.o_lora_rank))
    z = np.asarray(rt._restore_local(z_online, plan, 2))
    f = plan.frames[1]
    rows = np.arange(f.start, f.start + f.doc_len)
    unprot = ~plan.protected[rows]
    assert unprot.any() and (~unprot).any()
    np.testing.assert_array_equal(z[rows[unprot]], np.asarray(art.layers[2]["zl"])[unprot])  # replaced
    np.testing.assert_array_equal(z[rows[~unprot]], np.asarray(z_online)[rows[~unprot]])  # untouched
    others = np.setdiff1d(np.arange(plan.n_rows), rows[unprot])
    np.testing.assert_array_equal(z[others], np.asarray(z_online)[others])


def test_i_ledgers_with_every_prefill(model):
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), budget_override=0.2)
    rt = ReuseRuntime(model, prof, FP)
    d = docs(6, (40, 60))
    req = Request([Segment(d[0], build(model, prof, d[0])), Segment(d[1], build(model, prof, d[1])),
                   Segment(d[0][:7])])
    res = rt.prefill(req, "redknot", require_reuse=True)
    led = res.ledgers.to_dict()
    assert set(led) == {"head_row", "token_row", "operator", "wallclock", "cert"}
    plan = res.plan
    n_prot = int(plan.protected.sum())
    local = CFG.num_heads - CFG.o_groups
    reusable = CFG.num_layers - 2
    assert led["head_row"]["restored_pairs"] == reusable * local * (plan.n_rows - n_prot)
    assert 0 < led["head_row"]["saving"] < led["head_row"]["ceiling"]
    assert plan.prefix == 40 and res.fanout_hist.sum() == reusable * (plan.n_rows - 40)  # the prefix: no row run
    # the last layer (a fence) computes its query block only, and the operator ledger charges that
    out = rt.consumer.last_layer_rows(plan)
    native = lambda rows: operator_flops(CFG, prof, plan.n_rows, 0, 0.0, "recompute", out_rows=rows)
    assert out is not None and led["operator"]["recompute"] == native(out) != native(None)


def test_bad_requests_are_named():
    prof = tiny_profile(CFG.num_layers)
    from redknot_jax.reuse.planner import plan_request

    with pytest.raises(RequestError, match="segment 0"):
        plan_request(Request([Segment(np.array([], np.int32))]), prof)
    with pytest.raises(RequestError, match="query_rows"):
        plan_request(Request([Segment(np.arange(5))], query_rows=(9,)), prof)
    with pytest.raises(RequestError, match="segment 1: dirty rows \\[7\\]"):
        plan_request(Request([Segment(np.arange(5)), Segment(np.arange(4), dirty=(7,))]), prof)


@pytest.mark.parametrize("boundary", [0, 3, 50])
def test_row_classes_of_a_plan(boundary):
    """Boundary rows at both ends of each relocated document (none with boundary_rows=0, the
    whole document when it is shorter), dirty rows, tail rows, new rows; no class but Q, N and T
    in a first document that cannot be an exact prefix (no artifact certificate here) and
    relocates at 0 without boundary rows."""
    from redknot_jax.reuse.planner import plan_request

    art = lambda n: type("A", (), {"length": n, "certificate": None})()
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), boundary_rows=boundary, tail_rows=6)
    plan = plan_request(Request([Segment(np.arange(10), art(10)), Segment(np.arange(20), art(20), dirty=(4,)),
                                 Segment(np.arange(5))]), prof)
    rows = lambda k: np.flatnonzero(plan.classes[k]).tolist()
    b = min(boundary, 20)
    assert rows("B") == sorted(set(range(10, 10 + b)) | set(range(30 - b, 30)))
    assert (rows("D"), rows("N"), rows("T"), rows("Q")) == ([14], list(range(30, 35)), list(range(29, 35)), [34])
    assert plan.prefix == 0 and plan.doc_row.tolist() == [True] * 30 + [False] * 5
    assert plan.frame_of_row.tolist() == [0] * 10 + [1] * 25


def test_decode_continues_over_relocated_frames(model):
    """Full protection + refresh + native MoE: generated tokens equal the Recomputed arm's; and
    a prefix-only request decodes exactly at a small budget."""
    prof = dataclasses.replace(tiny_profile(CFG.num_layers), latent_refresh="protected", budget_override=1.0,
                               fanout_mode="native")
    rt = ReuseRuntime(model, prof, FP)
    d = docs(8, (30, 64))
    req = Request([Segment(d[0], build(model, prof, d[0])), Segment(d[1], build(model, prof, d[1])),
                   Segment(d[0][:5])])
    red, first = rt.generate(req, 3, "redknot", require_reuse=True)
    rec, _ = rt.generate(req, 3, "recompute")
    assert first.arm == "redknot" and red == rec
    prof2 = dataclasses.replace(tiny_profile(CFG.num_layers), budget_override=0.1, fanout_mode="native")
    rt2 = ReuseRuntime(model, prof2, FP)
    req2 = Request([Segment(d[0], build(model, prof2, d[0])), Segment(d[1]), Segment(d[0][:5])])
    assert rt2.generate(req2, 3, "redknot", require_reuse=True)[0] == rt2.generate(req2, 3, "recompute")[0]
