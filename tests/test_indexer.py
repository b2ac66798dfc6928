"""The Lightning Indexer's causal selection over entry prefixes (`indexer.select_topk_causal`):
the same picks as scoring every entry, computed over the shortest prefix that holds what the
block can see."""

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from redknot_jax import config
from redknot_jax.indexer import prefix_sizes, select_topk, select_topk_causal
from redknot_jax.init import random_model
from redknot_jax.pallas.indexer_scores import index_scores
from redknot_jax.reuse.consumer import Consumer
from redknot_jax.reuse.profile import tiny_profile
from tests.tolerances import TOL, rel_err


def test_prefix_sizes():
    # n and the largest powers of two below it (a sort's cost steps there)
    assert prefix_sizes(16384, 4) == (2048, 4096, 8192, 16384)
    assert prefix_sizes(8672, 4) == (2048, 4096, 8192, 8672)
    assert prefix_sizes(1000, 4) == (128, 256, 512, 1000)
    assert prefix_sizes(256, 4) == (64, 128, 256)  # at least 64 (the kernel's tile) once the entries allow
    assert prefix_sizes(40, 4) == (8, 16, 32, 40)
    assert prefix_sizes(3, 4) == (1, 2, 3)
    assert prefix_sizes(40, 1) == (40,)
    with pytest.raises(ValueError, match="stages must be >= 1"):
        prefix_sizes(40, 0)


@pytest.mark.parametrize("k", [4, 16])
def test_causal_selection_equals_scoring_every_entry(k):
    """Blocks whose last visible entry sits at each side of every prefix edge, a block that sees
    nothing and blocks that see fewer entries than k: the real picks (ids and flags) equal the
    full width's, and the scores ran over the prefix the block needs (a callback records the
    entry count of the branch that ran)."""
    rng = np.random.default_rng(0)
    n, heads, dim, t = 40, 4, 16, 3
    q = jnp.asarray(rng.normal(size=(1, t, heads, dim)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(1, t, heads)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(1, n, dim)), jnp.float32)
    seen = []

    def scores(q, w, keys):
        jax.debug.callback(lambda s: seen.append(int(s)), keys.shape[-2])
        return index_scores(q, w, keys)

    run = jax.jit(lambda vis: select_topk_causal(scores, q, w, keys, vis, k, 4))
    sizes = (8, 16, 32, 40)
    for last in (-1, 0, 5, 7, 8, 9, 15, 16, 31, 32, 39):  # each side of every prefix's edge
        counts = np.array([max(last - 1, 0), last + 1, max(last, 0)])  # row 1 sees the most: it decides
        vis = jnp.asarray(np.arange(n)[None, None, :] < counts[None, :, None])
        seen.clear()
        ids, ok = jax.block_until_ready(run(vis))
        want_ids, want_ok = select_topk(index_scores(q, w, keys), vis, k)
        assert ids.shape == want_ids.shape and np.array_equal(ok, want_ok), last
        assert np.array_equal(np.where(ok, ids, -1), np.where(want_ok, want_ids, -1)), last
        assert seen == [next(s for s in sizes if s > last)], (last, seen)


def test_consumer_picks_do_not_depend_on_the_stages():
    """Both arms of the consumer give the same logits with prefixes (4 stages) as with every
    entry scored (1 stage), over a request of several query blocks."""
    cfg = config.tiny("mixed")
    model = random_model(cfg, seed=3, dtype=jnp.float32)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), tail_rows=8, budget_override=0.5)
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.reuse.planner import Request, Segment, plan_request

    rng = np.random.default_rng(5)
    docs = [rng.integers(2, cfg.vocab_size, n) for n in (60, 47)]
    arts = [build_artifact(model, prof, d, checkpoint_fingerprint="fp") for d in docs]
    req = Request([Segment(d, a) for d, a in zip(docs, arts)] + [Segment(rng.integers(2, cfg.vocab_size, 40))],
                  query_rows=(146, 120))
    staged, full = Consumer(model, prof, topk_stages=4), Consumer(model, prof, topk_stages=1)
    assert np.asarray(staged.recompute(req.tokens, req.query_rows)).shape[0] == 2
    assert rel_err(staged.recompute(req.tokens, req.query_rows), full.recompute(req.tokens, req.query_rows)) < \
        TOL["chunked_vs_oneshot"][0]
    plan = plan_request(req, prof)
    a = staged.redknot(plan, req.tokens, staged.pool(arts))[0]
    b = full.redknot(plan_request(req, prof), req.tokens, full.pool(arts))[0]
    assert rel_err(a, b) < TOL["chunked_vs_oneshot"][0]
    assert staged._layout(plan, staged.pool(arts)).tables["prot_idx"].shape[0] > staged.block  # pass B: blocks
    with pytest.raises(ValueError, match="topk_stages must be an int >= 1"):
        Consumer(model, prof, topk_stages=0)
