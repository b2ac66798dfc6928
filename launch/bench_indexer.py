"""Lightning Indexer on one GPU: score + top-k selection at CSA shapes, sort vs radix select.

    python launch/bench_indexer.py --queries 4096 --entries 16384 --json docs/results/indexer_h200.json

For each (queries, entries) shape: the score alone (`index_scores`), each selection method alone
on those scores (`select_topk` sort = XLA TopK, radix at each digit width), and score + selection
together, all jitted and timed side by side in one run; the picks of every radix variant are
checked to be the same set as the sort's (a mismatch exits non-zero). Visibility is causal as in
a prefill chunk that ends at the last entry (row t sees entries < (t + 1) * entries / queries).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from redknot_jax.indexer import index_scores, select_topk
from redknot_jax.pallas.timing import median_time, record


def problem(key, t: int, s: int, heads: int, dim: int):
    kq, kk, kw = jax.random.split(key, 3)
    q = jax.random.normal(kq, (1, t, heads, dim), jnp.bfloat16)
    keys = jax.random.normal(kk, (1, s, dim), jnp.bfloat16)
    w = jax.random.normal(kw, (1, t, heads), jnp.float32) * (dim ** -0.5 * heads ** -0.5)
    vis = jnp.arange(s)[None, None, :] < ((jnp.arange(t) + 1) * s // t)[None, :, None]
    return q, w, keys, vis


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", default="4096")
    ap.add_argument("--entries", default="16384")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--bits", default="4,8", help="radix digit widths to compare")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows, same = [], True
    for t in [int(v) for v in a.queries.split(",")]:
        for s in [int(v) for v in a.entries.split(",")]:
            q, w, keys, vis = problem(jax.random.key(t * 7 + s), t, s, a.heads, a.dim)
            k = min(a.topk, s)
            score = jax.jit(index_scores)
            sc = score(q, w, keys)
            row = dict(queries=t, entries=s, heads=a.heads, dim=a.dim, topk=k,
                       score_ms=median_time(score, q, w, keys, iters=a.iters) * 1e3,
                       score_tflops=2 * t * a.heads * s * a.dim / median_time(score, q, w, keys, iters=a.iters) / 1e12)
            variants = [("sort", 0)] + [("radix", int(b)) for b in a.bits.split(",")]
            ref_ids = None
            for method, bits in variants:
                name = method if method == "sort" else f"radix{bits}"
                kw = dict(method=method) if method == "sort" else dict(method=method, bits=bits)
                sel = jax.jit(functools.partial(select_topk, k=k, **kw))
                both = jax.jit(lambda q, w, keys, vis, kw=kw: select_topk(index_scores(q, w, keys), vis, k, **kw))
                ids, ok = sel(sc, vis)
                picked = np.sort(np.where(np.asarray(ok), np.asarray(ids), -1), axis=-1)
                if ref_ids is None:
                    ref_ids = picked
                elif not np.array_equal(picked, ref_ids):
                    same = False
                    print(f"MISMATCH {name} t={t} s={s}: {int((picked != ref_ids).any(-1).sum())} rows differ", flush=True)
                row[f"{name}_select_ms"] = median_time(sel, sc, vis, iters=a.iters) * 1e3
                row[f"{name}_total_ms"] = median_time(both, q, w, keys, vis, iters=a.iters) * 1e3
            rows.append(row)
            print(" ".join(f"{key}={val:.3f}" if isinstance(val, float) else f"{key}={val}" for key, val in row.items()),
                  flush=True)
    res = record("indexer_select", a.json, rows=rows, same_picks=same,
                 command="python launch/bench_indexer.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    if not same:
        raise SystemExit("radix select picked a different set than XLA TopK")
    return res


if __name__ == "__main__":
    main()
