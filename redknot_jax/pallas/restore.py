"""Fused restoration (DESIGN §4, §7) as a Mosaic GPU kernel, beside its reference.

The RedKnot consumer's projected state of one reusable layer, z [t, g, o], the input of the
single `wo_b`. Per row, exactly one of:

    protected (t = prot_idx[i]): z[t] = z_p[i]                              replaced: every head native
    restored  (zl_row >= 0):  z[t, g] = W_oa,G[g] . o_G[t, g] + z_L[zl_row[t], g]
    neither   (padding rows): z[t, g] = W_oa,G[g] . o_G[t, g]

o_G [t, g, nG, k] are the Global heads' outputs (after the inverse output RoPE), W_oa,G[g] the
columns of wo_a [g*o, (h/g)*k] that belong to group g's Global heads, z_L the artifact pool's
projected Local contribution [P, g, o] (rows replaced, never added to a Local recomputation),
z_p [p, g, o] the protected rows' projection through all of wo_a (pass B; an XLA matmul).

`restore_reference` is the consumer's XLA formulation; `restore` the Mosaic GPU kernel with the
same signature; `RestoreConfig` its validated tiling; `main()` the benchmark.

Kernel layout, two forms (`RestoreConfig.resident`), three warpgroups each. A producer
warpgroup issues the TMA copies: the o_G rows [128, 64] and the wo_a tile [block_n, 64] (the
group's rows, the Global head's columns, read in place: no weight copy) of each contraction step
of 64 into one of `steps` slots; and, between the steps, the rows' addends from their sources,
z_L pool rows or z_p rows, by a one-row TMA copy each (TMA has no gather on Hopper: a copy per
row is the gather); each row arrives once on its consumer's barrier, padding rows (no addend)
without a copy. `RestoreConfig.chunk` > 1 copies an aligned run of up to 16 rows whose sources
are consecutive rows of one array in one copy (`addend_chunks`), the rows it covers arriving
plainly: up to 9x fewer copies, and slower on the H200 (0.80-0.96x of a copy per row,
2026-12-03): the producer's per-row branching, not the copies, sets the pace.
`RestoreConfig.walk` "copies" takes that branching away: the wrapper compacts each consumer
half's copies into a list grouped by copy shape (`addend_copies`), and the producer loops over
each shape's entries (a TMA copy of static shape each), then arrives plainly once for each of
the half's other rows. With a copy per row (chunk 1) that is 1.17-1.20x the rows walk on the
H200 (2026-12-04), so it is the default; with chunk 16 its ten loops per step cost more than they
save (0.65-0.69x). `RestoreConfig.sizes` "ends" keeps only the chunk-row copies and single rows
(four copy shapes, not ten, at chunk 16), so long runs still merge. Each consumer
warpgroup owns 64 rows (the wgmma M), shares the weight tile with the other, keeps one wgmma in
flight and releases a slot when its product is done. Its epilogue drops the product of
protected rows, adds the addend (zero on padding rows) in fp32 in place of the addend in shared
memory (each thread writes the elements it read) and stores its rows with one TMA copy.
* tiled: one CTA per (128 rows, group, block_n output columns); a slot holds both operands, so a
  row block's o_G is read o / block_n times (4 at block_n 256), from L2 at best;
* resident: one CTA per (128 rows, group). The producer first loads the CTA's o_G rows
  [128, k] whole (128 KB at k = 512), one barrier per step; the CTA then loops over the
  o / block_n column blocks, a slot holding only a weight tile. The weight stream runs on across
  column blocks (the next block's first tiles load while the consumers run an epilogue), and the
  producer copies a block's addends once both consumers' stores of the previous block have read
  the buffer (one addend / output buffer: [128, o] would not fit). o_G is read once.
Limits: one Global head per group (nG = 1, the profiles' "7 of every 8 heads restored"), bf16,
k % 64 == 0, o % block_n == 0, shared memory (the resident form holds k = 512 with block_n <= 128).
Mosaic GPU interpret mode runs both forms on CPU (their wgmma operands all come from shared
memory), so CPU CI tests the kernel itself, not only its lowering.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from redknot_jax.pallas.mosaic import interpret_params, specialise
from redknot_jax.pallas.timing import matmul_peak_tflops, median_time, record, rel_err

HIGHEST = jax.lax.Precision.HIGHEST
WG_ROWS = 64  # wgmma M of one consumer warpgroup
BLOCK_T = 2 * WG_ROWS  # rows per CTA: two consumer warpgroups
BLOCK_K = 64  # one 128-byte swizzle row of bf16: the contraction step
SMEM_LIMIT = 227 * 1024  # Hopper's per-CTA shared memory
HEAD_DIM = 512  # the Flash / Pro head dim: the k RestoreConfig's budget is checked at
CHUNKS = (16, 8, 4, 2)  # addend copies: aligned runs of these many rows, else one row
SIZES = ("pow2", "ends")  # which of CHUNKS up to chunk a copy may span (`RestoreConfig.sizes`, `chunk_sizes`)
WALKS = ("rows", "copies")  # how the producer finds the addend copies (`RestoreConfig.walk`)


@dataclasses.dataclass(frozen=True)
class RestoreConfig:
    """Tiling: block_n output columns per product (wgmma N, shared by both consumers), steps the
    number of operand slots of the contraction pipeline, chunk the longest addend copy (rows),
    sizes which shorter copies it may use, walk how the producer finds the addend copies,
    resident the form:

    * False ("tiled"): one CTA per (128 rows, group, block_n columns); a slot holds the o_G rows
      [128, 64] and the weight tile [block_n, 64] of one contraction step, so a row block's o_G
      is read once per column block (o / block_n times);
    * True ("resident"): one CTA per (128 rows, group); the CTA's o_G rows [128, k] are loaded
      into shared memory once and the CTA loops over the o / block_n column blocks, a slot
      holding one weight tile [block_n, 64]; the weight stream runs on across column blocks, so
      the next block's first tiles load during a block's epilogue.

    walk:
    * "rows": the producer visits each of the CTA's 128 rows, reads its (source row, kind, chunk
      size) and copies or arrives plainly by branch (as measured: 57 % of copy bandwidth);
    * "copies": the wrapper compacts each consumer half's copies into a list grouped by copy shape
      (`addend_copies`); the producer loops over the list, a loop per shape with no per-row
      test, then arrives plainly for the rest of the half's 64 rows. The default: 1.17-1.20x the
      rows walk at chunk 1 on the H200 (docs/kernels.md, "Walking copies, not rows").

    sizes (`chunk_sizes`; irrelevant at chunk 1 and 2, where both give the same copies):
    * "pow2": copies of every power of two up to chunk rows (16, 8, 4, 2, then 1): the fewest
      copies; at chunk 16, 10 copy shapes (2 sources x 5 sizes), each a loop of the copies walk
      per half per step, and those loops cost more than the copies they save (0.65-0.69x);
    * "ends": copies of chunk rows or of one row, nothing between: 4 shapes, so a run shorter
      than an aligned chunk costs a copy per row, while long runs (boundary rows, the tail)
      still merge.

    Shared memory (`smem_bytes`): the operand slots, o_G (resident: [128, k] whole), 128 *
    block_n * 2 bytes of addend rows (the output staging too) and `id_rows` rows of 128 ids
    (`restore`). __post_init__ checks it at k = HEAD_DIM, the Flash / Pro head dim; `restore`
    checks the k it is given."""

    block_n: int = 256
    steps: int = 3
    resident: bool = False
    chunk: int = 1  # the longest addend copy in rows (`addend_chunks`; 1: a copy per row; default_config: 16, "ends")
    walk: str = "copies"  # "copies" (measured fastest) or "rows": the producer's loop (above)
    sizes: str = "pow2"  # "pow2" (every power of two up to chunk) or "ends" (chunk or 1 rows only): above

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"RestoreConfig.block_n: expected 64, 128 or 256, got {self.block_n}")
        if not 2 <= self.steps <= 4:
            raise ValueError(f"RestoreConfig.steps: expected 2..4, got {self.steps}")
        if not isinstance(self.resident, bool):
            raise ValueError(f"RestoreConfig.resident: expected a bool, got {self.resident!r}")
        if self.chunk not in (1, *CHUNKS):
            raise ValueError(f"RestoreConfig.chunk: expected one of 1, {', '.join(map(str, CHUNKS))}, got {self.chunk}")
        if self.walk not in WALKS:
            raise ValueError(f"RestoreConfig.walk: expected one of {', '.join(WALKS)}, got {self.walk!r}")
        if self.sizes not in SIZES:
            raise ValueError(f"RestoreConfig.sizes: expected one of {', '.join(SIZES)}, got {self.sizes!r}")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(self.over_budget())

    @property
    def form(self) -> str:
        return "resident" if self.resident else "tiled"

    @property
    def id_rows(self) -> int:
        """Rows of 128 int32 ids a CTA reads (`restore`): the rows walk each row's (source row, kind,
        chunk size); the copies walk the list's source rows and offsets, each row's kind and the
        halves' class starts."""
        return 3 if self.walk == "rows" else 4

    def smem_bytes(self, k: int = HEAD_DIM) -> int:
        """Shared memory of one CTA at head dim k (barriers rounded up to 1 KB)."""
        o_g = BLOCK_T * k * 2 if self.resident else self.steps * BLOCK_T * BLOCK_K * 2
        weights = self.steps * self.block_n * BLOCK_K * 2
        return o_g + weights + BLOCK_T * self.block_n * 2 + self.id_rows * BLOCK_T * 4 + 1024

    def over_budget(self, k: int = HEAD_DIM) -> str:
        """The error of a config whose shared memory at head dim k exceeds the budget."""
        why = (f" (o_G [{BLOCK_T}, {k}] {BLOCK_T * k * 2 // 1024} KB + {self.steps} weight slots [{self.block_n}, "
               f"{BLOCK_K}] + addend / output rows [{BLOCK_T}, {self.block_n}]: use a smaller block_n or fewer steps)"
               if self.resident else "")
        return (f"RestoreConfig(block_n={self.block_n}, steps={self.steps}, form={self.form!r}): "
                f"{self.smem_bytes(k)} bytes of shared memory at k={k} > {SMEM_LIMIT}, the Hopper per-CTA budget{why}")


def default_config(o: int, resident: bool = False) -> RestoreConfig:
    """The widest block_n that divides the output-group rank and fits (Flash / Pro, o = 1024:
    tiled 256 with 3 slots; resident 128 with 4 slots, 226 KB of shared memory at k = 512). The
    tiled form copies aligned 16-row runs in one copy, else single rows (chunk 16, sizes "ends"):
    on the H200 that is 1.09x a copy per row where protected rows come in runs, as a request's
    tail and a document's restored rows do, and 0.94x where they are scattered (2026-12-04)."""
    if resident:
        return RestoreConfig(block_n=128 if o % 128 == 0 else 64, steps=4, resident=True)
    bn = next((b for b in (256, 128) if o % b == 0), 64)
    return RestoreConfig(block_n=bn, chunk=16, sizes="ends")


def _check(o_g, wo_a, zl, zl_row, z_p, prot_idx, global_heads):
    if o_g.ndim != 4:
        raise ValueError(f"restore: expected o_g [t, g, nG, k], got {o_g.shape}")
    t, g, ng, k = o_g.shape
    heads = tuple(int(j) for j in global_heads)
    if len(heads) != ng:
        raise ValueError(f"restore: {len(heads)} Global heads per group named, o_g has {ng}")
    if wo_a.ndim != 2 or wo_a.shape[0] % g or wo_a.shape[1] % k:
        raise ValueError(f"restore: expected wo_a [g*o, (h/g)*k] for g={g}, k={k}, got {wo_a.shape}")
    o, hpg = wo_a.shape[0] // g, wo_a.shape[1] // k
    if any(not 0 <= j < hpg for j in heads):
        raise ValueError(f"restore: Global heads {heads} outside 0..{hpg - 1}")
    for name, a in (("zl", zl), ("z_p", z_p)):
        if a.ndim != 3 or a.shape[1:] != (g, o):
            raise ValueError(f"restore: expected {name} [rows, {g}, {o}], got {a.shape}")
    if zl_row.shape != (t,):
        raise ValueError(f"restore: expected zl_row [{t}], got {zl_row.shape}")
    if prot_idx.shape != z_p.shape[:1]:
        raise ValueError(f"restore: expected prot_idx [{z_p.shape[0]}] (one row per z_p row), got {prot_idx.shape}")
    return t, g, ng, k, o, hpg, heads


def restore_reference(o_g, wo_a, zl, zl_row, z_p, prot_idx, *, global_heads, config=None):
    """z [t, g, o] in o_g.dtype (see the module doc); XLA: the Global columns of wo_a applied
    to every row, z_L gathered and added where restored, protected rows replaced (z_p row i
    scattered to row prot_idx[i]; entries >= t are padding and dropped)."""
    del config
    t, g, ng, k, o, hpg, heads = _check(o_g, wo_a, zl, zl_row, z_p, prot_idx, global_heads)
    wa = wo_a.reshape(g, o, hpg, k)[:, :, list(heads)]  # [g, o, nG, k]
    z = jnp.einsum("tgjk,gojk->tgo", o_g, wa, precision=HIGHEST)
    z = z + jnp.where((zl_row >= 0)[:, None, None], zl[jnp.maximum(zl_row, 0)].astype(z.dtype), 0)
    return z.at[prot_idx].set(z_p.astype(z.dtype), mode="drop")


def protected_rows(prot_idx, t: int) -> jax.Array:
    """p_row [t]: each row's index in the protected list prot_idx (padded with t, dropped), or -1."""
    n = prot_idx.shape[0]
    return jnp.full((t,), -1, jnp.int32).at[prot_idx].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def addend_sources(zl_row, prot_idx, t: int) -> tuple[jax.Array, jax.Array]:
    """(kind, row), int32 [t padded to a multiple of BLOCK_T]: each row's addend source (0 none:
    padding, 1 z_L, 2 z_p: protected rows win) and its row there (0 where none)."""
    p_row = protected_rows(prot_idx, t)
    kind = jnp.where(p_row >= 0, 2, jnp.where(zl_row >= 0, 1, 0)).astype(jnp.int32)
    row = jnp.where(kind == 2, p_row, jnp.where(kind == 1, zl_row, 0)).astype(jnp.int32)
    tp = -t % BLOCK_T
    return jnp.pad(kind, (0, tp)), jnp.pad(row, (0, tp))


def chunk_sizes(max_chunk: int, sizes: str = "pow2") -> tuple[int, ...]:
    """The row counts (> 1, largest first) an addend copy may span (`RestoreConfig.chunk`,
    `RestoreConfig.sizes`): "pow2" every one of CHUNKS up to max_chunk, "ends" max_chunk alone
    (none at max_chunk 1). Any other row copies alone."""
    if sizes not in SIZES:
        raise ValueError(f"sizes: expected one of {', '.join(SIZES)}, got {sizes!r}")
    return tuple(c for c in CHUNKS if c <= max_chunk and (sizes == "pow2" or c == max_chunk))


def addend_chunks(kind, row, max_chunk: int = CHUNKS[0], sizes: str = "pow2") -> jax.Array:
    """size [t] (t a multiple of max_chunk): the rows one addend copy starting at each row
    covers. A chunk of s rows (s one of `chunk_sizes(max_chunk, sizes)`) starts at a multiple of
    s, holds rows of one source (kind 1: z_L, 2: z_p) whose source rows are consecutive, and is
    the largest such that no larger chunk already covers; rows it covers after its first get 0,
    as do padding rows (kind 0: no addend); any other row copies alone (1)."""
    t = kind.shape[0]
    link = jnp.concatenate([(kind[1:] == kind[:-1]) & (row[1:] == row[:-1] + 1), jnp.zeros((1,), bool)])
    size = jnp.where(kind > 0, 1, 0).astype(jnp.int32)
    covered = jnp.zeros((t,), bool)
    for s in chunk_sizes(max_chunk, sizes):
        good = link.reshape(-1, s)[:, :-1].all(axis=1) & (kind[::s] > 0) & ~covered[::s]
        size = size.at[::s].set(jnp.where(good, s, size[::s]))
        covered = covered | jnp.repeat(good, s)
    return jnp.where(covered & (size == 1), 0, size)


def copy_classes(max_chunk: int, sizes: str = "pow2") -> tuple[tuple[int, int], ...]:
    """The (kind, rows) of every addend copy shape (rows 1 and `chunk_sizes(max_chunk, sizes)`),
    in the producer's order. A TMA copy's source array (kind 1: z_L, 2: z_p) and row count are
    static, so each shape is its own code: the rows walk tests every shape per row, the copies
    walk loops per shape (10 shapes at chunk 16 "pow2", 4 at "ends")."""
    return tuple((kind, s) for s in (1, *chunk_sizes(max_chunk, sizes)) for kind in (1, 2))


class AddendCopies(NamedTuple):
    """Each consumer half's addend copies (`addend_copies`), [blocks, 2, WG_ROWS] entries: half w
    of 128-row block b copies `size` rows from row `source` of z_L (kind 1) or z_p (kind 2) to the
    block's rows offset .. offset + size - 1. start [blocks, 2, classes + 1]: the entries of class
    c (`copy_classes`) are start[c] .. start[c + 1] - 1, start[-1] the half's count of copies."""

    offset: jax.Array
    source: jax.Array
    kind: jax.Array
    size: jax.Array
    start: jax.Array


def addend_copies(kind, row, size, max_chunk: int = CHUNKS[0], sizes: str = "pow2") -> AddendCopies:
    """The copies walk's lists: per consumer half (64 rows), its copies only, grouped by copy
    class (`copy_classes`), in row order within a class, then zeros past the count; rows without
    a copy (covered by an earlier row's chunk, padding) have no entry. kind, row [t]
    (`addend_sources`, t a multiple of BLOCK_T), size [t] (`addend_chunks` at max_chunk, sizes).
    Grouped so the producer's loop per class issues a copy of a static shape per entry, with no
    test; each entry's position is its class's start plus its rank in the class (a cumsum)."""
    classes = copy_classes(max_chunk, sizes)
    halves = kind.shape[0] // WG_ROWS
    kind, row, size = (a.reshape(halves, WG_ROWS) for a in (kind, row, size))
    cls = jnp.full(kind.shape, len(classes), jnp.int32)  # no copy: past every class
    for c, (want, s) in enumerate(classes):
        cls = jnp.where((kind == want) & (size == s), c, cls)
    member = (cls[..., None] == jnp.arange(len(classes))).astype(jnp.int32)  # [halves, 64, classes]
    start = jnp.pad(jnp.cumsum(member.sum(axis=1), axis=1), ((0, 0), (1, 0)))  # [halves, classes + 1]
    earlier = jnp.cumsum(member, axis=1) - member  # the half's earlier rows of each class
    pos = jnp.where(cls < len(classes), ((start[:, None, :-1] + earlier) * member).sum(-1), WG_ROWS)  # WG_ROWS: dropped
    half = jnp.arange(halves)[:, None]
    offset = (half % 2) * WG_ROWS + jnp.arange(WG_ROWS)  # the row's offset in its 128-row block

    def compact(a):
        return jnp.zeros((halves, WG_ROWS), jnp.int32).at[half, pos].set(a, mode="drop").reshape(-1, 2, WG_ROWS)

    return AddendCopies(compact(jnp.broadcast_to(offset, kind.shape)), compact(row), compact(kind), compact(size),
                        start.reshape(-1, 2, len(classes) + 1))


def copy_ids(kind, copies: AddendCopies) -> jax.Array:
    """ids [4, t] of the copies walk, read per CTA like the rows walk's: per 128-row block, row 0
    the halves' entries' source rows (half w's entry i at column w * 64 + i), row 1 each row's
    kind (the consumers' epilogue reads it), row 2 the entries' offsets, row 3 the halves' class
    starts (`AddendCopies.start`, at columns w * 64 ..)."""
    t = kind.shape[0]
    start = copies.start.reshape(-1, copies.start.shape[-1])
    heads = jnp.pad(start, ((0, 0), (0, WG_ROWS - start.shape[1]))).reshape(t)
    return jnp.stack([copies.source.reshape(t), kind, copies.offset.reshape(t), heads])


def addend_ids(kind, row, cfg: RestoreConfig) -> jax.Array:
    """The ids [cfg.id_rows, t] the kernel reads per 128-row block (by one TMA copy), from each
    row's addend source (`addend_sources`): the rows walk each row's (source row, kind, chunk
    size); the copies walk the compact lists of `copy_ids`."""
    size = addend_chunks(kind, row, cfg.chunk, cfg.sizes)
    if cfg.walk == "rows":
        return jnp.stack([row, kind, size])
    return copy_ids(kind, addend_copies(kind, row, size, cfg.chunk, cfg.sizes))


def _kernel_call(a, wo_a, zl, zp, idx, *, g, o, k, col0, cfg, interpret):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    t = a.shape[0]
    bt, bn, nk, slots, resident = BLOCK_T, cfg.block_n, k // BLOCK_K, cfg.steps, cfg.resident
    nb = o // bn if resident else 1  # column blocks per CTA
    dtype = a.dtype
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # the wgmma operands
    # the addend copies of a column block spread over its first `spread` steps, issued while the
    # consumers compute: tiled over all steps (as measured); resident over the first half, so the
    # last rows land well before the epilogue (one addend buffer: the next block's cannot be
    # fetched during this one). Rows walk: step kk copies rows bounds[kk] .. bounds[kk + 1] - 1,
    # whole chunks (multiples of CHUNKS[0]); copies walk: the kk-th of `spread` equal shares of
    # each half's copy list.
    spread = max(1, nk // 2) if resident else nk
    classes = copy_classes(cfg.chunk, cfg.sizes)  # the copy shapes the ids name (`addend_ids`)
    units = bt // CHUNKS[0]
    bounds = [kk * units // spread * CHUNKS[0] for kk in range(spread + 1)]

    def slot(j, kk):  # the slot of contraction step kk of column block j (j an int or traced)
        if isinstance(j, int):
            return (j * nk + kk) % slots
        if nk % slots == 0:  # every column block starts at slot 0: static
            return kk % slots
        return lax.rem(j * nk + kk, slots)

    def when(cond, f):  # f() where cond holds: a Python bool (tiled, j = 0) or a traced one (resident)
        if not isinstance(cond, bool):
            pl.when(cond)(f)
        elif cond:
            f()

    def body(a_ref, w_ref, zl_ref, zp_ref, idx_ref, out_ref, scratch):
        (a_s, w_s, add_s, idx_s), (idx_bar, a_bar, ready, add_bar, free, add_free) = scratch
        r0 = lax.axis_index("t") * bt
        # the CTA's first column of z [t, g*o]: its group's, and (tiled) its column block's
        n0 = lax.axis_index("g") * o + (0 if resident else lax.axis_index("n") * bn)
        a0 = lax.axis_index("g") * k  # the group's Global head in o_G [t, g*k]

        def consumer(w):
            plgpu.set_max_registers(232, action="increase")
            rows = pl.ds(w * WG_ROWS, WG_ROWS)

            def product(acc_ref, j):
                for kk in range(nk):  # one wgmma in flight: step kk - 1's slot is free once kk is issued
                    if resident:  # o_G's chunk kk, loaded once, before the first column block uses it
                        when(j == 0, lambda kk=kk: plgpu.barrier_wait(a_bar.at[kk]))
                    sl = slot(j, kk)
                    plgpu.barrier_wait(ready.at[sl])
                    plgpu.wgmma(acc_ref, a_s.at[kk if resident else sl, rows], w_s.at[sl].T)
                    plgpu.wgmma_wait(1)
                    if kk:
                        plgpu.barrier_arrive(free.at[slot(j, kk - 1)])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free.at[slot(j, nk - 1)])
                return acc_ref[...]

            plgpu.barrier_wait(idx_bar)
            kinds = plgpu.load(idx_s.at[1, rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

            def column_block(j):  # columns n0 + j * bn ..: product, epilogue, store (not awaited)
                acc = pl.run_scoped(lambda acc_ref: product(acc_ref, j), plgpu.ACC((WG_ROWS, bn), jnp.float32))
                plgpu.barrier_wait(add_bar.at[w])
                keep = lax.broadcast_in_dim(kinds != 2, (WG_ROWS, bn), [0])  # protected rows: replaced
                pad = lax.broadcast_in_dim(kinds == 0, (WG_ROWS, bn), [0])  # padding rows: no addend landed
                # the addend's elements are overwritten by the threads that read them (whole rows: a
                # column slice of this buffer gave wrong results on the H200 at block_n 128)
                add = plgpu.load(add_s.at[rows], layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
                add_s.at[rows][...] = (jnp.where(keep, acc, 0.0) + jnp.where(pad, 0.0, add)).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(add_s.at[rows],
                                        out_ref.at[pl.ds(r0 + w * WG_ROWS, WG_ROWS), pl.ds(n0 + j * bn, bn)])

            if resident:
                @pl.loop(0, nb)
                def _block(j):
                    column_block(j)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the store has read the rows:
                    plgpu.barrier_arrive(add_free.at[w])  # the next block's addends may land there
            else:
                column_block(0)
            plgpu.wait_smem_to_gmem(0)

        def producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(idx_ref.at[:, pl.ds(r0, bt)], idx_s, idx_bar)

            def o_g(kk):  # the CTA's o_G rows [128, 64] of contraction step kk
                return a_ref.at[pl.ds(r0, bt), pl.ds(a0 + kk * BLOCK_K, BLOCK_K)]

            if resident:  # all of the CTA's o_G rows, once, a barrier per step
                for kk in range(nk):
                    plgpu.copy_gmem_to_smem(o_g(kk), a_s.at[kk], a_bar.at[kk])

            def load(j, kk):  # step kk of column block j into its slot: the weight tile (tiled: and o_G's)
                sl = slot(j, kk)
                if not resident:
                    plgpu.copy_gmem_to_smem(o_g(kk), a_s.at[sl], ready.at[sl])
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(n0 + j * bn, bn), pl.ds(col0 + kk * BLOCK_K, BLOCK_K)],
                                        w_s.at[sl], ready.at[sl])

            def addend_copy(want, s, src, rr, c0, w):  # s addend rows from row src of z_L / z_p (kind want)
                ref = zl_ref if want == 1 else zp_ref
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(src, s), pl.ds(c0, bn)], add_s.at[pl.ds(rr, s)], add_bar.at[w])

            def addend_rows(kk, c0):  # rows walk: step kk's rows, columns c0 ..: one arrival per row (module doc)
                lo, hi = bounds[kk], bounds[kk + 1]
                for w in (0, 1):
                    a_lo, a_hi = max(lo, w * WG_ROWS), min(hi, (w + 1) * WG_ROWS)
                    if a_lo >= a_hi:
                        continue

                    @pl.loop(a_lo, a_hi)
                    def _row(rr, w=w):
                        src, kind, size = idx_s[0, rr], idx_s[1, rr], idx_s[2, rr]

                        @pl.when(size == 0)  # covered by an earlier row's copy, or padding
                        def _():
                            plgpu.barrier_arrive(add_bar.at[w])

                        for want, s in classes:
                            pl.when((size == s) & (kind == want))(
                                lambda want=want, s=s: addend_copy(want, s, src, rr, c0, w))

            def addend_list(kk, c0):  # copies walk: step kk's share of each half's list, columns c0 ..
                for w in (0, 1):
                    head = w * WG_ROWS  # the half's entries (ids rows 0, 2) and class starts (row 3)
                    n = idx_s[3, head + len(classes)]
                    lo, hi = lax.div(n * kk, spread), lax.div(n * (kk + 1), spread)
                    for c, (want, s) in enumerate(classes):  # a static copy shape per loop: no test per copy
                        @pl.loop(jnp.maximum(lo, idx_s[3, head + c]), jnp.minimum(hi, idx_s[3, head + c + 1]))
                        def _copy(e, w=w, want=want, s=s):
                            addend_copy(want, s, idx_s[0, head + e], idx_s[2, head + e], c0, w)

                    if kk == 0:  # the barrier counts WG_ROWS arrivals: the rows no copy arrives for
                        @pl.loop(n, WG_ROWS)
                        def _plain(_, w=w):
                            plgpu.barrier_arrive(add_bar.at[w])

            def column_block(j):
                for kk in range(nk):
                    if kk < spread:
                        (addend_rows if cfg.walk == "rows" else addend_list)(kk, n0 + j * bn)
                    j2, kk2 = j + (kk + slots) // nk, (kk + slots) % nk  # the step `slots` ahead

                    def _next(j=j, kk=kk, j2=j2, kk2=kk2):
                        plgpu.barrier_wait(free.at[slot(j, kk)])  # both consumers are done with step (j, kk)
                        load(j2, kk2)

                    when(j2 < nb, _next)

            for s in range(min(slots, nb * nk)):
                load(s // nk, s % nk)
            plgpu.barrier_wait(idx_bar)
            if resident:
                def addends_free():  # both consumers' stores of the previous block have read the rows
                    for w in (0, 1):
                        plgpu.barrier_wait(add_free.at[w])

                @pl.loop(0, nb)
                def _block(j):
                    when(j > 0, addends_free)
                    column_block(j)

                addends_free()  # the last block's (every phase is waited on)
            else:
                column_block(0)
            for s in range(max(nb * nk - slots, 0), nb * nk):  # observe the last releases
                plgpu.barrier_wait(free.at[slot(s // nk, s % nk)])

        specialise(lax.axis_index("wg"), consumer, producer)

    scratch = (
        # o_G: the CTA's rows whole (resident) or a step's chunk per slot (tiled); the weight
        # tiles; the addend rows, then the output rows; the ids (`RestoreConfig.id_rows`)
        (plgpu.SMEM((nk if resident else slots, bt, BLOCK_K), dtype, transforms=swizzled),
         plgpu.SMEM((slots, bn, BLOCK_K), dtype, transforms=swizzled),
         plgpu.SMEM((bt, bn), dtype),
         plgpu.SMEM((cfg.id_rows, bt), jnp.int32)),
        # ids ready; (resident) o_G's chunk ready; a slot's operands ready (tiled: two copies); a
        # consumer's addend rows (an arrival per row); a slot free (both consumers); (resident) a
        # consumer's addend rows free (its store has read them)
        (plgpu.Barrier(), plgpu.Barrier(num_barriers=nk) if resident else None,
         plgpu.Barrier(num_arrivals=1 if resident else 2, num_barriers=slots),
         plgpu.Barrier(num_arrivals=WG_ROWS, num_barriers=2), plgpu.Barrier(num_arrivals=2, num_barriers=slots),
         plgpu.Barrier(num_barriers=2) if resident else None),
    )

    def entry(*refs):
        pl.run_scoped(lambda *sc: body(*refs, sc), *scratch, collective_axes="wg")

    grid, names = ((t // bt, g), ("t", "g")) if resident else ((t // bt, g, o // bn), ("t", "g", "n"))
    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((t, g * o), dtype), grid=grid, grid_names=names, num_threads=3,
        thread_name="wg",
        # No automatic warpgroup barriers (Pallas would put one before each addend copy). Safe: the
        # producer reads only the ids, after their barrier; each consumer thread overwrites only
        # the addend elements it read itself, and commit_smem (a fence and a
        # warpgroup barrier) precedes the output's TMA; the wait for the store to have read the
        # rows ends with a warpgroup barrier, before any thread releases them.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        interpret=interpret_params(interpret))(a, wo_a, zl, zp, idx)


def restore_unsupported(k: int, o: int, n_global: int, dtype, config: RestoreConfig | None = None) -> str | None:
    """Why the kernel cannot run this shape (None: it can). k head dim, o output-group rank,
    n_global Global heads per group."""
    cfg = config or default_config(o)
    if n_global != 1:
        return f"one Global head per group supported, got {n_global}"
    if isinstance(dtype, str) or jnp.dtype(dtype) != jnp.bfloat16:
        return f"bf16 operands expected, got {dtype}"
    if k % BLOCK_K or o % cfg.block_n:
        return f"k={k} must divide by {BLOCK_K} and o={o} by block_n={cfg.block_n}"
    if cfg.smem_bytes(k) > SMEM_LIMIT:
        return cfg.over_budget(k)
    return None


def restore(o_g, wo_a, zl, zl_row, z_p, prot_idx, *, global_heads, config: RestoreConfig | None = None,
            interpret: bool | None = None):
    """Mosaic GPU fused restoration; same signature and result as `restore_reference`.

    Supported: one Global head per group, bf16 operands, k % 64 == 0, o % block_n == 0, a CTA's
    shared memory within the budget at this k; anything else raises ValueError (the caller then
    uses the reference explicitly). config: the tiling and the form (`RestoreConfig.resident`;
    default the tiled `default_config(o)`). Rows are padded to a multiple of 128 here when needed
    (a copy; the consumer's row counts are multiples of 128).
    interpret: Mosaic GPU interpret mode; None = on when the default backend is not a GPU."""
    t, g, ng, k, o, hpg, heads = _check(o_g, wo_a, zl, zl_row, z_p, prot_idx, global_heads)
    cfg = config or default_config(o)
    dts = {a.dtype for a in (o_g, wo_a, zl, z_p)}
    why = restore_unsupported(k, o, ng, dts.pop() if len(dts) == 1 else "mixed dtypes", cfg)
    if why:
        raise ValueError(f"restore kernel: {why}")
    kind, row = addend_sources(zl_row, prot_idx, t)  # the kernel reads each row's source, not a scatter list
    a = jnp.pad(o_g.reshape(t, g * k), ((0, kind.shape[0] - t), (0, 0)))
    z = _kernel_call(a, wo_a, zl.reshape(zl.shape[0], g * o), z_p.reshape(z_p.shape[0], g * o),
                     addend_ids(kind, row, cfg), g=g, o=o, k=k, col0=heads[0] * k, cfg=cfg, interpret=interpret)
    return z[:t].reshape(t, g, o)


# ----------------------------------------------------------------------------- problems, benchmark
def make_problem(key, *, t: int, g: int = 8, hpg: int = 8, k: int = 512, o: int = 1024, pool: int | None = None,
                 protected: float = 0.25, runs: int = 0, global_head: int = 0, dtype=jnp.bfloat16):
    """A consumer-shaped random problem (Flash dimensions by default): rows split into restored
    (z_L from a pool of `pool` rows, in document order), protected (a `protected` share, z_p)
    and padding rows at the end. runs: 0, each row protected on its own (scattered, as budget-
    selected rows can be: the shortest addend chunks); n > 0, protected rows in runs of about n
    (as boundary rows and the tail are). Returns (args, kwargs) for restore / restore_reference."""
    ks = jax.random.split(key, 5)
    pool = pool or t
    o_g = (jax.random.normal(ks[0], (t, g, 1, k), jnp.float32)).astype(dtype)
    wo_a = (jax.random.normal(ks[1], (g * o, hpg * k), jnp.float32) * k ** -0.5).astype(dtype)
    zl = jax.random.normal(ks[2], (pool, g, o), jnp.float32).astype(dtype)
    if runs and protected > 0:  # alternating runs of geometric lengths: protected ones of mean `runs`
        rng = np.random.default_rng(np.asarray(jax.random.key_data(ks[3])).ravel())
        lens = rng.geometric([1 / runs if i % 2 else min(1.0, protected / (runs * (1 - protected) + 1e-9))
                              for i in range(2 * t)])
        prot = np.repeat(np.arange(2 * t) % 2 == 1, lens)[:t]
    else:
        prot = np.array(jax.random.bernoulli(ks[3], protected, (t,)))
    pad = max(1, t // 16) if t >= 32 else 0
    prot[t - pad:] = False
    real = np.arange(t) < t - pad
    base = int(jax.random.randint(ks[4], (), 0, max(1, pool - t + 1)))
    zl_row = np.where(real & ~prot, (base + np.arange(t)) % pool, -1).astype(np.int32)
    prot_idx = np.flatnonzero(prot)
    prot_idx = prot_idx if prot_idx.size else np.array([t])  # none protected: one padding entry
    z_p = jax.random.normal(ks[4], (prot_idx.size, g, o), jnp.float32).astype(dtype)
    args = (o_g, wo_a, zl, jnp.asarray(zl_row), z_p, jnp.asarray(prot_idx, jnp.int32))
    return args, {"global_heads": (global_head,)}


def moved_bytes(args) -> int:
    """Bytes a perfect restoration moves: o_G and the addend rows read, z written (the weight
    columns, 1 MB per group, are read once)."""
    o_g, wo_a, zl, zl_row, z_p, prot_idx = args
    t, g, _, k = o_g.shape
    o = zl.shape[2]
    rows_with_addend = int(np.sum((np.asarray(zl_row) >= 0) | (np.asarray(protected_rows(prot_idx, t)) >= 0)))
    return 2 * (t * g * k + rows_with_addend * g * o + t * g * o + g * o * k)


def bench_configs(forms, block_ns, steps, chunks, sizes, walks) -> list[RestoreConfig]:
    """The benchmark's configs, every combination in this order. One RestoreConfig refuses (over
    the shared-memory budget, a bad chunk) is said and left out, as is one whose kernel an earlier
    one already is: the same copy shapes (`copy_classes`) and the rest of the config equal, e.g.
    chunk 1 (or 2) with sizes pow2 and ends, so no kernel is timed twice."""
    configs, made = [], {}  # made: the kernel (copy shapes, the rest of the config) -> its first config
    for form, bn, st, ch, sz, wk in [(f, b, s, c, z, w) for f in forms for b in block_ns for s in steps for c in chunks
                                     for z in sizes for w in walks]:
        what = f"{form} block_n={bn} steps={st} chunk={ch} sizes={sz} walk={wk}"
        try:
            cfg = RestoreConfig(block_n=bn, steps=st, resident=form == "resident", chunk=ch, sizes=sz, walk=wk)
        except ValueError as e:
            print(f"{what}: not timed: {e}", flush=True)
            continue
        kernel = (copy_classes(ch, sz), dataclasses.replace(cfg, chunk=1, sizes="pow2"))
        if kernel in made:
            print(f"{what}: not timed: the kernel of chunk={made[kernel].chunk} sizes={made[kernel].sizes}", flush=True)
            continue
        made[kernel] = cfg
        configs.append(cfg)
    return configs


def main(argv=None):
    """Kernel forms vs XLA reference at consumer shapes, timed interleaved (each round times the
    reference and every kernel once); GB/s against a copy measured in the same run."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="8192,65536")
    ap.add_argument("--form", default="tiled,resident",
                    help="kernel forms to compare: tiled (a CTA per column block), resident (o_G in shared memory)")
    ap.add_argument("--block-n", default="128,256")
    ap.add_argument("--steps", default="2,3", help="RestoreConfig.steps variants to compare")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each figure is the median over them")
    ap.add_argument("--protected", type=float, default=0.25, help="protected share of the rows")
    ap.add_argument("--runs", default="0,32",
                    help="protected-row layouts (make_problem's runs): 0 scattered, n runs of about n rows")
    ap.add_argument("--chunk", default="1,16", help="RestoreConfig.chunk variants: the longest addend copy (1: per row)")
    ap.add_argument("--sizes", default="ends",
                    help="RestoreConfig.sizes variants: pow2 (copies of every power of two up to chunk rows), ends "
                         "(chunk rows or one row only); a config whose copies an earlier one already makes is not "
                         "timed twice (chunk 1 or 2: both the same)")
    ap.add_argument("--walk", default="copies",
                    help="RestoreConfig.walk variants: copies (a compact list, the config's default), rows (the "
                         "producer visits every row)")
    a = ap.parse_args(argv)
    forms, walks, sizes = a.form.split(","), a.walk.split(","), a.sizes.split(",")
    if any(f not in ("tiled", "resident") for f in forms):
        ap.error(f"--form: expected a comma list of tiled, resident, got {a.form!r}")
    if any(w not in WALKS for w in walks):
        ap.error(f"--walk: expected a comma list of {', '.join(WALKS)}, got {a.walk!r}")
    if any(v not in SIZES for v in sizes):
        ap.error(f"--sizes: expected a comma list of {', '.join(SIZES)}, got {a.sizes!r}")
    configs = bench_configs(forms, [int(v) for v in a.block_n.split(",")], [int(v) for v in a.steps.split(",")],
                            [int(v) for v in a.chunk.split(",")], sizes, walks)
    x = jnp.ones((1 << 28,), jnp.bfloat16)  # 512 MB: read + write
    copy = jax.jit(lambda u: u + 1)
    copy_gbs = 2 * x.nbytes / median_time(copy, x, iters=10) / 1e9
    del x
    peak = matmul_peak_tflops()
    rows = []
    for t, runs in [(int(v), int(r)) for v in a.rows.split(",") for r in a.runs.split(",")]:
        args, kw = make_problem(jax.random.key(t), t=t, protected=a.protected, runs=runs)
        kind, src = addend_sources(args[3], args[5], t)
        ref = jax.jit(functools.partial(restore_reference, **kw))
        zr = ref(*args)
        nbytes = moved_bytes(args)
        tflop = 2 * t * args[0].shape[1] * args[0].shape[3] * args[2].shape[2] / 1e12  # the Global-head product
        kers = [jax.jit(functools.partial(restore, **kw, config=cfg)) for cfg in configs]
        errs = [rel_err(ker(*args), zr) for ker in kers]  # compiled here, before any timing
        times = [[] for _ in range(len(kers) + 1)]  # the reference's, then each kernel's
        for _ in range(a.repeats):
            for ts, f in zip(times, [ref, *kers]):
                ts.append(median_time(f, *args))
        tr = float(np.median(times[0]))
        for cfg, err, ts in zip(configs, errs, times[1:]):
            tk = float(np.median(ts))
            copies = int(np.count_nonzero(addend_chunks(kind, src, cfg.chunk, cfg.sizes)))
            rows.append(dict(rows=t, runs=runs, protected=a.protected, addend_copies_per_row=copies / t, form=cfg.form,
                             walk=cfg.walk, sizes=cfg.sizes,
                             config=dataclasses.asdict(cfg), smem_bytes=cfg.smem_bytes(),
                             rel_err=err, kernel_ms=tk * 1e3, xla_ms=tr * 1e3, speedup=tr / tk,
                             kernel_ms_rounds=[v * 1e3 for v in ts], xla_ms_rounds=[v * 1e3 for v in times[0]],
                             kernel_gbs=nbytes / tk / 1e9, xla_gbs=nbytes / tr / 1e9,
                             kernel_frac_of_copy=nbytes / tk / 1e9 / copy_gbs, kernel_tflops=tflop / tk,
                             xla_tflops=tflop / tr))
            print(f"t={t:6d} runs={runs:2d} ({copies / t:.2f} copies/row) {cfg.form:8s} block_n={cfg.block_n:3d} "
                  f"steps={cfg.steps} chunk={cfg.chunk:2d} sizes={cfg.sizes:4s} walk={cfg.walk:6s} err {err:.1e} "
                  f"kernel {tk * 1e3:7.3f} ms xla {tr * 1e3:7.3f} ms x{tr / tk:4.2f} {nbytes / tk / 1e9:6.0f} GB/s "
                  f"({nbytes / tk / 1e9 / copy_gbs:.0%} of copy {copy_gbs:.0f}), {tflop / tk:.0f} TFLOP/s "
                  f"(peak {peak:.0f})", flush=True)
    return record("restore", a.json, argv, copy_gbs=copy_gbs, matmul_peak_tflops=peak, rows=rows)


if __name__ == "__main__":
    main()
