"""TTFT of both arms on exactly the same requests (issue #9; DESIGN §6 timing rules).

A release suite of frozen request records per length (documents drawn from a seed, the first
as prefix at offset 0, the rest relocated, then a question of new rows); the records' token
digests are saved with the results so a rerun can check it measured the same requests. Per
length: build the artifacts (timed: the cold construction cost), admit them (--resident device:
the hot tier, a device-resident `DocPool`; host: a `HostPool`, payloads in host memory, each
layer copied to the device one layer ahead of the consumer, the copy the compute does not hide
counted in TTFT; --host-kind: from pageable or pinned host memory, staged at admission;
payload digests verified once; the exact prefix's cache, `prefix.PrefixCache` of one
document: the first document's native state of every layer dense on the device, as a prefix
cache holds it, read by the prefix and RedKnot arms alike), warm up the arms (compilation), then
alternate the arms for --repeats. --cold adds, after them, RedKnot runs whose TTFT includes
building every artifact from the documents' tokens (construction, packing, certification).
TTFT = model-forward entry to the first token on the host; the RedKnot arm's boundary
includes certification, planning, the controller and the layout. A RedKnot run that fell back
is rejected (require_reuse).

    python launch/bench_ttft.py --lengths 65536 --docs 4 --repeats 2 --out ttft.json
    python launch/bench_ttft.py --lengths 65536 --fanout k3 --tail-rows 4096 --out ttft_k3.json  # variants
    python launch/bench_ttft.py --lengths 131072 --resident host --repeats 1 --out ttft_128k_host.json
    python launch/bench_ttft.py --lengths 32768 --cold --out ttft_32k_cold.json
    python launch/bench_ttft.py --lengths 65536 --repeats 1 --layer-times --out ttft_64k_layers.json  # profile
    python launch/bench_ttft.py --lengths 65536 --repeats 1 --op-profile 3,4 --out ttft_64k_ops.json  # op level
    python launch/bench_ttft.py --lengths 65536 --repeats 1 --decode-steps 16 --out ttft_64k_decode.json
    python launch/bench_ttft.py --lengths 32768 --repeats 1 --decode-steps 16 \
        --kernels indexer+restore+ragged_dot+sparse_attention,indexer+restore+ragged_dot+sparse_attention+seg_attention
    python launch/bench_ttft.py --lengths 15872,16384 --repeats 1 --shape-buckets 0 --out ttft_buckets0.json
    python launch/bench_ttft.py --lengths 65536 --repeats 2 --topk-stages 4,1 --out ttft_64k_stages.json

--topk-stages N[,M..]: the CSA selection's entry prefixes (`indexer.select_topk_causal`; 1 scores
every entry, the form before session 30); several are timed side by side, each under every
kernel set, keyed 'SET/stagesN'.

--shape-buckets N: the consumer's padded sizes per octave (`reuse.pool.Buckets`, default 8; 0: exact
sizes). Each length's `warmup_*_s` is its first call: with two lengths in one bucket the second
compiles nothing, so its warm-up is about one timed run; with 0 it compiles its own programs.

--decode-steps N adds, after the timed runs, per arm one prefill that keeps a decode state
(`prefill(decode_rows=)`) and N greedy tokens after it (`next_logits`, one row per step): the
seconds per token side by side (the first step, which compiles, apart), and the RedKnot state's
device bytes (fence layers' native caches; reusable layers' compact rows, the documents' rows
read from the pool, and the request's entries; the decode layout) against what per-row copies
of every request row would hold. With several --kernels sets the RedKnot decode runs under each
(`decode.by_kernels`): decode kernels ("seg_attention") side by side.

--decode-batch B (with --decode-steps) then decodes B copies of the request per arm as rows of one
`DecodeBatch` (the server's document decode batch; native states for the Recomputed arm):
seconds per step and per token, and whether every row's tokens are the single run's.

--store DIR keeps the built artifacts in an artifact store (raw codec) and reads them back on a
later run with the same records, profile and model (content ids): a run too long for one call
(128K: the build alone is minutes) can be split into a build call and a timed call. The row
then says `artifacts: "store"` and `load_s` replaces `build_s`; the timed runs are unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import hashlib
import json
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # flash-shaped weights + a long pool: JAX's 75 % is too little
import numpy as np
import jax

from redknot_jax import config, op_profile
from redknot_jax.indexer import TOPK_STAGES
from redknot_jax.init import random_model
from redknot_jax.pallas import KERNELS
from redknot_jax.reuse import ledger as ledgers
from redknot_jax.reuse.artifact import build_artifact
from redknot_jax.reuse.codec import CODECS
from redknot_jax.reuse.planner import Request, Segment, plan_request
from redknot_jax.reuse.pool import Buckets
from redknot_jax.reuse.profile import FANOUT_MODES, FFN_ROWS, flash_profile, tiny_profile
from redknot_jax.reuse.runtime import ReuseFallback, ReuseRuntime
from redknot_jax.store import ArtifactStore

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


def records(length: int, n_docs: int, question: int, vocab: int, seed: int):
    """Frozen request: n_docs documents and a question, `length` rows in all."""
    rng = np.random.default_rng(seed + length)
    doc_len = (length - question) // n_docs
    docs = [rng.integers(2, vocab, doc_len).astype(np.int32) for _ in range(n_docs)]
    q = rng.integers(2, vocab, length - doc_len * n_docs).astype(np.int32)
    digest = hashlib.sha256(b"".join(d.tobytes() for d in docs) + q.tobytes()).hexdigest()
    return docs, q, digest


def check_record_args(ap, args) -> list[int]:
    """The request-record flags (--lengths, --docs, --question, --repeats) checked; the lengths.
    Every document must get at least one token: length >= question + docs."""
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: expected comma-separated integers, got {args.lengths!r}")
    for flag, v in (("--docs", args.docs), ("--question", args.question), ("--repeats", args.repeats)):
        if v < 1:
            ap.error(f"{flag}: expected >= 1, got {v}")
    short = [n for n in lengths if n < args.question + args.docs]
    if short:
        ap.error(f"--lengths {short}: a request needs >= --question ({args.question}) + --docs ({args.docs}) "
                 f"tokens (one per document at least)")
    return lengths


def op_profile_layers(ap, spec: str, num_layers: int) -> list[int]:
    """--op-profile's layer indices, checked against the preset's layer count."""
    try:
        layers = sorted({int(x) for x in spec.split(",")})
    except ValueError:
        ap.error(f"--op-profile: expected comma-separated layer indices, got {spec!r}")
    if not layers or layers[0] < 0 or layers[-1] >= num_layers:
        ap.error(f"--op-profile: layer indices must lie in [0, {num_layers}), got {spec!r}")
    return layers


def profile_variant(prof, **over):
    """The profile with the given fields overridden (None or the profile's own value: kept),
    renamed after them: a named variant whose digest differs, so artifacts are certified for it."""
    over = {k: v for k, v in over.items() if v is not None and v != getattr(prof, k)}
    if not over:
        return prof
    return dataclasses.replace(prof, name=prof.name + "".join(f"-{k}={v}" for k, v in over.items()), **over)


PROFILE_SPEC = "'default' or dash-joined fields: tailN (tail rows), bNN (budget %), omit|restore|run (ffn_rows), " \
               "k3|tau|native (fan-out), dense|fp8|fp4 (artifact_codec), e.g. 'tail0-b10-omit' or 'tail0-b10-omit-fp4'"


def parse_profile(base, spec: str):
    """A --profiles entry: the base profile with the spec's fields overridden (`profile_variant`)."""
    over = {}
    for part in ([] if spec == "default" else spec.split("-")):
        if part in FFN_ROWS:
            over["ffn_rows"] = part
        elif part in FANOUT_MODES:
            over["fanout_mode"] = part
        elif part in CODECS:
            over["artifact_codec"] = part
        elif part.startswith("tail") and part[4:].isdigit():
            over["tail_rows"] = int(part[4:])
        elif part.startswith("b") and part[1:].isdigit() and 0 < int(part[1:]) <= 100:
            over["budget_override"] = int(part[1:]) / 100
        else:
            raise ValueError(f"profile variant {spec!r}: cannot read {part!r}; expected {PROFILE_SPEC}")
    return profile_variant(base, **over)


def certify_for(arts, prof) -> None:
    """Point the artifacts' certificates at `prof` (a --profiles sweep): what a producer writes
    depends only on the fences, the Global head and whether FFN outputs are kept, which every
    variant of one sweep shares (checked in main), so the arrays are the ones a build under
    `prof` writes; the payload digest is unchanged."""
    for a in arts:
        a.certificate = dataclasses.replace(a.certificate, profile_digest=prof.digest())


def headline(out: dict) -> dict:
    """The machine-readable headline of a run (`docs/results/ttft_headline.json`, issue #45): per
    length the preset's own profile (no override but the artifact codec) as `rows`, and the fastest
    RedKnot variant timed as `best_measured`; medians of the run's repeats."""
    rows, best = [], []
    for r in out["lengths"]:
        if "redknot_median_s" not in r:
            continue  # cut off before its medians
        variants = r.get("by_profile") or r.get("by_kernels") or {next(iter(out["profiles"])): r}
        point = lambda name, v: {
            "length": r["length"], "recompute_s": v["recompute_median_s"], "prefix_s": r.get("prefix_median_s"),
            "redknot_s": v["redknot_median_s"], "profile": out["profiles"][name]["name"], "variant": name,
            "ffn_rows": out["profiles"][name]["ffn_rows"], "protected_fraction": v["protected_fraction"],
            "operator_bound": v["operator_bound"], "repeats": len(r["recompute_s"])}
        overrides = lambda n: {part.split("=")[0] for part in out["profiles"][n]["name"].split("-") if "=" in part}
        own = [n for n in variants if overrides(n) <= {"artifact_codec"}]  # the name's "-field=value" parts
        rows += [point(n, variants[n]) for n in own[:1]]
        fastest = min(variants, key=lambda n: variants[n]["redknot_median_s"])
        best.append(point(fastest, variants[fastest]))
    return {k: out[k] for k in ("device", "date", "jax", "command")} | {"rows": rows, "best_measured": best}


def out_of_memory_named(fn, what: str, row: dict, weights_gb: float, codec: str):
    """`fn` with its running out of device memory turned into an exit naming what the device held
    and what to change (`XLA_PYTHON_CLIENT_MEM_FRACTION` is already 0.95 here)."""
    def run(*args):
        try:
            return fn(*args)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            pool = f"a {row['pool_gb']:.1f} GB {codec} artifact pool" if "pool_gb" in row else f"{codec} artifacts"
            compact = "a compact codec (an '-fp4' --profiles variant, the Flash preset's own), " if codec == "dense" \
                else ""
            raise SystemExit(f"bench_ttft: {what} at {row['length']} tokens ran out of device memory beside "
                             f"{weights_gb:.1f} GB of weights and {pool}: use {compact}--resident host (the pool in "
                             f"host memory, streamed a layer at a time) or a shorter length") from e
    return run


def _decode(rt, req, pool, arm: str, steps: int):
    """One prefill keeping a decode state, then `steps` greedy tokens: (state, tokens, seconds per step)."""
    res = rt.prefill(req, arm, require_reuse=arm == "redknot", pool=pool, decode_rows=steps)
    gen, secs = [int(np.argmax(res.logits[-1]))], []
    for _ in range(steps):
        t0 = time.perf_counter()
        gen.append(int(np.argmax(rt.next_logits(req, res, gen))))
        secs.append(time.perf_counter() - t0)
    return res.decode, gen, secs


def _decode_batch(rt, req, pool, arm: str, steps: int, size: int):
    """`size` copies of the request prefilled one by one keeping decode states, then `steps` greedy
    tokens for all of them as rows of one `DecodeBatch`: (tokens, seconds per step, whether every
    row gave the first row's token at every step)."""
    firsts = [rt.prefill(req, arm, require_reuse=arm == "redknot", pool=pool, decode_rows=steps) for _ in range(size)]
    batch = rt.consumer.decode_batch(size)
    for f in firsts:
        batch.join(f.decode)
    gen, secs, same = [int(np.argmax(firsts[0].logits[-1]))], [], True
    for _ in range(steps):
        t0 = time.perf_counter()
        top = np.argmax(np.asarray(batch.step(np.full(size, gen[-1], np.int32))), -1)
        secs.append(time.perf_counter() - t0)
        gen.append(int(top[0]))
        same &= bool((top == top[0]).all())
    return gen, secs, same


def decode_row(rts: dict, req, pool, steps: int, out: dict, save=lambda: None, batch: int = 0) -> dict:
    """Both arms under the first kernel set of `rts`: a prefill keeping a decode state, then
    `steps` greedy tokens, one row each (`next_logits` -> `Consumer.decode_step`). The RedKnot
    state's device bytes by part, after the steps (the first step adds the request's entries),
    against per-row copies. With `batch` > 1, per arm that many copies decoding as rows of one
    `DecodeBatch` ("batch": seconds per step and per token, tokens equal to the single run's).
    Every further kernel set: the RedKnot arm's steps again ("by_kernels"), so decode kernels are
    timed side by side. Fills `out` and calls `save` after each run."""
    rt = next(iter(rts.values()))
    out.update(steps=steps, request_rows=int(req.tokens.size))
    med = lambda secs: statistics.median(secs[1:]) if steps > 1 else None
    for arm in ("redknot", "recompute"):
        st, gen, secs = _decode(rt, req, pool, arm, steps)
        out[arm] = {"first_step_s": secs[0], "step_s": secs[1:], "step_median_s": med(secs), "rows_after": st.rows,
                    "state_gb": st.nbytes() / 1e9, "tokens": gen}
        if arm == "redknot":
            gb = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree)) / 1e9
            reusable = [i for i in st.layers if i in rt.reusable]
            compact = {i: {k: v for k, v in st.layers[i].items() if k not in ("ents", "ikeys")} for i in reusable}
            entries = {i: {k: v for k, v in st.layers[i].items() if k in ("ents", "ikeys")} for i in reusable}
            out[arm].update(
                fence_cache_gb=gb([st.layers[i] for i in st.layers if i not in rt.reusable]),
                compact_gb=gb(compact), entries_gb=gb(entries), layout_gb=gb(st.layout.tables),
                compact_rows=st.own, compact_capacity=st.own_cap,
                # per-row copies of every request row (prompt + generated) in the reusable layers
                per_row_copy_gb=gb(compact) / st.own_cap * (req.tokens.size + steps))
        save()
    if steps > 1:
        out["recompute_over_redknot_step"] = out["recompute"]["step_median_s"] / out["redknot"]["step_median_s"]
    for arm in ("redknot", "recompute") if batch else ():
        gen, secs, same = _decode_batch(rt, req, pool, arm, steps, batch)
        step = med(secs)
        out.setdefault("batch", {"size": batch})[arm] = {
            "first_step_s": secs[0], "step_s": secs[1:], "step_median_s": step,
            "per_token_s": step / batch if step else None, "tokens": gen,
            "tokens_equal_alone": gen == out[arm]["tokens"] and same}
        save()
    for k, krt in list(rts.items())[1:]:
        _, gen, secs = _decode(krt, req, pool, "redknot", steps)
        out.setdefault("by_kernels", {})[k] = {"redknot": {
            "first_step_s": secs[0], "step_s": secs[1:], "step_median_s": med(secs), "tokens": gen,
            "kernels": krt.consumer.kernels, "decode_kernels": krt.consumer.decode_kernels}}
        save()
    return out


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/bench_ttft.py --lengths 65536 --repeats 2 "
                                        "--profiles tail0-b10-omit,default")  # README
    ap.add_argument("--preset", default="flash-shaped", choices=sorted(config.PRESETS))
    ap.add_argument("--lengths", default="65536")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--question", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="ttft.json")
    ap.add_argument("--headline", help="also write the run's headline here (`headline`: per length the preset's own "
                                       "profile and the fastest variant; docs/results/ttft_headline.json)")
    ap.add_argument("--tail-rows", type=int, help="override the profile's tail class (default: the profile's, 32768)")
    ap.add_argument("--fanout", choices=("native", "tau", "k3"), help="override the profile's MoE fan-out mode")
    ap.add_argument("--budget", type=float, help="fixed budget instead of the controller (budget_override)")
    ap.add_argument("--resident", choices=("device", "host"), default="device",
                    help="where the admitted artifacts live: device (hot) or host (prefetched, streamed per layer)")
    ap.add_argument("--host-kind", choices=("auto", "numpy", "pinned"), default="auto",
                    help="with --resident host: the payloads in pageable (numpy) or pinned host memory, staged at "
                         "admission (HostPool; auto = pinned on a GPU)")
    ap.add_argument("--cold", action="store_true", help="also time RedKnot with artifact construction included")
    ap.add_argument("--store", help="artifact store directory: read the documents' artifacts from it when there, "
                                    "else build and publish them")
    ap.add_argument("--kernels", default="auto",
                    help="the consumer's kernel set (Consumer(kernels=)): auto (on a GPU the kernels measured faster "
                         "than XLA), xla (the references), mosaic (every Mosaic GPU kernel), or kernels of "
                         "redknot_jax.pallas.KERNELS joined by '+' (indexer+ragged_dot); several sets as "
                         "'xla,indexer+ragged_dot': each repeat then times both arms under each, side by side, and "
                         "the first named fills the row's main fields")
    ap.add_argument("--topk-stages", default=str(TOPK_STAGES),
                    help="the CSA selection's entry prefixes (Consumer(topk_stages=), indexer.select_topk_causal; "
                         "1 scores every entry); several as '1,4' are timed side by side like kernel sets, "
                         "keyed 'SET/stagesN'")
    ap.add_argument("--layer-times", action="store_true",
                    help="after the timed runs, one profile run per arm (the prefix arm too, unless "
                         "--no-prefix-arm) that waits for every layer: per-layer seconds")
    ap.add_argument("--op-profile", metavar="LAYERS",
                    help="comma-separated layer indices: after the timed runs, one more run per arm in which each "
                         "of these layers runs inside a jax.profiler trace of its own (OUT.traces/); the JSON gets "
                         "each traced layer's device time by op category, its idle time and its top ops, each op's source line "
                         "read from the programs' optimized HLO, dumped to OUT.hlo/ (redknot_jax.op_profile)")
    ap.add_argument("--build-only", action="store_true", help="with --store: build and publish, time nothing")
    ap.add_argument("--shape-buckets", type=int, default=8,
                    help="padded sizes per octave (Consumer(buckets=)): 8 by default, 0 for exact sizes")
    ap.add_argument("--query-block", type=int, default=0,
                    help="query rows per attention step in every arm (Consumer(block=)): 0 for the consumer's "
                         "default (256 at model scale)")
    ap.add_argument("--compile-threads", type=int, default=0,
                    help="threads that compile a request's layer programs ahead of their first calls "
                         "(Consumer(compile_threads=)); 0: each compiles when first reached")
    ap.add_argument("--profiles", help="profile variants timed side by side (one kernel set; a single variant: the "
                                       "profile of every kernel set): comma list, each "
                                       + PROFILE_SPEC.replace("%", "%%")  # argparse %-formats help
                                       + "; the Recomputed and prefix arms run once per repeat")
    ap.add_argument("--no-prefix-arm", action="store_true", help="do not time the prefix arm (the first document "
                                                                 "read from its artifact in every layer, the rest native)")
    ap.add_argument("--decode-steps", type=int, default=0,
                    help="after the timed runs: one RedKnot prefill keeping a decode state, then this many greedy "
                         "tokens (the state's bytes, seconds per token)")
    ap.add_argument("--decode-batch", type=int, default=0,
                    help="with --decode-steps: also that many copies of the request per arm decoding as rows of one "
                         "DecodeBatch (seconds per step and per token; every row's tokens the request's own)")
    ap.add_argument("--stacks-every", type=float, default=0, metavar="S",
                    help="dump every thread's Python stack to stderr each S seconds (faulthandler): where a "
                         "warm-up stalls, compiling or running")
    args = ap.parse_args(argv)
    if args.stacks_every < 0:
        ap.error(f"--stacks-every: expected seconds >= 0, got {args.stacks_every}")
    if args.stacks_every:
        faulthandler.dump_traceback_later(args.stacks_every, repeat=True)
    if args.decode_steps < 0:
        ap.error(f"--decode-steps: expected >= 0, got {args.decode_steps}")
    if args.decode_batch < 0 or (args.decode_batch and not args.decode_steps):
        ap.error(f"--decode-batch: expected >= 0, with --decode-steps, got {args.decode_batch}")
    try:
        Buckets(args.shape_buckets)
    except ValueError as e:
        ap.error(f"--shape-buckets: {e}")
    if args.query_block < 0 or args.query_block & (args.query_block - 1):
        ap.error(f"--query-block: expected 0 or a power of two, got {args.query_block}")
    if args.compile_threads < 0:
        ap.error(f"--compile-threads: expected >= 0, got {args.compile_threads}")
    if args.tail_rows is not None and args.tail_rows < 0:
        ap.error(f"--tail-rows: expected >= 0, got {args.tail_rows}")
    if args.build_only and not args.store:
        ap.error("--build-only needs --store")
    if args.build_only and args.cold:
        ap.error("--build-only times nothing; drop --cold")
    lengths = check_record_args(ap, args)
    cfg = config.PRESETS[args.preset]()
    traced = op_profile_layers(ap, args.op_profile, cfg.num_layers) if args.op_profile else []
    hlo_dump = pathlib.Path(args.out + ".hlo")
    if traced:  # the optimized HLO of every program, so the op profile names each op's source line
        # (takes effect only where JAX has not started its backend yet: a fresh process)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {op_profile.dump_flags(hlo_dump)}".strip()
    kernel_sets = args.kernels.split(",")
    modes = ("auto", "xla", "mosaic")
    if (any(k not in modes and not set(k.split("+")) <= set(KERNELS) for k in kernel_sets)
            or len(set(kernel_sets)) < len(kernel_sets)):
        ap.error(f"--kernels: expected one or several distinct sets, each one of {modes} or kernels of {KERNELS} "
                 f"joined by '+', got {args.kernels!r}")
    try:
        stages = [int(v) for v in args.topk_stages.split(",")]
    except ValueError:
        stages = []
    if not stages or min(stages) < 1 or len(set(stages)) < len(stages):
        ap.error(f"--topk-stages: expected distinct ints >= 1, comma-separated, got {args.topk_stages!r}")
    # what each repeat times side by side: kernel set x stages (keyed by the set alone when one stages value)
    variants = {(k if len(stages) == 1 else f"{k}/stages{n}"): (k, n) for k in kernel_sets for n in stages}

    t0 = time.perf_counter()
    model = random_model(cfg, seed=0)
    jax.block_until_ready(jax.tree.leaves(model))
    init_s = time.perf_counter() - t0
    weights_gb = sum(x.nbytes for x in jax.tree.leaves(model)) / 1e9
    prof = flash_profile() if cfg.num_layers == 43 else tiny_profile(cfg.num_layers)
    prof = profile_variant(prof, tail_rows=args.tail_rows, fanout_mode=args.fanout, budget_override=args.budget)
    profs = {v: prof for v in variants}
    specs = args.profiles.split(",") if args.profiles else []
    sweep = len(specs) > 1  # profile variants side by side (else kernel sets / stagings, under one profile)
    if sweep and len(variants) > 1:
        ap.error("--profiles: time profile variants under one kernel set and one --topk-stages value")
    try:
        parsed = {spec: parse_profile(prof, spec) for spec in specs}
    except ValueError as e:
        ap.error(f"--profiles: {e}")
    if sweep:
        profs, variants = parsed, {spec: next(iter(variants.values())) for spec in parsed}
    elif specs:  # one profile for every kernel set
        profs = dict.fromkeys(variants, parsed[specs[0]])
    producer = {(p.fence_first, p.fence_last, p.global_head, p.artifact_codec) for p in profs.values()}
    if len(producer) > 1:
        ap.error("--profiles: the variants must share fences, Global head and artifact codec (one set of artifacts "
                 "serves them)")
    codec = next(iter(producer))[3]
    rts = {v: ReuseRuntime(model, profs[v], checkpoint_fingerprint=f"random-{args.preset}-seed-0",
                           kernels=k.replace("+", ","), buckets=args.shape_buckets, topk_stages=n, prefix_cache=1,
                           block=args.query_block or None, compile_threads=args.compile_threads)
           for v, (k, n) in variants.items()}
    # the artifacts are built once, under the first variant that restores FFN outputs (they hold them) or the first
    prof = next((p for p in profs.values() if p.ffn_rows == "restore"), next(iter(profs.values())))
    first = next(iter(variants))
    rt = rts[first]
    out = {"device": str(jax.devices()[0].device_kind), "date": datetime.date.today().isoformat(),
           "jax": jax.__version__, "python": platform.python_version(), "preset": args.preset,
           "profile": prof.to_dict(), "profiles": {v: p.to_dict() for v, p in profs.items()},
           "resident": args.resident, "kernels": args.kernels,
           "shape_buckets": args.shape_buckets, "topk_stages": stages, "query_block": rt.consumer.block,
           "compile_threads": args.compile_threads,
           "kernels_resolved": {k: r.consumer.kernels for k, r in rts.items()}, "model_init_s": init_s,
           "weights_gb": weights_gb, "command": "python launch/bench_ttft.py " +
           " ".join(argv if argv is not None else sys.argv[1:]), "lengths": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        if args.headline:
            pathlib.Path(args.headline).write_text(json.dumps(headline(out), indent=1) + "\n")

    store = ArtifactStore(args.store, durable=False) if args.store else None

    def stored(store, docs):
        """Every document's artifact from the store, or None if any is missing (then all are built)."""
        arts = []
        for d in _cli.progress(docs, desc=f"{length}: load artifacts", unit="doc", leave=False):
            found = store.lookup(d, prof, cfg, rt.fingerprint)
            if found.artifact is None:
                return None
            arts.append(found.artifact)
        return arts

    for length in lengths:
        docs, q, digest = records(length, args.docs, args.question, cfg.vocab_size, args.seed)
        row = {"length": length, "records_sha256": digest, "doc_len": int(docs[0].size), "question": int(q.size)}
        out["lengths"].append(row)

        def build():  # each document alone at 0; kept in host memory (the pool is the device copy)
            arts = []
            for d in _cli.progress(docs, desc=f"{length}: build artifacts", unit="doc", leave=False):
                a = build_artifact(model, prof, d, checkpoint_fingerprint=rt.fingerprint)
                a.layers = jax.tree.map(np.asarray, a.layers)
                arts.append(a)
            return arts

        def admit(arts):
            pool = rt.consumer.pool(arts, resident=args.resident, host_kind=args.host_kind)
            if args.resident == "device":
                jax.block_until_ready(jax.tree.leaves(pool.layers))
            req = Request([Segment(d, a) for d, a in zip(docs, arts)] + [Segment(q)])
            certify_for(arts, rt.profile)
            bad = rt.certify(req)  # admission: payload digests verified once
            if bad is not None:
                raise ReuseFallback(f"admission: the freshly built artifacts failed certification: {bad}")
            return pool, req

        t0 = time.perf_counter()
        arts = stored(store, docs) if store is not None else None
        if arts is not None:
            row["artifacts"], row["load_s"] = "store", time.perf_counter() - t0
        else:
            arts = build()
            row["artifacts"], row["build_s"] = "built", time.perf_counter() - t0
            if store is not None:
                t0 = time.perf_counter()
                for a in arts:  # one generation per document
                    store.publish(a)
                row["publish_s"] = time.perf_counter() - t0
        if args.build_only:
            save()
            continue
        t0 = time.perf_counter()
        pool, req = out_of_memory_named(admit, "admitting the artifacts", row, weights_gb, codec)(arts)
        row["admit_s"], row["pool_gb"], row["pool"] = time.perf_counter() - t0, pool.nbytes() / 1e9, type(pool).__name__
        if args.resident == "host":
            row["host_kind"] = pool.host_kind
        hot0 = rt.prefix_cache.get(arts[0])  # the exact prefix's states, hot on the device (both arms)
        row["prefix_cache_gb"] = rt.prefix_cache.nbytes() / 1e9
        save()

        def recompute(rt):
            t0 = time.perf_counter()
            plan = plan_request(req, prof)
            tok = int(np.argmax(np.asarray(rt.consumer.recompute(req.tokens, plan.query_rows))[-1]))
            return time.perf_counter() - t0, tok

        def redknot(rt):
            certify_for(arts, rt.profile)
            t0 = time.perf_counter()
            res = rt.prefill(req, "redknot", require_reuse=True, pool=pool)
            return time.perf_counter() - t0, int(np.argmax(res.logits[-1])), res

        def prefix(rt):  # the prefix arm: what a prefix cache gives (the first document exact, the rest native)
            t0 = time.perf_counter()
            logits = rt.consumer.prefix(hot0, req.tokens, plan_request(req, prof).query_rows)
            return time.perf_counter() - t0, int(np.argmax(np.asarray(logits)[-1]))

        # under --profiles the Recomputed and prefix arms do not depend on the variant: timed once per repeat
        rec_once = sweep
        arms_of = lambda krt: (["recompute"] if krt is rt or not rec_once else []) + \
            (["prefix"] if not args.no_prefix_arm and (krt is rt or not rec_once) else []) + ["redknot"]
        run_arm = {arm: out_of_memory_named(fn, f"the {arm} arm", row, weights_gb, codec)
                   for arm, fn in (("recompute", recompute), ("prefix", prefix), ("redknot", redknot))}
        bar = _cli.progress(desc=f"{length}: warm-up + {args.repeats} repeats", unit="run", leave=False,
                            total=(1 + args.repeats) * sum(len(arms_of(krt)) for krt in rts.values()))
        for k, krt in rts.items():  # warm-up (compilation) of every program timed below
            for arm in arms_of(krt):
                t0 = time.perf_counter()
                run_arm[arm](krt)
                row[f"warmup_{arm}_s" + ("" if krt is rt else f"_{k}")] = time.perf_counter() - t0
                _cli.echo(f"{length}: {arm} ({k}) warmed up in {time.perf_counter() - t0:.1f} s")  # a log says
                bar.update()  # where a run that stalls is
                save()
        times = {k: {**{f"{arm}_s": [] for arm in arms_of(krt)}, "tokens": []} for k, krt in rts.items()}
        results = {}
        for _ in range(args.repeats):  # each repeat: the arms under each variant, interleaved
            for k, krt in rts.items():
                toks = []
                for arm in arms_of(krt):
                    got = run_arm[arm](krt)
                    bar.update()
                    times[k][f"{arm}_s"].append(got[0])
                    toks.append(got[1])
                    if arm == "redknot":
                        results[k] = got[2]
                times[k]["tokens"].append(toks)
                row["repeats_so_far"] = times  # a run cut off by a time limit keeps what it timed
                save()
        bar.close()
        row.pop("repeats_so_far")
        res = results[first]
        rec_t, red_t = times[first]["recompute_s"], times[first]["redknot_s"]
        ratios = [a / b for a, b in zip(rec_t, red_t)]
        tok_rec, tok_red = times[first]["tokens"][-1][0], times[first]["tokens"][-1][-1]
        if not args.no_prefix_arm:
            row.update(prefix_s=times[first]["prefix_s"], prefix_median_s=statistics.median(times[first]["prefix_s"]))
        if len(rts) > 1:
            rec_med = statistics.median(rec_t)
            by = {}
            for k, v in times.items():
                r = results[k]
                red_med = statistics.median(v["redknot_s"])
                rec_k = statistics.median(v["recompute_s"]) if "recompute_s" in v else rec_med
                total = r.ledgers.operator["total"]
                by[k] = {**v, "recompute_median_s": rec_k, "redknot_median_s": red_med,
                         "speedup_median": rec_k / red_med if rec_once else statistics.median(
                             [a / b for a, b in zip(v["recompute_s"], v["redknot_s"])]),
                         "protected_fraction": r.plan.fraction_protected(), "budget": r.plan.budget,
                         "ffn_rows": rts[k].profile.ffn_rows, "operator_bound": total["recompute"] / total["redknot"],
                         "token_row_saving": r.ledgers.token_row["saving"],
                         "fanout_hist": [int(x) for x in r.fanout_hist], "cert": rts[k].counters.snapshot()}
                if "prefix_median_s" in row:
                    by[k]["over_prefix"] = row["prefix_median_s"] / red_med
            row["by_profile" if rec_once else "by_kernels"] = by
        led = dataclasses.replace(res.ledgers, wallclock=ledgers.wallclock_ledger(
            statistics.median(rec_t), statistics.median(red_t)))
        row.update({
            "recompute_s": rec_t, "redknot_s": red_t, "ratio_per_repeat": ratios,
            "recompute_median_s": statistics.median(rec_t), "redknot_median_s": statistics.median(red_t),
            "speedup_median": statistics.median(ratios), "first_token_agree": tok_rec == tok_red,
            "protected_fraction": res.plan.fraction_protected(), "protected_rows": int(res.plan.protected.sum()),
            "budget": res.plan.budget, "concentration": res.plan.concentration,
            "fanout_hist": [int(x) for x in res.fanout_hist], "ledgers": led.to_dict(),
            "operator_bound": led.operator["total"]["recompute"] / led.operator["total"]["redknot"],
            "cert": rt.counters.snapshot()})
        save()  # the medians and the headline before the optional stages below: a run cut there keeps them
        if args.layer_times:  # where the time goes: one more run per arm, each layer waited for
            rec_lt, pre_lt, red_lt, plan_t = [], [], [], {}
            rt.consumer.recompute(req.tokens, plan_request(req, prof).query_rows, layer_times=rec_lt)
            if not args.no_prefix_arm:
                rt.consumer.prefix(hot0, req.tokens, plan_request(req, prof).query_rows, layer_times=pre_lt)
            rt.consumer.redknot(plan_request(req, rt.profile), req.tokens, pool, timings=plan_t, layer_times=red_lt)
            n = cfg.num_layers
            row["layer_times"] = {
                "kind": [str(k) for k in cfg.layer_types],
                "role": ["fence" if prof.is_fence(i, n) else "reusable" for i in range(n)],
                "recompute_s": rec_lt, "prefix_s": pre_lt or None, "redknot_s": red_lt,
                "redknot_controller_s": plan_t.get("controller_s"), "redknot_plan_s": plan_t.get("plan_s"),
                "note": "one run per arm with a wait after every layer (serialised, so sums exceed the TTFT); "
                        "the first reusable layer of RedKnot includes the controller and the layout (host "
                        "seconds: redknot_plan_s, of which redknot_controller_s, its device read included)"}
        if traced:  # op-level: each chosen layer traced on its own, every arm
            base = pathlib.Path(args.out + ".traces") / str(length)
            rt.consumer.recompute(req.tokens, plan_request(req, prof).query_rows, layer_times=[],
                                  layer_traces=(str(base / "recompute"), traced))
            arms = ("recompute", "redknot") if args.no_prefix_arm else ("recompute", "prefix", "redknot")
            if not args.no_prefix_arm:
                rt.consumer.prefix(hot0, req.tokens, plan_request(req, prof).query_rows, layer_times=[],
                                   layer_traces=(str(base / "prefix"), traced))
            rt.consumer.redknot(plan_request(req, rt.profile), req.tokens, pool, layer_times=[],
                                layer_traces=(str(base / "redknot"), traced))
            n = cfg.num_layers
            dumped = hlo_dump if any(hlo_dump.glob("module_*")) else None  # none: JAX had started already
            row["op_profile"] = {
                "traces": str(base),
                "layers": {str(i): {"kind": str(cfg.layer_types[i]),
                                    "role": "fence" if prof.is_fence(i, n) else "reusable"} for i in traced},
                "hlo_dump": str(dumped) if dumped else None,
                **{arm: {str(i): op_profile.summarize(base / arm / f"layer_{i:02d}", hlo_dump=dumped) for i in traced}
                   for arm in arms}}
            save()
        if args.decode_steps:
            decode_row(rts, req, pool, args.decode_steps, row.setdefault("decode", {}), save, args.decode_batch)
            save()
        if args.cold:  # after the hot runs, with their pool gone: construction + admission + prefill
            del pool
            cold_t = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                cold_pool, cold_req = admit(build())
                rt.prefill(cold_req, "redknot", require_reuse=True, pool=cold_pool)
                cold_t.append(time.perf_counter() - t0)
                del cold_pool, cold_req
            row.update({"cold_redknot_s": cold_t, "cold_redknot_median_s": statistics.median(cold_t),
                        "cold_vs_recompute": statistics.median(rec_t) / statistics.median(cold_t)})
        row["cert"] = rt.counters.snapshot()  # the runs above validated too (decode, cold)
        save()
        _cli.echo(json.dumps({k: row[k] for k in ("length", "recompute_median_s", "redknot_median_s", "speedup_median",
                                                   "protected_fraction", "first_token_agree")}))
    return out


if __name__ == "__main__":
    try:
        main()
    except ReuseFallback as e:  # a silent recomputation would be a lie: reject the run
        raise SystemExit(f"rejected: {e}")
