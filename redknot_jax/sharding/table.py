"""The one table from parameter paths to mesh axes (tensor parallelism over axis "tp", data
parallelism over axis "dp").

This is the only place the mesh axis names appear. The split follows DeepSeek's own
tensor-parallel layout (spec §7.7, DESIGN §7):

* by head, dim 0: `attn.wq_b` [h*k, q], `attn.wo_a` [g*o, h*k/g] (by output group),
  `attn.attn_sink` [h], `attn.indexer.wq_b` [i*j, q], `attn.indexer.weights_proj` [i, d];
* row-parallel, dim 1: `attn.wo_b` [d, g*o] (its input is the head-split `wo_a` output);
* by expert index range, dim 0: routed experts `ffn.w1` / `ffn.w3` / `ffn.w2` [e, in, out];
* by vocabulary, dim 0: `embed`, `head` [vocab, d];
* everything else (norms, mHC, `wq_a`, the shared K=V `wkv`, compressors, router, shared
  expert) replicated.

A dim is split only when tp divides it; otherwise the parameter is replicated, so any tp
restores any checkpoint. The shard_map'd forward (`redknot_jax.sharding.tp`) needs whole
heads, groups, experts and vocabulary slices per rank and checks that with `check_tp`.

Activations and caches: the batch dim is split over "dp" (when the mesh has it), replicated
over "tp" (the shared K=V latent, compressor states and entries are one head: every rank
keeps them whole, DESIGN §7).
"""

from __future__ import annotations

import re

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "tp"
DP_AXIS = "dp"

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


def check_tp(cfg, tp: int) -> None:
    """Raise ValueError unless every rank of a degree-`tp` split holds whole heads, output
    groups, indexer heads, experts and an equal vocabulary slice (what the shard_map'd
    forward assumes; Flash and Pro satisfy it for tp = 1, 2, 4, 8)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected a positive int, got {tp!r}")
    counts = {"num_heads": cfg.num_heads, "o_groups": cfg.o_groups, "index_n_heads": cfg.index_n_heads,
              "n_routed_experts": cfg.n_routed_experts, "vocab_size": cfg.vocab_size}
    bad = {k: v for k, v in counts.items() if v % tp}
    if bad:
        raise ValueError(f"tp={tp} does not divide {bad} (every rank must hold whole heads, groups, "
                         f"experts and vocabulary slices)")


def make_mesh(tp: int, dp: int = 1) -> Mesh:
    """tp only: a 1-D mesh named "tp" over the first `tp` devices. With dp > 1: a 2-D mesh
    ("dp", "tp") whose tp groups never cross a process (TP inside a host, DP across hosts):
    each process contributes whole rows of `tp` of its local devices."""
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp: expected a positive int, got {dp!r}")
    devices = jax.devices()
    if dp == 1:
        if not 1 <= tp <= len(devices):
            raise ValueError(f"tp={tp}: expected 1 <= tp <= {len(devices)} (the visible devices)")
        return Mesh(np.array(devices[:tp]), (AXIS,))
    by_proc: dict[int, list] = {}
    for d in sorted(devices, key=lambda d: (d.process_index, d.id)):
        by_proc.setdefault(d.process_index, []).append(d)
    rows = []
    for proc in sorted(by_proc):
        local = by_proc[proc]
        rows += [local[i:i + tp] for i in range(0, len(local) - tp + 1, tp)]
    if tp < 1 or len(rows) < dp:
        raise ValueError(f"mesh dp={dp} x tp={tp}: the processes' local devices "
                         f"{ {p: len(v) for p, v in by_proc.items()} } hold only {len(rows)} whole tp groups")
    return Mesh(np.array(rows[:dp]), (DP_AXIS, AXIS))


def batch_spec(mesh: Mesh, ndim: int) -> PartitionSpec:
    """Activations / caches [b, ...]: batch over "dp" when the mesh has it, replicated over "tp"."""
    lead = DP_AXIS if DP_AXIS in mesh.axis_names else None
    return PartitionSpec(lead, *([None] * (ndim - 1))) if ndim else PartitionSpec()


def param_sharding(mesh: Mesh, path: str, shape) -> NamedSharding:
    """NamedSharding of a parameter on `mesh` (its "tp" axis gives the degree)."""
    return NamedSharding(mesh, param_spec(path, shape, mesh.shape[AXIS]))
