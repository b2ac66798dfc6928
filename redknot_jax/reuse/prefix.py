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

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.reuse.certificate import can_prefix


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


def hot_prefix(artifact, num_layers: int):
    """What a prefix cache (vLLM's, SGLang's) holds of `artifact`'s document: every layer's
    native state (`Artifact.native_state`, a compact codec's latents decoded once) dense on the
    device, as an artifact of those alone (`prefix_layers`; no reusable layer, the same
    certificate). `Consumer.prefix` over it reads no host array and decodes nothing per request;
    it gives the logits of `artifact` itself."""
    states = {i: jax.device_put(artifact.native_state(i)) for i in range(num_layers)}
    return dataclasses.replace(artifact, layers={}, prefix_layers=states)


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
