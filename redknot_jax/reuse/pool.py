"""The documents' pool (DESIGN §7): hot artifacts packed once per reusable layer into device
arrays (K=V rows, z_L, document-local top-k, compressed entries, indexer keys, boundary
compressor rings). A request never copies or rewrites them: it reads them through its layout's
index tables (`layout.py`), so many requests share one pool with different offsets.

`DocPool` is device-resident (hot); `HostPool` keeps the payloads in host memory and packs each
reusable layer onto the device on a worker thread, one layer ahead of the consumer.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.reuse import codec
from redknot_jax.reuse.artifact import Artifact
from redknot_jax.store.tiers import host_memory_kind

ENTRY_PAD = 64
POOL_ROW_PAD = 256


def ceil_to(n: int, m: int) -> int:
    """n rounded up to a multiple of m, at least m."""
    return max(m, -(-n // m) * m)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """How a request's arrays are padded (rows, protected rows, entries, cache capacities, the
    pool's rows): to a multiple of the size's unit and then, with `per_octave` > 0, up to the next
    of `per_octave` geometric steps per doubling (at most 1 / per_octave of padding), so that
    requests of similar sizes share compiled programs instead of compiling their own (a layer
    program at model scale compiles for minutes). per_octave=0: the unit only."""

    per_octave: int = 8

    def __post_init__(self):
        p = self.per_octave
        if not isinstance(p, int) or p < 0 or p & (p - 1):
            raise ValueError(f"Buckets: per_octave must be 0 or a power of two, got {p!r}")

    def __call__(self, n: int, unit: int) -> int:
        """n rounded up to its bucket: a multiple of unit (at least unit)."""
        k = max(1, -(-int(n) // unit))
        if self.per_octave:  # keep log2(per_octave) + 1 significant bits of k
            e = max(0, k.bit_length() - self.per_octave.bit_length())
            k = -(-k >> e) << e
        return k * unit

    def docs(self, n: int) -> int:
        """A pool's document count padded (its boundary rings): a power of two when bucketing."""
        return Buckets(1)(n, 1) if self.per_octave else n


EXACT = Buckets(0)


def _pad_rows(a: jax.Array, n: int) -> jax.Array:
    """a padded with zero rows to n rows."""
    return jnp.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))


def _fields(p: dict, dtype, conv) -> dict:
    """The fields of one document's layer payload a pool keeps, each through conv(array, its
    pool dtype): dense rows and entries in `dtype`, an encoded field's arrays (`reuse.codec`) in
    their own dtypes (dequantised only inside the consumer's layer programs), compressor states
    fp32, top-k ids as stored (int32, or int16 in a compact codec)."""
    def field(v):
        if not isinstance(v, dict):
            return conv(v, dtype)
        if "nope" in v:  # a latent: FP8 NoPE part, the RoPE part as produced
            return {"nope": field(v["nope"]), "rope": conv(v["rope"], dtype)}
        return {k: conv(a, a.dtype) for k, a in v.items()}

    d = {"kv": field(p["kv"]), "zl": field(p["zl"])}
    for name, state in (("entries", "cmp"), ("idx_entries", "idx")):
        if name in p:
            d[name] = field(p[name])
            d[state] = {s: conv(p[state][s], jnp.float32) for s in ("kv", "gate")}
    if "topk" in p:
        d["topk"] = conv(p["topk"], p["topk"].dtype)
    if "ffn" in p:  # canonical FFN outputs (profiles with ffn_rows="restore")
        d["ffn"] = field(p["ffn"])
    return d


def _pack(per: list[dict], dtype, put=lambda x, dt: jnp.asarray(x, dt), buckets: Buckets = EXACT) -> dict:
    """One reusable layer of several documents' artifacts, packed into device arrays; put(x, dt)
    brings one document's array onto the device as dt. Rows pad to `buckets` of POOL_ROW_PAD,
    entries of ENTRY_PAD, boundary rings to `buckets.docs` documents (padding is never read)."""
    fs = [_fields(p, dtype, put) for p in per]
    cat = lambda name, n: jax.tree.map(lambda *xs: _pad_rows(jnp.concatenate(xs), n), *[f[name] for f in fs])
    rows = buckets(sum(codec.shape(f["kv"])[0] for f in fs), POOL_ROW_PAD)
    d = {name: cat(name, rows) for name in ("kv", "zl", "ffn") if name in fs[0]}
    for name, state in (("entries", "cmp"), ("idx_entries", "idx")):
        if name in fs[0]:
            d[name] = cat(name, buckets(sum(codec.shape(f[name])[0] for f in fs), ENTRY_PAD))
            ring = fs[0][state]["kv"].shape[0]
            d[state] = {s: _pad_rows(jnp.concatenate([f[state][s] for f in fs]), ring * buckets.docs(len(fs)))
                        for s in ("kv", "gate")}
    if "topk" in fs[0]:  # a document with fewer entries than the top-k picks them all: narrower picks, -1 pads
        width = max(f["topk"].shape[1] for f in fs)
        d["topk"] = _pad_rows(jnp.concatenate([jnp.pad(f["topk"], ((0, 0), (0, width - f["topk"].shape[1])),
                                                       constant_values=-1) for f in fs]), rows)
    return d


class DocPool:
    """Device-resident artifacts of a set of documents, packed per reusable layer. Row arrays
    are padded to `buckets` of POOL_ROW_PAD rows (entries of ENTRY_PAD), so pools of similar
    size share compiled layer programs; the padding is never indexed."""

    def __init__(self, artifacts: list[Artifact], layers, dtype, buckets: Buckets = EXACT):
        codecs = sorted({getattr(a.certificate, "codec", "dense") for a in artifacts})
        if len(codecs) > 1:
            raise ValueError(f"DocPool: the documents' artifacts are stored in different codecs {codecs}; "
                             "one pool packs one codec")
        self.codec = codecs[0] if codecs else "dense"
        self.buckets = buckets
        self.index = {id(a): k for k, a in enumerate(artifacts)}
        self.artifacts = list(artifacts)
        lens = [a.length for a in artifacts]
        self.row_base = np.r_[0, np.cumsum(lens)][:-1].astype(np.int64)
        self.rows = int(sum(lens))
        self.layers = self._place(list(layers), dtype)

    def _place(self, layers: list[int], dtype):
        return {i: _pack([a.layers[i] for a in self.artifacts], dtype, buckets=self.buckets) for i in layers}

    def doc(self, art: Artifact) -> int:
        if id(art) not in self.index:
            raise KeyError("DocPool: this artifact is not in the pool (pack it with the request's documents)")
        return self.index[id(art)]

    def entry_base(self, art: Artifact, m: int) -> int:
        k = self.doc(art)
        return int(sum(a.length // m for a in self.artifacts[:k]))

    def nbytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.layers)))


class HostPool(DocPool):
    """Host-resident (prefetched) artifacts: the documents' payloads stay in host memory and
    each reusable layer is packed onto the device, on a worker thread, as soon as the consumer
    has asked for the layer before it. So its host-to-device copy overlaps that layer's compute,
    and the dispatch of layer i never waits for the copy of layer i + 1 (a copy from pageable
    memory holds the thread that issues it). At most two layers of the pool are on the device at
    a time; what a request pays is the copy the compute did not hide.

    host_kind (`store.tiers.host_memory_kind`): "numpy" reads the artifacts' own (pageable)
    arrays; "pinned" stages the kept fields once, here, in the pool's dtypes, into pinned host
    memory, so each layer's copy is one DMA per array at link speed (52.7 vs 6.7 GB/s measured
    on the H200, docs/store.md) at the price of a host copy of the payload; "auto": pinned on a
    GPU."""

    def __init__(self, artifacts: list[Artifact], layers, dtype, host_kind: str = "auto", buckets: Buckets = EXACT):
        self.device = jax.devices()[0]
        self.host_kind = host_memory_kind(self.device, host_kind)
        self.staged = None  # pinned: layer -> the documents' kept fields in pinned host memory
        super().__init__(artifacts, layers, dtype, buckets)

    def _place(self, layers: list[int], dtype):
        if self.host_kind == "numpy":
            return _Streamed(lambda i: _pack([a.layers[i] for a in self.artifacts], dtype, buckets=self.buckets), layers)
        pinned = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        to_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.device.default_memory().kind)
        host = lambda x, dt: np.asarray(x).astype(dt, copy=False)
        self.staged = jax.block_until_ready({i: [jax.device_put(_fields(a.layers[i], dtype, host), pinned)
                                                 for a in self.artifacts] for i in layers})  # admission pays it
        put = lambda x, dt: jax.device_put(x, to_device)
        return _Streamed(lambda i: _pack(self.staged[i], dtype, put=put, buckets=self.buckets), layers)

    def nbytes(self) -> int:  # host bytes of the layers it streams (unpadded)
        return int(sum(np.asarray(x).nbytes for a in self.artifacts for i in self.layers
                       for x in jax.tree.leaves(a.layers[i])))


class _Streamed:
    """layer -> packed device arrays, packed one layer ahead of the reader (`order`) on one
    worker thread; a pack that failed raises when its layer is read."""

    def __init__(self, pack, order: list[int]):
        self.pack, self.order, self.ahead = pack, order, {}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="hostpool-pack")

    def __getitem__(self, i: int) -> dict:
        if i not in self.order:
            raise KeyError(f"HostPool: layer {i} is not a reusable layer of this pool ({self.order})")
        ahead = self.ahead.pop(i, None)
        d = ahead.result() if ahead is not None else self.pack(i)  # the first layer read: packed here
        k = self.order.index(i) + 1
        if k < len(self.order) and self.order[k] not in self.ahead:  # started now, read by the next layer
            self.ahead[self.order[k]] = self._worker.submit(self.pack, self.order[k])
        return d

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)
