"""The one table from parameter paths to mesh axes (tensor parallelism over axis "tp").

This is the only place the mesh axis name appears. The split follows DeepSeek's own
tensor-parallel layout (spec §7.7, DESIGN §7):

* by head, dim 0: `attn.wq_b` [h*k, q], `attn.wo_a` [g*o, h*k/g] (by output group),
  `attn.attn_sink` [h], `attn.indexer.wq_b` [i*j, q], `attn.indexer.weights_proj` [i, d];
* row-parallel, dim 1: `attn.wo_b` [d, g*o] (its input is the head-split `wo_a` output);
* by expert index range, dim 0: routed experts `ffn.w1` / `ffn.w3` / `ffn.w2` [e, in, out];
* by vocabulary, dim 0: `embed`, `head` [vocab, d];
* everything else (norms, mHC, `wq_a`, the shared K=V `wkv`, compressors, router, shared
  expert) replicated.

A dim is split only when tp divides it; otherwise the parameter is replicated, so any tp
restores any checkpoint. This is the storage layout only: a later issue writes the
shard_map'd forward that relies on it (and may tighten the rule to whole heads / groups).
"""

from __future__ import annotations

import re

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "tp"

_RULES = (  # (path pattern, dim split over AXIS)
    (re.compile(r"(^|\.)attn\.(wq_b|wo_a|attn_sink)$"), 0),
    (re.compile(r"(^|\.)attn\.indexer\.(wq_b|weights_proj)$"), 0),
    (re.compile(r"(^|\.)attn\.wo_b$"), 1),
    (re.compile(r"(^|\.)ffn\.(w1|w2|w3)$"), 0),
    (re.compile(r"^(embed|head)$"), 0),
)


def param_spec(path: str, shape, tp: int) -> PartitionSpec:
    """PartitionSpec of the parameter at dotted `path` (as `weights.param_leaves` names it)
    with `shape`, for tensor parallelism of degree `tp`."""
    if tp < 1:
        raise ValueError(f"tp: expected a positive int, got {tp}")
    for rx, dim in _RULES:
        if rx.search(path):
            if tp > 1 and len(shape) > dim and shape[dim] % tp == 0:
                return PartitionSpec(*([None] * dim), AXIS)
            break
    return PartitionSpec()


def make_mesh(tp: int) -> Mesh:
    """A 1-D mesh named "tp" over the first `tp` devices."""
    devices = jax.devices()
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tp={tp}: expected 1 <= tp <= {len(devices)} (the visible devices)")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def param_sharding(mesh: Mesh, path: str, shape) -> NamedSharding:
    """NamedSharding of a parameter on `mesh` (its "tp" axis gives the degree)."""
    return NamedSharding(mesh, param_spec(path, shape, mesh.shape[AXIS]))
