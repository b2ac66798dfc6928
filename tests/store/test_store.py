"""Artifact store: identity, layout, exact round trip, partial reads, generations, pins, gc,
request lookup, tiers and prefetch. Synthetic artifacts (tests/store/__init__.py) with the
tiny config's exact structure: the store never looks inside the arrays. The runtime
end-to-end test (a real built artifact through the store) is in test_faults.py."""

import dataclasses
import os
import subprocess
import threading
import time

import chex
import numpy as np
import pytest
import jax

from redknot_jax.reuse.artifact import single_rank
from redknot_jax.reuse.certificate import CertCounters, FallbackReason, TPGeometry
from redknot_jax.store import (DEFAULT_TP, ArtifactStore, InvalidDocumentId, PublishError, StoreIntegrityError,
                               StoreMissError, TieredCache, document_id, flatten_layers, split_tp)
from redknot_jax.store.store import _host
from tests.store import CFG, FP, PROFILE, REPO, synthetic


def assert_same(a, b):
    """Bit for bit: the same payload names, each with the same dtype, shape and bytes (compared
    as uint8, so -0.0 / 0.0 or two NaN payloads differ), and the same tokens."""
    pa, pb = (jax.tree.map(np.asarray, x.payload()) for x in (a, b))
    chex.assert_trees_all_equal_shapes_and_dtypes(pa, pb)
    bits = lambda tree: jax.tree.map(lambda x: np.ascontiguousarray(x).reshape(-1).view(np.uint8), tree)
    chex.assert_trees_all_equal(bits(pa), bits(pb))
    np.testing.assert_array_equal(a.tokens, b.tokens)


@pytest.fixture
def store(tmp_path):
    with ArtifactStore(tmp_path / "store", layer_group_size=2) as s:
        yield s


# ---------------------------------------------------------------------------- identity
def test_document_id_is_a_content_hash_and_user_ids_are_checked(store):
    art = synthetic(0)
    d = document_id(art.tokens, PROFILE, CFG, FP)
    assert len(d) == 64 and d == document_id(list(map(int, art.tokens)), PROFILE.digest(), CFG.fingerprint(), FP)
    others = {document_id(art.tokens[:-1], PROFILE, CFG, FP),
              document_id(art.tokens, dataclasses.replace(PROFILE, tau=0.5), CFG, FP),
              document_id(art.tokens, PROFILE, dataclasses.replace(CFG, vocab_size=98), FP),
              document_id(art.tokens, PROFILE, CFG, FP + "x")}
    assert d not in others and len(others) == 4
    assert store.publish(art).doc_id == d
    for bad in ("../" + d[3:], d.upper(), d[:63], d + "0", "/etc/passwd", None, 7, d[:32] + "/" + d[33:]):
        with pytest.raises(InvalidDocumentId):
            store.load(bad)
    assert DEFAULT_TP == single_rank()


def test_tile_names_are_the_certificate_payload_names():
    art = synthetic(1)
    flat = flatten_layers(art.layers)
    assert set(flat) == set(art.payload())
    with pytest.raises(PublishError, match="not \\[A-Za-z0-9_\\]"):
        flatten_layers({1: {"../x": np.zeros(2)}})


# ---------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("n,art_codec", [(40, "dense"), (10, "dense"), (40, "fp4")])  # 10 rows: HCA layers
@pytest.mark.parametrize("codec", ["raw", "orbax"])  # have zero-size entries [0, 32]; fp4: reuse/codec.py's tiles
def test_round_trip_is_exact(tmp_path, codec, n, art_codec):
    art = synthetic(2, n=n, zl_dtype=jax.numpy.bfloat16, artifact_codec=art_codec)  # ml_dtypes tiles
    with ArtifactStore(tmp_path / codec, codec=codec, layer_group_size=2) as s:
        p = s.publish(art)
        assert p.created and p.generation == 1
        back = s.load(p.doc_id)
        assert_same(art, back)
        zl = back.layers[1]["zl"]
        if art_codec == "dense":
            assert zl.dtype.name == "bfloat16"
        else:  # e2m1 codes, e4m3 block scales, an fp32 row scale; top-k ids int16
            assert {k: v.dtype.name for k, v in zl.items()} == {"e2m1": "uint8", "e4m3": "float8_e4m3fn",
                                                                 "fp32": "float32"}
            assert back.layers[1]["topk"].dtype.name == "int16" and back.certificate.codec == "fp4"
        assert back.certificate == art.certificate  # generation 1 == the build's
        p2 = s.publish(art)
        assert p2.generation == 2 and s.load(p.doc_id).certificate.generation == 2
        assert s.load(p.doc_id, 1).certificate.generation == 1
        assert [e for e in s.fsck() if e[2] is not None] == []
        info = s.generation_info(p.doc_id, 2)
        assert info["codec"] == codec and info["tp_size"] == 1


def test_publish_refuses_data_that_does_not_match_its_certificate(store):
    art = synthetic(3)
    art.layers[2]["kv"] = art.layers[2]["kv"] + 1e-3
    with pytest.raises(PublishError, match="hashes to"):
        store.publish(art)
    art = synthetic(3)
    art.tokens = art.tokens[::-1].copy()
    with pytest.raises(PublishError, match="token"):
        store.publish(art)
    assert store.documents() == [] and os.listdir(store.root / "tmp") == []


# ---------------------------------------------------------------------------- partial reads
def test_a_layer_group_and_a_rank_slice_are_read_alone(store, monkeypatch):
    """... and a whole load hands its checked payload digest to the artifact (certification does
    not hash it again, Artifact.digest); a part of one is hashed when asked."""
    from redknot_jax.reuse import artifact

    hashed = []
    monkeypatch.setattr(artifact, "payload_digest", lambda a: hashed.append(1) or "partial")
    art = synthetic(4)
    p = store.publish(art)
    meta = store.open_slice(p.doc_id, p.generation)
    assert meta.groups == {0: (1, 2), 1: (3, 4)}
    assert store.load(p.doc_id).digest() == art.certificate.payload_digest and not hashed
    before = store.stats()["bytes_read"]
    part = store.load(p.doc_id, layers=[3])
    assert part.digest() == part.digest() == "partial" and len(hashed) == 1  # hashed once, kept
    assert sorted(part.layers) == [3, 4]  # the whole group holding layer 3, nothing else
    assert store.stats()["bytes_read"] - before == meta.group_nbytes(1) < sum(
        a.nbytes for a in art.payload().values())
    with pytest.raises(StoreMissError) as e:
        store.load(p.doc_id, layers=[5])
    assert e.value.reason == FallbackReason.MISSING_LAYERS

    ranks = split_tp(art, 2)  # one output group per rank, as Flash at TP 8
    assert [r.certificate.tp.channel_ranges for r in ranks] == [((0, 16),), ((16, 32),)]
    q = store.publish(ranks)
    assert q.doc_id == p.doc_id and q.generation == 2
    before = store.stats()["bytes_read"]
    r1 = store.load(p.doc_id, tp=ranks[1].certificate.tp)
    assert store.stats()["bytes_read"] - before == sum(a.nbytes for a in ranks[1].payload().values())
    assert_same(r1, ranks[1])
    np.testing.assert_array_equal(r1.layers[2]["zl"], np.asarray(art.layers[2]["zl"])[:, 1:])
    # the single-rank reader still finds generation 1; an unknown geometry is TP_GEOMETRY
    assert store.load(p.doc_id).certificate.generation == 1
    with pytest.raises(StoreMissError) as e:
        store.load(p.doc_id, tp=TPGeometry(4, 0, ((0, 8),)))
    assert e.value.reason == FallbackReason.TP_GEOMETRY
    with pytest.raises(PublishError, match="one slice per rank"):
        store.publish(ranks[:1])


# ---------------------------------------------------------------------------- generations
def test_pins_keep_generations_from_gc(store):
    art = synthetic(5)
    doc = store.publish(art).doc_id
    store.publish(art)
    store.publish(art)
    assert store.generations(doc) == [1, 2, 3]
    kept = store.load(doc, 1, pin=True)  # a reader holding generation 1
    with store.pinned(doc, 2) as g:
        assert g == 2
        rep = store.gc()
        assert rep.removed_generations == [] and sorted(rep.kept_pinned) == [(doc, 1), (doc, 2)]
    assert store.held_pins() == {(doc, 1): 1}
    rep = store.gc()
    assert rep.removed_generations == [(doc, 2)] and store.generations(doc) == [1, 3]
    store.unpin(doc, kept.certificate.generation)
    assert store.gc().removed_generations == [(doc, 1)] and store.generations(doc) == [3]
    with pytest.raises(StoreMissError) as e:
        store.load(doc, 1)
    assert e.value.reason == FallbackReason.UNKNOWN_ARTIFACT
    assert store.load(doc).certificate.generation == 3


def test_gc_removes_dead_pins_and_abandoned_temporaries_only(store):
    art = synthetic(6)
    doc = store.publish(art).doc_id
    store.publish(art)
    proc = subprocess.Popen(["true"])
    proc.wait()
    dead_pid = proc.pid  # a process of this host that has exited (and was reaped)
    pdir = store.root / "pins" / doc
    pdir.mkdir(parents=True, exist_ok=True)
    (pdir / f"gen-1.{_host()}.{dead_pid}.{'a' * 32}.pin").write_text("{}")
    tmp = store.root / "tmp"
    live = tmp / f"{_host()}.{os.getpid()}.{'b' * 32}"  # a builder still running (us)
    dead = tmp / f"{_host()}.{dead_pid}.{'c' * 32}"
    remote_old = tmp / f"otherhost.12.{'d' * 32}"
    remote_new = tmp / f"otherhost.13.{'e' * 32}"
    for d in (live, dead, remote_old, remote_new):
        (d / "tp1-r0-c0_1").mkdir(parents=True)
    old = time.time() - 7 * 3600
    os.utime(remote_old, (old, old))
    rep = store.gc()
    assert rep.removed_pins == [f"{doc}/gen-1.{_host()}.{dead_pid}.{'a' * 32}.pin"]
    assert rep.removed_generations == [(doc, 1)]  # the dead reader's pin did not protect it
    assert sorted(rep.removed_tmp) == sorted([dead.name, remote_old.name])
    assert sorted(os.listdir(tmp)) == sorted([live.name, remote_new.name])
    assert os.listdir(store.root / "trash") == []


def test_publish_conflict_yields_to_the_winner_or_takes_the_next_number(store, monkeypatch):
    """A builder that computed N before another published N (the race, made deterministic)."""
    art = synthetic(7)
    doc = store.publish(art).doc_id
    winner = store.generation_info(doc, 1)["builder"]
    real = store._next_generation
    stale = iter([1])
    monkeypatch.setattr(store, "_next_generation", lambda d: next(stale, None) or real(d))
    p = store.publish(art, on_conflict="yield")
    assert (p.generation, p.created) == (1, False) and store.generations(doc) == [1]
    assert store.generation_info(doc, 1)["builder"] == winner  # untouched
    stale = iter([1])
    p = store.publish(art, on_conflict="retry")
    assert (p.generation, p.created) == (2, True) and store.generations(doc) == [1, 2]
    assert store.stats()["publish_conflicts"] == 2
    assert os.listdir(store.root / "tmp") == []
    assert store.load(doc, 2).certificate.generation == 2


# ---------------------------------------------------------------------------- requests
def test_lookup_for_request_counts_every_miss(store):
    art = synthetic(8)
    store.publish(art)
    c = CertCounters()
    got = store.lookup_for_request(art.tokens, PROFILE, CFG, FP, counters=c)
    assert_same(got, art)
    assert store.lookup_for_request(art.tokens[:-1], PROFILE, CFG, FP, counters=c) == FallbackReason.UNKNOWN_ARTIFACT
    assert store.lookup_for_request(art.tokens, PROFILE, CFG, "other", counters=c) == FallbackReason.UNKNOWN_ARTIFACT
    assert store.lookup_for_request(art.tokens, PROFILE, CFG, FP, min_generation=2,
                                    counters=c) == FallbackReason.STALE_GENERATION
    assert store.lookup_for_request(art.tokens, PROFILE, CFG, FP, tp=TPGeometry(2, 1, ((16, 32),)),
                                    counters=c) == FallbackReason.TP_GEOMETRY
    snap = c.snapshot()
    assert snap["validated"] == 0  # only the runtime's certification counts validations
    assert {k: v for k, v in snap["fallback"].items() if v} == {"unknown_artifact": 2, "stale_generation": 1,
                                                                 "tp_geometry": 1}


# ---------------------------------------------------------------------------- tiers
def test_tiers_are_lru_by_bytes_with_counters(store):
    arts = [synthetic(10 + i) for i in range(3)]
    docs = [store.publish(a).doc_id for a in arts]
    g = store.open_slice(docs[0], 1).group_nbytes(0)
    assert all(store.open_slice(d, 1).group_nbytes(k) == g for d in docs for k in (0, 1))  # equal sizes
    cache = TieredCache(store, device_bytes=2 * g, host_bytes=3 * g)
    try:
        dev0 = cache.group(docs[0], 0)
        assert all(isinstance(v, jax.Array) and v.devices() == {cache.device} for v in dev0.values())
        np.testing.assert_array_equal(np.asarray(dev0["1/['cmp']['kv']"]), arts[0].layers[1]["cmp"]["kv"])
        cache.group(docs[0], 1)
        cache.group(docs[0], 0)  # device hit; (0,0) becomes most recent
        cache.group(docs[1], 0)  # device evicts (0,1), the least recent
        s = cache.stats()
        assert (s["device"]["hits"], s["device"]["misses"], s["device"]["evictions"]) == (1, 3, 1)
        assert s["disk"]["reads"] == 3 and s["device"]["bytes"] == 2 * g
        cache.group(docs[0], 1)  # device miss, host hit: no disk read
        s = cache.stats()
        assert s["disk"]["reads"] == 3 and s["host"]["hits"] == 1
        cache.group(docs[2], 0)  # host (capacity 3) evicts its least recent entry, (0,0)
        assert cache.stats()["host"]["evictions"] == 1
        cache.group(docs[0], 0)  # gone from both tiers (device evicted it at the previous miss)
        assert cache.stats()["disk"]["reads"] == 5
        cache.group(docs[0], 0)
        assert cache.stats()["device"]["hits"] == 2
        art = cache.load(docs[1])  # a device Artifact assembled from its groups
        assert_same(art, arts[1])  # payload() copies to host
        # a generation stays pinned in the store while any of its groups is cached
        cached = {k[:2] for k in cache.device_tier.keys() + cache.host_tier.keys()}
        assert set(store.held_pins()) == cached and cache.stats()["pinned_generations"] == len(cached)
    finally:
        cache.close()
    assert store.held_pins() == {}
    tiny = TieredCache(store, device_bytes=g // 2, host_bytes=g // 2)
    try:
        tiny.group(docs[0], 0)
        assert tiny.stats()["device"]["bypassed"] == 1 and tiny.stats()["device"]["entries"] == 0
    finally:
        tiny.close()


def test_prefetch_is_asynchronous_and_single_flight(store, monkeypatch):
    arts = [synthetic(20 + i) for i in range(2)]
    docs = [store.publish(a).doc_id for a in arts]
    gate = threading.Event()
    real = store.read_group

    def slow(meta, group):
        assert gate.wait(10)
        return real(meta, group)

    monkeypatch.setattr(store, "read_group", slow)
    cache = TieredCache(store, device_bytes=1 << 22, host_bytes=1 << 22)
    try:
        t0 = time.perf_counter()
        futs = cache.prefetch(docs, [1])
        again = cache.prefetch(docs, [1])  # requested again while loading: the same futures
        assert time.perf_counter() - t0 < 5 and not any(f.done() for f in futs.values())
        assert all(again[k] is futs[k] for k in futs)
        gate.set()
        for (d, k), f in futs.items():
            a = arts[docs.index(d)]
            np.testing.assert_array_equal(np.asarray(f.result()["3/['zl']"]), a.layers[3]["zl"])
        assert cache.stats()["disk"]["reads"] == 2  # one read per group despite two requests
        part = cache.load(docs[0], layers=[4])
        assert sorted(part.layers) == [3, 4] and cache.stats()["device"]["hits"] >= 1
    finally:
        cache.close()


def test_tier_load_errors_reach_the_consumer(store):
    art = synthetic(30)
    doc = store.publish(art).doc_id
    meta = store.open_slice(doc, 1)
    victim = meta.path / next(iter(meta.tiles_of(0).values()))["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    cache = TieredCache(store, device_bytes=1 << 20, host_bytes=1 << 20)
    try:
        with pytest.raises(StoreIntegrityError) as e:
            cache.group(doc, 0)
        assert e.value.reason == FallbackReason.CHECKSUM
        assert cache.stats()["device"]["entries"] == 0
        cache.group(doc, 1)  # the intact group still loads
    finally:
        cache.close()
    assert store.held_pins() == {}


def test_the_store_imports_no_jax():
    """The store (and the certificates it checks) is numpy-only, so builder processes start in a
    fraction of a second (test_faults spawns 14); a compact codec's shapes are read without jax."""
    import subprocess
    import sys

    code = ("import sys; from redknot_jax.store.store import ArtifactStore, split_tp; "
            "from redknot_jax.reuse.certificate import CODECS; assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(REPO))
