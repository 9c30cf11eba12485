#!/usr/bin/env bash
# One device call of checks, each with its own time limit, everything logged under $OUT/logs
# and packed into $OUT/logs.tgz (the device returns few files):
#   tools/gpu_session.sh KERNEL_PATTERNS STEP [STEP ...]
# KERNEL_PATTERNS "prebuilt": sparktune/_C*.so was built on another machine for the device's
# Python and carried; no build here (tools/device_prep.sh).
# STEP: models (transformers models end to end, fresh database, shipped records),
#       tests (the GPU tests of the call path, kernels, compile and timer),
#       tune (tools/gpu_check_tune.sh), recipe:FILE:SECONDS (tune a recipe into $OUT/recipe.sqlite3),
#       kernels (bench/model_kernels.py: the kernels of one llama step, sparktune against sdpa),
#       profile (bench/model_profile.py: host time of a llama step at 2k, train and prefill),
#       tuneprof (sparktune tune --seqlen 8192 --heads 12 --json, cold then warm Triton cache),
#       models2k (the models at 2k tokens, 8 rounds, with and without the attention timing),
#       sm90 (tools/gpu_check_sm90.py on the built fwd_sm90 kernels), sm90bwd (the Hopper
#       backward's device check, correctness only), sanitize:K1+K2 (compute-sanitizer on those
#       kernels), ncu:KERNEL (Nsight Compute), features (the Triton features' check, no timing),
#       decode (tools/gpu_check_decode.py and bench/decode_bandwidth.py), modelsdecode (the
#       models' greedy decoding against a static cache of 2k and 8k tokens).
#       records:FILE:OP:SECONDS (shipped records: tune OP (fwd or bwd) of the recipe FILE, the
#       Triton and sm80 families left out as for the shipped H200 records, into
#       /tmp/records.sqlite3, shared by the call's records steps, then export that database per
#       GPU model into $OUT/tuning_db/, the layout of tuning_db/).
#       decoderecords:SECONDS (shipped records of recipes/decode.yaml, the Triton decode
#       configs and SDPA on the sliced cache, 20 trials and 14 s a problem as for the shipped
#       H200 ones, into the same database and export as the records steps).
#       groupsplit (the Hopper backward's group split: its GPU test and the block orders',
#       then bench/gqa_bwd.py's A/B of the splits against SDPA and cuDNN at GQA 16:4, 16:2
#       and 32:8, head dim 128, bf16, causal; the A/B that decides sm90_bwd_split.RULE_ON).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
logs=${OUT:-/tmp/out}/logs
mkdir -p "$logs"
patterns=$1; shift
if [ "$patterns" = prebuilt ] || ! python3 -c "import sparktune._C" 2>/dev/null \
    || ! python3 -c "import optuna" 2>/dev/null; then
  . tools/device_prep.sh "$patterns" > "$logs/prep.log" 2>&1; tail -2 "$logs/prep.log"
fi
export PYTHONPATH=/tmp/site:$PWD
rc=0
# the records steps' database, exported per GPU model into $OUT/tuning_db/ (the layout of tuning_db/)
export_records() {
  python3 -m sparktune db export --db /tmp/records.sqlite3 --per-device "${OUT:-/tmp/out}/tuning_db" \
    >> "$logs/records.log" 2>&1 || rc=1
}
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    models)
      SPARKTUNE_DB=/tmp/fresh-$$.sqlite3 timeout 330 python3 -m sparktune.benchmark.models --json \
        > "$logs/models.json" 2> "$logs/models.err" || rc=1 ;;
    tests)
      timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_host_overhead.py tests/test_torch_backend.py \
        tests/test_spark_bwd.py tests/test_compile.py tests/test_spark.py tests/test_tune_check.py \
        tests/test_integration_transformers.py > "$logs/tests.log" 2>&1 || rc=1
      tail -3 "$logs/tests.log" ;;
    tune)
      OUT=$logs timeout 260 tools/gpu_check_tune.sh > "$logs/tune.log" 2>&1 || rc=1
      grep -E "wall time|targets|exhaustive run" "$logs/tune.log" ;;
    kernels)
      for mode in prefill train; do
        timeout 60 python3 bench/model_kernels.py --preset llama --mode $mode --seqlen 2048 >> "$logs/kernels.log" 2>&1
      done
      head -12 "$logs/kernels.log" ;;
    profile)
      for mode in train prefill; do
        timeout 120 python3 bench/model_profile.py --preset llama --mode $mode --seqlen 2048 >> "$logs/profile.log" 2>&1
      done
      grep -E "host .* ms to issue" "$logs/profile.log" ;;
    tuneprof)
      export SPARKTUNE_SHIPPED_DB=""
      python3 -c "import time; t=time.time(); import torch; from sparktune.backends import torch_sdpa as m; t1=time.time(); m._lse_op('flash'); print(f'import {t1-t:.2f} s, _lse_op(flash) {time.time()-t1:.2f} s')" | tee "$logs/tuneprof.log"
      for run in cold warm; do
        t1=$(date +%s.%N)
        timeout 150 python3 -m sparktune tune --seqlen 8192 --heads 12 --db /tmp/tp-$run-$$.sqlite3 --no-progress --json \
          > "$logs/tune-$run.json" 2> "$logs/tune-$run.err"
        echo "tune $run wall: $(python3 -c "import time; print(round(time.time() - $t1, 1))") s" | tee -a "$logs/tuneprof.log"
        python3 -c "import json,sys; [print(' ', r['key'], r['mode'], r.get('wall_s'), r['phases_s'], r['best']['candidate']) for r in json.load(open(sys.argv[1]))['results']]" "$logs/tune-$run.json" | tee -a "$logs/tuneprof.log"
      done
      unset SPARKTUNE_SHIPPED_DB ;;
    models2k)
      for extra in "" "--no-attention-timing"; do
        SPARKTUNE_DB=/tmp/fresh-$$.sqlite3 timeout 200 python3 -m sparktune.benchmark.models --seqlen 2048 --rounds 8 $extra \
          >> "$logs/models2k.log" 2>&1 || rc=1
      done
      grep -E "^(llama|gpt2)|eomet" "$logs/models2k.log" ;;
    sm90)
      timeout 300 python3 tools/gpu_check_sm90.py --speed-budget 120 > "$logs/sm90.log" 2>&1 || rc=1
      grep -E "correctness|FAIL" "$logs/sm90.log" | head -5 ;;
    sm90bwd)
      timeout 420 python3 tools/gpu_check_sm90_bwd.py --no-speed --out "$logs/sm90bwd.log" > /dev/null 2>&1 || rc=1
      tail -5 "$logs/sm90bwd.log" ;;
    sanitize:*)
      kernels=${step#sanitize:}
      OUT=$logs timeout 400 tools/gpu_sanitize.sh ${kernels//+/ } || rc=1 ;;
    ncu:*)
      OUT=$logs timeout 200 tools/gpu_ncu.sh "${step#ncu:}" || rc=1 ;;
    features)
      timeout 300 python3 tools/gpu_check_triton_features.py --no-speed > "$logs/features.log" 2>&1 || rc=1
      grep -E "correctness|FAIL" "$logs/features.log" | head -5 ;;
    decode)
      timeout 200 python3 tools/gpu_check_decode.py --out "$logs/decode.log" > /dev/null 2>&1 || rc=1
      tail -2 "$logs/decode.log"
      timeout 240 python3 bench/decode_bandwidth.py --out "$logs/decode_bw.txt" > /dev/null 2>&1
      tail -16 "$logs/decode_bw.txt" ;;
    modelsdecode)
      SPARKTUNE_DB=/tmp/fresh-$$.sqlite3 timeout 300 python3 -m sparktune.benchmark.models --mode decode \
        --seqlen 2048 8192 --batch 8 > "$logs/modelsdecode.log" 2>&1 || rc=1
      grep -E "decode|geomean" "$logs/modelsdecode.log" ;;
    records:*)
      IFS=: read -r _ file op secs <<< "$step"
      timeout "$secs" python3 -m sparktune tune --recipe "$file" --op "$op" --no-leases --no-progress \
        --exclude 'triton:*' --exclude 'spark:*_sm80_*' --db /tmp/records.sqlite3 \
        >> "$logs/records.log" 2>&1 || rc=1
      export_records ;;
    decoderecords:*)
      timeout "${step#decoderecords:}" python3 -m sparktune tune --recipe recipes/decode.yaml --trials 20 \
        --timeout 14 --no-leases --no-progress --db /tmp/records.sqlite3 >> "$logs/records.log" 2>&1 || rc=1
      export_records ;;
    groupsplit)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_spark_bwd.py \
        -k "group_split or block_orders or default_backward" > "$logs/groupsplit_tests.log" 2>&1 || rc=1
      tail -1 "$logs/groupsplit_tests.log"
      for gqa in "16 4 1024,2048,4096,8192 1,2,4,rule" "16 2 2048,4096,8192 1,2,4,8,rule" \
                 "32 8 1024,2048,4096 1,2,4,rule"; do
        read -r hq hk lens splits <<< "$gqa"
        timeout 120 python3 bench/gqa_bwd.py --heads "$hq" --heads-kv "$hk" --seqlens "$lens" \
          --splits "$splits" >> "$logs/groupsplit_bench.log" 2>&1 || rc=1
      done
      grep -E "^hd|^#" "$logs/groupsplit_bench.log" ;;
    recipe:*)
      IFS=: read -r _ file secs <<< "$step"
      timeout "$secs" python3 -m sparktune tune --recipe "$file" --no-leases --no-progress \
        --db "${OUT:-/tmp/out}/recipe.sqlite3" > "$logs/recipe.log" 2>&1 || true ;;
  esac
  echo "$step: $(( $(date +%s) - t0 )) s"
done
tar czf "${OUT:-/tmp/out}/logs.tgz" -C "$(dirname "$logs")" logs && rm -rf "$logs"
exit $rc
