"""A reusable layer of the RedKnot arm at serving scale (DESIGN §4, §7): the math the
consumer's layer programs trace (`programs.py`), over one request's computed rows, the
documents' pool (`pool.py`: hot artifacts packed once per reusable layer, never copied or
rewritten by a request) and the request's `Layout` (`layout.py`: index tables saying where each
row's keys, entries and z_L come from).

A reusable layer: mHC, norm, `wq_a` for every row; latents and compressor projections for
the own rows only (new, refreshed, and rows an online entry pools: `layout`), every other row's
K=V and entries read from the pool; **pass A** runs the Global heads of every
row (own frame's window, the artifact's document-local CSA top-k, every visible HCA entry);
**pass B** runs every head of the protected rows over the native key sets (the native indexer
across frames); z = z_G + z_L with z_L read from the pool for unprotected document rows, the
protected rows' projected state **replaces** theirs (never added); `wo_b` once; mHC; MoE with
the fan-out rule, over the rows the profile's `ffn_rows` says.

Relocation in this XLA path: a frame's canonical keys are turned by R(D) while they are read
(the orthogonal twin of turning the query by R(-D): <R(-D) q, k> = <q, R(D) k>), so the
output needs no phase restore before the native inverse output RoPE. The artifact itself is
never written. (`pallas/seg_attention.py` rotates queries per segment instead: a decode step's
HCA layers run it when the kernel set names it, `decode.py`, reading the pool's entries in
place; docs/kernels.md says why prefill turns keys. Both are tested against the reference's
rotated-query form.) Pass B's CSA blocks run `pallas/sparse_attention.py` when the kernel set
names it: per row a list of key ids into one table of the request's absolute-frame latents and
entries; pass A's too, when it names "sparse_global", its Global heads padded to the kernel's 64
(the consumer names it for requests of long documents only, `pass_a_kernels`; else the span form).
Restoration runs `pallas/restore.py` when the set names "restore".

Under tensor parallelism (`sharding/consumer_tp.py`) the same functions run on a rank's heads,
groups and experts.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.attention import sink_softmax_attend
from redknot_jax.config import CSA, HCA
from redknot_jax.indexer import TOPK_STAGES, score_function, select_topk_causal
from redknot_jax.mhc import HyperConnection
from redknot_jax.norms import rms_norm
from redknot_jax.pallas import kernel_mode
from redknot_jax.pallas.indexer_scores import index_scores
from redknot_jax.pallas.restore import restore_reference
from redknot_jax.pallas.restore import restore as restore_kernel
from redknot_jax.pallas.sparse_attention import HEADS as SPARSE_HEADS
from redknot_jax.pallas.sparse_attention import row_lists, sparse_attention
from redknot_jax.reuse import codec
from redknot_jax.reuse.fanout import fanout_keep
from redknot_jax.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------- entries
def pooled_entries(comp, proj_kv, proj_gate, ring, slots, w, freqs, own_slot=None):
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


def absolute_entries(pool_entries, tab, on_ents, E, dk, freqs):
    """Request entries [E, dk] (fp32) in absolute coordinates: pool entries turned by R(D) as
    they are read, then the online entries `on_ents` [E_on, dk] (absolute already) in place."""
    out = jnp.zeros((E, dk), jnp.float32)
    if pool_entries is not None:  # (encoded or dense: `codec.rows` dequantises the rows read)
        src = tab["src"]
        pe = apply_rope(codec.rows(pool_entries, jnp.maximum(src, 0)).astype(jnp.float32), tab["d"], freqs)
        out = jnp.where((src >= 0)[:, None], pe, out)
    return out.at[tab["on_idx"]].set(on_ents.astype(jnp.float32), mode="drop")


def online_entries(comp, proj_kv, proj_gate, ring, tab, freqs, own_slot=None):
    """The request's online entries [E_on, dk], pooled from their slots (`pooled_entries`) and
    turned by R(D) into absolute coordinates."""
    e = jnp.minimum(tab["on_idx"], tab["src"].shape[0] - 1)
    ent = pooled_entries(comp, proj_kv, proj_gate, ring, tab["on_slots"], tab["w"][e], freqs, own_slot)
    return apply_rope(ent, tab["d"][e], freqs)


# ---------------------------------------------------------------------------------- passes A and B
PASS_A_ROWS = 8192  # pass A's rows per loop step at most (the kernel's calls; XLA's, but a CSA layer's)
SPAN_ROWS = 2048  # a CSA layer's pass A in its span form: rows per loop step at most
SPAN_CHUNK = 2048  # ... scored in chunks of this many entries, up to each step's last pick
# documents of at most this many rows: pass A's span form in chunks beats the kernel ("sparse_global");
# one H100, 2026-12-06, launch/bench_pass_a.py (docs/kernels.md): at 64K it took 15.2 / 17.8 / 17.8 ms
# at documents of 8K / 16K / 32K rows where the kernel took 30.7 / 26.9 / 18.7; at 128K, 32K: 50.7 to 55.1
SPAN_DOC_ROWS = 32768


def pass_a(q, tab, kv_abs, ents, sink, scale, kind, block, window, csa_ids, sparse: bool = False,
           call_rows: int | None = None, csa_span: int | None = None, span_chunk: int | None = None):
    """Global heads of every row: own frame's window, document-local top-k, visible HCA.
    `sparse` (CSA): by `pallas.sparse_attention` over one table of the request's latents and
    entries, the heads padded to the kernel's 64 (zero queries, outputs dropped): the kernel
    reads each key in place where XLA gathers a [block, top-k, k] tensor, and its time is the
    gather's, not the padded heads' products.

    In XLA the rows run in loop steps of equal size (the last padded): a CSA layer's of `block`
    rows (it gathers [rows, top-k, k] keys), any other's of up to `call_rows` (default
    `PASS_A_ROWS`; its entries are shared by every row, and a step per 256-row block cost more
    than the attention at 32K on the H100, docs/benchmarks.md). Within a step the window is
    banded: rows in bands of `window`, each band's keys the latents of its own and the previous
    band's positions (2 x window keys, masked to the row's window and frame), so no [rows, rows]
    tensor exists. The sparse form's `call_rows` is its rows per kernel call at most.

    `csa_span` (CSA, XLA): instead of gathering each row's picks, a step scores its 8 heads
    densely against one slice of `csa_span` entries, from its smallest pick on, masked to each
    row's picks (a [rows x heads, k] x [k, span] product, where the gather moves [rows, top-k, k]
    keys); steps of up to `call_rows` rows (default `SPAN_ROWS`). Exact when every step's picks
    lie within `csa_span` entries of its smallest: a document-local pick lies in its row's
    document, before the row, so `csa_span_bound` of the longest document and the step's rows
    holds. With `span_chunk` the slice is scored in chunks of that many entries with an online
    softmax (`_span_chunks`), up to the step's last pick only: the entries past it, the causal
    half of a long document on average, are not scored (a loop of data-dependent length)."""
    t, h, k = q.shape
    if sparse and kind == CSA:
        return _pass_a_sparse(q, tab, kv_abs, ents, sink, scale, window, csa_ids, call_rows)
    w = window
    span = kind == CSA and csa_span is not None
    cap = block if kind == CSA and not span else call_rows or (SPAN_ROWS if span else PASS_A_ROWS)
    p0 = tab["pos"][0]  # the computed rows are key rows p0 .. p0 + t - 1
    tail = min(t, max(cap, w)) + w  # > the last step's padding rows, which read past T
    ext = jnp.pad(kv_abs, ((w, tail), (0, 0)))  # key row p at w + p
    ext_frame = jnp.pad(tab["key_frame"], (w, tail), constant_values=-1)
    arrays = [(q, 0), (tab["frame"], -2)] + ([(csa_ids, -1)] if kind == CSA else [])  # a padding row: no key
    if span:
        n = min(csa_span, ents[0].shape[0])
        span_chunk = span_chunk and min(span_chunk, n)
        n_slice = -(-n // span_chunk) * span_chunk if span_chunk else n  # whole chunks
        e_ext = jnp.pad(ents[0], ((0, n_slice - n), (0, 0)))  # a slice from any start <= E - n fits

    def run(x):
        start, qb, fb = x[:3]
        rows = qb.shape[0]
        nb = rows // w
        bands = lambda a: jnp.concatenate([a[:-w].reshape(nb, w, *a.shape[1:]), a[w:].reshape(nb, w, *a.shape[1:])], 1)
        pb = p0 + start + jnp.arange(rows).reshape(nb, w)
        kk = bands(jax.lax.dynamic_slice_in_dim(ext, p0 + start, rows + w))  # [nb, 2w, k]: positions below
        kf = bands(jax.lax.dynamic_slice_in_dim(ext_frame, p0 + start, rows + w))
        kp = bands(p0 + start - w + jnp.arange(rows + w))
        fb = fb.reshape(nb, w)
        wm = (kp[:, None] <= pb[..., None]) & (kp[:, None] > pb[..., None] - w) & (kf[:, None] == fb[..., None])
        sets = [(kk, wm[:, :, None, :], "bthk,bsk->bths")]
        chunked = None
        if kind == HCA:
            e, end = ents
            sets.append((e.astype(q.dtype), (end <= pb[..., None])[:, :, None, :], "bthk,wk->bthw"))
        elif kind == CSA:
            e, end = ents
            ids = x[3].reshape(nb, w, -1)
            safe = jnp.maximum(ids, 0)
            ok = (ids >= 0) & (end[safe] <= pb[..., None])
            if span:  # one slice of entries for the step, each row's picks a mask over it
                off = jnp.clip(jnp.min(jnp.where(ok, ids, e.shape[0])), 0, e.shape[0] - n)
                at = jnp.where(ok, ids - off, n_slice).reshape(rows, -1)
                pick = jnp.zeros((rows, n_slice), bool).at[jnp.arange(rows)[:, None], at].set(True, mode="drop")
                keys = jax.lax.dynamic_slice_in_dim(e_ext, off, n_slice).astype(q.dtype)
                if span_chunk:
                    chunked = (keys, pick.reshape(nb, w, 1, n_slice), jnp.max(jnp.where(ok, ids - off, -1)) + 1)
                else:
                    sets.append((keys, pick.reshape(nb, w, 1, n_slice), "bthk,wk->bthw"))
            else:
                sets.append((e[safe].astype(q.dtype), ok[:, :, None, :], "bthk,btwk->bthw"))
        o, lse = sink_softmax_attend(qb.reshape(nb, w, h, k), sets, sink, scale)
        if chunked is not None:  # the window's (with the sink) and the chunks' softmax, merged
            m, l, acc = _span_chunks(qb.reshape(nb, w, h, k), *chunked, span_chunk, scale)
            top = jnp.maximum(lse, jnp.where(l > 0, m, -jnp.inf))  # lse holds the sink: finite
            a, b = jnp.exp(lse - top), jnp.where(l > 0, jnp.exp(m - top), 0.0)
            o = (o * a[..., None] + acc * b[..., None]) / (a + l * b)[..., None]
        return o.astype(q.dtype).reshape(rows, h, k)

    return in_steps(run, arrays, t, cap, unit=w)


def _span_chunks(q, keys, mask, hi, chunk: int, scale):
    """Softmax attention of q [nb, w, h, k] over keys [n, k] (whole chunks) where mask
    [nb, w, 1, n], online over chunks of `chunk` keys and only up to key `hi` (dynamic; every
    mask is false past it): (running max m, sum l of exp(s - m), unnormalised output acc)
    fp32, no sink; a row with no key has l = 0."""
    nb, w, h, k = q.shape

    def body(c, carry):
        m, l, acc = carry
        kc = jax.lax.dynamic_slice_in_dim(keys, c * chunk, chunk)
        s = jnp.einsum("bthk,wk->bthw", q, kc, preferred_element_type=jnp.float32, precision=HIGHEST) * scale
        s = jnp.where(jax.lax.dynamic_slice_in_dim(mask, c * chunk, chunk, axis=-1), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, -1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p, r = jnp.exp(s - safe[..., None]), jnp.exp(m - safe)
        pv = jnp.einsum("bthw,wk->bthk", p.astype(kc.dtype), kc, preferred_element_type=jnp.float32,
                        precision=HIGHEST)
        return m_new, l * r + jnp.sum(p, -1), acc * r[..., None] + pv

    init = (jnp.full((nb, w, h), -jnp.inf, jnp.float32), jnp.zeros((nb, w, h), jnp.float32),
            jnp.zeros((nb, w, h, k), jnp.float32))
    return jax.lax.fori_loop(0, (hi + chunk - 1) // chunk, body, init)


def csa_span_bound(doc_rows: int, rate: int, window: int, step_rows: int = SPAN_ROWS) -> int:
    """A `csa_span` that holds any step's picks (`pass_a`). A restored row picks among its own
    document's entries closed before it, so a step's picks lie between the first document's
    first entry it sees and its last row's: at most the longest document's entries (`doc_rows`
    rows) plus those its rows close (its cap in whole bands of `window`; rows that continue a
    document, in its frame, are rows of the step), and two for entries a frame edge splits."""
    return doc_rows // rate + -(-step_rows // window) * window // rate + 2


def pass_a_kernels(kernels: str, longest_doc: int | None, span_doc_rows: int = SPAN_DOC_ROWS) -> str:
    """The resolved kernel set `kernels` as a reusable layer runs it for requests whose longest
    document has `longest_doc` rows: less "sparse_global" (pass A's kernel) where the span form is
    faster, documents of at most `span_doc_rows` rows (None: unknown, the set unchanged)."""
    if longest_doc is None or longest_doc > span_doc_rows:
        return kernels
    return ",".join(k for k in kernels.split(",") if k and k != "sparse_global")


def in_steps(run, arrays, t: int, cap: int, unit: int = 1):
    """`run` over t rows in as few loop steps of equal size, whole `unit`s of at most `cap` rows
    (or one unit), as there can be: `arrays` ([t, ...] each, given with its padding value) padded
    to n x rows and cut into steps; run((row offset, *their step slices)) -> [rows, ...]; the steps'
    outputs joined and cut to t rows. One step: no loop; else a `lax.map`, one compiled body
    (unrolled calls would compile a Mosaic kernel each)."""
    n = -(-t // max(cap, unit))
    rows = -(-t // (n * unit)) * unit
    n = -(-t // rows)
    xs = (jnp.arange(n) * rows,) + tuple(
        jnp.pad(a, ((0, n * rows - t),) + ((0, 0),) * (a.ndim - 1), constant_values=fill).reshape(n, rows, *a.shape[1:])
        for a, fill in arrays)
    if n == 1:
        return run(jax.tree.map(lambda a: a[0], xs))[:t]
    o = jax.lax.map(run, xs)
    return o.reshape(n * rows, *o.shape[2:])[:t]


def _frame_first(key_frame, frame):
    """Each computed row's frame's first key row, from the frame index per key row
    (nondecreasing) and per computed row."""
    return jnp.searchsorted(key_frame, frame, side="left").astype(jnp.int32)


def _pass_a_sparse(q, tab, kv_abs, ents, sink, scale, window, csa_ids, call_rows=None):
    """`pass_a` of a CSA layer by the gathered-key kernel. Per row its key list: the window rows
    of its own frame (positions p - j, j < min(window, p - frame start + 1), nearest first),
    then its document-local top-k entries (valid first, as the artifact's picks are stored).
    The kernel's rows are independent (one CTA each), so it runs over all rows in as few calls
    of at most `call_rows` (default `PASS_A_ROWS`) rows as there can be, of equal size (the
    last padded, its padding rows given no keys), one loop step each, not a step per query
    block: a step per 256-row block cost more than the kernel at 32K on the H100 (the op profile
    in docs/benchmarks.md). The cap bounds the padded queries and outputs a call holds."""
    t, nh, _ = q.shape
    T = kv_abs.shape[0]
    table = jnp.concatenate([kv_abs, ents[0].astype(kv_abs.dtype)])
    end = ents[1]
    sp = jnp.pad(sink, (0, SPARSE_HEADS - nh))
    first = _frame_first(tab["key_frame"], tab["frame"])
    arrays = [(jnp.pad(q, ((0, 0), (0, SPARSE_HEADS - nh), (0, 0))), 0), (tab["pos"], 0),
              (first, np.iinfo(np.int32).max), (csa_ids, -1)]  # a padding row: no keys

    def run(x):
        _, qb, pb, fb, ids = x
        safe = jnp.maximum(ids, 0)
        ok = (ids >= 0) & (end[safe] <= pb[:, None])
        win = pb[:, None] - jnp.arange(window)[None, :]
        idx, count = row_lists(win, jnp.clip(pb - fb + 1, 0, window), T + safe, jnp.sum(ok, -1))
        return sparse_attention(qb, table, idx, count, sp, scale=scale)[0][:, :nh]

    return in_steps(run, arrays, t, call_rows or PASS_A_ROWS)


def pass_b(q, pos, window_keys, ents, idx, sink, scale, kind, block, window, topk, scores=index_scores,
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


# ---------------------------------------------------------------------------------- the layer
def reusable_layer(blk, x, ids, tab, pool_layer, *, freqs, glob, block, fan, reduce=None, ffn=None,
                   kernels: str = "", topk_stages: int = TOPK_STAGES, ffn_rows: str = "run",
                   longest_doc: int | None = None):
    """One reusable layer of the RedKnot arm over the request rows (see the module doc).

    Under tensor parallelism (`redknot_jax.sharding.consumer_tp`) the block holds a rank's
    heads / groups / experts, `reduce` sums the row-parallel `wo_b` output over ranks and
    `ffn(x, ids, keep_fn) -> (x, keep)` is the rank's MoE half; by default both are local.
    `ffn_rows`: the profile's; "omit" / "restore" run the MoE over the protected rows only
    (`ffn_args`)."""
    x = reusable_attention(blk, x, tab, pool_layer, freqs=freqs, glob=glob, block=block, reduce=reduce,
                           kernels=kernels, topk_stages=topk_stages, longest_doc=longest_doc)
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
    y = codec.rows(pool_layer["ffn"], jnp.maximum(zr, 0), codec.produced_dtype(pool_layer))
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


def head_queries(attn, cq, heads, pos, freqs):
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
    full = lambda comp, a, b, ring, pool_name: absolute_entries(
        pool_layer.get(pool_name), rt,
        online_entries(comp, proj[a], proj[b], pool_layer.get(ring), rt, freqs, tab["own_slot"]), E, comp.dk, freqs)
    ents = (full(attn.compressor, "pk", "pg", "cmp", "entries"), rt["end"])
    idx_keys = full(attn.indexer.compressor, "ik", "ig", "idx", "idx_entries") if kind == CSA else None
    return ents, idx_keys


def compressor_projections(attn, xa, cpos) -> dict:
    """Compressor (and CSA indexer-compressor) projections of rows xa [t, d] at canonical cpos."""
    pk, pg = attn.compressor.project(xa[None], cpos[None])
    out = {"pk": pk[0], "pg": pg[0]}
    if attn.kind == CSA:
        ik, ig = attn.indexer.compressor.project(xa[None], cpos[None])
        out.update(ik=ik[0], ig=ig[0])
    return out


def reusable_attention(blk, x, tab, pool_layer, *, freqs, glob, block, reduce=None, keep_rows=None,
                       kernels: str = "", topk_stages: int = TOPK_STAGES, longest_doc: int | None = None):
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
    (`indexer.select_topk_causal`; 1 under `vmap`). `longest_doc` (`Layout.longest_doc`,
    rounded up): a CSA layer's pass A in XLA takes its span form (`pass_a`'s `csa_span`), else its
    gather form."""
    attn = blk.attn
    t = x.shape[1]
    h, k, g, w = attn.h, attn.k, attn.g, attn.window
    u, post, comb = blk.hc_attn.pre(x)
    xa = blk.attn_norm(u)[0]  # [t, d]
    pos, d_row = tab["pos"], tab["d"]
    cpos = pos - d_row
    cq = attn.q_norm(jnp.einsum("td,qd->tq", xa, attn.wq_a[...], precision=HIGHEST))
    queries = lambda c, heads, p: head_queries(attn, c, heads, p, freqs)

    # keys (every key row): canonical pool latent or the own rows' online latent at the
    # canonical position, turned by R(D)
    oi = tab["own_idx"]
    oc = jnp.minimum(oi, t - 1)
    xo, co = xa[oc], cpos[oc]
    kv_on = attn.latent(xo[None], co[None], freqs)[0]  # [K]
    ar = tab["art_row"]
    T = ar.shape[0]
    on = jnp.zeros((T,) + kv_on.shape[1:], kv_on.dtype).at[jnp.where(oi < t, pos[oc], T)].set(kv_on, mode="drop")
    kv = jnp.where((ar >= 0)[:, None], codec.rows(pool_layer["kv"], jnp.maximum(ar, 0)).astype(kv_on.dtype), on)
    kv_abs = apply_rope(kv, tab["key_d"], freqs)

    kind = attn.kind
    ents = idx_keys = proj = None
    if kind in (CSA, HCA):
        proj = compressor_projections(attn, xo, co)
        ents, idx_keys = _request_entries(attn, proj, tab, pool_layer, freqs)
    scale, sink = k ** -0.5, attn.attn_sink[...]

    # pass A: Global heads of every row
    zr = tab["zl_row"]
    csa_ids = None
    if kind == CSA:
        local_ids = pool_layer["topk"][jnp.maximum(zr, 0)].astype(jnp.int32)  # document-local entry ids [t, K]
        rt = tab["rates"]["csa"]
        csa_ids = jnp.where((zr >= 0)[:, None] & (local_ids >= 0), rt["ebase"][pos][:, None] + local_ids, -1)
    q_g = queries(cq, glob, pos)
    span = csa_span_bound(longest_doc, attn.compressor.m, w) if kind == CSA and longest_doc is not None \
        else None
    o_g = pass_a(q_g, tab, kv_abs, ents, sink[glob], scale, kind, block, w, csa_ids,
                 sparse=kernel_mode(kernels, "sparse_global") == "mosaic", csa_span=span, span_chunk=SPAN_CHUNK)
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
    o_p = pass_b(q_p, pp, lambda kp: kv_abs[jnp.clip(kp, 0, T - 1)], ents, idx, sink, scale, kind, block, w,
                 attn.indexer.topk if kind == CSA else 0, score_function(kernel_mode(kernels, "indexer")),
                 kv_abs=kv_abs if kernel_mode(kernels, "sparse_attention") == "mosaic" else None,
                 stages=topk_stages)
    o_p = apply_rope(o_p, pp, freqs, inverse=True)
    z_p = attn.wo_a_apply(o_p[None])[0].astype(o_g.dtype)

    # restoration: the Global heads' columns of wo_a, plus z_L from the pool on restored rows,
    # protected rows replaced by z_p (pallas/restore.py: the kernel or its XLA reference)
    gl = tuple(int(j) for j in (np.asarray(glob) % (h // g))[: len(glob) // g])
    restore_fn = restore_kernel if kernel_mode(kernels, "restore") == "mosaic" else restore_reference
    zl = pool_layer["zl"]
    if isinstance(zl, Mapping):  # a compact codec: the restored rows' z_L dequantised, request-sized
        zl = codec.rows(zl, jnp.maximum(zr, 0), codec.produced_dtype(pool_layer))
        zr = jnp.where(zr >= 0, jnp.arange(t, dtype=zr.dtype), -1)
    z = restore_fn(o_g.reshape(t, g, len(gl), k), attn.wo_a[...], zl, zr, z_p, pi, global_heads=gl)

    y = attn.wo_b_apply(z[None])
    if reduce is not None:
        y = reduce(y)
    out = HyperConnection.post(x, y.astype(x.dtype), post, comb)
    if keep_rows is not None:
        kr = jnp.minimum(keep_rows, oi.shape[0] - 1)
        return out, {"kv": kv_on[kr], **{n: v[kr] for n, v in (proj or {}).items()}}
    return out
