"""Plots of the committed benchmark results: PNGs under docs/plots/ (docs/benchmarks.md shows them
and names the result files behind each).

    python launch/plot_benchmarks.py --qps docs/results/qps_headline_docs4_h100.json   # + ttft_*_h200.json
    python launch/plot_benchmarks.py --ttft a.json b.json --qps qps.json --out /tmp/plots

From `launch/bench_ttft.py` results (one or more files, each with rows per length), at the preset's
own profile:
* `ttft_vs_length.png`: TTFT of both arms per length (median, every repeat as a dot);
* `speedup_vs_length.png`: the measured RedKnot / Recomputed ratio per length beside the
  operator ledger's bound for that request (1 / (1 - FLOP saving)), with 1x marked;
* `ledgers_per_length.png`: the four savings per length (head-row, token-row, operator FLOPs,
  wall-clock), side by side, never summed ("n/a" where the run did not record one).
From rows with a per-layer profile (`--layer-times`): `layer_times_<length>.png`.
From the newest result with `--profiles` variants: `ttft_by_profile_<length>.png` (every arm and
profile of that run, seconds and ratio to the Recomputed arm).
From a `launch/bench_qps.py` result or its `--headline` file (rows of several runs):
`qps_vs_concurrency.png` (requests/s of each arm per concurrency level with the bootstrap 95 %
interval).

Every figure's title is one line: what was measured, on which device, when. The result files
behind a figure are named in docs/benchmarks.md, not in the figure (`sources(rows)` lists them).
"""

from __future__ import annotations

import glob
import json
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from launch import _cli  # noqa: E402

COLORS = {"recompute": "#444444", "prefix": "#1f77b4", "redknot": "#d62728"}
TITLE_SIZE = 9


def load_ttft(paths) -> tuple[list[dict], list[str]]:
    """Rows (one per length, the preset's own profile) and provenance lines ("file: device, date").

    A result run with `--profiles` whose first variant is not the preset's own profile still gives
    a row for the `default` variant among them (its RedKnot times beside the run's Recomputed times).
    Runs of one length on the same request records, profile, kernel set and top-k staging are
    pooled (every repeat kept, medians over all of them). Otherwise a run of the preset's own
    profile wins over a variant (`bench_ttft.py --tail-rows/--fanout/--budget` rename it
    "name-field=value"), then a run of today's default top-k staging (`indexer.TOPK_STAGES`; runs
    before it scored every entry), then the run with more of today's default kernels
    (`redknot_jax.pallas.FASTER`), and among equals the last file; a winner without a per-layer
    profile shows the per-layer profile of the best-ranked run that has one (naming its file)."""
    rows, prov, layers = {}, [], {}
    for p in paths:
        d = json.loads(pathlib.Path(p).read_text())
        if "lengths" not in d:
            raise SystemExit(f"--ttft {p}: not a bench_ttft.py result (no 'lengths')")
        complete = [r for r in d["lengths"] if "recompute_s" in r and "redknot_s" in r]
        src = _source(p, d)
        if complete:  # files of complete rows only (not a --build-only run)
            prov.append(f"{src['file']}: {src['device']}, {src['date']}")
        for r in complete:
            r = {**r, "profile_name": d.get("profile", {}).get("name"), "kernel_set": _kernel_set(d),
                 "topk_stages": (d.get("topk_stages") or [1])[0], "sources": [src]}
            if _variant(r):
                r = _default_of_sweep(d, r) or r
            n = int(r["length"])
            if r.get("layer_times"):
                r["layer_times_src"] = src
                if n not in layers or _rank(r) >= layers[n][0]:
                    layers[n] = (_rank(r), r["layer_times"], src)
            was = rows.get(n)
            same = ("records_sha256", "profile_name", "kernel_set", "topk_stages")
            if was and all(was[k] == r[k] for k in same):
                r = _pool(was, r)
            elif was and _rank(r) < _rank(was):
                continue
            rows[n] = r
    if not rows:
        raise SystemExit(f"--ttft: no complete length rows in {list(paths)}")
    for n, r in rows.items():  # a winner without a per-layer profile shows the best-ranked run's, naming its file
        if not r.get("layer_times") and n in layers:
            r["layer_times"], r["layer_times_src"] = layers[n][1], layers[n][2]
    return [rows[k] for k in sorted(rows)], prov


def _source(path, d: dict) -> dict:
    return {"file": pathlib.Path(path).name, "device": d.get("device", "?"), "date": str(d.get("date", "?"))[:10]}


def _default_of_sweep(d: dict, r: dict) -> dict | None:
    """The `default` variant of a `--profiles` run as a row of its own: the run's Recomputed
    repeats, the variant's RedKnot repeats, its protected share, operator bound, token-row and
    wall-clock ledgers (a sweep records no head-row ledger per variant: left out)."""
    from redknot_jax.reuse.ledger import wallclock_ledger

    v = (r.get("by_profile") or {}).get("default")
    if not v or not v.get("redknot_s"):
        return None
    rec, red = r["recompute_s"], v["redknot_s"]
    rec_m, red_m = statistics.median(rec), statistics.median(red)
    bound = v["operator_bound"]
    out = {k: r[k] for k in ("length", "records_sha256", "pool", "topk_stages", "sources") if k in r}
    out.update(
        profile_name=d["profiles"]["default"]["name"],
        kernel_set=(d.get("kernels_resolved") or {}).get("default", r["kernel_set"]),
        recompute_s=rec, redknot_s=red, recompute_median_s=rec_m, redknot_median_s=red_m,
        ratio_per_repeat=[a / b for a, b in zip(rec, red)], speedup_median=rec_m / red_m,
        protected_fraction=v["protected_fraction"],
        ledgers={"head_row": None, "token_row": {"saving": v["token_row_saving"]},
                 "operator": {"total": {"saving": 1.0 - 1.0 / bound}}, "wallclock": wallclock_ledger(rec_m, red_m)})
    return out


def _kernel_set(d: dict) -> str:
    """The kernels behind a result's main fields: the first of `--kernels`, as resolved when
    recorded (results before kernels were recorded ran the XLA references; with several
    `--topk-stages` or `--profiles` the resolved sets are keyed by variant, the first variant first)."""
    resolved = d.get("kernels_resolved", {})
    if resolved and (all("/stages" in k for k in resolved) or d.get("profiles")):
        return next(iter(resolved.values()))
    first = (d.get("kernels") or "xla").split(",")[0]
    return resolved.get(first, "" if first == "xla" else first)


def _variant(r: dict) -> bool:
    return "=" in (r["profile_name"] or "")


def _rank(r: dict) -> tuple[bool, bool, int]:
    """Which of two unpoolable runs of one length a plot shows: the preset's own profile, then
    today's top-k staging, then the most kernels of the current default set."""
    from redknot_jax.indexer import TOPK_STAGES
    from redknot_jax.pallas import FASTER

    return (not _variant(r), r["topk_stages"] == TOPK_STAGES,
            sum(k in FASTER for k in r["kernel_set"].split(",") if k))


def _pool(a: dict, b: dict) -> dict:
    """Two runs of the same requests as one row: repeats concatenated, medians over all; the
    ledgers and the per-layer profile of the later run."""
    out = dict(b)
    for arm in ("recompute", "redknot"):
        out[f"{arm}_s"] = a[f"{arm}_s"] + b[f"{arm}_s"]
        out[f"{arm}_median_s"] = statistics.median(out[f"{arm}_s"])
    out["ratio_per_repeat"] = a["ratio_per_repeat"] + b["ratio_per_repeat"]
    out["speedup_median"] = statistics.median(out["ratio_per_repeat"])
    out["sources"] = a["sources"] + b["sources"]
    if not out.get("layer_times"):
        out["layer_times"], out["layer_times_src"] = a.get("layer_times"), a.get("layer_times_src")
    return out


def sources(rows) -> list[dict]:
    """Per plotted length: the result files behind it, date, kernel set, profile (for the page)."""
    return [{"length": r["length"], "files": [s["file"] for s in r["sources"]],
             "dates": sorted({s["date"] for s in r["sources"]}), "kernels": r["kernel_set"],
             "profile": r["profile_name"], "layer_times": (r.get("layer_times_src") or {}).get("file")}
            for r in rows]


def _kfmt(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _when(srcs) -> str:
    """'on DEVICE, DATE' (or 'DATE to DATE') for a title."""
    devices = sorted({s["device"] for s in srcs})
    dates = sorted({s["date"] for s in srcs})
    return f"{' / '.join(devices)}, {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "")


def _title(ax, what: str, srcs) -> None:
    ax.set_title(f"{what}; {_when(srcs)}", fontsize=TITLE_SIZE, pad=22)


def _legend_above(ax, ncol: int) -> None:
    """The legend in one row between the title and the axes, where no bar or label can sit."""
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=ncol, frameon=False, fontsize=8,
              borderaxespad=0.2, handlelength=1.5)


def _tick(r: dict) -> str:
    """A length's axis label: the length, the date it was measured (rows of one figure come from
    runs of different days and kernel sets: docs/benchmarks.md names them), host-resident artifacts."""
    dates = sorted({s["date"] for s in r["sources"]})
    when = dates[-1][5:] if len(dates) == 1 else f"{dates[0][5:]}..{dates[-1][5:]}"
    return _kfmt(r["length"]) + f"\n{when}" + ("\nhost" if r.get("pool") == "HostPool" else "")


def _all_sources(rows) -> list[dict]:
    return [s for r in rows for s in r["sources"]]


def plot_ttft(rows, out: pathlib.Path, plt) -> list[pathlib.Path]:
    xs = range(len(rows))
    srcs = _all_sources(rows)
    files = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm in ("recompute", "redknot"):
        med = [r[f"{arm}_median_s"] for r in rows]
        ax.plot(xs, med, "-o", color=COLORS[arm], label=f"{arm} (median; dots: repeats)")
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r[f"{arm}_s"]), r[f"{arm}_s"], s=12, color=COLORS[arm], alpha=0.4)
    ax.set_xticks(list(xs), [_tick(r) for r in rows])
    ax.set_xlabel("request length (tokens; date measured; host: artifacts in host memory)", fontsize=8)
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0, top=max(max(r["recompute_s"] + r["redknot_s"]) for r in rows) * 1.08)
    _legend_above(ax, 2)
    _title(ax, "TTFT by request length, flash-shaped, default profile", srcs)
    files.append(_save(fig, out / "ttft_vs_length.png", plt))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    measured = [r["speedup_median"] for r in rows]
    bound = [1.0 / max(1e-9, 1.0 - r["ledgers"]["operator"]["total"]["saving"]) for r in rows]
    w = 0.38
    ax.bar([x - w / 2 for x in xs], measured, w, color=COLORS["redknot"], label="measured (median ratio)")
    ax.bar([x + w / 2 for x in xs], bound, w, color="#999999", label="operator-ledger bound")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    for x, m, b in zip(xs, measured, bound):
        ax.text(x - w / 2, m, f"{m:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.text(x + w / 2, b, f"{b:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(measured + bound) * 1.15)
    ax.set_xticks(list(xs), [f"{_tick(r)}\n{r['protected_fraction']:.0%} protected" for r in rows])
    ax.set_ylabel("RedKnot speed-up over Recomputed")
    _legend_above(ax, 2)
    _title(ax, "TTFT speed-up by request length, flash-shaped, default profile", srcs)
    files.append(_save(fig, out / "speedup_vs_length.png", plt))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    kinds = [("head_row", "head-row"), ("token_row", "token-row"), ("operator", "operator FLOPs"),
             ("wallclock", "wall-clock")]
    w = 0.8 / len(kinds)
    lowest = 0.0
    for k, (key, label) in enumerate(kinds):
        vals = []
        for r in rows:
            led = r["ledgers"][key]
            vals.append(led["total"]["saving"] if key == "operator" else (led or {}).get("saving", math.nan))
        pos = [x - 0.4 + w * (k + 0.5) for x in xs]
        ax.bar(pos, [v * 100 for v in vals], w, label=label)
        for p, v in zip(pos, vals):
            if v != v:
                ax.text(p, 1, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
        lowest = min([lowest] + [v * 100 for v in vals if v == v])
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [_tick(r) for r in rows])
    ax.set_ylabel("saving (%; negative: RedKnot slower)")
    ax.set_ylim(lowest - 5, 100)
    _legend_above(ax, 4)
    _title(ax, "The four ledgers by request length (never summed), default profile", srcs)
    files.append(_save(fig, out / "ledgers_per_length.png", plt))
    return files


def plot_layers(rows, out: pathlib.Path, plt) -> list[pathlib.Path]:
    """`layer_times_<length>.png` for each row with a per-layer profile (bench_ttft --layer-times)."""
    files = []
    for r in rows:
        lt = r.get("layer_times")
        if not lt:
            continue
        n = len(lt["kind"])
        fig, ax = plt.subplots(figsize=(9.0, 4.2))
        w = 0.4
        for k, arm in enumerate(("recompute", "redknot")):
            ax.bar([i + (k - 0.5) * w for i in range(n)], lt[f"{arm}_s"], width=w, color=COLORS[arm], label=arm)
        short = {"sliding_attention": "S", "compressed_sparse_attention": "C", "heavily_compressed_attention": "H"}
        ax.set_xticks(range(n), [short.get(kd, "?") + ("*" if role == "fence" else "")
                                 for kd, role in zip(lt["kind"], lt["role"])], fontsize=6)
        ax.set_xlabel("layer (S sliding, C CSA, H HCA; * fence, native in both arms)")
        ax.set_ylabel("seconds (each layer waited for)")
        _legend_above(ax, 2)
        _title(ax, f"Per-layer time of both arms at {_kfmt(r['length'])}, flash-shaped, default profile",
               [r["layer_times_src"]])
        files.append(_save(fig, out / f"layer_times_{_kfmt(r['length'])}.png", plt))
    return files


def load_profiles(paths) -> list[dict]:
    """Per length, the newest `bench_ttft.py --profiles` run (by date, then the later file): the
    Recomputed and prefix arms and every RedKnot variant, median seconds and ratio."""
    best = {}
    for p in paths:
        d = json.loads(pathlib.Path(p).read_text())
        for r in d.get("lengths", []):
            bp = r.get("by_profile")
            if not bp or "recompute_s" not in r:
                continue
            src = _source(p, d)
            was = best.get(int(r["length"]))
            if was and was["source"]["date"] > src["date"]:
                continue
            rec = statistics.median(r["recompute_s"])
            bars = [("Recomputed", rec, "recompute")]
            if r.get("prefix_s"):
                bars.append(("prefix arm", statistics.median(r["prefix_s"]), "prefix"))
            for name, v in bp.items():
                bars.append((f"RedKnot {name} ({v['ffn_rows']}, {v['protected_fraction']:.0%} protected)",
                             v["redknot_median_s"], "redknot"))
            best[int(r["length"])] = {"length": int(r["length"]), "bars": bars, "recompute_s": rec, "source": src}
    return [best[k] for k in sorted(best)]


def plot_profiles(runs, out: pathlib.Path, plt) -> list[pathlib.Path]:
    files = []
    for run in runs:
        bars = run["bars"]
        fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.45 * len(bars)))
        ys = list(range(len(bars)))[::-1]
        ax.barh(ys, [b[1] for b in bars], color=[COLORS[b[2]] for b in bars], height=0.6)
        for y, (_, s, _) in zip(ys, bars):
            ax.text(s, y, f" {s:.2f} s ({run['recompute_s'] / s:.2f}x)", va="center", fontsize=8)
        ax.set_yticks(ys, [b[0] for b in bars], fontsize=8)
        ax.set_xlim(0, max(b[1] for b in bars) * 1.35)
        ax.set_xlabel("time to first token (s, median); in brackets: Recomputed / this")
        ax.set_title(f"TTFT at {_kfmt(run['length'])} by arm and RedKnot profile, flash-shaped; "
                     f"{_when([run['source']])}", fontsize=TITLE_SIZE)
        files.append(_save(fig, out / f"ttft_by_profile_{_kfmt(run['length'])}.png", plt))
    return files


def qps_points(path) -> tuple[dict, list[dict], str]:
    """A bench_qps.py result file, or its --headline file (rows from several runs): ({arm:
    {clients: (requests/s, [lo, hi] or None)}}, the title's device and dates, the model served)."""
    d = json.loads(pathlib.Path(path).read_text())
    points: dict = {}
    if "rows" in d:  # the headline: one row per (arm, clients), each with its run's date
        for r in d["rows"]:
            points.setdefault(r["arm"], {})[int(r["concurrency"])] = (r["requests_per_s"], r.get("ci"))
        device = d.get("device", "?").split(" (")[0].removeprefix("1 x ")
        model = "flash-shaped" if "flash-shaped" in d.get("command", "") else "?"
        return points, [{"device": device, "date": str(r.get("date", d.get("date", "?")))[:10]}
                        for r in d["rows"]], model
    if "results" not in d:
        raise SystemExit(f"--qps {path}: not a bench_qps.py result or headline (no 'results' or 'rows')")
    for arm, per in d["results"].items():
        points[arm] = {int(c): (v["requests_per_s"], v.get("requests_per_s_ci95")) for c, v in per.items()}
    server = d.get("server", {})
    dev = server.get("device", {})
    return points, [{"device": dev.get("device_kind") or dev.get("backend", "?"),
                     "date": str(d.get("date", "?"))[:10]}], server.get("model", "?")


def plot_qps(path, out: pathlib.Path, plt) -> pathlib.Path:
    points, srcs, model = qps_points(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    top = 0.0
    for arm, per in points.items():
        levels = sorted(per)
        y = [per[c][0] for c in levels]
        ci = [per[c][1] or [v, v] for c, v in zip(levels, y)]
        err = [[v - lo for v, (lo, _) in zip(y, ci)], [hi - v for v, (_, hi) in zip(y, ci)]]
        ax.errorbar(levels, y, yerr=err, fmt="-o", capsize=3, color=COLORS.get(arm), label=arm)
        top = max([top] + [hi for _, hi in ci])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for per in points.values() for c in per}))
    ax.set_xticklabels([str(c) for c in ax.get_xticks()])
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("completed requests / s (95 % bootstrap interval)")
    ax.set_ylim(bottom=0, top=top * 1.15)
    _legend_above(ax, len(points))
    _title(ax, f"Throughput of each arm over the HTTP server, {model}", srcs)
    return _save(fig, out / "qps_vs_concurrency.png", plt)


def _save(fig, path: pathlib.Path, plt) -> pathlib.Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv=None):
    ap = _cli.parser(__doc__, __file__,
                     "python launch/plot_benchmarks.py --qps docs/results/qps_headline_docs4_h100.json")
    ap.add_argument("--ttft", nargs="*", type=_cli.input_file,
                    help="bench_ttft.py result files (default: docs/results/ttft_*_h200.json)")
    ap.add_argument("--qps", type=_cli.input_file, help="a bench_qps.py result or --headline file")
    ap.add_argument("--out", default=str(ROOT / "docs" / "plots"), help="directory of the PNGs (default: docs/plots)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = args.ttft if args.ttft else sorted(glob.glob(str(ROOT / "docs" / "results" / "ttft_*_h200.json")))
    rows, _ = load_ttft(paths)
    files = plot_ttft(rows, out, plt) + plot_layers(rows, out, plt) + plot_profiles(load_profiles(paths), out, plt)
    if args.qps:
        files.append(plot_qps(args.qps, out, plt))
    for f in files:
        _cli.echo(f)
    for s in sources(rows):
        _cli.echo(f"{_kfmt(s['length'])}: {', '.join(s['files'])} ({', '.join(s['dates'])}; kernels {s['kernels'] or 'xla'}; "
              f"profile {s['profile']}" + (f"; per-layer profile {s['layer_times']}" if s["layer_times"] else "") + ")")
    return files


if __name__ == "__main__":
    main()
