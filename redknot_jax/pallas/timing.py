"""Timing for the kernels' benchmark `main()`s: the median of timed calls after a warm-up."""

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
