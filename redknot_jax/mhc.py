"""Manifold-constrained hyper-connections (spec §3): N residual streams per token.

Per site, from the flattened, RMS-normalised streams f in R^{N*D} (fp32 throughout):
  m = fn @ f;  pre = sigmoid(m_pre*scale0 + base) + eps;  post = 2*sigmoid(m_post*scale1 + base);
  C = Sinkhorn(softmax_rows(m_comb*scale2 + base) + eps)   (column first, then rows/cols),
  block input u = sum_i pre_i X_i;   update X'[k] = post_k * y + sum_j C[j, k] X[j]   (C^T X).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def mix_logits(x: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """fn @ RMSNorm(flatten(x)) [b, t, c] in fp32, as (fn @ flatten(x)) * rsqrt(mean(x^2) + eps):
    the norm is one scalar per row, so the normalised fp32 streams are never written (the site
    reads x once for the sum of squares and once for the projection). fp32 x: the projection at
    HIGHEST precision. bf16 x: fn split into two bf16 parts (hi + lo, ~16 of fp32's 24 mantissa
    bits) so the projection runs on bf16 tensor cores with fp32 accumulation; each product of a
    bf16 x and a part is exact in fp32 (`launch/bench_mhc.py` times both forms, docs/benchmarks.md)."""
    xf = x.reshape(*x.shape[:-2], -1)  # [b, t, n*d]
    sq = jnp.mean(jnp.square(xf.astype(jnp.float32)), axis=-1, keepdims=True)
    if xf.dtype != jnp.bfloat16:
        m = jnp.einsum("btf,cf->btc", xf.astype(jnp.float32), fn, precision=jax.lax.Precision.HIGHEST)
    else:
        # hi: fn truncated to bf16's bits by a mask, not by a rounding convert: with the convert,
        # lo came out zero on an H100 (1.6e-3 off, fn's bf16 rounding; XLA may drop an
        # f32 -> bf16 -> f32 round trip under its allowed excess precision)
        hi32 = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(fn.astype(jnp.float32), jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
        hi, lo = hi32.astype(xf.dtype), (fn - hi32).astype(xf.dtype)
        c = fn.shape[0]
        both = jnp.einsum("btf,cf->btc", xf, jnp.concatenate([hi, lo]), preferred_element_type=jnp.float32)
        m = both[..., :c] + both[..., c:]
    return m * jax.lax.rsqrt(sq + eps)


def fold(op, x: jax.Array, axis: int) -> jax.Array:
    """`op` (jnp.add, jnp.maximum) folded over a short static axis of x slice by slice, the axis
    kept: elementwise ops only, which XLA fuses with their neighbours, where each reduce op is a
    fusion of its own. XLA:GPU compiled the flash-shaped decode step's Sinkhorn in 23.8 s with
    reduce ops, 1.4 s folded (one H100, `launch/bench_compile.py --sinkhorn reduce`, docs/serving.md)."""
    return functools.reduce(op, [jax.lax.slice_in_dim(x, j, j + 1, axis=axis) for j in range(x.shape[axis])])


def sinkhorn(logits: jax.Array, iters: int, eps: float, unroll: bool = True) -> jax.Array:
    """Row softmax + eps, then column-normalise, then (iters - 1) x (row, column), over [..., n, n]
    with a small n (4): the sums and the max are `fold`s, so the whole of it is one elementwise
    fusion.

    unroll=True (inference): straight-line code.
    unroll=False (training): a `fori_loop`, so the program (and its gradient) stays small: 20
    unrolled iterations at 2 sites x 12 layers, twice over for the backward pass, made the QA
    model's train step ~70K StableHLO lines, most of XLA:GPU's compile time."""
    e = jnp.exp(logits - fold(jnp.maximum, logits, -1))
    c = e / fold(jnp.add, e, -1) + eps
    c = c / (fold(jnp.add, c, -2) + eps)

    def body(_, c):
        c = c / (fold(jnp.add, c, -1) + eps)
        return c / (fold(jnp.add, c, -2) + eps)

    if unroll:
        for i in range(iters - 1):
            c = body(i, c)
        return c
    return jax.lax.fori_loop(0, iters - 1, body, c)


class HyperConnection(nnx.Module):
    """One mHC site (before attention or before the MoE)."""

    def __init__(self, n: int, d: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        self.fn = nnx.Param(jnp.zeros(((2 + n) * n, n * d), jnp.float32))
        self.base = nnx.Param(jnp.zeros(((2 + n) * n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.unroll_sinkhorn = True  # static; training sets False (see `sinkhorn`)

    def pre(self, x: jax.Array):
        """x [b, t, n, d] -> (u [b, t, d] block input, post [b, t, n], comb [b, t, n, n])."""
        n = self.n
        m = mix_logits(x, self.fn[...], self.norm_eps)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
        comb_logits = m[..., 2 * n:].reshape(*m.shape[:-1], n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = sinkhorn(comb_logits, self.iters, self.hc_eps, self.unroll_sinkhorn)
        u = jnp.einsum("btn,btnd->btd", pre, x.astype(jnp.float32)).astype(x.dtype)
        return u, post, comb

    @staticmethod
    def post(x: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
        """X'[k] = post_k * y + sum_j comb[j, k] X[j], in x's dtype as the reference does (its
        [n, n] x [n, d] matmul per token accumulates in fp32 and rounds once; so does this).
        The sum over the n streams is written out, so XLA can fuse it into one elementwise pass
        instead of a batched matmul of n-row operands per token: 1.79 vs 6.77 ms at 65536 rows
        on an H200, 81 % of copy bandwidth (`launch/bench_mhc.py`, docs/benchmarks.md)."""
        dt = x.dtype
        c, xf = comb.astype(dt).astype(jnp.float32), x.astype(jnp.float32)
        mixed = sum(c[..., j, :, None] * xf[..., j, None, :] for j in range(x.shape[-2]))
        return post.astype(dt)[..., None] * y[..., None, :] + mixed.astype(dt)


class HyperHead(nnx.Module):
    """Final collapse of the N streams (pre weights only, no Sinkhorn)."""

    def __init__(self, n: int, d: int, hc_eps: float, norm_eps: float):
        self.hc_fn = nnx.Param(jnp.zeros((n, n * d), jnp.float32))
        self.hc_base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        m = mix_logits(x, self.hc_fn[...], self.norm_eps)
        pre = jax.nn.sigmoid(m * self.hc_scale[...] + self.hc_base[...]) + self.hc_eps
        return jnp.einsum("btn,btnd->btd", pre, x.astype(jnp.float32)).astype(x.dtype)
