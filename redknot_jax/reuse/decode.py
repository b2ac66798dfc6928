"""Decoding after a prefill (DESIGN §4: new tokens are query rows over the same relocated
segments): what a request keeps for it (`DecodeState`) and a reusable layer's attention for the
new rows over it, never re-running the request (`Consumer.decode_step` runs the steps).

A reusable layer keeps compact rows only: the canonical K=V and compressor projections of the
rows the pool does not hold (`layout.own_slot`), and the online entries, renewed per window; a
document row's K=V and entries are read from the pool, turned by R(D) as they are read. With
"seg_attention" in the kernel set an HCA layer reads the pool's entries canonical instead, one
segment per run of pool entries (`layout.pool_runs`), the queries turned per document by the
kernel (`pallas/seg_attention.py`).

`main()`: the benchmark of the two forms of a decode step's HCA attention (the kernel's segments
vs turning every entry in XLA) at serving shapes,
`python -m redknot_jax.reuse.decode --doc-lens 16384,32768 --splits 1,2,4,16`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.config import CSA, HCA
from redknot_jax.mhc import HyperConnection
from redknot_jax.pallas import kernel_mode
from redknot_jax.pallas.seg_attention import (DECODE_CONFIG, HEAD_DIM, HEADS, ROPE_DIM, SegAttentionConfig, Segment,
                                              seg_attention)
from redknot_jax.pallas.timing import median_time, record, rel_err
from redknot_jax.reuse import codec
from redknot_jax.reuse.layer import (absolute_entries, compressor_projections, head_queries, online_entries, pass_b,
                                     pooled_entries)
from redknot_jax.reuse.layout import NEVER, Layout, pool_runs
from redknot_jax.reuse.pool import DocPool
from redknot_jax.rope import apply_rope

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass
class DecodeState:
    """What decoding after a prefill reads: per native layer (a fence; every layer of the
    Recomputed arm's, `native`) its cache (capacity `cap` rows); per reusable layer the
    canonical K=V and compressor projections of the rows the pool does not hold (the request's
    own rows, refreshed rows, rows an online entry pools), `own` of them so far in `own_cap`
    compact rows, and the request's compressed entries (`decode_entries`, added by the first
    step): a document's rows are read from `pool`, the documents' pool the prefill read, never
    copied. `rows` request rows so far. `layout`: the decode layout, the prompt's plan extended
    by every row the state has room for, built once (so the steps share one program and no host
    work)."""

    rows: int
    cap: int
    pool: DocPool | None
    own: int = 0
    own_cap: int = 0
    layers: dict = dataclasses.field(default_factory=dict)
    layout: Layout | None = None
    stepped: bool = False  # a step ran (so the entries are in `layers`)
    native: bool = False  # every layer native (the Recomputed arm's state; no pool, no layout)
    plan: object = None  # the decode layout's plan (the prompt's, extended by every row there is room for)
    batch: object = None  # the `DecodeBatch` it joined, which holds its rows from then on (`layers` emptied)

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


# ---------------------------------------------------------------------------------- the decode layer
def _renew_entries(comp, proj_kv, proj_gate, ring, tab, rows, freqs, own_slot, on_ents):
    """A decode state's online entries `on_ents` [E_on, dk] (absolute) with those whose
    windows hold `rows` pooled again from the compact rows (an unfinished window's entry is not
    visible yet; the row that finishes it writes its final value)."""
    E, E_on = tab["src"].shape[0], on_ents.shape[0]
    j = tab["row_on"][rows]  # E_on: no online entry (dropped)
    jc = jnp.minimum(j, E_on - 1)
    e = jnp.minimum(tab["on_idx"][jc], E - 1)
    ent = pooled_entries(comp, proj_kv, proj_gate, ring, tab["on_slots"][jc], tab["w"][e], freqs, own_slot)
    return on_ents.at[j].set(apply_rope(ent, tab["d"][e], freqs).astype(on_ents.dtype), mode="drop")


def decode_entries(attn, keys, tab, pool_layer, *, freqs) -> dict:
    """A decode state's layer `keys` (compact rows) with the request's online compressed
    entries added, pooled once from them over the decode layout `tab` (absolute frame): "ents"
    [E_on, k] in the latent's dtype, the attention's, and for CSA "ikeys" (the indexer's). A
    step reads the pool's entries as it needs them and renews only the online entries of the
    windows its rows fall in."""
    if attn.kind not in (CSA, HCA):
        return keys
    rt = tab["rates"]["csa" if attn.kind == CSA else "hca"]
    online = lambda comp, a, b, ring: online_entries(comp, keys[a], keys[b], pool_layer.get(ring), rt, freqs,
                                                     tab["own_slot"])
    out = {**keys, "ents": online(attn.compressor, "pk", "pg", "cmp").astype(keys["kv"].dtype)}
    if attn.kind == CSA:
        out["ikeys"] = online(attn.indexer.compressor, "ik", "ig", "idx")
    return out


def _decode_segment_args(q, pos, wk, wvalid, on_ents, rt, pool_entries, sink, scale, freqs, m):
    """The arguments of `pallas.seg_attention` for a decode step's HCA attention
    (`_decode_segments`): (positional, keyword)."""
    g, k = q.shape[0], wk.shape[2]
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
    o [g, h, k] in the absolute frame, sink included (as `pass_b`'s). `config`: the kernel's
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
        new.update({n: put(keys[n], v) for n, v in compressor_projections(attn, xa, cpos).items()})
        rt = tab["rates"]["csa" if attn.kind == CSA else "hca"]
        renew = lambda comp, a, b, ring, e: _renew_entries(comp, new[a], new[b], pool_layer.get(ring), rt, rows,
                                                           freqs, own, e)
        E = rt["src"].shape[0]
        new["ents"] = renew(attn.compressor, "pk", "pg", "cmp", keys["ents"])
    if attn.kind in (CSA, HCA) and not segments:
        ents = (absolute_entries(pool_layer.get("entries"), rt, new["ents"], E, attn.compressor.dk, freqs)
                .astype(new["ents"].dtype), rt["end"])
        if attn.kind == CSA:
            new["ikeys"] = renew(attn.indexer.compressor, "ik", "ig", "idx", keys["ikeys"])
            ikeys = absolute_entries(pool_layer.get("idx_entries"), rt, new["ikeys"], E, attn.indexer.compressor.dk,
                                     freqs)
            iq, iw = attn.indexer.queries(xa[None], cq[None], pos[None], freqs)
            idx = (iq[0], iw[0], ikeys)

    def window_keys(kp):  # pool rows of the documents, compact rows of the rest
        r = jnp.clip(kp, 0, own.shape[0] - 1)
        ar = tab["art_row"][r]
        pool_kv = codec.rows(pool_layer["kv"], jnp.maximum(ar, 0)).astype(new["kv"].dtype)
        kv = jnp.where((ar >= 0)[..., None], pool_kv, new["kv"][jnp.maximum(own[r], 0)])
        return apply_rope(kv, tab["key_d"][r], freqs)

    q = head_queries(attn, cq, np.arange(attn.h), pos, freqs)
    if segments:
        kp = pos[:, None] - attn.window + 1 + jnp.arange(attn.window)  # as `pass_b`'s window
        pool_entries = codec.decode(pool_layer["entries"], codec.produced_dtype(pool_layer)) \
            if "entries" in pool_layer else None  # read in place by the kernel: dense
        o = _decode_segments(q, pos, window_keys(kp), kp >= 0, new["ents"], rt, pool_entries,
                             attn.attn_sink[...], attn.k ** -0.5, freqs, attn.compressor.m)
    else:
        o = pass_b(q, pos, window_keys, ents, idx, attn.attn_sink[...], attn.k ** -0.5, attn.kind, g, attn.window,
                   attn.indexer.topk if attn.kind == CSA else 0, stages=1)
    o = apply_rope(o, pos, freqs, inverse=True)
    y = attn.wo_b_apply(attn.wo_a_apply(o[None]))
    return HyperConnection.post(x, y.astype(x.dtype), post, comb), new


# ---------------------------------------------------------------------------------- benchmark
def decode_layer_problem(key, *, doc_len: int, n_docs: int, own: int, m: int = 128, window: int = 128):
    """A RedKnot decode step's HCA attention at serving shapes, in both forms' inputs: n_docs
    documents of doc_len rows at offsets 0, doc_len, ..., their entries in a pool [S, 512];
    `own` rows of the request's own after them (online entries); the new row at the end. Returns (q, pos, window keys, online entries, entry table `rt` with its runs, pool
    entries, sink, freqs, m)."""
    ks = jax.random.split(key, 5)
    per = doc_len // m
    src, d, w, end = [], [], [], []
    for i in range(n_docs):
        e = np.arange(per)
        src.append(i * per + e), d.append(np.full(per, i * doc_len)), w.append(e)
        end.append(i * doc_len + (e + 1) * m - 1)
    base = n_docs * doc_len
    e = np.arange(own // m)
    src.append(np.full(e.size, -1)), d.append(np.full(e.size, base)), w.append(e), end.append(base + (e + 1) * m - 1)
    src, d, w, end = (np.concatenate(x).astype(np.int32) for x in (src, d, w, end))
    E_on = ceil8 = -(-max(e.size, 1) // 8) * 8
    on_idx = np.r_[np.flatnonzero(src < 0), np.full(ceil8 - e.size, src.size)].astype(np.int32)
    pad = -src.size % 8
    rt = {"src": np.r_[src, np.full(pad, -1)], "d": np.r_[d, np.zeros(pad)], "w": np.r_[w, np.zeros(pad)],
          "end": np.r_[end, np.full(pad, NEVER)], "on_idx": on_idx, **pool_runs(src, d, w)}
    rt = {k: jnp.asarray(v, jnp.int32) for k, v in rt.items()}
    unit = lambda k, shape: (lambda x: (x / jnp.linalg.norm(x, axis=-1, keepdims=True) * 8.0).astype(jnp.bfloat16))(
        jax.random.normal(k, shape, jnp.float32))
    pool_entries = unit(ks[0], (n_docs * per, HEAD_DIM))
    on_ents = unit(ks[1], (E_on, HEAD_DIM))
    wk = unit(ks[2], (1, window, HEAD_DIM))
    q = (jax.random.normal(ks[3], (1, HEADS, HEAD_DIM), jnp.float32) * 0.5).astype(jnp.bfloat16)
    sink = jax.random.normal(ks[4], (HEADS,), jnp.float32)
    freqs = tuple(float(f) for f in 1.0 / (160000.0 ** (np.arange(0, ROPE_DIM, 2) / ROPE_DIM)))
    pos = jnp.asarray([base + own], jnp.int32)
    return q, pos, wk, on_ents, rt, pool_entries, sink, freqs, m


def decode_layer_forms(problem, config: SegAttentionConfig | None = None):
    """The two forms of a decode step's HCA attention, jitted: "kernel" (`_decode_segments`:
    the pool's entries read canonical, queries turned per run) and "xla" (`absolute_entries`
    turns every entry into the absolute frame, then `pass_b`)."""
    q, pos, wk, on_ents, rt, pe, sink, freqs, m = problem
    scale = HEAD_DIM ** -0.5
    W = wk.shape[1]
    kp = pos[:, None] - W + 1 + jnp.arange(W)

    def kernel(q, wk, on_ents, rt, pe):
        return _decode_segments(q, pos, wk, kp >= 0, on_ents, rt, pe, sink, scale, freqs, m, config)

    def xla(q, wk, on_ents, rt, pe):
        ents = (absolute_entries(pe, rt, on_ents, rt["src"].shape[0], HEAD_DIM, freqs).astype(q.dtype), rt["end"])
        return pass_b(q, pos, lambda _: wk, ents, None, sink, scale, HCA, 1, W, 0, stages=1)

    args = (q, wk, on_ents, rt, pe)
    return jax.jit(kernel), jax.jit(xla), args


def decode_layer_kernel_alone(problem, config: SegAttentionConfig | None = None):
    """The kernel form's `seg_attention` call alone (its wrapper: rotation tables, the kernel,
    the merge of splits) on the arguments the form prepares once: (jitted function, arguments)."""
    q, pos, wk, on_ents, rt, pe, sink, freqs, m = problem
    W = wk.shape[1]
    kp = pos[:, None] - W + 1 + jnp.arange(W)
    (q, keys, segs, offs, lo, hi, sink, freqs), kw = _decode_segment_args(
        q, pos, wk, kp >= 0, on_ents, rt, pe, sink, HEAD_DIM ** -0.5, freqs, m)
    f = jax.jit(lambda q, keys, offs, lo, hi, gk: seg_attention(q, keys, segs, offs, lo, hi, sink, freqs,
                                                                 scale=kw["scale"], gkeys=gk, config=config)[0])
    return f, (q, keys, offs, lo, hi, kw["gkeys"])


def main(argv=None):
    """A RedKnot decode step's HCA attention in its two forms (the kernel vs turning every entry
    in XLA) at 4 documents of each given length, 512 own rows; prints a table, writes JSON."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--doc-lens", default="16384,32768", help="comma-separated document lengths (4 documents each)")
    ap.add_argument("--splits", default=str(DECODE_CONFIG.num_splits),
                    help="the kernel's num_splits, several comma-separated")
    a = ap.parse_args(argv)
    rows = []
    for doc_len in (int(x) for x in a.doc_lens.split(",")):
        for splits in (int(x) for x in a.splits.split(",")):
            cfg = SegAttentionConfig(num_splits=splits)
            kernel, xla, args = decode_layer_forms(decode_layer_problem(jax.random.key(0), doc_len=doc_len,
                                                                        n_docs=4, own=512), cfg)
            problem = decode_layer_problem(jax.random.key(0), doc_len=doc_len, n_docs=4, own=512)
            alone, alone_args = decode_layer_kernel_alone(problem, cfg)
            ok, ox = kernel(*args), xla(*args)
            err = rel_err(ok, ox)
            tk, tx, ta = median_time(kernel, *args), median_time(xla, *args), median_time(alone, *alone_args)
            rows.append(dict(doc_len=doc_len, n_docs=4, own=512, num_splits=splits, rel_err_vs_xla=err,
                             kernel_ms=tk * 1e3, xla_ms=tx * 1e3, speedup=tx / tk, kernel_call_alone_ms=ta * 1e3))
            print(f"decode HCA, 4 docs x {doc_len}, splits {splits}: err {err:.2e}  kernel form {tk * 1e3:.3f} ms "
                  f"(its seg_attention call alone {ta * 1e3:.3f} ms)  xla {tx * 1e3:.3f} ms  x{tx / tk:.2f}",
                  flush=True)
    return record("seg_attention", a.json, argv, program="python -m redknot_jax.reuse.decode", rows=rows)


if __name__ == "__main__":
    main()
