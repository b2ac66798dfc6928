"""Train the QA model (issue 10) on the synthetic multi-document QA task, within a wall-clock
budget, and write a loadable checkpoint (hub-layout safetensors + config.json +
tokenizer.json) and a training log.

    python launch/train_quality_model.py --out out/qa_model --time-budget-s 250      # H200
    python launch/train_quality_model.py --config qa-test --seq-len 128 --batch 2 \\
        --max-steps 6 --eval-docs 2 --per-doc 2 --out /tmp/qa                        # CPU smoke

Schedule by the fraction of the training budget used (time, or --max-steps): learning rate
warm-up + cosine; curriculum (`curriculum`): short packed episodes inside the sliding window
first, then half-size documents, then 2-6, then half the rows full-size episodes (as many
documents as the evaluation requests). With --recall-until, the episodes before that stage
are associative-recall warm-ups in the same words (session 19: a textbook transformer learnt
the QA wording only after one); --recall-rows keeps that many rows of every batch on recall
after it. With --dense-csa-until, CSA attention is dense (every
visible compressed entry, `Trainer.step_fn`) until that curriculum stage, then the model's
top-k; the top-k step compiles on a side thread meanwhile. The end of the
budget is reserved for rounding to the shipped bf16 weights, saving, and the teacher-forced
validation / held-out test scores (greedy-equivalent EM per question type) in train_log.json.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax import op_profile
from redknot_jax.config import ModelConfig
from redknot_jax.init import random_model
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import qa_config, qa_cpu_config, qa_test_config
from redknot_jax.quality.train import (TrainConfig, Trainer, by_distance, load_model, lr_at, recall_scores,
                                       save_checkpoint, teacher_forced_scores, write_serving_files)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402


PROFILE_AFTER = 2  # --op-profile: steps before the trace (the first one compiles)


def curriculum(frac: float, row: int, args) -> D.Curriculum:
    """Episode sizes by budget fraction: first one or two documents of two people each (the
    facts sit inside the sliding window: retrieval is learnt there), then one or two documents
    of four people (facts partly beyond the window), then 2-6 full documents, then half the
    rows full-size evaluation worlds. No question repeats within an episode."""
    full = max(2, args.eval_docs)
    if frac < 0.35:
        cur = D.Curriculum(*args.inwindow, two_hop=0.3)
    elif frac < 0.6:
        cur = D.Curriculum(1, 2, max(2, args.per_doc // 2), 8, two_hop=0.4)
    elif frac < 0.8 or row % 2:
        cur = D.Curriculum(2, min(6, full), args.per_doc, 16, two_hop=0.5)
    else:
        cur = D.Curriculum(max(2, full - 1), full, args.per_doc, 24, two_hop=0.5)
    cur = dataclasses.replace(cur, templates=args.templates)
    # associative recall first (--recall-until, sizes --recall-shape), and in the last --recall-rows rows
    # of every batch after it (recall kept alive beside the QA wording)
    if frac < args.recall_until or row >= args.batch - args.recall_rows:
        if args.recall_shape:
            cur = D.Curriculum(*args.recall_shape, templates=args.templates)
        cur = dataclasses.replace(cur, recall=True)
    if frac < args.simple_until:  # fewer kinds of facts / questions first (--simple-*)
        cur = dataclasses.replace(cur, facts=args.simple_facts, asks=args.simple_asks,
                                  two_hop=cur.two_hop if args.simple_two_hop is None else args.simple_two_hop)
    return cur


def config_overrides(items) -> dict:
    """["head_dim=256", ...] -> {"head_dim": 256, ...}: numeric ModelConfig fields only."""
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        f = fields.get(key)
        if not sep or f is None or f.type not in ("int", "float"):  # (string annotations)
            raise ValueError(f"expected NUMERIC_FIELD=VALUE with a numeric ModelConfig field, got {item!r}")
        try:
            out[key] = (float if f.type == "float" else int)(val)
        except ValueError:
            raise ValueError(f"{key}: {val!r} is not a {f.type}") from None
    return out


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/train_quality_model.py --out out/qa_model --time-budget-s 250")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/qa_model"))
    ap.add_argument("--config", choices=("qa", "qa-cpu", "qa-test"), default="qa")
    ap.add_argument("--time-budget-s", type=float, default=250.0, help="whole run, compile included")
    ap.add_argument("--reserve-s", type=float, default=30.0, help="kept for saving and evaluation")
    ap.add_argument("--max-steps", type=int, default=0, help="0: until the time budget")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--per-doc", type=int, default=8)
    ap.add_argument("--eval-docs", type=int, default=9, help="documents per evaluation world")
    ap.add_argument("--eval-episodes", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", type=_cli.checkpoint_dir,
                    help="a checkpoint directory written by this script: train on from its weights "
                         "(bf16 as shipped; the optimizer state and the schedule start afresh)")
    ap.add_argument("--curriculum-from", type=float, default=0.0,
                    help="curriculum stage at the start, as a budget fraction (e.g. 0.6 with --init-from: full-size "
                         "episodes from the first step)")
    ap.add_argument("--curriculum-until", type=float, default=1.0,
                    help="curriculum stage at the end of the budget (e.g. 0.34: the in-window stage throughout)")
    ap.add_argument("--dense-csa-until", type=float, default=0.0,
                    help="curriculum stage (a budget fraction, as --curriculum-from) until which CSA layers attend "
                         "every visible compressed entry instead of the indexer's top-k (0: never)")
    ap.add_argument("--templates", choices=D.TEMPLATES, default="plain",
                    help="the wording of facts and questions (quality.data.TEMPLATES; echo: each question ends in the "
                         "word that precedes the answer in its fact); recorded in train_log.json, where the "
                         "evaluation scripts read it")
    ap.add_argument("--inwindow", default="1,2,2,6", metavar="MIN_DOCS,MAX_DOCS,PER_DOC,QUESTIONS",
                    help="the first (in-window) stage's episodes: documents per episode, people per document, "
                         "questions per episode (at most; no question repeats)")
    ap.add_argument("--recall-shape", metavar="MIN_DOCS,MAX_DOCS,PER_DOC,QUESTIONS",
                    help="the recall episodes' sizes, as --inwindow (default: the stage's own), e.g. 1,3,32,8: "
                         "recall of facts up to ~390 rows back while the QA stage after it stays at --inwindow")
    ap.add_argument("--recall-until", type=float, default=0.0,
                    help="curriculum stage (a budget fraction, as --curriculum-from) until which episodes are "
                         "associative-recall warm-ups (quality.data.recall_episode: 'ka lo oslo .' facts, then "
                         "'me ru rome' queries, no question words) instead of QA (0: never)")
    ap.add_argument("--recall-rows", type=int, default=0,
                    help="after --recall-until, this many rows of every batch (the last ones) stay associative-recall "
                         "episodes (sizes --recall-shape), the rest QA: recall mixed with QA, not only before it")
    ap.add_argument("--simple-until", type=float, default=0.0,
                    help="curriculum stage (a budget fraction, as --curriculum-from) until which episodes hold only "
                         "the --simple-facts and ask only the --simple-asks (0: never)")
    ap.add_argument("--simple-facts", default=",".join(D.RELATIONS),
                    help="comma list of the relations the documents state before --simple-until, e.g. city")
    ap.add_argument("--simple-asks", help="comma list of the relations asked before --simple-until (default: the facts)")
    ap.add_argument("--simple-two-hop", type=float, help="two-hop share before --simple-until (default: the stage's)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override a numeric field of the config (a new model only; repeatable), e.g. head_dim=256 "
                         "or sliding_window=64 (probes: a window the small worlds fit in, a wider attention head)")
    ap.add_argument("--other-weight", type=float, default=0.02,
                    help="loss weight of every target that is not an answer token or its <eos> (answers: 1)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the forward's dtype (bfloat16: the served model's casts, bf16 matmul operands with fp32 "
                         "master weights; TrainConfig.compute_dtype)")
    ap.add_argument("--min-lr-frac", type=float, default=TrainConfig.min_lr_frac,
                    help="the cosine schedule's floor as a share of --lr (1: constant after the warm-up)")
    ap.add_argument("--block", type=int, default=512, help="attention query block (Attention.__call__)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--op-profile", type=int, default=0, metavar="STEPS",
                    help="trace STEPS training steps after %d warm ones (jax.profiler) and log their device time "
                         "by op category and top ops (redknot_jax.op_profile) beside their wall-clock: is the "
                         "step bound by the device's work or by launching it" % PROFILE_AFTER)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="every N steps, teacher-forced validation EM and in-context chance on 16 worlds of the "
                         "evaluation size (the first one waits for the evaluation forward's compile; 0: only at the end)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.curriculum_from < 1.0:
        ap.error(f"--curriculum-from: expected a fraction in [0, 1), got {args.curriculum_from}")
    if not args.curriculum_from < args.curriculum_until <= 1.0:
        ap.error(f"--curriculum-until: expected a fraction in (--curriculum-from, 1], got {args.curriculum_until}")
    if not 0.0 <= args.dense_csa_until <= 1.0:
        ap.error(f"--dense-csa-until: expected a fraction in [0, 1], got {args.dense_csa_until}")
    if not 0.0 <= args.min_lr_frac <= 1.0:
        ap.error(f"--min-lr-frac: expected a share in [0, 1], got {args.min_lr_frac}")
    for flag in ("simple_until", "recall_until"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            ap.error(f"--{flag.replace('_', '-')}: expected a fraction in [0, 1], got {getattr(args, flag)}")
    try:
        args.simple_facts = tuple(args.simple_facts.split(","))
        args.simple_asks = tuple(args.simple_asks.split(",")) if args.simple_asks else args.simple_facts
        D.Curriculum(facts=args.simple_facts, asks=args.simple_asks,
                     two_hop=0.0 if args.simple_two_hop is None else args.simple_two_hop)
    except ValueError as e:
        ap.error(f"--simple-facts / --simple-asks / --simple-two-hop: {e}")
    for flag in ("inwindow", "recall_shape"):
        text, name = getattr(args, flag), "--" + flag.replace("_", "-")
        if text is None:
            continue
        try:
            shape = tuple(int(v) for v in text.split(","))
        except ValueError:
            ap.error(f"{name}: expected four integers MIN_DOCS,MAX_DOCS,PER_DOC,QUESTIONS, got {text!r}")
        if len(shape) != 4 or not (1 <= shape[0] <= shape[1] and shape[2] >= 2 and shape[3] >= 1):
            ap.error(f"{name}: expected 1 <= MIN_DOCS <= MAX_DOCS, PER_DOC >= 2, QUESTIONS >= 1, got {shape}")
        setattr(args, flag, shape)
    if not 0 <= args.recall_rows < args.batch:
        ap.error(f"--recall-rows: expected 0 <= rows < --batch ({args.batch}), got {args.recall_rows}")
    if args.op_profile < 0:
        ap.error(f"--op-profile: expected a step count >= 0, got {args.op_profile}")
    if not 0.0 <= args.other_weight <= 1.0:
        ap.error(f"--other-weight: expected a weight in [0, 1], got {args.other_weight}")
    if args.set and args.init_from:
        ap.error(f"--set {args.set}: config overrides need a new model (not --init-from)")
    try:
        over = config_overrides(args.set)
    except ValueError as e:
        ap.error(f"--set: {e}")
    t_start = time.perf_counter()
    deadline = t_start + args.time_budget_s
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.init_from:  # continue a previous run: its shipped (bf16) weights, fresh optimizer state
        model = load_model(args.init_from)
        cfg = model.cfg
        prior = pathlib.Path(args.init_from) / "train_log.json"
        prior = json.loads(prior.read_text()) if prior.is_file() else {}
    else:
        try:
            cfg = {"qa": qa_config, "qa-cpu": qa_cpu_config, "qa-test": qa_test_config}[args.config](**over)
        except (TypeError, ValueError) as e:
            ap.error(f"--set {args.set}: {e}")
        model = random_model(cfg, seed=args.seed, dtype=jnp.float32)
        prior = {}
    tc = TrainConfig(lr=args.lr, min_lr_frac=args.min_lr_frac, block=min(args.block, args.seq_len),
                     compute_dtype=args.compute_dtype)
    trainer = Trainer(model, tc)
    _cli.echo(f"model initialised at {time.perf_counter() - t_start:.1f}s")
    names = D.split_names()["train"]
    rng = np.random.default_rng(args.seed)
    log = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": str(jax.devices()[0].device_kind), "platform": platform.node(), "jax": jax.__version__,
           "model_config": cfg.to_hf_dict(), "train_config": dataclasses.asdict(tc), "args": vars(args),
           "n_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(trainer.params))), "history": [],
           "init_from": args.init_from, "prior_runs": prior.get("prior_runs", []) + (
               [{k: prior.get(k) for k in ("command", "date", "steps", "tokens", "train_s")}] if prior else [])}

    def write_log():
        (out / "train_log.json").write_text(json.dumps(log, indent=1))

    # What the end of the run needs compiles on a side thread while training runs (the GPU is
    # busy with steps meanwhile): with a dense warm-up, the top-k step first; then the
    # evaluation forward, so the reserved end of the budget is not spent compiling.
    eval_shape = jnp.zeros((args.batch, args.seq_len), jnp.int32)
    example = (jnp.zeros((args.batch, args.seq_len + 1), jnp.int32), jnp.zeros((args.batch, args.seq_len), jnp.float32))
    dense = args.dense_csa_until > args.curriculum_from
    compiled = {}

    def lower(fn):
        return fn.lower(trainer.params, trainer.rest, trainer.opt_state, *example, jnp.float32(0), trainer.decay)

    def compile_ahead(topk_step: bool):
        if topk_step:
            t0 = time.perf_counter()
            compiled["topk_step"] = lower(trainer.step_fn()).compile()
            compiled["topk_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled["fn"] = trainer._eval.lower(trainer.params, trainer.rest, eval_shape).compile()
        compiled["s"] = time.perf_counter() - t0

    th = threading.Thread(target=compile_ahead, args=(dense,), daemon=True)  # started after the first step

    t0 = time.perf_counter()
    lowered = lower(trainer.step_fn(args.seq_len // cfg.csa_rate) if dense else trainer._step)
    log["lower_s"] = round(time.perf_counter() - t0, 2)
    _cli.echo(f"train step {'(dense CSA) ' if dense else ''}lowered in {log['lower_s']:.1f}s")
    t0 = time.perf_counter()
    trainer._step = lowered.compile()
    log["compile_s"] = round(time.perf_counter() - t0, 2)
    _cli.echo(f"train step compiled in {log['compile_s']:.1f}s (at {time.perf_counter() - t_start:.1f}s)")
    # the validation curve's worlds: those the run trains on at its start (--simple-*: fewer kinds of facts),
    # scored per relation; the end-of-run scores below are always on full worlds
    simple = args.simple_until > args.curriculum_from
    curve_rel = dict(facts=args.simple_facts, asks=args.simple_asks) if simple else {}
    probe_eps = D.eval_episodes("val", 16, seed=2000 + args.seed, n_docs=args.eval_docs, per_doc=args.per_doc,
                                questions_per_type=4, templates=args.templates, **curve_rel) if args.eval_every else []
    # with --recall-until or --recall-rows, the curve also follows recall at the --recall-shape sizes by distance
    recall_probe = (D.recall_probe("val", 32, 3000 + args.seed, D.Curriculum(*(args.recall_shape or args.inwindow)),
                                  args.seq_len)
                   if args.eval_every and (args.recall_until > args.curriculum_from or args.recall_rows) else None)
    if args.eval_every:
        log["val_curve_worlds"] = {"facts": list(curve_rel.get("facts", D.RELATIONS)),
                                   "asks": list(curve_rel.get("asks", D.RELATIONS))}
    step, tokens_seen, t_train0, train_budget = 0, 0, None, None
    trace_dir = None  # --op-profile's trace while it runs
    pending = []
    saved_mid = False
    bar = _cli.progress(desc="train", total=args.max_steps or None, unit="step")  # without --max-steps: the time budget
    while True:
        now = time.perf_counter()
        if t_train0 is None:
            frac = 0.0
        elif args.max_steps:
            frac = step / args.max_steps
        else:
            frac = (now - t_train0) / train_budget
        if (args.max_steps and step >= args.max_steps) or (not args.max_steps and t_train0 is not None and frac >= 1):
            break
        if now > deadline - args.reserve_s:
            break
        stage = args.curriculum_from + (args.curriculum_until - args.curriculum_from) * frac
        if dense and stage >= args.dense_csa_until:  # from here on the indexer's top-k
            if "topk_step" not in compiled:
                th.join()  # normally long done; waiting keeps the schedule honest
            trainer._step, dense = compiled.pop("topk_step"), False
            log["dense_csa_until_step"] = step
            log["topk_compile_s"] = round(compiled["topk_s"], 1)
            _cli.echo(f"step {step}: CSA top-k from here on (dense until stage {args.dense_csa_until})")
        rows = [D.training_sequence(rng, names, args.seq_len, curriculum(stage, r, args), args.other_weight)
                for r in range(args.batch)]
        toks, w = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        lr = lr_at(tc, frac)
        if args.op_profile and step == PROFILE_AFTER:  # the trace goes to a scratch dir, not beside the checkpoint
            jax.block_until_ready(trainer.params)
            trace_dir = tempfile.mkdtemp(prefix="qa_op_trace_")
            jax.profiler.start_trace(trace_dir)
            t_trace = time.perf_counter()
        stats = trainer.step(toks, w, lr)
        step += 1
        bar.update()
        if args.op_profile and step == PROFILE_AFTER + args.op_profile:
            jax.block_until_ready(trainer.params)
            wall = (time.perf_counter() - t_trace) / args.op_profile * 1e3
            jax.profiler.stop_trace()
            summary = op_profile.summarize(trace_dir)
            shutil.rmtree(trace_dir, ignore_errors=True)
            trace_dir = None
            log["op_profile"] = {"steps": args.op_profile, "wall_ms_per_step": round(wall, 2),
                                 "device_ops_ms_per_step": round(summary["ops_ms"] / args.op_profile, 2),
                                 "ops_per_step": summary["ops"] // args.op_profile, **summary}
            _cli.echo(f"op profile of {args.op_profile} steps: wall {wall:.1f} ms/step, device ops "
                      f"{summary['ops_ms'] / args.op_profile:.1f} ms/step in {summary['ops'] // args.op_profile} ops; "
                      + ", ".join(f"{c} {ms / args.op_profile:.1f}" for c, ms in summary["by_category"].items()))
            for r in summary["top"][:10]:
                _cli.echo(f"  {r['ms'] / args.op_profile:7.2f} ms/step x{r['count'] // args.op_profile:<5} "
                          f"{r['category']:<20} {r['op']}")
        tokens_seen += int((toks[:, 1:] != D.PAD).sum())
        pending.append((step, lr, frac, stats))
        if t_train0 is None:  # the first step includes compilation
            jax.block_until_ready(stats["loss"])
            t_train0 = time.perf_counter()
            train_budget = max(1.0, deadline - args.reserve_s - t_train0)
            log["first_step_s"] = t_train0 - t_start
            _cli.echo(f"first step (compile included) at {log['first_step_s']:.1f}s; training budget "
                      f"{train_budget:.0f}s")
            th.start()
        if step % args.log_every == 0 or step == 1:
            for s, l, f, st in pending:
                rec = {"step": s, "lr": l, "frac": round(f, 4), **{k: float(v) for k, v in st.items()}}
                log["history"].append(rec)
            pending = []
            rec = log["history"][-1]
            rec["elapsed_s"] = round(time.perf_counter() - t_start, 2)
            _cli.echo(f"step {step} t={rec['elapsed_s']:.0f}s frac={frac:.2f} lr={lr:.2e} loss={rec['loss']:.3f} "
                      f"answer_ce={rec['answer_ce']:.3f} answer_acc={rec['answer_acc']:.3f} "
                      f"span_acc={rec['span_acc']:.3f} indexer_kl={rec['indexer_kl']:.3f} gnorm={rec['grad_norm']:.2f}")
            bar.set_postfix_str(f"{frac:.0%} of the budget, loss {rec['loss']:.3f}", refresh=False)
        if args.eval_every and step % args.eval_every == 0:
            th.join()  # the evaluation forward compiles on the side thread from the first step on
            trainer._eval = compiled["fn"]
            tf = teacher_forced_scores(trainer, probe_eps, args.seq_len, args.batch, by_relation=True)
            log.setdefault("val_curve", []).append(
                {"step": step, **{k: {m: round(v[m], 3) for m in ("em", "chance")} for k, v in tf.items()}})
            _cli.echo(f"step {step} validation " + ", ".join(f"{k} EM {v['em']:.3f} (chance {v['chance']:.3f})"
                                                             for k, v in tf.items()))
            if recall_probe is not None:
                rs = recall_scores(trainer, *recall_probe, args.batch, cfg.sliding_window)
                log.setdefault("recall_curve", []).append(
                    {"step": step, **{k: {m: round(v[m], 3) for m in ("n", "acc", "chance")} for k, v in rs.items()}})
                _cli.echo(f"step {step} validation recall " + ", ".join(
                    f"{k} {v['acc']:.3f} (n {v['n']}, chance {v['chance']:.3f})" for k, v in rs.items()))
        if not saved_mid and frac >= 0.6:  # a usable checkpoint even if the run is cut short
            save_checkpoint(trainer.model(), out, metadata={"step": str(step), "note": "mid-training"})
            saved_mid = True
            write_log()
    bar.close()
    for s, l, f, st in pending:
        log["history"].append({"step": s, "lr": l, "frac": round(f, 4), **{k: float(v) for k, v in st.items()}})
    if trace_dir is not None:  # the run ended inside the traced steps: say so, leave nothing behind
        jax.profiler.stop_trace()
        shutil.rmtree(trace_dir, ignore_errors=True)
        log["op_profile"] = {"skipped": f"the run ended after {step} steps, before the {args.op_profile} traced "
                                        f"steps from step {PROFILE_AFTER} finished"}
        _cli.echo(log["op_profile"]["skipped"])
    jax.block_until_ready(trainer.params)
    t_end = time.perf_counter()
    log.update(steps=step, tokens=tokens_seen, train_s=round(t_end - (t_train0 or t_end), 2),
               steps_per_s=round((step - 1) / max(1e-9, t_end - (t_train0 or t_end)), 3) if step > 1 else None)

    trainer.round_to_bf16()  # from here on: exactly the shipped weights
    files = save_checkpoint(trainer.model(), out, metadata={"step": str(step)})
    log["files"] = files + ["config.json"] + write_serving_files(out)
    write_log()
    _cli.echo(f"saved {files} after {step} steps ({tokens_seen} tokens) at {time.perf_counter() - t_start:.0f}s")

    if th.is_alive() or th.ident is not None:
        th.join(timeout=max(1.0, deadline - time.perf_counter()))
    if "fn" in compiled:
        trainer._eval = compiled["fn"]
        log["eval_compile_s"] = round(compiled["s"], 1)
    for split in _cli.progress(("val", "test"), desc="evaluate", unit="split"):
        if time.perf_counter() > deadline + 60:
            log.setdefault("skipped", []).append(f"{split}: out of time")
            break
        t0 = time.perf_counter()
        eps = D.eval_episodes(split, args.eval_episodes, seed=1000 + args.seed, n_docs=args.eval_docs,
                              per_doc=args.per_doc, questions_per_type=4, templates=args.templates)
        recs = []
        log[f"teacher_forced_{split}"] = teacher_forced_scores(trainer, eps, args.seq_len, args.batch, records=recs)
        log[f"teacher_forced_{split}"]["seconds"] = round(time.perf_counter() - t0, 2)
        log[f"teacher_forced_{split}_by_distance"] = by_distance(recs, cfg.sliding_window)
        _cli.echo(split, json.dumps(log[f"teacher_forced_{split}"]))
        _cli.echo(split, "by distance from the farthest fact:",
                  json.dumps(log[f"teacher_forced_{split}_by_distance"]))
        write_log()
    log["total_s"] = round(time.perf_counter() - t_start, 2)
    write_log()


if __name__ == "__main__":
    main()
