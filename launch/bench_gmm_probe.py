"""Probe: cost of jax.lax.ragged_dot vs a dense matmul of the same useful FLOPs on this GPU,
and of Precision.HIGHEST on bf16 operands. Prints one line per variant (why moe.py has its own
grouped matmul). Sizes: --rows tokens x --hidden into --experts experts of width --inter, the
rows split evenly over the experts."""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def bench(f, *a, reps=10):
    f(*a).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f(*a).block_until_ready()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_gmm_probe.py")  # docs/kernels.md
    ap.add_argument("--rows", type=int, default=6 * 8192, help="tokens (rows of x)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048, help="expert width")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    n, d, f, e = a.rows, a.hidden, a.inter, a.experts
    if n % e:
        ap.error(f"--rows: expected a multiple of --experts ({e}), got {n}")
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    w = jax.random.normal(k[1], (e, d, f), jnp.bfloat16)
    sizes = jnp.full((e,), n // e, jnp.int32)
    useful = 2 * n * d * f
    hi = jax.lax.Precision.HIGHEST
    variants = [
        ("ragged_dot default", jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s)), (x, w, sizes)),
        ("ragged_dot HIGHEST", jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, precision=hi)), (x, w, sizes)),
        ("dense same flops", jax.jit(lambda x, w: x @ w[0]), (x, w)),
        ("dense HIGHEST bf16", jax.jit(lambda x, w: jnp.einsum('nd,df->nf', x, w[0], precision=hi)), (x, w)),
        ("dense f32-acc", jax.jit(lambda x, w: jnp.einsum('nd,df->nf', x, w[0], preferred_element_type=jnp.float32)),
         (x, w)),
        ("batched per-expert", jax.jit(lambda x, w: jnp.einsum('end,edf->enf', x, w)), (x.reshape(e, n // e, d), w)),
    ]
    out = {}
    for name, fn, args in _cli.progress(variants, desc="variants", unit="variant"):
        t = bench(fn, *args, reps=a.reps)
        out[name] = t
        _cli.echo(f"{name}: {t*1e3:.2f} ms {useful/t/1e12:.0f} TFLOP/s")
    return out


if __name__ == "__main__":
    main()
