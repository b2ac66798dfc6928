#!/usr/bin/env bash
# Several short QA-model trainings (issue 10) at once on one GPU, to compare recipes side by
# side in one run: each variant is a `train_quality_model.py` run from scratch with the common
# probe arguments plus its own, all started together (memory is allocated on demand, not
# preallocated). This buys a side-by-side comparison, not throughput: four qa runs at once
# made 5.4 steps/s together, one alone 7.4 (H200, 2026-12-01).
# Written to OUT (few files: a GPU call returns at most 8): probes.log (every run's output, then
# the summary below),
# probes.json (every run's train_log.json) and the checkpoint of the variant with the best
# validation EM above its in-context chance in OUT/best (safetensors, config.json,
# train_log.json; `train.write_serving_files` restores the rest). The held-out test split
# plays no part in the choice.
#
#   bash launch/qa_probes.sh OUT SECONDS "NAME ARGS..." ["NAME ARGS..." ...]
#   bash launch/qa_probes.sh $OUT 480 "base" "hd256 --set head_dim=256 --set rope_dim=32"
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 OUT SECONDS \"NAME ARGS...\" [...]" >&2
    exit 2
fi
out=$1 budget=$2
shift 2
mkdir -p "$out"
: "${PROBE_ARGS:=--seq-len 1024 --batch 8 --curriculum-until 0.34 --eval-docs 2 --per-doc 2 --eval-episodes 64 --log-every 50}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the working tree, installed or not
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false}"
mkdir -p /tmp/qa_probe
names=()
for spec in "$@"; do
    read -r name args <<<"$spec"
    names+=("$name")
    # shellcheck disable=SC2086  # ARGS are word-split on purpose
    python3 launch/train_quality_model.py --out "/tmp/qa_probe/$name" --time-budget-s "$budget" --reserve-s 45 \
        $PROBE_ARGS $args >"/tmp/qa_probe/$name.log" 2>&1 &
done
wait || true
python3 - "$out" "${names[@]}" <<'EOF'
import json, pathlib, shutil, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
tmp = pathlib.Path("/tmp/qa_probe")
logs = {}
with open(out / "probes.log", "w") as f:
    for n in names:
        f.write(f"===== {n}\n" + ((tmp / f"{n}.log").read_text() if (tmp / f"{n}.log").is_file() else "(no log)\n"))
best, rows = None, []
for n in names:
    p = tmp / n / "train_log.json"
    log = logs[n] = json.loads(p.read_text()) if p.is_file() else {}
    val = {k: v for k, v in log.get("teacher_forced_val", {}).items() if isinstance(v, dict)}
    if not val:
        rows.append(f"{n}: no validation scores")
        continue
    margin = sum(v["em"] - v["chance"] for v in val.values()) / len(val)
    rows.append(f"{n}: steps {log['steps']}, validation " + ", ".join(
        f"{k} EM {v['em']:.3f} (chance {v['chance']:.3f})" for k, v in val.items()) + f"; mean margin {margin:+.3f}")
    if best is None or margin > best[1]:
        best = (n, margin)
(out / "probes.json").write_text(json.dumps(logs, indent=1))
if best:
    rows.append(f"best: {best[0]} (margin {best[1]:+.3f}) -> {out}/best")
summary = "\n".join(rows)
print(summary)
with open(out / "probes.log", "a") as f:  # the summary travels with the logs, not only on stdout
    f.write("===== summary\n" + summary + "\n")
if best:
    (out / "best").mkdir(exist_ok=True)
    for f in (tmp / best[0]).iterdir():
        if f.suffix == ".safetensors" or f.name in ("config.json", "train_log.json"):
            shutil.copy(f, out / "best" / f.name)
EOF
