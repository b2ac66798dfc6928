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

Kernel layout: one CTA per (128 rows, group, block_n output columns), three warpgroups. A
producer warpgroup issues the TMA copies: per contraction step of 64 the two consumers' o_G rows
[128, 64] and the wo_a tile [block_n, 64] (the group's rows, the Global head's columns, read in
place: no weight copy) into one of `steps` slots; and, between the first steps, each row's
addend by a one-row TMA copy from its source, z_L pool row, z_p row or a zero row (TMA has no
gather on Hopper; a copy per row is the gather), onto one barrier per consumer. Each consumer
warpgroup owns 64 rows (the wgmma M), shares the weight tile with the other, keeps one wgmma in
flight and releases a slot when its product is done. Its epilogue drops the product of
protected rows, adds the addend in fp32 in place of the addend in shared memory (each thread
writes the elements it read) and stores its rows with one TMA copy. Limits: one Global head per
group (nG = 1, the profiles' "7 of every 8 heads restored"), bf16, k % 64 == 0, o % block_n == 0.
Mosaic GPU interpret mode runs this kernel on CPU (its wgmma operands all come from shared
memory), so CPU CI tests the kernel itself, not only its lowering.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from redknot_jax.pallas import interpret_params
from redknot_jax.pallas.timing import matmul_peak_tflops, median_time, record, rel_err

HIGHEST = jax.lax.Precision.HIGHEST
WG_ROWS = 64  # wgmma M of one consumer warpgroup
BLOCK_T = 2 * WG_ROWS  # rows per CTA: two consumer warpgroups
BLOCK_K = 64  # one 128-byte swizzle row of bf16: the contraction step
SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class RestoreConfig:
    """Tiling: block_n output columns per CTA (wgmma N, shared by both consumers), steps the
    number of operand slots of the contraction pipeline. Shared memory: steps * (128 + block_n)
    * 64 * 2 bytes of operands, 128 * block_n * 2 of addend rows (the output staging too) and
    the rows' (source row, kind) pairs."""

    block_n: int = 256
    steps: int = 3

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"RestoreConfig.block_n: expected 64, 128 or 256, got {self.block_n}")
        if not 2 <= self.steps <= 4:
            raise ValueError(f"RestoreConfig.steps: expected 2..4, got {self.steps}")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"RestoreConfig: {self.smem_bytes()} bytes of shared memory > {SMEM_LIMIT}")

    def smem_bytes(self) -> int:
        return (self.steps * (BLOCK_T + self.block_n) * BLOCK_K * 2 + BLOCK_T * self.block_n * 2
                + 2 * BLOCK_T * 4 + 1024)


def default_config(o: int) -> RestoreConfig:
    """The widest block_n that divides the output-group rank (Flash / Pro: 1024 -> 256)."""
    bn = next((b for b in (256, 128) if o % b == 0), 64)
    return RestoreConfig(block_n=bn)


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


def _kernel_call(a, wo_a, zl, zp, z0, idx, *, g, o, k, col0, cfg, interpret):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from redknot_jax.pallas.seg_attention import specialise

    t = a.shape[0]
    bt, bn, nk, slots = BLOCK_T, cfg.block_n, k // BLOCK_K, cfg.steps
    dtype = a.dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(a_ref, w_ref, zl_ref, zp_ref, z0_ref, idx_ref, out_ref, scratch):
        (a_s, w_s, add_s, idx_s), (idx_bar, ready, add_bar, free) = scratch
        r0 = lax.axis_index("t") * bt
        c0 = lax.axis_index("g") * o + lax.axis_index("n") * bn  # this tile's columns of z [t, g*o]
        a0 = lax.axis_index("g") * k  # the group's Global head in o_G [t, g*k]

        def consumer(w):
            plgpu.set_max_registers(232, action="increase")
            rows = pl.ds(w * WG_ROWS, WG_ROWS)

            def product(acc_ref):
                for s in range(nk):  # one wgmma in flight: step s - 1's slot is free once s is issued
                    plgpu.barrier_wait(ready.at[s % slots])
                    plgpu.wgmma(acc_ref, a_s.at[s % slots, rows], w_s.at[s % slots].T)
                    plgpu.wgmma_wait(1)
                    if s:
                        plgpu.barrier_arrive(free.at[(s - 1) % slots])
                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free.at[(nk - 1) % slots])
                return acc_ref[...]

            acc = pl.run_scoped(product, plgpu.ACC((WG_ROWS, bn), jnp.float32))
            plgpu.barrier_wait(idx_bar)
            plgpu.barrier_wait(add_bar.at[w])
            kinds = plgpu.load(idx_s.at[1, rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            keep = lax.broadcast_in_dim(kinds != 2, (WG_ROWS, bn), [0])  # protected rows: replaced
            # the addend's elements are overwritten by the threads that read them (whole rows: a
            # column slice of this buffer gave wrong results on the H200 at block_n 128)
            add = plgpu.load(add_s.at[rows], layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
            add_s.at[rows][...] = (jnp.where(keep, acc, 0.0) + add).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(add_s.at[rows], out_ref.at[pl.ds(r0 + w * WG_ROWS, WG_ROWS), pl.ds(c0, bn)])
            plgpu.wait_smem_to_gmem(0)

        def producer():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(idx_ref.at[:, pl.ds(r0, bt)], idx_s, idx_bar)

            def load(s):
                plgpu.copy_gmem_to_smem(a_ref.at[pl.ds(r0, bt), pl.ds(a0 + s * BLOCK_K, BLOCK_K)], a_s.at[s % slots],
                                        ready.at[s % slots])
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(c0, bn), pl.ds(col0 + s * BLOCK_K, BLOCK_K)],
                                        w_s.at[s % slots], ready.at[s % slots])

            def addends(lo, hi):  # rows lo .. hi - 1: each row's addend from its source, one copy per row
                for w in (0, 1):
                    a_lo, a_hi = max(lo, w * WG_ROWS), min(hi, (w + 1) * WG_ROWS)
                    if a_lo >= a_hi:
                        continue

                    @pl.loop(a_lo, a_hi)
                    def _row(rr, w=w):
                        src, kind = idx_s[0, rr], idx_s[1, rr]
                        for want, ref in ((0, z0_ref), (1, zl_ref), (2, zp_ref)):
                            @pl.when(kind == want)
                            def _(ref=ref):
                                plgpu.copy_gmem_to_smem(ref.at[pl.ds(src, 1), pl.ds(c0, bn)], add_s.at[pl.ds(rr, 1)],
                                                        add_bar.at[w])

            for s in range(min(slots, nk)):
                load(s)
            plgpu.barrier_wait(idx_bar)
            for s in range(nk):  # the addend copies spread over the steps, issued while the consumers compute
                addends(s * bt // nk, (s + 1) * bt // nk)
                if s + slots < nk:
                    plgpu.barrier_wait(free.at[s % slots])  # both consumers are done with step s
                    load(s + slots)
            for s in range(max(nk - slots, 0), nk):  # observe the last releases (every phase is waited on)
                plgpu.barrier_wait(free.at[s % slots])

        specialise(lax.axis_index("wg"), consumer, producer)

    scratch = (
        (plgpu.SMEM((slots, bt, BLOCK_K), dtype, transforms=tiled),
         plgpu.SMEM((slots, bn, BLOCK_K), dtype, transforms=tiled),
         plgpu.SMEM((bt, bn), dtype),  # addend rows, then the output rows
         plgpu.SMEM((2, bt), jnp.int32)),
        # ids ready; a slot's operands ready (two copies); a consumer's addend rows (one copy per
        # row); a slot free (both consumers)
        (plgpu.Barrier(), plgpu.Barrier(num_arrivals=2, num_barriers=slots),
         plgpu.Barrier(num_arrivals=WG_ROWS, num_barriers=2), plgpu.Barrier(num_arrivals=2, num_barriers=slots)),
    )

    def entry(*refs):
        pl.run_scoped(lambda *sc: body(*refs, sc), *scratch, collective_axes="wg")

    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((t, g * o), dtype), grid=(t // bt, g, o // bn),
        grid_names=("t", "g", "n"), num_threads=3, thread_name="wg",
        # No automatic warpgroup barriers (Pallas would put one before each of the 128 addend
        # copies). Safe: the producer reads only the ids, after their barrier; each consumer thread
        # overwrites only the addend elements it read itself, and commit_smem (a fence and a
        # warpgroup barrier) precedes the output's TMA.
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True),
        interpret=interpret_params(interpret))(a, wo_a, zl, zp, z0, idx)


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
    return None


def restore(o_g, wo_a, zl, zl_row, z_p, prot_idx, *, global_heads, config: RestoreConfig | None = None,
            interpret: bool | None = None):
    """Mosaic GPU fused restoration; same signature and result as `restore_reference`.

    Supported: one Global head per group, bf16 operands, k % 64 == 0, o % block_n == 0; anything
    else raises ValueError (the caller then uses the reference explicitly). Rows are padded to
    a multiple of 128 here when needed (a copy; the consumer's row counts are multiples of 128).
    interpret: Mosaic GPU interpret mode; None = on when the default backend is not a GPU."""
    t, g, ng, k, o, hpg, heads = _check(o_g, wo_a, zl, zl_row, z_p, prot_idx, global_heads)
    cfg = config or default_config(o)
    dts = {a.dtype for a in (o_g, wo_a, zl, z_p)}
    why = restore_unsupported(k, o, ng, dts.pop() if len(dts) == 1 else "mixed dtypes", cfg)
    if why:
        raise ValueError(f"restore kernel: {why}")
    p_row = protected_rows(prot_idx, t)  # the kernel reads each row's source, not a scatter list
    kind = jnp.where(p_row >= 0, 2, jnp.where(zl_row >= 0, 1, 0)).astype(jnp.int32)
    row = jnp.where(kind == 2, p_row, jnp.where(kind == 1, zl_row, 0)).astype(jnp.int32)
    a = o_g.reshape(t, g * k)
    tp = -t % BLOCK_T
    if tp:
        a = jnp.pad(a, ((0, tp), (0, 0)))
        kind, row = jnp.pad(kind, (0, tp)), jnp.pad(row, (0, tp))
    z = _kernel_call(a, wo_a, zl.reshape(zl.shape[0], g * o), z_p.reshape(z_p.shape[0], g * o),
                     jnp.zeros((1, g * o), jnp.bfloat16), jnp.stack([row, kind]), g=g, o=o, k=k, col0=heads[0] * k, cfg=cfg,
                     interpret=interpret)
    return z[:t].reshape(t, g, o)


# ----------------------------------------------------------------------------- problems, benchmark
def make_problem(key, *, t: int, g: int = 8, hpg: int = 8, k: int = 512, o: int = 1024, pool: int | None = None,
                 protected: float = 0.25, global_head: int = 0, dtype=jnp.bfloat16):
    """A consumer-shaped random problem (Flash dimensions by default): rows split into restored
    (z_L from a pool of `pool` rows, in document order), protected (a `protected` share, z_p)
    and padding rows at the end. Returns (args, kwargs) for restore / restore_reference."""
    ks = jax.random.split(key, 5)
    pool = pool or t
    o_g = (jax.random.normal(ks[0], (t, g, 1, k), jnp.float32)).astype(dtype)
    wo_a = (jax.random.normal(ks[1], (g * o, hpg * k), jnp.float32) * k ** -0.5).astype(dtype)
    zl = jax.random.normal(ks[2], (pool, g, o), jnp.float32).astype(dtype)
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


def main(argv=None):
    """Kernel vs XLA reference at consumer shapes; GB/s against a copy measured in the same run."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="8192,65536")
    ap.add_argument("--block-n", default="128,256")
    ap.add_argument("--steps", default="2,3", help="RestoreConfig.steps variants to compare")
    a = ap.parse_args(argv)
    x = jnp.ones((1 << 28,), jnp.bfloat16)  # 512 MB: read + write
    copy = jax.jit(lambda u: u + 1)
    copy_gbs = 2 * x.nbytes / median_time(copy, x, iters=10) / 1e9
    peak = matmul_peak_tflops()
    rows = []
    for t in [int(v) for v in a.rows.split(",")]:
        args, kw = make_problem(jax.random.key(t), t=t)
        ref = jax.jit(functools.partial(restore_reference, **kw))
        zr = ref(*args)
        tr = median_time(ref, *args)
        nbytes = moved_bytes(args)
        tflop = 2 * t * args[0].shape[1] * args[0].shape[3] * args[2].shape[2] / 1e12  # the Global-head product
        for bn, st in [(int(v), int(w)) for v in a.block_n.split(",") for w in a.steps.split(",")]:
            try:
                cfg = RestoreConfig(block_n=bn, steps=st)
            except ValueError as e:  # a shared-memory budget it exceeds: said, not timed
                print(f"block_n={bn} steps={st}: {e}", flush=True)
                continue
            ker = jax.jit(functools.partial(restore, **kw, config=cfg))
            zk = ker(*args)
            err = rel_err(zk, zr)
            tk = median_time(ker, *args)
            rows.append(dict(rows=t, config=dataclasses.asdict(cfg), rel_err=err, kernel_ms=tk * 1e3,
                             xla_ms=tr * 1e3, speedup=tr / tk, kernel_gbs=nbytes / tk / 1e9, xla_gbs=nbytes / tr / 1e9,
                             kernel_frac_of_copy=nbytes / tk / 1e9 / copy_gbs, kernel_tflops=tflop / tk,
                             xla_tflops=tflop / tr))
            print(f"t={t:6d} block_n={bn:3d} steps={st} err {err:.1e} kernel {tk * 1e3:7.3f} ms xla {tr * 1e3:7.3f} ms "
                  f"x{tr / tk:4.2f} {nbytes / tk / 1e9:6.0f} GB/s ({nbytes / tk / 1e9 / copy_gbs:.0%} of copy "
                  f"{copy_gbs:.0f}), {tflop / tk:.0f} TFLOP/s (peak {peak:.0f})", flush=True)
    return record("restore", a.json, argv, copy_gbs=copy_gbs, matmul_peak_tflops=peak, rows=rows)


if __name__ == "__main__":
    main()
