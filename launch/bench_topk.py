"""The CSA selection's top-k (`indexer.select_topk`: k of a query block's scores over an entry
prefix, masked to the visible entries) by prefix length, on this device: what a stage of
`indexer.select_topk_causal` costs, so that `indexer.prefix_sizes` can be cut where the cost
steps (XLA lowers a large-k top-k to a sort, whose cost may follow the next power of two).

    python launch/bench_topk.py --sizes 2048,2176,4096,4352,6144,6528,8192,8672,16384 --json topk.json

Per size: milliseconds per call of one query block ([1, --block, size] fp32 scores, k = --k), and
per 1024 entries (flat where the cost is linear in the prefix).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp

from redknot_jax.indexer import select_topk
from redknot_jax.pallas.timing import median_time, record

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def main(argv=None) -> dict:
    ap = _cli.parser(__doc__, __file__, "python launch/bench_topk.py")  # docs/kernels.md
    ap.add_argument("--sizes", default="2048,2176,4096,4352,6144,6528,8192,8672,16384")
    ap.add_argument("--block", type=int, default=256, help="query rows per call (the consumer's query block)")
    ap.add_argument("--k", type=int, default=512, help="picks per row (Flash's index_topk)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < args.k or args.block < 1:
        ap.error(f"--sizes: expected comma-separated ints >= --k ({args.k}), --block >= 1; got {args.sizes!r}, "
                 f"{args.block}")
    run = jax.jit(select_topk, static_argnums=2)
    rows = []
    for n in sizes:
        s = jax.random.normal(jax.random.key(n), (1, args.block, n), jnp.float32)
        vis = jnp.arange(n)[None, None, :] < n - jnp.arange(args.block)[None, :, None]  # causal-like edge
        ms = median_time(run, s, vis, args.k) * 1e3
        rows.append({"size": n, "ms": ms, "ms_per_1024": ms * 1024 / n})
        _cli.echo(f"size {n}: {ms:.3f} ms per {args.block}-row block, {ms * 1024 / n:.4f} ms per 1024 entries")
    return record("select_topk", args.json, argv, program="python launch/bench_topk.py", block=args.block, k=args.k,
                  rows=rows)


if __name__ == "__main__":
    main()
