"""The break-even table (issue #47): TTFT of both arms per artifact tier and request length, on
the device this runs on, in the form `launch/serve.py --break-even` reads (reuse/break_even.py).

Per length: a request of --docs documents (the first an exact prefix) and a --question-token
question, every document's artifact built once and published to a scratch artifact store.
Timed, each the median of --repeats after a warm-up call (compiles excluded):
* recompute: the Recomputed arm;
* device: RedKnot over a device arena already holding the documents, the first document's exact
  prefix hot in the runtime's prefix cache (as the server holds them);
* host: the documents' artifacts in host memory, written into the arena (the prefix cache
  emptied: the fences' prefix states read from the artifact too), then RedKnot;
* disk: the artifacts read from the store (verified), certified, written into the arena, then RedKnot.

    python launch/bench_break_even.py --lengths 512,1024,2048 --out docs/results/break_even_cpu.json
    python launch/bench_break_even.py --preset flash-shaped --dtype bfloat16 --profile flash \\
        --lengths 16384,65536 --out break_even_h200.json        # one H200

The table serves only the profile it measured (`serve.py --break-even` refuses it for another):
--profile and --artifact-codec as the server's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

# flash-shaped weights + a long pool: JAX's default 75 % of the GPU is too little
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402

DEFAULT_CKPT = pathlib.Path(__file__).resolve().parents[1] / "redknot_jax" / "assets" / "qa_model"


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{name}: expected integers >= 1, got {text!r}")
    return out


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,  # README
                     "python launch/bench_break_even.py --lengths 1024,3072 --out break_even.json")
    ap.add_argument("--checkpoint", default=None, type=_cli.checkpoint_dir,
                    help="safetensors checkpoint (default: the shipped QA model)")
    ap.add_argument("--preset", default=None, help="random weights of this preset instead (e.g. flash-shaped)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--profile", default="auto", type=_cli.profile_arg,
                    help="as serve.py's: auto (the checkpoint's, else by layer count) | tiny | tiny-exact | flash | "
                         "pro | profile.json (the table serves only this profile)")
    ap.add_argument("--artifact-codec", default=None, choices=["dense", "fp8", "fp4"],
                    help="how the artifacts are stored (reuse/codec.py; default: the profile's)")
    ap.add_argument("--lengths", type=lambda t: _ints(t, "--lengths"), default=[512, 1024, 2048])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--question", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="the table (JSON; a .md beside it)")
    args = ap.parse_args(argv)
    if args.docs < 1 or args.repeats < 1 or args.question < 1:
        ap.error("--docs, --repeats and --question must be >= 1")
    short = [n for n in args.lengths if n < args.docs + args.question]
    if short:
        ap.error(f"--lengths {short}: a request needs at least --docs + --question = {args.docs + args.question} tokens")
    if args.checkpoint and args.preset:
        ap.error("--checkpoint and --preset: give one of them")

    import jax
    import jax.numpy as jnp

    from redknot_jax import config
    from redknot_jax.init import random_model
    from redknot_jax.quality.model_config import PROFILE_FILE
    from redknot_jax.quality.train import load_model
    from redknot_jax.reuse import profile as profiles
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.reuse.planner import Request, Segment
    from redknot_jax.reuse.runtime import ReuseRuntime
    from redknot_jax.store import ArtifactStore

    if args.preset:
        cfg = config.preset(args.preset)
        model = random_model(cfg, seed=0, dtype=jnp.dtype(args.dtype))
        fp = f"random-{args.preset}-seed-0"
    else:
        ckpt = args.checkpoint or str(DEFAULT_CKPT)
        model, fp = load_model(ckpt), f"checkpoint:{pathlib.Path(ckpt).name}"
        cfg = model.cfg
    try:
        shipped = None if args.preset else str(pathlib.Path(args.checkpoint or DEFAULT_CKPT) / PROFILE_FILE)
        prof = profiles.named(args.profile, cfg.num_layers, shipped)
    except (ValueError, OSError, TypeError) as e:  # ProfileError, a file that is not a profile
        ap.error(f"--profile: {e}")
    if args.artifact_codec:
        prof = dataclasses.replace(prof, artifact_codec=args.artifact_codec)
    rt = ReuseRuntime(model, prof, fp, prefix_cache=1)  # the first document's exact prefix, as the server holds it
    rng = np.random.default_rng(0)
    points, raw = [], []
    tmp = tempfile.TemporaryDirectory()
    store = ArtifactStore(pathlib.Path(tmp.name) / "store", durable=False)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        out = fn()
        np.asarray(out.logits)  # wait for the device
        return time.perf_counter() - t0

    bar = _cli.progress(desc="lengths x (build + 4 arms)", total=len(args.lengths) * 5, unit="step")
    for n in args.lengths:
        per = (n - args.question) // args.docs
        lens = [per] * (args.docs - 1) + [n - args.question - per * (args.docs - 1)]
        docs = [rng.integers(2, cfg.vocab_size, k).astype(np.int32) for k in lens]
        question = rng.integers(2, cfg.vocab_size, args.question).astype(np.int32)
        bar.set_postfix_str(f"{n} tokens: build")
        arts = [build_artifact(model, prof, d, checkpoint_fingerprint=fp, kernels=rt.consumer.kernels) for d in docs]
        ids = [store.publish(a).doc_id for a in arts]
        bar.update()
        req = lambda aa: Request([Segment(d, a) for d, a in zip(docs, aa)] + [Segment(question)])
        arena = rt.consumer.arena(rows=n + args.docs * cfg.hca_rate, docs=2 * args.docs)  # one set at a time

        def recompute():
            return rt.prefill(req([None] * len(docs)), "recompute")

        def over_arena(aa, load: bool):
            def run():
                if load:
                    aa[:] = [store.load(i) for i in ids]  # verified read: new artifact objects
                arena.acquire(aa)
                try:
                    return rt.prefill(req(aa), "redknot", require_reuse=True, pool=arena)
                finally:
                    arena.release(aa)
            return run

        arms = {"recompute": recompute}
        arms["device"] = over_arena(arts, False)
        arms["host"] = over_arena(arts, False)
        loaded = list(arts)
        arms["disk"] = over_arena(loaded, True)
        secs = {}
        for name, fn in arms.items():
            bar.set_postfix_str(f"{n} tokens: {name}")
            fn()  # warm-up: compiles
            ts = []
            for _ in range(args.repeats):
                if name in ("host", "disk"):  # not resident: the request writes them in (its exact prefix too)
                    arena.evict(arts + loaded)
                    rt.prefix_cache.clear()
                ts.append(timed(fn))
            secs[name] = statistics.median(ts)
            raw.append({"tokens": n, "arm": name, "seconds": ts})
            bar.update()
            _cli.echo(f"{n} tokens: {name} {secs[name]:.3f}s")  # as it ends (the bar draws only on a terminal)
        for tier in ("device", "host", "disk"):
            points.append({"tier": tier, "tokens": n, "recompute_s": round(secs["recompute"], 6),
                           "redknot_s": round(secs[tier], 6)})
        _cli.echo(f"{n} tokens: " + ", ".join(f"{k} {v:.3f}s" for k, v in secs.items()))
    bar.close()
    tmp.cleanup()
    result = {"device": str(jax.devices()[0].device_kind), "date": datetime.date.today().isoformat(),
              "command": "python launch/bench_break_even.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "jax": jax.__version__, "model": args.preset or pathlib.Path(args.checkpoint or DEFAULT_CKPT).name,
              "profile": prof.name, "profile_digest": prof.digest(), "docs": args.docs, "question": args.question,
              "repeats": args.repeats,
              "points": points, "raw": raw}
    lines = ["| tokens | tier | Recomputed s | RedKnot s | faster |", "|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['tokens']} | {p['tier']} | {p['recompute_s']:.3f} | {p['redknot_s']:.3f} | "
                     f"{'RedKnot' if p['redknot_s'] <= p['recompute_s'] else 'Recomputed'} |")
    print("\n".join(lines))
    if args.out:
        out = pathlib.Path(args.out)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
