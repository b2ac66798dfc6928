"""Cross-rank certification (DESIGN §5): every TP rank validates its own artifact slices, then
ONE small collective agrees on (verdict, digest) before any reuse-specific collective.

* `tp_geometry(cfg, tp, rank)`: the slice a rank reads, its projected output channels
  [r g/tp o, (r+1) g/tp o) of the z = wo_a output (whole output groups per rank).
* Slices are cut by `store.split_tp` (z_L columns of the rank's groups; the shared latent,
  entries and metadata are one head and stay whole), each certified for its rank's geometry
  (the same as `tp_geometry`). A slice is valid only at the tp it was cut for: anything else
  is `FallbackReason.TP_GEOMETRY`. `reslice` is the documented path from the slices of one tp
  to another: it verifies every source slice, joins z_L back and cuts again.
* `rank_verdict` is one rank's local check (`certificate.explain` against that rank's
  geometry); its `digest` binds what must be identical on all ranks (the certificates' fields
  minus the rank-specific ones: rank, channel ranges, payload checksum).
* `agree(mesh, verdicts)` runs the collective and returns the same `Decision` on every rank:
  reuse iff every rank is ok with the same digest; else the lowest failing rank's reason, or
  `RANK_DISAGREEMENT` when all are ok but digests differ. Counted once per request.

A rank whose own check failed still enters the collective with its failure as data: no rank
ever skips it, so a single-rank failure cannot deadlock the others.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from redknot_jax.config import ModelConfig
from redknot_jax.reuse.artifact import Artifact, profile_parts
from redknot_jax.reuse.certificate import (FORMAT_VERSION, CertCounters, Certificate, FallbackReason, TPGeometry,
                                           explain, json_digest, payload_digest, token_digest)
from redknot_jax.sharding.table import AXIS, DP_AXIS, check_tp
from redknot_jax.store.store import split_tp

# Verdict codes carried by the collective: 0 = ok, i + 1 = the i-th FallbackReason.
REASONS = tuple(FallbackReason)
_CODE = {r: i + 1 for i, r in enumerate(REASONS)}
DIGEST_WORDS = 8  # a SHA-256 digest as 8 x 32-bit words
WIDTH = 1 + DIGEST_WORDS  # int32 per rank in the collective
NO_DIGEST = "0" * 64


# ------------------------------------------------------------------------------ geometry
def tp_geometry(cfg: ModelConfig, tp: int, rank: int) -> TPGeometry:
    """Rank `rank` of `tp`: its projected output channels of z = wo_a(o) ([g * o] wide), whole
    output groups; the geometry `store.split_tp` certifies slices with."""
    check_tp(cfg, tp)
    width = cfg.o_groups // tp * cfg.o_lora_rank
    return TPGeometry(tp_size=tp, rank=rank, channel_ranges=((rank * width, (rank + 1) * width),))


def reslice(slices: Sequence[Artifact], cfg: ModelConfig, tp: int) -> list[Artifact]:
    """Slices of one artifact at tp_src = len(slices) (rank order) -> slices at `tp`
    (e.g. artifacts built for tp = 8 served at tp = 2).

    Every source slice must carry a certificate for its own rank of tp_src whose payload
    checksum matches; all must agree on everything but rank, channels and checksum. The z_L
    columns are concatenated back and cut again; the replicated arrays come from rank 0."""
    src_tp = len(slices)
    if src_tp < 1:
        raise ValueError("reslice: no source slices")
    base = None
    for r, s in enumerate(slices):
        cert = s.certificate
        want = tp_geometry(cfg, src_tp, r)
        if cert.tp != want:
            raise ValueError(f"reslice: slice {r}: geometry expected {want}, got {cert.tp}")
        got = payload_digest(s.payload())
        if got != cert.payload_digest:
            raise ValueError(f"reslice: slice {r}: payload hashes to {got}, certificate says {cert.payload_digest}")
        ident = identity(cert)
        if base is None:
            base = ident
        elif ident != base:
            raise ValueError(f"reslice: slice {r} is from another artifact than slice 0 ({ident} vs {base})")
    check_tp(cfg, tp)
    first = slices[0]
    whole = {i: {**d, "zl": jax.tree.map(lambda *zs: np.concatenate([np.asarray(z) for z in zs], axis=1),
                                         *[s.layers[i]["zl"] for s in slices])}
             for i, d in first.layers.items()}
    merged = Artifact(first.tokens, whole, None, prefix_layers=dict(first.prefix_layers))
    merged.certificate = dataclasses.replace(first.certificate, tp=tp_geometry(cfg, 1, 0),
                                             payload_digest=payload_digest(merged.payload()))
    return split_tp(merged, tp)


# ------------------------------------------------------------------------------ local verdict
def identity(cert: Certificate) -> dict:
    """The certificate fields every rank must share (rank, channels, checksum removed)."""
    d = cert.to_dict()
    for k in ("payload_digest",):
        d.pop(k)
    d["tp"] = {"tp_size": cert.tp.tp_size}
    return d


@dataclasses.dataclass(frozen=True)
class Expectation:
    """What every rank of a request expects of its artifacts (its geometry aside)."""

    profile_digest: str
    model_digest: str
    checkpoint_fingerprint: str
    min_generation: int
    required_layers: tuple[int, ...]
    required_parts: tuple[str, ...] = ()  # optional artifact parts the profile needs
    codec: str = "dense"  # the codec the profile reads (`RedKnotProfile.artifact_codec`)

    @classmethod
    def of_runtime(cls, rt) -> "Expectation":
        """From a `reuse.runtime.ReuseRuntime` (its profile, config, fingerprint, generation)."""
        return cls(rt.profile.digest(), rt.cfg.fingerprint(), rt.fingerprint, rt.min_generation,
                   tuple(rt.reusable), profile_parts(rt.profile), rt.profile.artifact_codec)


@dataclasses.dataclass(frozen=True)
class RankVerdict:
    """One rank's local check: reason None = ok; `digest` what ranks must agree on."""

    reason: FallbackReason | None
    detail: str
    digest: str

    @property
    def ok(self) -> bool:
        return self.reason is None


def rank_verdict(segments: Iterable, expect: Expectation, geometry: TPGeometry) -> RankVerdict:
    """Validate one rank's artifact slices. `segments`: objects with `.tokens` and `.artifact`
    (a rank's slice, or None for new rows), e.g. `planner.Segment`. The same checks as
    `ReuseRuntime.certify`, against this rank's geometry (a slice's payload hashed once per
    slice object, `Artifact.digest`, as the single-device runtime does)."""
    idents = []
    for i, seg in enumerate(segments):
        art = seg.artifact
        if art is None:
            continue
        cert = art.certificate
        if isinstance(cert, Certificate):
            idents.append(identity(cert))
        absent = sorted(set(expect.required_layers) - set(art.layers))
        if absent:
            return RankVerdict(FallbackReason.MISSING_LAYERS, f"segment {i}: artifact lacks layers {absent}",
                               NO_DIGEST)
        bad = explain(cert, expected_tokens_digest=token_digest(seg.tokens), profile_digest=expect.profile_digest,
                      model_digest=expect.model_digest, checkpoint_fingerprint=expect.checkpoint_fingerprint,
                      tp=geometry, min_generation=expect.min_generation, required_layers=expect.required_layers,
                      required_parts=expect.required_parts, codec=expect.codec, actual_payload_digest=art.digest())
        if bad is not None:
            return RankVerdict(bad[0], f"segment {i}: {bad[1]}", NO_DIGEST)
    return RankVerdict(None, "", json_digest({"format": FORMAT_VERSION, "segments": idents}))


# ------------------------------------------------------------------------------ agreement
@dataclasses.dataclass(frozen=True)
class Decision:
    """The request's decision, identical on every rank of its TP group."""

    reuse: bool
    reason: FallbackReason | None
    detail: str
    failing_ranks: tuple[int, ...] = ()  # ranks whose own check failed
    differing_ranks: tuple[int, ...] = ()  # ranks whose digest differs from rank 0's


def _encode(v: RankVerdict) -> np.ndarray:
    row = np.zeros(WIDTH, np.int32)
    row[0] = 0 if v.reason is None else _CODE[v.reason]
    row[1:] = np.frombuffer(bytes.fromhex(v.digest), dtype="<u4").view(np.int32)
    return row


def _decide(gathered):
    """gathered [tp, WIDTH] int32 (the same on every rank) -> [4] int32:
    (code, first failing rank or -1, failing-rank bit mask, differing-digest bit mask)."""
    tp = gathered.shape[0]
    codes, digests = gathered[:, 0], gathered[:, 1:]
    bad = codes != 0
    any_bad = jnp.any(bad)
    first = jnp.argmax(bad)
    differ = jnp.any(digests != digests[0:1], axis=1)
    bits = jnp.left_shift(jnp.int32(1), jnp.arange(tp, dtype=jnp.int32))
    code = jnp.where(any_bad, codes[first], jnp.where(jnp.any(differ), _CODE[FallbackReason.RANK_DISAGREEMENT], 0))
    return jnp.stack([code, jnp.where(any_bad, first, -1).astype(jnp.int32),
                      jnp.sum(jnp.where(bad, bits, 0)), jnp.sum(jnp.where(differ, bits, 0))]).astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def _agree_fn(mesh):
    spec = P(DP_AXIS, AXIS) if DP_AXIS in mesh.axis_names else P(AXIS)

    def body(local):  # [1, WIDTH] (1-D mesh) or [1, 1, WIDTH]: this rank's encoded verdict
        row = local.reshape(WIDTH)
        # COLLECTIVE: all-gather over tp of every rank's (verdict code, 8-word digest):
        # tp x 9 int32 = 36 tp bytes. The only collective of certification; every rank then
        # computes the same decision from the same table.
        table = jax.lax.all_gather(row, AXIS, axis=0, tiled=False)  # [tp, WIDTH]
        return _decide(table).reshape(local.shape[:-1] + (4,))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def agree(mesh, verdicts, counters: CertCounters | None = None):
    """Agree on one request per TP group. `verdicts`: on a 1-D "tp" mesh, one `RankVerdict`
    per rank (rank order); on a ("dp", "tp") mesh, one such list per dp row this process
    drives (its local rows, in mesh order). Returns the `Decision` (a list of them per local dp
    row on a dp mesh), recorded once per request in `counters`. Raises if ranks computed
    different decisions (impossible unless the collective is broken)."""
    tp = mesh.shape[AXIS]
    if tp > 31:  # rank sets travel as int32 bit masks
        raise ValueError(f"agree: tp={tp} > 31 is not supported")
    has_dp = DP_AXIS in mesh.axis_names
    rows = [list(v) for v in verdicts] if has_dp else [list(verdicts)]
    for r in rows:
        if len(r) != tp:
            raise ValueError(f"agree: expected {tp} verdicts per TP group, got {len(r)}")
    table = np.stack([np.stack([_encode(v) for v in r]) for r in rows])  # [dp_local, tp, WIDTH]
    if not has_dp:
        table = table[0]
    spec = P(DP_AXIS, AXIS) if has_dp else P(AXIS)
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
        arr = jax.device_put(table, sharding)
    else:
        arr = jax.make_array_from_process_local_data(sharding, table)
    out = _agree_fn(mesh)(arr)
    # Every rank's own decision, as this process sees it: [dp_local, tp, 4].
    per_rank = {}
    for s in out.addressable_shards:
        idx = tuple(i.start or 0 for i in s.index[:-1])
        per_rank[idx] = np.asarray(s.data).reshape(4)
    decisions = []
    local_rows = sorted({k[0] for k in per_rank}) if has_dp else [0]
    for li, row in enumerate(local_rows):
        mine = [v for k, v in sorted(per_rank.items()) if (k[0] == row if has_dp else True)]
        if any(not np.array_equal(m, mine[0]) for m in mine):
            raise RuntimeError(f"agree: ranks computed different decisions {[m.tolist() for m in mine]}")
        decisions.append(_decision(mine[0], rows[li], tp, counters))
    return decisions if has_dp else decisions[0]


def _decision(vec, verdicts: Sequence[RankVerdict], tp: int, counters: CertCounters | None) -> Decision:
    code, first, fail_mask, differ_mask = (int(x) for x in vec)
    failing = tuple(r for r in range(tp) if fail_mask >> r & 1)
    differing = tuple(r for r in range(tp) if differ_mask >> r & 1)
    if code == 0:
        if counters is not None:
            counters.record_ok()
        return Decision(True, None, "")
    reason = REASONS[code - 1]
    if first >= 0:
        detail = f"rank {first} of {tp}: {verdicts[first].detail}"
        if len(failing) > 1:
            detail += f" (failing ranks {list(failing)})"
    else:
        detail = f"ranks {list(differing)} hold other certificates than rank 0 (all validated locally)"
    if counters is not None:
        counters.record_fallback(reason)
    return Decision(False, reason, detail, failing, differing)
