"""Artifact certificates (DESIGN.md §3 last row, §5).

A certificate binds an artifact slice to everything its contents depend on: the checkpoint,
the document's token ids, the profile, the model config, the TP geometry of the rank that
reads it, the artifact generation and format, the layers it holds, the optional parts it holds
(format 4: `PARTS`), the codec its rows are stored in (format 5: `reuse.codec`) and a checksum of its arrays. A consumer calls `validate` with what *it* expects; any difference is a
`FallbackReason` and the request falls back to full recomputation before any reuse-specific
collective (cross-rank agreement on (verdict, `Certificate.digest()`) lives in
`redknot_jax/sharding/`, which reports `RANK_DISAGREEMENT`).

Digests are SHA-256 hex strings over canonical encodings, so they are stable across
processes, hosts and Python versions.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import numpy as np

# Bump when the artifact layout changes. 2: per-row controller statistic `far` in every reusable
# layer; 3: chunked payload digest; 4: optional parts (`PARTS`) named in the certificate; 5: the
# codec (`reuse.codec`) its rows are stored in.
FORMAT_VERSION = 5
# Formats a consumer still reads: a format-3 artifact relocates, but holds no optional part (so it
# cannot serve as an exact prefix, `can_prefix`); formats 3 and 4 are "dense".
READABLE_VERSIONS = (3, 4, 5)
# Optional parts of an artifact (format >= 4): "prefix" = every fence layer's native attention
# state (the document can be an exact prefix, DESIGN §4); "ffn" = each reusable layer's
# canonical FFN sub-layer output (profile ffn_rows="restore").
PARTS = ("prefix", "ffn")
# How an artifact's rows are stored (format >= 5; `reuse/codec.py` encodes and decodes them).
CODECS = ("dense", "fp8", "fp4")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class CertificateError(ValueError):
    """A certificate or geometry that is malformed (not merely mismatched)."""


# ------------------------------------------------------------------------------ digests
def canonical_json(obj: Any) -> str:
    """The one canonical JSON encoding hashed into digests: sorted keys, no whitespace,
    ASCII only, NaN/inf refused (they have no canonical JSON form)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def json_digest(obj: Any) -> str:
    """SHA-256 hex of `canonical_json(obj)` (profiles and certificates use this)."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


def _update_framed(h, data) -> None:
    # Length-prefix every field so that no two different sequences of fields hash alike
    # (e.g. names "ab"+"c" vs "a"+"bc").
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def token_digest(tokens) -> str:
    """SHA-256 of a 1-D sequence of token ids, as little-endian int64.

    Python lists and integer arrays of any width give the same digest for the same ids.
    """
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise CertificateError(f"token_digest: expected a 1-D sequence of ids, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise CertificateError(f"token_digest: expected integer token ids, got dtype {a.dtype}")
    a = a.astype("<i8", copy=False)
    h = hashlib.sha256(b"tokens:int64:")
    _update_framed(h, np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# Chunk of an array's bytes hashed on its own: chunks hash on several threads at once (hashlib
# releases the GIL), so a 90 GB payload is hashed at many times one core's ~1 GB/s.
PAYLOAD_CHUNK = 64 << 20
_HASH_THREADS = min(16, os.cpu_count() or 1)


def _chunk_digest(buf) -> bytes:
    return hashlib.sha256(buf).digest()


def payload_digest(arrays: Mapping[str, Any]) -> str:
    """SHA-256 over (name, dtype name, shape, chunk digests) of every array, in sorted name order.

    Each array's little-endian, C-contiguous bytes are cut into PAYLOAD_CHUNK-byte chunks;
    each chunk's SHA-256 is hashed (framed) in place of the bytes. So the digest depends on
    exactly the same things as one SHA-256 over all bytes, and the chunks hash in parallel.
    The dtype *name* is hashed (not `dtype.str`): ml_dtypes types such as bfloat16 and the
    float8 family all report an opaque `'<V2'`/`'<V1'` str, which would collide. A strided
    view hashes like its copy.
    """
    fields, chunks = [], []
    for name in sorted(arrays):
        if not isinstance(name, str):
            raise CertificateError(f"payload_digest: array names must be str, got {name!r}")
        a = np.asarray(arrays[name])
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # hashed in place (no bytes copy)
        k0 = len(chunks)
        chunks += [raw[i:i + PAYLOAD_CHUNK] for i in range(0, raw.size, PAYLOAD_CHUNK)]
        fields.append((name, a.dtype.name, list(a.shape), k0, len(chunks)))
    if len(chunks) > 1 and _HASH_THREADS > 1:
        with ThreadPoolExecutor(_HASH_THREADS) as ex:
            digests = list(ex.map(_chunk_digest, chunks))
    else:
        digests = [_chunk_digest(c) for c in chunks]
    h = hashlib.sha256(b"payload:chunked:")
    _update_framed(h, PAYLOAD_CHUNK.to_bytes(8, "little"))
    for name, dtype, shape, k0, k1 in fields:
        _update_framed(h, name.encode("utf-8"))
        _update_framed(h, dtype.encode("ascii"))
        _update_framed(h, canonical_json(shape).encode("ascii"))
        _update_framed(h, b"".join(digests[k0:k1]))
    return h.hexdigest()


# ------------------------------------------------------------------------------ data
def _int_field(owner: str, name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise CertificateError(f"{owner}.{name}: expected an int >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TPGeometry:
    """The tensor-parallel slice a rank reads: TP size, its rank, and the projected
    output-channel ranges `[start, end)` it owns (sorted, disjoint)."""

    tp_size: int
    rank: int
    channel_ranges: tuple[tuple[int, int], ...]

    def __post_init__(self):
        _int_field("TPGeometry", "tp_size", self.tp_size, 1)
        _int_field("TPGeometry", "rank", self.rank, 0)
        if self.rank >= self.tp_size:
            raise CertificateError(f"TPGeometry.rank: expected < tp_size {self.tp_size}, got {self.rank}")
        try:  # JSON gives lists; keep the dataclass hashable and comparable
            ranges = tuple((int(s), int(e)) for s, e in self.channel_ranges)
        except (TypeError, ValueError):
            raise CertificateError(f"TPGeometry.channel_ranges: expected (start, end) pairs, "
                                   f"got {self.channel_ranges!r}") from None
        prev_end = 0
        for s, e in ranges:
            if not 0 <= s < e or s < prev_end:
                raise CertificateError(f"TPGeometry.channel_ranges: expected sorted, disjoint, non-empty "
                                       f"[start, end) ranges, got {ranges}")
            prev_end = e
        object.__setattr__(self, "channel_ranges", ranges)

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "rank": self.rank,
                "channel_ranges": [list(r) for r in self.channel_ranges]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TPGeometry":
        return cls(tp_size=d["tp_size"], rank=d["rank"], channel_ranges=d["channel_ranges"])


_SINCE = {"parts": 4, "codec": 5}  # certificate fields and the format that introduced them


@dataclasses.dataclass(frozen=True)
class Certificate:
    """What one artifact slice (layer group x TP rank x channel range) was built from."""

    checkpoint_fingerprint: str
    token_digest: str
    profile_digest: str
    model_digest: str
    tp: TPGeometry
    generation: int
    format_version: int
    layers: tuple[int, ...]
    payload_digest: str
    parts: tuple[str, ...] = ()  # optional parts held (sorted, of PARTS); format >= 4 only
    codec: str = "dense"  # how its rows are stored (reuse.codec.CODECS); format >= 5 only

    def __post_init__(self):
        if not isinstance(self.checkpoint_fingerprint, str) or not self.checkpoint_fingerprint:
            raise CertificateError(f"Certificate.checkpoint_fingerprint: expected a non-empty str, "
                                   f"got {self.checkpoint_fingerprint!r}")
        for name in ("token_digest", "profile_digest", "model_digest", "payload_digest"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _HEX64.match(v):
                raise CertificateError(f"Certificate.{name}: expected 64 lowercase hex digits "
                                       f"(SHA-256), got {v!r}")
        if not isinstance(self.tp, TPGeometry):
            raise CertificateError(f"Certificate.tp: expected a TPGeometry, got {self.tp!r}")
        _int_field("Certificate", "generation", self.generation, 0)
        _int_field("Certificate", "format_version", self.format_version, 1)
        layers = tuple(self.layers)
        for layer in layers:
            _int_field("Certificate", "layers[]", layer, 0)
        if list(layers) != sorted(set(layers)):
            raise CertificateError(f"Certificate.layers: expected strictly increasing layer ids, got {layers}")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.parts, str) or not all(isinstance(p, str) for p in self.parts):
            raise CertificateError(f"Certificate.parts: expected a sequence of str, got {self.parts!r}")
        parts = tuple(self.parts)
        if list(parts) != sorted(set(parts)) or set(parts) - set(PARTS):
            raise CertificateError(f"Certificate.parts: expected sorted, distinct names of {PARTS}, got {parts}")
        if parts and self.format_version < 4:
            raise CertificateError(f"Certificate.parts: format {self.format_version} holds no optional part, got {parts}")
        object.__setattr__(self, "parts", parts)
        if self.codec not in CODECS:
            raise CertificateError(f"Certificate.codec: expected one of {CODECS}, got {self.codec!r}")
        if self.codec != "dense" and self.format_version < 5:
            raise CertificateError(f"Certificate.codec: format {self.format_version} is dense only, got {self.codec!r}")

    def to_dict(self) -> dict:
        """Plain JSON-able form (stored beside the artifact; also what `digest` hashes). Before
        format 4 there is no `parts` field, before 5 no `codec` (so older certificates keep their
        digests)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["tp"] = self.tp.to_dict()
        d["layers"] = list(self.layers)
        d["parts"] = list(self.parts)
        for name, since in _SINCE.items():
            if self.format_version < since:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Certificate":
        names = {f.name for f in dataclasses.fields(cls)}
        need = names - {n for n, since in _SINCE.items() if d.get("format_version", FORMAT_VERSION) < since}
        if not need <= set(d) <= names:
            raise CertificateError(f"Certificate.from_dict: unknown fields {sorted(set(d) - names)}, "
                                   f"missing fields {sorted(need - set(d))}")
        return cls(**{**d, "tp": TPGeometry.from_dict(d["tp"]), "layers": tuple(d["layers"]),
                      "parts": tuple(d.get("parts", ()))})

    def digest(self) -> str:
        """SHA-256 of the canonical JSON of every field (what ranks agree on)."""
        return json_digest(self.to_dict())


# ------------------------------------------------------------------------------ validation
class FallbackReason(enum.Enum):
    """Why a request fell back to full recomputation (one counter each)."""

    MISSING_LAYERS = "missing_layers"
    TOKEN_MISMATCH = "token_mismatch"
    PROFILE_MISMATCH = "profile_mismatch"
    CONFIG_MISMATCH = "config_mismatch"
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"
    STALE_GENERATION = "stale_generation"
    TP_GEOMETRY = "tp_geometry"
    CHECKSUM = "checksum"
    RANK_DISAGREEMENT = "rank_disagreement"
    UNKNOWN_ARTIFACT = "unknown_artifact"
    MISSING_PART = "missing_part"  # an optional part the profile needs (e.g. "ffn") is absent
    CODEC_MISMATCH = "codec_mismatch"  # rows stored in another codec than the profile reads
    ARENA_FULL = "arena_full"  # the cited documents do not fit the device arena beside pinned ones (server)
    NO_PREFIX_STATE = "no_prefix_state"  # asked to be an exact prefix, the artifact cannot (`can_prefix`)


def can_prefix(cert) -> bool:
    """Whether the artifact holds every layer's native state, i.e. can serve as an exact prefix
    (format >= 4 and the "prefix" part)."""
    return isinstance(cert, Certificate) and cert.format_version >= 4 and "prefix" in cert.parts


def explain(cert, *, expected_tokens_digest: str, profile_digest: str, model_digest: str,
            checkpoint_fingerprint: str, tp: TPGeometry, min_generation: int,
            required_layers: Iterable[int], actual_payload_digest: str, required_parts: Iterable[str] = (),
            codec: str = "dense") -> tuple[FallbackReason, str] | None:
    """Like `validate`, but also returns a message with the offending values (for logs)."""
    # Anything that is not a certificate of a readable format cannot be read field by field.
    if not isinstance(cert, Certificate):
        return FallbackReason.UNKNOWN_ARTIFACT, f"not a Certificate: {type(cert).__name__}"
    if cert.format_version not in READABLE_VERSIONS:
        return (FallbackReason.UNKNOWN_ARTIFACT,
                f"format_version: expected one of {READABLE_VERSIONS}, got {cert.format_version}")
    if cert.codec != codec:  # before the profile digest, which binds the codec too: the specific reason
        return FallbackReason.CODEC_MISMATCH, f"codec: expected {codec!r}, got {cert.codec!r}"
    required = sorted(set(required_layers))
    checks = (
        (FallbackReason.TOKEN_MISMATCH, "token_digest", expected_tokens_digest, cert.token_digest),
        (FallbackReason.PROFILE_MISMATCH, "profile_digest", profile_digest, cert.profile_digest),
        (FallbackReason.CONFIG_MISMATCH, "model_digest", model_digest, cert.model_digest),
        (FallbackReason.CHECKPOINT_MISMATCH, "checkpoint_fingerprint", checkpoint_fingerprint,
         cert.checkpoint_fingerprint),
        (FallbackReason.TP_GEOMETRY, "tp", tp, cert.tp),
    )
    for reason, name, want, got in checks:
        if want != got:
            return reason, f"{name}: expected {want!r}, got {got!r}"
    if cert.generation < min_generation:
        return FallbackReason.STALE_GENERATION, f"generation: expected >= {min_generation}, got {cert.generation}"
    missing = sorted(set(required) - set(cert.layers))
    if missing:
        return FallbackReason.MISSING_LAYERS, f"layers: missing {missing} (certificate holds {list(cert.layers)})"
    absent = sorted(set(required_parts) - set(cert.parts))
    if absent:
        return (FallbackReason.MISSING_PART, f"parts: missing {absent} (certificate of format "
                                             f"{cert.format_version} holds {list(cert.parts)})")
    if actual_payload_digest != cert.payload_digest:
        return (FallbackReason.CHECKSUM,
                f"payload_digest: certificate says {cert.payload_digest}, data hashes to {actual_payload_digest}")
    return None


def validate(cert, *, expected_tokens_digest: str, profile_digest: str, model_digest: str,
             checkpoint_fingerprint: str, tp: TPGeometry, min_generation: int,
             required_layers: Iterable[int], actual_payload_digest: str,
             required_parts: Iterable[str] = (), codec: str = "dense") -> FallbackReason | None:
    """None if `cert` may be consumed by this rank, else the first failing check's reason.

    Order: format (UNKNOWN_ARTIFACT unless in READABLE_VERSIONS), codec (`codec`: the profile's
    `artifact_codec`), tokens, profile, model config,
    checkpoint, TP geometry, generation (stale iff `cert.generation < min_generation`), required
    layers, required optional parts (MISSING_PART), payload checksum. The checksum is last because it is the one check that needs the data read.
    `RANK_DISAGREEMENT` is never returned here: it comes from the cross-rank agreement.
    """
    r = explain(cert, expected_tokens_digest=expected_tokens_digest, profile_digest=profile_digest,
                model_digest=model_digest, checkpoint_fingerprint=checkpoint_fingerprint, tp=tp,
                min_generation=min_generation, required_layers=required_layers,
                actual_payload_digest=actual_payload_digest, required_parts=required_parts, codec=codec)
    return None if r is None else r[0]


class CertCounters:
    """Thread-safe counters: certificates validated, fallbacks by reason (DESIGN.md §5-§6)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._validated = 0
        self._fallback = {r: 0 for r in FallbackReason}

    def record_ok(self) -> None:
        with self._lock:
            self._validated += 1

    def record_fallback(self, reason: FallbackReason) -> None:
        if not isinstance(reason, FallbackReason):
            raise TypeError(f"record_fallback: expected a FallbackReason, got {reason!r}")
        with self._lock:
            self._fallback[reason] += 1

    @property
    def validated(self) -> int:
        with self._lock:
            return self._validated

    @property
    def fallback(self) -> dict[FallbackReason, int]:
        """A copy: {reason: count} for every reason (zeros included)."""
        with self._lock:
            return dict(self._fallback)

    def snapshot(self) -> dict:
        """JSON-able, consistent (taken under one lock): {"validated": n, "fallback": {reason: n}}."""
        with self._lock:
            return {"validated": self._validated,
                    "fallback": {r.value: n for r, n in self._fallback.items()}}
