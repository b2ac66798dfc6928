"""Artifact store (DESIGN §3, §5, §7): immutable, generation-atomic, certified artifacts on
disk, laid out by document x generation x TP slice x layer group.

Layout under `root` (every path component below is derived from validated data, never from a
user-given name):

    STORE.json                         store format marker
    lock                               flock: gc exclusive, pinning readers shared
    docs/<doc_id>/gen-<N>/             one published generation (immutable)
        generation.sha256              SHA-256 of generation.json (the root of trust)
        generation.json                doc id, N, TP size, codec, layer-group size, builder,
                                       tokens {file, sha256}, slices {name: manifest sha256}
        tokens.bin                     the document's token ids
        tp<T>-r<R>-c<s>_<e>[.<s>_<e>]/ one TP rank x its projected output-channel ranges
            manifest.json              the rank's certificate, layer groups, and per tile:
                                       layer, keys, group, file, dtype, shape, nbytes, sha256
            group-<k>/...              the layer group's tiles (codecs.py: raw files or Orbax)
    tmp/<host>.<pid>.<uuid>/           a builder's private workspace
    pins/<doc_id>/gen-<N>.<host>.<pid>.<uuid>.pin   a reader's pin
    trash/                             what gc is deleting

* Document ids are content hashes: SHA-256 over (token digest, profile digest, model digest,
  checkpoint fingerprint). Any id given to the store must be 64 lowercase hex digits.
* Publication: a builder writes a complete generation (tiles, manifests, then the
  generation files) in its own `tmp/` directory, fsyncs it, and renames it to
  `docs/<doc_id>/gen-<N>` with `renameat2(RENAME_NOREPLACE)` (plain `rename` where the file
  system lacks it: a published generation is never empty, so rename onto it fails too). N is
  one more than the largest published generation; a builder that loses the race for N
  either yields to the winner (`on_conflict="yield"`, same document content by
  construction) or takes the next number (`"retry"`). A reader therefore sees a generation
  whole or not at all, and a generation is written by exactly one builder.
* Integrity: on every read from disk, generation.json is checked against
  generation.sha256, each manifest against generation.json, the tokens against the
  manifest's SHA-256; a full load checks every tile against the certificate's payload_digest
  (one hash of every byte; on a mismatch the tiles are read again against their own SHA-256,
  to name the damaged one), a partial load or a layer group each tile. Any mismatch,
  truncation or unreadable file is a `StoreIntegrityError` with `FallbackReason.CHECKSUM`;
  nothing unverified is returned. Checksums detect corruption, not malice (whoever can write
  the store can rewrite the checksums).
* Readers pin a generation (in-process refcount + a pin file under a shared flock); `gc`
  (under the exclusive flock) removes unpinned generations older than the newest `keep` of
  each TP layout, builders' temporaries whose process is gone (or older than a grace
  period), and pins of dead readers.

POSIX only (flock, rename semantics). On NFS-like shared storage use one gc host; flock and
pid liveness are per host (pins of other hosts expire after `pin_ttl_s` unless refreshed).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from redknot_jax.reuse.certificate import (CertCounters, Certificate, CertificateError, FallbackReason, TPGeometry,
                                           canonical_json, json_digest, payload_digest, token_digest)
from redknot_jax.store.codecs import TileError, canonical, codec as get_codec, fsync_dir, is_no_space, sha256_of, write_file

STORE_FORMAT = 1
# The geometry of a single-rank artifact (== redknot_jax.reuse.artifact.single_rank(); kept
# here so that writers need not import jax; a test checks they agree).
DEFAULT_TP = TPGeometry(tp_size=1, rank=0, channel_ranges=((0, 1),))

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_GEN = re.compile(r"^gen-([1-9][0-9]{0,17})$")
_KEY = re.compile(r"^[A-Za-z0-9_]+$")
_OWNER = re.compile(r"^([A-Za-z0-9-]+)\.([0-9]+)\.([0-9a-f]{32})$")
_PIN = re.compile(r"^gen-([1-9][0-9]*)\.([A-Za-z0-9-]+)\.([0-9]+)\.([0-9a-f]{32})\.pin$")


# ------------------------------------------------------------------------------ errors
class StoreError(RuntimeError):
    """A read that cannot give a certified artifact. `reason` is the fallback to count."""

    def __init__(self, reason: FallbackReason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail = reason, detail


class StoreMissError(StoreError):
    """No such document / generation / TP slice / layer (UNKNOWN_ARTIFACT, TP_GEOMETRY,
    STALE_GENERATION or MISSING_LAYERS)."""


class StoreIntegrityError(StoreError):
    """Stored bytes that do not verify (always FallbackReason.CHECKSUM)."""

    def __init__(self, detail: str):
        super().__init__(FallbackReason.CHECKSUM, detail)


class PublishError(RuntimeError):
    """A generation that was not published; nothing of it became visible."""


class StoreFullError(PublishError):
    """No space (ENOSPC / EDQUOT) while writing; the temporary was removed."""


class InvalidDocumentId(ValueError):
    """A document id that is not 64 lowercase hex digits (never used as a path)."""


# ------------------------------------------------------------------------------ identity
def document_id_from_digests(token_digest: str, profile_digest: str, model_digest: str,
                             checkpoint_fingerprint: str) -> str:
    """SHA-256 of what an artifact's contents depend on (not of the generation or TP layout:
    every generation and rank slice of one document shares its id)."""
    return json_digest({"kind": "redknot-document", "version": 1, "tokens": token_digest,
                        "profile": profile_digest, "model": model_digest, "checkpoint": checkpoint_fingerprint})


def document_id(tokens, profile, model_cfg, checkpoint_fingerprint: str) -> str:
    """Content address of a document's artifact. `profile` is a RedKnotProfile (or its
    digest), `model_cfg` a ModelConfig (or its fingerprint)."""
    pd = profile if isinstance(profile, str) else profile.digest()
    md = model_cfg if isinstance(model_cfg, str) else model_cfg.fingerprint()
    return document_id_from_digests(token_digest(tokens), pd, md, checkpoint_fingerprint)


def certificate_document_id(cert: Certificate) -> str:
    return document_id_from_digests(cert.token_digest, cert.profile_digest, cert.model_digest,
                                    cert.checkpoint_fingerprint)


def check_document_id(doc_id) -> str:
    """`doc_id` if it is 64 lowercase hex digits, else InvalidDocumentId."""
    if not isinstance(doc_id, str) or not _HEX64.match(doc_id):
        raise InvalidDocumentId(f"document id: expected 64 lowercase hex digits (a SHA-256), got {doc_id!r}")
    return doc_id


def slice_name(tp: TPGeometry) -> str:
    """Directory of one TP rank's slice: tp size, rank and projected output-channel ranges."""
    ranges = ".".join(f"{s}_{e}" for s, e in tp.channel_ranges)
    return f"tp{tp.tp_size}-r{tp.rank}-c{ranges}"


# ------------------------------------------------------------------------------ tiles
def flatten_layers(layers: Mapping[int, Any]) -> dict[str, tuple[int, tuple[str, ...], np.ndarray]]:
    """name -> (layer, keys, array) for every array of an artifact's layers.

    Names are `Artifact.payload()`'s (`f"{layer}/" + jax keystr`, e.g. "3/['cmp']['kv']"),
    so `payload_digest` over them is the certificate's. Keys must match [A-Za-z0-9_]+ (they
    become file names).
    """
    out = {}
    for layer in sorted(layers):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
            raise PublishError(f"artifact layers: expected int layer ids >= 0, got {layer!r}")
        layer = int(layer)

        def walk(node, keys):
            if isinstance(node, Mapping):
                for k in sorted(node):
                    if not isinstance(k, str) or not _KEY.match(k):
                        raise PublishError(f"artifact layer {layer}: key {k!r} at {list(keys)} is not [A-Za-z0-9_]+")
                    walk(node[k], keys + (k,))
            elif isinstance(node, (list, tuple)) or node is None:
                raise PublishError(f"artifact layer {layer}: {type(node).__name__} at {list(keys)}; "
                                   f"only dicts of arrays are stored")
            else:
                if not keys:
                    raise PublishError(f"artifact layer {layer}: expected a dict of arrays, got an array")
                name = f"{layer}/" + "".join(f"[{k!r}]" for k in keys)
                out[name] = (layer, keys, canonical(node))

        walk(layers[layer], ())
    return out


def tile_stem(layer: int, keys: Sequence[str]) -> str:
    return f"L{layer}." + ".".join(keys)


def layer_groups(layers: Iterable[int], size: int) -> dict[int, tuple[int, ...]]:
    """Group k = the k-th run of `size` consecutive stored layers (sorted)."""
    ls = sorted(layers)
    return {k: tuple(ls[i:i + size]) for k, i in enumerate(range(0, len(ls), size))}


# ------------------------------------------------------------------------------ metadata
@dataclasses.dataclass(frozen=True)
class Published:
    doc_id: str
    generation: int
    created: bool  # False: another builder won the race for this generation and we yielded


@dataclasses.dataclass(frozen=True)
class SliceMeta:
    """One verified TP slice of a published generation (everything but the tiles)."""

    doc_id: str
    generation: int
    slice: str
    path: Path
    codec: str
    certificate: Certificate
    tokens: np.ndarray
    groups: dict[int, tuple[int, ...]]
    tiles: dict[str, dict]
    builder: str

    def groups_for(self, layers: Iterable[int] | None = None) -> list[int]:
        if layers is None:
            return sorted(self.groups)
        want = set(int(x) for x in layers)
        have = {x for ls in self.groups.values() for x in ls}
        if want - have:
            raise StoreMissError(FallbackReason.MISSING_LAYERS,
                                 f"document {self.doc_id}, generation {self.generation}: layers "
                                 f"{sorted(want - have)} not stored (stored: {sorted(have)})")
        return sorted(k for k, ls in self.groups.items() if want & set(ls))

    def tiles_of(self, group: int) -> dict[str, dict]:
        if group not in self.groups:
            raise StoreMissError(FallbackReason.MISSING_LAYERS,
                                 f"document {self.doc_id}, generation {self.generation}: no layer group {group} "
                                 f"(groups {sorted(self.groups)})")
        return {n: e for n, e in self.tiles.items() if e["group"] == group}

    def group_nbytes(self, group: int) -> int:
        return sum(int(e["nbytes"]) for e in self.tiles_of(group).values())

    def assemble(self, arrays: Mapping[str, Any], digest: str | None = None):
        """An `Artifact` from tile arrays (numpy or jax) of some or all layer groups; `digest`:
        their payload digest, when the caller checked it (`Artifact.from_stored`)."""
        from redknot_jax.reuse.artifact import Artifact

        layers: dict[int, dict] = {}
        for name, a in arrays.items():
            e = self.tiles[name]
            d = layers.setdefault(int(e["layer"]), {})
            for k in e["keys"][:-1]:
                d = d.setdefault(k, {})
            d[e["keys"][-1]] = a
        return Artifact.from_stored(self.tokens.copy(), dict(sorted(layers.items())), self.certificate, digest)


@dataclasses.dataclass
class GCReport:
    removed_generations: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    kept_pinned: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    removed_tmp: list[str] = dataclasses.field(default_factory=list)
    removed_pins: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class LookupResult:
    doc_id: str
    artifact: Any | None  # Artifact
    reason: FallbackReason | None
    detail: str = ""


@dataclasses.dataclass
class _Prepared:
    art: Any
    cert: Certificate
    tiles: dict[str, tuple[int, tuple[str, ...], np.ndarray]]


# ------------------------------------------------------------------------------ helpers
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:63] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _renameat2():
    try:
        f = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    f.restype = ctypes.c_int
    return f


_RENAMEAT2 = _renameat2()


def rename_noreplace(src: Path, dst: Path) -> None:
    """Atomically rename src to dst; FileExistsError if dst exists (never replaces)."""
    if _RENAMEAT2 is not None:
        if _RENAMEAT2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        e = ctypes.get_errno()
        if e == errno.EEXIST:
            raise FileExistsError(e, os.strerror(e), str(dst))
        if e not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(e, os.strerror(e), str(src), None, str(dst))
    # No RENAME_NOREPLACE here: rename(2) onto a non-empty directory fails, and a published
    # generation is never empty (gc moves generations away whole, never empties them in place).
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    try:
        os.rename(src, dst)
    except OSError as ex:
        if ex.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(ex.errno, ex.strerror, str(dst)) from ex
        raise


def _read_small(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------------------ the store
class ArtifactStore:
    """Immutable, generation-atomic, certified artifacts under `root` (module docstring).

    `codec` ("raw" | "orbax") and `layer_group_size` apply to what this instance publishes;
    readers follow what each generation records. `durable` fsyncs files and directories
    before publication (needed against power loss, not against killed processes).
    `io_threads` read the tiles of one layer group in parallel.
    """

    def __init__(self, root, *, codec: str = "raw", layer_group_size: int = 4, durable: bool = True,
                 io_threads: int | None = None, pin_ttl_s: float = 24 * 3600.0):
        if isinstance(layer_group_size, bool) or not isinstance(layer_group_size, int) or layer_group_size < 1:
            raise ValueError(f"layer_group_size: expected an int >= 1, got {layer_group_size!r}")
        get_codec(codec)
        self.root = Path(root)
        self.codec, self.layer_group_size, self.durable = codec, layer_group_size, durable
        self.pin_ttl_s = pin_ttl_s
        self.io_threads = io_threads or min(8, os.cpu_count() or 1)
        for d in ("docs", "tmp", "pins", "trash"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._init_marker()
        self._pins: dict[tuple[str, int], list] = {}
        self._pin_mu = threading.Lock()
        self._stats_mu = threading.Lock()
        self._stats = {"bytes_read": 0, "tiles_read": 0, "groups_read": 0, "integrity_failures": 0,
                       "publishes": 0, "publish_conflicts": 0, "bytes_written": 0}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_mu = threading.Lock()
        self._write = write_file  # seam for fault tests (ENOSPC simulation)

    def _init_marker(self) -> None:
        marker = self.root / "STORE.json"
        want = {"format": "redknot-artifact-store", "version": STORE_FORMAT}
        if not marker.exists():
            tmp = self.root / "tmp" / f"STORE.{uuid.uuid4().hex}"
            tmp.write_text(canonical_json(want))
            os.replace(tmp, marker)  # concurrent initialisers write identical bytes
        try:
            got = json.loads(marker.read_text())
        except (OSError, ValueError) as e:
            raise PublishError(f"{marker}: unreadable store marker: {e}") from e
        if got != want:
            raise PublishError(f"{marker}: expected {want}, got {got}")

    # -------------------------------------------------------------- layout
    def doc_dir(self, doc_id: str) -> Path:
        return self.root / "docs" / check_document_id(doc_id)

    def gen_dir(self, doc_id: str, generation: int) -> Path:
        if isinstance(generation, bool) or not isinstance(generation, (int, np.integer)) or generation < 1:
            raise ValueError(f"generation: expected an int >= 1, got {generation!r}")
        return self.doc_dir(doc_id) / f"gen-{int(generation)}"

    def documents(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root / "docs") if _HEX64.match(n))

    def generations(self, doc_id: str) -> list[int]:
        """Published generations of a document, ascending (every one complete)."""
        try:
            names = os.listdir(self.doc_dir(doc_id))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_GEN.match, names) if m)

    def latest(self, doc_id: str, tp: TPGeometry | None = None) -> int:
        """Newest generation holding `tp`'s slice; StoreMissError if none."""
        tp = tp or DEFAULT_TP
        gens = self.generations(doc_id)
        if not gens:
            raise StoreMissError(FallbackReason.UNKNOWN_ARTIFACT, f"document {doc_id}: no published generation")
        name = slice_name(tp)
        for g in reversed(gens):
            if (self.gen_dir(doc_id, g) / name).is_dir():
                return g
        raise StoreMissError(FallbackReason.TP_GEOMETRY,
                             f"document {doc_id}: generations {gens} hold no slice {name}")

    # -------------------------------------------------------------- publish
    def _owner(self) -> str:
        return f"{_host()}.{os.getpid()}.{uuid.uuid4().hex}"

    def _prepare(self, art) -> _Prepared:
        cert = art.certificate
        if not isinstance(cert, Certificate):
            raise PublishError(f"artifact certificate: expected a Certificate, got {type(cert).__name__}")
        # Artifact.stored_layers: fence layers' native state under "prefix" (plain objects with
        # `layers` only, e.g. a builder's that imports no jax, store those)
        tiles = flatten_layers(art.stored_layers() if hasattr(art, "stored_layers") else art.layers)
        have = sorted({layer for layer, _, _ in tiles.values()})
        if have != list(cert.layers):
            raise PublishError(f"artifact layers {have} differ from its certificate's {list(cert.layers)}")
        got = payload_digest({n: a for n, (_, _, a) in tiles.items()})
        if got != cert.payload_digest:
            raise PublishError(f"refusing to publish: artifact data hashes to {got}, its certificate says "
                               f"{cert.payload_digest}")
        tokens = np.asarray(art.tokens)
        if token_digest(tokens) != cert.token_digest:
            raise PublishError("refusing to publish: artifact tokens do not match its certificate's token_digest")
        return _Prepared(art, cert, tiles)

    def publish(self, artifacts, *, on_conflict: str = "yield") -> Published:
        """Publish one document's artifact (or all TP rank slices of it) as a new generation.

        `artifacts`: an Artifact, or a sequence of Artifacts of the same document, one per
        rank 0..tp_size-1 (a generation is usable only if every rank can read its slice).
        Certificates are checked against the data (payload digest, tokens) and rewritten with
        the generation number assigned here. Returns the generation that holds the document
        when this call returns: ours (`created=True`) or, with `on_conflict="yield"`, a
        concurrent builder's that won the same number (`created=False`). Raises
        StoreFullError on ENOSPC/EDQUOT, PublishError otherwise; in every failure nothing is
        visible and our temporary is removed (a killed builder's is left for gc).
        """
        if on_conflict not in ("yield", "retry"):
            raise ValueError(f"on_conflict: expected 'yield' or 'retry', got {on_conflict!r}")
        slices = [artifacts] if hasattr(artifacts, "certificate") else list(artifacts)
        if not slices:
            raise PublishError("publish: no artifact given")
        prepared = [self._prepare(a) for a in slices]
        c0 = prepared[0].cert
        doc_id = certificate_document_id(c0)
        for p in prepared[1:]:
            c = p.cert
            if certificate_document_id(c) != doc_id or c.layers != c0.layers or c.tp.tp_size != c0.tp.tp_size:
                raise PublishError("publish: slices of different documents, layers or TP sizes")
        ranks = sorted(p.cert.tp.rank for p in prepared)
        if ranks != list(range(c0.tp.tp_size)):
            raise PublishError(f"publish: a generation needs one slice per rank 0..{c0.tp.tp_size - 1}, got ranks {ranks}")
        codec = get_codec(self.codec)
        owner = self._owner()
        tmp = self.root / "tmp" / owner
        write = self._write
        written = 0
        try:
            tmp.mkdir()
            tokens = canonical(np.asarray(slices[0].tokens))
            write(tmp / "tokens.bin", tokens.reshape(-1).view(np.uint8), self.durable)
            tok_meta = {"file": "tokens.bin", "dtype": tokens.dtype.name, "shape": list(tokens.shape),
                        "sha256": sha256_of(tokens)}
            slices_meta = {}
            for p in prepared:
                sha = dict(zip(p.tiles, self._get_pool().map(lambda t: sha256_of(t[2]), p.tiles.values())))  # io threads
                name = slice_name(p.cert.tp)
                sdir = tmp / name
                sdir.mkdir()
                groups = layer_groups(p.cert.layers, self.layer_group_size)
                entries = {}
                for g, ls in groups.items():
                    group_tiles = {n: t for n, t in p.tiles.items() if t[0] in ls}
                    files = codec.write_group(sdir, g, {tile_stem(l, k): a for l, k, a in group_tiles.values()},
                                              self.durable, write)
                    for n, (l, k, a) in group_tiles.items():
                        entries[n] = {"layer": l, "keys": list(k), "group": g, "dtype": a.dtype.name,
                                      "shape": list(a.shape), "nbytes": int(a.nbytes), "sha256": sha[n],
                                      **files[tile_stem(l, k)]}
                        written += int(a.nbytes)
                slices_meta[name] = (p, groups, entries)
            while True:
                gen = self._next_generation(doc_id)
                self._write_generation_files(tmp, doc_id, gen, owner, tok_meta, slices_meta)
                self.doc_dir(doc_id).mkdir(parents=True, exist_ok=True)
                try:
                    rename_noreplace(tmp, self.gen_dir(doc_id, gen))
                except FileExistsError:
                    self._count("publish_conflicts")
                    if on_conflict == "yield" and self._tp_size_of(doc_id, gen) == c0.tp.tp_size:
                        shutil.rmtree(tmp, ignore_errors=True)
                        return Published(doc_id, gen, created=False)
                    continue
                except FileNotFoundError as e:
                    raise PublishError(f"publish {doc_id}: temporary {tmp} vanished before commit "
                                       f"(removed by gc after its grace period?)") from e
                if self.durable:
                    fsync_dir(self.doc_dir(doc_id))
                self._count("publishes")
                self._count("bytes_written", written)
                return Published(doc_id, gen, created=True)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if is_no_space(e):
                raise StoreFullError(f"artifact store {self.root}: no space left while writing a generation of "
                                     f"document {doc_id} ({e}); nothing was published and the temporary was "
                                     f"removed") from e
            if isinstance(e, OSError):
                raise PublishError(f"artifact store {self.root}: publishing document {doc_id} failed: {e}; "
                                   f"nothing was published") from e
            raise

    def _next_generation(self, doc_id: str) -> int:
        gens = self.generations(doc_id)
        return (gens[-1] if gens else 0) + 1

    def _write_generation_files(self, tmp: Path, doc_id: str, gen: int, owner: str, tok_meta: dict,
                                slices_meta: dict) -> None:
        """The small generation-numbered files (rewritten if a commit attempt lost its number)."""
        shas = {}
        for name, (p, groups, entries) in slices_meta.items():
            cert = dataclasses.replace(p.cert, generation=gen)
            manifest = {"format": STORE_FORMAT, "doc_id": doc_id, "generation": gen, "slice": name,
                        "codec": self.codec, "builder": owner, "certificate": cert.to_dict(),
                        "layer_group_size": self.layer_group_size,
                        "groups": {str(k): list(v) for k, v in groups.items()}, "tiles": entries}
            data = canonical_json(manifest).encode()
            self._replace_file(tmp / name / "manifest.json", data)
            shas[name] = hashlib.sha256(data).hexdigest()
            if self.durable:
                fsync_dir(tmp / name)
        tp_size = next(iter(slices_meta.values()))[0].cert.tp.tp_size
        meta = {"format": STORE_FORMAT, "doc_id": doc_id, "generation": gen, "tp_size": tp_size,
                "codec": self.codec, "layer_group_size": self.layer_group_size, "builder": owner,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "tokens": tok_meta, "slices": shas}
        data = canonical_json(meta).encode()
        self._replace_file(tmp / "generation.json", data)
        self._replace_file(tmp / "generation.sha256", (hashlib.sha256(data).hexdigest() + "\n").encode())
        if self.durable:
            fsync_dir(tmp)

    def _replace_file(self, path: Path, data: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._write(path, data, self.durable)

    # -------------------------------------------------------------- read
    def _read_generation(self, doc_id: str, generation: int) -> dict:
        gdir = self.gen_dir(doc_id, generation)
        if not gdir.is_dir():
            raise StoreMissError(FallbackReason.UNKNOWN_ARTIFACT, f"document {doc_id}: no generation {generation}")
        where = f"document {doc_id}, generation {generation}"
        try:
            want = _read_small(gdir / "generation.sha256").decode("ascii", "replace")
            data = _read_small(gdir / "generation.json")
        except FileNotFoundError as e:
            if not gdir.is_dir():
                raise StoreMissError(FallbackReason.UNKNOWN_ARTIFACT, f"{where}: removed while reading") from None
            raise StoreIntegrityError(f"{where}: {e.filename} missing") from None
        got = hashlib.sha256(data).hexdigest()
        if want != got + "\n":  # byte-exact: any change to either file is detected
            raise StoreIntegrityError(f"{where}: generation.json sha256 {got}, generation.sha256 says {want!r}")
        meta = json.loads(data)
        if meta.get("doc_id") != doc_id or meta.get("generation") != generation or meta.get("format") != STORE_FORMAT:
            raise StoreIntegrityError(f"{where}: generation.json names document {meta.get('doc_id')}, generation "
                                      f"{meta.get('generation')}, format {meta.get('format')}")
        return meta

    def generation_info(self, doc_id: str, generation: int) -> dict:
        """The verified generation.json (builder, TP size, codec, slices, creation time)."""
        return self._read_generation(check_document_id(doc_id), generation)

    def open_slice(self, doc_id: str, generation: int, tp: TPGeometry | None = None) -> SliceMeta:
        """Verified metadata of `tp`'s slice (certificate, tokens, groups, tile table)."""
        tp = tp or DEFAULT_TP
        meta = self._open_slice_by_name(check_document_id(doc_id), generation, slice_name(tp))
        if meta.certificate.tp != tp:
            raise StoreMissError(FallbackReason.TP_GEOMETRY,
                                 f"document {doc_id}, generation {generation}: slice certificate has {meta.certificate.tp}, "
                                 f"expected {tp}")
        return meta

    def _open_slice_by_name(self, doc_id: str, generation: int, name: str) -> SliceMeta:
        gmeta = self._read_generation(doc_id, generation)
        where = f"document {doc_id}, generation {generation}"
        if name not in gmeta["slices"]:
            raise StoreMissError(FallbackReason.TP_GEOMETRY,
                                 f"{where}: no slice {name} (has {sorted(gmeta['slices'])})")
        gdir = self.gen_dir(doc_id, generation)
        try:
            data = _read_small(gdir / name / "manifest.json")
            tok = gmeta["tokens"]
            tbuf = _read_small(gdir / tok["file"]) if tok["file"] == "tokens.bin" else b""
        except FileNotFoundError as e:
            raise StoreIntegrityError(f"{where}: {e.filename} missing") from None
        got = hashlib.sha256(data).hexdigest()
        if got != gmeta["slices"][name]:
            raise StoreIntegrityError(f"{where}: {name}/manifest.json sha256 {got}, generation.json says "
                                      f"{gmeta['slices'][name]}")
        try:
            from redknot_jax.store.codecs import dtype_from_name

            tokens = np.frombuffer(tbuf, dtype_from_name(tok["dtype"]).newbyteorder("<")).reshape(tok["shape"])
        except (ValueError, TileError) as e:
            raise StoreIntegrityError(f"{where}: tokens.bin does not hold {tok['dtype']}{tok['shape']}: {e}") from None
        if sha256_of(canonical(tokens)) != tok["sha256"]:
            raise StoreIntegrityError(f"{where}: tokens.bin sha256 mismatch")
        m = json.loads(data)
        try:
            cert = Certificate.from_dict(m["certificate"])
        except (CertificateError, KeyError, TypeError) as e:
            raise StoreIntegrityError(f"{where}: bad certificate in {name}: {e}") from None
        if (m["doc_id"] != doc_id or m["generation"] != generation or cert.generation != generation
                or certificate_document_id(cert) != doc_id or slice_name(cert.tp) != name
                or token_digest(tokens) != cert.token_digest or m["builder"] != gmeta["builder"]):
            raise StoreIntegrityError(f"{where}: slice {name} does not belong to this generation")
        return SliceMeta(doc_id=doc_id, generation=generation, slice=name, path=gdir / name, codec=m["codec"],
                         certificate=cert, tokens=np.array(tokens), builder=m["builder"],
                         groups={int(k): tuple(v) for k, v in m["groups"].items()}, tiles=m["tiles"])

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_mu:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="artifact-io")
            return self._pool

    def read_group(self, meta: SliceMeta, group: int, verify: bool = True) -> dict[str, np.ndarray]:
        """The verified tiles (name -> host array) of one layer group of one slice (verify=False:
        their checksums left to a caller that checks the payload digest over every group). The
        caller keeps the generation pinned (`pin` / `pinned`) while it reads."""
        entries = meta.tiles_of(group)
        try:
            out = get_codec(meta.codec).read_group(meta.path, entries, self._get_pool(), verify)
        except TileError as e:
            if not meta.path.is_dir():
                raise StoreMissError(FallbackReason.UNKNOWN_ARTIFACT,
                                     f"document {meta.doc_id}, generation {meta.generation}: removed while reading "
                                     f"(not pinned?)") from None
            self._count("integrity_failures")
            raise StoreIntegrityError(f"document {meta.doc_id}, generation {meta.generation}, slice {meta.slice}, "
                                      f"group {group}: {e}") from None
        self._count("bytes_read", sum(int(e["nbytes"]) for e in entries.values()))
        self._count("tiles_read", len(entries))
        self._count("groups_read")
        return out

    def load(self, doc_id: str, generation: int | None = None, *, layers: Iterable[int] | None = None,
             tp: TPGeometry | None = None, pin: bool = False, min_generation: int = 0):
        """The verified Artifact (host numpy arrays) of `doc_id`.

        generation: None = the newest holding `tp`'s slice. layers: None = all; else only the
        layer groups holding them are read. The generation is pinned while reading; with
        `pin=True` it stays pinned until `unpin(doc_id, artifact.certificate.generation)`.
        Raises StoreMissError / StoreIntegrityError (each carries the FallbackReason).
        """
        doc_id, tp = check_document_id(doc_id), tp or DEFAULT_TP
        for attempt in range(3):
            gen = int(generation) if generation is not None else self.latest(doc_id, tp)
            if gen < min_generation:
                raise StoreMissError(FallbackReason.STALE_GENERATION,
                                     f"document {doc_id}: generation {gen} < required {min_generation}")
            try:
                self.pin(doc_id, gen)
                break
            except StoreMissError:  # gc removed it since `latest` (a newer one exists): look again
                if generation is not None or attempt == 2:
                    raise
        ok = False
        try:
            meta = self.open_slice(doc_id, gen, tp)
            groups = meta.groups_for(layers)
            # a whole slice is checked by its payload digest alone (one hash of every byte, bound to the
            # certificate like the tile checksums); a part of one, tile by tile
            arrays, got, whole = {}, None, len(groups) == len(meta.groups)
            for g in groups:
                arrays.update(self.read_group(meta, g, verify=not whole))
            if whole:
                got = payload_digest(arrays)
                if got != meta.certificate.payload_digest:
                    for g in groups:  # which tile: read again, checked (raises, naming it)
                        self.read_group(meta, g)
                    self._count("integrity_failures")
                    raise StoreIntegrityError(f"document {doc_id}, generation {gen}: payload digest {got}, "
                                              f"certificate says {meta.certificate.payload_digest}")
            art = meta.assemble(arrays, got)  # the runtime's certification then hashes nothing again
            ok = True
            return art
        finally:
            if not (pin and ok):
                self.unpin(doc_id, gen)

    def verify(self, doc_id: str, generation: int) -> None:
        """Read and check every slice and tile of a generation; raises StoreError if it fails."""
        doc_id = check_document_id(doc_id)
        with self.pinned(doc_id, generation):
            for name in sorted(self._read_generation(doc_id, generation)["slices"]):
                meta = self._open_slice_by_name(doc_id, generation, name)
                arrays = {}
                for g in sorted(meta.groups):
                    arrays.update(self.read_group(meta, g))
                if payload_digest(arrays) != meta.certificate.payload_digest:
                    raise StoreIntegrityError(f"document {doc_id}, generation {generation}, slice {name}: "
                                              f"payload digest mismatch")

    def fsck(self) -> list[tuple[str, int, str | None]]:
        """(doc_id, generation, None if it verifies else the error) for every visible generation."""
        out = []
        for doc in self.documents():
            for g in self.generations(doc):
                try:
                    self.verify(doc, g)
                    out.append((doc, g, None))
                except StoreError as e:
                    out.append((doc, g, str(e)))
        return out

    # -------------------------------------------------------------- requests
    def lookup(self, tokens, profile, model_cfg, checkpoint_fingerprint: str, *, tp: TPGeometry | None = None,
               min_generation: int = 0, layers: Iterable[int] | None = None,
               counters: CertCounters | None = None) -> LookupResult:
        """Find and load a document's artifact by content; failures are counted in `counters`."""
        doc_id = document_id(tokens, profile, model_cfg, checkpoint_fingerprint)
        try:
            art = self.load(doc_id, tp=tp, min_generation=min_generation, layers=layers)
        except StoreError as e:
            if counters is not None:
                counters.record_fallback(e.reason)
            return LookupResult(doc_id, None, e.reason, e.detail)
        return LookupResult(doc_id, art, None)

    def lookup_for_request(self, tokens, profile, model_cfg, checkpoint_fingerprint: str, *,
                           tp: TPGeometry | None = None, min_generation: int = 0,
                           counters: CertCounters | None = None):
        """Artifact, or the FallbackReason (already counted in `counters`) if there is none
        that verifies. The runtime still certifies what it gets (DESIGN §5)."""
        r = self.lookup(tokens, profile, model_cfg, checkpoint_fingerprint, tp=tp, min_generation=min_generation,
                        counters=counters)
        return r.artifact if r.reason is None else r.reason

    # -------------------------------------------------------------- pins
    @contextlib.contextmanager
    def _flock(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def pin(self, doc_id: str, generation: int) -> None:
        """Keep `generation` from gc until as many `unpin`s (refcounted per process)."""
        key = (check_document_id(doc_id), int(generation))
        with self._pin_mu:
            ent = self._pins.get(key)
            if ent is not None:
                ent[0] += 1
                return
            with self._flock(exclusive=False):
                if not self.gen_dir(*key).is_dir():
                    raise StoreMissError(FallbackReason.UNKNOWN_ARTIFACT, f"document {doc_id}: no generation {generation}")
                pdir = self.root / "pins" / doc_id
                pdir.mkdir(parents=True, exist_ok=True)
                path = pdir / f"gen-{key[1]}.{self._owner()}.pin"
                try:
                    write_file(path, canonical_json({"time": time.time()}).encode(), False)
                except OSError as e:
                    raise StoreMissError(FallbackReason.UNKNOWN_ARTIFACT, f"cannot pin {doc_id} gen {generation}: {e}") from e
            self._pins[key] = [1, path]

    def unpin(self, doc_id: str, generation: int) -> None:
        key = (doc_id, int(generation))
        with self._pin_mu:
            ent = self._pins.get(key)
            if ent is None:
                raise ValueError(f"unpin: document {doc_id} generation {generation} is not pinned here")
            ent[0] -= 1
            if ent[0] == 0:
                del self._pins[key]
                with contextlib.suppress(FileNotFoundError):
                    ent[1].unlink()

    @contextlib.contextmanager
    def pinned(self, doc_id: str, generation: int | None = None, tp: TPGeometry | None = None) -> Iterator[int]:
        """`with store.pinned(doc) as gen:` the generation (newest if None) stays while inside."""
        for attempt in range(3):
            gen = generation if generation is not None else self.latest(doc_id, tp)
            try:
                self.pin(doc_id, gen)
                break
            except StoreMissError:
                if generation is not None or attempt == 2:
                    raise
        try:
            yield gen
        finally:
            self.unpin(doc_id, gen)

    def held_pins(self) -> dict[tuple[str, int], int]:
        with self._pin_mu:
            return {k: v[0] for k, v in self._pins.items()}

    def _live(self, host: str, pid: int, mtime: float, now: float, ttl: float) -> bool:
        if host == _host():
            return _pid_alive(pid)
        return now - mtime < ttl

    # -------------------------------------------------------------- gc
    def _tp_size_of(self, doc_id: str, gen: int):
        try:
            return self._read_generation(doc_id, gen)["tp_size"]
        except (StoreError, ValueError, KeyError):
            return None

    def gc(self, *, keep: int = 1, grace_s: float = 6 * 3600.0, now: float | None = None) -> GCReport:
        """Remove unpinned generations older than the newest `keep` per TP size, temporaries of
        dead builders on this host (or older than `grace_s` from other hosts), dead pins."""
        if keep < 1:
            raise ValueError(f"gc keep: expected >= 1, got {keep}")
        now = time.time() if now is None else now
        rep, doomed = GCReport(), []
        trash = self.root / "trash"
        with self._flock(exclusive=True):
            live = set()
            for pdir in (self.root / "pins").iterdir():
                for p in pdir.iterdir():
                    m = _PIN.match(p.name)
                    try:
                        mtime = p.stat().st_mtime
                    except FileNotFoundError:
                        continue
                    if m and self._live(m.group(2), int(m.group(3)), mtime, now, self.pin_ttl_s):
                        live.add((pdir.name, int(m.group(1))))
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
                        rep.removed_pins.append(f"{pdir.name}/{p.name}")
            for doc in self.documents():
                gens = self.generations(doc)
                by_tp: dict[Any, list[int]] = {}
                for g in gens:
                    by_tp.setdefault(self._tp_size_of(doc, g), []).append(g)
                newest = {g for lst in by_tp.values() for g in sorted(lst)[-keep:]}
                for g in gens:
                    if g in newest:
                        continue
                    if (doc, g) in live:
                        rep.kept_pinned.append((doc, g))
                        continue
                    dst = trash / f"{doc}.gen-{g}.{uuid.uuid4().hex}"
                    os.rename(self.gen_dir(doc, g), dst)  # vanishes whole, atomically
                    doomed.append(dst)
                    rep.removed_generations.append((doc, g))
            for t in (self.root / "tmp").iterdir():
                m = _OWNER.match(t.name)
                try:
                    mtime = t.stat().st_mtime
                except FileNotFoundError:
                    continue
                alive = self._live(m.group(1), int(m.group(2)), mtime, now, grace_s) if m else now - mtime < grace_s
                if not alive:
                    dst = trash / f"tmp.{t.name}.{uuid.uuid4().hex}"
                    with contextlib.suppress(FileNotFoundError):
                        os.rename(t, dst)
                        doomed.append(dst)
                        rep.removed_tmp.append(t.name)
        for d in list(trash.iterdir()):  # ours, and whatever an interrupted gc left
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
        return rep

    # -------------------------------------------------------------- misc
    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_mu:
            self._stats[key] += n

    def stats(self) -> dict[str, int]:
        with self._stats_mu:
            return dict(self._stats)

    def close(self) -> None:
        """Release every pin held by this instance and stop its I/O threads."""
        with self._pin_mu:
            for ent in self._pins.values():
                with contextlib.suppress(FileNotFoundError):
                    ent[1].unlink()
            self._pins.clear()
        with self._pool_mu:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------ TP slices
def _map_arrays(fn, v):
    """fn over every array of a field (an array, or an encoded field's dict of arrays)."""
    return {k: _map_arrays(fn, x) for k, x in v.items()} if isinstance(v, Mapping) else fn(v)


def _zl_shape(zl) -> tuple[int, ...]:
    """z_L's dense shape [L, g, o], encoded or not (`reuse.codec.shape`, imported only for an
    encoded one: the store itself needs no jax, so its builder processes start fast)."""
    if not isinstance(zl, Mapping):
        return tuple(np.shape(zl))
    from redknot_jax.reuse.codec import shape

    return shape(zl)


def split_tp(artifact, tp_size: int) -> list:
    """Rank slices of a single-rank artifact for TP over output groups (DESIGN §7): rank r
    keeps z_L's groups [r g/T, (r+1) g/T) -- projected output channels [r g o/T, (r+1) g o/T)
    -- and everything else (the shared K=V latent is one head, replicated per rank; so are the
    fence layers' native states, `prefix_layers`). Each
    slice gets its own certificate (TP geometry and payload digest of its own arrays)."""
    from redknot_jax.reuse.artifact import Artifact

    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size: expected an int >= 1, got {tp_size!r}")
    if not artifact.layers:
        raise ValueError("split_tp: the artifact has no layers")
    out = []
    for r in range(tp_size):
        layers, g, o = {}, None, None
        for layer, d in artifact.layers.items():
            g, o = _zl_shape(d["zl"])[1:]  # [L, g, o]; an encoded z_L keeps the group axis in every array
            if g % tp_size:
                raise ValueError(f"split_tp: {g} output groups do not split over tp_size {tp_size}")
            per = g // tp_size
            layers[layer] = {**d, "zl": _map_arrays(lambda z: np.asarray(z)[:, r * per:(r + 1) * per], d["zl"])}
        per = g // tp_size
        tp = TPGeometry(tp_size, r, ((r * per * o, (r + 1) * per * o),))
        art = Artifact(tokens=np.asarray(artifact.tokens), layers=layers, certificate=None,
                       prefix_layers=dict(artifact.prefix_layers))
        art.certificate = dataclasses.replace(artifact.certificate, tp=tp, payload_digest=payload_digest(art.payload()))
        out.append(art)
    return out
