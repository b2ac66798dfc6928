"""The exact prefix (DESIGN §4, "The prefix is exact and free"): the pieces both arms that use
one share (`Consumer.prefix`, what a prefix cache such as vLLM's automatic prefix caching or
SGLang's radix cache gives; and the RedKnot arm's fences, `Consumer.redknot`).

The first document of a request sits at offset 0, so causal attention makes its canonical state
*the* state of those rows in every layer: its rows are computed in no layer. A layer's cache
is rebuilt from the artifact (`native_cache`: fence layers from `Artifact.prefix_layers`,
reusable layers from their K=V rows, entries and compressor states) and the remaining rows run
natively as one chunk at pos0 = L (`model.block_jit`; `Block.__call__` is chunk-incremental). A
request of a prefix document plus new rows therefore gives the Recomputed arm's logits.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.reuse.certificate import can_prefix


def native_cache(attn, state: dict, cap: int, dtype) -> dict:
    """The cache `attn.init_cache(1, cap, dtype)` holds after a native run of a document of
    L = state["length"] (default len(state["kv"])) rows from position 0, from its native state
    (`Artifact.native_state`, or `hot_prefix`'s, which keeps the last window's K=V rows only):
    the window ring (position p in slot p % window, zero before position 0), compressed entries
    and indexer keys padded to cap // m, the open compressor windows as stored. One compiled
    program per shape (op by op, its ~30 small dispatches left the device idle ~25 ms a layer
    on the H100)."""
    n = int(state.get("length", np.shape(state["kv"])[0]))  # `hot_prefix` keeps the window's rows only
    if n > cap:
        raise ValueError(f"native_cache: {n} document rows exceed the capacity {cap}")
    arrays = {k: v for k, v in state.items() if k != "length"}
    return _native_cache(arrays, like=_cache_like(attn, cap, dtype), n=n, window=attn.window)


_LIKE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention -> {(cap, dtype): cache shapes}


def _cache_like(attn, cap: int, dtype):
    """`attn.init_cache(1, cap, dtype)`'s tree and leaf shapes (`_native_cache`'s static
    argument), traced once per attention, capacity and dtype (a trace costs ~1.5 ms of host time,
    every fence layer of every request)."""
    key = (cap, jnp.dtype(dtype).name)
    held = _LIKE.setdefault(attn, {})
    if key not in held:
        leaves, tree = jax.tree.flatten(jax.eval_shape(lambda: attn.init_cache(1, cap, dtype)))
        held[key] = (tree, tuple(leaves))
    return held[key]


@functools.partial(jax.jit, static_argnames=("like", "n", "window"))
def _native_cache(state: dict, like, n: int, window: int) -> dict:
    tree, leaves = like
    c = jax.tree.unflatten(tree, [jnp.zeros(s.shape, s.dtype) for s in leaves])
    kv, w = state["kv"], window
    kept = kv[kv.shape[0] - min(n, w):]  # positions n - min(n, w) .. n - 1
    tail = jnp.pad(kept, ((w - kept.shape[0], 0), (0, 0)))  # positions n - w .. n - 1
    c["win"] = tail[np.mod(np.arange(w) - n, w)][None].astype(c["win"].dtype)
    for name, st in (("entries", "cmp"), ("idx_entries", "idx")):
        if name not in c:
            continue
        e = state[name]
        c[name] = jnp.pad(e, ((0, c[name].shape[1] - e.shape[0]), (0, 0)))[None].astype(c[name].dtype)
        c[st] = {k: jnp.asarray(v)[None].astype(c[st][k].dtype) for k, v in state[st].items()}
    return c


def hot_prefix(artifact, layers, window: int):
    """What a prefix cache (vLLM's, SGLang's) holds of `artifact`'s document: the native state of
    `layers` (layer ids; `Artifact.native_state`, a compact codec's latents decoded once) dense on
    the device, as an artifact of those alone (`prefix_layers`; no reusable layer, the same
    certificate), of the K=V rows only the last `window` (the sliding window: all that
    `native_cache` reads of them; "length" keeps the document's). `Consumer.prefix` over it
    reads no host array and decodes nothing per request; it gives the logits of `artifact`."""
    def hot(state):  # "length" stays a host int: native_cache reads it per request without a device read
        kv = state["kv"]
        return {**jax.device_put({**state, "kv": kv[max(0, kv.shape[0] - window):]}), "length": np.int32(kv.shape[0])}

    return dataclasses.replace(artifact, layers={}, prefix_layers={i: hot(artifact.native_state(i)) for i in layers})


class PrefixCache:
    """The exact prefix's device cache, read by the prefix and RedKnot arms' fence layers alike
    (`Consumer._hot`): the `hot_prefix` of up to `capacity` documents, least recently used
    evicted first (vLLM's automatic prefix caching holds a prefix's KV blocks on the device the
    same way). Keyed by the artifact's payload digest, so a rebuilt or
    regenerated artifact is a new entry; `stats`: hits, misses, evictions. Thread-safe."""

    def __init__(self, capacity: int, num_layers: int, window: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"PrefixCache: capacity must be an int >= 1, got {capacity!r}")
        self.capacity, self.num_layers, self.window = capacity, num_layers, window
        self._hot: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "evictions": 0}

    @staticmethod
    def _key(artifact) -> str:
        return artifact.certificate.payload_digest

    def get(self, artifact, layers=None):
        """`artifact`'s hot prefix holding at least `layers` (default every layer: the prefix arm
        reads them all, the RedKnot arm its fences only); on a miss the layers it lacks are made
        (and the least recently used document evicted)."""
        key, want = self._key(artifact), set(range(self.num_layers) if layers is None else layers)
        with self._lock:
            held = self._hot.get(key)
            if held is not None and want <= held.prefix_layers.keys():
                self._hot.move_to_end(key)
                self.stats["hits"] += 1
                return held
        # outside the lock: device work
        hot = hot_prefix(artifact, sorted(want - (held.prefix_layers.keys() if held else set())), self.window)
        if held is not None:
            hot = dataclasses.replace(hot, prefix_layers={**held.prefix_layers, **hot.prefix_layers})
        with self._lock:
            self.stats["misses"] += 1
            self._hot[key] = hot
            self._hot.move_to_end(key)
            while len(self._hot) > self.capacity:
                self._hot.popitem(last=False)
                self.stats["evictions"] += 1
        return hot

    def drop(self, artifact) -> bool:
        """Forget `artifact`'s entry (its document deleted); whether there was one."""
        with self._lock:
            return self._hot.pop(self._key(artifact), None) is not None

    def clear(self) -> None:
        """Forget every entry (the statistics stay)."""
        with self._lock:
            self._hot.clear()

    def __len__(self) -> int:
        return len(self._hot)

    def nbytes(self) -> int:
        with self._lock:
            return sum(v.nbytes for h in self._hot.values() for v in jax.tree.leaves(h.prefix_layers))

    def snapshot(self) -> dict:
        """Entries ("docs"), device bytes and the statistics, for metrics."""
        return {"docs": len(self), "bytes": self.nbytes(), **self.stats}


def prefix_check(artifact, tokens, num_layers: int) -> None:
    """ValueError unless `artifact` can serve as the exact prefix of `tokens` with rows after it."""
    if not can_prefix(artifact.certificate):
        cert = artifact.certificate
        raise ValueError(f"prefix: the artifact cannot serve as an exact prefix (format "
                         f"{getattr(cert, 'format_version', None)}, parts {getattr(cert, 'parts', ())}: "
                         f"format >= 4 with the 'prefix' part needed)")
    absent = [i for i in range(num_layers) if i not in artifact.layers and i not in artifact.prefix_layers]
    if absent:
        raise ValueError(f"prefix: the artifact holds no native state of layers {absent}")
    n, L = len(tokens), artifact.length
    if n <= L:
        raise ValueError(f"prefix: no rows after the prefix ({n} request rows, prefix of {L})")
    if not np.array_equal(np.asarray(tokens[:L]), np.asarray(artifact.tokens)):
        raise ValueError("prefix: the request's tokens do not start with the artifact's tokens")
