#!/bin/bash
# The GPU benchmark queue for the lent device machine (`run`: at most 600 s a call, a machine
# kept warm ~30 s between calls, device time cut by the budget left).
#
#   bash launch/device_chain.sh WAIT_S [STEPS]
#
# The first call on a machine starts the queue detached (setsid: it outlives the call); every
# call then waits up to WAIT_S seconds for it, copying what it has written (*.json, *.md, *.log)
# to $OUT every 10 s, so a call cut at its limit still returns the partial results, and prints
# the queue's progress. Keep WAIT_S 30+ s under the call's expected limit_s (the budget left
# after the machine started can be less than the timeout asked). Later calls on the same warm
# machine wait for the same queue. STEPS (a comma list of the step names below; default: the
# device's list) picks what runs; a failed step does not stop the next. Results: /tmp/res on
# the device, then $OUT. One GPU process at a time: do not start another benchmark while the
# queue runs (two on one GPU both die of out-of-memory in XLA's autotuner). Step `qps` needs the
# server's wheels: `pip download -d .whl uvicorn starlette prometheus_client` here, and
# `carry: [".whl"]` in the `run` call (.whl/ is ignored by git).
set -u
cd "$(dirname "$0")/.."
R=/tmp/res
mkdir -p "$R"

step() {  # name, then the command's arguments after `python`; STEP_TIMEOUT=S (default 7200) interrupts it
  # after S seconds (SIGINT: Python prints where it was), so the queue goes on to the next step
  local name=$1; shift
  echo "== $name start $(date +%T)" >> $R/chain.log
  timeout -s INT -k 30 "${STEP_TIMEOUT:-7200}" python "$@" > $R/$name.log 2>&1
  echo "== $name rc=$? $(date +%T)" >> $R/chain.log
}

qps_setup() {  # the `qps` steps': the server's wheels (.whl/)
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> $R/chain.log 2>&1
}

run_steps() {
  export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jc
  local d today; d=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
  today=$(date +%Y%m%d)
  local steps=${1:-}
  if [ -z "$steps" ]; then  # what docs/benchmarks.md still lists as not measured, by device
    if [ $d = h200 ]; then steps=ttft128,ttft64head,qps,break_even,ttft256build,ttft256,model64,decode_batch,pass_a,mhc
    else steps=qps_h100,buckets32,ops32,pass_a,decode_batch16,model32; fi  # command F (qps) exceeds an H100's 80 GB
  fi
  for s in ${steps//,/ }; do case $s in
    ttft64) step $s launch/bench_ttft.py --lengths 65536 --repeats 2 --layer-times --op-profile 2,20,21,40 \
      --profiles tail0-b10-omit,tail0-b10-restore,default --out $R/ttft_64k_modes_${d}_$today.json \
      --headline $R/ttft_headline_64k_${d}_$today.json ;;
    ttft64head) step $s launch/bench_ttft.py --lengths 65536 --repeats 2 --profiles default,tail0-b10-omit \
      --out $R/ttft_64k_head_${d}_$today.json --headline $R/ttft_headline_64k_${d}_$today.json ;;  # ttft64 less its
      # profiles and restore variant: the headline's 64K row in one call of a short budget
    ttft64omit) step $s launch/bench_ttft.py --lengths 65536 --repeats 2 --layer-times --profiles tail0-b10-omit-fp4 \
      --out $R/ttft_64k_omit_fp4_${d}_$today.json ;;  # 64K within an H100's 80 GB: one profile, `omit`, whose fp4
      # pool holds no FFN outputs (14.2 GB; 19.8 GB with `restore`'s, when the Recomputed warm-up ran out of memory)
    pass_a) step $s launch/bench_pass_a.py --length 131072 --doc 16384 --call-rows 8192 --span-rows 2048 \
      --span-chunks 2048 --hca-rows 8192 --json $R/pass_a_128k_doc16384_${d}_$today.json ;;  # the kernel-vs-chunks
      # table's last gap (docs/kernels.md; layer.SPAN_DOC_ROWS)
    ttft128) STEP_TIMEOUT=1200 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 step $s launch/bench_ttft.py \
      --lengths 131072 --repeats 2 --profiles default,tail0-b10-omit --stacks-every 120 \
      --out $R/ttft_128k_${d}_$today.json --headline $R/ttft_headline_128k_${d}_$today.json ;;
      # 2026-12-06 on an H200: the prefix arm's warm-up had not ended 10 minutes after the Recomputed arm's (102.6 s);
      # the log names each warm-up's end, Python's stacks every 2 minutes say where it stalls, and XLA logs each
      # compiler pass as it starts (compiling or running); cut after 20 minutes, so the queue goes on
    ttft128np) step $s launch/bench_ttft.py --lengths 131072 --repeats 2 --profiles default,tail0-b10-omit \
      --no-prefix-arm --out $R/ttft_128k_noprefix_${d}_$today.json \
      --headline $R/ttft_headline_128k_noprefix_${d}_$today.json ;;  # ttft128 less the prefix arm
    ttft256build) step $s launch/bench_ttft.py --lengths 262144 --profiles tail0-b10-omit-fp4 \
      --store /tmp/art --build-only --out $R/ttft_256k_build_${d}_$today.json ;;
    ttft256) step $s launch/bench_ttft.py --lengths 262144 --repeats 2 --profiles tail0-b10-omit-fp4 \
      --store /tmp/art --out $R/ttft_256k_fp4_${d}_$today.json ;;
    break_even) step $s launch/bench_break_even.py --preset flash-shaped --dtype bfloat16 --profile flash \
      --artifact-codec fp4 --lengths 16384,65536 --repeats 2 --out $R/break_even_${d}_$today.json ;;
    break_even_h100)  # the break-even table within an H100's 80 GB, for the profile steps qps and qps_h100 serve
      # (the Flash preset's at tail 0 and a 10 % budget: at these lengths its 32K tail protects every row);
      # BE_LENGTHS narrows it to a short device budget
      step $s launch/bench_break_even.py --preset flash-shaped --dtype bfloat16 \
        --profile launch/profiles/flash_tail0_b10.json --lengths ${BE_LENGTHS:-16384,32768} --repeats 2 \
        --out $R/break_even_tail0_b10_${d}_$today.json ;;
    model64|model32) step $s launch/bench_model.py --lengths $([ $s = model64 ] && echo 65536 || echo 32768) \
      --decode-steps 16 --repeats 1 --json $R/bench_model_${s#model}k_${d}_$today.json ;;  # first call: the per-layer compile
    decode_batch) step $s launch/bench_ttft.py --lengths 32768 --repeats 1 --decode-steps 16 \
      --decode-batch 8 --no-prefix-arm --out $R/decode_batch_32k_${d}_$today.json ;;
    decode_batch16) step $s launch/bench_ttft.py --lengths 16384 --repeats 1 --tail-rows 0 --budget 0.1 \
      --decode-steps 8 --decode-batch 4 --no-prefix-arm --out $R/decode_batch_16k_${d}_$today.json ;;
    ops32) XLA_FLAGS=--xla_gpu_enable_command_buffer= step $s launch/bench_ttft.py --lengths 32768 --repeats 1 \
      --op-profile 2,20,21,42 --profiles tail0-b10-omit-fp4 --out $R/ops_32k_nocmdbuf_${d}_$today.json ;;  # ops named
      # (not hidden in command buffers) with their source lines; times not comparable with the other steps'; the
      # first fence's and the last layer's idle time named; not in the default lists
    buckets32) for nb in 8 16; do  # padded sizes per octave, side by side on one machine (one artifact store):
        # RedKnot's 24704 computed rows pad to 26624 (7.8 %) at 8, to 25600 (3.6 %) at 16, in every layer
        step ${s}_$nb launch/bench_ttft.py --lengths 32768 --repeats 2 --profiles tail0-b10-omit-fp4 --no-prefix-arm \
          --store /tmp/art32 --shape-buckets $nb --out $R/ttft_32k_buckets${nb}_${d}_$today.json
      done ;;  # not in the default lists; ~6 min for the first half on a fresh H100, so give it a call of its own
    blocks32) for qb in 256 512; do  # query rows per attention step in every arm, side by side (one artifact
        # store): a 32K fence layer idles ~8.5 ms of ~85 between its 256-row steps (the loop, the top-k switch)
        step ${s}_$qb launch/bench_ttft.py --lengths 32768 --repeats 2 --layer-times --profiles tail0-b10-omit-fp4 \
          --no-prefix-arm --store /tmp/art32 --query-block $qb --out $R/ttft_32k_block${qb}_${d}_$today.json
      done ;;  # not in the default lists; ~6 min for the first half on a fresh H100 (the artifacts built)
    ahead32) for th in 0 8; do  # compile threads 0 and 8 side by side (one artifact store; a fresh compilation
        # cache each, so both warm-ups compile every program): warm-up and timed seconds decide Consumer's default
        JAX_COMPILATION_CACHE_DIR=/tmp/jc_ahead$th step ${s}_$th launch/bench_ttft.py --lengths 32768 --repeats 3 \
          --profiles tail0-b10-omit-fp4 --no-prefix-arm --store /tmp/art32 --compile-threads $th \
          --out $R/ttft_32k_ahead${th}_${d}_$today.json
      done ;;  # not in the default lists; ~12 min on a fresh H100
    plan32) step $s launch/bench_ttft.py --lengths 32768 --repeats 2 --layer-times --profiles tail0-b10-omit-fp4 \
      --no-prefix-arm --compile-threads 8 --out $R/ttft_32k_plan_${d}_$today.json ;;  # the request's host time
      # (redknot_plan_s) and TTFT in the least device time: layer programs compiled side by side
    mhc) step $s launch/bench_mhc.py --rows 32768 --json $R/mhc_32k_${d}_$today.json ;;  # mHC's forms side by side
    ttft32) step $s launch/bench_ttft.py --lengths 32768 --repeats 2 --layer-times --op-profile 2,20,21,40 \
      --profiles tail0-b10-omit-fp4,tail0-b10-restore-fp4,fp4 --out $R/ttft_32k_fp4_${d}_$today.json ;;
    qps)  # issue #46's command F at 1 / 4 / 16 clients, served with the Flash profile at tail 0 and a 10 % budget
      # (the preset's 32K tail protects every row of a 32K request: RedKnot would do the prefix arm's work); then
      # each arm at twice its best rate, open loop (--overload): a queue of 16 (not 64) keeps each arm's drain short;
      # QPS_LEVELS and QPS_OVERLOAD as in qps_h100. 16 slots (QPS_SLOTS): every one of 16 clients in flight, as a
      # deployment sizes its batch to its load (vLLM's max_num_seqs); at 8, half of them wait in the queue (F4, one
      # H100, 2026-12-07: RedKnot's TTFT p50 12.9 s at 16 clients, 1.6 s at 4)
      qps_setup
      PYTHONPATH=/tmp/site:$PWD step $s launch/bench_qps.py --serve-args "--preset flash-shaped --dtype bfloat16 \
--profile launch/profiles/flash_tail0_b10.json --max-model-len 33280 --arena-rows 65536 --max-tokens-limit 64 \
--prefill-chunk 8192 --max-batched-tokens 8192 --compile-threads 8 --warmup-documents 4x8192+32 --max-queue 16 \
--slots ${QPS_SLOTS:-16}" \
      --arms redknot,prefix,recompute --overload ${QPS_OVERLOAD:-2} --concurrency ${QPS_LEVELS:-1,4,16} --duration-s 30 \
      --warmup-requests 1 --warmup-max-rounds 3 --docs 8 --docs-per-request 4 \
      --doc-chars 8192 --prompt-chars 32 --output-len 64 --startup-timeout-s 600 \
      --headline $R/qps_headline_${d}_$today.json --out $R/qps_flash_${d}_$today.json ;;
    qps_h100)  # command F within an H100's 80 GB (its arena of 65,536 rows did not fit beside the weights): the
      # 4 documents every request cites (in a seeded random order) in an arena of 32,768 rows, batches of 2; the
      # Flash profile at tail 0 and a 10 % budget (its 32K tail protects every row of a 32K request). Both qps
      # steps warm F's document requests at start-up (alone, in batches, prefix arm): compiled mid-run, a batch
      # shape's autotuning found no memory beside the requests in flight (2026-12-07, H100, 4 clients). QPS_LEVELS
      # (default 1,4,16), QPS_REUSE_BATCH (default 2) and QPS_OVERLOAD (default 2; 0: none) in the environment
      # narrow it to a short device budget
      qps_setup
      PYTHONPATH=/tmp/site:$PWD step $s launch/bench_qps.py --serve-args "--preset flash-shaped --dtype bfloat16 \
--profile launch/profiles/flash_tail0_b10.json --max-model-len 33280 --arena-rows 32768 --reuse-batch ${QPS_REUSE_BATCH:-2} \
--max-tokens-limit 64 --prefill-chunk 8192 --max-batched-tokens 8192 --compile-threads 8 --warmup-documents 4x8192+32 \
--max-queue 16" --arms redknot,prefix,recompute --overload ${QPS_OVERLOAD:-2} --concurrency ${QPS_LEVELS:-1,4,16} \
      --duration-s 30 --warmup-requests 1 --warmup-max-rounds 3 --docs 4 --docs-per-request 4 \
      --doc-chars 8192 --prompt-chars 32 --output-len 64 --startup-timeout-s 600 \
      --headline $R/qps_headline_docs4_${d}_$today.json --out $R/qps_flash_docs4_${d}_$today.json ;;
    compile0)  # the flash-shaped decode step's layer-0 parts, compiled alone (the server's decode warm-up;
      # docs/serving.md): the Sinkhorn's sums as folds (served) and as reduce ops (the form before), side by side;
      # ~3 min on an H100, measured 2026-12-07, so not in the default lists
      for sk in unrolled reduce; do step ${s}_$sk launch/bench_compile.py --preset flash-shaped --layer 0 --slots 8 \
        --capacity 33280 --parts layer,mhc_pre,mix,sinkhorn,hc_post,attn,moe,ffn --sinkhorn $sk --timeout 150 \
        --out $R/compile_decode_layer0_${sk}_${d}_$today.json; done ;;
    *) echo "== $s: no such step" >> $R/chain.log ;;
  esac; done
  touch $R/done
}

if [ "${1:-}" = --queue ]; then run_steps "${2:-}"; exit; fi
if [ ! -f $R/started ]; then
  touch $R/started
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $R/chain.log
  setsid nohup bash "$0" --queue "${2:-}" > $R/queue.out 2>&1 < /dev/null &
fi
end=$((SECONDS + ${1:-540}))
save() { cp $R/*.json $R/*.md $R/*.log "${OUT:-/tmp}"/ 2>/dev/null; }
while [ ! -f $R/done ] && [ $SECONDS -lt $end ]; do sleep 10; save; echo "t=$SECONDS $(tail -1 $R/chain.log)"; done
save
cat $R/chain.log
for f in $R/*.log; do
  [ "$f" = $R/chain.log ] && continue
  echo "--- $f"; tr '\r' '\n' < "$f" | grep -v "it/s\]\|s/it\]\|^    @" | tail -12
done
