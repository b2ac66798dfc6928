"""Where a bf16 tensor-parallel run leaves fp32 (issue #6): the RedKnot arm of one request
through `TPConsumer` at tp = 1 and tp = 2 in bf16 and at tp = 1 in fp32 (each with artifacts
built in its own dtype), with the hidden streams compared after every layer, over all rows and
at the query row, and the logits at the end. A jump at one layer for one degree only is a
discrete choice (a top-k near-tie) going the other way, not accumulated rounding.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python launch/trace_tp_bf16.py \\
        --out docs/results/tp_cpu_layer_trace.json
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys

import numpy as np
import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from launch import _cli  # noqa: E402
from launch.bench_ttft import profile_variant, records  # noqa: E402
from redknot_jax import config  # noqa: E402
from redknot_jax.init import random_model  # noqa: E402
from redknot_jax.reuse.artifact import build_artifact  # noqa: E402
from redknot_jax.reuse.planner import Request, Segment, plan_request  # noqa: E402
from redknot_jax.reuse.profile import tiny_profile  # noqa: E402
from redknot_jax.sharding.consumer_tp import TPConsumer  # noqa: E402
from redknot_jax.sharding.table import make_mesh  # noqa: E402


def trace(cfg, prof, docs, q, dtype, tp: int):
    """The RedKnot arm layer by layer: (hidden streams after each layer [real rows], logits, plan)."""
    model = random_model(cfg, seed=0, dtype=dtype)
    arts = [build_artifact(model, prof, d, checkpoint_fingerprint="trace") for d in docs]
    req = Request([Segment(d, a) for d, a in zip(docs, arts)] + [Segment(q)])
    con = TPConsumer(model, prof, make_mesh(tp))
    plan, streams = plan_request(req, prof), []
    logits, _ = con.redknot(plan, req.tokens, con.pool(arts), streams=streams)
    t_real = len(req.tokens)
    return [np.asarray(x, np.float32)[:, :t_real] for x in streams], np.asarray(logits, np.float32), plan


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "XLA_FLAGS=--xla_force_host_platform_device_count=2 "
                                        "python launch/trace_tp_bf16.py --out docs/results/tp_cpu_layer_trace.json")
    ap.add_argument("--preset", default="tiny-tp2", choices=sorted(config.PRESETS))
    ap.add_argument("--length", type=int, default=600)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--question", type=int, default=40)
    ap.add_argument("--budget", type=float, default=1.0, help="budget_override (1.0: no controller choice)")
    ap.add_argument("--out", default="tp_layer_trace.json")
    args = ap.parse_args(argv)
    if len(jax.devices()) < 2:
        ap.error("needs 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    cfg = config.PRESETS[args.preset]()
    prof = profile_variant(tiny_profile(cfg.num_layers), budget_override=args.budget)
    docs, q, digest = records(args.length, args.docs, args.question, cfg.vocab_size, 0)
    bar = _cli.progress(desc="traced runs", total=3, unit="run")
    f32, lf, plan = trace(cfg, prof, docs, q, jnp.float32, 1)
    bar.update()
    runs = {}
    for tp in (1, 2):
        runs[f"bf16 tp={tp}"] = trace(cfg, prof, docs, q, jnp.bfloat16, tp)
        bar.update()
    bar.close()
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    qr = plan.query_rows
    out = {"command": "python launch/trace_tp_bf16.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "preset": args.preset, "records_sha256": digest, "profile": prof.to_dict(),
           "query_rows": [int(r) for r in qr], "vs_fp32": {}}
    for name, (xs, lg, _) in runs.items():
        out["vs_fp32"][name] = {
            "layers": [{"layer": i, "fence": prof.is_fence(i, cfg.num_layers), "all_rows": rel(x, f),
                        "query_rows": rel(x[:, qr], f[:, qr])} for i, (x, f) in enumerate(zip(xs, f32))],
            "logits": rel(lg, lf)}
        print(name, "logits vs fp32 %.4f;" % out["vs_fp32"][name]["logits"], "query row per layer:",
              " ".join("%.4f" % r["query_rows"] for r in out["vs_fp32"][name]["layers"]))
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
