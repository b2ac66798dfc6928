"""Mixture of experts (spec §5): hash or learned router, clamped SwiGLU experts, shared expert.

Router: scores s = sqrt(softplus(W_g x)) (fp32); selection = top-k of s + bias (learned
layers) or tid2eid[token] (hash layers); weights = s[sel] / sum s[sel] * routed_scale.
Experts run as grouped matmuls over assignments sorted by expert, so only the chosen
experts' FLOPs are spent: `grouped_matmul` (beside the kernel, `pallas/ragged_dot.py`) walks
fixed-size row tiles, each tile inside one expert's group (at most rows/tile + experts tiles),
one dense matmul per tile. It replaces `jax.lax.ragged_dot`, its reference, which XLA runs 13x
slower than a dense matmul on an H200 (47 vs 624 TFLOP/s, `launch/bench_gmm_probe.py`,
2026-11-29). With `kernels="mosaic"` the three expert matmuls run as one Mosaic GPU
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
        kernels: the grouped matmuls by XLA ("xla") or the Mosaic GPU kernel ("mosaic")."""
        n, k = sel.shape
        eid = sel.reshape(-1)
        if keep is not None:
            eid = jnp.where(keep.reshape(-1), eid, self.e)  # dropped: sorted past every group
        order = jnp.argsort(eid, stable=True)
        tok = order // k
        sizes = jnp.bincount(eid, length=self.e + 1)[: self.e].astype(jnp.int32)
        xs = x[tok]
        if kernels == "mosaic":
            gmm = lambda a, w, **kw: ragged_dot_kernel(a, w, sizes, **kw)
        elif kernels != "xla":
            raise ValueError(f"MoE.experts: kernels must be 'xla' or 'mosaic', got {kernels!r}")
        elif n * k >= 64 * self.e:  # long chunks: tiled scan (a few dense tiles per expert)
            tile = self.tile(n * k)
            gmm = lambda a, w, **kw: grouped_matmul(a, w, sizes, tile, **kw)
        else:  # decode-sized: ragged_dot (the scan's per-tile launches dominate at a few rows;
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
