"""Cross-rank certification: one all-gather of (verdict, digest) per request decides for every
rank; a failure on a single rank makes every rank fall back with that rank's reason, counted
once; ranks that all validate but hold different certificates fall back with
RANK_DISAGREEMENT; artifacts cut for tp = 8 are refused at tp = 2 unless re-sliced."""

import dataclasses

import chex
import numpy as np
import pytest
import jax

from redknot_jax.reuse import codec
from redknot_jax.reuse.artifact import Artifact
from redknot_jax.reuse.certificate import CertCounters, FallbackReason, payload_digest
from redknot_jax.sharding import make_mesh
from redknot_jax.sharding.agree import Decision, RankVerdict, agree, rank_verdict, reslice, tp_geometry
from redknot_jax.store import split_tp
from tests.sharding.helpers import CFG, expectation, rank_segments, whole_artifact

TOKENS = np.arange(2, 42) % CFG.vocab_size


def verdicts(slices, tp, expect=None):
    expect = expect or expectation()
    return [rank_verdict(rank_segments(TOKENS, slices, r), expect, tp_geometry(CFG, tp, r)) for r in range(tp)]


def cut(art, tp):
    return split_tp(art, tp)


@pytest.fixture(scope="module")
def art():
    return whole_artifact(TOKENS, generation=3)


def test_all_ranks_ok_reuse(art):
    counters = CertCounters()
    v = verdicts(cut(art, 8), 8, expectation(min_generation=2))
    assert all(x.ok for x in v) and len({x.digest for x in v}) == 1
    d = agree(make_mesh(8), v, counters)
    assert d == Decision(True, None, "")
    assert counters.validated == 1 and sum(counters.fallback.values()) == 0


def _stale(slices, rank):
    old = whole_artifact(TOKENS, generation=1)  # an older generation of the same document
    slices[rank] = split_tp(old, 8)[rank]


def _geometry(slices, rank):
    slices[rank] = split_tp(whole_artifact(TOKENS, generation=3), 2)[rank % 2]  # cut for tp = 2


def _corrupt(slices, rank):
    s = slices[rank]
    layers = {i: dict(d) for i, d in s.layers.items()}
    z = layers[1]["zl"].copy()
    z[3, 0, 7] += 1e-3  # one value of the slice changes after certification
    layers[1]["zl"] = z
    slices[rank] = dataclasses.replace(s, layers=layers)


@pytest.mark.parametrize("inject,reason", [(_stale, FallbackReason.STALE_GENERATION),
                                           (_geometry, FallbackReason.TP_GEOMETRY),
                                           (_corrupt, FallbackReason.CHECKSUM)])
@pytest.mark.parametrize("rank", [0, 5])
def test_single_rank_failure_falls_back_everywhere(art, inject, reason, rank):
    slices = cut(art, 8)
    inject(slices, rank)
    v = verdicts(slices, 8, expectation(min_generation=2))
    assert [x.ok for x in v] == [r != rank for r in range(8)]  # only that rank saw anything wrong
    counters = CertCounters()
    d = agree(make_mesh(8), v, counters)  # returns: the failing rank joined the collective
    assert not d.reuse and d.reason is reason and d.failing_ranks == (rank,)
    assert d.detail.startswith(f"rank {rank} of 8: segment 0: ")
    assert counters.fallback[reason] == 1 and counters.validated == 0
    assert sum(counters.fallback.values()) == 1


def test_rank_disagreement(art):
    """Rank 6 holds a newer generation: every rank validates locally, digests differ."""
    slices = cut(art, 8)
    slices[6] = split_tp(whole_artifact(TOKENS, generation=4), 8)[6]
    v = verdicts(slices, 8, expectation(min_generation=2))
    assert all(x.ok for x in v)
    counters = CertCounters()
    d = agree(make_mesh(8), v, counters)
    assert (d.reuse, d.reason, d.differing_ranks, d.failing_ranks) == (False, FallbackReason.RANK_DISAGREEMENT, (6,), ())
    assert counters.fallback[FallbackReason.RANK_DISAGREEMENT] == 1


def test_several_failures_lowest_rank_reason(art):
    bad = [RankVerdict(None, "", "cd" * 32)] * 4
    bad[2] = RankVerdict(FallbackReason.CHECKSUM, "c", "0" * 64)
    bad[1] = RankVerdict(FallbackReason.MISSING_LAYERS, "m", "0" * 64)
    d = agree(make_mesh(4), bad)
    assert d.reason is FallbackReason.MISSING_LAYERS and d.failing_ranks == (1, 2)


def test_tp8_artifacts_rejected_at_tp2_unless_resliced(art):
    slices8 = cut(art, 8)
    counters = CertCounters()
    v = verdicts(slices8[:2], 2)  # a tp = 2 consumer reading the first two tp = 8 slices
    assert all(x.reason is FallbackReason.TP_GEOMETRY for x in v)
    assert "tp_size=2" in v[0].detail and "tp_size=8" in v[0].detail, v[0].detail
    d = agree(make_mesh(2), v, counters)
    assert d.reason is FallbackReason.TP_GEOMETRY and d.failing_ranks == (0, 1)
    assert counters.fallback[FallbackReason.TP_GEOMETRY] == 1

    slices2 = reslice(slices8, CFG, 2)  # the documented re-slicing path
    assert agree(make_mesh(2), verdicts(slices2, 2), counters).reuse and counters.validated == 1
    direct = cut(art, 2)
    for a, b in zip(slices2, direct):
        assert a.certificate == b.certificate
        chex.assert_trees_all_equal(a.layers, b.layers, strict=True)  # every layer's every field
    broken = list(slices8)
    _corrupt(broken, 3)
    with pytest.raises(ValueError, match="slice 3: payload"):
        reslice(broken, CFG, 2)


def test_compact_artifacts_cut_and_reslice_by_group(art):
    """An NVFP4 z_L (reuse/codec.py) keeps the output-group axis in its codes and both scales, so
    a rank's slice decodes to exactly the whole's groups, and re-slicing gives the direct cut."""
    layers = {i: jax.tree.map(np.asarray, codec.encode_layer(d, "fp4", CFG.rope_dim)) for i, d in art.layers.items()}
    enc = Artifact(art.tokens, layers, None)
    enc.certificate = dataclasses.replace(art.certificate, codec="fp4", payload_digest=payload_digest(enc.payload()))
    whole = enc.layer(1)["zl"]
    per = CFG.o_groups // 8
    slices8 = cut(enc, 8)
    for r, sl in enumerate(slices8):
        assert sl.certificate.codec == "fp4"
        np.testing.assert_array_equal(sl.layer(1)["zl"], whole[:, r * per:(r + 1) * per])
    for a, b in zip(reslice(slices8, CFG, 2), cut(enc, 2)):
        assert a.certificate == b.certificate
        chex.assert_trees_all_equal(a.layers, b.layers, strict=True)


def test_agreement_is_per_tp_group(art):
    """On a (dp, tp) mesh each dp row is its own request: a failure in one row's TP group
    falls back that row only."""
    mesh = make_mesh(4, dp=2)
    ok = verdicts(cut(art, 4), 4)
    slices = cut(art, 4)
    _corrupt(slices, 2)
    bad = verdicts(slices, 4)
    counters = CertCounters()
    d = agree(mesh, [ok, bad], counters)
    assert [x.reuse for x in d] == [True, False] and d[1].reason is FallbackReason.CHECKSUM
    assert counters.validated == 1 and counters.fallback[FallbackReason.CHECKSUM] == 1


def test_geometry_and_slices(art):
    assert tp_geometry(CFG, 8, 3).channel_ranges == ((3 * 16, 4 * 16),)  # one group of o = 16 per rank
    for tp in (1, 2, 8):  # the store cuts slices with exactly the geometry ranks expect
        assert [s.certificate.tp for s in split_tp(art, tp)] == [tp_geometry(CFG, tp, r) for r in range(tp)]
    with pytest.raises(ValueError, match="o_groups"):
        tp_geometry(CFG, 16, 0)
    assert len(jax.devices()) == 8
