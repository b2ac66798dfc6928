"""Lightning Indexer (spec §4.5): which compressed CSA entries each query may attend to.

  q^I_t = RoPE(W^I_q c_q,t) per indexer head,  w_t,i = (W_w x_t)_i / sqrt(j * heads),
  I_t,s = sum_i w_t,i ReLU(q^I_t,i . f_s),  visible iff s < floor((t+1)/m),
  top-k by score; exact ties go to the lower entry index (XLA TopK's documented order; scores
  compare in IEEE total order, so -0.0 ranks below +0.0), so selection is deterministic across
  chunkings and kernels.

Selection has two implementations that pick the same set: `sort` (XLA TopK, the reference; it
sorts each row, which is what makes the indexer dominate long prefill on a GPU) and `radix`
(the default: a radix select of each row's k-th largest score by counting passes, then the
picks compacted in entry order; `launch/bench_indexer.py` measures both).
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


SELECT_METHODS = ("radix", "sort")


def select_topk(scores: jax.Array, visible: jax.Array, k: int, method: str = "radix", bits: int = 4):
    """Top-k entry ids [..., k] among visible entries, and which picks are real (visible).

    Both methods pick the same set of entries; `sort` lists them by descending score (XLA TopK),
    `radix` by entry index. Attention over the picks does not depend on their order.
    """
    masked = jnp.where(visible, scores, -jnp.inf)
    if method == "sort":
        vals, ids = jax.lax.top_k(masked, k)
        return ids, vals > -jnp.inf
    if method != "radix":
        raise ValueError(f"select_topk: method must be one of {SELECT_METHODS}, got {method!r}")
    ids = radix_topk(masked, k, bits)
    return ids, jnp.take_along_axis(visible, ids, axis=-1)


def total_order_key(x: jax.Array) -> jax.Array:
    """fp32 -> uint32 with the same order as IEEE total order (-inf < ... < -0.0 < +0.0 < ... < inf)."""
    if x.dtype != jnp.float32:
        raise ValueError(f"total_order_key: expects float32 scores, got {x.dtype}")
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def kth_largest_key(u: jax.Array, k: int, bits: int = 4) -> jax.Array:
    """The k-th largest value of each row of u [..., s] (uint32), found digit by digit from the top.

    Each of the 32 / bits passes reads the row once and counts, for all 2**bits - 1 candidate
    digits at once, how many entries are >= the threshold so far with that digit appended; the
    digit kept is the largest whose count still reaches k. The result is the largest tau with
    count(u >= tau) >= k, i.e. the k-th largest entry.
    """
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"kth_largest_key: bits must be 1, 2, 4 or 8 (a divisor of 32 up to 8), got {bits}")
    if not 1 <= k <= u.shape[-1]:
        raise ValueError(f"kth_largest_key: k = {k} must be in [1, {u.shape[-1]}] (entries per row)")
    digits = jnp.arange(1, 2 ** bits, dtype=jnp.uint32)
    tau = jnp.zeros(u.shape[:-1], jnp.uint32)
    for shift in range(32 - bits, -1, -bits):
        cand = tau[..., None] | (digits << shift)  # [..., 2**bits - 1]
        counts = jnp.sum(u[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)
        tau = tau | (jnp.sum(counts >= k, axis=-1, dtype=jnp.uint32) << shift)
    return tau


def radix_topk(x: jax.Array, k: int, bits: int = 4) -> jax.Array:
    """Ids [..., k] (ascending) of the k largest entries of each row of x [..., s] fp32: the same
    set as `jax.lax.top_k` (total order, ties to the lower index), without sorting the row."""
    s = x.shape[-1]
    if k == 0:
        return jnp.zeros((*x.shape[:-1], 0), jnp.int32)
    u = total_order_key(x)
    tau = kth_largest_key(u, k, bits)[..., None]
    gt, eq = u > tau, u == tau
    need = k - jnp.sum(gt, axis=-1, keepdims=True, dtype=jnp.int32)  # ties taken, lowest index first
    cs = jnp.cumsum(gt, axis=-1, dtype=jnp.int32) + jnp.minimum(jnp.cumsum(eq, axis=-1, dtype=jnp.int32), need)
    # the j-th pick is the first entry whose running count of picks reaches j + 1
    rows = cs.reshape(-1, s)
    ids = jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(1, k + 1, dtype=jnp.int32), side="left"))(rows)
    return ids.reshape(*x.shape[:-1], k).astype(jnp.int32)
