"""Prefill and decode throughput of the flash-shaped preset on one GPU (issue: model benchmark).

Random bf16 weights (speed does not depend on values), every Flash dimension and the 43-layer
schedule with 16 routed experts (top-6: FLOPs per token of Flash). For each length: chunked
prefill (chunks of --chunk rows; equals one-shot prefill), then --decode-steps greedy decode
steps at batch 1. Analytic FLOPs (recompute arm of the operator ledger) over time give
TFLOP/s; MFU is against a bf16 matmul peak measured in the same run. Where a decode step's time
goes: `decode_host_ms`, the host's time to dispatch one (4 steps enqueued, nothing read back), and
`decode_device_ms`, the device's busy time in one (a trace of 2 steps, `redknot_jax.op_profile`);
a step takes about the larger of the two.

    python launch/bench_model.py --lengths 8192,32768,65536 --out docs/bench_model.md
"""

from __future__ import annotations

import os
import datetime
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # flash-shaped weights + a long pool: JAX's 75 % is too little
import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax import config, op_profile
from redknot_jax.generate import Engine
from redknot_jax.init import random_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 matmul TFLOP/s (median of reps) on the default device."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(ts) / 1e12


def prefill_flops(cfg, n: int) -> float:
    """Analytic FLOPs of a full prefill of n rows (recompute arm)."""
    try:
        from redknot_jax.reuse.ledger import operator_flops
    except ImportError:  # older tree: report times only
        return float("nan")
    from redknot_jax.reuse.profile import flash_profile

    ops = operator_flops(cfg, flash_profile(), n_rows=n, protected_rows=n, kept_experts_per_row=6.0,
                         arm="recompute")
    return float(sum(ops.values()))


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,  # docs/benchmarks.md
                     "python launch/bench_model.py --lengths 8192,32768 --decode-steps 16")
    ap.add_argument("--lengths", default="8192,32768,65536")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="write a markdown table here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: expected comma-separated integers, got {args.lengths!r}")

    cfg = config.flash_shaped(args.experts)
    dev = jax.devices()[0]
    t0 = time.perf_counter()
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16)
    jax.block_until_ready(model.embed[...])
    print(f"init {time.perf_counter() - t0:.1f}s on {dev.device_kind}", flush=True)
    peak = matmul_peak()
    print(f"bf16 matmul peak {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for L in _cli.progress(lengths, desc="lengths", unit="length"):
        eng = Engine(model, capacity=L + args.decode_steps + 256, block=256)
        prompt = [np.random.default_rng(L).integers(2, cfg.vocab_size, L).tolist()]
        t0 = time.perf_counter()
        logits, cache = eng.prefill(prompt, chunk=args.chunk)
        tok = jnp.argmax(logits, -1)
        logits, cache = eng.decode(np.asarray(tok), cache)
        jax.block_until_ready(logits)
        compile_s = time.perf_counter() - t0
        pre, dec = [], []
        for _ in range(args.repeats):
            del cache
            t0 = time.perf_counter()
            logits, cache = eng.prefill(prompt, chunk=args.chunk)
            jax.block_until_ready(logits)
            pre.append(time.perf_counter() - t0)
            tok = np.asarray(jnp.argmax(logits, -1))
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                logits, cache = eng.decode(tok, cache)
                tok = np.asarray(jnp.argmax(logits, -1))
            dec.append((time.perf_counter() - t0) / args.decode_steps)
        t0 = time.perf_counter()
        for _ in range(4):  # the host's side of a step: dispatched, nothing read back (the cache has 256 spare rows)
            logits, cache = eng.decode(tok, cache)
        host = (time.perf_counter() - t0) / 4
        jax.block_until_ready(logits)
        with tempfile.TemporaryDirectory() as trace:  # the device's side: its busy time in 2 steps
            jax.profiler.start_trace(trace)
            for _ in range(2):
                logits, cache = eng.decode(tok, cache)
            jax.block_until_ready(logits)
            jax.profiler.stop_trace()
            busy = op_profile.summarize(trace)["ops_ms"] / 2
        fl = prefill_flops(cfg, L)
        p, d = statistics.median(pre), statistics.median(dec)
        row = dict(length=L, chunk=args.chunk, prefill_s=p, prefill_tok_s=L / p, flops=fl, tflops=fl / p / 1e12,
                   mfu=fl / p / 1e12 / peak, decode_ms=d * 1e3, decode_tok_s=1 / d, decode_host_ms=host * 1e3,
                   decode_device_ms=busy, first_call_s=compile_s,
                   prefill_runs=pre, decode_runs_ms=[x * 1e3 for x in dec])
        rows.append(row)
        _cli.echo(json.dumps(row))
        del cache, eng
    meta = dict(date=datetime.date.today().isoformat(), device=dev.device_kind, jax=jax.__version__,
                python=platform.python_version(), peak_tflops=peak, experts=args.experts,
                command="python launch/bench_model.py " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.json:
        json.dump(dict(meta=meta, rows=rows), open(args.json, "w"), indent=1)
    table = ["| length | prefill s | prefill tok/s | TFLOP/s | MFU | decode ms/token (b=1) | decode tok/s | "
             "host ms/step | device ms/step | first call s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['length']} | {r['prefill_s']:.3f} | {r['prefill_tok_s']:.0f} | {r['tflops']:.0f} | "
                     f"{r['mfu'] * 100:.1f} % | {r['decode_ms']:.1f} | {r['decode_tok_s']:.1f} | "
                     f"{r['decode_host_ms']:.1f} | {r['decode_device_ms']:.1f} | {r['first_call_s']:.0f} |")
    text = "\n".join(table)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"Device {meta['device']}, {meta['date']}, jax {meta['jax']}, measured bf16 matmul peak "
                    f"{peak:.0f} TFLOP/s, flash-shaped ({args.experts} routed experts, top-6), chunk {args.chunk}.\n\n"
                    + text + "\n")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
