"""Plots of the committed benchmark results (issue #9): PNGs under docs/plots/.

    python launch/plot_benchmarks.py                                   # docs/results/ttft_*_h200.json
    python launch/plot_benchmarks.py --ttft a.json b.json --qps qps.json --out /tmp/plots

From `launch/bench_ttft.py` results (one or more files, each with rows per length):
* `ttft_vs_length.png`: TTFT of both arms per length (median, every repeat as a dot);
* `speedup_vs_length.png`: the measured RedKnot / Recomputed ratio per length beside the
  operator ledger's bound for that request (1 / (1 - FLOP saving)), with 1x marked;
* `ledgers_per_length.png`: the four savings per length (head-row, token-row, operator FLOPs,
  wall-clock), side by side, never summed.
From rows with a per-layer profile (`--layer-times`): `layer_times_<length>.png`.
From a `launch/bench_qps.py` result: `qps_vs_concurrency.png` (requests/s of both arms per
concurrency level with the bootstrap 95 % interval). Every figure names its source files,
device and date in the title block.
"""

from __future__ import annotations

import argparse
import glob
import json
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLORS = {"recompute": "#444444", "redknot": "#d62728"}


def load_ttft(paths) -> tuple[list[dict], list[str]]:
    """Rows (one per length) and provenance lines. Runs of one length on the same request
    records, profile and kernel set are pooled (every repeat kept, medians over all of them).
    Otherwise a run of the preset's own profile wins over a variant (`bench_ttft.py
    --tail-rows/--fanout/--budget` rename it "name-field=value"), then a run of today's default
    top-k staging (`indexer.TOPK_STAGES`; runs before it scored every entry), then the run with
    more of today's default kernels (`redknot_jax.pallas.FASTER`), and among equals the last file; a
    winner without a per-layer profile keeps the loser's (its plot names the file it came from)."""
    rows, prov = {}, []
    for p in paths:
        d = json.loads(pathlib.Path(p).read_text())
        if "lengths" not in d:
            raise SystemExit(f"--ttft {p}: not a bench_ttft.py result (no 'lengths')")
        complete = [r for r in d["lengths"] if "recompute_s" in r and "redknot_s" in r]
        src = f"{pathlib.Path(p).name}: {d.get('device', '?')}, {d.get('date', '?')}"
        if complete:  # files of complete rows only (not a --build-only run)
            prov.append(src)
        for r in complete:
            r = {**r, "profile_name": d.get("profile", {}).get("name"), "kernel_set": _kernel_set(d),
                 "topk_stages": (d.get("topk_stages") or [1])[0]}
            if r.get("layer_times"):
                r["layer_times_src"] = src
            was = rows.get(int(r["length"]))
            same = ("records_sha256", "profile_name", "kernel_set", "topk_stages")
            if was and all(was[k] == r[k] for k in same):
                r = _pool(was, r)
            elif was and _rank(r) < _rank(was):
                continue
            elif was and not r.get("layer_times"):  # a per-layer profile stays, naming its own file
                r["layer_times"], r["layer_times_src"] = was.get("layer_times"), was.get("layer_times_src")
            rows[int(r["length"])] = r
    if not rows:
        raise SystemExit(f"--ttft: no complete length rows in {list(paths)}")
    return [rows[k] for k in sorted(rows)], prov


def _kernel_set(d: dict) -> str:
    """The kernels behind a result's main fields: the first of `--kernels`, as resolved when
    recorded (results before kernels were recorded ran the XLA references; with several
    `--topk-stages` the resolved sets are keyed 'SET/stagesN', the first variant first)."""
    resolved = d.get("kernels_resolved", {})
    if resolved and all("/stages" in k for k in resolved):
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
    import statistics

    out = dict(b)
    for arm in ("recompute", "redknot"):
        out[f"{arm}_s"] = a[f"{arm}_s"] + b[f"{arm}_s"]
        out[f"{arm}_median_s"] = statistics.median(out[f"{arm}_s"])
    out["ratio_per_repeat"] = a["ratio_per_repeat"] + b["ratio_per_repeat"]
    out["speedup_median"] = statistics.median(out["ratio_per_repeat"])
    if not out.get("layer_times"):
        out["layer_times"], out["layer_times_src"] = a.get("layer_times"), a.get("layer_times_src")
    return out


def _kfmt(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _prov(prov: list[str]) -> str:
    """Provenance lines of a title, wrapped to the figure's width."""
    return "\n".join(textwrap.wrap("; ".join(prov), 95))


def _tick(r: dict) -> str:
    """A length's axis label: the length, and what differs between rows of one figure (host-
    resident artifacts, the Mosaic GPU kernels run)."""
    notes = (["host"] if r.get("pool") == "HostPool" else []) + (
        [r["kernel_set"].replace(",", ",\n")] if r.get("kernel_set") else [])  # one kernel per line
    return _kfmt(r["length"]) + "".join(f"\n{n}" for n in notes)


def plot_ttft(rows, prov, out: pathlib.Path, plt) -> list[pathlib.Path]:
    xs = range(len(rows))
    files = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm in ("recompute", "redknot"):
        med = [r[f"{arm}_median_s"] for r in rows]
        ax.plot(xs, med, "-o", color=COLORS[arm], label=f"{arm} (median)")
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r[f"{arm}_s"]), r[f"{arm}_s"], s=12, color=COLORS[arm], alpha=0.4)
    ax.set_xticks(list(xs), [_tick(r) for r in rows])
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("TTFT, both arms (hot artifacts: on the device, or in host memory where marked host)\n" + _prov(prov), fontsize=8)
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
    ax.set_xticks(list(xs), [f"{_tick(r)}\n{r['protected_fraction']:.0%} protected" for r in rows])
    ax.set_ylabel("RedKnot speed-up over Recomputed")
    ax.legend(loc="upper left")
    ax.set_title("TTFT speed-up per length\n" + _prov(prov), fontsize=8)
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
            vals.append(led["total"]["saving"] if key == "operator" else (led or {}).get("saving", float("nan")))
        ax.bar([x - 0.4 + w * (k + 0.5) for x in xs], [v * 100 for v in vals], w, label=label)
        lowest = min([lowest] + [v * 100 for v in vals if v == v])
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(list(xs), [_tick(r) for r in rows])
    ax.set_ylabel("saving (%; negative: RedKnot slower)")
    ax.set_ylim(lowest - 5, 100)
    ax.legend(fontsize=8)
    ax.set_title("The four ledgers per length (each its own quantity; never summed)\n" + _prov(prov),
                 fontsize=8)
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
        ax.legend()
        ax.set_title(f"Per-layer time of both arms at {_kfmt(r['length'])}\n" + _prov([r["layer_times_src"]]),
                     fontsize=8)
        files.append(_save(fig, out / f"layer_times_{_kfmt(r['length'])}.png", plt))
    return files


def plot_qps(path, out: pathlib.Path, plt) -> pathlib.Path:
    d = json.loads(pathlib.Path(path).read_text())
    if "results" not in d:
        raise SystemExit(f"--qps {path}: not a bench_qps.py result (no 'results')")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm, per in d["results"].items():
        levels = sorted(per, key=int)
        y = [per[c]["requests_per_s"] for c in levels]
        ci = [per[c].get("requests_per_s_ci95") or [v, v] for c, v in zip(levels, y)]
        err = [[v - lo for v, (lo, _) in zip(y, ci)], [hi - v for v, (_, hi) in zip(y, ci)]]
        ax.errorbar([int(c) for c in levels], y, yerr=err, fmt="-o", capsize=3, color=COLORS.get(arm), label=arm)
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("completed requests / s (95 % bootstrap interval)")
    ax.set_ylim(bottom=0)
    ax.legend()
    dev = d.get("server", {}).get("device", {})
    ax.set_title(f"Throughput vs concurrency\n{pathlib.Path(path).name}: {dev.get('backend', '?')}, "
                 f"{d.get('date', '?')}", fontsize=8)
    return _save(fig, out / "qps_vs_concurrency.png", plt)


def _save(fig, path: pathlib.Path, plt) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttft", nargs="*", help="bench_ttft.py result files (default: docs/results/ttft_*_h200.json)")
    ap.add_argument("--qps", help="a bench_qps.py result file")
    ap.add_argument("--out", default=str(ROOT / "docs" / "plots"))
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = args.ttft if args.ttft else sorted(glob.glob(str(ROOT / "docs" / "results" / "ttft_*_h200.json")))
    rows, prov = load_ttft(paths)
    files = plot_ttft(rows, prov, out, plt) + plot_layers(rows, out, plt)
    if args.qps:
        files.append(plot_qps(args.qps, out, plt))
    for f in files:
        print(f)
    return files


if __name__ == "__main__":
    main()
