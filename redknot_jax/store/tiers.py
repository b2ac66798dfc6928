"""Tiers in front of the disk store: device memory (hot), host memory, disk; and prefetch.

The unit cached is one layer group of one TP slice of one generation (what a consumer uses
at once and what prefetch moves while the previous group computes). Entries are immutable
(generations never change), so there is no write-back and no invalidation: a rebuilt
document is a new generation, i.e. a new key.

Policy: LRU by bytes, one capacity per tier. Why LRU: the consumer touches a document's
groups in layer order once per request, and document popularity in retrieval workloads is
skewed and bursty, so recency is the signal we have; entries of one artifact are similar in
size, so size-aware policies (GDSF) buy little here. An entry larger than a tier's capacity
passes through that tier uncached. The host tier is (weakly) inclusive of the device tier:
evicting from the device costs nothing because the host copy usually remains.

Integrity: tiles are verified (SHA-256) when read from disk; host and device copies are
trusted (they never leave this process).

Prefetch: `prefetch(doc_ids, groups)` returns futures immediately; a worker thread reads and
verifies the group from disk (or takes it from the host tier) and calls `jax.device_put`,
which dispatches the host-to-device copy asynchronously, so the copy of group k+1 overlaps
the computation of group k. Concurrent requests for the same group share one load
(single-flight). Host arrays can be staged in pinned host memory (`host_kind="pinned"`) so
the host-to-device copy is one DMA at link speed; "auto" uses it where the device exposes a
`pinned_host` memory space and is not a CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

import numpy as np

from redknot_jax.reuse.certificate import TPGeometry
from redknot_jax.store.store import DEFAULT_TP, ArtifactStore, SliceMeta, slice_name

Key = tuple[str, int, str, int]  # (doc_id, generation, slice, group)


@dataclasses.dataclass
class TierStats:
    capacity: int
    bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bypassed: int = 0  # entries larger than the capacity

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class LRUTier:
    """Byte-bounded LRU map (not thread-safe on its own: TieredCache holds its lock)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"tier capacity: expected >= 0 bytes, got {capacity}")
        self.stats = TierStats(capacity=int(capacity))
        self._d: collections.OrderedDict[Key, tuple[Any, int]] = collections.OrderedDict()

    def get(self, key: Key):
        v = self._d.get(key)
        if v is None:
            self.stats.misses += 1
            return None
        self._d.move_to_end(key)
        self.stats.hits += 1
        return v[0]

    def peek(self, key: Key):
        v = self._d.get(key)
        return None if v is None else v[0]

    def put(self, key: Key, value, nbytes: int) -> list[Key]:
        """Insert (most recent); returns the keys evicted to make room."""
        if nbytes > self.stats.capacity:
            self.stats.bypassed += 1
            return []
        if key in self._d:
            self._d.move_to_end(key)
            return []
        self._d[key] = (value, nbytes)
        self.stats.bytes += nbytes
        evicted = []
        while self.stats.bytes > self.stats.capacity:
            k, (_, n) = self._d.popitem(last=False)
            self.stats.bytes -= n
            self.stats.evictions += 1
            evicted.append(k)
        self.stats.entries = len(self._d)
        return evicted

    def keys(self) -> list[Key]:
        return list(self._d)

    def __contains__(self, key: Key) -> bool:
        return key in self._d


def host_memory_kind(device, host_kind: str) -> str:
    """Where host-resident arrays for `device` live: "numpy" (pageable) or "pinned" (jax arrays
    in the device's `pinned_host` memory space: the host-to-device copy is one DMA at link
    speed, 52.7 vs 6.7 GB/s on the H200, docs/store.md). "auto": pinned where the device has
    that memory space and is not a CPU."""
    if host_kind not in ("auto", "numpy", "pinned"):
        raise ValueError(f"host_kind: expected 'auto', 'numpy' or 'pinned', got {host_kind!r}")
    kinds = {m.kind for m in device.addressable_memories()}
    if host_kind == "auto":
        return "pinned" if "pinned_host" in kinds and device.platform != "cpu" else "numpy"
    if host_kind == "pinned" and "pinned_host" not in kinds:
        raise ValueError(f"host_kind='pinned': device {device} has memories {sorted(kinds)}")
    return host_kind


def _nbytes(tiles: dict) -> int:
    return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in tiles.values()))


class TieredCache:
    """Device / host / disk tiers over an ArtifactStore, with asynchronous prefetch.

    `device_bytes`, `host_bytes`: tier capacities. `device`: the jax device (default: the
    first). `host_kind`: "numpy" (pageable), "pinned" (jax arrays in pinned host memory) or
    "auto". A generation is pinned in the store while any of its groups is cached or loading.
    `stats()` gives hits / misses / evictions / bytes per tier (the server's /metrics).
    """

    def __init__(self, store: ArtifactStore, *, device_bytes: int, host_bytes: int, device=None,
                 host_kind: str = "auto", workers: int = 2):
        import jax

        self.store = store
        self.device = device or jax.devices()[0]
        self.host_kind = host_memory_kind(self.device, host_kind)
        # explicit memory kind: device_put(pinned_host array, device) keeps the source's kind
        self._to_device = jax.sharding.SingleDeviceSharding(self.device, memory_kind=self.device.default_memory().kind)
        self.device_tier, self.host_tier = LRUTier(device_bytes), LRUTier(host_bytes)
        self._mu = threading.Lock()
        self._inflight: dict[tuple[Key, str], Future] = {}
        self._meta: collections.OrderedDict[tuple[str, int, str], SliceMeta] = collections.OrderedDict()
        self._gen_refs: collections.Counter[tuple[str, int]] = collections.Counter()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="artifact-prefetch")
        self.disk_reads = 0
        self.disk_bytes = 0

    # -------------------------------------------------------------- keys, metadata, pins
    def _resolve(self, doc_id: str, generation: int | None, tp: TPGeometry | None) -> tuple[int, str]:
        tp = tp or DEFAULT_TP
        gen = generation if generation is not None else self.store.latest(doc_id, tp)
        return int(gen), slice_name(tp)

    def meta(self, doc_id: str, generation: int | None = None, tp: TPGeometry | None = None) -> SliceMeta:
        """Verified slice metadata (cached; generations are immutable)."""
        gen, name = self._resolve(doc_id, generation, tp)
        k = (doc_id, gen, name)
        with self._mu:
            m = self._meta.get(k)
            if m is not None:
                self._meta.move_to_end(k)
                return m
        with self.store.pinned(doc_id, gen):
            m = self.store.open_slice(doc_id, gen, tp)
        with self._mu:
            self._meta[k] = m
            while len(self._meta) > 4096:
                self._meta.popitem(last=False)
        return m

    def _ref(self, key: Key, n: int) -> None:
        """Pin the generation while any of its groups is cached or loading (lock held)."""
        g = (key[0], key[1])
        if n > 0 and self._gen_refs[g] == 0:
            self.store.pin(*g)
        self._gen_refs[g] += n
        if self._gen_refs[g] == 0:
            del self._gen_refs[g]
            self.store.unpin(*g)

    def _evicted(self, keys: list[Key]) -> None:
        for k in keys:
            self._ref(k, -1)

    # -------------------------------------------------------------- loading
    def _host_put(self, tiles: dict):
        import jax

        if self.host_kind == "numpy":
            return tiles
        sh = jax.sharding.SingleDeviceSharding(self.device, memory_kind="pinned_host")
        return jax.device_put(tiles, sh)

    def _load_host(self, key: Key, meta: SliceMeta) -> dict:
        with self._mu:
            hit = self.host_tier.get(key)
        if hit is not None:
            return hit
        tiles = self.store.read_group(meta, key[3])  # verified
        with self._mu:
            self.disk_reads += 1
            self.disk_bytes += _nbytes(tiles)
        tiles = self._host_put(tiles)
        with self._mu:
            if key not in self.host_tier:
                self._ref(key, +1)
                ev = self.host_tier.put(key, tiles, _nbytes(tiles))
                if key not in self.host_tier:  # bypassed: too large for the tier
                    self._ref(key, -1)
                self._evicted(ev)
        return tiles

    def _load_device(self, key: Key, meta: SliceMeta) -> dict:
        import jax

        host = self._load_host(key, meta)
        dev = jax.device_put(host, self._to_device)  # asynchronous: returns before the copy ends
        with self._mu:
            if key not in self.device_tier:
                self._ref(key, +1)
                ev = self.device_tier.put(key, dev, _nbytes(dev))
                if key not in self.device_tier:
                    self._ref(key, -1)
                self._evicted(ev)
        return dev

    def _submit(self, key: Key, meta: SliceMeta, tier: str) -> Future:
        """Single-flight load of one group into `tier` ("device" or "host")."""
        with self._mu:
            t = self.device_tier if tier == "device" else self.host_tier
            hit = t.get(key)
            if hit is not None:
                f = Future()
                f.set_result(hit)
                return f
            fut = self._inflight.get((key, tier))
            if fut is not None:
                return fut
            fut = Future()
            self._inflight[(key, tier)] = fut
            self._ref(key, +1)  # the generation stays while the load runs

        def run():
            try:
                fut.set_result(self._load_device(key, meta) if tier == "device" else self._load_host(key, meta))
            except BaseException as e:  # the future carries StoreError to the consumer
                fut.set_exception(e)
            finally:
                with self._mu:
                    self._inflight.pop((key, tier), None)
                    self._ref(key, -1)

        self._pool.submit(run)
        return fut

    # -------------------------------------------------------------- public
    def prefetch(self, doc_ids: Iterable[str], layer_groups: Iterable[int], *, generation: int | None = None,
                 tp: TPGeometry | None = None, tier: str = "device") -> dict[tuple[str, int], Future]:
        """Start loading `layer_groups` of each document into `tier`; returns {(doc, group): Future}
        whose results are {tile name: array} (device arrays for tier="device")."""
        if tier not in ("device", "host"):
            raise ValueError(f"tier: expected 'device' or 'host', got {tier!r}")
        out = {}
        groups = list(layer_groups)
        for doc in doc_ids:
            meta = self.meta(doc, generation, tp)
            for g in groups:
                meta.tiles_of(g)  # unknown group -> StoreMissError now, not in a thread
                out[(doc, g)] = self._submit((doc, meta.generation, meta.slice, g), meta, tier)
        return out

    def group(self, doc_id: str, group: int, *, generation: int | None = None, tp: TPGeometry | None = None,
              tier: str = "device") -> dict:
        """One layer group's tiles, waiting for them (a prefetched group is a hit)."""
        return self.prefetch([doc_id], [group], generation=generation, tp=tp, tier=tier)[(doc_id, group)].result()

    def load(self, doc_id: str, *, generation: int | None = None, layers: Iterable[int] | None = None,
             tp: TPGeometry | None = None, tier: str = "device"):
        """An Artifact assembled from cached groups (device arrays for tier="device")."""
        meta = self.meta(doc_id, generation, tp)
        groups = meta.groups_for(layers)
        futs = self.prefetch([doc_id], groups, generation=meta.generation, tp=tp, tier=tier)
        arrays = {}
        for g in groups:
            arrays.update(futs[(doc_id, g)].result())
        return meta.assemble(arrays)

    def stats(self) -> dict:
        with self._mu:
            return {"device": self.device_tier.stats.to_dict(), "host": self.host_tier.stats.to_dict(),
                    "disk": {"reads": self.disk_reads, "bytes": self.disk_bytes},
                    "pinned_generations": len(self._gen_refs)}

    def close(self) -> None:
        """Wait for loads in flight, drop every entry and release the store pins."""
        self._pool.shutdown(wait=True)
        with self._mu:
            for t in (self.device_tier, self.host_tier):
                for k in t.keys():
                    self._ref(k, -1)
                t._d.clear()
                t.stats.bytes = t.stats.entries = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
