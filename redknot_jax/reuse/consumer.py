"""The RedKnot consumer (DESIGN §4, §7): both arms jitted per layer, query-blocked, at serving
scale. `runtime.py` is the eager reference it is tested against (tests/reuse/test_consumer.py).
It reads the documents through a `DocPool` (`pool.py`: hot artifacts packed once per reusable
layer, never copied or rewritten by a request) and a request's `Layout` (`layout.py`: index
tables saying where each row's keys, entries and z_L come from). `Consumer` holds per-layer
jitted functions: layers with equal structure share one compiled program (the nnx graph
definition is a static argument), so the 43-layer flash stack compiles a few layer programs
instead of one unrolled program.

A reusable layer: mHC, norm, `wq_a` for every row; latents and compressor projections for
the own rows only (new, refreshed, and rows an online entry pools: `layout`), every other row's
K=V and entries read from the pool; **pass A** runs the Global heads of every
row (own frame's window, the artifact's document-local CSA top-k, every visible HCA entry);
**pass B** runs every head of the protected rows over the native key sets (the native indexer
across frames); z = z_G + z_L with z_L read from the pool for unprotected document rows, the
protected rows' projected state **replaces** theirs (never added); `wo_b` once; mHC; MoE with
the fan-out rule.

Relocation in this XLA path: a frame's canonical keys are turned by R(D) while they are read
(the orthogonal twin of turning the query by R(-D): <R(-D) q, k> = <q, R(D) k>), so the
output needs no phase restore before the native inverse output RoPE. The artifact itself is
never written. (`pallas/seg_attention.py` rotates queries per segment instead: a decode step's
HCA layers run it when the kernel set names it, `_decode_segments`, reading the pool's entries
in place; docs/kernels.md says why prefill turns keys. Both are tested against the
reference's rotated-query form. Pass B's CSA blocks run `pallas/sparse_attention.py` when the kernel set names it: per row
a list of key ids into one table of the request's absolute-frame latents and entries; pass A's
too, when it names "sparse_global", its Global heads padded to the kernel's 64.)

An exact prefix (`Plan.prefix`, DESIGN §4) is computed in no layer of the RedKnot arm: only the
rows after it are embedded and run; a fence reads the prefix's native cache from its artifact
(`prefix.native_cache`) and runs those rows as one chunk after it; a reusable layer reads the
prefix's keys, entries and open windows from the pool like any document's.

Sections below: layer math (pass A / pass B, restoration, decode attention), jitted layers,
and `Consumer`: pieces, the arms (`recompute`, `prefix`, `redknot`, `decode_step`; `layer_times`
/ `layer_traces` profile runs through `_LayerClock`), batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Sequence

import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx

from redknot_jax.attention import sink_softmax_attend
from redknot_jax.config import CSA, HCA
from redknot_jax.indexer import TOPK_STAGES, index_scores, score_function, select_topk_causal
from redknot_jax.mhc import HyperConnection
from redknot_jax.model import block_jit
from redknot_jax.norms import rms_norm
from redknot_jax.pallas import DECODE_ONLY, kernel_mode, resolve_kernels
from redknot_jax.pallas.restore import restore_reference
from redknot_jax.pallas.restore import restore as restore_kernel
from redknot_jax.pallas.seg_attention import Segment, seg_attention
from redknot_jax.pallas.sparse_attention import HEADS as SPARSE_HEADS
from redknot_jax.pallas.sparse_attention import row_lists, sparse_attention
from redknot_jax.reuse import codec
from redknot_jax.reuse.arena import DocArena
from redknot_jax.reuse.artifact import local_head_mask
from redknot_jax.reuse.fanout import fanout_keep
from redknot_jax.reuse.layout import NEVER, build_layout, common_sizes, frame_rows
from redknot_jax.reuse.planner import Plan, concentration, fill_itop, latent_deviation, row_risk
from redknot_jax.reuse.pool import ENTRY_PAD, Buckets, DocPool, HostPool, ceil_to
from redknot_jax.reuse.prefix import native_cache, prefix_check
from redknot_jax.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------- layer math
def _pooled(comp, proj_kv, proj_gate, ring, slots, w, freqs, own_slot=None):
    """Canonical entries [n, dk] (zero where every slot is empty) pooled from slots [n, r]:
    request rows' projections (< t), then the artifact's boundary ring; window index w [n].
    `own_slot` (a layout's [t] table): the projections are a decode state's compact rows, not
    the request's, so a request-row slot reads row own_slot[slot] of them; a row with none (a
    padding row, never written) is an empty slot."""
    srcs_kv = jnp.concatenate([proj_kv, ring["kv"]]) if ring is not None else proj_kv
    srcs_gate = jnp.concatenate([proj_gate, ring["gate"]]) if ring is not None else proj_gate
    ok = slots >= 0
    if own_slot is not None:  # request rows (< t) -> compact rows; ring slots follow those
        t = own_slot.shape[0]
        slots = jnp.where(slots >= t, slots - t + proj_kv.shape[0], own_slot[jnp.clip(slots, 0, t - 1)])
        ok = ok & (slots >= 0)
    sk = srcs_kv[jnp.maximum(slots, 0)]  # [n, r, c*dk]
    sg = jnp.where(ok[..., None], srcs_gate[jnp.maximum(slots, 0)], -jnp.inf)
    m, dk = comp.m, comp.dk
    if comp.overlap:  # A halves of window w-1 (first m slots), B halves of window w
        kv = jnp.concatenate([sk[:, :m, :dk], sk[:, m:, dk:]], axis=1)
        gate = jnp.concatenate([sg[:, :m, :dk], sg[:, m:, dk:]], axis=1)
    else:
        kv, gate = sk, sg
    ent = comp.pool(kv[None], gate[None], w[None], freqs)[0]  # canonical RoPE at w*m
    return jnp.where(ok.any(1)[:, None], ent, 0.0)


def _entries(pool_entries, tab, on_ents, E, dk, freqs):
    """Request entries [E, dk] (fp32) in absolute coordinates: pool entries turned by R(D) as
    they are read, then the online entries `on_ents` [E_on, dk] (absolute already) in place."""
    out = jnp.zeros((E, dk), jnp.float32)
    if pool_entries is not None:
        src = tab["src"]
        pe = apply_rope(pool_entries[jnp.maximum(src, 0)].astype(jnp.float32), tab["d"], freqs)
        out = jnp.where((src >= 0)[:, None], pe, out)
    return out.at[tab["on_idx"]].set(on_ents.astype(jnp.float32), mode="drop")


def _online(comp, proj_kv, proj_gate, ring, tab, freqs, own_slot=None):
    """The request's online entries [E_on, dk], pooled from their slots (`_pooled`) and turned
    by R(D) into absolute coordinates."""
    e = jnp.minimum(tab["on_idx"], tab["src"].shape[0] - 1)
    ent = _pooled(comp, proj_kv, proj_gate, ring, tab["on_slots"], tab["w"][e], freqs, own_slot)
    return apply_rope(ent, tab["d"][e], freqs)


def _renew_entries(comp, proj_kv, proj_gate, ring, tab, rows, freqs, own_slot, on_ents):
    """A decode state's online entries `on_ents` [E_on, dk] (absolute) with those whose
    windows hold `rows` pooled again from the compact rows (an unfinished window's entry is not
    visible yet; the row that finishes it writes its final value)."""
    E, E_on = tab["src"].shape[0], on_ents.shape[0]
    j = tab["row_on"][rows]  # E_on: no online entry (dropped)
    jc = jnp.minimum(j, E_on - 1)
    e = jnp.minimum(tab["on_idx"][jc], E - 1)
    ent = _pooled(comp, proj_kv, proj_gate, ring, tab["on_slots"][jc], tab["w"][e], freqs, own_slot)
    return on_ents.at[j].set(apply_rope(ent, tab["d"][e], freqs).astype(on_ents.dtype), mode="drop")


def _pass_a(q, tab, kv_abs, ents, sink, scale, kind, block, window, csa_ids, sparse: bool = False):
    """Global heads of every row: own frame's window, document-local top-k, visible HCA.
    `sparse` (CSA): by `pallas.sparse_attention` over one table of the request's latents and
    entries, the heads padded to the kernel's 64 (zero queries, outputs dropped): the kernel
    reads each key in place where XLA gathers a [block, top-k, k] tensor, and its time is the
    gather's, not the padded heads' products."""
    t = q.shape[0]
    if sparse and kind == CSA:
        return _pass_a_sparse(q, tab, kv_abs, ents, sink, scale, block, window, csa_ids)
    pad = jnp.zeros((window, kv_abs.shape[1]), kv_abs.dtype)
    ext = jnp.concatenate([pad, kv_abs])
    ext_frame = jnp.concatenate([jnp.full((window,), -1, jnp.int32), tab["key_frame"]])
    p0 = tab["pos"][0]  # the computed rows are key rows p0 .. p0 + t - 1

    def run(start):
        qb = jax.lax.dynamic_slice_in_dim(q, start, block)
        pb = p0 + start + jnp.arange(block)
        fb = jax.lax.dynamic_slice_in_dim(tab["frame"], start, block)
        wk = jax.lax.dynamic_slice_in_dim(ext, p0 + start, block + window)
        wf = jax.lax.dynamic_slice_in_dim(ext_frame, p0 + start, block + window)
        wp = p0 + start - window + jnp.arange(block + window)
        wm = (wp[None] <= pb[:, None]) & (wp[None] > pb[:, None] - window) & (wf[None] == fb[:, None])
        sets = [(wk[None], wm[None, :, None, :], "bthk,bsk->bths")]
        if kind == HCA:
            e, end = ents
            sets.append((e[None].astype(q.dtype), (end[None] <= pb[:, None])[None, :, None, :], "bthk,bwk->bthw"))
        elif kind == CSA:
            e, end = ents
            ids = jax.lax.dynamic_slice_in_dim(csa_ids, start, block)
            safe = jnp.maximum(ids, 0)
            ok = (ids >= 0) & (end[safe] <= pb[:, None])
            sets.append((e[safe][None].astype(q.dtype), ok[None, :, None, :], "bthk,btwk->bthw"))
        o, _ = sink_softmax_attend(qb[None], sets, sink, scale)
        return o[0].astype(q.dtype)

    n = t // block
    o = run(0) if n == 1 else jax.lax.map(run, jnp.arange(n) * block).reshape(t, *q.shape[1:])
    return o


def _frame_first(key_frame, frame):
    """Each computed row's frame's first key row, from the frame index per key row
    (nondecreasing) and per computed row."""
    return jnp.searchsorted(key_frame, frame, side="left").astype(jnp.int32)


def _pass_a_sparse(q, tab, kv_abs, ents, sink, scale, block, window, csa_ids):
    """`_pass_a` of a CSA layer by the gathered-key kernel. Per row its key list: the window rows
    of its own frame (positions p - j, j < min(window, p - frame start + 1), nearest first),
    then its document-local top-k entries (valid first, as the artifact's picks are stored)."""
    t, nh, _ = q.shape
    T = kv_abs.shape[0]
    table = jnp.concatenate([kv_abs, ents[0].astype(kv_abs.dtype)])
    end = ents[1]
    first = _frame_first(tab["key_frame"], tab["frame"])
    qp = jnp.pad(q, ((0, 0), (0, SPARSE_HEADS - nh), (0, 0)))
    sp = jnp.pad(sink, (0, SPARSE_HEADS - nh))

    def run(start):
        qb = jax.lax.dynamic_slice_in_dim(qp, start, block)
        pb = jax.lax.dynamic_slice_in_dim(tab["pos"], start, block)
        fb = jax.lax.dynamic_slice_in_dim(first, start, block)
        ids = jax.lax.dynamic_slice_in_dim(csa_ids, start, block)
        safe = jnp.maximum(ids, 0)
        ok = (ids >= 0) & (end[safe] <= pb[:, None])
        win = pb[:, None] - jnp.arange(window)[None, :]
        idx, count = row_lists(win, jnp.clip(pb - fb + 1, 0, window), T + safe, jnp.sum(ok, -1))
        return sparse_attention(qb, table, idx, count, sp, scale=scale)[0][:, :nh]

    n = t // block
    return run(0) if n == 1 else jax.lax.map(run, jnp.arange(n) * block).reshape(t, *q.shape[1:])


def _pass_b(q, pos, window_keys, ents, idx, sink, scale, kind, block, window, topk, scores=index_scores,
            kv_abs=None, stages: int = TOPK_STAGES):
    """Every head of the protected rows over the native key sets (indexer across frames;
    `scores`: `index_scores` or its kernel, `indexer.score_function`; `stages`: the selection's
    entry prefixes, `indexer.select_topk_causal`, used when there are several blocks). `window_keys(kp)`: the
    absolute-frame K=V of request rows kp (>= 0; others are masked). `kv_abs` (every row's,
    given only when the kernel set names it): a CSA layer's attention by
    `pallas.sparse_attention` over one table of the request's latents and entries."""
    P = q.shape[0]
    sparse = kv_abs is not None and kind == CSA
    if sparse:
        table = jnp.concatenate([kv_abs, ents[0].astype(kv_abs.dtype)])

    n = P // block

    def run(start):
        qb = jax.lax.dynamic_slice_in_dim(q, start, block)
        pb = jax.lax.dynamic_slice_in_dim(pos, start, block)
        kp = pb[:, None] - window + 1 + jnp.arange(window)  # window keys: positions = rows
        wk = window_keys(kp)
        sets = [(wk[None], (kp >= 0)[None, :, None, :], "bthk,btsk->bths")]
        if kind == HCA:
            e, end = ents
            sets.append((e[None].astype(q.dtype), (end[None] <= pb[:, None])[None, :, None, :], "bthk,bwk->bthw"))
        elif kind == CSA:
            e, end = ents
            iq, iw, ikeys = idx
            iqb = jax.lax.dynamic_slice_in_dim(iq, start, block)
            iwb = jax.lax.dynamic_slice_in_dim(iw, start, block)
            vis = (end[None] <= pb[:, None])[None]
            k = min(topk, e.shape[0])
            sel, ok = select_topk_causal(scores, iqb[None], iwb[None], ikeys[None], vis, k, stages if n > 1 else 1)
            if sparse:  # window positions nearest first (real while >= 0), then the entries
                win = pb[:, None] - jnp.arange(window)[None, :]
                ids, count = row_lists(win, jnp.clip(pb + 1, 0, window),
                                       kv_abs.shape[0] + sel[0], jnp.sum(ok[0], -1))
                return sparse_attention(qb, table, ids, count, sink, scale=scale)[0]
            sets.append((e[sel[0]][None].astype(q.dtype), ok[:, :, None, :], "bthk,btwk->bthw"))
        o, _ = sink_softmax_attend(qb[None], sets, sink, scale)
        return o[0].astype(q.dtype)

    return run(0) if n == 1 else jax.lax.map(run, jnp.arange(n) * block).reshape(P, *q.shape[1:])


def reusable_layer(blk, x, ids, tab, pool_layer, *, freqs, glob, block, fan, reduce=None, ffn=None,
                   kernels: str = "", topk_stages: int = TOPK_STAGES, ffn_rows: str = "run"):
    """One reusable layer of the RedKnot arm over the request rows (see the module doc).

    Under tensor parallelism (`redknot_jax.sharding.consumer_tp`) the block holds a rank's
    heads / groups / experts, `reduce` sums the row-parallel `wo_b` output over ranks and
    `ffn(x, ids, keep_fn) -> (x, keep)` is the rank's MoE half; by default both are local.
    `ffn_rows`: the profile's; "omit" / "restore" run the MoE over the protected rows only
    (`ffn_args`)."""
    x = reusable_attention(blk, x, tab, pool_layer, freqs=freqs, glob=glob, block=block, reduce=reduce,
                           kernels=kernels, topk_stages=topk_stages)
    return reusable_ffn(blk, x, ids, tab["pos"] < tab["n_real"], fan, ffn, kernels,
                        **ffn_args(ffn_rows, tab, pool_layer))


def ffn_args(ffn_rows: str, tab, pool_layer) -> dict:
    """`reusable_ffn`'s row arguments for the profile's `ffn_rows` over a layout `tab` (one
    request's, or a batch's stacked on a leading axis): "run" none (every row runs the MoE);
    "omit" rows = the protected rows; "restore" also the artifact's canonical FFN outputs of
    the restored rows (`zl_row`: unprotected document rows; zero elsewhere)."""
    if ffn_rows == "run":
        return {}
    if ffn_rows == "omit":
        return {"rows": tab["prot_idx"]}
    if "ffn" not in pool_layer:
        raise ValueError("ffn_rows='restore': the pool holds no canonical FFN outputs (artifacts built "
                         "under a profile without ffn_rows='restore')")
    zr = tab["zl_row"]
    y = codec.decode(pool_layer["ffn"], codec.produced_dtype(pool_layer))[jnp.maximum(zr, 0)]
    return {"rows": tab["prot_idx"], "restored": jnp.where((zr >= 0)[..., None], y, 0)}


def reusable_ffn(blk, x, ids, real, fan, ffn=None, kernels: str = "", rows=None, restored=None,
                 per_request: bool = False):
    """The MoE half of a reusable layer with the fan-out rule: (x, histogram of kept experts
    over the `real` rows [.., t] that ran it). `kernels`: the resolved set (its "ragged_dot"),
    local MoE only. `rows` ([P] or [b, P] row indices, padded with t; `ffn_args`): only those
    rows run the MoE, gathered (physical token-row omission); every other row's streams pass
    the FFN sub-layer unchanged ("omit") or, given `restored` ([.., t, d]: the artifact's
    canonical FFN outputs), take them through the native mHC post/comb ("restore").
    `per_request`: the histogram per request of a batch x [b, t, ...], [b, k+1]."""
    keep_fn = lambda sel, wts, scores: fanout_keep(wts, fan[0], fan[1], fan[2])
    run = (lambda xx, ii: blk.ffn_residual(xx, ii, keep_fn, with_keep=True, kernels=kernels)) if ffn is None \
        else (lambda xx, ii: ffn(xx, ii, keep_fn))
    real = jnp.broadcast_to(real, x.shape[:2])
    if rows is None:
        x, keep = run(x, ids)
    else:
        b, t = x.shape[:2]
        rows = jnp.broadcast_to(rows, (b, rows.shape[-1]))
        rc = jnp.minimum(rows, t - 1)
        xs, keep = run(jnp.take_along_axis(x, rc[:, :, None, None], 1), jnp.take_along_axis(ids, rc, 1))
        if restored is not None:
            _, post, comb = blk.hc_ffn.pre(x)
            x = HyperConnection.post(x, jnp.broadcast_to(restored, x.shape[:2] + x.shape[-1:]).astype(x.dtype),
                                     post, comb)
        x = x.at[jnp.arange(b)[:, None], rows].set(xs, mode="drop")
        real = jnp.take_along_axis(real, rc, 1) & (rows < t)
    count = lambda kk, rr: jnp.zeros((keep.shape[-1] + 1,), jnp.int32).at[kk].add(rr.astype(jnp.int32))
    kept = jnp.sum(keep, -1)
    if per_request:
        return x, jax.vmap(count)(kept.reshape(kept.shape[0], -1), real)
    return x, count(kept.reshape(-1), real.reshape(-1))


def _queries(attn, cq, heads, pos, freqs):
    """Queries of the chosen heads from the rows' compressed queries cq [t, q], RoPE at pos."""
    wq = attn.wq_b[...].reshape(attn.h, attn.k, -1)
    qq = jnp.einsum("tq,hkq->thk", cq, wq[heads], precision=HIGHEST)
    return apply_rope(rms_norm(qq, None, attn.eps), pos, freqs)


def _request_entries(attn, proj, tab, pool_layer, freqs):
    """The request's compressed entries (and for CSA its indexer keys) from the own rows'
    compressor projections `proj` {"pk", "pg"[, "ik", "ig"]} ([K, .] each, `layout` module doc),
    the pool and the entry table: ((entries [E, k], last positions [E]), indexer keys [E, .] or
    None)."""
    kind = attn.kind
    rt = tab["rates"]["csa" if kind == CSA else "hca"]
    E = rt["src"].shape[0]
    full = lambda comp, a, b, ring, pool_name: _entries(
        pool_layer.get(pool_name), rt,
        _online(comp, proj[a], proj[b], pool_layer.get(ring), rt, freqs, tab["own_slot"]), E, comp.dk, freqs)
    ents = (full(attn.compressor, "pk", "pg", "cmp", "entries"), rt["end"])
    idx_keys = full(attn.indexer.compressor, "ik", "ig", "idx", "idx_entries") if kind == CSA else None
    return ents, idx_keys


def _projections(attn, xa, cpos) -> dict:
    """Compressor (and CSA indexer-compressor) projections of rows xa [t, d] at canonical cpos."""
    pk, pg = attn.compressor.project(xa[None], cpos[None])
    out = {"pk": pk[0], "pg": pg[0]}
    if attn.kind == CSA:
        ik, ig = attn.indexer.compressor.project(xa[None], cpos[None])
        out.update(ik=ik[0], ig=ig[0])
    return out


def reusable_attention(blk, x, tab, pool_layer, *, freqs, glob, block, reduce=None, keep_rows=None,
                       kernels: str = "", topk_stages: int = TOPK_STAGES):
    """The attention half of a reusable layer (passes A and B, z_L restore, `wo_b` once, mHC
    post) over one request's computed rows x [1, C, n, d] (the rows after its exact prefix,
    `tab["pos"]`; the prefix's keys, entries and open windows are the pool's). Latents and
    compressor projections are computed for the own rows only (`tab["own_idx"]`, `layout`);
    every other row's are the pool's. With `keep_rows` ([R] compact rows, i.e. indices into
    the own rows, padded past them) also what decoding reads later of those rows
    (`DecodeState`): their canonical K=V and compressor projections, R rows (a row past the own
    rows reads the last). `kernels`: which
    Mosaic GPU kernels run instead of their references ("restore", "indexer" for pass B's scores;
    `Consumer`'s resolved set). `topk_stages`: pass B's CSA selection over entry prefixes
    (`indexer.select_topk_causal`; 1 under `vmap`)."""
    attn = blk.attn
    t = x.shape[1]
    h, k, g, w = attn.h, attn.k, attn.g, attn.window
    pool_layer = codec.dense(pool_layer)  # dequantised here, inside the layer's program (fused into its reads)
    u, post, comb = blk.hc_attn.pre(x)
    xa = blk.attn_norm(u)[0]  # [t, d]
    pos, d_row = tab["pos"], tab["d"]
    cpos = pos - d_row
    cq = attn.q_norm(jnp.einsum("td,qd->tq", xa, attn.wq_a[...], precision=HIGHEST))
    queries = lambda c, heads, p: _queries(attn, c, heads, p, freqs)

    # keys (every key row): canonical pool latent or the own rows' online latent at the
    # canonical position, turned by R(D)
    oi = tab["own_idx"]
    oc = jnp.minimum(oi, t - 1)
    xo, co = xa[oc], cpos[oc]
    kv_on = attn.latent(xo[None], co[None], freqs)[0]  # [K]
    ar = tab["art_row"]
    T = ar.shape[0]
    on = jnp.zeros((T,) + kv_on.shape[1:], kv_on.dtype).at[jnp.where(oi < t, pos[oc], T)].set(kv_on, mode="drop")
    kv = jnp.where((ar >= 0)[:, None], pool_layer["kv"][jnp.maximum(ar, 0)].astype(kv_on.dtype), on)
    kv_abs = apply_rope(kv, tab["key_d"], freqs)

    kind = attn.kind
    ents = idx_keys = proj = None
    if kind in (CSA, HCA):
        proj = _projections(attn, xo, co)
        ents, idx_keys = _request_entries(attn, proj, tab, pool_layer, freqs)
    scale, sink = k ** -0.5, attn.attn_sink[...]

    # pass A: Global heads of every row
    zr = tab["zl_row"]
    csa_ids = None
    if kind == CSA:
        local_ids = pool_layer["topk"][jnp.maximum(zr, 0)]  # document-local entry ids [t, K]
        rt = tab["rates"]["csa"]
        csa_ids = jnp.where((zr >= 0)[:, None] & (local_ids >= 0), rt["ebase"][pos][:, None] + local_ids, -1)
    q_g = queries(cq, glob, pos)
    o_g = _pass_a(q_g, tab, kv_abs, ents, sink[glob], scale, kind, block, w, csa_ids,
                  sparse=kernel_mode(kernels, "sparse_global") == "mosaic")
    o_g = apply_rope(o_g, pos, freqs, inverse=True)

    # pass B: every head of the protected rows, native key sets; their z replaces the row's
    pi = tab["prot_idx"]
    pic = jnp.minimum(pi, t - 1)
    pp = pos[pic]
    q_p = queries(cq[pic], np.arange(h), pp)
    idx = None
    if kind == CSA:
        iq, iw = attn.indexer.queries(xa[pic][None], cq[pic][None], pp[None], freqs)
        idx = (iq[0], iw[0], idx_keys)
    o_p = _pass_b(q_p, pp, lambda kp: kv_abs[jnp.clip(kp, 0, T - 1)], ents, idx, sink, scale, kind, block, w,
                  attn.indexer.topk if kind == CSA else 0, score_function(kernel_mode(kernels, "indexer")),
                  kv_abs=kv_abs if kernel_mode(kernels, "sparse_attention") == "mosaic" else None,
                  stages=topk_stages)
    o_p = apply_rope(o_p, pp, freqs, inverse=True)
    z_p = attn.wo_a_apply(o_p[None])[0].astype(o_g.dtype)

    # restoration: the Global heads' columns of wo_a, plus z_L from the pool on restored rows,
    # protected rows replaced by z_p (pallas/restore.py: the kernel or its XLA reference)
    gl = tuple(int(j) for j in (np.asarray(glob) % (h // g))[: len(glob) // g])
    restore_fn = restore_kernel if kernel_mode(kernels, "restore") == "mosaic" else restore_reference
    z = restore_fn(o_g.reshape(t, g, len(gl), k), attn.wo_a[...], pool_layer["zl"], zr, z_p, pi,
                   global_heads=gl)

    y = attn.wo_b_apply(z[None])
    if reduce is not None:
        y = reduce(y)
    out = HyperConnection.post(x, y.astype(x.dtype), post, comb)
    if keep_rows is not None:
        kr = jnp.minimum(keep_rows, oi.shape[0] - 1)
        return out, {"kv": kv_on[kr], **{n: v[kr] for n, v in (proj or {}).items()}}
    return out


class _LayerClock:
    """Per-layer wall time for a profile run: when given a list, waits for each layer's output
    (which serialises host and device, so only profile runs pass one) and appends its seconds.
    `traces` (directory, layer indices): those layers also run inside a `jax.profiler` trace of
    their own, `directory/layer_NN` (started once the previous layer is done, stopped once this
    one is: the trace holds that layer's work only; `redknot_jax.op_profile` summarises it)."""

    def __init__(self, times: list | None, x, traces: tuple[str, Sequence[int]] | None = None):
        if traces is not None and times is None:
            raise ValueError("layer traces are taken in a profile run: pass layer_times too")
        self.times, self.i = times, 0
        self.dir, self.traced = (traces[0], set(traces[1])) if traces is not None else (None, set())
        if times is not None:
            jax.block_until_ready(x)
            self._start()

    def _start(self) -> None:
        if self.i in self.traced:
            jax.profiler.start_trace(os.path.join(self.dir, f"layer_{self.i:02d}"))
        self.t0 = time.perf_counter()

    def lap(self, x) -> None:
        if self.times is not None:
            jax.block_until_ready(x)
            self.times.append(time.perf_counter() - self.t0)
            if self.i in self.traced:
                jax.profiler.stop_trace()
            self.i += 1
            self._start()


def decode_entries(attn, keys, tab, pool_layer, *, freqs) -> dict:
    """A decode state's layer `keys` (compact rows) with the request's online compressed
    entries added, pooled once from them over the decode layout `tab` (absolute frame): "ents"
    [E_on, k] in the latent's dtype, the attention's, and for CSA "ikeys" (the indexer's). A
    step reads the pool's entries as it needs them and renews only the online entries of the
    windows its rows fall in."""
    if attn.kind not in (CSA, HCA):
        return keys
    rt = tab["rates"]["csa" if attn.kind == CSA else "hca"]
    online = lambda comp, a, b, ring: _online(comp, keys[a], keys[b], pool_layer.get(ring), rt, freqs,
                                              tab["own_slot"])
    out = {**keys, "ents": online(attn.compressor, "pk", "pg", "cmp").astype(keys["kv"].dtype)}
    if attn.kind == CSA:
        out["ikeys"] = online(attn.indexer.compressor, "ik", "ig", "idx")
    return out


def _decode_segment_args(q, pos, wk, wvalid, on_ents, rt, pool_entries, sink, scale, freqs, m):
    """The arguments of `pallas.seg_attention` for a decode step's HCA attention
    (`_decode_segments`): (positional, keyword)."""
    g, (W, k) = q.shape[0], wk.shape[1:]
    E, oi = rt["src"].shape[0], rt["on_idx"]
    on_valid = (oi[None] < E) & (rt["end"][jnp.minimum(oi, E - 1)][None] <= pos[:, None])  # [g, E_on]
    gk = jnp.concatenate([wk, jnp.broadcast_to(on_ents[None].astype(wk.dtype), (g,) + on_ents.shape)], 1)
    valid = jnp.concatenate([wvalid, on_valid], 1)
    order = jnp.argsort(~valid, axis=1, stable=True)  # valid first: the segment is [0, count)
    gk = jnp.take_along_axis(gk, order[..., None], 1)
    count = jnp.sum(valid, 1).astype(jnp.int32)
    G = gk.shape[1]
    if pool_entries is None:  # no document entry at this rate: the runs are all empty
        pool_entries = jnp.zeros((8, k), gk.dtype)
    # entry w of a run is visible once its window closes: d + (w + 1) m - 1 <= pos
    vis = jnp.clip((pos[:, None] - rt["run_d"][None] + 1) // m - rt["run_w"][None], 0, rt["run_n"][None])
    first = jnp.arange(g, dtype=jnp.int32)[:, None] * G
    lo = jnp.concatenate([jnp.broadcast_to(rt["run_src"][None], vis.shape), first], 1)
    hi = jnp.concatenate([rt["run_src"][None] + vis, first + count[:, None]], 1)
    segs = (Segment(0, pool_entries.shape[0]),) * vis.shape[1] + (Segment(0, g * G, src=1),)
    offs = jnp.concatenate([rt["run_d"], jnp.zeros(1, jnp.int32)])
    return ((q.astype(gk.dtype), pool_entries.astype(gk.dtype), segs, offs, lo, hi, sink, freqs),
            {"scale": scale, "gkeys": gk.reshape(g * G, k)})


def _decode_segments(q, pos, wk, wvalid, on_ents, rt, pool_entries, sink, scale, freqs, m, config=None):
    """A decode step's HCA attention by the relocated segment attention kernel
    (`pallas/seg_attention.py`), for new rows at positions pos [g]: the documents' entries are
    read canonical, in place in the pool, one segment per run of pool entries
    (`layout.pool_runs`), each at its frame's offset D (the kernel turns the queries by R(-D)
    and the partial output back); the run's visible entries are a prefix. The window rows wk
    [g, W, k] (`wvalid` [g, W]) and the online entries on_ents [E_on, k], both in the absolute
    frame already, enter per row as one gathered segment at offset 0, valid ones first. Returns
    o [g, h, k] in the absolute frame, sink included (as `_pass_b`'s). `config`: the kernel's
    (`SegAttentionConfig`; None: its decode default)."""
    args, kw = _decode_segment_args(q, pos, wk, wvalid, on_ents, rt, pool_entries, sink, scale, freqs, m)
    return seg_attention(*args, **kw, config=config)[0]


def decode_attention(blk, x, tab, pool_layer, keys, t0, *, freqs, kernels: str = ""):
    """The attention half of a reusable layer for g new rows x [1, g, n, d] at request rows
    t0 .. t0+g-1 of a frozen plan (protected new rows of the last frame: every head, native
    key sets), reading the earlier rows' keys instead of recomputing them: a document row's
    K=V from the pool (canonical, turned by R(D) as it is read), any other row's from `keys`,
    the decode state's compact rows (`tab["own_slot"]`: the request's own rows, refreshed
    rows and the rows online entries pool); the entries: the pool's, turned as they are read,
    and the online ones from `keys` (`decode_entries`; those of the new rows' windows pooled
    again). `tab`: the decode layout (the plan extended
    to the state's capacity). `kernels` naming "seg_attention": an HCA layer attends by that
    kernel (`_decode_segments`: the pool's entries read canonical, the queries turned per
    document) instead of turning every entry. Returns (x, keys with the new rows written in)."""
    attn = blk.attn
    g = x.shape[1]
    pool_layer = codec.dense(pool_layer)
    u, post, comb = blk.hc_attn.pre(x)
    xa = blk.attn_norm(u)[0]  # [g, d]
    rows = t0 + jnp.arange(g)
    pos, d_row = rows, tab["key_d"][rows]  # request rows are positions
    cpos = pos - d_row
    own = tab["own_slot"]
    slots = own[rows]  # the new rows' compact rows (>= 0: new rows are the request's own)
    cq = attn.q_norm(jnp.einsum("td,qd->tq", xa, attn.wq_a[...], precision=HIGHEST))
    put = lambda a, v: a.at[slots].set(v.astype(a.dtype), mode="drop")
    new = {**keys, "kv": put(keys["kv"], attn.latent(xa[None], cpos[None], freqs)[0])}
    ents = idx = None
    segments = attn.kind == HCA and kernel_mode(kernels, "seg_attention") == "mosaic"
    if attn.kind in (CSA, HCA):
        new.update({n: put(keys[n], v) for n, v in _projections(attn, xa, cpos).items()})
        rt = tab["rates"]["csa" if attn.kind == CSA else "hca"]
        renew = lambda comp, a, b, ring, e: _renew_entries(comp, new[a], new[b], pool_layer.get(ring), rt, rows,
                                                           freqs, own, e)
        E = rt["src"].shape[0]
        new["ents"] = renew(attn.compressor, "pk", "pg", "cmp", keys["ents"])
    if attn.kind in (CSA, HCA) and not segments:
        ents = (_entries(pool_layer.get("entries"), rt, new["ents"], E, attn.compressor.dk, freqs)
                .astype(new["ents"].dtype), rt["end"])
        if attn.kind == CSA:
            new["ikeys"] = renew(attn.indexer.compressor, "ik", "ig", "idx", keys["ikeys"])
            ikeys = _entries(pool_layer.get("idx_entries"), rt, new["ikeys"], E, attn.indexer.compressor.dk, freqs)
            iq, iw = attn.indexer.queries(xa[None], cq[None], pos[None], freqs)
            idx = (iq[0], iw[0], ikeys)

    def window_keys(kp):  # pool rows of the documents, compact rows of the rest
        r = jnp.clip(kp, 0, own.shape[0] - 1)
        ar = tab["art_row"][r]
        kv = jnp.where((ar >= 0)[..., None], pool_layer["kv"][jnp.maximum(ar, 0)].astype(new["kv"].dtype),
                       new["kv"][jnp.maximum(own[r], 0)])
        return apply_rope(kv, tab["key_d"][r], freqs)

    q = _queries(attn, cq, np.arange(attn.h), pos, freqs)
    if segments:
        kp = pos[:, None] - attn.window + 1 + jnp.arange(attn.window)  # as `_pass_b`'s window
        o = _decode_segments(q, pos, window_keys(kp), kp >= 0, new["ents"], rt, pool_layer.get("entries"),
                             attn.attn_sink[...], attn.k ** -0.5, freqs, attn.compressor.m)
    else:
        o = _pass_b(q, pos, window_keys, ents, idx, attn.attn_sink[...], attn.k ** -0.5, attn.kind, g, attn.window,
                    attn.indexer.topk if attn.kind == CSA else 0, stages=1)
    o = apply_rope(o, pos, freqs, inverse=True)
    y = attn.wo_b_apply(attn.wo_a_apply(o[None]))
    return HyperConnection.post(x, y.astype(x.dtype), post, comb), new


# ---------------------------------------------------------------------------------- jitted layers
@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "block", "cap", "kernels", "topk_stages"))
def _native_jit(state, x, ids, n_real, *, graphdef, freqs, block, cap, kernels="", topk_stages=TOPK_STAGES):
    """One native layer over a batch of b padded requests (n_real [b] real rows each)."""
    blk = nnx.merge(graphdef, state)
    b = x.shape[0]
    cache = blk.attn.init_cache(b, cap, x.dtype)
    x, _ = blk(x, ids, jnp.zeros((b,), jnp.int32), n_real, cache, freqs, block, kernels=kernels,
               topk_stages=topk_stages)
    return x


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "glob", "block", "fan", "kernels", "topk_stages",
                                             "ffn_rows"))
def _reusable_keys_jit(state, x, ids, tab, pool_layer, keep_rows, *, graphdef, freqs, glob, block, fan, kernels,
                       topk_stages=TOPK_STAGES, ffn_rows="run"):
    """`_reusable_jit` that also returns what decoding reads of rows `keep_rows` (see
    `reusable_attention`)."""
    blk = nnx.merge(graphdef, state)
    x, keys = reusable_attention(blk, x, tab, pool_layer, freqs=freqs, glob=np.asarray(glob), block=block,
                                 keep_rows=keep_rows, kernels=kernels, topk_stages=topk_stages)
    x, hist = reusable_ffn(blk, x, ids, tab["pos"] < tab["n_real"], fan, kernels=kernels,
                           **ffn_args(ffn_rows, tab, pool_layer))
    return x, hist, keys


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "fan", "kernels"), donate_argnames=("keys",))
def _reusable_step_jit(state, x, ids, tab, pool_layer, keys, t0, *, graphdef, freqs, fan, kernels=""):
    """A reusable layer for new rows over the cached keys (`decode_attention`, which writes
    them in place), then the MoE (XLA: `kernels` reaches the attention only)."""
    blk = nnx.merge(graphdef, state)
    x, keys = decode_attention(blk, x, tab, pool_layer, keys, t0, freqs=freqs, kernels=kernels)
    x, _ = reusable_ffn(blk, x, ids, jnp.ones(x.shape[1], bool), fan)
    return x, keys


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs"))
def _decode_entries_jit(state, keys, tab, pool_layer, *, graphdef, freqs):
    return decode_entries(nnx.merge(graphdef, state).attn, keys, tab, pool_layer, freqs=freqs)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "glob", "block", "fan", "kernels", "ffn_rows"))
def _reusable_batch_jit(state, x, ids, tab, pool_layer, keep_rows=None, *, graphdef, freqs, glob, block, fan,
                        kernels="", ffn_rows="run"):
    """A reusable layer over a batch x [b, t, n, d]: the attention half vmapped over the
    requests (tables stacked on a leading axis, one shared pool), the MoE half once over the
    batch's rows that run it (tokens are independent there). Returns (x, histogram per request),
    and with `keep_rows` [b, R] what decoding reads of those compact rows, per request
    (`_reusable_keys_jit`)."""
    blk = nnx.merge(graphdef, state)

    def one(xx, tt, kr):
        out = reusable_attention(blk, xx[None], tt, pool_layer, freqs=freqs, glob=np.asarray(glob), block=block,
                                 keep_rows=kr, topk_stages=1)  # vmapped: no switch
        return (out[0][0], out[1]) if kr is not None else (out[0], None)

    x, keys = jax.vmap(one)(x, tab, keep_rows)
    x, hist = reusable_ffn(blk, x, ids, tab["pos"] < tab["n_real"][:, None], fan, kernels=kernels, per_request=True,
                           **ffn_args(ffn_rows, tab, pool_layer))
    return (x, hist) if keep_rows is None else (x, hist, keys)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs", "glob", "block", "fan", "kernels", "topk_stages",
                                             "ffn_rows"))
def _reusable_jit(state, x, ids, tab, pool_layer, *, graphdef, freqs, glob, block, fan, kernels,
                  topk_stages=TOPK_STAGES, ffn_rows="run"):
    blk = nnx.merge(graphdef, state)
    return reusable_layer(blk, x, ids, tab, pool_layer, freqs=freqs, glob=np.asarray(glob), block=block, fan=fan,
                          kernels=kernels, topk_stages=topk_stages, ffn_rows=ffn_rows)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed_jit(state, ids, *, graphdef):
    return nnx.merge(graphdef, state).embed_streams(ids)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits_jit(state, x, rows, *, graphdef):
    return nnx.merge(graphdef, state).logits(x, rows)


@functools.partial(jax.jit, static_argnames=("pre_def", "csa_def", "freqs", "m"))
def _controller_jit(pre_state, csa_state, xq, qr, ikeys, d_e, end_e, *, pre_def, csa_def, freqs, m):
    """Indexer scores of the documents' windows for the query rows (max over query rows)."""
    first, blk = nnx.merge(pre_def, pre_state), nnx.merge(csa_def, csa_state)
    u, _, _ = first.hc_attn.pre(xq)
    xa = blk.attn_norm(u)
    _, cq = blk.attn.query(xa, qr[None], freqs)
    iq, iw = blk.attn.indexer.queries(xa, cq, qr[None], freqs)
    keys = apply_rope(ikeys.astype(jnp.float32), d_e, freqs).astype(ikeys.dtype)
    s = index_scores(iq, iw, keys[None])[0]  # [q, E]
    s = jnp.where(end_e[None] <= qr[:, None], s, -jnp.inf)
    return jnp.max(s, axis=0)


@functools.partial(jax.jit, static_argnames=("graphdef", "freqs"))
def _deviation_jit(state, x, pool_kv, pool_row, cpos, *, graphdef, freqs):
    """`latent_deviation` of every row with a pool row at the layer's input x [1, t, n, d]; 0 elsewhere."""
    blk = nnx.merge(graphdef, state)
    u, _, _ = blk.hc_attn.pre(x)
    kv = blk.attn.latent(blk.attn_norm(u), cpos[None], freqs)[0]
    dev = latent_deviation(kv, pool_kv[jnp.maximum(pool_row, 0)])
    return jnp.where(pool_row >= 0, dev, 0.0)


@dataclasses.dataclass
class DecodeState:
    """What decoding after a prefill reads: per native layer (a fence; every layer of the
    Recomputed arm's, `native`) its cache (capacity
    `cap` rows); per reusable layer the canonical K=V and compressor projections of the rows
    the pool does not hold (the request's own rows, refreshed rows, rows an online entry
    pools), `own` of them so far in `own_cap` compact rows, and the request's compressed
    entries (`decode_entries`, added by the first step): a document's rows are read from
    `pool`, the documents' pool the prefill read, never copied. `rows` request rows so far.
    `layout`: the decode layout, the prompt's plan extended by every row the state has room
    for, built once (so the steps share one program and no host work)."""

    rows: int
    cap: int
    pool: "DocPool"
    own: int = 0
    own_cap: int = 0
    layers: dict = dataclasses.field(default_factory=dict)
    layout: "Layout | None" = None
    stepped: bool = False  # a step ran (so the entries are in `layers`)
    native: bool = False  # every layer native (the Recomputed arm's state; no pool, no layout)

    @property
    def room(self) -> bool:
        """Whether one more row fits (`cap` and the decode layout's rows)."""
        return self.rows < min(self.cap, self.layout.n_real if self.layout is not None else self.cap)

    def nbytes(self, layers=None) -> int:
        """Device bytes the request holds for decoding (caches, compact rows, entries and, over
        all layers, the decode layout's tables; not the pool), over `layers` (default all)."""
        keep = self.layers if layers is None else {i: self.layers[i] for i in layers}
        tables = self.layout.tables if layers is None and self.layout is not None else {}
        return int(sum(x.nbytes for x in jax.tree.leaves((keep, tables))))


class Consumer:
    """Both arms of a model at serving scale: `recompute(req)` and `redknot(req, pool)`."""

    def __init__(self, model, profile, block: int | None = None, kernels: str = "auto", buckets: int = 8,
                 topk_stages: int = TOPK_STAGES):
        """kernels: which Mosaic GPU kernels single requests run (batches run only the MoE's,
        `batch_kernels`): see `resolve_kernels`; `self.kernels` is the resolved set. A kernel
        named explicitly that the model cannot run is refused here, not silently replaced by its
        reference. buckets: `Buckets.per_octave` of every padded size (rows, protected rows,
        entries, decode capacities, pools), so requests of similar sizes share compiled
        programs; 0 pads to the query block and ENTRY_PAD only. topk_stages: a CSA query block
        scores and selects over the shortest of that many entry prefixes holding what it sees
        (`indexer.select_topk_causal`; the same picks; 1 scores every entry, the form before)."""
        # query block: 256 rows at model scale; 32 for the small test models (fewer padded rows)
        block = block or (256 if model.cfg.hidden_size >= 1024 else 32)
        self.model, self.profile, self.cfg, self.block = model, profile, model.cfg, block
        self.buckets = Buckets(buckets)
        self.defs = [nnx.split(b) for b in model.layers]
        self.top_def, self.top_state = nnx.split(model)  # embedding / head jits read only their leaves
        local = local_head_mask(model, profile)
        self.glob = tuple(int(i) for i in np.flatnonzero(~local))
        self.reusable = list(profile.reusable_layers(self.cfg.num_layers))
        self.fan = (profile.fanout_mode, float(profile.tau), int(profile.fanout_min))
        self.ffn_rows = profile.ffn_rows
        self.kernels = resolve_kernels(kernels, model, len(self.glob) // self.cfg.o_groups)
        if not isinstance(topk_stages, int) or topk_stages < 1:
            raise ValueError(f"Consumer: topk_stages must be an int >= 1, got {topk_stages!r}")
        self.topk_stages = topk_stages

    @property
    def batch_kernels(self) -> str:
        """The kernels of `self.kernels` that batches run: the MoE's grouped matmul (the MoE
        flattens a batch's rows, so it is the single-request program); the indexer and
        restoration kernels are validated on single requests only, and the RedKnot arm's
        attention half is vmapped over the batch."""
        return "ragged_dot" if "ragged_dot" in self.kernels.split(",") else ""

    @property
    def decode_kernels(self) -> str:
        """The kernels of `self.kernels` that a RedKnot decode step's HCA layers run: the segment
        attention ("seg_attention"); the rest of a step is XLA."""
        return ",".join(k for k in self.kernels.split(",") if k in DECODE_ONLY)

    @property
    def prefill_kernels(self) -> str:
        """`self.kernels` less the decode-only ones, so kernel sets that differ only in those
        share the prefill's compiled programs."""
        return ",".join(k for k in self.kernels.split(",") if k not in DECODE_ONLY)

    def pool(self, artifacts, resident: str = "device", host_kind: str = "auto") -> DocPool:
        """The documents' artifacts packed for the RedKnot arm: "device" (hot: every layer on the
        device now) or "host" (prefetched: payloads stay in host memory, streamed per layer;
        `host_kind` as `HostPool`'s)."""
        if resident == "host":
            return HostPool(artifacts, self.reusable, self.model.dtype, host_kind, self.buckets)
        if resident != "device":
            raise ValueError(f"pool: resident must be one of ['device', 'host'], got {resident!r}")
        return DocPool(artifacts, self.reusable, self.model.dtype, self.buckets)

    def arena(self, rows: int, docs: int = 64) -> DocArena:
        """A device arena of `rows` document rows and `docs` documents (`arena.py`): one pool for
        every request, whatever documents it cites; `DocArena.acquire` the request's artifacts
        before running it over the arena, `release` them after its last decode step."""
        rates = {}
        for i in self.reusable:
            attn = self.model.layers[i].attn
            rates[i] = {"entries": attn.compressor.m} if attn.compressor is not None else {}
            if attn.indexer is not None:
                rates[i]["idx_entries"] = attn.indexer.m
        return DocArena(self.reusable, self.model.dtype, rows, docs, rates,
                        unit=math.lcm(self.cfg.csa_rate, self.cfg.hca_rate),
                        topk=self.cfg.index_topk, buckets=self.buckets)

    # -------------------------------------------------------------- pieces
    def _rows(self, n: int) -> int:
        """Padded rows of a request of n rows (its bucket of query blocks)."""
        return self.buckets(n, self.block)

    def _cap(self, n: int) -> int:
        """Cache capacity (rows) for n rows: their bucket, whole HCA windows."""
        return ceil_to(self._rows(n), self.cfg.hca_rate)

    def _layout(self, plan: Plan, pool: DocPool, pad_to: dict | None = None, runs: bool = False):
        return build_layout(plan, pool, self.profile, self.cfg, self.block, pad_to, self.buckets, runs)

    def _pad(self, tokens):
        t_real = len(tokens)
        t = self._rows(t_real)
        ids = jnp.asarray(np.pad(np.asarray(tokens, np.int32), (0, t - t_real)))[None]
        return ids, t, t_real

    def _native(self, i, x, ids, t_real, t):
        """t_real: an int, or one per request of the batch."""
        gd, st = self.defs[i]
        cap = self._cap(t)
        return _native_jit(st, x, ids, jnp.asarray(np.reshape(t_real, -1), jnp.int32), graphdef=gd,
                           freqs=self.model.freqs(i), block=min(self.block, t), cap=cap,
                           kernels=self.prefill_kernels if x.shape[0] == 1 else self.batch_kernels, topk_stages=self.topk_stages)

    def _embed(self, ids):
        return _embed_jit(self.top_state, ids, graphdef=self.top_def)

    def _logits(self, x, rows):
        """Logits of `rows` of x; several rows are padded to a bucket of 8 (one row, a decode
        step's or a single query's, is not: the head would run 8 times)."""
        rows = np.asarray(rows, np.int32).reshape(-1)
        padded = np.r_[rows, np.full(self.buckets(rows.size, 8) - rows.size, rows[-1])] if rows.size > 1 else rows
        return _logits_jit(self.top_state, x, jnp.asarray(padded)[None], graphdef=self.top_def)[0, :rows.size]

    # -------------------------------------------------------------- arms
    def _prefix_cap(self, L: int, c: int, n: int) -> int:
        """Cache capacity of a request of n rows (decode rows included) whose exact prefix of L
        rows is followed by c padded computed rows: whole windows of both compression rates."""
        return ceil_to(max(self._cap(n), L + c), math.lcm(self.cfg.hca_rate, self.cfg.csa_rate))

    def _native_cached(self, i, x, ids, pos0, n_real, cap, artifacts, state=None):
        """Native layer i over computed rows x [b, C, ...] with a cache of `cap` rows: after each
        request's exact prefix (`artifacts`: one per request, None for a request without one,
        whose pos0 is then 0), the cache rebuilt from the artifact (`prefix.native_cache`); with
        `state` (a `DecodeState`, or one per request of a batch) the cache is kept for decoding."""
        gd, st = self.defs[i]
        attn = self.model.layers[i].attn
        caches = [native_cache(attn, a.native_state(i), cap, self.model.dtype) if a is not None
                  else attn.init_cache(1, cap, self.model.dtype) for a in artifacts]
        cache = caches[0] if len(caches) == 1 else jax.tree.map(lambda *c: jnp.concatenate(c), *caches)
        x, cache = block_jit(st, x, ids, jnp.asarray(pos0, jnp.int32).reshape(-1),
                             jnp.asarray(n_real, jnp.int32).reshape(-1), cache, graphdef=gd, freqs=self.model.freqs(i),
                             block=min(self.block, x.shape[1]),
                             kernels=self.prefill_kernels if x.shape[0] == 1 else self.batch_kernels,
                             topk_stages=self.topk_stages)
        if isinstance(state, DecodeState):
            state.layers[i] = cache
        elif state is not None:  # a batch: each request's row of the cache
            for b, st_b in enumerate(state):
                st_b.layers[i] = jax.tree.map(lambda c: c[b:b + 1], cache)
        return x

    def recompute(self, tokens, query_rows, layer_times: list | None = None,
                  layer_traces: tuple[str, Sequence[int]] | None = None, decode_rows: int = 0):
        """The Recomputed arm: every layer native over the whole request (logits [q, vocab]),
        and with `decode_rows` > 0 a native `DecodeState` for that many generated rows
        (`decode_step`). `layer_times`: a profile; each layer is waited for and its seconds
        appended; `layer_traces` (directory, layers): those layers traced on their own
        (`_LayerClock`)."""
        ids, t, t_real = self._pad(tokens)
        x = self._embed(ids)
        clock = _LayerClock(layer_times, x, layer_traces)
        state = DecodeState(t_real, self._cap(t_real + decode_rows), None, native=True) \
            if decode_rows else None
        for i in range(self.cfg.num_layers):
            x = self._native(i, x, ids, t_real, t) if state is None else \
                self._native_cached(i, x, ids, 0, t_real, state.cap, [None], state)
            clock.lap(x)
        logits = self._logits(x, query_rows)
        return (logits, state) if decode_rows else logits

    def prefix(self, artifact, tokens, query_rows, decode_rows: int = 0, layer_times: list | None = None):
        """The prefix arm (what a prefix cache gives): `artifact`'s document (tokens[:L]) computed
        in no layer, every layer's cache rebuilt from it (`prefix.native_cache`), the rows
        tokens[L:] run natively as one chunk at pos0 = L. query_rows: request rows (>= L).
        Returns logits [q, vocab] fp32, and with `decode_rows` > 0 also a native `DecodeState`
        (rows = the request length) that `decode_step` continues. `layer_times`: as
        `recompute`'s."""
        tokens = np.asarray(tokens, np.int32)
        prefix_check(artifact, tokens, self.cfg.num_layers)
        n, L = int(tokens.size), artifact.length
        q = np.asarray(query_rows, np.int64).reshape(-1)
        if q.size == 0 or (q < L).any() or (q >= n).any():
            raise ValueError(f"prefix arm: query rows must lie in [{L}, {n}) (after the prefix), got {q.tolist()}")
        ids, t, t_real = self._pad(tokens[L:])
        cap = self._prefix_cap(L, t, n + decode_rows)
        x = self._embed(ids)
        clock = _LayerClock(layer_times, x)
        state = DecodeState(n, cap, None, native=True)
        for i in range(self.cfg.num_layers):
            x = self._native_cached(i, x, ids, L, t_real, cap, [artifact], state)
            clock.lap(x)
        logits = self._logits(x, q - L)
        return (logits, state) if decode_rows else logits

    def controller(self, plan: Plan, x, pool: DocPool, pool_layer: dict) -> None:
        """Fill Itop and the budget (profile rule) from the native indexer for the query rows;
        with `itop_rank="deviation"` the budget's rows are those of largest `latent_deviation` at
        x, the first reusable layer's input (`pool_layer`: that layer of `pool`). x holds the
        computed rows (after the exact prefix, whose rows are no candidates)."""
        cfg, prof = self.cfg, self.profile
        csa = [i for i in self.reusable if cfg.layer_types[i] == CSA]
        scores = np.full(plan.n_rows, -np.inf)
        conc = 1.0
        L = plan.prefix
        docs = [f for f in plan.candidate_frames if f.doc_len >= cfg.csa_rate]
        if csa and docs:
            li, m = csa[0], cfg.csa_rate
            keys = jnp.concatenate([jnp.asarray(f.artifact.layers[li]["idx_entries"]) for f in docs])
            d_e = np.concatenate([np.full(f.doc_len // m, f.offset) for f in docs]).astype(np.int32)
            w_e = np.concatenate([np.arange(f.doc_len // m) for f in docs])
            end_e = d_e + (w_e + 1) * m - 1
            # padded to buckets: entries never visible (scores -inf, then dropped), query rows repeated
            n_e, qr = keys.shape[0], np.asarray(plan.query_rows, np.int32)
            pad_e = self.buckets(n_e, ENTRY_PAD) - n_e
            keys = jnp.pad(keys, ((0, pad_e), (0, 0)))
            d_e, end_e = np.r_[d_e, np.zeros(pad_e, np.int32)], np.r_[end_e, np.full(pad_e, NEVER)]
            qr = np.r_[qr, np.full(self.buckets(qr.size, 8) - qr.size, qr[-1])]
            pd, ps = self.defs[self.reusable[0]]
            cd, cs = self.defs[li]
            s = np.asarray(_controller_jit(ps, cs, x[:, qr - L], jnp.asarray(qr), keys, jnp.asarray(d_e, jnp.int32),
                                           jnp.asarray(end_e, jnp.int32), pre_def=pd, csa_def=cd,
                                           freqs=self.model.freqs(li), m=m))[:n_e]
            off = 0
            for f in docs:
                n = f.doc_len // m
                scores[f.start:f.start + n * m] = np.repeat(s[off:off + n], m)
                off += n
            conc = concentration(s, cfg.index_topk)
        plan.concentration = conc
        budget = prof.budget_override if prof.budget_override is not None else prof.choose_budget(conc)
        dev = None
        if prof.itop_rank == "deviation":
            rows = L + np.arange(x.shape[1])
            d_row, pool_row = frame_rows(plan.frames, pool, rows[-1] + 1)
            gd, st = self.defs[self.reusable[0]]
            kv = jax.device_put(codec.decode(pool_layer["kv"], codec.produced_dtype(pool_layer)),
                                x.sharding)  # TP: the controller runs on one device
            dev = np.zeros(plan.n_rows)
            dev[L:] = np.asarray(_deviation_jit(st, x, kv, jnp.asarray(pool_row[rows], jnp.int32),
                                                jnp.asarray(rows - d_row[rows], jnp.int32), graphdef=gd,
                                                freqs=self.model.freqs(self.reusable[0])))[:plan.n_rows - L]
        fill_itop(plan, scores, budget, row_risk(plan, self.reusable), dev)

    def redknot(self, plan: Plan, tokens, pool: DocPool, timings: dict | None = None, frozen: bool = False,
                decode_rows: int = 0, layer_times: list | None = None,
                layer_traces: tuple[str, Sequence[int]] | None = None):
        """The RedKnot arm for a planned request whose artifacts are in `pool`; fills Itop
        (unless the plan is `frozen`: decode continuation keeps the prompt's protected set).
        Returns (logits [q, vocab], fan-out histogram [k+1] over reusable layers and rows), and
        with `decode_rows` > 0 a `DecodeState` for that many generated rows (`decode_step`).
        `layer_times`: a profile; each layer is waited for and its seconds appended (the first
        reusable layer's include the controller and the layout); `layer_traces` (directory,
        layers): those layers traced on their own (`_LayerClock`). An exact prefix
        (`plan.prefix` rows) is computed in no layer (module doc)."""
        cfg, prof = self.cfg, self.profile
        L, n = plan.prefix, plan.n_rows
        ids, t, t_real = self._pad(np.asarray(tokens)[L:])  # the computed rows
        x = self._embed(ids)
        clock = _LayerClock(layer_times, x, layer_traces)
        hist, layout = None, None
        cap = self._prefix_cap(L, t, n + decode_rows) if L else self._cap(n + decode_rows)
        state = DecodeState(n, cap, pool) if decode_rows else None
        for i in range(cfg.num_layers):
            if prof.is_fence(i, cfg.num_layers):
                if L or state is not None:
                    x = self._native_cached(i, x, ids, L, t_real, cap, [plan.frames[0].artifact if L else None], state)
                else:
                    x = self._native(i, x, ids, t_real, t)
                clock.lap(x)
                continue
            pool_layer = pool.layers[i]  # read once: a HostPool streams each layer once
            if layout is None:  # the controller reads the first reusable layer's input
                t0 = time.perf_counter()
                if not frozen:
                    self.controller(plan, x, pool, pool_layer)
                layout = self._layout(plan, pool)
                if layout.c != t:
                    raise AssertionError(f"layout of {layout.c} computed rows for {t} embedded rows")
                if state is not None:  # the compact rows decoding keeps, then room for the new rows
                    kept = layout.own_rows(n)
                    state.own, state.own_cap = kept.size, self._rows(kept.size + decode_rows)
                    keep_rows = jnp.arange(state.own_cap, dtype=jnp.int32)  # compact rows: the own rows, in order
                    state.layout = self._layout(plan.extend(decode_rows), pool, runs=bool(self.decode_kernels))
                    if not np.array_equal(state.layout.own_rows(n), kept):
                        raise AssertionError("decode layout: the prompt's compact rows changed")
                if timings is not None:
                    timings["plan_s"] = time.perf_counter() - t0
            gd, st = self.defs[i]
            kw = dict(graphdef=gd, freqs=self.model.freqs(i), glob=self.glob, block=self.block, fan=self.fan,
                      kernels=self.prefill_kernels, topk_stages=self.topk_stages, ffn_rows=self.ffn_rows)
            if state is None:
                x, h = _reusable_jit(st, x, ids, layout.tables, pool_layer, **kw)
            else:
                x, h, state.layers[i] = _reusable_keys_jit(st, x, ids, layout.tables, pool_layer, keep_rows, **kw)
            hist = h if hist is None else hist + h
            clock.lap(x)
        logits = self._logits(x, plan.query_rows - L)
        return (logits, hist, state) if decode_rows else (logits, hist)

    def decode_step(self, token: int, state: "DecodeState") -> jax.Array:
        """Logits [vocab] after one generated `token` appended to a request, reading the earlier
        rows' keys, entries and caches from `state` (from `redknot` or `recompute` with
        `decode_rows`; updated in place) instead of re-running the request: native layers (all
        of a `native` state's; the fences otherwise) decode with their caches, reusable layers
        run the new row (protected: every head over the native key sets) over the cached keys
        and entries, renewing the entries of the new row's windows. Equals the arm over the whole
        extended request (RedKnot's with the plan frozen, `Plan.extend`)."""
        cfg, prof, lay = self.cfg, self.profile, state.layout
        t0 = state.rows
        if not state.room:
            raise ValueError(f"decode_step: the decode state holds {state.rows} rows and has no room for more")
        if lay is not None and (int(lay.own_slot[t0]) != state.own or state.own >= state.own_cap):
            raise RuntimeError(f"decode_step: row {t0} would be compact row {int(lay.own_slot[t0])}, "
                               f"expected {state.own} of {state.own_cap}")
        ids = jnp.asarray([[token]], jnp.int32)
        x = self._embed(ids)
        for i in range(cfg.num_layers):
            gd, st = self.defs[i]
            if state.native or prof.is_fence(i, cfg.num_layers):
                x, state.layers[i] = block_jit(st, x, ids, jnp.full((1,), t0, jnp.int32), jnp.ones((1,), jnp.int32),
                                               state.layers[i], graphdef=gd, freqs=self.model.freqs(i), block=1)
                continue
            pool_layer = state.pool.layers[i]
            if not state.stepped:  # the first step: the request's entries, once
                state.layers[i] = _decode_entries_jit(st, state.layers[i], lay.tables, pool_layer, graphdef=gd,
                                                      freqs=self.model.freqs(i))
            x, state.layers[i] = _reusable_step_jit(st, x, ids, lay.tables, pool_layer, state.layers[i],
                                                    jnp.int32(t0), graphdef=gd, freqs=self.model.freqs(i),
                                                    fan=self.fan,
                                                    kernels=self.decode_kernels if cfg.layer_types[i] == HCA else "")
        state.rows += 1
        state.own += lay is not None
        state.stepped = True
        return self._logits(x, [0])[0]

    # -------------------------------------------------------------- batches
    def _pad_batch(self, token_lists, t_min: int = 0):
        """ids [b, t] (each request padded to the batch's common row count), t, real lengths."""
        t_real = [len(x) for x in token_lists]
        t = max(self._rows(max(t_real)), t_min)
        ids = np.stack([np.pad(np.asarray(x, np.int32), (0, t - n)) for x, n in zip(token_lists, t_real)])
        return jnp.asarray(ids), t, t_real

    def _logits_batch(self, x, rows_list):
        r = max(len(q) for q in rows_list)
        rows = np.stack([np.r_[q, np.full(r - len(q), q[-1])] for q in map(np.asarray, rows_list)])
        out = _logits_jit(self.top_state, x, jnp.asarray(rows, jnp.int32), graphdef=self.top_def)
        return [out[b, :len(q)] for b, q in enumerate(rows_list)]

    def recompute_batch(self, token_lists, query_rows_list) -> list[jax.Array]:
        """The Recomputed arm for several requests in one jitted call per layer (padded to a
        common row count; each request's real length masks its padding)."""
        ids, t, t_real = self._pad_batch(token_lists)
        x = self._embed(ids)
        for i in range(self.cfg.num_layers):
            x = self._native(i, x, ids, t_real, t)
        return self._logits_batch(x, query_rows_list)

    def redknot_batch(self, plans: list[Plan], token_lists, pool: DocPool, decode_rows: int = 0):
        """The RedKnot arm for several planned requests whose artifacts are all in `pool`, in
        one jitted call per layer: fences natively over the batch, the controller per request
        (its query rows only), layouts padded to the batch's common sizes, reusable layers
        vmapped; each request's exact prefix computed in no layer (`redknot`). Returns [(logits
        [q, vocab], fan-out histogram)] per request, equal to `redknot` request by request, and
        with `decode_rows` > 0 each request's `DecodeState` too (caches of the batch's common
        capacity; `decode_step` then runs each request on its own)."""
        cfg, prof = self.cfg, self.profile
        Ls = [p.prefix for p in plans]
        ids, t, t_real = self._pad_batch([np.asarray(tk)[L:] for tk, L in zip(token_lists, Ls)])
        x = self._embed(ids)
        hist, tabs, keep_rows = None, None, None
        cap = max(self._prefix_cap(L, t, p.n_rows + decode_rows) for L, p in zip(Ls, plans))
        firsts = [p.frames[0].artifact if p.prefix else None for p in plans]
        states = [DecodeState(p.n_rows, cap, pool) for p in plans] if decode_rows else None
        for i in range(cfg.num_layers):
            if prof.is_fence(i, cfg.num_layers):
                x = self._native_cached(i, x, ids, Ls, t_real, cap, firsts, states) if any(Ls) or states else \
                    self._native(i, x, ids, t_real, t)
                continue
            pool_layer = pool.layers[i]
            if tabs is None:
                for b, plan in enumerate(plans):
                    self.controller(plan, x[b:b + 1], pool, pool_layer)
                first = [self._layout(plan, pool, {"t": 0, "C": t, "P": 0, "K": 0, "rates": {}}) for plan in plans]
                sizes = common_sizes(first)
                layouts = [self._layout(plan, pool, sizes) for plan in plans]
                tabs = jax.tree.map(lambda *a: jnp.stack(a), *[lay.tables for lay in layouts])
                if states is not None:  # as `redknot`: each request's compact rows, then its decode layout
                    for plan, lay, st_b in zip(plans, layouts, states):
                        kept = lay.own_rows(plan.n_rows)
                        st_b.own, st_b.own_cap = kept.size, self._rows(kept.size + decode_rows)
                        st_b.layout = self._layout(plan.extend(decode_rows), pool, runs=bool(self.decode_kernels))
                        if not np.array_equal(st_b.layout.own_rows(plan.n_rows), kept):
                            raise AssertionError("decode layout: the prompt's compact rows changed")
                    keep_rows = jnp.tile(jnp.arange(max(s.own_cap for s in states), dtype=jnp.int32), (len(plans), 1))
            gd, st = self.defs[i]
            out = _reusable_batch_jit(st, x, ids, tabs, pool_layer, keep_rows, graphdef=gd, freqs=self.model.freqs(i),
                                      glob=self.glob, block=self.block, fan=self.fan, kernels=self.batch_kernels,
                                      ffn_rows=self.ffn_rows)
            x, hb = out[:2]
            if states is not None:  # each request's compact rows, cut to its own capacity
                for b, st_b in enumerate(states):
                    st_b.layers[i] = jax.tree.map(lambda k: k[b, :st_b.own_cap], out[2])
            hist = hb if hist is None else hist + hb
        logits = self._logits_batch(x, [p.query_rows - p.prefix for p in plans])
        return [(lg, None if hist is None else hist[b]) + ((states[b],) if states else ())
                for b, lg in enumerate(logits)]
