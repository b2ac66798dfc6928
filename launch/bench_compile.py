"""Compile seconds of one layer's program and of its parts, for a decode step or a prefill chunk.

Nothing is allocated: the model's weights and caches are shapes (`nnx.eval_shape`), each part
is lowered and compiled for the default device (`jax.jit(...).lower(...).compile()`), never run.
Each part compiles in its own child process (JAX's persistent cache off), all at once, so one
slow compile does not hold the others and `--timeout` cuts a straggler (reported as `> T s`).
What a server's warm-up waits on, part by part (its programs: `Engine._chunk`, one
`model.block_jit` per distinct layer):

  layer     the whole `Block` (what `block_jit` compiles; XLA for every part, as a decode step)
  mhc_pre   `HyperConnection.pre` of the attention site: mix_logits, Sinkhorn, the block input
  mix       `mhc.mix_logits` alone
  sinkhorn  `mhc.sinkhorn` alone, over the site's [b, t, n, n] logits
  hc_post   `HyperConnection.post`
  attn      `Attention.__call__` over the layer's cache (XLA paths)
  moe       `MoE.__call__` (routing, experts, shared expert)
  ffn       `Block.ffn_residual`: mHC pre, the MoE, mHC post

`--sinkhorn loop` compiles the Sinkhorn iterations as a `fori_loop` (what training runs)
instead of unrolled, `--sinkhorn reduce` unrolled with its sums and max as reduce ops (the form
before `mhc.fold`), to compare. Prints one line per part; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402

PARTS = ("layer", "mhc_pre", "mix", "sinkhorn", "hc_post", "attn", "moe", "ffn")
EXAMPLE = ("python launch/bench_compile.py --preset flash-shaped --layer 0 --slots 8 --capacity 33280 "
           "--parts layer,mhc_pre,sinkhorn,attn,moe,ffn --timeout 300")


def compile_part(preset: str, part: str, layer: int, slots: int, rows: int, capacity: int, sinkhorn: str) -> dict:
    """Lower and compile one part in this process: {part, lower_s, compile_s}."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from redknot_jax import config, mhc
    from redknot_jax.model import Model

    cfg = config.preset(preset)
    model = nnx.eval_shape(lambda: Model(cfg, jnp.bfloat16))
    if not 0 <= layer < cfg.num_layers:
        raise ValueError(f"--layer {layer}: the preset has layers 0..{cfg.num_layers - 1}")
    cache = jax.eval_shape(lambda: model.init_cache(slots, capacity))["layers"][layer]
    blk = model.layers[layer]
    for site in (blk.hc_attn, blk.hc_ffn):
        site.unroll_sinkhorn = sinkhorn != "loop"
    if sinkhorn == "reduce":  # this process only: mhc.sinkhorn's folds as the reduce ops they replace
        mhc.fold = lambda op, x, axis: (jnp.sum if op is jnp.add else jnp.max)(x, axis=axis, keepdims=True)
    gd, state = nnx.split(blk)
    n, d, freqs, block = cfg.hc_mult, cfg.hidden_size, model.freqs(layer), min(256, rows)
    sds = jax.ShapeDtypeStruct
    shapes = {"x": sds((slots, rows, n, d), jnp.bfloat16), "u": sds((slots, rows, d), jnp.bfloat16),
              "ids": sds((slots, rows), jnp.int32), "pos": sds((slots,), jnp.int32), "cache": cache,
              "post": sds((slots, rows, n), jnp.float32), "comb": sds((slots, rows, n, n), jnp.float32)}
    site = blk.hc_attn
    calls = {
        "layer": lambda b, a: b(a["x"], a["ids"], a["pos"], a["pos"], a["cache"], freqs, block),
        "mhc_pre": lambda b, a: b.hc_attn.pre(a["x"]),
        "mix": lambda b, a: mhc.mix_logits(a["x"], b.hc_attn.fn[...], site.norm_eps),
        "sinkhorn": lambda b, a: mhc.sinkhorn(a["comb"], site.iters, site.hc_eps, site.unroll_sinkhorn),  # alone
        "hc_post": lambda b, a: mhc.HyperConnection.post(a["x"], a["u"], a["post"], a["comb"]),
        "attn": lambda b, a: b.attn(a["u"], a["pos"], a["pos"], a["cache"], freqs, block, kernels="xla", sparse="xla"),
        "moe": lambda b, a: b.ffn(a["u"], a["ids"]),
        "ffn": lambda b, a: b.ffn_residual(a["x"], a["ids"]),
    }
    if part not in calls:
        raise ValueError(f"part {part!r}: expected one of {', '.join(PARTS)}")
    fn = jax.jit(lambda st, a: calls[part](nnx.merge(gd, st), a))
    t0 = time.perf_counter()
    low = fn.trace(state, shapes).lower()
    t1 = time.perf_counter()
    low.compile()
    return {"part": part, "lower_s": round(t1 - t0, 2), "compile_s": round(time.perf_counter() - t1, 2)}


def main(argv=None) -> list[dict]:
    ap = _cli.parser(__doc__, __file__, EXAMPLE)
    ap.add_argument("--preset", default="flash-shaped", help="model preset (redknot_jax.config.PRESETS)")
    ap.add_argument("--layer", type=int, default=0, help="which layer's parts (its kind: sliding, CSA or HCA)")
    ap.add_argument("--slots", type=int, default=8, help="sequences per call (a decode step's slots)")
    ap.add_argument("--rows", type=int, default=1, help="rows per sequence: 1 is a decode step, more a prefill chunk")
    ap.add_argument("--capacity", type=int, default=33280, help="cache positions per sequence")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    ap.add_argument("--sinkhorn", default="unrolled", choices=["unrolled", "loop", "reduce"],
                    help="the mHC sites' Sinkhorn: unrolled (served), a fori_loop (training's), or unrolled with "
                         "its sums and max as reduce ops (mhc.fold's replaced form)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a part may compile before it is cut")
    ap.add_argument("--out", help="write the lines as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one part, in this process
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        ap.error(f"--parts: {bad or 'none given'}: expected a comma list of {', '.join(PARTS)}")
    from redknot_jax.config import PRESETS

    if args.preset not in PRESETS:
        ap.error(f"--preset: unknown {args.preset!r}; known: {', '.join(sorted(PRESETS))}")
    for flag in ("slots", "rows", "capacity"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}: expected a positive integer, got {getattr(args, flag)}")
    if args.child:
        res = compile_part(args.preset, parts[0], args.layer, args.slots, args.rows, args.capacity, args.sinkhorn)
        print(json.dumps(res))
        return [res]
    base = [sys.executable, os.path.abspath(__file__), "--child", "--preset", args.preset, "--layer", str(args.layer),
            "--slots", str(args.slots), "--rows", str(args.rows), "--capacity", str(args.capacity),
            "--sinkhorn", args.sinkhorn]
    # a compile, not a persistent-cache read; no child preallocates the device's memory (they run side by side), and
    # jax 0.11.2's allocator partitioning is off (with it two H100 runs died in `BFCAllocator::InsertFreeChunk`:
    # "spatial partitioning expects one central gap", while the autotuner allocated, 2026-12-07)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_allocator_spatial_partitioning=false"
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "XLA_FLAGS": flags.strip()}
    procs = {p: subprocess.Popen(base + ["--parts", p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env) for p in parts}
    t0, rows = time.perf_counter(), []
    for p, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(1.0, args.timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            res = {"part": p, "compile_s": None, "note": f"> {args.timeout:g} s (cut)"}
        else:
            if proc.returncode:  # reported, and the other parts still are
                why = [ln for ln in err.splitlines() if "Check failed" in ln or "Error" in ln] or err.splitlines()[-1:]
                why = why[-1].strip()[:300] if why else "no error output"
                res = {"part": p, "compile_s": None, "note": f"failed (exit {proc.returncode}): {why}"}
            else:
                res = json.loads(out.strip().splitlines()[-1])
        rows.append(res)
        print(f"{p:9s} " + (f"lowered {res['lower_s']:.1f}s, compiled {res['compile_s']:.1f}s"
                            if res["compile_s"] is not None else res["note"]), flush=True)
    if args.out:
        import jax

        meta = {"command": "python launch/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "date": datetime.date.today().isoformat(), "parts": rows}
        pathlib.Path(args.out).write_text(json.dumps(meta, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
