"""A RedKnot request's host time: what the host does between the fences and the first reusable
layer while the device waits (and, for `plan_request`, before the first layer is dispatched).

    python launch/bench_host.py --doc-lengths 8192,32768 --json host.json

Per document length: a flash-shaped request of `--docs` documents (the first an exact prefix)
and a 512-token question, then per repeat the median milliseconds of `plan_request` (frames, row
classes), `row_risk` (the documents' per-row `far` means, stored on the device as artifacts hold
them), `fill_itop` (the budget's rows ranked) and `build_layout` (index tables, on the device).
No model and no kernel: the pool is an index-only stand-in (the layout reads its row and entry
bases), so any machine runs it; what it measures is numpy and the host-device transfers. Run it
on an older commit's package (`git archive REV redknot_jax | tar -x -C OLD`, then `PYTHONPATH=OLD:$PWD`) beside
the current one for a side-by-side figure.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

import redknot_jax.reuse.planner as planner
from redknot_jax import config
from redknot_jax.pallas.timing import record
from redknot_jax.reuse.artifact import Artifact
from redknot_jax.reuse.layout import build_layout
from redknot_jax.reuse.pool import Buckets
from redknot_jax.reuse.profile import flash_profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402

STEPS = ("plan_request", "row_risk", "fill_itop", "build_layout")


class IndexPool:
    """What `build_layout` reads of a `DocPool`: each document's first row and entry."""

    def __init__(self, artifacts):
        self.artifacts, self.index = artifacts, {id(a): k for k, a in enumerate(artifacts)}
        self.row_base = np.r_[0, np.cumsum([a.length for a in artifacts])][:-1]

    def doc(self, art) -> int:
        return self.index[id(art)]

    def entry_base(self, art, m: int) -> int:
        return int(sum(a.length // m for a in self.artifacts[:self.doc(art)]))


def request_host_ms(doc_len: int, docs: int, budget: float, repeats: int, seed: int = 0) -> dict:
    cfg = config.preset("flash-shaped")
    prof = dataclasses.replace(flash_profile(), tail_rows=0)
    reusable = list(prof.reusable_layers(cfg.num_layers))
    rng = np.random.default_rng(seed)
    arts = [Artifact(rng.integers(2, cfg.vocab_size, doc_len).astype(np.int32),
                     {i: {"far": jnp.asarray(rng.random(doc_len), jnp.float32)} for i in reusable}, None)
            for _ in range(docs)]
    pool = IndexPool(arts)
    req = planner.Request([planner.Segment(a.tokens, a) for a in arts] +
                          [planner.Segment(rng.integers(2, cfg.vocab_size, 512).astype(np.int32))])
    can_prefix = planner.can_prefix
    planner.can_prefix = lambda cert: True  # the first document is the exact prefix, as in bench_ttft
    try:
        times = {k: [] for k in STEPS}
        for rep in range(repeats + 2):  # the first two: warm-up (the transfers' programs)
            t = [time.perf_counter()]
            plan = planner.plan_request(req, prof)
            t.append(time.perf_counter())
            risk = planner.row_risk(plan, reusable)
            t.append(time.perf_counter())
            planner.fill_itop(plan, rng.random(plan.n_rows), budget, risk)
            t.append(time.perf_counter())
            jax.block_until_ready(build_layout(plan, pool, prof, cfg, 256, None, Buckets(8)).tables)
            t.append(time.perf_counter())
            if rep >= 2:
                for k, a, b in zip(STEPS, t, t[1:]):
                    times[k].append((b - a) * 1e3)
    finally:
        planner.can_prefix = can_prefix
    ms = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": plan.n_rows, "prefix": plan.prefix, **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
            "total_ms": round(sum(ms.values()), 3)}


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_host.py --doc-lengths 8192,32768")  # docs/benchmarks.md
    ap.add_argument("--doc-lengths", default="8192,32768", help="tokens per document, comma-separated")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in a.doc_lengths.split(",")]
    except ValueError:
        ap.error(f"--doc-lengths: expected comma-separated integers, got {a.doc_lengths!r}")
    for flag, value in (("--doc-lengths", min(lengths)), ("--docs", a.docs), ("--repeats", a.repeats)):
        if value < 1:
            ap.error(f"{flag}: expected positive integers, got {value}")
    if not 0 < a.budget <= 1:
        ap.error(f"--budget: expected a fraction in (0, 1], got {a.budget}")
    rows = [request_host_ms(n, a.docs, a.budget, a.repeats) for n in lengths]
    res = record("host", a.json, argv, program="python launch/bench_host.py", docs=a.docs, budget=a.budget,
                 repeats=a.repeats, rows=rows)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
