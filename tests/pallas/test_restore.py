"""Fused restoration: the reference against the per-head-role formulation of the eager runtime
(CPU), the Mosaic GPU kernel against the reference in interpret mode (CPU) and on a GPU, its
CUDA lowering (CPU), and bad inputs."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax.pallas import restore as rs
from tests.pallas.kernel_case import kernel_case
from tests.tolerances import TOL, rel_err


def _roles_formulation(o_all, wo_a, zl, zl_row, p_row, global_head):
    """The eager runtime's shape of the same state: every head's output projected through wo_a
    twice, once with the Local heads zeroed and once with the Global heads zeroed; the Local part
    replaced by z_L on restored rows; protected rows keep the native projection of all heads."""
    t, h, k = o_all.shape
    g = zl.shape[1]
    hpg = h // g
    is_glob = (np.arange(h) % hpg) == global_head
    wa = wo_a.reshape(g, -1, hpg * k)

    def project(mask):
        oh = (o_all * jnp.asarray(mask, o_all.dtype)[None, :, None]).reshape(t, g, hpg * k)
        return jnp.einsum("tgi,goi->tgo", oh, wa, precision=jax.lax.Precision.HIGHEST)

    z_g, z_l = project(is_glob), project(~is_glob)
    restored = (zl_row >= 0)[:, None, None]
    z = z_g + jnp.where(restored, zl[jnp.maximum(zl_row, 0)], 0.0)
    return jnp.where((p_row >= 0)[:, None, None], z_g + z_l, z), z_g + z_l


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_is_row_replacement(seed):
    """Identity (fp32): restored rows are W_G o_G + z_L, never W_G o_G + W_L o_L + z_L; protected
    rows equal the native projection of all heads; padding rows keep W_G o_G."""
    t, g, hpg, k, o, gh = 40, 4, 4, 16, 24, 1
    ks = jax.random.split(jax.random.key(seed), 3)
    o_all = jax.random.normal(ks[0], (t, g * hpg, k), jnp.float32)
    args, kw = rs.make_problem(ks[1], t=t, g=g, hpg=hpg, k=k, o=o, global_head=gh, dtype=jnp.float32)
    _, wo_a, zl, zl_row, _, prot_idx = args
    p_row = rs.protected_rows(prot_idx, t)
    want, native = _roles_formulation(o_all, wo_a, zl, zl_row, p_row, gh)
    z_p = native[jnp.minimum(prot_idx, t - 1)]  # the protected rows' native projection, in list order
    o_g = o_all.reshape(t, g, hpg, k)[:, :, gh:gh + 1]
    got = rs.restore_reference(o_g, wo_a, zl, zl_row, z_p, prot_idx, **kw)
    assert rel_err(got, want) < 1e-5
    assert bool((p_row >= 0).any()) and bool((zl_row >= 0).any()) and bool(((zl_row < 0) & (p_row < 0)).any())
    # negative control: adding z_L on top of a Local recomputation is a different state
    assert rel_err(got, want + jnp.where((zl_row >= 0)[:, None, None], native - want, 0)) > 1e-2


def test_protected_rows_inverse_map():
    p = rs.protected_rows(jnp.asarray([2, 5, 9, 9], jnp.int32), 9)  # 9 = padding, dropped
    assert np.asarray(p).tolist() == [-1, -1, 0, -1, -1, 1, -1, -1, -1]


def test_addend_chunks():
    """Aligned runs of consecutive source rows of one kind become one copy of 16, 8, 4 or 2 rows
    (the largest aligned one), the rows it covers and padding rows none; on random layouts every
    row with an addend is covered by exactly one chunk of its own kind and consecutive sources."""
    kind = np.array([1] * 20 + [2, 2, 1, 0] * 3 + [1] * 16 + [0] * 80, np.int32)
    row = np.concatenate([np.arange(20) + 5, [0, 1, 30, 0, 2, 3, 31, 0, 4, 5, 40, 0], np.arange(16) + 100,
                          np.zeros(80, int)]).astype(np.int32)
    row[7] = 99  # breaks the first 16-row run: 8 of rows 8..15, 4 of 0..3, 2 of 4..5, 1 and 1
    got = np.asarray(rs.addend_chunks(jnp.asarray(kind), jnp.asarray(row)))
    assert got[:48].tolist() == ([4, 0, 0, 0, 2, 0, 1, 1, 8] + [0] * 7 + [4, 0, 0, 0]
                                 + [2, 0, 1, 0] * 3 + [16] + [0] * 15)
    assert (got[48:] == 0).all()
    for runs in (0, 8):
        kind, src = _random_sources(runs)
        size = _check_chunks(kind, src, rs.addend_chunks(kind, src), (16, 8, 4, 2, 1))
        assert size.max() == (16 if runs else 8)  # the longest chunks these layouts hold


def _random_sources(runs, t=1024):
    """(kind, source row) of a random consumer layout (`make_problem`; runs 0: scattered)."""
    args, _ = rs.make_problem(jax.random.key(runs), t=t, g=1, hpg=2, k=64, o=64, runs=runs)
    return rs.addend_sources(args[3], args[5], t)


def _check_chunks(kind, src, size, allowed):
    """size (`addend_chunks`) as chunks: each of an allowed size s, starting at a multiple of s,
    of rows of one kind with consecutive source rows; every row with an addend covered by exactly
    one chunk, padding rows by none. Returns size as numpy."""
    kind, src, size = (np.asarray(a) for a in (kind, src, size))
    hits = np.zeros(kind.shape[0], int)
    for r in np.flatnonzero(size):
        s = size[r]
        assert s in allowed and r % s == 0 and (kind[r:r + s] == kind[r]).all()
        assert (src[r:r + s] == src[r] + np.arange(s)).all()
        hits[r:r + s] += 1
    assert (hits == (kind > 0)).all()
    return size


def test_addend_chunks_ends():
    """sizes "ends": copies of chunk rows or of one row, nothing between. On the hand-made layout
    of test_addend_chunks the broken 16-row run copies row by row (pow2 makes 8 + 4 + 2 of it)
    and the whole one at 32 stays one copy (two of 8 at chunk 8); on random layouts every aligned
    chunk whose rows are one kind with consecutive sources is one copy, every other row with an
    addend alone, and more copies than pow2 make."""
    kind = np.array([1] * 20 + [2, 2, 1, 0] * 3 + [1] * 16 + [0] * 80, np.int32)
    row = np.concatenate([np.arange(20) + 5, [0, 1, 30, 0, 2, 3, 31, 0, 4, 5, 40, 0], np.arange(16) + 100,
                          np.zeros(80, int)]).astype(np.int32)
    row[7] = 99
    kind, row = jnp.asarray(kind), jnp.asarray(row)
    got = np.asarray(rs.addend_chunks(kind, row, 16, "ends"))
    assert got[:48].tolist() == [1] * 20 + [1, 1, 1, 0] * 3 + [16] + [0] * 15 and (got[48:] == 0).all()
    got = np.asarray(rs.addend_chunks(kind, row, 8, "ends"))
    assert got[:48].tolist() == [1] * 8 + [8] + [0] * 7 + [1] * 4 + [1, 1, 1, 0] * 3 + ([8] + [0] * 7) * 2
    assert rs.chunk_sizes(16, "ends") == (16,) and rs.chunk_sizes(1, "ends") == ()
    assert rs.copy_classes(16, "ends") == ((1, 1), (2, 1), (1, 16), (2, 16))
    for runs in (0, 8):
        kind, src = _random_sources(runs)
        for chunk in (4, 16):
            size = _check_chunks(kind, src, rs.addend_chunks(kind, src, chunk, "ends"), (chunk, 1))
            k, r = np.asarray(kind).reshape(-1, chunk), np.asarray(src).reshape(-1, chunk)
            whole = (k == k[:, :1]).all(1) & (k[:, 0] > 0) & (r == r[:, :1] + np.arange(chunk)).all(1)
            np.testing.assert_array_equal(size[::chunk] == chunk, whole)  # every aligned run merged
            assert whole.any() == (runs > 0 or chunk == 4)  # scattered rows hold no aligned 16-row run
            assert np.count_nonzero(size) > np.count_nonzero(rs.addend_chunks(kind, src, chunk))
    with pytest.raises(ValueError, match="sizes: expected one of pow2, ends, got 'all'"):
        rs.addend_chunks(kind, src, 16, "all")


def _check_copies(kind, src, size, copies, max_chunk, sizes="pow2"):
    """The compact lists hold exactly addend_chunks' copies: per half, entry i < count starts a
    chunk of its size at its offset, with that row's source and kind; entries are grouped by
    class in `copy_classes` order (in row order within one), zeros past the count; replaying
    the entries covers every row with an addend once."""
    classes = rs.copy_classes(max_chunk, sizes)
    kind, src, size = (np.asarray(a) for a in (kind, src, size))
    off, source, knd, sz, start = (np.asarray(a) for a in copies)
    blocks = kind.shape[0] // rs.BLOCK_T
    assert off.shape == (blocks, 2, rs.WG_ROWS) and start.shape == (blocks, 2, len(classes) + 1)
    hits = np.zeros(kind.shape[0], int)
    for b in range(blocks):
        for w in range(2):
            base = b * rs.BLOCK_T + w * rs.WG_ROWS
            n = start[b, w, -1]
            assert n == np.count_nonzero(size[base:base + rs.WG_ROWS])
            assert start[b, w, 0] == 0 and (np.diff(start[b, w]) >= 0).all()
            for c, (want, s) in enumerate(classes):
                e = slice(start[b, w, c], start[b, w, c + 1])
                assert (knd[b, w, e] == want).all() and (sz[b, w, e] == s).all()
                assert (np.diff(off[b, w, e]) > 0).all()
            for i in range(n):
                r = b * rs.BLOCK_T + off[b, w, i]
                assert w * rs.WG_ROWS <= off[b, w, i] < (w + 1) * rs.WG_ROWS
                assert (size[r], kind[r], src[r]) == (sz[b, w, i], knd[b, w, i], source[b, w, i])
                hits[r:r + sz[b, w, i]] += 1
            for a in (off, source, knd, sz):
                assert (a[b, w, n:] == 0).all()
    assert (hits == (kind > 0)).all()


def test_addend_copies():
    """The copies walk's lists (`addend_copies`) against addend_chunks, on the hand-made layout
    of test_addend_chunks and on random ones (scattered and runs, chunk 1 and 16, sizes pow2 and
    ends at 16), and their packing into the kernel's ids (`copy_ids`)."""
    kind = np.array([1] * 20 + [2, 2, 1, 0] * 3 + [1] * 16 + [0] * 80, np.int32)
    row = np.concatenate([np.arange(20) + 5, [0, 1, 30, 0, 2, 3, 31, 0, 4, 5, 40, 0], np.arange(16) + 100,
                          np.zeros(80, int)]).astype(np.int32)
    row[7] = 99
    kind, row = jnp.asarray(kind), jnp.asarray(row)
    size = rs.addend_chunks(kind, row)
    copies = rs.addend_copies(kind, row, size)
    _check_copies(kind, row, size, copies, 16)
    # half 0, by class: the single z_L rows 6, 7, 22, 26, 30, then z_L's 16-row run at 32, its
    # 8 rows at 8, its 4-row runs at 0 and 16, its pair at 4, then the z_p pairs at 20, 24, 28
    n = int(copies.start[0, 0, -1])
    assert np.asarray(copies.offset[0, 0, :n]).tolist() == [6, 7, 22, 26, 30, 32, 8, 0, 16, 4, 20, 24, 28]
    assert np.asarray(copies.size[0, 0, :n]).tolist() == [1] * 5 + [16, 8, 4, 4] + [2] * 4
    assert np.asarray(copies.kind[0, 0, :n]).tolist() == [1] * 10 + [2] * 3
    assert np.asarray(copies.start[0, 1]).tolist() == [0] * 11  # rows 64..127: padding, no copy
    for runs in (0, 8):
        args, _ = rs.make_problem(jax.random.key(runs), t=1000, g=1, hpg=2, k=64, o=64, runs=runs)
        kind, src = rs.addend_sources(args[3], args[5], 1000)
        for chunk, sizes in ((16, "ends"), (1, "pow2"), (16, "pow2")):
            size = rs.addend_chunks(kind, src, chunk, sizes)
            copies = rs.addend_copies(kind, src, size, chunk, sizes)
            _check_copies(kind, src, size, copies, chunk, sizes)
    ids = np.asarray(rs.copy_ids(kind, copies))
    assert ids.shape == (4, 1024)
    np.testing.assert_array_equal(ids[1], np.asarray(kind))  # the consumers' per-row kinds
    np.testing.assert_array_equal(ids[0].reshape(copies.source.shape), np.asarray(copies.source))
    np.testing.assert_array_equal(ids[2].reshape(copies.offset.shape), np.asarray(copies.offset))
    heads = ids[3].reshape(-1, 2, rs.WG_ROWS)
    np.testing.assert_array_equal(heads[..., :11], np.asarray(copies.start))
    assert (heads[..., 11:] == 0).all()
    assert ids.shape[0] == rs.RestoreConfig(walk="copies").id_rows


@pytest.mark.parametrize("seed,t,k,bn,steps,resident,runs,chunk,walk,sizes", [(*c, "pow2") for c in [
    (0, 256, 256, 128, 2, False, 0, 1, "rows"), (1, 100, 128, 64, 3, False, 0, 1, "rows"),
    (3, 256, 128, 128, 2, False, 16, 1, "rows"),
    # protected rows in runs: 16-row copies of z_L and of z_p
    (2, 256, 128, 128, 2, False, 16, 16, "rows"),
    # resident: 2 column blocks, slots dividing the 4 steps; 4 column blocks of 2 steps through 3
    # slots (slot indices computed in the loop, the weight stream running 1-2 blocks ahead)
    (0, 256, 256, 128, 2, True, 0, 1, "rows"), (1, 100, 128, 64, 3, True, 0, 1, "rows"),
    (2, 256, 128, 128, 2, True, 16, 16, "rows"),
    # the copies walk: halves of 64 copies (no plain arrival; lists split over 4 steps), short
    # chunks of scattered rows, a half with no copy (t 60: 64 plain arrivals), 16-row copies of
    # runs; resident over 2 and 4 column blocks (the lists re-walked per block)
    (0, 256, 256, 128, 2, False, 0, 1, "copies"), (1, 100, 128, 64, 3, False, 0, 16, "copies"),
    (4, 60, 128, 64, 2, False, 0, 16, "copies"), (2, 256, 128, 128, 2, False, 16, 16, "copies"),
    (0, 256, 256, 128, 2, True, 16, 16, "copies"), (1, 100, 128, 64, 3, True, 0, 1, "copies")]] + [
    # sizes "ends" at chunk 16: 16-row copies or single rows (the copies walk's 4 shapes), of runs
    # (16-row copies of z_L and z_p) and of scattered rows (all single: the 16-row loops run
    # empty, where pow2 copies 2, 4 and 8 rows); the rows walk's test of the 4 shapes, resident
    (2, 256, 128, 128, 2, False, 16, 16, "copies", "ends"), (5, 256, 128, 64, 3, False, 0, 16, "copies", "ends"),
    (2, 256, 128, 128, 2, True, 16, 16, "rows", "ends")])
def test_kernel_matches_reference_interpret(seed, t, k, bn, steps, resident, runs, chunk, walk, sizes):
    """The kernel itself, both forms and both walks, run by Mosaic GPU interpret mode on CPU (GPU:
    natively), on a small consumer-shaped problem: restored, protected and padding rows, rows not
    a multiple of 64, more contraction steps than slots (slots reused) and fewer, addend copies
    of 1 to 16 rows (every size, or 16 and 1 only). Interpret mode fills the output and the shared memory with NaN before the
    kernel runs (uninitialized_memory="nan"), so an element the kernel never writes, or an addend
    row no copy fetched, is caught."""
    args, kw = rs.make_problem(jax.random.key(seed), t=t, g=2, hpg=4, k=k, o=256, pool=300, global_head=2, runs=runs)
    cfg = rs.RestoreConfig(block_n=bn, steps=steps, resident=resident, chunk=chunk, walk=walk, sizes=sizes)
    got = rs.restore(*args, **kw, config=cfg)
    want = rs.restore_reference(*args, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))
    assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < TOL["kernel_bf16_o"][0]
    # the protected rows are exactly z_p's (replaced, not added)
    p = np.asarray(rs.protected_rows(args[5], t))
    np.testing.assert_array_equal(np.asarray(got)[p >= 0], np.asarray(args[4])[p[p >= 0]])
    # every kind of row is present and right on its own (restored, padding)
    zl_row = np.asarray(args[3])
    for rows in (zl_row >= 0, (zl_row < 0) & (p < 0)):
        assert rows.any()
        assert rel_err(got[rows].astype(jnp.float32), want[rows].astype(jnp.float32)) < TOL["kernel_bf16_o"][0]


@pytest.mark.parametrize("bn,steps,resident,chunk,walk,sizes", [(*c, "pow2") for c in [
    (256, 3, False, 1, "rows"), (128, 4, False, 1, "rows"), (128, 4, True, 1, "rows"), (128, 3, True, 1, "rows"),
    (256, 3, False, 16, "copies"), (128, 4, True, 1, "copies"), (128, 3, True, 16, "copies")]] + [
    (256, 3, False, 16, "copies", "ends")])
def test_kernel_lowers_for_cuda(bn, steps, resident, chunk, walk, sizes):
    """Flash shapes (8 groups, k 512, o 1024): the Mosaic GPU lowering (layout inference, TMA
    shapes, and Mosaic's own shared-memory check against 227 KB) runs on CPU. The resident
    default (block_n 128, 4 slots) is the tightest budget (231,936 bytes by `smem_bytes`; the
    copies walk's fourth id row makes it 232,448, the budget itself); with 3 slots, which do not
    divide the 8 steps, the slot indices are computed in the loop. The copies walk's loops have
    bounds read from shared memory (4 loops per half and step at chunk 16 sizes "ends")."""
    args, kw = rs.make_problem(jax.random.key(0), t=256)
    cfg = rs.RestoreConfig(block_n=bn, steps=steps, resident=resident, chunk=chunk, walk=walk, sizes=sizes)
    f = jax.jit(lambda *a: rs.restore(*a, **kw, config=cfg, interpret=False))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_config_budget(refused):
    """Shared memory: the resident form holds o_G [128, 512] (128 KB), so block_n 256 does not
    fit beside its weight slots and output rows; the defaults fit; a larger head dim is refused."""
    assert rs.default_config(1024) == rs.RestoreConfig(block_n=256, steps=3, chunk=16, sizes="ends")
    res = rs.default_config(1024, resident=True)
    assert res == rs.RestoreConfig(block_n=128, steps=4, resident=True) and res.smem_bytes() <= rs.SMEM_LIMIT
    for steps in (2, 3, 4):
        with pytest.raises(ValueError, match=r"shared memory at k=512 > 232448.*o_G \[128, 512\]"):
            rs.RestoreConfig(block_n=256, steps=steps, resident=True)
    with pytest.raises(ValueError, match="resident"):
        rs.RestoreConfig(resident="yes")
    with pytest.raises(ValueError, match="chunk: expected one of 1, 16, 8, 4, 2, got 3"):
        rs.RestoreConfig(chunk=3)
    with pytest.raises(ValueError, match="RestoreConfig.walk: expected one of rows, copies, got 'chunks'"):
        rs.RestoreConfig(walk="chunks")
    refused(rs.main, ["--walk", "rows,chunks"], "--walk: .*'rows,chunks'")  # refused before anything runs
    with pytest.raises(ValueError, match="RestoreConfig.sizes: expected one of pow2, ends, got 'mid'"):
        rs.RestoreConfig(chunk=16, sizes="mid")
    refused(rs.main, ["--sizes", "pow2,mid"], "--sizes: .*'pow2,mid'")
    # the benchmark times each kernel once: chunk 1 is one kernel whatever the sizes
    got = rs.bench_configs(["tiled"], [256], [3], [1, 16], ["pow2", "ends"], ["copies"])
    assert [(c.chunk, c.sizes) for c in got] == [(1, "pow2"), (16, "pow2"), (16, "ends")]
    # the copies walk's fourth row of ids: 512 bytes more, the resident default still fits
    copies = rs.RestoreConfig(block_n=128, steps=4, resident=True, walk="copies")
    rows = rs.RestoreConfig(block_n=128, steps=4, resident=True, walk="rows")
    assert copies.smem_bytes() == rows.smem_bytes() + 512 <= rs.SMEM_LIMIT
    assert "shared memory at k=1024" in rs.restore_unsupported(1024, 1024, 1, jnp.bfloat16, res)
    assert rs.restore_unsupported(1024, 1024, 1, jnp.bfloat16, rs.RestoreConfig(block_n=256)) is None
    assert rs.restore_unsupported(512, 1024, 1, jnp.bfloat16, res) is None


def test_bad_inputs_raise():
    args, kw = rs.make_problem(jax.random.key(4), t=64, g=2, hpg=4, k=64, o=128)
    o_g, wo_a, zl, zl_row, z_p, prot_idx = args
    with pytest.raises(ValueError, match="zl"):
        rs.restore_reference(o_g, wo_a, zl[:, :1], zl_row, z_p, prot_idx, **kw)
    with pytest.raises(ValueError, match="prot_idx"):
        rs.restore_reference(o_g, wo_a, zl, zl_row, z_p, prot_idx[:-1], **kw)
    with pytest.raises(ValueError, match="Global heads"):
        rs.restore_reference(o_g, wo_a, zl, zl_row, z_p, prot_idx, global_heads=(7,))
    with pytest.raises(ValueError, match="bf16"):
        rs.restore(o_g.astype(jnp.float32), wo_a, zl, zl_row, z_p, prot_idx, **kw)
    with pytest.raises(ValueError, match="bf16"):
        rs.restore(o_g.astype(jnp.float32), wo_a.astype(jnp.float32), zl.astype(jnp.float32), zl_row,
                   z_p.astype(jnp.float32), prot_idx, **kw)
    with pytest.raises(ValueError, match="one Global head"):
        rs.restore(jnp.concatenate([o_g, o_g], 2), wo_a, zl, zl_row, z_p, prot_idx, global_heads=(0, 1))
    with pytest.raises(ValueError, match="block_n"):
        rs.RestoreConfig(block_n=96)
    with pytest.raises(ValueError, match="steps"):
        rs.RestoreConfig(steps=1)
    with pytest.raises(ValueError, match="shared memory"):
        rs.RestoreConfig(block_n=256, steps=4)
    with pytest.raises(ValueError, match="block_n"):
        rs.restore(o_g, wo_a, zl, zl_row, z_p, prot_idx, **kw, config=rs.RestoreConfig(block_n=256))


def _poisoned_run(f, *a, **k):
    out = jax.eval_shape(lambda: f(*a, **k))
    for s in jax.tree.leaves(out):
        jnp.full(s.shape, jnp.nan, s.dtype).block_until_ready().delete()
    return jax.block_until_ready(f(*a, **k))


@pytest.mark.gpu
@pytest.mark.parametrize("walk", ["rows", "copies"])
@pytest.mark.parametrize("seed,t,bn,steps,resident,runs,chunk,sizes", [(*c, "pow2") for c in [
    (0, 4096, 256, 3, False, 0, 1), (1, 1000, 256, 2, False, 0, 16), (2, 64, 64, 2, False, 0, 1),
    (3, 4096, 128, 4, False, 0, 16), (4, 1000, 128, 3, False, 0, 1), (5, 4096, 256, 3, False, 32, 16),
    (6, 4096, 256, 3, False, 32, 1),
    (0, 4096, 128, 4, True, 0, 1), (1, 1000, 128, 2, True, 0, 16), (2, 64, 64, 2, True, 0, 1),
    (3, 4096, 64, 3, True, 0, 16), (4, 1000, 128, 3, True, 0, 1), (5, 4096, 128, 4, True, 32, 16)]] + [
    # chunk 16 with sizes "ends": 16-row copies or single rows (runs, tiled; scattered, resident)
    (7, 4096, 256, 3, False, 32, 16, "ends"), (8, 1000, 128, 3, True, 0, 16, "ends")])
def test_kernel_matches_reference_gpu(seed, t, bn, steps, resident, runs, chunk, sizes, walk):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args, kw = rs.make_problem(jax.random.key(seed), t=t, runs=runs)
    cfg = rs.RestoreConfig(block_n=bn, steps=steps, resident=resident, chunk=chunk, walk=walk, sizes=sizes)
    got = _poisoned_run(rs.restore, *args, **kw, config=cfg)
    want = rs.restore_reference(*args, **kw)
    assert bool(jnp.all(jnp.isfinite(got.astype(jnp.float32))))
    assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < TOL["kernel_bf16_o"][0]
    p = np.asarray(rs.protected_rows(args[5], t))
    np.testing.assert_array_equal(np.asarray(got)[p >= 0], np.asarray(args[4])[p[p >= 0]])


def test_consumer_runs_the_kernel(monkeypatch):
    """Both arms with kernels="indexer,restore" (the restoration and indexer-score kernels, interpret mode
    on CPU) give the logits of kernels="xla" on a bf16 tiny model (head dims and output rank
    widened to the kernels' tiles); a model the kernels cannot run is refused at construction."""
    import dataclasses

    from redknot_jax.init import random_model
    from redknot_jax.pallas import indexer_scores as ix
    from redknot_jax.reuse.runtime import ReuseRuntime

    cfg, model, prof, arts, req = kernel_case()

    traced = []  # indexer kernel calls traced into the mosaic programs
    kernel = ix.indexer_scores
    monkeypatch.setattr(ix, "indexer_scores", lambda *a, **k: traced.append(a[0].shape) or kernel(*a, **k))
    restored = []  # restoration kernel calls traced into the consumer's reusable layers
    from redknot_jax.reuse import layer

    restore = layer.restore_kernel
    monkeypatch.setattr(layer, "restore_kernel", lambda *a, **k: restored.append(a[0].shape) or restore(*a, **k))
    # the XLA side named explicitly: "auto" resolves to the faster kernels on a GPU
    xla = ReuseRuntime(model, prof, "fp", kernels="xla")
    mosaic = ReuseRuntime(model, prof, "fp", kernels="indexer,restore")
    a = xla.prefill(req, "redknot", require_reuse=True)
    b = mosaic.prefill(req, "redknot", require_reuse=True)
    assert 0 < b.plan.fraction_protected() < 1 and (a.plan.protected == b.plan.protected).all()
    assert rel_err(b.logits, a.logits) < TOL["kernel_bf16_o"][0]
    assert traced and mosaic.consumer.kernels == "indexer,restore" and xla.consumer.kernels == ""
    assert len(restored) == len(mosaic.reusable)  # every reusable layer restored by the kernel, not its reference
    a, n_redknot = xla.prefill(req, "recompute"), len(traced)
    jax.clear_caches()  # the native layers retraced: the Recomputed arm's own calls are counted
    b = mosaic.prefill(req, "recompute")
    assert rel_err(b.logits, a.logits) < TOL["kernel_bf16_o"][0]
    assert len(traced) > n_redknot
    with pytest.raises(ValueError, match="indexer,restore.*indexer head dim 16"):
        ReuseRuntime(random_model(dataclasses.replace(cfg, index_head_dim=16), seed=5, dtype=jnp.bfloat16), prof,
                     "fp", kernels="indexer,restore")
    with pytest.raises(ValueError, match="indexer,restore.*bf16"):
        ReuseRuntime(random_model(cfg, seed=5, dtype=jnp.float32), prof, "fp", kernels="indexer,restore")
    with pytest.raises(ValueError, match="kernels"):
        ReuseRuntime(model, prof, "fp", kernels="triton")
