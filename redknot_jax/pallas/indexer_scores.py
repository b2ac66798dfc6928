"""Lightning Indexer scores (spec §4.5) as a Mosaic GPU kernel, beside its reference.

    I[b, t, s] = sum_i w[b, t, i] * relu(q[b, t, i] . keys[b, s])

The reference (`index_scores`, what `redknot_jax.indexer.score_function` gives for "xla") is
two XLA einsums: the per-head products [t, i, s] are written to memory in fp32 (64 heads: 64x
the size of the scores) and read back for the ReLU and the weighted head sum. On the H200 that
costs 1.43 ms per 256-query block at 16K entries (48 TFLOP/s), almost three times the top-k that
follows (`docs/results/indexer_select_h200.json`), and the indexer is what makes CSA layers the
slow ones at long context.

Kernel layout: one CTA per (64 query rows, block_s entries), one warpgroup. The entries' keys
[block_s, j] stay in shared memory; a pipeline over the heads brings each head's query tile
[64, j] by TMA, one wgmma gives that head's products [64, block_s] in fp32 registers, and the
ReLU and the head's weight (one value per row) fold them into a running sum carried in
registers. Nothing per head reaches memory; the output tile is written once in fp32.
Sums run in a different order than the reference's, so scores agree to fp32 rounding and a
top-k may differ from the reference's where two scores are within that rounding.

Limits: bf16 q (keys are cast to it, as in the reference), fp32 w, j % 64 == 0. Rows and entries are padded here to the tile
(padding entries score 0 and are cut off). Mosaic GPU interpret mode runs the kernel on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from redknot_jax.pallas.mosaic import interpret_params
from redknot_jax.pallas.timing import matmul_peak_tflops, median_time, record

HIGHEST = jax.lax.Precision.HIGHEST
BLOCK_T = 64  # wgmma M of one warpgroup
SMEM_LIMIT = 227 * 1024


def index_scores(q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """The reference: I [b, t, s] = sum_i w[b,t,i] relu(q[b,t,i] . keys[b,s]) (products
    accumulated in fp32)."""
    dots = jnp.einsum("btij,bsj->btis", q, keys.astype(q.dtype), preferred_element_type=jnp.float32,
                      precision=HIGHEST)
    return jnp.einsum("btis,bti->bts", jax.nn.relu(dots), w, precision=HIGHEST)


@dataclasses.dataclass(frozen=True)
class ScoresConfig:
    """Tiling: block_s entries per CTA (wgmma N; the running sum and one head's products, two
    [64, block_s] fp32 tiles over 128 threads, take block_s registers per thread, so 128 is the
    most that does not spill), steps the depth of the pipeline over heads."""

    block_s: int = 128
    steps: int = 2

    def __post_init__(self):
        if self.block_s not in (64, 128):
            raise ValueError(f"ScoresConfig.block_s: expected 64 or 128, got {self.block_s}")
        if not 1 <= self.steps <= 4:
            raise ValueError(f"ScoresConfig.steps: expected 1..4, got {self.steps}")

    def smem_bytes(self, heads: int, dim: int) -> int:
        """keys + query pipeline + head weights + fp32 output staging."""
        return (self.block_s * dim * 2 + self.steps * BLOCK_T * dim * 2 + heads * BLOCK_T * 4
                + BLOCK_T * self.block_s * 4 + 1024)


def scores_unsupported(heads: int, dim: int, dtype, config: ScoresConfig | None = None) -> str | None:
    """Why the kernel cannot run an indexer of `heads` heads of `dim` in `dtype` (None: it can)."""
    cfg = config or ScoresConfig()
    if isinstance(dtype, str) or jnp.dtype(dtype) != jnp.bfloat16:
        return f"bf16 indexer queries and keys expected, got {dtype}"
    if dim % 64:
        return f"indexer head dim {dim} must be a multiple of 64"
    if cfg.smem_bytes(heads, dim) > SMEM_LIMIT:
        return f"{cfg.smem_bytes(heads, dim)} bytes of shared memory > {SMEM_LIMIT}"
    return None


def _kernel_call(q2, wt, keys, *, heads, dim, cfg, interpret):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    t, s = q2.shape[0], keys.shape[0]
    bt, bs = BLOCK_T, cfg.block_s
    bf16_tiles = lambda: (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    f32_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

    def body(q_ref, w_ref, k_ref, out_ref):
        r0, c0 = lax.axis_index("t") * bt, lax.axis_index("s") * bs

        def scoped(k_s, w_s, out_s, bar):
            plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(c0, bs)], k_s, bar)
            plgpu.copy_gmem_to_smem(w_ref.at[:, pl.ds(r0, bt)], w_s, bar)
            plgpu.barrier_wait(bar)

            def head(idx, q_s, total):
                def products(acc_ref):
                    plgpu.wgmma(acc_ref, q_s, k_s.T)
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]

                dots = pl.run_scoped(products, plgpu.ACC((bt, bs), jnp.float32))
                wh = plgpu.load(w_s.at[idx[0]], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                return total + lax.broadcast_in_dim(wh, (bt, bs), [0]) * jnp.maximum(dots, 0.0)

            zero = plgpu.layout_cast(jnp.full((bt, bs), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            total = plgpu.emit_pipeline(
                head, grid=(heads,), max_concurrent_steps=cfg.steps,
                in_specs=[plgpu.BlockSpec((bt, dim), lambda h: (0, h), transforms=bf16_tiles())],
                init_carry=zero,
            )(q_ref.at[pl.ds(r0, bt)])
            out_s[...] = total
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s, out_ref.at[pl.ds(r0, bt), pl.ds(c0, bs)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((bs, dim), keys.dtype, transforms=bf16_tiles()),
                      plgpu.SMEM((heads, bt), jnp.float32),
                      plgpu.SMEM((bt, bs), jnp.float32, transforms=f32_tiles),
                      plgpu.Barrier(num_arrivals=2))

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((t, s), jnp.float32), grid=(t // bt, s // bs),
                        grid_names=("t", "s"), interpret=interpret_params(interpret))(q2, wt, keys)


def indexer_scores(q, w, keys, *, config: ScoresConfig | None = None, interpret: bool | None = None):
    """Mosaic GPU indexer scores; same signature and result as `index_scores` (to fp32 rounding).

    Unsupported operands raise ValueError (the caller then uses the reference explicitly).
    interpret: Mosaic GPU interpret mode; None = on when the default backend is not a GPU."""
    cfg = config or ScoresConfig()
    if q.ndim != 4 or w.shape != q.shape[:3] or keys.ndim != 3 or keys.shape[0] != q.shape[0] \
            or keys.shape[2] != q.shape[3]:
        raise ValueError(f"indexer_scores: expected q [b, t, i, j], w [b, t, i], keys [b, s, j], got "
                         f"{q.shape}, {w.shape}, {keys.shape}")
    if w.dtype != jnp.float32:
        raise ValueError(f"indexer_scores: fp32 head weights expected, got {w.dtype}")
    why = scores_unsupported(q.shape[2], q.shape[3], q.dtype, cfg)
    if why:
        raise ValueError(f"indexer_scores kernel: {why}")
    keys = keys.astype(q.dtype)  # as the reference does
    b, t, heads, dim = q.shape
    s = keys.shape[1]
    tp, sp = -t % BLOCK_T, -s % cfg.block_s
    out = []
    for i in range(b):  # batches are one or a few requests: one launch each
        q2 = jnp.pad(q[i], ((0, tp), (0, 0), (0, 0))).reshape(t + tp, heads * dim)
        wt = jnp.pad(w[i], ((0, tp), (0, 0))).T  # [i, t]: each head's row weights contiguous
        kp = jnp.pad(keys[i], ((0, sp), (0, 0)))
        out.append(_kernel_call(q2, wt, kp, heads=heads, dim=dim, cfg=cfg, interpret=interpret)[:t, :s])
    return jnp.stack(out)


# ----------------------------------------------------------------------------- problems, benchmark
def make_problem(key, *, t: int, s: int, b: int = 1, heads: int = 64, dim: int = 128):
    """Random indexer operands at CSA shapes (Flash: 64 heads of 128; keys already rotated)."""
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, heads, dim), jnp.float32).astype(jnp.bfloat16)
    keys = jax.random.normal(kk, (b, s, dim), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (b, t, heads), jnp.float32) * (dim ** -0.5 * heads ** -0.5)
    return q, w, keys


def main(argv=None):
    """Kernel vs the XLA reference at CSA shapes (per 256-query block, and 4096 queries); TFLOP/s
    against a bf16 matmul measured in the same run."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="256x16384,256x65536,4096x16384", help="queries x entries, comma-separated")
    ap.add_argument("--block-s", default="64,128")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    peak = matmul_peak_tflops(iters=a.iters)
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in a.shapes.split(","):
        t, s = (int(v) for v in shape.split("x"))
        q, w, keys = make_problem(jax.random.key(t + s), t=t, s=s)
        flops = 2 * t * s * q.shape[2] * q.shape[3]
        ref = jax.jit(index_scores)
        want = ref(q, w, keys)
        tr = median_time(ref, q, w, keys, iters=a.iters)
        for bs in [int(v) for v in a.block_s.split(",")]:
            cfg = ScoresConfig(block_s=bs)
            ker = jax.jit(functools.partial(indexer_scores, config=cfg))
            got = ker(q, w, keys)
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            tk = median_time(ker, q, w, keys, iters=a.iters)
            rows.append(dict(queries=t, entries=s, config=dataclasses.asdict(cfg), max_err_rel_to_max=err,
                             kernel_ms=tk * 1e3, xla_ms=tr * 1e3, speedup=tr / tk, kernel_tflops=flops / tk / 1e12,
                             xla_tflops=flops / tr / 1e12, kernel_frac_of_peak=flops / tk / 1e12 / peak))
            print(f"{t}x{s} block_s={bs} err {err:.1e} kernel {tk * 1e3:.3f} ms xla {tr * 1e3:.3f} ms x{tr / tk:.2f} "
                  f"{flops / tk / 1e12:.0f} TFLOP/s ({flops / tk / 1e12 / peak:.0%} of {peak:.0f})", flush=True)
    return record("indexer_scores", a.json, argv, matmul_tflops=peak, rows=rows)


if __name__ == "__main__":
    main()
