"""Mixture of experts (spec §5): hash or learned router, clamped SwiGLU experts, shared expert.

Router: scores s = sqrt(softplus(W_g x)) (fp32); selection = top-k of s + bias (learned
layers) or tid2eid[token] (hash layers); weights = s[sel] / sum s[sel] * routed_scale.
Experts run as grouped matmuls over assignments sorted by expert, so only the chosen
experts' FLOPs are spent: `grouped_matmul` (beside the kernel, `pallas/ragged_dot.py`) walks
fixed-size row tiles, each tile inside one expert's group (at most rows/tile + experts tiles),
one dense matmul per tile. It replaces `jax.lax.ragged_dot`, its reference, which XLA runs 13x
slower than a dense matmul on an H200 (47 vs 624 TFLOP/s, `launch/bench_gmm_probe.py`,
2026-11-29): on a GPU, XLA's RaggedDotRewriter makes it a dense dot over every expert, so it also
reads all e experts' weights however few rows it has. A decode step's few rows, fewer assignments
than experts, therefore run each used expert once instead (`_experts_used`): every row through it,
weighted by its routing weight there, at most n * k experts' weights read (Flash's 256 experts:
6 of 256 for one row). With `kernels="mosaic"` the three expert matmuls run as one Mosaic GPU
grouped-matmul kernel each (`redknot_jax.pallas.ragged_dot`) instead: the scan's per-tile ops
were most of a long prefill layer's launches. An optional `keep` mask drops assignments (the
RedKnot fan-out rule) without renormalising the kept weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.config import ModelConfig
from redknot_jax.pallas.ragged_dot import grouped_matmul, ragged_dot as ragged_dot_kernel

HIGHEST = jax.lax.Precision.HIGHEST


class Buffer(nnx.Variable):
    """Non-trainable state loaded from the checkpoint (the hash table tid2eid)."""


def token_chunk(n_experts: int) -> int:
    """Tokens per grouped-matmul call at prefill: 4096, or 64 per routed expert when that is more
    (384 rows per expert at top 6), so each call reads every expert's weights for a few full
    tiles of work. One Flash-sized MoE layer over 16384 tokens with the ragged_dot kernel, H200,
    2026-12-01 (`launch/bench_moe.py`, docs/results/moe_chunk_h200.json): 256 experts 33.0 ms at
    4096 tokens -> 18.5 ms at 16384 (1.8x). 16 experts went 11.5 -> 10.6 ms, and stay at 4096:
    8 % of a MoE layer is not worth ~3 GB more transient memory at 128K, where the
    flash-shaped preset's HBM is tightest (that trade is judged, not measured)."""
    return max(4096, 64 * n_experts)


def swiglu(gate, up, limit):
    """SiLU(min(gate, L)) * clip(up, -L, L), in fp32."""
    gate = jnp.minimum(gate.astype(jnp.float32), limit)
    up = jnp.clip(up.astype(jnp.float32), -limit, limit)
    return jax.nn.silu(gate) * up


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_inter_dim
        self.is_hash = cfg.is_hash(layer)
        self.gate = nnx.Param(jnp.zeros((e, d), dtype))
        if self.is_hash:
            self.tid2eid = Buffer(jnp.zeros((cfg.vocab_size, cfg.experts_per_tok), jnp.int32))
        else:
            self.bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        # routed experts in x @ W layout, the layout ragged_dot takes: [e, in, out]
        self.w1 = nnx.Param(jnp.zeros((e, d, f), dtype))
        self.w3 = nnx.Param(jnp.zeros((e, d, f), dtype))
        self.w2 = nnx.Param(jnp.zeros((e, f, d), dtype))
        # shared expert in checkpoint layout [out, in]
        self.s1 = nnx.Param(jnp.zeros((f, d), dtype))
        self.s3 = nnx.Param(jnp.zeros((f, d), dtype))
        self.s2 = nnx.Param(jnp.zeros((d, f), dtype))
        self.k, self.e, self.scale, self.limit = cfg.experts_per_tok, e, cfg.routed_scaling_factor, cfg.swiglu_limit

    def tile(self, rows: int) -> int:
        """Row tile: about a group's mean size, a power of two in [8, 512]."""
        mean = max(1, rows // self.e)
        return int(min(512, max(8, 1 << (mean.bit_length() - 1))))

    def route(self, x, ids):
        """x [n, d], token ids [n] -> (experts [n, k] int32, weights [n, k] fp32, scores [n, e])."""
        logits = jnp.einsum("nd,ed->ne", x, self.gate[...], preferred_element_type=jnp.float32,
                            precision=HIGHEST)
        scores = jnp.sqrt(jax.nn.softplus(logits))
        if self.is_hash:
            sel = self.tid2eid[...][ids]
        else:
            _, sel = jax.lax.top_k(scores + self.bias[...], self.k)
        wts = jnp.take_along_axis(scores, sel, axis=-1)
        wts = wts / (jnp.sum(wts, -1, keepdims=True) + 1e-20)
        return sel.astype(jnp.int32), wts * self.scale, scores

    def experts(self, x, sel, wts, keep=None, kernels: str = "xla"):
        """Sum over kept assignments of w * expert(x): x [n, d], sel/wts/keep [n, k] -> [n, d] fp32.
        kernels: "xla" (by size: fewer assignments than experts, each used expert once; a few rows
        per expert, XLA's ragged_dot; longer chunks, the tiled scan), "mosaic" (the Mosaic GPU
        kernel), or "ragged" (`jax.lax.ragged_dot` at any size: the reference)."""
        if kernels not in ("xla", "mosaic", "ragged"):
            raise ValueError(f"MoE.experts: kernels must be 'xla', 'mosaic' or 'ragged', got {kernels!r}")
        n, k = sel.shape
        if kernels == "xla" and n * k < self.e:
            return self._experts_used(x, sel, wts, keep)
        eid = sel.reshape(-1)
        if keep is not None:
            eid = jnp.where(keep.reshape(-1), eid, self.e)  # dropped: sorted past every group
        order = jnp.argsort(eid, stable=True)
        tok = order // k
        sizes = jnp.bincount(eid, length=self.e + 1)[: self.e].astype(jnp.int32)
        xs = x[tok]
        if kernels == "mosaic":
            gmm = lambda a, w, **kw: ragged_dot_kernel(a, w, sizes, **kw)
        elif kernels == "xla" and n * k >= 64 * self.e:  # long chunks: tiled scan (a few dense tiles per expert)
            tile = self.tile(n * k)
            gmm = lambda a, w, **kw: grouped_matmul(a, w, sizes, tile, **kw)
        else:  # a few rows per expert: ragged_dot (the scan's per-tile launches dominate at a few rows;
            # measured 287 vs 33 ms per flash-shaped decode token on an H200, 2026-11-29)
            gmm = lambda a, w, **kw: jax.lax.ragged_dot(a, w, sizes, precision=HIGHEST, **kw)
        h = swiglu(gmm(xs, self.w1[...]), gmm(xs, self.w3[...]), self.limit)
        out = gmm(h.astype(x.dtype), self.w2[...], preferred_element_type=jnp.float32)
        # back to assignment order (a gather by the inverse permutation), then each token's
        # weighted sum over its k experts: one fused gather-reduce, no fp32 scatter-add
        # (dropped assignments: zero rows past the groups, and weight 0)
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
        w = wts if keep is None else jnp.where(keep, wts, 0.0)
        return jnp.sum(out[rank].reshape(n, k, -1) * w[..., None], axis=1)

    def _experts_used(self, x, sel, wts, keep=None):
        """`experts` for fewer assignments than experts (a decode step's few rows): each used
        expert's weights read once, every row through it, weighted by the row's routing weight
        for it (0 if it does not route there). On a GPU XLA's ragged_dot is a dense dot over
        every expert (its RaggedDotRewriter), which reads all e experts' weights for a few rows."""
        n, k = sel.shape
        w = wts if keep is None else jnp.where(keep, wts, 0.0)
        used = jnp.unique(sel if keep is None else jnp.where(keep, sel, self.e), size=n * k, fill_value=self.e)
        out = jnp.zeros(x.shape, jnp.float32)
        for e in used:  # unrolled (n * k < e): no device loop; padding entries (e = self.e) weigh 0
            pick = lambda v: jax.lax.dynamic_index_in_dim(v[...], jnp.minimum(e, self.e - 1), keepdims=False)
            h = swiglu(jnp.dot(x, pick(self.w1), precision=HIGHEST), jnp.dot(x, pick(self.w3), precision=HIGHEST),
                        self.limit)
            y = jnp.dot(h.astype(x.dtype), pick(self.w2), preferred_element_type=jnp.float32, precision=HIGHEST)
            out = out + y * jnp.sum(jnp.where(sel == e, w, 0.0), axis=1)[:, None]
        return out

    def shared(self, x):
        g = jnp.einsum("nd,fd->nf", x, self.s1[...], precision=HIGHEST)
        u = jnp.einsum("nd,fd->nf", x, self.s3[...], precision=HIGHEST)
        return jnp.einsum("nf,df->nd", swiglu(g, u, self.limit).astype(x.dtype), self.s2[...],
                          preferred_element_type=jnp.float32, precision=HIGHEST)

    def __call__(self, x, ids, keep_fn=None, chunk: int | None = None, with_keep: bool = False,
                 kernels: str = "xla"):
        """x [b, t, d], ids [b, t] -> [b, t, d]. Tokens are processed `chunk` at a time (default
        `token_chunk` of the expert count); `kernels` as in `experts`.

        keep_fn(sel, wts, scores) -> keep mask [n, k] or None (fan-out trimming). With
        `with_keep`, also returns the mask applied, [b, t, k] (all True without keep_fn).
        """
        b, t, d = x.shape
        xf, idf = x.reshape(b * t, d), ids.reshape(b * t)

        def run(xc, ic):
            sel, wts, scores = self.route(xc, ic)
            keep = None if keep_fn is None else keep_fn(sel, wts, scores)
            y = (self.experts(xc, sel, wts, keep, kernels) + self.shared(xc)).astype(x.dtype)
            return y, jnp.ones(sel.shape, bool) if keep is None else keep

        n, chunk = b * t, chunk or token_chunk(self.e)
        if n <= chunk:
            y, keep = run(xf, idf)
        else:
            pad = (-n) % chunk
            xp = jnp.pad(xf, ((0, pad), (0, 0))).reshape(-1, chunk, d)
            ip = jnp.pad(idf, (0, pad)).reshape(-1, chunk)
            y, keep = jax.lax.map(lambda a: run(*a), (xp, ip))
            y, keep = y.reshape(-1, d)[:n], keep.reshape(n + pad, -1)[:n]
        y = y.reshape(b, t, d)
        return (y, keep.reshape(b, t, -1)) if with_keep else y
