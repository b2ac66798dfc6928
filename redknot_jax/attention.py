"""DeepSeek-V4 attention block (spec §4): query path, shared K=V, sliding window, CSA/HCA
compressed entries, attention sink, inverse output RoPE, grouped output projection.

Long chunks are processed in query blocks (`lax.map`), so no [t, t] or [t, t/m, h] tensor
is built: a block sees its 128-row window band, the compressed entries (HCA: all, masked by
visibility; CSA: the indexer's top-k, gathered), and the sink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.compressor import Compressor
from redknot_jax.config import CSA, HCA, ModelConfig
from redknot_jax.indexer import TOPK_STAGES, Indexer, score_function, select_topk_causal
from redknot_jax.norms import RMSNorm, rms_norm
from redknot_jax.ring import ring_read, ring_write, scatter_rows
from redknot_jax.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST
NEG = -jnp.inf


def sink_softmax_attend(q, key_sets, sink, scale, masses: bool = False):
    """Softmax attention with a per-head sink logit over several key sets sharing K=V.

    q [b, t, h, k]; key_sets: list of (keys, mask, eq) where `eq` contracts q with keys to
    [b, t, h, s] and mask broadcasts to it; sink [h]. Returns (o [b, t, h, k] fp32,
    lse [b, t, h] fp32 including the sink), and with `masses` also the attention probability
    each key set received ([b, t, h] per set; with the sink's share they sum to 1). Rows with
    no visible key fall back to the sink alone (o = 0).
    """
    logits = []
    for keys, mask, eq in key_sets:
        lg = jnp.einsum(eq, q, keys, preferred_element_type=jnp.float32, precision=HIGHEST) * scale
        logits.append(jnp.where(mask, lg, NEG))
    sink = sink.astype(jnp.float32)[None, None, :]
    mx = jnp.maximum(jnp.max(jnp.concatenate(logits, -1), axis=-1), sink)  # [b, t, h]
    probs = [jnp.exp(lg - mx[..., None]) for lg in logits]
    denom = sum(jnp.sum(p, -1) for p in probs) + jnp.exp(sink - mx)
    o = 0.0
    for p, (keys, _, eq) in zip(probs, key_sets):
        lhs, rhs = eq.split("->")[0].split(",")
        out_eq = f"{eq.split('->')[1]},{rhs}->{lhs}"  # probs [b,t,h,s] x keys -> [b,t,h,k]
        o = o + jnp.einsum(out_eq, p.astype(keys.dtype), keys, preferred_element_type=jnp.float32,
                           precision=HIGHEST)
    if masses:
        return o / denom[..., None], mx + jnp.log(denom), [jnp.sum(p, -1) / denom for p in probs]
    return o / denom[..., None], mx + jnp.log(denom)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        d, h, k, q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
        eps = cfg.rms_norm_eps
        self.kind = cfg.layer_types[layer]
        self.wq_a = nnx.Param(jnp.zeros((q, d), dtype))
        self.q_norm = RMSNorm(q, eps)
        self.wq_b = nnx.Param(jnp.zeros((h * k, q), dtype))
        self.wkv = nnx.Param(jnp.zeros((k, d), dtype))
        self.kv_norm = RMSNorm(k, eps)
        self.wo_a = nnx.Param(jnp.zeros((cfg.o_groups * cfg.o_lora_rank, h * k // cfg.o_groups), dtype))
        self.wo_b = nnx.Param(jnp.zeros((d, cfg.o_groups * cfg.o_lora_rank), dtype))
        self.attn_sink = nnx.Param(jnp.zeros((h,), jnp.float32))
        compressor = indexer = None
        if self.kind == CSA:
            compressor = Compressor(d, k, cfg.csa_rate, overlap=True, eps=eps, dtype=dtype)
            indexer = Indexer(d, q, cfg.index_n_heads, cfg.index_head_dim, cfg.csa_rate, cfg.index_topk,
                              eps, dtype)
        elif self.kind == HCA:
            compressor = Compressor(d, k, cfg.hca_rate, overlap=False, eps=eps, dtype=dtype)
        self.compressor, self.indexer = nnx.data(compressor), nnx.data(indexer)
        self.h, self.k, self.g, self.o = h, k, cfg.o_groups, cfg.o_lora_rank
        self.window, self.eps = cfg.sliding_window, eps

    # ------------------------------------------------------------------ cache
    def init_cache(self, b: int, capacity: int, dtype) -> dict:
        c = {"win": jnp.zeros((b, self.window, self.k), dtype)}
        if self.compressor is not None:
            c["cmp"] = self.compressor.init_state(b)
            c["entries"] = jnp.zeros((b, capacity // self.compressor.m, self.k), dtype)
        if self.indexer is not None:
            c["idx"] = self.indexer.compressor.init_state(b)
            c["idx_entries"] = jnp.zeros((b, capacity // self.indexer.m, self.indexer.dim), dtype)
        return c

    # ------------------------------------------------------------------ pieces
    def query(self, x, pos, freqs):
        """(q [b, t, h, k] normalised and rotated, c_q [b, t, q]) (spec §4.1)."""
        b, t, _ = x.shape
        cq = self.q_norm(jnp.einsum("btd,qd->btq", x, self.wq_a[...], precision=HIGHEST))
        q = jnp.einsum("btq,cq->btc", cq, self.wq_b[...], precision=HIGHEST).reshape(b, t, self.h, self.k)
        q = rms_norm(q, None, self.eps)  # per-head, unweighted
        return apply_rope(q, pos, freqs), cq

    def latent(self, x, pos, freqs):
        """The shared K=V vector [b, t, k] (spec §4.2)."""
        kv = self.kv_norm(jnp.einsum("btd,kd->btk", x, self.wkv[...], precision=HIGHEST))
        return apply_rope(kv, pos, freqs)


    def wo_a_apply(self, o):
        """o [b, t, h, k] -> per-group projected state z [b, t, g, o]."""
        b, t = o.shape[:2]
        wa = self.wo_a[...].reshape(self.g, self.o, -1)
        return jnp.einsum("btgi,goi->btgo", o.reshape(b, t, self.g, -1), wa, precision=HIGHEST)

    def wo_b_apply(self, z):
        b, t = z.shape[:2]
        return jnp.einsum("btc,dc->btd", z.reshape(b, t, -1), self.wo_b[...], precision=HIGHEST)

    def _sparse_block(self, qb, pb, start, sel, ok, table, span, t, sink, scale):
        """A CSA query block by `pallas.sparse_attention`: per row its window (nearest first:
        ext rows w + start + r - j, real while the position is >= 0) and its top-k entries
        (entry e at ext length t + w + e), as ids into the batch-flattened `table` [b*span, k]."""
        from redknot_jax.pallas.sparse_attention import row_lists, sparse_attention

        b, tb = qb.shape[:2]
        w = self.window
        win = (w + start + jnp.arange(tb))[:, None] - jnp.arange(w)[None, :]  # [tb, w]
        base = (jnp.arange(b) * span)[:, None, None]
        win = jnp.broadcast_to(base + win[None], (b, tb, w))
        ent = base + t + w + sel
        idx, count = row_lists(win.reshape(b * tb, w), jnp.clip(pb + 1, 0, w).reshape(-1),
                               ent.reshape(b * tb, -1), jnp.sum(ok, -1).reshape(-1))
        o, _ = sparse_attention(qb.reshape(b * tb, self.h, self.k), table, idx, count, sink, scale=scale)
        return o.reshape(b, tb, self.h, self.k)

    # ------------------------------------------------------------------ forward
    def __call__(self, x, pos0, n_new, cache, freqs, block: int, trace: bool = False, kernels: str = "xla",
                 sparse: str = "xla", topk_stages: int = TOPK_STAGES, out=None):
        """x [b, t, d] (normed block input) at positions pos0 + [0, t), n_new real rows each.

        Returns (y [b, t, d], new cache), plus with `trace` a dict of intermediates the artifact
        producer keeps: `o` (head outputs after inverse RoPE [b, t, h, k]), `kv` (the rows'
        K=V latents [b, t, k]), `far` (each head's attention share on compressed entries, i.e.
        beyond the sliding window [b, t, h]; 0 in sliding layers) and for CSA `topk` (selected
        entry ids [b, t, K], -1 if none).
        Queries run in blocks of `block` rows (t % block == 0). `kernels`: the indexer's scores
        by XLA ("xla") or the Mosaic GPU kernel ("mosaic"; `indexer.score_function`). `sparse`:
        a CSA block's attention over its window and top-k keys by XLA (a gather, then
        `sink_softmax_attend`) or by `pallas.sparse_attention` ("mosaic"; not with `trace`,
        whose per-set attention masses only the XLA form gives). `topk_stages`: a CSA query
        block scores and selects over the shortest of that many entry prefixes that holds what
        it sees (`indexer.select_topk_causal`; 1: over every entry), when the call has several
        blocks. `out` (row0, rows): only rows [row0, row0 + rows) get queries and an output
        (y [b, rows, d]; row0 traced, a multiple of `block`; rows static, a multiple of it),
        every row still its keys, entries and cache; None: every row.
        """
        b, t, _ = x.shape
        w, m = self.window, None
        pos = pos0[:, None] + jnp.arange(t)
        row0, rows = (0, t) if out is None else out
        if out is not None and (trace or rows % block or rows > t):
            raise ValueError(f"attention: output rows {rows} must be a multiple of the block {block}, at most "
                             f"the call's {t} rows, and without trace")
        xo, po = (x, pos) if out is None else (jax.lax.dynamic_slice_in_dim(v, row0, rows, axis=1) for v in (x, pos))
        q, cq = self.query(xo, po, freqs)
        kv = self.latent(x, pos, freqs).astype(cache["win"].dtype)
        ext = jnp.concatenate([ring_read(cache["win"], pos0), kv], axis=1)  # positions pos0-w ..
        new = {"win": ring_write(ext, pos0 - w, pos0 + n_new, w)}

        if self.compressor is not None:
            m = self.compressor.m
            ent, ids, new["cmp"] = self.compressor(x, pos0, n_new, cache["cmp"], freqs)
            n_max = cache["entries"].shape[1]
            new["entries"] = scatter_rows(cache["entries"], jnp.where(ids < 0, n_max, ids), ent)
        if self.indexer is not None:
            ient, iids, new["idx"] = self.indexer.compressor(x, pos0, n_new, cache["idx"], freqs)
            n_max = cache["idx_entries"].shape[1]
            new["idx_entries"] = scatter_rows(cache["idx_entries"], jnp.where(iids < 0, n_max, iids), ient)
            iq, iw = self.indexer.queries(xo, cq, po, freqs)

        scale = self.k ** -0.5
        sink = self.attn_sink[...]
        # a CSA top-k that covers every entry selects every visible one: those are attended as
        # HCA's are (the same set, without scores, selection or gather; short contexts, and
        # the dense phase of training, quality/train.py)
        dense_csa = self.kind == CSA and self.indexer.topk >= new["idx_entries"].shape[1] and not trace
        kernel_csa = sparse == "mosaic" and self.kind == CSA and not trace and not dense_csa
        if kernel_csa:  # one packed table per sequence: window latents (ext), then the entries
            table = jnp.concatenate([ext, new["entries"]], axis=1)
            span = table.shape[1]
            table = table.reshape(b * span, self.k)

        nblk = rows // block

        def run_block(start):  # rows start .. start + block of the call
            qb = jax.lax.dynamic_slice_in_dim(q, start - row0, block, axis=1)
            pb = pos0[:, None] + start + jnp.arange(block)  # [b, tb]
            wk = jax.lax.dynamic_slice_in_dim(ext, start, block + w, axis=1)
            wp = pos0[:, None] - w + start + jnp.arange(block + w)
            wmask = ((wp[:, None, :] <= pb[:, :, None]) & (wp[:, None, :] > pb[:, :, None] - w)
                     & (wp[:, None, :] >= 0))[:, :, None, :]
            sets = [(wk, wmask, "bthk,bsk->bths")]
            picked = jnp.zeros((b, block, 0), jnp.int32)
            if self.kind == HCA or dense_csa:
                ents = new["entries"]
                vis = jnp.arange(ents.shape[1])[None, None, :] < ((pb + 1) // m)[..., None]
                sets.append((ents, vis[:, :, None, :], "bthk,bwk->bthw"))
            elif self.kind == CSA:
                ients = new["idx_entries"]
                iqb = jax.lax.dynamic_slice_in_dim(iq, start - row0, block, axis=1)
                iwb = jax.lax.dynamic_slice_in_dim(iw, start - row0, block, axis=1)
                vis = jnp.arange(ients.shape[1])[None, None, :] < ((pb + 1) // m)[..., None]
                kk = min(self.indexer.topk, ients.shape[1])
                sel, ok = select_topk_causal(score_function(kernels), iqb, iwb, ients, vis, kk,
                                             topk_stages if nblk > 1 else 1)
                if kernel_csa:
                    return self._sparse_block(qb, pb, start, sel, ok, table, span, t, sink, scale), \
                        jnp.where(ok, sel, -1)
                ents = jax.vmap(lambda e, s: e[s])(new["entries"], sel)  # [b, tb, kk, k]
                sets.append((ents, ok[:, :, None, :], "bthk,btwk->bthw"))
                picked = jnp.where(ok, sel, -1)
            if not trace:
                o, _ = sink_softmax_attend(qb, sets, sink, scale)
                return o.astype(x.dtype), picked
            o, _, mass = sink_softmax_attend(qb, sets, sink, scale, masses=True)
            far = sum(mass[1:]) if len(mass) > 1 else jnp.zeros_like(mass[0])
            return o.astype(x.dtype), picked, far

        if nblk == 1:
            res = run_block(row0)
        else:
            res = jax.lax.map(run_block, row0 + jnp.arange(nblk) * block)  # [nblk, b, tb, ...]
            res = tuple(jnp.moveaxis(r, 0, 1).reshape(b, rows, *r.shape[3:]) for r in res)
        o, picked = res[0], res[1]
        o = apply_rope(o, po, freqs, inverse=True)
        y = self.wo_b_apply(self.wo_a_apply(o))
        if trace:
            return y, new, {"o": o, "kv": kv, "topk": picked, "far": res[2]}
        return y, new
