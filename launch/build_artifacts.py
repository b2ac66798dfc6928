"""Build a corpus of document artifacts into an artifact store, resumably, with a progress bar.

    python launch/build_artifacts.py --store /tmp/store --demo 16          # random docs, tiny model
    python launch/build_artifacts.py --store /data/art --corpus docs.jsonl --checkpoint DIR
    python launch/build_artifacts.py --store /data/art --corpus docs.jsonl --preset flash-shaped \\
        --dtype bfloat16 --profile flash --tp 8

Corpus: JSON lines `{"name": str, "tokens": [int, ...]}`. Names are labels written to the
manifest only; they never become paths (documents are stored under their content hash).

Resumable manifest (`--manifest`, default `<corpus>.manifest.jsonl`, or
`<store>/demo.manifest.jsonl` for `--demo`): one JSON line per finished document (name,
doc_id, generation, tokens, seconds, built), appended and fsync'ed after its generation is
published. A rerun skips every document whose line is there and whose generation is still
in the store, and documents another builder already published (recorded with built=false);
`--rebuild` publishes a new generation for every document. A torn last line (the builder was
killed while writing it) is ignored. Killing the builder at any point loses at most the
document in flight; its temporary files are removed by the store's gc.

The summary gives build throughput in tokens/s per device (artifact construction runs on one
device: on a GPU machine this is tokens/s per GPU), overall and without the first document
(which pays for compilation; `build_artifact` is eager, so a new length bucket compiles
again), split into compute and publish time; `--json` writes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # flash-shaped weights + a long pool: JAX's 75 % is too little
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def read_corpus(path: Path, vocab: int) -> list[tuple[str, np.ndarray]]:
    docs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                name, toks = str(d["name"]), np.asarray(d["tokens"], np.int64)
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{i}: expected {{\"name\": str, \"tokens\": [int, ...]}}: {e}")
            if toks.ndim != 1 or toks.size == 0 or toks.min() < 0 or toks.max() >= vocab:
                raise SystemExit(f"{path}:{i} ({name!r}): tokens must be a non-empty list of ids in [0, {vocab})")
            docs.append((name, toks.astype(np.int32)))
    return docs


def read_manifest(path: Path) -> dict[str, dict]:
    """doc_id -> last line about it; a torn final line is ignored, a bad earlier one is an error."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i >= len(lines) - 2:  # the last line, written by a builder that was killed:
                # cut it off so that the next append starts a clean line
                keep = len("\n".join(lines[:i]).encode()) + (1 if i else 0)
                os.truncate(path, keep)
                print(f"manifest {path}: dropped a torn last line ({len(line)} chars)", file=sys.stderr)
                continue
            raise SystemExit(f"manifest {path}:{i + 1}: not JSON: {line[:80]!r}")
        done[rec["doc_id"]] = rec
    return done


def append_line(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,  # docs/store.md
                     "python launch/build_artifacts.py --store /tmp/store --demo 16",
                     "python launch/build_artifacts.py --store /data/art --corpus docs.jsonl --checkpoint DIR "
                     "--profile flash --tp 8")
    ap.add_argument("--store", required=True, help="artifact store root")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", type=lambda t: Path(_cli.input_file(t)), help="JSON lines {name, tokens}")
    src.add_argument("--demo", type=int, metavar="N", help="N random documents instead of a corpus")
    ap.add_argument("--demo-lengths", default="24,64", help="min,max tokens of --demo documents")
    ap.add_argument("--manifest", type=Path, help="resumable manifest (default: see above)")
    ap.add_argument("--checkpoint", type=_cli.checkpoint_dir,
                    help="safetensors directory with config.json (default: random weights)")
    ap.add_argument("--preset", default="tiny", help="random-weight preset when no checkpoint")
    ap.add_argument("--seed", type=int, default=7, help="random-weight seed")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--profile", default="auto", choices=["auto", "tiny", "flash", "pro"])
    ap.add_argument("--fingerprint", help="checkpoint fingerprint (default: sha256 of the checkpoint files, "
                                          "or random:<preset>:<seed>:<dtype>)")
    ap.add_argument("--tp", type=int, default=1, help="publish this many TP rank slices per document")
    ap.add_argument("--layer-group-size", type=int, default=4)
    ap.add_argument("--codec", default="raw", choices=["raw", "orbax"], help="the store's tile codec")
    ap.add_argument("--artifact-codec", default=None, choices=["dense", "fp8", "fp4"],
                    help="how the reusable layers' rows are stored (reuse/codec.py: fp8 / fp4 compact; default: "
                         "the profile's, fp4 for flash and pro, dense for tiny); part of the profile, so a "
                         "consumer reads them under the same codec")
    ap.add_argument("--no-fsync", action="store_true", help="skip fsync (scratch stores only)")
    ap.add_argument("--rebuild", action="store_true", help="a new generation for every document")
    ap.add_argument("--limit", type=int, help="stop after this many documents built")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar (there is none anyway when stderr is not a terminal)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from redknot_jax import config
    from redknot_jax.reuse import profile as profiles
    from redknot_jax.reuse.artifact import build_artifact
    from redknot_jax.reuse.certificate import json_digest
    from redknot_jax.store import ArtifactStore, document_id, split_tp

    # The model is loaded only when a document needs building (a resumed run may need none):
    # document ids need only the config, the profile and the fingerprint.
    if args.checkpoint:
        from checkpoints_convert.safetensors_io import ShardedCheckpoint

        cfg = config.ModelConfig.from_json(f"{args.checkpoint}/config.json")
        fp = args.fingerprint or json_digest(ShardedCheckpoint(args.checkpoint).fingerprint("sha256"))
    else:
        cfg = config.preset(args.preset)
        fp = args.fingerprint or f"random:{args.preset}:{args.seed}:{args.dtype}"
    kind = args.profile
    if kind == "auto":
        kind = "tiny" if cfg.num_layers <= 8 else ("pro" if cfg.num_layers > 50 else "flash")
    prof = {"tiny": lambda: profiles.tiny_profile(cfg.num_layers), "flash": profiles.flash_profile,
            "pro": profiles.pro_profile}[kind]()
    if args.artifact_codec:
        prof = dataclasses.replace(prof, artifact_codec=args.artifact_codec)
    model, load_s = None, 0.0

    def get_model():
        nonlocal model, load_s
        if model is None:
            t = time.perf_counter()
            dtype = jnp.dtype(args.dtype)
            if args.checkpoint:
                model = _cli.load_model(args.checkpoint, dtype)
            else:
                from redknot_jax.init import random_model

                model = random_model(cfg, seed=args.seed, dtype=dtype)
            load_s = time.perf_counter() - t
        return model

    if args.corpus:
        docs = read_corpus(args.corpus, cfg.vocab_size)
        manifest = args.manifest or args.corpus.with_name(args.corpus.name + ".manifest.jsonl")
    else:
        lo, hi = map(int, args.demo_lengths.split(","))
        rng = np.random.default_rng(args.seed)
        docs = [(f"demo-{i}", rng.integers(2, cfg.vocab_size, int(rng.integers(lo, hi + 1))).astype(np.int32))
                for i in range(args.demo)]
        manifest = args.manifest or Path(args.store) / "demo.manifest.jsonl"
    store = ArtifactStore(args.store, codec=args.codec, layer_group_size=args.layer_group_size,
                          durable=not args.no_fsync)
    done = read_manifest(manifest)

    built = skipped = existing = 0
    tokens_built, build_s, warm_tokens, warm_s, compute_s, publish_s = 0, 0.0, 0, 0.0, 0.0, 0.0
    bar = _cli.progress(docs, desc="build", unit="doc", off=args.no_progress)
    for name, toks in bar:
        doc = document_id(toks, prof, cfg, fp)
        gens = store.generations(doc)
        if not args.rebuild and doc in done and done[doc]["generation"] in gens:
            skipped += 1
            continue
        if not args.rebuild and gens:  # another builder (or an earlier run without manifest) made it
            append_line(manifest, {"name": name, "doc_id": doc, "generation": gens[-1], "tokens": int(toks.size),
                                   "seconds": 0.0, "built": False})
            existing += 1
            continue
        if args.limit is not None and built >= args.limit:
            break
        t0 = time.perf_counter()
        art = build_artifact(get_model(), prof, toks, checkpoint_fingerprint=fp)
        jax.block_until_ready(art.layers)
        t1 = time.perf_counter()
        pub = store.publish(split_tp(art, args.tp) if args.tp > 1 else art, on_conflict="yield")
        dt_build, dt = t1 - t0, time.perf_counter() - t0
        append_line(manifest, {"name": name, "doc_id": doc, "generation": pub.generation, "tokens": int(toks.size),
                               "seconds": round(dt, 4), "built": pub.created})
        if built:  # the first document pays for compilation
            warm_tokens, warm_s = warm_tokens + int(toks.size), warm_s + dt
        built += 1
        tokens_built += int(toks.size)
        build_s += dt
        compute_s, publish_s = compute_s + dt_build, publish_s + (dt - dt_build)
        bar.set_postfix(tok_s=f"{tokens_built / max(build_s, 1e-9):.0f}", gen=pub.generation)
    bar.close()

    dev = jax.devices()[0]
    summary = {
        "date": datetime.date.today().isoformat(), "device": f"{dev.platform}:{dev.device_kind}",
        "jax": jax.__version__, "python": platform.python_version(), "command": " ".join(sys.argv),
        "model": args.checkpoint or args.preset, "dtype": args.dtype, "profile": prof.name, "tp_slices": args.tp,
        "documents": len(docs), "built": built, "skipped_in_manifest": skipped, "found_in_store": existing,
        "tokens_built": tokens_built, "build_s": round(build_s, 3), "compute_s": round(compute_s, 3),
        "publish_s": round(publish_s, 3), "model_load_s": round(load_s, 3),
        "tokens_per_s_per_device": round(tokens_built / build_s, 1) if build_s else None,
        "warm_tokens_per_s_per_device": round(warm_tokens / warm_s, 1) if warm_s else None,
        "store": str(args.store), "manifest": str(manifest), "store_stats": store.stats(),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    store.close()
    return summary


if __name__ == "__main__":
    main()
