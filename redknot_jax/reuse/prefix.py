"""The prefix arm (DESIGN §4, "The prefix is exact and free"): what a prefix cache (vLLM's
automatic prefix caching, SGLang's radix cache) gives.

The first document of a request sits at offset 0, so causal attention makes its canonical state
*the* state of those rows in every layer: its rows are computed in no layer. Each layer's cache
is rebuilt from the artifact (`native_cache`: fence layers from `Artifact.prefix_layers`,
reusable layers from their K=V rows, entries and compressor states) and the remaining rows run
natively as one chunk at pos0 = L (`Block.__call__` is chunk-incremental). A request of a
prefix document plus new rows therefore gives the Recomputed arm's logits.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.indexer import TOPK_STAGES
from redknot_jax.reuse.certificate import can_prefix
from redknot_jax.reuse.consumer import DecodeState, _LayerClock
from redknot_jax.reuse.pool import ceil_to


def native_cache(attn, state: dict, cap: int, dtype) -> dict:
    """The cache `attn.init_cache(1, cap, dtype)` holds after a native run of a document of
    L = len(state["kv"]) rows from position 0, from its native state (`Artifact.native_state`):
    the window ring (position p in slot p % window, zero before position 0), compressed entries
    and indexer keys padded to cap // m, the open compressor windows as stored."""
    c = attn.init_cache(1, cap, dtype)
    kv = jnp.asarray(state["kv"])
    n, w = kv.shape[0], attn.window
    if n > cap:
        raise ValueError(f"native_cache: {n} document rows exceed the capacity {cap}")
    tail = jnp.pad(kv[max(0, n - w):], ((max(0, w - n), 0), (0, 0)))  # positions n - w .. n - 1
    c["win"] = tail[np.mod(np.arange(w) - n, w)][None].astype(dtype)
    for name, st in (("entries", "cmp"), ("idx_entries", "idx")):
        if name not in c:
            continue
        e = jnp.asarray(state[name])
        c[name] = jnp.pad(e, ((0, c[name].shape[1] - e.shape[0]), (0, 0)))[None].astype(dtype)
        c[st] = {k: jnp.asarray(v)[None].astype(c[st][k].dtype) for k, v in state[st].items()}
    return c


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "block", "kernels", "topk_stages"),
                   donate_argnames=("cache",))
def _chunk_jit(state, x, ids, pos0, n_real, cache, *, graphdef, freqs, block, kernels="", topk_stages=TOPK_STAGES):
    """A native layer over one request's chunk x [1, t, ...] at pos0 (n_real real rows) with a
    cache that holds the rows before it: (x, new cache)."""
    blk = nnx.merge(graphdef, state)
    return blk(x, ids, pos0[None], n_real[None], cache, freqs, block, kernels=kernels, topk_stages=topk_stages)


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


def prefix_arm(consumer, artifact, tokens, query_rows, decode_rows: int = 0, layer_times: list | None = None):
    """The prefix arm: `artifact`'s document (tokens[:L]) computed in no layer, every layer's
    cache rebuilt from it (`native_cache`), the rows tokens[L:] run natively as one chunk at
    pos0 = L, padded as `consumer._pad` pads. query_rows: request rows (>= L). Returns logits
    [q, vocab] fp32, and with `decode_rows` > 0 also a native `DecodeState` (rows = the request
    length) that `consumer.decode_step` continues. `layer_times`: as `Consumer.recompute`'s."""
    cfg, model = consumer.cfg, consumer.model
    tokens = np.asarray(tokens, np.int32)
    prefix_check(artifact, tokens, cfg.num_layers)
    n, L = int(tokens.size), artifact.length
    q = np.asarray(query_rows, np.int64).reshape(-1)
    if q.size == 0 or (q < L).any() or (q >= n).any():
        raise ValueError(f"prefix_arm: query rows must lie in [{L}, {n}) (after the prefix), got {q.tolist()}")
    ids, t, t_real = consumer._pad(tokens[L:])
    unit = math.lcm(cfg.hca_rate, cfg.csa_rate)
    cap = ceil_to(max(consumer._cap(n + decode_rows), L + t), unit)
    x = consumer._embed(ids)
    clock = _LayerClock(layer_times, x)
    pos0, n_real = jnp.int32(L), jnp.int32(t_real)
    layers = {}
    for i, blk in enumerate(model.layers):
        gd, st = consumer.defs[i]
        cache = native_cache(blk.attn, artifact.native_state(i), cap, model.dtype)
        x, layers[i] = _chunk_jit(st, x, ids, pos0, n_real, cache, graphdef=gd, freqs=model.freqs(i),
                                  block=min(consumer.block, t), kernels=consumer.prefill_kernels,
                                  topk_stages=consumer.topk_stages)
        clock.lap(x)
    logits = consumer._logits(x, q - L)
    if not decode_rows:
        return logits
    return logits, DecodeState(n, cap, None, layers=layers, native=True)
