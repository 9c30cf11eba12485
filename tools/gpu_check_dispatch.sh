#!/usr/bin/env bash
# Dispatch against torch flash and the fastest candidate at the sweep's short sequences, where
# host cost matters: retune them (forward and backward; $TUNE_OPS, e.g. "bwd", for fewer), then
# `sparktune bench` there. From the repository
# root, on a GPU machine with sparktune._C built (see tools/device_prep.sh):
#
#   OUT=/path tools/gpu_check_dispatch.sh [SEQLENS]     # default 512,1024
#   BENCH_ARGS="" OUT=/path tools/gpu_check_dispatch.sh # the bench over the whole sweep
#
# 1. A database with the shipped records (tuning_db/), less those of SEQLENS and TUNE_OPS.
# 2. `sparktune tune` of TUNE_OPS at SEQLENS (hd 64 and 128, causal and not, 16k tokens, 12
#    heads), on this host: backward candidates are timed as a training call runs them
#    (autograd's engine and sparktune's autograd function included).
# 3. tools/gpu_bench.sh on that database (`--seqlens SEQLENS`, or $BENCH_ARGS when set), and the
#    targets from bench/targets.py.
# Writes retuned.jsonl (the new records, for tuning_db/), what gpu_bench.sh writes (bench.json,
# bench.csv, bench.txt, charts), and summary.txt (every ratio and each target).
# Exit status: the bench's when it failed, else 1 when a target is missed (bench/targets.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:?set OUT to the directory for the results}
seqlens=${1:-512,1024}
ops=${TUNE_OPS:-fwd, bwd}
work=$(mktemp -d)
export SPARKTUNE_SHIPPED_DB=""   # only what is in the database below
unset SPARKTUNE_DB
db="$work/dispatch.sqlite3"

"$PY" - "$seqlens" "$work/kept.jsonl" "$ops" <<'EOF'
import json, sys
seqlens = {int(s) for s in sys.argv[1].split(",")}
ops = {o.strip() for o in sys.argv[3].split(",")}
kept = dropped = 0
with open("tuning_db/nvidia-h200.jsonl") as src, open(sys.argv[2], "w") as dst:
    for line in src:
        p = json.loads(line)["problem"]
        if p["op"] in ops and p["seqlen_q"] in seqlens:
            dropped += 1
            continue
        dst.write(line)
        kept += 1
print(f"shipped records: {kept} kept, {dropped} {sorted(ops)} records at seqlen {sorted(seqlens)} left out")
EOF
"$PY" -m sparktune db import "$work/kept.jsonl" --db "$db"

cat > "$work/recipe.yaml" <<EOF
name: short-sequences
budget:
  trials: ${TUNE_TRIALS:-12}
defaults:
  dtype: float16
  heads: 12
  head_dim: [64, 128]
  causal: [false, true]
  tokens: 16384
  ops: [$ops]
shapes:
  - seqlen: [$seqlens]
EOF
echo "== tune $ops at seqlen $seqlens"
timeout 360 "$PY" -m sparktune tune --recipe "$work/recipe.yaml" --db "$work/new.sqlite3" --no-leases \
  --timeout "${TUNE_TIMEOUT:-18}" --no-progress | tee "$out/tune.txt"
"$PY" -m sparktune db export "$out/retuned.jsonl" --db "$work/new.sqlite3"
"$PY" -m sparktune db import "$out/retuned.jsonl" --db "$db"

echo "== sparktune bench (tools/gpu_bench.sh ${BENCH_ARGS---seqlens $seqlens}) on that database"
rc=0
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
OUT="$out" SPARKTUNE_DB="$db" tools/gpu_bench.sh ${BENCH_ARGS---seqlens $seqlens} > "$out/gpu_bench.txt" 2>&1 || rc=$?
tail -3 "$out/gpu_bench.txt"
targets=0
"$PY" bench/targets.py "$out/bench.json" > "$out/summary.txt" || targets=$?
cat "$out/summary.txt"
[ "$rc" != 0 ] && exit "$rc"
exit "$targets"
