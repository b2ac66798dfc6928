"""Pass A of a reusable CSA layer (`reuse.layer.pass_a` through the gathered-key kernel: the 8
Global heads of every computed row over its own frame's 128 window rows and its document's
top-512 entries, heads padded to the kernel's 64) at the consumer's shapes, timed side by side
for several rows-per-call caps (`call_rows`; the consumer's default is `layer.PASS_A_ROWS`,
256 = the query block it used to loop over). Documents of --doc rows each, the first an exact
prefix (its rows are keys, not queries), CSA rate 4, each row's picks among the entries its
document had closed before it. Every variant's output is checked against pass A's XLA form
(per 256-row block, gathered keys; timed too).

    python launch/bench_pass_a.py --length 32768 --call-rows 256,8192,32768 --json pass_a.json
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.config import CSA
from redknot_jax.pallas.timing import median_time, rel_err
from redknot_jax.reuse import layer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def problem(length: int, doc: int, heads: int = 8, k: int = 512, topk: int = 512, rate: int = 4, seed: int = 0):
    """pass_a's arguments (sparse CSA form) for `length` key rows in documents of `doc` rows,
    the queries every row after the first document."""
    rng = np.random.default_rng(seed)
    pos = np.arange(doc, length, dtype=np.int32)
    frame = (np.arange(length) // doc).astype(np.int32)
    seen = (pos % doc + 1) // rate  # entries of the row's document closed at or before it
    base = (pos // doc) * (doc // rate)
    pick = (rng.random((pos.size, topk)) * np.maximum(seen, 1)[:, None]).astype(np.int32)
    ids = np.where(np.arange(topk)[None] < np.minimum(seen, topk)[:, None], base[:, None] + pick, -1)
    end = np.arange(length // rate, dtype=np.int32) * rate + rate - 1
    key = jax.random.split(jax.random.key(seed), 4)
    f = lambda kk, *shape: jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
    tab = {"frame": jnp.asarray(frame[doc:]), "key_frame": jnp.asarray(frame), "pos": jnp.asarray(pos)}
    return (f(key[0], pos.size, heads, k), tab, f(key[1], length, k), (f(key[2], end.size, k), jnp.asarray(end)),
            jax.random.normal(key[3], (heads,), jnp.float32), k ** -0.5, CSA, 256, 128, jnp.asarray(ids))


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_pass_a.py --length 32768 --call-rows 256,8192,32768")
    ap.add_argument("--length", type=int, default=32768, help="key rows (the request)")
    ap.add_argument("--doc", type=int, default=8192, help="rows per document")
    ap.add_argument("--call-rows", default="256,8192", help="rows-per-call caps, comma list")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.length % a.doc or a.length <= a.doc:
        ap.error(f"--length {a.length}: expected a multiple of --doc {a.doc} above it")
    caps = [int(v) for v in a.call_rows.split(",")]
    args = problem(a.length, a.doc)
    xs, rows, want = (*args[:5], args[9]), [], None
    for cap in [None] + caps:  # None: the XLA form
        fn = jax.jit(lambda q, tab, kv, ents, sink, ids, cap=cap: layer.pass_a(
            q, tab, kv, ents, sink, *args[5:9], ids, sparse=cap is not None, call_rows=cap))
        t0 = time.perf_counter()
        o = jax.block_until_ready(fn(*xs)).astype(jnp.float32)
        first_s = time.perf_counter() - t0
        want = o if want is None else want
        ms = median_time(fn, *xs, iters=10) * 1e3
        rows.append(dict(form="xla" if cap is None else "kernel", call_rows=cap or 256,
                         calls=-(-o.shape[0] // (cap or 256)), ms=ms, first_call_s=first_s, rel_err_vs_xla=rel_err(o, want)))
        print(f"{rows[-1]['form']} call_rows {cap}: {ms:.2f} ms ({rows[-1]['calls']} calls), "
              f"vs XLA {rows[-1]['rel_err_vs_xla']:.1e}", flush=True)
    out = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d"), jax=jax.__version__,
               command="python launch/bench_pass_a.py " + " ".join(sys.argv[1:] if argv is None else argv),
               length=a.length, doc=a.doc, query_rows=int(args[0].shape[0]), rows=rows)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
