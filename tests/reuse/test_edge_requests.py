"""Requests at the edges of the serving path's shapes: documents narrower than the indexer's
top-k sharing a pool, a short request decoding with room for many rows. (Apart from
test_consumer.py: that module's compiled programs are many already, and one process holding
more of them crashed XLA's CPU compiler in CI, a segfault while writing the compilation cache.)"""

import dataclasses

import numpy as np
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.config import CSA
from redknot_jax.init import random_model
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.reuse.runtime import ReuseRuntime
from tests.reuse.test_consumer import _request
from tests.tolerances import TOL, rel_err


def test_documents_narrower_than_the_top_k_pack_into_one_pool():
    """A document with fewer CSA entries than the indexer's top-k keeps all of them as its picks,
    so documents of different lengths store picks of different widths (here 16, 16 and 8 for
    top-64). The pool pads them with -1 (no pick), and the consumer still equals the eager
    reference. (Before, packing such documents failed in a concatenation.)"""
    cfg = dataclasses.replace(config.tiny("mixed"), index_topk=64)
    model = random_model(cfg, seed=7, dtype=jnp.float32)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.2, tail_rows=8)
    req, arts = _request(cfg, prof, model, 3)
    csa = next(i for i in range(cfg.num_layers) if cfg.layer_types[i] == CSA)
    assert len({a.layers[csa]["topk"].shape[1] for a in arts}) == 2
    rt = ReuseRuntime(model, prof, "fp")
    pool = rt.consumer.pool(arts)
    picks = np.asarray(pool.layers[csa]["topk"])
    assert picks.shape[1] == max(a.layers[csa]["topk"].shape[1] for a in arts) and (picks == -1).any()
    ref = rt.prefill(req, "redknot", require_reuse=True, path="reference")
    fast = rt.prefill(req, "redknot", require_reuse=True, pool=pool)
    assert rel_err(fast.logits, ref.logits) < TOL["consumer_vs_reference"][0]


def test_decode_of_a_short_request_with_room_for_many_rows():
    """A 13-row request (one 7-row document, a 6-row question) with room for 20 generated rows:
    the decode layout pads to 64 rows, past the state's 32 compact rows. Padding rows get no
    compact row, and an online entry's slot on one is empty. (Before, their slots read past the
    compact rows into the boundary ring's empty slots, and entries pooled from nothing but empty
    gates were NaN: never visible, yet 0 x NaN in the attention's PV product made every logit NaN.)
    The steps give the logits of re-running the extended request."""
    cfg = dataclasses.replace(config.tiny("mixed"), index_topk=8)
    model = random_model(cfg, seed=7, dtype=jnp.float32)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.2, tail_rows=4)
    rng = np.random.default_rng(1)
    doc = rng.integers(2, cfg.vocab_size, 7)
    art = build_artifact(model, prof, doc, checkpoint_fingerprint="fp")
    req = Request([Segment(doc, art), Segment(rng.integers(2, cfg.vocab_size, 6))])
    rt = ReuseRuntime(model, prof, "fp")
    pool = rt.consumer.pool([art])
    inc = rt.prefill(req, "redknot", require_reuse=True, pool=pool, decode_rows=20)
    full = rt.prefill(req, "redknot", require_reuse=True, pool=pool)
    lay = inc.decode.layout
    assert lay.t > inc.decode.own_cap + req.tokens.size  # padding rows past the compact rows' room
    assert (lay.own_slot[lay.n_real:] == -1).all() and lay.own_slot.max() < inc.decode.own_cap
    gen = []
    for s in range(5):
        gen.append(int(rng.integers(2, cfg.vocab_size)))
        a = rt.next_logits(req, inc, gen)
        assert bool(jnp.all(jnp.isfinite(a))), s
        assert rel_err(a, rt.next_logits(req, full, gen, pool=pool)) < TOL["consumer_vs_reference"][0], s
