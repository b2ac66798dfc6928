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

Kernel layout: one CTA per (64-row block, group, block_n output columns), one warpgroup. The
Global-head product is a pipelined wgmma: A = o_G rows [64, block_k], B = the wo_a tile
[block_n, block_k] read in place (the group's rows, the Global head's columns; used transposed,
no weight copy). While it runs, each row's addend is fetched by a one-row TMA copy from the row's
source, z_L pool row, z_p row or a zero row, all onto one barrier expecting 64 arrivals (TMA has
no gather on Hopper; a copy per row is the gather). The epilogue drops the product of protected
rows, adds the addend in fp32 and stores the tile with TMA. Limits: one Global head per group
(nG = 1, the profiles' "7 of every 8 heads restored"), bf16, k % block_k == 0, o % block_n == 0.
Mosaic GPU interpret mode runs this kernel on CPU (its operands all come from shared memory),
so CPU CI tests the kernel itself, not only its lowering.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from redknot_jax.pallas import interpret_params
from redknot_jax.pallas.timing import median_time, record, rel_err

HIGHEST = jax.lax.Precision.HIGHEST
BLOCK_T = 64  # wgmma M of one warpgroup


@dataclasses.dataclass(frozen=True)
class RestoreConfig:
    """Tiling: block_n output columns per CTA (wgmma N), block_k the contraction step of the
    pipeline, steps its depth. Shared memory: steps * (64 + block_n) * block_k * 2 bytes of
    operands plus 2 * 64 * block_n * 2 bytes (addend rows, output staging). indices: where the
    CTA reads its 64 rows' (source row, kind) pairs: "gmem" (128 scalar global loads, the
    variant measured on the H200) or "smem" (one 512-byte TMA copy into shared memory first)."""

    block_n: int = 128
    block_k: int = 64
    steps: int = 2
    indices: str = "gmem"

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"RestoreConfig.block_n: expected 64, 128 or 256, got {self.block_n}")
        if self.block_k != 64:  # one 128-byte swizzle row of bf16
            raise ValueError(f"RestoreConfig.block_k: expected 64, got {self.block_k}")
        if self.indices not in ("gmem", "smem"):
            raise ValueError(f"RestoreConfig.indices: expected 'gmem' or 'smem', got {self.indices!r}")
        if not 1 <= self.steps <= 4:
            raise ValueError(f"RestoreConfig.steps: expected 1..4, got {self.steps}")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"RestoreConfig: {self.smem_bytes()} bytes of shared memory > {SMEM_LIMIT}")

    def smem_bytes(self) -> int:
        return (self.steps * (BLOCK_T + self.block_n) * self.block_k * 2 + 2 * BLOCK_T * self.block_n * 2
                + 2 * BLOCK_T * 4 + 1024)


SMEM_LIMIT = 227 * 1024


def default_config(o: int) -> RestoreConfig:
    """block_n 128 where it divides the output-group rank (Flash / Pro: 1024), else 64."""
    return RestoreConfig(block_n=128 if o % 128 == 0 else 64)


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

    t = a.shape[0]
    bt, bn, bk = BLOCK_T, cfg.block_n, cfg.block_k
    dtype = a.dtype
    tiled = lambda: (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(a_ref, w_ref, zl_ref, zp_ref, z0_ref, idx_ref, out_ref):
        i, gi, j = lax.axis_index("t"), lax.axis_index("g"), lax.axis_index("n")
        r0 = i * bt
        cols = pl.ds(gi * o + j * bn, bn)  # this tile's columns of z [t, g*o]

        def scoped(add_s, add_bar, out_s, idx_s, idx_bar):
            if cfg.indices == "smem":  # the block's (source row, kind) pairs, one copy
                plgpu.copy_gmem_to_smem(idx_ref.at[:, pl.ds(r0, bt)], idx_s, idx_bar)
                plgpu.barrier_wait(idx_bar)
                pair, kinds_ref = (lambda r: (idx_s[0, r], idx_s[1, r])), idx_s.at[1]
            else:
                pair, kinds_ref = (lambda r: (idx_ref[0, r0 + r], idx_ref[1, r0 + r])), idx_ref.at[1, pl.ds(r0, bt)]
            # each row's addend, one TMA row copy from its source; all arrive on one barrier
            for r in range(bt):
                src, kind = pair(r)
                for want, ref in ((0, z0_ref), (1, zl_ref), (2, zp_ref)):
                    @pl.when(kind == want)
                    def _(ref=ref, src=src, r=r):
                        plgpu.copy_gmem_to_smem(ref.at[pl.ds(src, 1), cols], add_s.at[pl.ds(r, 1)], add_bar)

            def product(acc_ref):
                def step(_, a_s, w_s):
                    plgpu.wgmma(acc_ref, a_s, w_s.T)
                    plgpu.wgmma_wait(0)

                plgpu.emit_pipeline(
                    step, grid=(k // bk,), max_concurrent_steps=cfg.steps,
                    in_specs=[plgpu.BlockSpec((bt, bk), lambda s: (0, s), transforms=tiled()),
                              plgpu.BlockSpec((bn, bk), lambda s: (0, s), transforms=tiled())],
                )(a_ref.at[pl.ds(r0, bt), pl.ds(gi * k, k)],
                  w_ref.at[pl.ds(gi * o + j * bn, bn), pl.ds(col0, k)])
                return acc_ref[...]

            acc = pl.run_scoped(product, plgpu.ACC((bt, bn), jnp.float32))
            plgpu.barrier_wait(add_bar)
            add = plgpu.load(add_s, layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
            kinds = plgpu.load(kinds_ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            keep = lax.broadcast_in_dim(kinds != 2, (bt, bn), [0])  # protected rows: replaced
            out_s[...] = (jnp.where(keep, acc, 0.0) + add).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s, out_ref.at[pl.ds(r0, bt), cols])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((bt, bn), dtype), plgpu.Barrier(num_arrivals=bt),
                      plgpu.SMEM((bt, bn), dtype, transforms=tiled()), plgpu.SMEM((2, bt), jnp.int32),
                      plgpu.Barrier())

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((t, g * o), dtype), grid=(t // bt, g, o // bn),
                        grid_names=("t", "g", "n"), interpret=interpret_params(interpret))(
        a, wo_a, zl, zp, z0, idx)


def restore_unsupported(k: int, o: int, n_global: int, dtype, config: RestoreConfig | None = None) -> str | None:
    """Why the kernel cannot run this shape (None: it can). k head dim, o output-group rank,
    n_global Global heads per group."""
    cfg = config or default_config(o)
    if n_global != 1:
        return f"one Global head per group supported, got {n_global}"
    if isinstance(dtype, str) or jnp.dtype(dtype) != jnp.bfloat16:
        return f"bf16 operands expected, got {dtype}"
    if k % cfg.block_k or o % cfg.block_n:
        return f"k={k} must divide by block_k={cfg.block_k} and o={o} by block_n={cfg.block_n}"
    return None


def restore(o_g, wo_a, zl, zl_row, z_p, prot_idx, *, global_heads, config: RestoreConfig | None = None,
            interpret: bool | None = None):
    """Mosaic GPU fused restoration; same signature and result as `restore_reference`.

    Supported: one Global head per group, bf16 operands, k % 64 == 0, o % block_n == 0; anything
    else raises ValueError (the caller then uses the reference explicitly). Rows are padded to
    a multiple of 64 here when needed (a copy; the consumer's row counts are multiples of 64).
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
    ap.add_argument("--indices", default="gmem,smem", help="RestoreConfig.indices variants to compare")
    a = ap.parse_args(argv)
    x = jnp.ones((1 << 28,), jnp.bfloat16)  # 512 MB: read + write
    copy = jax.jit(lambda u: u + 1)
    copy_gbs = 2 * x.nbytes / median_time(copy, x, iters=10) / 1e9
    rows = []
    for t in [int(v) for v in a.rows.split(",")]:
        args, kw = make_problem(jax.random.key(t), t=t)
        ref = jax.jit(functools.partial(restore_reference, **kw))
        zr = ref(*args)
        tr = median_time(ref, *args)
        nbytes = moved_bytes(args)
        for bn, ix in [(int(v), w) for v in a.block_n.split(",") for w in a.indices.split(",")]:
            cfg = RestoreConfig(block_n=bn, indices=ix)
            ker = jax.jit(functools.partial(restore, **kw, config=cfg))
            zk = ker(*args)
            err = rel_err(zk, zr)
            tk = median_time(ker, *args)
            rows.append(dict(rows=t, config=dataclasses.asdict(cfg), rel_err=err, kernel_ms=tk * 1e3,
                             xla_ms=tr * 1e3, speedup=tr / tk, kernel_gbs=nbytes / tk / 1e9, xla_gbs=nbytes / tr / 1e9,
                             kernel_frac_of_copy=nbytes / tk / 1e9 / copy_gbs))
            print(f"t={t:6d} block_n={bn:3d} {ix} err {err:.1e} kernel {tk * 1e3:7.3f} ms xla {tr * 1e3:7.3f} ms "
                  f"x{tr / tk:4.2f} {nbytes / tk / 1e9:6.0f} GB/s ({nbytes / tk / 1e9 / copy_gbs:.0%} of copy "
                  f"{copy_gbs:.0f})", flush=True)
    return record("restore", a.json, argv, copy_gbs=copy_gbs, rows=rows)


if __name__ == "__main__":
    main()
