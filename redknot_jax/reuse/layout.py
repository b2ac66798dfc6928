"""A planned request's layout (DESIGN §4, §7): index tables that say where each row's keys come
from, built on the host (numpy), then put on the device. Two row spaces:

* key rows (every request row, T padded): per row its frame offset "key_d" and frame
  "key_frame", pool row "art_row", compact row "own_slot"; per compressed rate the request's
  entry table (pool entry, or the slots an online entry pools, its offset and last position);
* computed rows (the C rows after the exact prefix, `Plan.prefix`; every row without one):
  position "pos" (prefix + 0 .. C-1), offset "d", frame "frame", z_L row "zl_row", the
  protected rows "prot_idx" and the own rows "own_idx" as computed-row indices.

**Own rows** (`own_slot` >= 0, in order): the rows whose latent and compressor projections this
request computes: rows the pool does not hold (new, refreshed) and rows an online entry pools.
Every other row's K=V, entries and windows are the pool's, so an unprotected document row never
runs `wkv` or a compressor; a decode state keeps exactly these rows (its compact rows).

Shapes are padded (rows and protected rows to buckets of the query block, entries to buckets of
ENTRY_PAD: `pool.Buckets`) so requests of similar sizes share their compiled programs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import jax

from redknot_jax.config import CSA, HCA
from redknot_jax.reuse.planner import Plan, online_frames
from redknot_jax.reuse.pool import ENTRY_PAD, EXACT, Buckets, DocPool, ceil_to

NEVER = np.int32(2 ** 30)  # last position of a padding entry: never visible


def pool_runs(src: np.ndarray, d: np.ndarray, w: np.ndarray, buckets: Buckets = EXACT) -> dict:
    """The request's pool entries as runs: maximal stretches of request entries that are
    consecutive pool entries of one frame (one offset D, consecutive windows), i.e. the
    segments of canonical entries a relocated segment attention reads in place
    (`pallas/seg_attention.py`). Per run: first pool entry "run_src", length "run_n", offset
    "run_d", first canonical window "run_w"; padded with empty runs to `buckets.docs` of their
    count (at least one run)."""
    e = np.flatnonzero(src >= 0)
    brk = np.r_[True, (np.diff(e) != 1) | (np.diff(src[e]) != 1) | (np.diff(d[e]) != 0)] if e.size else \
        np.zeros(0, bool)
    first = np.flatnonzero(brk)
    n = np.diff(np.r_[first, e.size])
    n_runs = buckets.docs(max(first.size, 1))
    pad = lambda a: np.r_[a, np.zeros(n_runs - a.size)].astype(np.int32)
    return {"run_src": pad(src[e[first]]), "run_n": pad(n), "run_d": pad(d[e[first]]), "run_w": pad(w[e[first]])}


def _entry_table(plan: Plan, pool: DocPool, m: int, overlap: bool, refresh: np.ndarray, t: int,
                 frames, min_sizes: tuple[int, int] = (0, 0), buckets: Buckets = EXACT, runs: bool = False) -> dict:
    """The request's entries at rate m: pool entry or online slots, offset, last position;
    per row `row_on`, the online index of the entry its window pools (what a decode step
    recomputes after writing the row; E_on if none). Entries pad to the t // m the rows can hold,
    online entries to `buckets` of ENTRY_PAD; `min_sizes` (entries, online entries): at least
    this far (a batch's common shapes). `runs`: the pool entries as runs too (`pool_runs`; their
    count padded to `buckets.docs`)."""
    r = (2 if overlap else 1) * m
    src, on_slots, d_off, wcan, endpos = [], [], [], [], []
    ebase = np.zeros(t, np.int32)
    row_ent = np.full(t, -1)  # the entry whose window holds the row (-1: an unfinished window)
    count = 0
    for f in frames:
        n = f.end - f.start
        nw = n // m
        ebase[f.start:f.end] = count
        row_ent[f.start:f.start + nw * m] = count + np.repeat(np.arange(nw), m)
        count += nw
        w = np.arange(nw)
        L = f.doc_len if f.artifact is not None else 0
        ref_rows = refresh[f.start:f.start + nw * m].reshape(nw, m).any(1) if nw else np.zeros(0, bool)
        if overlap and nw:
            ref_rows = ref_rows | np.r_[False, ref_rows[:-1]]
        from_pool = ((w + 1) * m <= L) & ~ref_rows
        pbase = pool.entry_base(f.artifact, m) if L else 0
        ring0 = pool.doc(f.artifact) * r if L else 0
        src.append(np.where(from_pool, pbase + w, -1))
        on = np.flatnonzero(~from_pool)  # the online entries: the slots they pool
        lo = (on - 1) * m if overlap else on * m
        c = lo[:, None] + np.arange(r)[None, :]  # canonical slot positions [n_on, r]
        # an exact prefix's slots are canonical whether refreshed or not: read from its ring
        art_slot = (c < L) & (~ref_rows[on, None] | (f.start < plan.prefix))
        if np.any(art_slot & (c >= 0) & (c < L - r)):
            raise AssertionError("entry table: a continuation slot lies before the artifact's boundary ring")
        slots = np.where(c < 0, -1, np.where(art_slot, t + ring0 + np.mod(c, r), f.start + c))
        on_slots.append(slots)
        d_off.append(np.full(nw, f.offset))
        wcan.append(w)
        endpos.append(f.offset + (w + 1) * m - 1)
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)
    src, slots = cat(src, np.int32), (np.concatenate(on_slots) if on_slots else np.zeros((0, r))).astype(np.int32)
    d_off, wcan, endpos = cat(d_off, np.int32), cat(wcan, np.int32), cat(endpos, np.int32)
    e = src.shape[0]
    E = max(ceil_to(t // m, ENTRY_PAD), min_sizes[0])  # e <= t // m: a function of the padded rows
    online = np.flatnonzero(src < 0)
    E_on = max(buckets(online.size, ENTRY_PAD), min_sizes[1])
    pad = E - e
    on_of = np.full(e + 1, E_on)  # entry -> its online index (E_on: a pool entry, or none)
    on_of[online] = np.arange(online.size)
    table = {
        "src": np.r_[src, np.full(pad, -1)].astype(np.int32),
        "d": np.r_[d_off, np.zeros(pad)].astype(np.int32),
        "w": np.r_[wcan, np.zeros(pad)].astype(np.int32),
        "end": np.r_[endpos, np.full(pad, NEVER)].astype(np.int32),
        "on_idx": np.r_[online, np.full(E_on - online.size, E)].astype(np.int32),
        "on_slots": np.r_[slots, np.full((E_on - online.size, r), -1)].astype(np.int32),
        "ebase": ebase,
        "row_on": on_of[row_ent].astype(np.int32),
    }
    if runs:
        table.update(pool_runs(src, d_off, wcan, buckets))
    return table


@dataclasses.dataclass
class Layout:
    """Index tables of one planned request (device arrays; numpy with `build_layout(place=False)`)
    and its static sizes."""

    tables: dict
    t: int  # padded key rows (T)
    n_real: int
    n_prot: int  # real protected rows
    own_slot: np.ndarray  # tables["own_slot"] on the host
    prefix: int = 0  # rows of the exact prefix (not computed)
    longest_doc: int = 0  # rows of the request's longest document (artifact): bounds how far apart a
    # step's document-local picks lie (pass A's span form, `layer.csa_span_bound`)

    @property
    def c(self) -> int:
        """Padded computed rows (C)."""
        return int(self.tables["pos"].shape[0])

    def own_rows(self, n: int) -> np.ndarray:
        """The rows among the first n that a decode state keeps (own_slot >= 0), in slot order."""
        return np.flatnonzero(self.own_slot[:n] >= 0)

    def sizes(self) -> dict:
        """The padded shapes that decide the compiled program (equal across a batch)."""
        return {"t": self.t, "C": self.c, "P": int(self.tables["prot_idx"].shape[0]),
                "K": int(self.tables["own_idx"].shape[0]),
                "rates": {k: (int(v["src"].shape[0]), int(v["on_idx"].shape[0]))
                          for k, v in self.tables["rates"].items()}}


def common_sizes(layouts) -> dict:
    """The smallest sizes every layout of a batch pads to."""
    return max_sizes(*(lay.sizes() for lay in layouts))


def max_sizes(*sizes: dict) -> dict:
    """The smallest sizes (`Layout.sizes` dicts) that each of `sizes` pads to."""
    rates = {k for s in sizes for k in s["rates"]}
    return {**{key: max(s[key] for s in sizes) for key in ("t", "C", "P", "K")},
            "rates": {k: tuple(max(s["rates"].get(k, (0, 0))[j] for s in sizes) for j in (0, 1)) for k in rates}}


def frame_rows(frames, pool: DocPool, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Per request row [t]: its frame's offset D, and its pool row (-1: no artifact row)."""
    d_row = np.zeros(t, np.int32)
    pool_row = np.full(t, -1, np.int64)
    for f in frames:
        d_row[f.start:f.end] = f.offset
        if f.artifact is not None and f.doc_len:
            pool_row[f.start:f.start + f.doc_len] = pool.row_base[pool.doc(f.artifact)] + np.arange(f.doc_len)
    return d_row, pool_row


def computed_rows(plan: Plan, block: int, buckets: Buckets = EXACT, pad_to: dict | None = None) -> tuple[int, int]:
    """(C, T): the padded computed rows (after the exact prefix) and key rows of a request."""
    c = max(buckets(plan.n_rows - plan.prefix, block), pad_to["C"] if pad_to else 0)
    t = max(buckets(plan.prefix + c, block), pad_to["t"] if pad_to else 0)
    return c, t


def build_layout(plan: Plan, pool: DocPool, profile, cfg, block: int, pad_to: dict | None = None,
                 buckets: Buckets = EXACT, runs: bool = False, place: bool = True) -> Layout:
    """Index tables of a planned request, padded to `buckets` (rows and protected rows of the
    query block, entries of ENTRY_PAD). `pad_to` (`common_sizes` of a batch): pad key rows,
    computed rows, protected rows and entry tables at least that far, so a batch shares one
    program; padding rows extend the last frame, padding entries are never visible, padding
    indices drop. `runs`: the HCA pool entries as runs too (`pool_runs`: a decode layout's, for
    the segment attention kernel). `place`: the tables on the device (one batched transfer), or
    left on the host (numpy; a batch stacks them first)."""
    t_real, L = plan.n_rows, plan.prefix
    c, t = computed_rows(plan, block, buckets, pad_to)
    prot = plan.protected
    collapse = profile.latent_refresh == "protected" and bool((prot | ~plan.doc_row).all())
    if collapse:  # every latent refreshed: one online frame at 0 (after the prefix), the native computation
        frames = online_frames(plan, t)
        doc_row = np.zeros(t, bool)
    else:
        frames = list(plan.frames)
        frames[-1] = dataclasses.replace(frames[-1], end=t)  # padding rows extend the last frame
        doc_row = np.r_[plan.doc_row, np.zeros(t - t_real, bool)]
    prot_t = np.r_[prot, np.zeros(t - t_real, bool)]
    if prot_t[:L].any():
        raise AssertionError("layout: a protected row inside the exact prefix")
    refresh = prot_t if profile.latent_refresh == "protected" else np.zeros(t, bool)
    d_row, pool_row = frame_rows(frames, pool, t)
    frame = np.zeros(t, np.int32)
    for fi, f in enumerate(frames):
        frame[f.start:f.end] = fi
    art_row = np.where(refresh, -1, pool_row)  # canonical latent read from the pool
    zl_row = np.where(doc_row & ~prot_t, pool_row, -1)  # z_L restored (and top-k read) from the pool
    prot_idx = np.flatnonzero(prot_t) - L  # computed rows
    P = max(buckets(prot_idx.size, block), pad_to["P"] if pad_to else 0)
    rows = L + np.arange(c)  # the computed rows' request rows
    tab = {"pos": rows.astype(np.int32), "d": d_row[rows], "frame": frame[rows],
           "zl_row": zl_row[rows].astype(np.int32),
           "prot_idx": np.r_[prot_idx, np.full(P - prot_idx.size, c)].astype(np.int32),
           "key_d": d_row, "key_frame": frame, "art_row": art_row.astype(np.int32), "n_real": np.int32(t_real)}
    rates = {}
    mins = (pad_to or {}).get("rates", {})
    if CSA in cfg.layer_types:
        rates["csa"] = _entry_table(plan, pool, cfg.csa_rate, True, refresh, t, frames, mins.get("csa", (0, 0)),
                                    buckets)
    if HCA in cfg.layer_types:
        rates["hca"] = _entry_table(plan, pool, cfg.hca_rate, False, refresh, t, frames, mins.get("hca", (0, 0)),
                                    buckets, runs)
    tab["rates"] = rates
    # what a decode state keeps of a row (compact rows, in row order): the K=V and compressor
    # projections of rows the pool does not hold (own, refreshed) and of rows an online entry pools
    kept = art_row < 0
    for rt in rates.values():
        s = rt["on_slots"]
        kept[s[(s >= 0) & (s < t)]] = True
    if (kept[:L] | (art_row[:L] < 0)).any():
        raise AssertionError("layout: an exact prefix row is read from this request, not from its artifact")
    # padding rows: no own row (an entry pooling one ends after every real row, so it is never seen)
    kept[t_real:] = False
    tab["own_slot"] = np.where(kept, np.cumsum(kept) - 1, -1).astype(np.int32)
    own = np.flatnonzero(kept) - L
    K = max(buckets(max(own.size, 1), block), (pad_to or {}).get("K", 0))
    tab["own_idx"] = np.r_[own, np.full(K - own.size, c)].astype(np.int32)
    longest = max((f.doc_len for f in plan.frames if f.artifact is not None), default=0)
    return Layout(tables=jax.device_put(tab) if place else tab, t=t, n_real=t_real, n_prot=int(prot_idx.size),
                  own_slot=tab["own_slot"], prefix=L, longest_doc=int(longest))
