"""Answer quality of reuse (issue 10): the Recomputed and RedKnot arms on exactly the same
multi-document QA requests, with the trained QA model.

Each held-out world (test split by default: names never seen in training) gives one request
per question: its documents in a shuffled order (the first is the prefix at offset 0, the rest
are relocated; each document's artifact was built alone at position 0), then the question as
new rows. Both arms answer greedily through `ReuseRuntime.prefill` / `next_logits` until
<eos> (at most --max-new tokens). Per variant of the RedKnot profile (budget 10/20/25/100 %
by `budget_override`, or the controller; MoE fan-out off = native top-6, on = tau rule, K3):
EM and F1 per question type for both arms, the paired difference with a bootstrap 95 %
interval (questions resampled, the same resample for both arms), first-token agreement, and
KL(recompute || redknot) of the first-token distribution. Writes JSON and a markdown table.

    python launch/eval_quality.py --n 2 --variants default --out /tmp/q     # CPU smoke
    python launch/eval_quality.py --n 16 --out docs/results/quality         # full grid

Artifacts: built once per document and per (fences, Global head), the only profile fields that
change an artifact's content; a variant that changes only the budget or the fan-out rule gets
the same payload under a certificate re-issued for its profile digest, so certification still
runs (and counts) for every request. The `reuse-a-b` variants reuse only layers a..b (the rest
fenced, i.e. native), which says which layers carry the arms' difference. `thin` protects
only 1/16 of a window at each end of a relocated document and a 1/8-window tail (8 and 16 rows
for a 128-row window), so the rows inside the question's window are restored.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re
import sys
import time

import numpy as np
import jax

from redknot_jax.config import ModelConfig
from redknot_jax.quality import data as D
from redknot_jax.quality.model_config import profile_of
from redknot_jax.quality.train import load_model
from redknot_jax.reuse.artifact import Artifact, build_artifact
from redknot_jax.reuse.planner import Request, Segment
from redknot_jax.reuse.runtime import ReuseRuntime

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from launch import _cli  # noqa: E402

DEFAULT_CKPT = pathlib.Path(__file__).resolve().parents[1] / "redknot_jax" / "assets" / "qa_model"


def variants(names: list[str], reusable: range, n_layers: int, window: int = 128) -> list[tuple[str, dict]]:
    """(label, profile overrides). 'default' = the profile the checkpoint ships (its
    redknot_profile.json, `profile_of`). Every other name says all of its protection rule, so
    it means the same whatever the shipped profile is: the budget (the controller's, or bNN's),
    the rows' order (the indexer's unless `-dev`) and the latents (canonical unless
    `-refresh`) and the FFN of unprotected rows (the shipped profile's unless `-omit`, `-restore`,
    `-run`: `ffn_rows`); it takes the rest (fences unless `reuse-a-b`, window, boundary and tail rows,
    Global head) from the shipped profile.
    `reusable`: the shipped profile's reusable layers, cut into bands of two for `reuse-a-b`
    (only that band reused, every other layer fenced, i.e. native). Names outside the grid:
    `reuse-a-b`, any other contiguous range a..b of the model's layers (e.g. reuse-5-8: fence
    0-4; reuse-3-8: the reference profile's 3F-6R-3F);
    `bNN-MODE`, any budget of NN % (1-100) with fan-out MODE (native, tau, k3); any variant
    followed by `-dev`: the same with the budget's rows ranked by latent deviation
    (`itop_rank="deviation"`); and any of these followed by `-refresh`: the same with the
    protected rows' latents recomputed (`latent_refresh="protected"`; b100-native-refresh must
    give the Recomputed answers); any of these followed by `-omit`, `-restore` or `-run`: the same with
    that `ffn_rows`; any of these followed by `-fp8` or `-fp4`: the same with artifacts in that
    compact codec (`artifact_codec`, reuse/codec.py; otherwise the shipped profile's)."""
    modes = {"native": "fan-out off", "tau": "fan-out on", "k3": "K3"}
    plain = {"itop_rank": "indexer", "latent_refresh": "none"}  # until -dev / -refresh say otherwise
    controller = {"budget_override": None, "fanout_mode": "tau", **plain}

    def budget(pct: int, mode: str):  # a fixed budget of pct % with fan-out `mode`
        return (f"b{pct}-{mode}", {"budget_override": pct / 100, "fanout_mode": mode, **plain, "_label": modes[mode]})

    def refreshed(v):  # the same variant with the protected rows' latents recomputed
        return (f"{v[0]}-refresh", {**v[1], "latent_refresh": "protected", "_label": v[1].get(
            "_label", "controller, fan-out on") + ", protected rows' latents recomputed"})

    def deviated(v):  # the same variant with the budget's rows ranked by latent deviation
        return (f"{v[0]}-dev", {**v[1], "itop_rank": "deviation", "_label": v[1].get(
            "_label", "controller, fan-out on") + ", rows ranked by latent deviation"})

    grid = [("default", {})] + [budget(pct, mode) for pct in (10, 20, 25, 100) for mode in modes]
    grid.append(refreshed(grid[0]))
    # the shipped profile protects the last `window` rows and half a window at each end of a
    # relocated document: a model that answers from inside its window reads only protected rows
    # there. `thin` (1/16 and 1/8 of the window: 8 and 16 rows at 128) restores those rows too.
    thin = dict(boundary_rows=max(1, window // 16), tail_rows=max(1, window // 8))
    grid.append(("thin", {**controller, **thin, "_label": f"controller, fan-out on, {thin['boundary_rows']} boundary rows, "
                                           f"{thin['tail_rows']}-row tail"}))

    def band(lo: int, hi: int):  # only layers lo..hi reused, every other layer native
        return (f"reuse-{lo}-{hi}", {"fence_first": lo, "fence_last": n_layers - 1 - hi, **controller,
                                     "_label": f"controller, fan-out on, only layers {lo}-{hi} reused"})

    grid += [band(lo, min(lo + 1, reusable[-1])) for lo in reusable[::2]]
    if names == ["all"]:
        return grid
    known = {g[0]: g for g in grid}

    def parse(n: str):  # a name outside the grid, or None
        if n in known:
            return known[n]
        if n.endswith("-refresh") and (base := parse(n[:-len("-refresh")])):
            return refreshed(base)
        if n.endswith("-dev") and (base := parse(n[:-len("-dev")])):
            return deviated(base)
        for c in ("fp8", "fp4"):
            if n.endswith(f"-{c}") and (base := parse(n[:-len(c) - 1])):
                shipped = "the shipped profile" if base[0] == "default" else "controller, fan-out on"
                return (n, {**base[1], "artifact_codec": c, "_label": base[1].get("_label", shipped)
                            + f", artifacts {c}"})
        for mode in ("omit", "restore", "run"):
            if n.endswith(f"-{mode}") and (base := parse(n[:-len(mode) - 1])):
                shipped = "the shipped profile" if base[0] == "default" else "controller, fan-out on"
                return (n, {**base[1], "ffn_rows": mode, "_label": base[1].get("_label", shipped)
                            + f", unprotected rows' FFN {mode}"})
        if (m := re.fullmatch(r"reuse-(\d+)-(\d+)", n)) and int(m[1]) <= int(m[2]) < n_layers:
            return band(int(m[1]), int(m[2]))
        if (m := re.fullmatch(r"b(\d+)-(native|tau|k3)", n)) and 1 <= int(m[1]) <= 100:
            return budget(int(m[1]), m[2])
        return None

    found = {n: parse(n) for n in names}
    bad = [n for n, v in found.items() if v is None]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; known: all, {', '.join(known)}, and the forms reuse-A-B "
                         f"(layers 0-{n_layers - 1}), bNN-MODE (NN 1-100, MODE native / tau / k3), NAME-dev, NAME-refresh, NAME-omit / -restore / -run, NAME-fp8 / -fp4")
    return [found[n] for n in names]


def recertify(art: Artifact, profile) -> Artifact:
    cert = dataclasses.replace(art.certificate, profile_digest=profile.digest())
    return dataclasses.replace(art, certificate=cert)  # prefix_layers kept


def greedy(rt: ReuseRuntime, req: Request, arm: str, max_new: int, pool=None):
    """Greedy tokens until <eos> (excluded) or max_new, and the first-token logits. `pool`: the
    documents' packed artifacts (RedKnot arm), shared by the prefill and every decode step."""
    first = rt.prefill(req, arm, require_reuse=(arm == "redknot"), pool=pool, decode_rows=max_new - 1)
    toks = [int(np.argmax(first.logits[-1]))]
    while toks[-1] != D.EOS and len(toks) < max_new:
        toks.append(int(np.argmax(rt.next_logits(req, first, toks, pool=pool))))
    ans = [t for t in toks if t != D.EOS] if D.EOS not in toks else toks[:toks.index(D.EOS)]
    return ans, first


def kl(p_logits, q_logits) -> float:
    lp = p_logits - np.logaddexp.reduce(p_logits)
    lq = q_logits - np.logaddexp.reduce(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def bootstrap_ci(diff: np.ndarray, reps: int, rng) -> tuple[float, float]:
    if diff.size == 0:
        return float("nan"), float("nan")
    idx = rng.integers(0, diff.size, (reps, diff.size))
    means = diff[idx].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarize(records, reps: int, seed: int, paired_with: str | None = None):
    """Per variant and question type (and 'all'): both arms' EM / F1, paired differences with
    bootstrap intervals, first-token agreement, mean KL, protected share; with `paired_with`
    also "vs_paired": the RedKnot EM / F1 differences from that variant's on the same questions,
    with intervals, and the mean first-token KL(paired_with || variant)."""
    out = {}
    rng = np.random.default_rng(seed)
    ref = {(r["episode"], r["qa"]): r for r in records if r["variant"] == paired_with}
    for var in sorted({r["variant"] for r in records}, key=lambda v: [r["variant"] for r in records].index(v)):
        rows = [r for r in records if r["variant"] == var]
        out[var] = {}
        for qt in list(D.QTYPES) + ["all"]:
            sub = [r for r in rows if qt == "all" or r["qtype"] == qt]
            if not sub:
                continue
            d = {"n": len(sub)}
            for m in ("em", "f1"):
                a = np.array([r[f"recompute_{m}"] for r in sub])
                b = np.array([r[f"redknot_{m}"] for r in sub])
                lo, hi = bootstrap_ci(b - a, reps, rng)
                d.update({f"recompute_{m}": float(a.mean()) * 100, f"redknot_{m}": float(b.mean()) * 100,
                          f"diff_{m}": float((b - a).mean()) * 100, f"diff_{m}_ci": [lo * 100, hi * 100]})
            d["first_token_agreement"] = float(np.mean([r["first_agree"] for r in sub]))
            d["mean_kl"] = float(np.mean([r["kl"] for r in sub]))
            d["protected_share"] = float(np.mean([r["protected"] for r in sub]))
            if paired_with is not None:
                d["vs_paired"] = {"variant": paired_with,
                                  "mean_kl": float(np.mean([r["kl_vs_paired"] for r in sub]))}
                for m in ("em", "f1"):
                    diff = np.array([r[f"redknot_{m}"] - ref[(r["episode"], r["qa"])][f"redknot_{m}"] for r in sub])
                    lo, hi = bootstrap_ci(diff, reps, rng)
                    d["vs_paired"].update({f"diff_{m}": float(diff.mean()) * 100, f"diff_{m}_ci": [lo * 100, hi * 100]})
            out[var][qt] = d
    return out


def markdown(summary, labels) -> str:
    head = ("| variant | type | n | EM recompute | EM RedKnot | ΔEM [95 % CI] | F1 recompute | F1 RedKnot | "
            "ΔF1 [95 % CI] | first-token agree | KL | protected |")
    lines = [head, "|" + "---|" * 12]
    for var, per in summary.items():
        for qt, d in per.items():
            ci_e, ci_f = d["diff_em_ci"], d["diff_f1_ci"]
            lines.append(
                f"| {labels.get(var, var)} | {qt} | {d['n']} | {d['recompute_em']:.1f} | {d['redknot_em']:.1f} | "
                f"{d['diff_em']:+.1f} [{ci_e[0]:+.1f}, {ci_e[1]:+.1f}] | {d['recompute_f1']:.1f} | "
                f"{d['redknot_f1']:.1f} | {d['diff_f1']:+.1f} [{ci_f[0]:+.1f}, {ci_f[1]:+.1f}] | "
                f"{d['first_token_agreement']:.0%} | {d['mean_kl']:.4f} | {d['protected_share']:.0%} |")
    paired = [(var, qt, d["vs_paired"]) for var, per in summary.items() for qt, d in per.items() if "vs_paired" in d]
    if paired:
        lines += ["", f"RedKnot against RedKnot `{paired[0][2]['variant']}`, question by question:", "",
                  "| variant | type | ΔEM [95 % CI] | ΔF1 [95 % CI] | first-token KL |", "|" + "---|" * 5]
        for var, qt, p in paired:
            ci_e, ci_f = p["diff_em_ci"], p["diff_f1_ci"]
            lines.append(f"| {labels.get(var, var)} | {qt} | {p['diff_em']:+.1f} [{ci_e[0]:+.1f}, {ci_e[1]:+.1f}] | "
                         f"{p['diff_f1']:+.1f} [{ci_f[0]:+.1f}, {ci_f[1]:+.1f}] | {p['mean_kl']:.2e} |")
    return "\n".join(lines)


def plot_svg(summary, qtype: str = "all", width: int = 520, height: int = 300) -> str | None:
    """Quality vs budget (hand-written SVG, no plotting dependency): RedKnot EM per fan-out mode
    at the budget grid, the Recomputed arm's EM as a dashed line."""
    modes = {"native": "#1f77b4", "tau": "#d62728", "k3": "#2ca02c"}
    pts = {m: [] for m in modes}
    rec = []
    for var, per in summary.items():
        grid = re.fullmatch(r"b(\d+)-(native|tau|k3)", var)  # the budget x fan-out grid only
        if grid is None or qtype not in per:
            continue
        pts[grid[2]].append((int(grid[1]), per[qtype]["redknot_em"]))
        rec.append(per[qtype]["recompute_em"])
    if not rec:
        return None
    xs = [10, 20, 25, 100]
    x0, x1, y0, y1 = 60, width - 130, height - 40, 20
    X = lambda b: x0 + (xs.index(b) / (len(xs) - 1)) * (x1 - x0)
    Y = lambda v: y0 - v / 100 * (y0 - y1)
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
          f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
          f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>',
          f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>']
    for v in range(0, 101, 20):
        el.append(f'<text x="{x0 - 8}" y="{Y(v) + 4}" text-anchor="end">{v}</text>')
        el.append(f'<line x1="{x0}" y1="{Y(v)}" x2="{x1}" y2="{Y(v)}" stroke="#ddd"/>')
    for b in xs:
        el.append(f'<text x="{X(b)}" y="{y0 + 16}" text-anchor="middle">{b} %</text>')
    el.append(f'<text x="{(x0 + x1) / 2}" y="{height - 6}" text-anchor="middle">budget (share of candidate rows '
              f'protected; categorical axis)</text>')
    el.append(f'<text x="14" y="{(y0 + y1) / 2}" transform="rotate(-90 14 {(y0 + y1) / 2})" '
              f'text-anchor="middle">EM ({qtype}) %</text>')
    r = float(np.mean(rec))
    el.append(f'<line x1="{x0}" y1="{Y(r)}" x2="{x1}" y2="{Y(r)}" stroke="black" stroke-dasharray="5,4"/>')
    legend = [("recompute", "black")] + [(f"RedKnot, {m}", c) for m, c in modes.items() if pts[m]]
    for m, c in modes.items():
        p = sorted(pts[m])
        if p:
            el.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
                c, " ".join(f"{X(b):.1f},{Y(v):.1f}" for b, v in p)))
            el += [f'<circle cx="{X(b):.1f}" cy="{Y(v):.1f}" r="3" fill="{c}"/>' for b, v in p]
    for i, (lab, c) in enumerate(legend):
        el.append(f'<rect x="{x1 + 12}" y="{y1 + 16 * i}" width="10" height="10" fill="{c}"/>')
        el.append(f'<text x="{x1 + 26}" y="{y1 + 9 + 16 * i}">{lab}</text>')
    return "\n".join(el + ["</svg>"])


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,  # docs/quality.md
                     "python launch/eval_quality.py --split test --n 128 --docs 3 --per-doc 4 --variants default "
                     "--out /tmp/q")
    ap.add_argument("--checkpoint", default=str(DEFAULT_CKPT), type=_cli.checkpoint_dir)
    ap.add_argument("--split", default="test", choices=D.SPLITS)
    ap.add_argument("--n", type=int, default=4, help="worlds (each gives one lookup and one two-hop request)")
    ap.add_argument("--docs", type=int, default=9, help="documents per request")
    ap.add_argument("--per-doc", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="all", help="comma list (default, b10-native, b25-tau, ...) or all")
    ap.add_argument("--max-new", type=int, default=3)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--out", default=None, help="path prefix: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--paired-with", default=None, metavar="VARIANT",
                    help="also compare every variant with this one (one of --variants), question by question: "
                         "paired ΔEM / ΔF1 with bootstrap intervals and the first-token KL(VARIANT || variant), "
                         "e.g. compact artifacts against dense ones: --variants default,default-fp4 --paired-with default")
    args = ap.parse_args(argv)

    # the variants are checked against the checkpoint's config and profile before any weight loads
    cfg = ModelConfig.from_json(pathlib.Path(args.checkpoint) / "config.json")
    fingerprint = f"qa_model:{pathlib.Path(args.checkpoint).name}"
    base = profile_of(args.checkpoint)
    vs = variants(args.variants.split(","), base.reusable_layers(cfg.num_layers), cfg.num_layers, cfg.sliding_window)
    if args.paired_with is not None and args.paired_with not in dict(vs):
        raise SystemExit(f"--paired-with: {args.paired_with!r} is not one of --variants {[n for n, _ in vs]}")
    model = load_model(args.checkpoint)
    runtimes = {}
    for name, ov in vs:
        ov = {k: v for k, v in ov.items() if not k.startswith("_")}
        prof = dataclasses.replace(base, name=f"{base.name}-{name}", **ov) if ov else base
        runtimes[name] = ReuseRuntime(model, prof, fingerprint)
    eps = D.eval_episodes(args.split, args.n, seed=args.seed, n_docs=args.docs, per_doc=args.per_doc,
                          templates=D.templates_of(args.checkpoint))  # the trained wording
    rng = np.random.default_rng([args.seed, 7])
    records, t_start, artifact_layers = [], time.perf_counter(), {}
    rec_rt = next(iter(runtimes.values()))
    bar = _cli.progress(desc="questions", total=sum(len(ep.qas) for ep in eps), unit="question")
    for e, ep in enumerate(eps):
        built = {}  # per artifact content key: the world's artifacts, built once
        per_variant = {}  # the world's artifacts certified for each variant, packed once
        for name, _ in vs:
            prof = runtimes[name].profile
            key = (prof.fence_first, prof.fence_last, prof.global_head, prof.ffn_rows == "restore",
                   prof.artifact_codec)
            if key not in built:
                built[key] = [build_artifact(model, prof, np.asarray(d), checkpoint_fingerprint=fingerprint)
                              for d in ep.docs]
            va = [recertify(a, prof) for a in built[key]]
            artifact_layers[name] = sorted(int(i) for i in va[0].layers)
            per_variant[name] = (va, runtimes[name].consumer.pool(va))
        for qi, qa in enumerate(ep.qas):
            order = rng.permutation(len(ep.docs))
            gold = D.decode(qa.answer)
            t0 = time.perf_counter()
            req = Request([Segment(np.asarray(ep.docs[j])) for j in order] + [Segment(np.asarray(qa.question))])
            rec_ans, rec_first = greedy(rec_rt, req, "recompute", args.max_new)
            rec_txt = D.decode(rec_ans)
            firsts = {}  # variant -> first-token logits
            for name, _ in vs:
                rt = runtimes[name]
                va, pool = per_variant[name]
                req = Request([Segment(np.asarray(ep.docs[j]), va[j]) for j in order]
                              + [Segment(np.asarray(qa.question))])
                ans, first = greedy(rt, req, "redknot", args.max_new, pool=pool)
                txt = D.decode(ans)
                firsts[name] = first.logits[-1]
                records.append({
                    "variant": name, "episode": e, "qa": qi, "qtype": qa.qtype, "relation": qa.relation,
                    "order": order.tolist(), "rows": int(req.tokens.size), "gold": gold,
                    "recompute": rec_txt, "redknot": txt,
                    "recompute_em": D.exact_match(rec_txt, gold), "redknot_em": D.exact_match(txt, gold),
                    "recompute_f1": D.f1(rec_txt, gold), "redknot_f1": D.f1(txt, gold),
                    "first_agree": int(np.argmax(first.logits[-1]) == np.argmax(rec_first.logits[-1])),
                    "kl": kl(rec_first.logits[-1], first.logits[-1]),
                    "protected": first.plan.fraction_protected(), "budget": first.plan.budget,
                    "concentration": first.plan.concentration})
            if args.paired_with is not None:
                for r in records[-len(vs):]:
                    r["kl_vs_paired"] = kl(firsts[args.paired_with], firsts[r["variant"]])
            _cli.echo(f"world {e} {qa.qtype}/{qa.relation}: gold {gold!r} recompute {rec_txt!r} "
                      f"redknot {[r['redknot'] for r in records[-len(vs):]]} ({time.perf_counter() - t0:.1f}s)")
            bar.update()
        if args.out:  # what this world added, kept even if the run is cut short later
            write(args, argv, base, vs, runtimes, records, artifact_layers, t_start, final=False)
    bar.close()
    return write(args, argv, base, vs, runtimes, records, artifact_layers, t_start, final=True)


def write(args, argv, base, vs, runtimes, records, artifact_layers, t_start, final: bool) -> dict:
    """The result so far: summary, table, certification counters and every record; written to
    --out after every world (so a run cut short keeps what it measured, `complete` false) and
    once more at the end, when the table is printed."""
    summary = summarize(records, args.bootstrap, args.seed, args.paired_with)
    labels = {name: (f"budget {ov['budget_override']:.0%}, {ov['_label']}" if ov.get("budget_override") is not None
                     else ov.get("_label", f"default: the shipped profile ({base.name})")) for name, ov in vs}
    table = markdown(summary, labels)
    if final:
        print(table)
    certs = {name: rt.counters.snapshot() for name, rt in runtimes.items()}
    result = {"command": "python launch/eval_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
              "jax": jax.__version__, "checkpoint": args.checkpoint, "split": args.split, "templates": D.templates_of(args.checkpoint),
              "n_worlds": args.n, "worlds_done": len({r["episode"] for r in records}), "complete": final,
              "docs_per_request": args.docs, "profile": base.to_dict(), "variants": dict(vs),
              "paired_with": args.paired_with,
              "artifact_layers": artifact_layers,
              "seconds": round(time.perf_counter() - t_start, 1), "summary": summary, "certification": certs,
              "records": records}
    if args.out:
        p = pathlib.Path(args.out)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
        p.with_suffix(".md").write_text(table + "\n")
        svg = plot_svg(summary)
        if svg:
            p.with_suffix(".svg").write_text(svg)
    return result


if __name__ == "__main__":
    main()
