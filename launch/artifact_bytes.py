"""Bytes per stored token of each artifact codec (reuse/codec.py) at DeepSeek-V4 shapes (issue #47).

The producer (`reuse.artifact.stored_bytes`) is traced on an abstract model of the preset, so
the figures are the exact array sizes `build_artifact` writes (no weights, nothing computed; a
CPU does it in seconds). Per preset, FFN mode (the profile's `ffn_rows`: "restore" stores each
row's FFN output, "omit" / "run" do not) and codec: KiB per stored token, split into the reusable
layers (what a documents' pool packs on the device) and the fence layers' native states (the
"prefix" part), and the device bytes of a pool of 65,536 and 262,144 document tokens.

With `--quality FILE` (an `eval_quality.py --paired-with` JSON comparing compact artifacts with
dense ones) it also writes the headline `docs/results/artifacts_headline.json`.

    python launch/artifact_bytes.py --out docs/results/artifact_bytes.json
    python launch/artifact_bytes.py --quality docs/results/quality_3x4_n64_codec_s34.json \\
        --quality-omit docs/results/quality_3x4_n64_codec_omit_s34.json --headline docs/results/artifacts_headline.json
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from launch import _cli  # noqa: E402
from redknot_jax import config  # noqa: E402
from redknot_jax.reuse.artifact import stored_bytes  # noqa: E402
from redknot_jax.reuse.codec import CODECS  # noqa: E402
from redknot_jax.reuse.profile import flash_profile, pro_profile  # noqa: E402

PRESETS = {"flash": (config.flash, flash_profile), "pro": (config.pro, pro_profile)}
KIB = 1024
GB = 1e9


def table(presets, n: int) -> list[dict]:
    rows = []
    cases = list(itertools.product(presets, ("omit", "restore"), CODECS))
    for name, ffn, c in _cli.progress(cases, desc="trace the producer", unit="case", leave=False):
        make_cfg, make_profile = PRESETS[name]
        prof = dataclasses.replace(make_profile(), ffn_rows=ffn, artifact_codec=c)
        b = stored_bytes(make_cfg(), prof, n, jnp.bfloat16)
        per_pool = b["reusable"] / n
        rows.append({"preset": name, "ffn_rows": ffn, "codec": c, "profile": prof.name,
                     "kib_per_token": round(b["per_token"] / KIB, 1),
                     "bytes_per_token": round(b["per_token"]),
                     "pool_kib_per_token": round(per_pool / KIB, 1),
                     "prefix_kib_per_token": round(b["prefix"] / n / KIB, 1),
                     "pool_gb_65536": round(per_pool * 65536 / GB, 1),
                     "pool_gb_262144": round(per_pool * 262144 / GB, 1)})
    return rows


def markdown(rows) -> str:
    lines = ["| preset | FFN of unprotected rows | codec | KiB / token | of which pool | of which prefix | "
             "pool GB at 64K | pool GB at 256K |", "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['ffn_rows']} | {r['codec']} | {r['kib_per_token']} | "
                     f"{r['pool_kib_per_token']} | {r['prefix_kib_per_token']} | {r['pool_gb_65536']} | "
                     f"{r['pool_gb_262144']} |")
    return "\n".join(lines)


def _compact(rows, ffn: str, quality: dict, compact: str) -> dict:
    """The compact codec's Flash bytes under `ffn` and its quality from an eval_quality.py
    --paired-with run (RedKnot over compact artifacts against RedKnot over dense ones)."""
    row = next(r for r in rows if (r["preset"], r["ffn_rows"], r["codec"]) == ("flash", ffn, compact))
    per = quality["summary"][next(v for v in quality["summary"] if v.endswith(f"-{compact}"))]
    qts = ("lookup", "two_hop")
    return {"format": compact, "ffn_rows": ffn, "bytes_per_token": row["bytes_per_token"],
            "delta_em_points": {qt: round(per[qt]["vs_paired"]["diff_em"], 1) for qt in qts},
            "ci": {qt: [round(x, 1) for x in per[qt]["vs_paired"]["diff_em_ci"]] for qt in qts},
            "first_token_kl": {qt: float(f"{per[qt]['vs_paired']['mean_kl']:.3g}") for qt in qts},
            "vs": quality["paired_with"], "quality_command": quality["command"]}


def headline(rows, quality: dict, compact: str, quality_omit: dict | None = None) -> dict:
    """`artifacts_headline.json` (issue #47): the Flash formats' bytes under the shipped FFN
    mode, the compact codec's bytes and quality there, and (`quality_omit`) without the FFN part."""
    ffn = flash_profile().ffn_rows
    out = {"device": "none (array sizes by shape; quality on a CPU)", "date": datetime.date.today().isoformat(),
           "command": "python launch/artifact_bytes.py " + " ".join(sys.argv[1:]), "ffn_rows": ffn,
           "formats": {("bf16" if r["codec"] == "dense" else r["codec"]): {"bytes_per_token": r["bytes_per_token"]}
                       for r in rows if r["preset"] == "flash" and r["ffn_rows"] == ffn},
           "compact": _compact(rows, ffn, quality, compact)}
    if quality_omit is not None:
        out["compact_without_ffn"] = _compact(rows, "omit", quality_omit, compact)
    out["ttft_262144"] = None  # not measured: no GPU was lent (docs/benchmarks.md says what it takes)
    return out


def main(argv=None):
    ap = _cli.parser(__doc__, __file__, "python launch/artifact_bytes.py --out docs/results/artifact_bytes.json")
    ap.add_argument("--presets", default="flash,pro")
    ap.add_argument("--tokens", type=int, default=65536, help="document length the sizes are taken at")
    ap.add_argument("--out", default=None, help="JSON of the table (a .md beside it)")
    ap.add_argument("--quality", default=None, type=_cli.input_file,
                    help="eval_quality.py --paired-with JSON (dense vs compact)")
    ap.add_argument("--quality-omit", default=None, type=_cli.input_file,
                    help="the same comparison under ffn_rows=omit")
    ap.add_argument("--compact", default="fp4", choices=[c for c in CODECS if c != "dense"])
    ap.add_argument("--headline", default=None, help="write artifacts_headline.json here (needs --quality)")
    args = ap.parse_args(argv)
    presets = args.presets.split(",")
    bad = [p for p in presets if p not in PRESETS]
    if bad:
        raise SystemExit(f"--presets: unknown {bad}; known: {sorted(PRESETS)}")
    if args.headline and not args.quality:
        raise SystemExit("--headline needs --quality (the compact codec's quality run)")
    rows = table(presets, args.tokens)
    print(markdown(rows))
    result = {"command": "python launch/artifact_bytes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "jax": jax.__version__, "tokens": args.tokens,
              "dtype": "bfloat16", "rows": rows}
    if args.out:
        p = pathlib.Path(args.out)
        p.write_text(json.dumps(result, indent=1) + "\n")
        p.with_suffix(".md").write_text(markdown(rows) + "\n")
    if args.headline:
        read = {}
        for flag, path in (("--quality", args.quality), ("--quality-omit", args.quality_omit)):
            if path is not None:
                read[flag] = json.loads(pathlib.Path(path).read_text())
                if not read[flag].get("paired_with"):
                    raise SystemExit(f"{flag} {path}: not an eval_quality.py --paired-with run")
        out = headline(rows, read["--quality"], args.compact, read.get("--quality-omit"))
        pathlib.Path(args.headline).write_text(json.dumps(out, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
