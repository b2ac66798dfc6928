"""Lightning Indexer (spec §4.5): which compressed CSA entries each query may attend to.

  q^I_t = RoPE(W^I_q c_q,t) per indexer head,  w_t,i = (W_w x_t)_i / sqrt(j * heads),
  I_t,s = sum_i w_t,i ReLU(q^I_t,i . f_s),  visible iff s < floor((t+1)/m),
  top-k by score; exact ties go to the lower entry index (XLA TopK's documented order), so
  selection is deterministic across chunkings and kernels.

The scores I live with their kernel (`pallas/indexer_scores.py`: `index_scores`, the XLA
reference, and the Mosaic GPU kernel); `score_function` picks one.

Causal prefill sees a growing prefix of the entries: a query block at row r can see only the
first (r + 1) / m. `select_topk_causal` scores and selects over the shortest of a few static
prefixes that holds every entry the block can see (chosen per block at run time; n and the
powers of two below it, `prefix_sizes`), so a long prefill scores and sorts about 5/8 of the
entries at 4 stages instead of all of them, with the same picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.compressor import Compressor
from redknot_jax.pallas import indexer_scores as scores_kernel
from redknot_jax.pallas.indexer_scores import index_scores
from redknot_jax.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST


class Indexer(nnx.Module):
    def __init__(self, d: int, q_rank: int, heads: int, dim: int, m: int, topk: int, eps: float, dtype):
        self.wq_b = nnx.Param(jnp.zeros((heads * dim, q_rank), dtype))
        self.weights_proj = nnx.Param(jnp.zeros((heads, d), dtype))
        self.compressor = Compressor(d, dim, m, overlap=True, eps=eps, dtype=dtype)
        self.heads, self.dim, self.m, self.topk = heads, dim, m, topk

    def queries(self, x: jax.Array, cq: jax.Array, pos: jax.Array, freqs):
        """(q^I [b, t, i, j], head weights [b, t, i] fp32) for the chunk's rows."""
        b, t, _ = x.shape
        q = jnp.einsum("btq,cq->btc", cq, self.wq_b[...], precision=HIGHEST).reshape(b, t, self.heads, self.dim)
        q = apply_rope(q, pos, freqs)
        w = jnp.einsum("btd,id->bti", x, self.weights_proj[...], preferred_element_type=jnp.float32,
                       precision=HIGHEST)
        return q, w * (self.dim ** -0.5 * self.heads ** -0.5)


def score_function(kernels: str = "xla"):
    """The scores I above: `index_scores` ("xla", the reference) or its Mosaic GPU kernel
    ("mosaic"), both from `redknot_jax.pallas.indexer_scores` (same signature): the caller's
    explicit choice. The kernel is looked up when asked for (tests put the reference in its place)."""
    if kernels == "xla":
        return index_scores
    if kernels == "mosaic":
        return scores_kernel.indexer_scores
    raise ValueError(f"score_function: kernels must be 'xla' or 'mosaic', got {kernels!r}")


TOPK_STAGES = 4  # prefixes of the entries a causal block scores over (1: every entry, always)


def prefix_sizes(n: int, stages: int) -> tuple[int, ...]:
    """The entry prefixes `select_topk_causal` chooses from, ascending: n and the `stages` - 1
    largest powers of two below it (at least 64, the indexer kernel's tile, once n >= 64 x stages).
    A large-k top-k is a sort, whose cost steps at powers of two (`launch/bench_topk.py`: 0.17 ms
    a 256-row block over 4096 entries, 0.27 over 4352, 0.32 over 6144 and 8192, on one H100), so a
    prefix just past one costs the next, as even steps of n would: 12288 of 16384 entries, or
    every step of a capacity such as 8672."""
    if stages < 1:
        raise ValueError(f"prefix_sizes: stages must be >= 1, got {stages}")
    low = 64 if n >= 64 * stages else 1
    below = [1 << j for j in range(max(n - 1, 1).bit_length()) if low <= 1 << j < n]
    return tuple(below[max(len(below) - stages + 1, 0):]) + (n,)


def select_topk_causal(scores, q, w, keys, visible, k: int, stages: int = TOPK_STAGES):
    """`select_topk(scores(q, w, keys), visible, k)` with k <= entries, computed over the
    shortest prefix of `prefix_sizes(entries, stages)` that holds every visible entry of the
    call (`lax.switch` on the last visible id: one branch per prefix). Same ids and flags: a
    prefix shorter than k pads its picks with id 0, flagged not real, where the full width
    would pick invisible entries, also flagged not real. keys [b, s, j], visible [b, t, s].
    Not under `vmap` (the switch would run every branch): pass stages=1 there."""
    n = keys.shape[-2]
    if k > n:
        raise ValueError(f"select_topk_causal: k={k} exceeds the {n} entries")
    sizes = prefix_sizes(n, stages)
    if len(sizes) == 1:
        return select_topk(scores(q, w, keys), visible, k)

    def branch(size):
        def run(_):
            kk = min(k, size)
            ids, ok = select_topk(scores(q, w, keys[..., :size, :]), visible[..., :size], kk)
            pad = [(0, 0)] * (ids.ndim - 1) + [(0, k - kk)]
            return jnp.pad(ids, pad), jnp.pad(ok, pad)
        return run

    last = jnp.max(jnp.where(visible, jnp.arange(n, dtype=jnp.int32), -1))  # -1: none visible
    stage = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), last + 1)  # first prefix holding it
    return jax.lax.switch(stage, [branch(size) for size in sizes], None)


def select_topk(scores: jax.Array, visible: jax.Array, k: int):
    """Top-k entry ids [b, t, k] among visible entries, and which picks are real (visible)."""
    masked = jnp.where(visible, scores, -jnp.inf)
    vals, ids = jax.lax.top_k(masked, k)
    return ids, vals > -jnp.inf
