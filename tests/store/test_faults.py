"""Fault tests of the artifact store (issue #5 item 6), with real processes and real kills.

* builders killed with SIGKILL at random (seeded) moments, many times, while a reader loads
  every visible generation: every visible generation verifies, no read ever failed, gc
  removes the dead builders' temporaries;
* a flipped byte / a truncated file anywhere in a generation -> CHECKSUM, and a request
  through the runtime falls back to recomputation, counted (real tiny model, real artifact);
* two builder processes racing on one document -> one clean generation each, or one winner;
* disk full (a 256 KiB tmpfs, or a simulated ENOSPC) -> StoreFullError, nothing visible,
  temporary removed, the store still verifies.
"""

import dataclasses
import errno
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import jax.numpy as jnp

from redknot_jax.reuse.certificate import CertCounters, FallbackReason
from redknot_jax.store import ArtifactStore, StoreFullError, StoreIntegrityError, document_id
from tests.store import CFG, FP, PROFILE, payload_of, spawn_builder, synthetic, write_plain

N_KILLS = 14


def same_payload(a, b) -> bool:
    pa, pb = a.payload(), b.payload()
    return sorted(pa) == sorted(pb) and all(np.asarray(pa[k]).tobytes() == np.asarray(pb[k]).tobytes() for k in pa)


def clean(store) -> bool:
    return all(err is None for _, _, err in store.fsck())


# ---------------------------------------------------------------------------- kill -9
def test_killed_builders_never_expose_a_partial_generation(tmp_path):
    rng = np.random.default_rng(20261129)
    root = tmp_path / "store"
    store = ArtifactStore(root, layer_group_size=2)
    art = synthetic(40)
    plain = write_plain(art, tmp_path / "art.pkl")
    doc = store.publish(art).doc_id
    reads, errors, stop = [0], [], threading.Event()

    def reader():  # another store instance, loading whatever is visible, as fast as it can
        rs = ArtifactStore(root)
        while not stop.is_set():
            for g in rs.generations(doc):
                try:
                    got = rs.load(doc, g)
                    if not same_payload(got, art) or got.certificate.generation != g:
                        errors.append(f"generation {g}: wrong contents")
                    reads[0] += 1
                except Exception as e:  # nothing may fail: no gc runs during the kills
                    errors.append(f"generation {g}: {e!r}")
            time.sleep(0.002)
        rs.close()

    th = threading.Thread(target=reader)
    th.start()
    printed, mid_write = 0, 0
    try:
        for _ in range(N_KILLS):
            p = spawn_builder(root, plain, on_conflict="retry")
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
            time.sleep(rng.uniform(0.0, 0.15))  # a publish takes ~10 ms: lands in a random phase
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            assert p.returncode == -signal.SIGKILL, p.stderr.read()
            printed += p.stdout.read().count("published")
            p.stdout.close(), p.stderr.close()
            mid_write += bool(os.listdir(root / "tmp"))
    finally:
        stop.set()
        th.join()
    assert errors == [] and reads[0] > 0
    gens = store.generations(doc)
    assert gens == list(range(1, len(gens) + 1)) and len(gens) >= 1 + printed  # a kill may follow the rename
    assert clean(store)
    leftovers = set(os.listdir(root / "tmp"))
    assert mid_write > 0 and leftovers  # some kills did land inside a publish
    rep = store.gc(keep=len(gens))  # keep every generation; remove the dead builders' temporaries
    assert set(rep.removed_tmp) == leftovers and os.listdir(root / "tmp") == []
    assert store.generations(doc) == gens and clean(store)
    assert store.gc().removed_generations == [(doc, g) for g in gens[:-1]]
    assert store.generations(doc) == gens[-1:] and same_payload(store.load(doc), art)


# ---------------------------------------------------------------------------- corruption
def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x40
    path.write_bytes(bytes(data))


def _targets(store, doc):
    meta = store.open_slice(doc, 1)
    g = store.gen_dir(doc, 1)
    if meta.codec == "raw":
        zl = "3/['zl']" if "3/['zl']" in meta.tiles else "3/['zl']['e2m1']"  # dense, or NVFP4 codes
        tile = meta.path / meta.tiles[zl]["file"]
    else:  # every data file of the Orbax item holding layer 3 (which one holds a given array is
        # TensorStore's business, and OCDBT may leave files no longer referenced)
        tile = [p for p in (meta.path / "group-1").rglob("*") if p.is_file() and p.parent.name == "d"]
    return {"tile": tile, "manifest": meta.path / "manifest.json", "generation.json": g / "generation.json",
            "generation.sha256": g / "generation.sha256", "tokens": g / "tokens.bin"}


CASES = [("raw", t, "dense") for t in ("tile", "manifest", "generation.json", "generation.sha256", "tokens")] + [
    ("orbax", "tile", "dense"), ("raw", "tile", "fp4"), ("orbax", "tile", "fp8")]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("codec,target,art_codec", CASES)
def test_damaged_files_are_checksum_failures(tmp_path, codec, target, art_codec, damage):
    store = ArtifactStore(tmp_path / "s", codec=codec, layer_group_size=2)
    art = synthetic(41, artifact_codec=art_codec)  # art_codec: how the rows are stored (reuse/codec.py)
    doc = store.publish(art).doc_id
    paths = _targets(store, doc)[target]
    for path in paths if isinstance(paths, list) else [paths]:
        if damage == "flip":
            _flip(path)
        else:
            os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(StoreIntegrityError) as e:
        store.load(doc)
    assert e.value.reason == FallbackReason.CHECKSUM
    if target == "tile":  # caught by the payload digest (or the read), then named: its layer group
        assert "group 1" in str(e.value), e.value
    c = CertCounters()
    profile = dataclasses.replace(PROFILE, artifact_codec=art_codec)
    assert store.lookup_for_request(art.tokens, profile, CFG, FP, counters=c) == FallbackReason.CHECKSUM
    assert c.fallback[FallbackReason.CHECKSUM] == 1
    assert [err is not None for _, _, err in store.fsck()] == [True]
    if target == "tile":
        with pytest.raises(StoreIntegrityError):  # a group read alone: the tile checksum alone catches it
            store.load(doc, layers=[3])
        assert sorted(store.load(doc, layers=[1]).layers) == [1, 2]  # the intact group still reads
    assert store.held_pins() == {}  # a failed read releases its pin


# ---------------------------------------------------------------------------- races
@pytest.mark.parametrize("policy", ["yield", "retry"])
def test_racing_builder_processes_never_mix(tmp_path, policy):
    root = tmp_path / "store"
    store = ArtifactStore(root, layer_group_size=2)
    for rnd in range(3):
        art = synthetic(50 + rnd)
        plain = write_plain(art, tmp_path / f"a{rnd}.pkl")
        start = time.time() + 1.0
        procs = [spawn_builder(root, plain, on_conflict=policy, loops=1, start_at=start) for _ in range(2)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            outs.append([tuple(map(int, ln.split()[1:])) for ln in out.splitlines() if ln.startswith("published")][0])
        doc = document_id(art.tokens, PROFILE, CFG, FP)
        gens = store.generations(doc)
        reported = sorted(g for g, _ in outs)
        if policy == "retry" or reported[0] != reported[1]:
            assert all(created for _, created in outs) and reported == gens and len(set(reported)) == 2
        else:  # both saw the same number: exactly one won, the other yielded to it
            assert sorted(created for _, created in outs) == [0, 1] and gens == reported[:1]
        builders = {store.generation_info(doc, g)["builder"] for g in gens}
        assert len(builders) == len(gens)  # one builder per generation (fsck checks every slice agrees)
        assert all(same_payload(store.load(doc, g), art) for g in gens)
        assert os.listdir(root / "tmp") == []
    assert clean(store)


# ---------------------------------------------------------------------------- disk full
@pytest.fixture
def small_tmpfs(tmp_path):
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); "
                    f"test_disk_full_simulated covers the same path")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


@pytest.mark.parametrize("codec", ["raw", "orbax"])
def test_disk_full_on_a_small_tmpfs(small_tmpfs, codec):
    store = ArtifactStore(small_tmpfs / "store", codec=codec, layer_group_size=2)
    small, big = synthetic(60), synthetic(61, n=400)
    doc = store.publish(small).doc_id
    free = os.statvfs(small_tmpfs).f_bfree
    with pytest.raises(StoreFullError, match="no space left") as e:
        store.publish(big)
    assert e.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(store.root / "tmp") == [] and os.statvfs(small_tmpfs).f_bfree == free
    assert store.documents() == [doc] and store.generations(doc) == [1] and clean(store)
    assert same_payload(store.load(doc), small)
    assert store.gc().removed_generations == []


# Writes of a publish of `synthetic` (4 layers in 2 groups): tokens.bin, the n tiles,
# manifest.json, generation.json, generation.sha256. Fail at each kind (write index from n).
@pytest.mark.parametrize("after_tiles,kind", [(-1, "tokens.bin"), (-0.5, ".bin"), (0, "manifest.json"),
                                              (1, "generation.json"), (2, "generation.sha256")])
def test_disk_full_simulated(tmp_path, after_tiles, kind):
    store = ArtifactStore(tmp_path / "s", layer_group_size=2)
    art = synthetic(62)
    n_tiles = len(payload_of(art.layers))
    fail_at = {-1: 0, -0.5: 5}.get(after_tiles, 1 + n_tiles + after_tiles)
    calls, failed = [0], []
    real = store._write

    def write(path, data, durable):
        calls[0] += 1
        if calls[0] > fail_at:
            failed.append(path.name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data, durable)

    store._write = write
    with pytest.raises(StoreFullError, match="nothing was published"):
        store.publish(art)
    assert failed[0].endswith(kind) and len(failed) == 1
    assert store.documents() == [] and os.listdir(store.root / "tmp") == []
    store._write = real
    assert store.publish(art).generation == 1 and clean(store)


# ---------------------------------------------------------------------------- runtime
@pytest.fixture(scope="module")
def model():
    from redknot_jax.init import random_model

    return random_model(CFG, seed=7, dtype=jnp.float32)


@pytest.mark.slow
def test_runtime_reads_the_store_and_falls_back_counted_on_corruption(model, tmp_path):
    """A real built artifact through the store gives the RedKnot arm bit-identical logits to
    the in-memory artifact; after a byte flip the request falls back to the Recomputed arm,
    counted as CHECKSUM, before any reuse work."""
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.reuse.from_store import prefill_from_store
    from redknot_jax.reuse.planner import Request, Segment
    from redknot_jax.reuse.runtime import ReuseFallback, ReuseRuntime

    rng = np.random.default_rng(70)
    doc_tokens, question = rng.integers(2, CFG.vocab_size, 40), rng.integers(2, CFG.vocab_size, 6)
    art = build_artifact(model, PROFILE, doc_tokens, checkpoint_fingerprint=FP)
    store = ArtifactStore(tmp_path / "s", layer_group_size=2)
    doc = store.publish(art).doc_id
    rt = ReuseRuntime(model, PROFILE, FP)

    res = prefill_from_store(store, rt, [doc_tokens], question, require_reuse=True)
    ref = rt.prefill(Request([Segment(doc_tokens, art), Segment(question)]), "redknot", require_reuse=True)
    assert res.arm == ref.arm == "redknot"
    np.testing.assert_array_equal(res.logits, ref.logits)
    assert rt.counters.validated == 2

    tile = store.open_slice(doc, 1)
    _flip(tile.path / tile.tiles["2/['kv']"]["file"])
    with pytest.raises(StoreIntegrityError):
        store.load(doc)
    bad = prefill_from_store(store, rt, [doc_tokens], question)
    assert bad.arm == "recompute" and bad.fallback == FallbackReason.CHECKSUM and "sha256" in bad.fallback_detail
    assert rt.counters.fallback[FallbackReason.CHECKSUM] == 1 and rt.counters.validated == 2
    np.testing.assert_array_equal(bad.logits, rt.prefill(Request([Segment(doc_tokens), Segment(question)]),
                                                          "recompute").logits)
    with pytest.raises(ReuseFallback, match="checksum"):
        prefill_from_store(store, rt, [doc_tokens], question, require_reuse=True)
    assert rt.counters.fallback[FallbackReason.CHECKSUM] == 2
