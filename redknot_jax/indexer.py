"""Lightning Indexer (spec §4.5): which compressed CSA entries each query may attend to.

  q^I_t = RoPE(W^I_q c_q,t) per indexer head,  w_t,i = (W_w x_t)_i / sqrt(j * heads),
  I_t,s = sum_i w_t,i ReLU(q^I_t,i . f_s),  visible iff s < floor((t+1)/m),
  top-k by score; exact ties go to the lower entry index (XLA TopK's documented order), so
  selection is deterministic across chunkings and kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.compressor import Compressor
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


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """I [b, t, s] = sum_i w[b,t,i] relu(q[b,t,i] . keys[b,s]) (products accumulated in fp32)."""
    dots = jnp.einsum("btij,bsj->btis", q, keys.astype(q.dtype), preferred_element_type=jnp.float32,
                      precision=HIGHEST)
    return jnp.einsum("btis,bti->bts", jax.nn.relu(dots), w, precision=HIGHEST)


def score_function(kernels: str = "xla"):
    """`index_scores` ("xla", the reference) or its Mosaic GPU kernel ("mosaic",
    `redknot_jax.pallas.indexer_scores`, same signature): the caller's explicit choice."""
    if kernels == "xla":
        return index_scores
    if kernels == "mosaic":
        from redknot_jax.pallas.indexer_scores import indexer_scores

        return indexer_scores
    raise ValueError(f"score_function: kernels must be 'xla' or 'mosaic', got {kernels!r}")


def select_topk(scores: jax.Array, visible: jax.Array, k: int):
    """Top-k entry ids [b, t, k] among visible entries, and which picks are real (visible)."""
    masked = jnp.where(visible, scores, -jnp.inf)
    vals, ids = jax.lax.top_k(masked, k)
    return ids, vals > -jnp.inf
