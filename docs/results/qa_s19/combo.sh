#!/usr/bin/env bash
# Session 19: one GPU call, two kinds of runs side by side for SECONDS: one-question probes
# (docs/results/qa_s18/ladder.sh, specs from the file LADDER) and QA-model trainings
# (launch/qa_probes.sh, specs from the file PROBES), one spec per line in each.
#
#   bash docs/results/qa_s19/combo.sh OUT SECONDS LADDER PROBES
set -uo pipefail
out=$1 budget=$2
mapfile -t ladder <"$3"
mapfile -t probes <"$4"
bash docs/results/qa_s18/ladder.sh "$out" "$budget" "${ladder[@]}" &
bash launch/qa_probes.sh "$out" "$budget" "${probes[@]}" &
wait
