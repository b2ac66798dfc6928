"""The device arena of hot documents (DESIGN §7; issue #46): one fixed-capacity pool on the
device that every request reads, whatever set of documents it cites.

A `DocPool` packs one set of documents; two sets sharing a document hold it twice, and a new
set has new array shapes, so its layer programs compile again. The arena instead allocates, per
reusable layer, arrays of a fixed capacity (`rows` document rows, their compressed entries at
each layer's rate, `docs` boundary rings), like vLLM's block pool: a document is admitted once
(its arrays written into a free row range) and read by every request that cites it, in any
order and beside any other documents. The shapes never change, so a new combination of
documents compiles nothing (each layer program compiles once per request size bucket).

* Placement: a document takes a contiguous range of rows starting at a multiple of `unit` (the
  least common multiple of the compression rates), so its entries at rate m start at
  row_start / m in every layer; first fit over the free ranges. No compaction: a pinned
  document can split the free rows (`ArenaFull` names the longest free range).
* Admission (`acquire`): documents not resident are written in (one jitted scatter per layer and
  document length bucket, the arena's buffers donated); each cited document is pinned until
  `release`. Eviction: least recently used unpinned documents, until the new ones fit (of that
  run only those in the way of the range taken; the others stay resident); evicted ones stay
  in host memory (their `Artifact`), the host tier, and are written in again when cited.
  `ArenaFull` when the pinned documents leave no room.
* Identity: a document is its `Artifact` object (held while resident), as in `DocPool`. The
  server gives each tenant's document its own artifact, so tenants share no arena entry and no
  hit tells one tenant what another cited (vLLM's cache_salt). Only certified artifacts may be
  admitted: the runtime certifies each request's artifact objects (hashing each object once), and
  the arena's copy is that object's payload.
* Layout interface (`layout.py`): `doc(art)` (ring slot), `row_base[slot]`, `entry_base(art, m)`,
  `layers`, like `DocPool`; artifacts in any codec (one per arena), fields as `pool._fields` keeps them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.reuse import codec
from redknot_jax.reuse.pool import POOL_ROW_PAD, Buckets, _fields, ceil_to

ROW_FIELDS = ("kv", "zl", "ffn", "topk")
ENTRY_FIELDS = {"entries": "cmp", "idx_entries": "idx"}  # entry field -> its boundary ring


class ArenaFull(RuntimeError):
    """The documents a request cites do not fit beside the pinned ones (the message says how many
    rows were asked and how many are free)."""


@dataclasses.dataclass
class _Resident:
    art: object  # held: its id is the key
    slot: int
    start: int
    rows: int  # rows allocated (a multiple of the unit)
    pins: int = 0


def doc_key(art) -> int:
    """A document's identity in the arena: its artifact object."""
    if getattr(art, "certificate", None) is None:
        raise ValueError("DocArena: an artifact without a certificate cannot be admitted")
    return id(art)


def _put(a, v, base, count):
    """a with rows base .. base + count - 1 replaced by v[:count] (v's padding rows dropped)."""
    i = jnp.arange(v.shape[0])
    return a.at[jnp.where(i < count, base + i, a.shape[0])].set(v.astype(a.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("rates",))
def _write(arena, doc, start, n, slot, *, rates):
    """One reusable layer of one document written into the arena's layer (donated): rows at
    `start`, entries at start / m of their rate, boundary rings at `slot`."""
    out = dict(arena)
    for f in ROW_FIELDS:
        if f in doc:
            out[f] = jax.tree.map(lambda a, v: _put(a, v, start, n), arena[f], doc[f])
    for f, ring in ENTRY_FIELDS.items():
        if f in doc:
            m = dict(rates)[f]
            out[f] = jax.tree.map(lambda a, v: _put(a, v, start // m, n // m), arena[f], doc[f])
            r = jax.tree.leaves(doc[ring])[0].shape[0]
            out[ring] = jax.tree.map(lambda a, v: _put(a, v, slot * r, r), arena[ring], doc[ring])
    return out


class DocArena:
    """Fixed-capacity device storage of hot documents, shared by every request (module doc).

    rows: document rows held at once (rounded up to `unit`); docs: documents held at once;
    layers: the reusable layers; rates: {layer: {"entries": m, "idx_entries": m'}} (the layer's
    compressor / indexer rates); unit: the row alignment (a multiple of every rate)."""

    def __init__(self, layers, dtype, rows: int, docs: int, rates: dict, unit: int, topk: int,
                 buckets: Buckets = Buckets()):
        if rows < unit or docs < 1:
            raise ValueError(f"DocArena: rows must be >= {unit} and docs >= 1, got rows={rows}, docs={docs}")
        self.layer_ids, self.dtype, self.unit, self.topk = list(layers), dtype, unit, topk
        self.rates, self.buckets = rates, buckets
        self.capacity = ceil_to(rows, unit)
        self.docs_capacity = docs
        self.row_base = np.zeros(docs, np.int64)  # slot -> first row
        self.layers: dict | None = None  # allocated at the first admission (field shapes from it)
        self.codec: str | None = None
        self._res: collections.OrderedDict[int, _Resident] = collections.OrderedDict()  # LRU first
        self.stats = {"admitted": 0, "hits": 0, "evicted": 0}
        self._lock = threading.RLock()  # residency changes (a server's worker admits, its event loop evicts)

    # ------------------------------------------------------------------ layout interface
    def doc(self, art) -> int:
        r = self._res.get(doc_key(art))
        if r is None:
            raise KeyError("DocArena: this artifact is not resident (acquire it for the request first)")
        return r.slot

    def entry_base(self, art, m: int) -> int:
        return self._res[doc_key(art)].start // m

    def nbytes(self) -> int:
        return 0 if self.layers is None else int(sum(x.nbytes for x in jax.tree.leaves(self.layers)))

    # ------------------------------------------------------------------ occupancy
    @property
    def rows_used(self) -> int:
        return sum(r.rows for r in self._res.values())

    def resident(self, art) -> bool:
        return doc_key(art) in self._res

    def snapshot(self) -> dict:
        with self._lock:
            pinned = sum(1 for r in self._res.values() if r.pins)
            return {"rows_capacity": self.capacity, "rows_used": self.rows_used, "docs": len(self._res),
                    "pinned": pinned, "docs_capacity": self.docs_capacity, "bytes": self.nbytes(), **self.stats}

    # ------------------------------------------------------------------ admission
    def acquire(self, artifacts) -> list:
        with self._lock:
            return self._acquire(artifacts)

    def _acquire(self, artifacts) -> list:
        """Make every artifact resident and pin it (until `release(artifacts)`); returns the
        artifacts admitted now (the others were resident: hits). The resident ones are pinned
        first, so none of them is evicted to make room for the others."""
        arts = list({doc_key(a): a for a in artifacts}.values())  # a document cited twice counts once
        pinned, admitted = [], []
        for a in arts:
            r = self._res.get(doc_key(a))
            if r is not None:
                r.pins += 1
                self._res.move_to_end(doc_key(a))
                pinned.append(a)
                self.stats["hits"] += 1
        try:
            for a in arts:
                k = doc_key(a)
                if k not in self._res:
                    self._admit(a, k)
                    self._res[k].pins += 1
                    pinned.append(a)
                    admitted.append(a)
        except Exception:
            self._release(pinned)
            raise
        return admitted

    def release(self, artifacts) -> None:
        with self._lock:
            self._release(artifacts)

    def _release(self, artifacts) -> None:
        for k in {doc_key(a) for a in artifacts}:
            r = self._res.get(k)
            if r is not None and r.pins:
                r.pins -= 1

    def evict(self, artifacts) -> int:
        """Free the rows of these documents now (e.g. deleted ones) unless a request in flight
        pins them (those stay, least recently used first in line); returns how many were freed."""
        with self._lock:
            gone = [k for k in {doc_key(a) for a in artifacts} if k in self._res and not self._res[k].pins]
            for k in gone:
                del self._res[k]
            self.stats["evicted"] += len(gone)
            return len(gone)

    def _admit(self, art, key: int) -> None:
        n = art.length
        need = ceil_to(n, self.unit)
        if need > self.capacity:
            raise ArenaFull(f"DocArena: a document of {n} rows needs {need} rows, more than the arena's "
                            f"{self.capacity}")
        codec_name = getattr(art.certificate, "codec", "dense")
        if self.codec is not None and codec_name != self.codec:
            raise ValueError(f"DocArena: artifacts stored in codec {codec_name!r}; this arena holds {self.codec!r}")
        start, slot = self._place(need)
        if start is None or slot is None:
            for k in self._victims(need):
                del self._res[k]
                self.stats["evicted"] += 1
            start, slot = self._place(need)
        put = lambda x, dt: jnp.asarray(x, dt)
        pad = self.buckets(n, POOL_ROW_PAD)
        for i in self.layer_ids:
            doc = _fields(art.layers[i], self.dtype, put)
            doc = {f: jax.tree.map(lambda a: self._pad(f, a, pad, i), v) for f, v in doc.items()}
            if self.layers is None or i not in self.layers:
                self._allocate(i, doc)
            self.layers[i] = _write(self.layers[i], doc, jnp.int32(start), jnp.int32(n), jnp.int32(slot),
                                    rates=tuple(sorted(self.rates[i].items())))
        self.codec = codec_name
        self.row_base[slot] = start
        self._res[key] = _Resident(art, slot, start, need)
        self.stats["admitted"] += 1

    def _pad(self, field: str, a, pad: int, layer: int):
        """A document's array padded to the row bucket `pad` (its rate's share for entries; top-k
        ids widened to the arena's width with -1)."""
        if field in ROW_FIELDS:
            rows = pad
        elif field in ENTRY_FIELDS:
            rows = pad // self.rates[layer][field]
        else:  # a boundary ring: as it is
            return a
        a = jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
        if field == "topk":
            a = jnp.pad(a, ((0, 0), (0, self.topk - a.shape[1])), constant_values=-1)
        return a

    def _allocate(self, layer: int, doc: dict) -> None:
        """The arena's arrays of one layer, zero, shaped after a document's (rows -> capacity)."""
        if self.layers is None:
            self.layers = {}

        def full(field, a):
            if field in ROW_FIELDS:
                n = self.capacity
            elif field in ENTRY_FIELDS:
                n = self.capacity // self.rates[layer][field]
            else:
                n = self.docs_capacity * a.shape[0]
            if field == "topk":  # document-local ids: the widest a document of the whole arena needs
                dt = jnp.promote_types(a.dtype, codec.topk_dtype(self.capacity // self.rates[layer]["entries"]))
                return jnp.full((n,) + a.shape[1:], -1, dt)
            return jnp.zeros((n,) + a.shape[1:], a.dtype)

        self.layers[layer] = {f: jax.tree.map(lambda a: full(f, a), v) for f, v in doc.items()}

    def _victims(self, need: int) -> list[int]:
        """The documents to evict so that `need` contiguous rows and a slot are free: the shortest
        run of least recently used unpinned documents whose eviction would leave room, and of those
        only the ones in the way of the range then taken (others in the run stay resident), plus the
        least recently used of the run when every slot is taken. `ArenaFull` when evicting every
        unpinned document would not do."""
        order = [k for k, r in self._res.items() if not r.pins]  # least recently used first
        for n in range(1, len(order) + 1):
            run = set(order[:n])
            start = next((s for s, m in self._free_ranges([r for k, r in self._res.items() if k not in run])
                          if m >= need), None)
            if start is None:
                continue
            out = [k for k in order[:n] if self._res[k].start < start + need and start < self._res[k].start
                   + self._res[k].rows]
            if len(self._res) - len(out) >= self.docs_capacity:  # a slot too
                out.append(next(k for k in order[:n] if k not in out))
            return out
        raise ArenaFull(f"DocArena: {need} rows asked; {self.capacity - self.rows_used} of {self.capacity} "
                        f"free (the longest free range {self._longest_free()} rows) and "
                        f"{self.docs_capacity - len(self._res)} of {self.docs_capacity} document slots free; "
                        "every resident document is pinned by a request in flight")

    def _free_ranges(self, residents=None) -> list[tuple[int, int]]:
        """The free row ranges (start, length), in row order, around `residents` (default: all)."""
        residents = self._res.values() if residents is None else residents
        out, prev = [], 0
        for s, e in sorted((r.start, r.start + r.rows) for r in residents) + [(self.capacity,) * 2]:
            if s > prev:
                out.append((prev, s - prev))
            prev = max(prev, e)
        return out

    def _longest_free(self) -> int:
        return max((n for _, n in self._free_ranges()), default=0)

    def _place(self, need: int) -> tuple[int | None, int | None]:
        """(first row, slot) of a free range of `need` rows (first fit) and a free slot (None where none)."""
        start = next((s for s, n in self._free_ranges() if n >= need), None)
        free = sorted(set(range(self.docs_capacity)) - {r.slot for r in self._res.values()})
        return start, (free[0] if free else None)
