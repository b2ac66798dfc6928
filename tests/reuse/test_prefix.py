"""The exact prefix (DESIGN §3-§4, issue 45): artifacts carry every layer's native attention
state (fences too) and, with ffn_rows="restore", each reusable layer's FFN output; the prefix
arm and the RedKnot arm read every layer's prefix state from them and compute only the rows
after the prefix; older artifacts still relocate but fall back, counted, when asked to be a
prefix.

One fp32 tiny model; documents of 45 rows (not a multiple of the window 8 or the rates 4 / 16)
and 32 rows (a multiple of all)."""

import dataclasses
import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax import config
from redknot_jax.init import random_model
from redknot_jax.model import block_jit
from redknot_jax.reuse import consumer as consumer_mod
from redknot_jax.reuse.artifact import Artifact, build_artifact
from redknot_jax.reuse.certificate import Certificate, FallbackReason, can_prefix, payload_digest
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.prefix import PrefixCache, hot_prefix, native_cache
from redknot_jax.reuse.profile import tiny_profile
from redknot_jax.reuse.runtime import ReuseFallback, ReuseRuntime
from redknot_jax.store import ArtifactStore, split_tp
from tests.tolerances import TOL, rel_err

CFG = config.tiny("mixed")  # sliding (fence), CSA, HCA, CSA, HCA, CSA (fence)
FP = "random-seed-7"
PROF = dataclasses.replace(tiny_profile(CFG.num_layers), fanout_mode="native")
TOL_FP32 = TOL["consumer_vs_reference"][0]


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=7, dtype=jnp.float32)


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(11)
    return {n: rng.integers(2, CFG.vocab_size, n).astype(np.int32) for n in (45, 32)}


@pytest.fixture(scope="module")
def arts(model, docs):
    return {n: build_artifact(model, PROF, d, checkpoint_fingerprint=FP) for n, d in docs.items()}


def downgrade(art: Artifact) -> Artifact:
    """The same document as a format-3 artifact: reusable layers only, no optional part."""
    layers = {i: {k: v for k, v in d.items() if k != "ffn"} for i, d in art.layers.items()}
    old = Artifact(art.tokens, layers, None)
    old.certificate = dataclasses.replace(art.certificate, format_version=3, parts=(), layers=tuple(sorted(layers)),
                                          payload_digest=payload_digest(old.payload()))
    return old


def test_native_cache_equals_the_native_runs_cache(model, docs, arts):
    """Every layer (sliding and CSA fences, CSA and HCA reusable layers): the cache rebuilt from
    the artifact is the one the native run of the document alone leaves."""
    rt_consumer = ReuseRuntime(model, PROF, FP).consumer
    ids, t, n = rt_consumer._pad(docs[45])
    cap = rt_consumer._cap(t)
    x = rt_consumer._embed(ids)
    art = arts[45]
    assert sorted(art.prefix_layers) == [0, 5] and sorted(art.layers) == [1, 2, 3, 4]
    assert art.certificate.layers == tuple(range(6)) and art.certificate.parts == ("prefix",)
    assert set(art.prefix_layers[0]) == {"kv"} and set(art.prefix_layers[5]) == {"kv", "entries", "cmp",
                                                                                 "idx_entries", "idx"}
    for i, blk in enumerate(model.layers):
        gd, st = nnx.split(blk)
        x, want = block_jit(st, x, ids, jnp.zeros((1,), jnp.int32), jnp.full((1,), n, jnp.int32),
                            blk.attn.init_cache(1, cap, model.dtype), graphdef=gd, freqs=model.freqs(i),
                            block=min(rt_consumer.block, t))
        got = native_cache(blk.attn, art.native_state(i), cap, model.dtype)
        assert jax.tree.structure(got) == jax.tree.structure(want), i
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
            assert a.shape == b.shape and a.dtype == b.dtype, (i, path)
            assert rel_err(a, b) <= TOL["chunked_vs_oneshot"][0], (i, jax.tree_util.keystr(path))


def count_rows(monkeypatch) -> list:
    """Patch the consumer's layer programs to record, per call, (first position, rows) handed in."""
    seen = []
    for name, pos in (("block_jit", lambda a: int(a[1][0])), ("native_jit", lambda a: 0),
                      ("reusable_jit", lambda a: int(a[1]["pos"][0])),
                      ("reusable_keys_jit", lambda a: int(a[1]["pos"][0]))):
        fn = getattr(consumer_mod, name)
        monkeypatch.setattr(consumer_mod, name, lambda st, x, *a, _fn=fn, _pos=pos, **k:
                            seen.append((_pos(a), x.shape[1])) or _fn(st, x, *a, **k))
    return seen


@pytest.mark.parametrize("L", [45, 32])
def test_both_arms_with_a_prefix_are_the_recomputed_arm_and_compute_no_prefix_row(model, docs, arts, L, monkeypatch):
    """A prefix document plus new rows, the prefix arm and the RedKnot arm: the Recomputed arm's
    logits (fp32) with only the new rows handed to every layer's program (the prefix's rows
    computed in no layer); decoding continues from the rebuilt caches."""
    rt = ReuseRuntime(model, PROF, FP)
    new = np.random.default_rng(L).integers(2, CFG.vocab_size, 64 - L).astype(np.int32)  # 64 rows
    req = Request([Segment(docs[L], arts[L]), Segment(new)], query_rows=(L, L + 7, L + new.size - 1))
    steps = 3
    rec = rt.prefill(req, "recompute", decode_rows=steps)
    seen = count_rows(monkeypatch)
    for k, arm in enumerate(("prefix", "redknot")):
        seen.clear()
        res = rt.prefill(req, arm, require_reuse=True, decode_rows=steps)
        assert res.arm == arm and res.fallback is None and rt.counters.validated == k + 1
        assert seen == [(L, rt.consumer._rows(new.size))] * CFG.num_layers, arm  # never a prefix row
        assert rel_err(res.logits, rec.logits) < TOL_FP32, arm
        assert res.decode.rows == req.tokens.size and res.decode.native == (arm == "prefix")
        if arm == "redknot":
            assert res.plan.prefix == L and res.plan.candidates == 0
            assert res.ledgers.token_row["prefix_rows"] == L
            assert res.ledgers.token_row["omitted_rows"] == L * CFG.num_layers
        gen = []
        for s in range(steps):
            gen.append(int(np.random.default_rng(s).integers(2, CFG.vocab_size)))
            a, b = rt.next_logits(req, res, gen), rt.next_logits(req, rec, gen)
            assert res.decode.rows == req.tokens.size + s + 1  # the incremental path ran
            assert rel_err(a, b) < TOL_FP32, (arm, s)
    # both arms over the document's state held dense on the device (what a prefix cache holds),
    # through a runtime with a prefix cache: the same logits; a miss the first time, then hits
    hot = hot_prefix(arts[L], range(CFG.num_layers), CFG.sliding_window)
    assert not hot.layers and sorted(hot.prefix_layers) == list(range(CFG.num_layers))
    assert all(isinstance(v, jax.Array) for d in hot.prefix_layers.values()
               for v in jax.tree.leaves({k: a for k, a in d.items() if k != "length"}))
    assert {d["length"] for d in hot.prefix_layers.values()} == {L}  # host ints: no device read per layer
    assert all(isinstance(d["length"], np.integer) for d in hot.prefix_layers.values())
    assert {d["kv"].shape[0] for d in hot.prefix_layers.values()} == {CFG.sliding_window} and CFG.sliding_window < L
    # the RedKnot arm first: its fences' states only, then the prefix arm adds the other layers
    cached = ReuseRuntime(model, PROF, FP, prefix_cache=1)
    fences = cached.consumer.fences
    for k, arm in enumerate(("redknot", "prefix", "prefix", "redknot")):
        want = rt.prefill(req, arm).logits
        np.testing.assert_array_equal(cached.prefill(req, arm, require_reuse=True).logits, want)
        held = next(iter(cached.prefix_cache._hot.values())).prefix_layers
        assert sorted(held) == (fences if k == 0 else list(range(CFG.num_layers))), arm
    assert 0 < len(fences) < CFG.num_layers
    assert cached.prefix_cache.stats == {"hits": 2, "misses": 2, "evictions": 0}


def test_prefix_cache_keeps_the_least_recently_used_out(arts):
    cache = PrefixCache(1, CFG.num_layers, CFG.sliding_window)
    a, b = cache.get(arts[45]), cache.get(arts[32])  # b evicts a
    assert cache.get(arts[32]) is b and cache.get(arts[45]) is not a and len(cache) == 1
    assert cache.stats == {"hits": 1, "misses": 3, "evictions": 2}
    hot = hot_prefix(arts[45], range(CFG.num_layers), CFG.sliding_window)
    assert cache.nbytes() == sum(v.nbytes for v in jax.tree.leaves(hot.prefix_layers))
    assert cache.drop(arts[45]) and not cache.drop(arts[45]) and len(cache) == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(0, CFG.num_layers, CFG.sliding_window)


def test_old_artifacts_relocate_and_fall_back_from_the_prefix_counted(model, docs, arts):
    rt = ReuseRuntime(model, PROF, FP)
    old = downgrade(arts[45])
    assert not can_prefix(old.certificate) and can_prefix(arts[45].certificate)
    assert "parts" not in old.certificate.to_dict()  # a format-3 certificate keeps its form and digest
    assert Certificate.from_dict(old.certificate.to_dict()) == old.certificate
    new = np.random.default_rng(3).integers(2, CFG.vocab_size, 19).astype(np.int32)
    req = Request([Segment(docs[45], old), Segment(new)])
    red = rt.prefill(req, "redknot", require_reuse=True)  # relocation still reads it, every row computed
    assert red.arm == "redknot" and red.plan.prefix == 0 and red.plan.candidates == 45
    res = rt.prefill(req, "prefix")
    assert res.arm == "recompute" and res.fallback is FallbackReason.NO_PREFIX_STATE and "format 3" in res.fallback_detail
    res = rt.prefill(Request([Segment(new), Segment(docs[45], arts[45])]), "prefix")
    assert res.fallback is FallbackReason.NO_PREFIX_STATE and "not a document" in res.fallback_detail
    assert rt.counters.fallback[FallbackReason.NO_PREFIX_STATE] == 2
    assert rt.counters.snapshot()["fallback"]["no_prefix_state"] == 2
    with pytest.raises(ReuseFallback, match="no_prefix_state"):
        rt.prefill(req, "prefix", require_reuse=True)
    with pytest.raises(ValueError, match="arm must be one of"):
        rt.prefill(req, "prefx")
    with pytest.raises(ValueError, match="cannot serve as an exact prefix"):
        rt.consumer.prefix(old, req.tokens, [50])
    with pytest.raises(ValueError, match="do not start with"):
        rt.consumer.prefix(arts[45], np.r_[new, docs[45]], [50])
    with pytest.raises(ValueError, match="no rows after"):
        rt.consumer.prefix(arts[45], docs[45], [44])
    with pytest.raises(ValueError, match=r"query rows must lie in \[45, 64\)"):
        rt.consumer.prefix(arts[45], req.tokens, [44])


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs"))
def _ffn_out(state, x, ids, *, graphdef, freqs):
    blk = nnx.merge(graphdef, state)
    t = x.shape[1]
    x, _, tr = blk(x, ids, jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32), blk.attn.init_cache(1, 64, x.dtype),
                   freqs, t, trace=True)
    return x, tr["ffn"]


def test_restore_profile_keeps_the_ffn_output_and_the_store_round_trips_it(model, docs, tmp_path):
    prof = dataclasses.replace(PROF, ffn_rows="restore")
    art = build_artifact(model, prof, docs[45], checkpoint_fingerprint=FP)
    assert art.certificate.parts == ("ffn", "prefix")
    ids = jnp.asarray(docs[45])[None]
    x = model.embed_streams(ids)
    for i, blk in enumerate(model.layers):  # the FFN sub-layer output of the native run, row by row
        gd, st = nnx.split(blk)
        x, y = _ffn_out(st, x, ids, graphdef=gd, freqs=model.freqs(i))
        if i in art.layers:
            assert art.layers[i]["ffn"].shape == (45, CFG.hidden_size) and art.layers[i]["ffn"].dtype == model.dtype
            assert rel_err(art.layers[i]["ffn"], y[0]) < TOL["chunked_vs_oneshot"][0], i
        else:
            assert "ffn" not in art.prefix_layers[i]
    # a profile that restores FFN rows refuses an artifact without them (counted)
    rt = ReuseRuntime(model, prof, FP)
    req = Request([Segment(docs[45], downgrade(art)), Segment(docs[32][:19])])
    res = rt.prefill(req, "redknot")
    assert res.fallback is FallbackReason.MISSING_PART and "ffn" in res.fallback_detail
    assert rt.counters.fallback[FallbackReason.MISSING_PART] == 1
    # persisted per layer (fence layers' state under "prefix"), checksummed, TP-sliced with it
    with ArtifactStore(tmp_path / "store", layer_group_size=2) as s:
        back = s.load(s.publish(art).doc_id)
    assert back.certificate == art.certificate and sorted(back.prefix_layers) == [0, 5]
    assert payload_digest(back.payload()) == art.certificate.payload_digest
    assert any(k.startswith("5/['prefix']") for k in back.payload())
    for sl in split_tp(art, 2):
        assert sorted(sl.prefix_layers) == [0, 5] and payload_digest(sl.payload()) == sl.certificate.payload_digest
