#!/usr/bin/env bash
# Session 18: several one-question associative-recall probes (docs/results/qa_s17/mqar1.py) at
# once on one GPU, each cut off after SECONDS; their outputs end up in OUT/ladder.log, one block
# per variant. Memory is allocated on demand so the variants share the GPU.
#
#   bash docs/results/qa_s18/ladder.sh OUT SECONDS "NAME MODE NPEOPLE [FIELD=VALUE ...]" ...
set -uo pipefail
out=$1 budget=$2
shift 2
mkdir -p "$out" /tmp/ladder
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
export XLA_FLAGS="${XLA_FLAGS:---xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false}"
names=()
for spec in "$@"; do
    read -r name mode npeople args <<<"$spec"
    names+=("$name")
    # shellcheck disable=SC2086  # ARGS are word-split on purpose
    timeout "$budget" python3 docs/results/qa_s17/mqar1.py "$mode" 10000000 "$npeople" $args \
        >"/tmp/ladder/$name.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
    echo "== $name"
    cat "/tmp/ladder/$name.log"
done >"$out/ladder.log"
for name in "${names[@]}"; do
    echo "$name: $(tail -n 1 "/tmp/ladder/$name.log")"
done
