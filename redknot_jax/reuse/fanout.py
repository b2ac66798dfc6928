"""MoE expert fan-out in reusable layers (DESIGN.md §4, "MoE").

The native router picks the top-k experts (k = 6 in Flash and Pro) with weights p. The six
weights are normalised *only to choose how many to keep*: keep the smallest count c >= k_min
whose largest-c normalised mass reaches tau (`"tau"` mode), exactly the top 3 (`"k3"`), or
all of them (`"native"`). The kept experts then run with their ORIGINAL weights p (no
renormalisation: `MoE.experts(..., keep=mask)` just drops the others); the shared expert
always runs. Fences never use this (native top-k).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from redknot_jax.reuse.profile import FANOUT_MODES, RedKnotProfile

K3_EXPERTS = 3  # the fixed count of the "k3" mode


def fanout_keep(weights: jax.Array, mode: str = "tau", tau: float = 0.9, k_min: int = 3) -> jax.Array:
    """Keep mask [n, k] bool over the native top-k weights [n, k] (any order within a row).

    `mode` and `k_min` are static; `tau` may be traced. Counts are clipped to k, so a model
    with fewer native experts than k_min keeps all of them. Ties in weight are broken by
    column index (lower kept first), so the mask is deterministic.
    """
    if mode not in FANOUT_MODES:
        raise ValueError(f"fanout_keep: mode expected one of {FANOUT_MODES}, got {mode!r}")
    if isinstance(k_min, bool) or not isinstance(k_min, int) or k_min < 1:
        raise ValueError(f"fanout_keep: k_min expected an int >= 1, got {k_min!r}")
    if isinstance(tau, (int, float)) and not 0.0 < tau <= 1.0:
        raise ValueError(f"fanout_keep: tau expected in (0, 1], got {tau!r}")
    if weights.ndim != 2:
        raise ValueError(f"fanout_keep: weights expected [n, k], got shape {weights.shape}")
    n, k = weights.shape
    if mode == "native":
        return jnp.ones((n, k), bool)

    w = weights.astype(jnp.float32)
    order = jnp.argsort(-w, axis=-1, stable=True)           # [n, k] column of the r-th largest
    rank = jnp.argsort(order, axis=-1, stable=True)         # [n, k] rank of each column
    if mode == "k3":
        count = jnp.full((n, 1), min(K3_EXPERTS, k), jnp.int32)
    else:
        p = w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-30)   # normalised only for the count
        mass = jnp.cumsum(jnp.take_along_axis(p, order, axis=-1), axis=-1)  # [n, k] largest-c mass
        # smallest c with mass[c-1] >= tau  ==  1 + #(prefixes still below tau)
        count = 1 + jnp.sum(mass < tau, axis=-1, keepdims=True, dtype=jnp.int32)
        count = jnp.clip(count, min(k_min, k), k)
    return rank < count


def make_keep_fn(profile: RedKnotProfile) -> Callable:
    """The profile's rule as the `keep_fn(sel, wts, scores)` hook of `MoE.__call__`."""
    mode, tau, k_min = profile.fanout_mode, profile.tau, profile.fanout_min
    return lambda sel, wts, scores: fanout_keep(wts, mode, tau, k_min)


def fanout_histogram(keep) -> np.ndarray:
    """Number of tokens keeping 0, 1, ..., 6 experts: int64 [7] (longer if k > 6).

    `keep` is a bool mask [..., k]; leading axes are flattened (tokens, layers, ...)."""
    keep = np.asarray(keep)
    if keep.ndim < 1 or keep.dtype != np.bool_:
        raise ValueError(f"fanout_histogram: expected a bool mask [..., k], got {keep.dtype} {keep.shape}")
    k = keep.shape[-1]
    counts = keep.reshape(-1, k).sum(-1)
    return np.bincount(counts, minlength=max(7, k + 1)).astype(np.int64)


def mean_kept(hist: np.ndarray) -> float:
    """Mean experts kept per token from a `fanout_histogram` (the ledgers' input)."""
    hist = np.asarray(hist)
    total = hist.sum()
    if total == 0:
        raise ValueError("mean_kept: empty histogram (no tokens)")
    return float((hist * np.arange(hist.size)).sum() / total)
