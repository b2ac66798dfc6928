"""The artifact's per-row controller statistic and how the controller uses it.

`far` (per reusable layer and row): the Local heads' mean attention share on compressed
entries, i.e. beyond the sliding window. Checked: attention shares per key set plus the sink's
share sum to 1; `far` is a share in [0, 1], exactly 0 for rows that see no compressed entry yet
and equal to a direct recomputation from the trace otherwise; `fill_itop` orders the rows of
one compressed window (equal indexer scores) by it, never lets it override a score, and takes
the rows a full sort ranks first.
"""

import numpy as np
import jax.numpy as jnp
import pytest

from redknot_jax import config
from redknot_jax.attention import sink_softmax_attend
from redknot_jax.config import CSA, HCA
from redknot_jax.init import random_model
from redknot_jax.reuse.artifact import build_artifact, local_head_mask
from redknot_jax.reuse.planner import DEVIATION_FLOOR, Plan, Request, Segment, fill_itop, plan_request, row_risk
from redknot_jax.reuse.profile import tiny_profile

CFG = config.tiny("mixed")


def test_key_set_shares_and_sink_sum_to_one():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 5, 3, 8)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(1, 7, 8)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(1, 4, 8)), jnp.float32)
    mask_b = jnp.asarray(rng.random((1, 5, 1, 4)) > 0.5)
    sink = jnp.asarray(rng.normal(size=3), jnp.float32)
    sets = [(a, jnp.ones((1, 5, 1, 7), bool), "bthk,bsk->bths"), (b, mask_b, "bthk,bsk->bths")]
    o, lse, (ma, mb) = sink_softmax_attend(q, sets, sink, 0.3, masses=True)
    o2, lse2 = sink_softmax_attend(q, sets, sink, 0.3)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    total = ma + mb + jnp.exp(sink[None, None] - lse)
    np.testing.assert_allclose(np.asarray(total), 1.0, atol=1e-6)
    assert float(jnp.max(jnp.where(~mask_b.any(-1), mb, 0))) == 0.0  # no visible key, no share


@pytest.fixture(scope="module")
def art():
    model = random_model(CFG, seed=3, dtype=jnp.float32)
    toks = np.random.default_rng(1).integers(2, CFG.vocab_size, 70)
    return model, build_artifact(model, tiny_profile(CFG.num_layers), toks, checkpoint_fingerprint="fp")


def test_far_is_a_share_and_zero_before_any_entry(art):
    model, a = art
    for i, d in a.layers.items():
        far = np.asarray(d["far"])
        assert far.shape == (a.length,) and far.dtype == np.float32
        assert (far >= 0).all() and (far <= 1 + 1e-6).all()
        kind = CFG.layer_types[i]
        m = CFG.csa_rate if kind == CSA else CFG.hca_rate
        if kind in (CSA, HCA):
            first_visible = m - 1  # a row sees entry 0 once its window is complete
            assert (far[:first_visible] == 0).all(), (i, far[:first_visible])
            assert far[first_visible:].max() > 0, i


def test_far_equals_the_trace_average_over_local_heads(art):
    model, a = art
    i = min(a.layers)
    blk = model.layers[i]
    # rerun the document to layer i with the trace and average the Local heads by hand
    ids = jnp.asarray(a.tokens)[None]
    x = model.embed_streams(ids)
    t = a.length
    for j in range(i):
        x, _ = model.layers[j](x, ids, jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32),
                               model.layers[j].attn.init_cache(1, 128, x.dtype), model.freqs(j), t)
    _, _, tr = blk(x, ids, jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32),
                   blk.attn.init_cache(1, 128, x.dtype), model.freqs(i), t, trace=True)
    local = local_head_mask(model, tiny_profile(CFG.num_layers))
    want = np.asarray(tr["far"][0])[:, local].mean(-1)
    np.testing.assert_allclose(np.asarray(a.layers[i]["far"]), want, atol=1e-6)


def test_fill_itop_orders_a_window_by_risk_never_over_scores(art):
    _, a = art
    prof = tiny_profile(CFG.num_layers)
    q = np.arange(2, 12)
    req = Request([Segment(a.tokens, a), Segment(a.tokens, a), Segment(q)])
    plan = plan_request(req, prof)
    risk = row_risk(plan, sorted(a.layers))
    np.testing.assert_allclose(risk[70:140], np.mean([np.asarray(a.layers[i]["far"]) for i in a.layers], 0))
    assert (risk[140:] == 0).all()
    # one window of 4 rows outscores the rest; the budget admits exactly 2 more rows
    scores = np.full(plan.n_rows, -1.0)
    win = np.arange(100, 104)
    scores[win] = 5.0
    r = np.zeros(plan.n_rows)
    r[win] = [0.1, 0.9, 0.2, 0.8]
    r[10] = 99.0  # a large risk never beats a better score
    have = int((plan.protected & plan.doc_row).sum())
    fill_itop(plan, scores, (have + 2) / plan.candidates, r)
    assert np.flatnonzero(plan.classes["I"]).tolist() == [101, 103]


@pytest.mark.parametrize("ranked_by", ["indexer", "deviation"])
def test_fill_itop_takes_the_rows_a_full_sort_ranks_first(ranked_by):
    """The budget's rows are those a full sort by (deviation, score, risk, row) puts first, with
    many ties (fill_itop sorts only the rows that can make the cut)."""
    rng = np.random.default_rng(0)
    n = 4000
    doc = rng.random(n) < 0.9
    classes = {k: np.zeros(n, bool) for k in ("Q", "N", "D", "B", "T", "I")}
    classes["B"][rng.choice(n, 50)] = True
    plan = Plan(n_rows=n, frames=[], frame_of_row=np.zeros(n, int), doc_row=doc, classes=classes,
                query_rows=np.array([n - 1]))
    scores = np.repeat(rng.integers(0, 30, n // 4).astype(float), 4)  # a window's rows share its score
    scores[rng.random(n) < 0.1] = -np.inf
    risk = rng.integers(0, 3, n).astype(float)
    dev = np.where(rng.random(n) < 0.2, rng.random(n), 0.0) if ranked_by == "deviation" else None
    fill_itop(plan, scores, 0.3, risk, dev)
    free = np.flatnonzero(doc & ~classes["B"])
    moved = np.zeros(n) if dev is None else np.where(dev > DEVIATION_FLOOR, dev, 0.0)
    want = int(np.ceil(0.3 * doc.sum())) - int((classes["B"] & doc).sum())
    ref = free[np.lexsort((free, -risk[free], -scores[free], -moved[free]))][:want]
    np.testing.assert_array_equal(np.flatnonzero(plan.classes["I"]), np.sort(ref))


def test_concentration_is_a_share_even_in_float32():
    """Fewer finite scores than k: all the mass is kept, and float32 rounding once made the sum
    1.0000001, which the profile then refused (a server 500). Now exactly a share in [0, 1]."""
    from redknot_jax.reuse.planner import concentration

    rng = np.random.default_rng(0)
    over = 0
    for _ in range(300):
        s = (rng.standard_normal(int(rng.integers(1, 60))) * 30).astype(np.float32)
        p = np.exp(s - s.max())
        p /= p.sum()
        over += float(np.sort(p)[::-1][:512].sum()) > 1  # the old float32 formula
        c = concentration(s, 512)
        assert 1 - 1e-12 < c <= 1.0 and tiny_profile(4).choose_budget(c) > 0
    assert over > 0  # the case exists
    s = np.array([5.0, 1.0, -np.inf, 0.0])
    p = np.exp(np.array([5.0, 1.0, 0.0]) - 5.0)
    assert concentration(s, 1) == pytest.approx(p[0] / p.sum())
    assert concentration(np.full(3, -np.inf), 2) == 1.0  # no visible entry: nothing to spread
