"""Pass A of a reusable layer (`reuse.layer.pass_a`: the 8 Global heads of every computed row over
its own frame's 128 window rows and its compressed entries) at the consumer's shapes, variants
timed side by side:
* CSA (the document's top-512 entries per row) through the gathered-key kernel, heads padded to
  its 64, for several rows-per-call caps (`call_rows`; the consumer's default is
  `layer.PASS_A_ROWS`, 256 = the query block it used to loop over), beside the XLA form and
  its span form (`--span-rows`: steps of that many rows, each scoring one slice of entries,
  `layer.csa_span_bound` of the document, masked to the picks) and that form scored in chunks
  of entries up to each step's last pick (`--span-chunks`, steps of `layer.SPAN_ROWS` rows);
* HCA (every visible entry, rate 128) in XLA for several rows-per-step caps (`--hca-rows`, the
  same `call_rows`; 256 = the query block it used to loop over).
Documents of --doc rows each, the first an exact prefix (its rows are keys, not queries); a CSA
row's picks are among the entries its document had closed before it. Every variant's output is
checked against the first of its kind (CSA: the XLA form).

    python launch/bench_pass_a.py --length 65536 --call-rows 256,8192 --span-rows 1024,4096 --hca-rows 256,8192 \
        --json pass_a.json
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.config import CSA, HCA
from redknot_jax.pallas.timing import median_time, rel_err
from redknot_jax.reuse import layer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def problem(length: int, doc: int, kind: str = CSA, heads: int = 8, k: int = 512, topk: int = 512, seed: int = 0):
    """pass_a's arguments for a `kind` layer (CSA or HCA) over `length` key rows in documents of
    `doc` rows, the queries every row after the first document."""
    rate = 4 if kind == CSA else 128
    pos = np.arange(doc, length, dtype=np.int32)
    frame = (np.arange(length) // doc).astype(np.int32)
    seen = (pos % doc + 1) // rate  # entries of the row's document closed at or before it
    base = (pos // doc) * (doc // rate)
    key = jax.random.split(jax.random.key(seed), 5)
    # distinct picks, as a top-k's: the first of a random order of the entries seen
    order = jax.random.uniform(key[4], (pos.size, max(doc // rate, topk))) + (np.arange(max(doc // rate, topk))[None]
                                                                             >= seen[:, None])
    pick = np.asarray(jax.lax.top_k(-order, topk)[1], np.int32)
    ids = np.where(np.arange(topk)[None] < np.minimum(seen, topk)[:, None], base[:, None] + pick, -1)
    end = np.arange(length // rate, dtype=np.int32) * rate + rate - 1
    f = lambda kk, *shape: jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16)
    tab = {"frame": jnp.asarray(frame[doc:]), "key_frame": jnp.asarray(frame), "pos": jnp.asarray(pos)}
    return (f(key[0], pos.size, heads, k), tab, f(key[1], length, k), (f(key[2], end.size, k), jnp.asarray(end)),
            jax.random.normal(key[3], (heads,), jnp.float32), k ** -0.5, kind, 256, 128,
            jnp.asarray(ids) if kind == CSA else None)


def timed(fn, xs, want):
    """(ms, first call s, output fp32, rel err vs want or 0)."""
    t0 = time.perf_counter()
    o = jax.block_until_ready(fn(*xs)).astype(jnp.float32)
    first_s = time.perf_counter() - t0
    return median_time(fn, *xs, iters=10) * 1e3, first_s, o, 0.0 if want is None else rel_err(o, want)


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,
                     "python launch/bench_pass_a.py --length 65536 --call-rows 256,8192 --span-rows 1024,4096 "
                     "--hca-rows 256,8192 --json pass_a.json")
    ap.add_argument("--length", type=int, default=32768, help="key rows (the request)")
    ap.add_argument("--doc", type=int, default=8192, help="rows per document")
    ap.add_argument("--call-rows", default="256,8192", help="CSA: the kernel's rows-per-call caps, comma list")
    ap.add_argument("--span-rows", default="1024,4096", help="CSA: the span form's rows-per-step caps, comma list")
    ap.add_argument("--span-chunks", default="", help="CSA: the span form's entries per chunk, comma list "
                    "(online softmax up to each step's last pick; steps of layer.SPAN_ROWS rows)")
    ap.add_argument("--hca-rows", default="256,8192", help="HCA: XLA rows-per-step caps, comma list")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.length % a.doc or a.length <= a.doc:
        ap.error(f"--length {a.length}: expected a multiple of --doc {a.doc} above it")
    ints = lambda spec: [int(v) for v in spec.split(",") if v]
    caps, spans, blocks, chunks = ints(a.call_rows), ints(a.span_rows), ints(a.hca_rows), ints(a.span_chunks)
    rows = []
    csa = [("xla", None, None)] + [("kernel", v, None) for v in caps] + [("span", v, None) for v in spans] + \
        [("span", layer.SPAN_ROWS, c) for c in chunks]
    for kind, variants in ((CSA, csa if caps or spans or chunks else []), (HCA, [("xla", v, None) for v in blocks])):
        if not variants:
            continue
        args = problem(a.length, a.doc, kind)
        xs, want = (*args[:5], args[9]), None
        for form, v, chunk in variants:  # CSA: None = the XLA form's block steps; else a cap
            span = layer.csa_span_bound(a.doc, 4, args[8], v) if form == "span" else None
            fn = jax.jit(lambda q, tab, kv, ents, sink, ids, form=form, v=v, span=span, chunk=chunk: layer.pass_a(
                q, tab, kv, ents, sink, *args[5:9], ids, sparse=form == "kernel", call_rows=v, csa_span=span,
                span_chunk=chunk))
            ms, first_s, o, err = timed(fn, xs, want)
            want = o if want is None else want
            rows.append(dict(kind=kind, form=form, rows_per_step=v or 256, span=span, span_chunk=chunk,
                             steps=-(-o.shape[0] // (v or 256)), ms=ms, first_call_s=first_s,
                             rel_err_vs_first=err))
            name = f"{form} chunks of {chunk}" if chunk else form
            print(f"{kind} {name} {rows[-1]['rows_per_step']} rows per step: {ms:.2f} ms "
                  f"({rows[-1]['steps']} steps), vs the first {err:.1e}", flush=True)
    out = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d"), jax=jax.__version__,
               command="python launch/bench_pass_a.py " + " ".join(sys.argv[1:] if argv is None else argv),
               length=a.length, doc=a.doc, query_rows=a.length - a.doc, rows=rows)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
