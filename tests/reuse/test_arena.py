"""The device arena of hot documents (reuse/arena.py): requests over it give exactly the logits of
a pool packed for their documents alone; a new combination of resident documents compiles
nothing; one copy per document whatever set cites it; least recently used unpinned documents
are evicted (and give the same logits when admitted again); pinned ones never are."""

import dataclasses

import numpy as np
import jax.numpy as jnp
import pytest

from redknot_jax import config
from redknot_jax.init import random_model
from redknot_jax.reuse.arena import ArenaFull
from redknot_jax.reuse.arena import doc_key as arena_key
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.reuse.runtime import ReuseRuntime, sub_batches
from redknot_jax.reuse import codec, programs
from redknot_jax.reuse.layout import max_sizes
from tests.tolerances import TOL, rel_err


def layer_programs() -> int:
    """Programs compiled so far by the consumer's jitted layer functions (the minutes-long
    compiles at model scale; small eager ops over artifact-sized arrays are not counted)."""
    return sum(f._cache_size() for name, f in vars(programs).items() if name.endswith("_jit") and
               hasattr(f, "_cache_size"))


@pytest.fixture(scope="module")
def setup():
    cfg = config.tiny("mixed")
    model = random_model(cfg, seed=7, dtype=jnp.float32)
    prof = dataclasses.replace(tiny_profile(cfg.num_layers), budget_override=0.2, tail_rows=8, artifact_codec="fp8")
    rng = np.random.default_rng(3)
    docs = [rng.integers(2, cfg.vocab_size, n) for n in (40, 33, 25, 50)]
    arts = [build_artifact(model, prof, d, checkpoint_fingerprint="fp") for d in docs]
    q = rng.integers(2, cfg.vocab_size, 7)
    req = lambda ix: Request([Segment(docs[i], arts[i]) for i in ix] + [Segment(q)])
    return cfg, ReuseRuntime(model, prof, "fp"), arts, req


def test_requests_over_the_arena_equal_their_own_pools_and_compile_nothing_new(setup):
    cfg, rt, arts, req = setup
    unit = cfg.hca_rate
    arena = rt.consumer.arena(rows=16 * unit, docs=8)
    seen = {}
    for ix in ([0, 2, 1], [1, 3, 2], [3, 0, 2]):  # three sets; the first two fall in one request size bucket
        arena.acquire([arts[i] for i in ix])
        before = layer_programs()
        got = rt.prefill(req(ix), "redknot", require_reuse=True, pool=arena)
        seen[tuple(ix)] = layer_programs() - before
        arena.release([arts[i] for i in ix])
        if ix[0] == 0:  # the arena's rows for a document are the pool's: the same arithmetic
            own = rt.prefill(req(ix), "redknot", require_reuse=True, pool=rt.consumer.pool([arts[i] for i in ix]))
            np.testing.assert_array_equal(got.logits, own.logits)
    assert seen[(0, 2, 1)] > 0 and seen[(1, 3, 2)] == 0, seen  # a new set, same buckets: no new program
    snap = arena.snapshot()  # one copy of each document: 4 admitted, 5 citations of resident ones
    assert (snap["docs"], snap["admitted"], snap["hits"], snap["evicted"]) == (4, 4, 5, 0)
    assert snap["rows_used"] == sum(-(-a.length // unit) * unit for a in arts)
    assert arena.codec == "fp8" and snap["bytes"] == arena.nbytes() > 0


def test_lru_eviction_pins_and_errors(setup):
    cfg, rt, arts, req = setup
    unit = cfg.hca_rate
    need = [-(-a.length // unit) * unit for a in arts]
    arena = rt.consumer.arena(rows=need[0] + need[1] + need[2], docs=3)
    ref = rt.prefill(req([0, 1]), "redknot", pool=rt.consumer.pool([arts[0], arts[1]])).logits
    arena.acquire(arts[:3])  # rows [0, 48), [48, 96), [96, 128)
    arena.release(arts[:3])
    arena.acquire([arts[2]])  # pinned, and the most recently used: 0 is the least
    arena.acquire([arts[3]])  # no room: evicts 0, then 1 (unpinned), never the pinned 2
    assert [arena.resident(a) for a in arts] == [False, False, True, True] and arena.stats["evicted"] == 2
    with pytest.raises(ArenaFull, match=r"48 rows asked; 32 of 128 free \(the longest free range 32 rows\).*"
                                        "every resident document is pinned"):
        arena.acquire([arts[0], arts[2]])  # 2 and 3 pinned, 32 rows left for 0
    assert arena.resident(arts[2]) and arena.resident(arts[3])
    assert arena._res[arena_key(arts[2])].pins == 1  # the failed acquire took back its own pin
    arena.release([arts[2], arts[3]])
    arena.acquire([arts[1]])
    arena.acquire([arts[0]])  # both evicted once, written in again elsewhere: the same logits
    got = rt.prefill(req([0, 1]), "redknot", pool=arena).logits
    np.testing.assert_array_equal(got, ref)
    gone = [a for a in arts[2:] if not arena.resident(a)]
    with pytest.raises(KeyError, match="not resident"):
        arena.doc(gone[0])
    with pytest.raises(ArenaFull, match="more than the arena's"):
        rt.consumer.arena(rows=unit, docs=1).acquire([arts[3]])
    dense = dataclasses.replace(arts[2], certificate=dataclasses.replace(arts[2].certificate, codec="dense"))
    arena.release([arts[0], arts[1]])
    with pytest.raises(ValueError, match="codec 'dense'; this arena holds 'fp8'"):
        arena.acquire([dense])

    # only the documents in the way are evicted: 0 at [0, 48), 1 at [48, 96) pinned, 2 at [96, 128),
    # 32 rows free; 3 (64 rows) fits once 0 and 2, the two least recently used, are gone, in 2's range
    arena = rt.consumer.arena(rows=need[0] + need[1] + 2 * need[2], docs=4)
    arena.acquire(arts[:3])
    arena.release(arts[:3])
    arena.acquire([arts[1]])
    arena.acquire([arts[3]])
    assert [arena.resident(a) for a in arts] == [True, True, False, True] and arena.stats["evicted"] == 1
    assert arena._res[arena_key(arts[3])].start == need[0] + need[1]


def test_a_decode_batch_steps_each_member_as_it_decodes_alone(setup, monkeypatch):
    """`DecodeBatch`: requests of different sizes over the arena joining (the larger pads every
    member once) and leaving between steps; each member's logits are those of its own decode
    state stepped alone; what cannot join is refused by name."""
    cfg, rt, arts, req = setup
    c = rt.consumer
    arena = c.arena(rows=16 * cfg.hca_rate, docs=8)
    arena.acquire(arts)
    sets, steps = ([3], [0, 2, 1], [1, 3]), cfg.hca_rate + 2  # rows 57, 105, 90; new rows close windows
    alone = [rt.prefill(req(ix), "redknot", require_reuse=True, pool=arena, decode_rows=steps).decode for ix in sets]
    mine = [rt.prefill(req(ix), "redknot", require_reuse=True, pool=arena, decode_rows=steps).decode for ix in sets]
    batch = c.decode_batch(slots=2)
    rng = np.random.default_rng(0)
    joins, leaves = {0: [0], 2: [1], 5: [2]}, {5: [0]}  # step -> requests; 2 takes 0's slot
    slot, done = {}, {0: 0, 1: 0, 2: 0}
    for k in range(steps + 5):
        for r in leaves.get(k, []):
            batch.leave(slot.pop(r))
        for r in joins.get(k, []):
            slot[r] = batch.join(mine[r])
        if k == 2:
            assert batch.sizes == max_sizes(mine[0].layout.sizes(), mine[1].layout.sizes())
        toks = rng.integers(2, cfg.vocab_size, batch.slots)
        logits = np.asarray(batch.step(toks))
        for r, b in slot.items():
            ref = np.asarray(c.decode_step(int(toks[b]), alone[r]))
            assert rel_err(logits[b], ref) < TOL["consumer_vs_reference"][0], (k, r)
            done[r] += 1
        for r in [r for r in slot if done[r] == steps]:
            batch.leave(slot.pop(r))
    assert done == {0: 5, 1: steps, 2: steps} and batch.size == 0 and batch.layers == {}
    # native states (the Recomputed and prefix arms') in a batch of their own: each as it decodes alone
    runs = [rt.prefill(req(ix), arm, decode_rows=3) for ix, arm in (([3], "recompute"), ([0, 2], "prefix")) * 2]
    assert [r.arm for r in runs] == ["recompute", "prefix"] * 2 and all(r.decode.native for r in runs)
    natives = c.decode_batch(slots=2)
    assert [natives.join(r.decode) for r in runs[:2]] == [0, 1]
    for k in range(3):
        toks = rng.integers(2, cfg.vocab_size, 2)
        logits = np.asarray(natives.step(toks))
        for b, r in enumerate(runs[2:]):
            assert rel_err(logits[b], np.asarray(c.decode_step(int(toks[b]), r.decode))) < \
                TOL["consumer_vs_reference"][0], (k, b)
    # the notebook API over it: generate_batch == generate, a request that falls back in a batch of native states
    stale = dataclasses.replace(arts[3], certificate=dataclasses.replace(arts[3].certificate, model_digest="0" * 64))
    reqs = [req(ix) for ix in sets] + [Request([Segment(req([3]).segments[0].tokens, stale), req([3]).segments[-1]])]
    toks, firsts = rt.generate_batch(reqs, 4, pool=arena)
    assert [f.arm for f in firsts] == ["redknot"] * 3 + ["recompute"]
    for r, t in zip(reqs, toks):
        assert t == rt.generate(r, 4, pool=arena)[0]
    # a batch of 3 under a server's batch sizes (2, 4): sub-batches of 2 and 1, the same logits, each counted once
    v0 = rt.counters.snapshot()["validated"]
    sizes, real = [], c.redknot_batch_steps
    monkeypatch.setattr(c, "redknot_batch_steps",
                        lambda plans, *a, **kw: sizes.append(len(plans)) or real(plans, *a, **kw))
    split = rt.prefill_batch(reqs[:3], "redknot", pool=arena, batch_sizes=(2, 4))
    assert sizes == [2, 1] and len(split) == 3 and rt.counters.snapshot()["validated"] == v0 + 3
    for a, b in zip(split, firsts):
        assert rel_err(a.logits, b.logits) < TOL["consumer_vs_reference"][0]
    monkeypatch.undo()
    assert sub_batches(7, (2, 4)) == [4, 2, 1] and sub_batches(6, (2, 4, 6)) == [6] and sub_batches(3) == [3]
    with pytest.raises(ValueError, match="joined a DecodeBatch"):
        c.decode_step(1, mine[1])
    one = c.decode_batch(slots=1)
    one.join(rt.prefill(req([3]), "redknot", pool=arena, decode_rows=2).decode)
    with pytest.raises(ValueError, match="it is native; the batch's members are RedKnot states"):
        one.join(rt.prefill(req([3]), "recompute", decode_rows=2).decode)
    with pytest.raises(ValueError, match="all 1 slots are taken"):
        one.join(rt.prefill(req([3]), "redknot", pool=arena, decode_rows=2).decode)
    with pytest.raises(ValueError, match="another pool"):
        one.join(rt.prefill(req([3]), "redknot", pool=c.pool([arts[3]]), decode_rows=2).decode)
    arena.release(arts)


def _avals(jaxpr):
    """Every value a jaxpr computes, nested jaxprs (jit, scan, cond, custom rules) included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval for v in eqn.outvars)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _avals(sub)


def test_layer_programs_dequantise_only_the_rows_they_read(setup):
    """Over a compact (fp8) arena a reusable layer's prefill and decode programs gather the rows
    they read encoded and dequantise those: no program computes a floating array as long as the
    arena (a whole layer's z_L, K=V or FFN outputs dequantised)."""
    cfg, rt, arts, req = setup
    c = rt.consumer
    arena = c.arena(rows=40 * cfg.hca_rate, docs=8)  # 40 units: a length no other array has
    arena.acquire(arts[:2])
    first = rt.prefill(req([0, 1]), "redknot", require_reuse=True, pool=arena, decode_rows=2)
    c.decode_step(5, first.decode)
    dec, lay = first.decode, c._layout(first.plan, arena)
    P = codec.shape(arena.layers[c.reusable[0]]["kv"])[0]
    assert P >= 40 * cfg.hca_rate
    ids = jnp.zeros((1, lay.c), jnp.int32)
    for i in c.reusable:
        gd, st = c.defs[i]
        kw = dict(graphdef=gd, freqs=c.model.freqs(i))
        prefill = programs.reusable_jit.trace(st, c._embed(ids), ids, lay.tables, arena.layers[i], glob=c.glob,
                                              block=c.block, fan=c.fan, kernels=c.prefill_kernels,
                                              ffn_rows=c.ffn_rows, **kw)
        step = programs.reusable_step_jit.trace(st, c._embed(ids[:, :1]), ids[:, :1], dec.layout.tables,
                                                arena.layers[i], dec.layers[i], jnp.int32(dec.rows), fan=c.fan, **kw)
        for traced in (prefill, step):
            wide = [a for a in _avals(traced.jaxpr.jaxpr)
                    if a.shape[:1] == (P,) and jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > 1]
            assert not wide, (i, wide[:3])
    arena.release(arts[:2])
