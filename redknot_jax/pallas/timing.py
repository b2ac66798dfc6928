"""Timing for the kernels' benchmark `main()`s: the median of timed calls after a warm-up, the
bf16 matmul peak they quote against, the relative error they report, and their JSON record."""

import time

import numpy as np
import jax


def median_time(f, *a, iters: int = 20, **kw) -> float:
    """Seconds per call of f(*a, **kw): one call to compile and warm up, then the median of
    `iters` calls, each waited for."""
    jax.block_until_ready(f(*a, **kw))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*a, **kw))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def matmul_peak_tflops(n: int = 8192, iters: int = 10) -> float:
    """bf16 TFLOP/s of one n x n x n matmul on the default device, measured now (the peak a
    benchmark's kernel figures are a fraction of, in the same run)."""
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(jnp.bfloat16)
    return 2 * n ** 3 / median_time(jax.jit(lambda u: u @ u), x, iters=iters) / 1e12


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| over all elements, in fp32."""
    import jax.numpy as jnp

    got, want = jnp.asarray(got, jnp.float32).ravel(), jnp.asarray(want, jnp.float32).ravel()
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def record(kernel: str, json_path: str | None, argv: list[str] | None, program: str | None = None,
           **fields) -> dict:
    """A benchmark's result with device, jax version, date and the command that ran it
    (`program`, by default the module `redknot_jax.pallas.<kernel>`, with `argv`, or the
    process's arguments when None); written as JSON when a path is given."""
    import datetime
    import json
    import sys

    args = argv if argv is not None else sys.argv[1:]
    res = dict(kernel=kernel, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               date=datetime.date.today().isoformat(),
               command=" ".join([program or "python -m redknot_jax.pallas." + kernel, *args]), **fields)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return res
