"""The MoE experts' grouped matmul (spec §5) as a Mosaic GPU kernel, beside its reference.

    out[r] = x[r] @ w[g(r)]   for the rows r of group g (rows sorted by group, sizes [e]);
    rows past sum(sizes) are zero.

That is `jax.lax.ragged_dot`'s contract, and `ragged_dot_reference` is `jax.lax.ragged_dot`;
`grouped_matmul` meets it too: the tiled scan the MoE runs when the kernel does not.
Why a kernel: the per-layer op profile of a 64K prefill on the H200
(`docs/results/ttft_64k_ops_h200.json`) showed the MoE's XLA path (`grouped_matmul` below, a
scan of one dense matmul per 512-row tile) issuing ~100K device ops per layer (3 matmuls x 64
tiles x 16 token chunks, each tile a handful of ops, plus a copy of the expert's weight matrix
per tile), so a layer spent about half its wall time between kernels; XLA's own `ragged_dot`
runs at 47 TFLOP/s there. This is one launch per matmul.

The kernel is JAX's (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, Hopper): a persistent
grid over (row tile, column tile) pairs, each row tile inside one group, a pipelined wgmma over
k, and stores of only the group's rows (a ladder of power-of-two TMA boxes). This module adds
what the MoE needs around it: the contract's zero rows past sum(sizes) (the kernel leaves them
unwritten; the fan-out rule sends dropped assignments there), `preferred_element_type` (the
kernel writes the operands' dtype; a wider type is a cast of that), a validated tiling
(`RaggedDotConfig`, tuned on the H200), `ragged_dot_unsupported` (why a shape cannot run) and
`main()`, the benchmark against the XLA paths.

Limits: bf16 operands, k % block_k == 0, n % block_n == 0. Anything else raises ValueError;
`Consumer(kernels=)` refuses such a model at construction. The kernel has no interpret mode
(JAX builds it without one), so CPU CI checks the reference's contract and the CUDA lowering;
the numerics are a GPU test (`tests/pallas/test_ragged_dot.py -m gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.pallas.timing import matmul_peak_tflops, median_time, record, rel_err

HIGHEST = jax.lax.Precision.HIGHEST
SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class RaggedDotConfig:
    """Tiling: block_m rows x block_n columns per tile (one warpgroup's wgmma; the fp32
    accumulator takes block_m * block_n / 128 registers per thread, so at most 128 x 128),
    block_k the contraction step, steps the pipeline's depth, grid_block_n how many column
    tiles in a row of the persistent grid's snake order (weight-tile reuse in L2)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    steps: int = 4
    grid_block_n: int = 4

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"RaggedDotConfig.block_m: expected 64 or 128, got {self.block_m}")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"RaggedDotConfig.block_n: expected 64, 128 or 256, got {self.block_n}")
        if self.block_m * self.block_n > 128 * 128:
            raise ValueError(f"RaggedDotConfig: a {self.block_m} x {self.block_n} fp32 accumulator does not fit "
                             "one warpgroup's registers (at most 128 x 128)")
        if self.block_k != 64:  # one 128-byte swizzle row of bf16
            raise ValueError(f"RaggedDotConfig.block_k: expected 64, got {self.block_k}")
        if not 2 <= self.steps <= 6:
            raise ValueError(f"RaggedDotConfig.steps: expected 2..6, got {self.steps}")
        if self.grid_block_n not in (1, 2, 4, 8, 16):
            raise ValueError(f"RaggedDotConfig.grid_block_n: expected 1, 2, 4, 8 or 16, got {self.grid_block_n}")
        if self.smem_bytes() > SMEM_LIMIT:
            raise ValueError(f"RaggedDotConfig: {self.smem_bytes()} bytes of shared memory > {SMEM_LIMIT}")

    def smem_bytes(self) -> int:
        """Operand pipeline plus the output staging tile (bf16)."""
        return self.steps * (self.block_m + self.block_n) * self.block_k * 2 + self.block_m * self.block_n * 2 + 1024


def ragged_dot_unsupported(k: int, n: int, dtype, config: RaggedDotConfig | None = None) -> str | None:
    """Why the kernel cannot multiply [m, k] rows by [e, k, n] weights in `dtype` (None: it can)."""
    cfg = config or RaggedDotConfig()
    if isinstance(dtype, str) or jnp.dtype(dtype) != jnp.bfloat16:
        return f"bf16 operands expected, got {dtype}"
    if k % cfg.block_k or n % cfg.block_n:
        return f"k={k} must divide by block_k={cfg.block_k} and n={n} by block_n={cfg.block_n}"
    return None


def _check(x, w, sizes):
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"ragged_dot: expected x [m, k] and w [e, k, n], got {x.shape} and {w.shape}")
    if sizes.shape != (w.shape[0],) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"ragged_dot: expected integer sizes [{w.shape[0]}], got {sizes.dtype}{sizes.shape}")


def ragged_dot_reference(x, w, sizes, preferred_element_type=None, config=None):
    """XLA's `jax.lax.ragged_dot` (fp32 accumulation), the contract the kernel meets."""
    del config
    _check(x, w, sizes)
    return jax.lax.ragged_dot(x, w, sizes, precision=HIGHEST, preferred_element_type=preferred_element_type)


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, tile: int = 512,
                   preferred_element_type=None) -> jax.Array:
    """The MoE's XLA path (`moe.MoE.experts` without the kernel, long chunks): rows x [m, k]
    sorted by group, group sizes [e] (sum <= m), w [e, k, n] -> [m, n]; rows past sum(sizes)
    are zero. Same contract as `jax.lax.ragged_dot(x, w, sizes)`."""
    m, kdim = x.shape
    e, _, n = w.shape
    tile = max(1, min(tile, m))
    out_dtype = preferred_element_type or x.dtype
    starts = jnp.cumsum(sizes) - sizes
    tiles_per = -(-sizes // tile)
    tiles_end = jnp.cumsum(tiles_per)
    ntiles = m // tile + e  # static bound on sum(ceil(size / tile))
    xpad = jnp.pad(x, ((0, tile), (0, 0)))

    def body(out, i):
        g = jnp.minimum(jnp.searchsorted(tiles_end, i, side="right"), e - 1)
        row = starts[g] + (i - (tiles_end[g] - tiles_per[g])) * tile
        row = jnp.clip(row, 0, m)
        # tiles past the last group (dropped assignments, the static bound's slack) are skipped,
        # so the fan-out rule's dropped experts cost no matmul
        y = jax.lax.cond(i < tiles_end[-1],
                         lambda: jnp.dot(jax.lax.dynamic_slice(xpad, (row, 0), (tile, kdim)), w[g],
                                         preferred_element_type=out_dtype),
                         lambda: jnp.zeros((tile, n), out_dtype))
        ok = (row + jnp.arange(tile) < starts[g] + sizes[g]) & (i < tiles_end[-1])
        old = jax.lax.dynamic_slice(out, (row, 0), (tile, n))
        return jax.lax.dynamic_update_slice(out, jnp.where(ok[:, None], y, old), (row, 0)), None

    out, _ = jax.lax.scan(body, jnp.zeros((m + tile, n), out_dtype), jnp.arange(ntiles))
    return out[:m]


_IMPORT_LOCK = threading.Lock()


def _mgpu_ragged_dot():
    """jax's Mosaic GPU grouped matmul. Its module imports `jax._src.test_util`, whose import
    installs absl's failure signal handler for the whole process (SIGTERM among its signals): a
    server would then print a crash-like stack trace on every ordinary stop. The handler is left
    out of that import (jax 0.11.2: `util.install_failure_signal_handler`, called once at import)."""
    import importlib
    import sys

    with _IMPORT_LOCK:  # compile-ahead threads trace layers side by side
        if "jax._src.test_util" not in sys.modules:
            from jax._src import util

            install, util.install_failure_signal_handler = util.install_failure_signal_handler, lambda *a, **k: None
            try:
                importlib.import_module("jax._src.test_util")
            finally:
                util.install_failure_signal_handler = install
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot as mgpu_ragged_dot
    return mgpu_ragged_dot


def ragged_dot(x, w, sizes, preferred_element_type=None, config: RaggedDotConfig | None = None):
    """Mosaic GPU grouped matmul; same signature and result as `ragged_dot_reference` (up to
    bf16 rounding of the output: the kernel accumulates in fp32 and writes bf16, which a wider
    `preferred_element_type` then widens). Unsupported shapes or dtypes raise ValueError."""
    mgpu_ragged_dot = _mgpu_ragged_dot()
    _check(x, w, sizes)
    cfg = config or RaggedDotConfig()
    why = ragged_dot_unsupported(x.shape[1], w.shape[2], x.dtype if x.dtype == w.dtype else "mixed dtypes", cfg)
    if why:
        raise ValueError(f"ragged_dot kernel: {why}")
    sizes = sizes.astype(jnp.int32)
    m = x.shape[0]
    if m % 8:  # the kernel's TMA descriptors tile rows by 8: pad with rows past the last group
        x = jnp.pad(x, ((0, -m % 8), (0, 0)))
    out = mgpu_ragged_dot(x, w, group_sizes=sizes, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                          max_concurrent_steps=cfg.steps, grid_block_n=cfg.grid_block_n)
    # rows past the last group are never written by the kernel: the contract says zero
    valid = jnp.arange(m) < jnp.sum(sizes)
    return jnp.where(valid[:, None], out[:m], 0).astype(preferred_element_type or x.dtype)


# ----------------------------------------------------------------------------- problems, benchmark
def make_problem(key, *, m: int, e: int = 16, k: int = 4096, n: int = 2048, used: float = 1.0, dtype=jnp.bfloat16):
    """An MoE-shaped random problem (Flash's hidden 4096 and expert width 2048 by default): m
    rows sorted by group, random group sizes summing to `used` * m (the rest: dropped rows)."""
    kx, kw, ks = jax.random.split(key, 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (e, k, n), jnp.float32) * k ** -0.5).astype(dtype)
    cuts = np.sort(np.asarray(jax.random.randint(ks, (e - 1,), 0, int(m * used) + 1)))
    sizes = np.diff(np.concatenate([[0], cuts, [int(m * used)]])).astype(np.int32)
    return x, w, jnp.asarray(sizes)


def main(argv=None):
    """Kernel vs the MoE's XLA paths (`grouped_matmul`, the tiled scan the model runs, and
    `jax.lax.ragged_dot`) at Flash MoE shapes; TFLOP/s against a bf16 matmul in the same run."""
    import argparse
    import itertools

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="24576", help="assignment rows per call (Flash top-6 x 4096-token chunk)")
    ap.add_argument("--shapes", default="4096x2048,2048x4096", help="k x n of the expert matmuls (w1/w3, w2)")
    ap.add_argument("--experts", default="16", help="expert counts: 16 (flash-shaped), 256 (Flash), 32 (a "
                                                    "Flash rank at tp = 8)")
    ap.add_argument("--block-m", default="64,128")
    ap.add_argument("--block-n", default="64,128")
    ap.add_argument("--steps", default="4")
    ap.add_argument("--grid-block-n", default="1,4")
    a = ap.parse_args(argv)
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak (8192^3) in this run: {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for m, shape, e in itertools.product([int(v) for v in a.rows.split(",")], a.shapes.split(","),
                                         [int(v) for v in a.experts.split(",")]):
        k, n = (int(v) for v in shape.split("x"))
        x, w, sizes = make_problem(jax.random.key(m + k), m=m, e=e, k=k, n=n, used=0.95)
        flop = 2 * int(jnp.sum(sizes)) * k * n
        ref = jax.jit(ragged_dot_reference)
        yr = ref(x, w, sizes).astype(jnp.float32)
        t_ragged = median_time(ref, x, w, sizes, iters=5)
        scan = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, 512))
        t_scan = median_time(scan, x, w, sizes, iters=10)
        for bm, bn, st, gbn in itertools.product(*[[int(v) for v in s.split(",")] for s in
                                                   (a.block_m, a.block_n, a.steps, a.grid_block_n)]):
            try:
                cfg = RaggedDotConfig(block_m=bm, block_n=bn, steps=st, grid_block_n=gbn)
            except ValueError as err:
                print(f"skip {bm}x{bn} steps {st}: {err}")
                continue
            ker = jax.jit(functools.partial(ragged_dot, config=cfg))
            yk = ker(x, w, sizes).astype(jnp.float32)
            err = rel_err(yk, yr)
            tk = median_time(ker, x, w, sizes, iters=10)
            rows.append(dict(rows=m, experts=e, k=k, n=n, config=dataclasses.asdict(cfg), rel_err=err, kernel_ms=tk * 1e3,
                             scan_ms=t_scan * 1e3, ragged_dot_ms=t_ragged * 1e3, kernel_tflops=flop / tk / 1e12,
                             scan_tflops=flop / t_scan / 1e12, ragged_dot_tflops=flop / t_ragged / 1e12,
                             kernel_frac_of_peak=flop / tk / 1e12 / peak))
            print(f"m={m} e={e} {k}x{n} {bm}x{bn} steps {st} gbn {gbn}: err {err:.1e} kernel {tk * 1e3:.3f} ms "
                  f"({flop / tk / 1e12:.0f} TFLOP/s, {flop / tk / 1e12 / peak:.0%}) scan {t_scan * 1e3:.3f} ms "
                  f"ragged_dot {t_ragged * 1e3:.3f} ms", flush=True)
    return record("ragged_dot", a.json, argv, matmul_peak_tflops=peak, rows=rows)


if __name__ == "__main__":
    main()
