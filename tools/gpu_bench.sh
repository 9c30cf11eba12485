#!/usr/bin/env bash
# `sparktune bench` on a GPU machine, everything into $OUT. From the repository root:
#
#   . tools/device_prep.sh 'PATTERNS'        # on the lent GPU machine: wheels and sparktune._C
#   OUT=/path tools/gpu_bench.sh             # the default sweep (BENCHMARKS.md)
#   OUT=/path tools/gpu_bench.sh --quick     # 2 shapes: seqlen 1024 and 8192, hd 128, no mask
#   OUT=/path tools/gpu_bench.sh --dtype float16,bfloat16   # other arguments go to sparktune bench
#
# (Without .whl/ and with sparktune's dependencies installed, just run the script.)
#
# Writes: bench.json (the whole run, --json), bench.csv, bench_<op>_<dtype>.png (one chart per
# op and dtype, when matplotlib is installed; otherwise draw them elsewhere with
# `sparktune bench --from-json bench.json --out DIR`), bench.txt (the table, rendered from
# bench.json), bench.log (stderr), and the total wall time on the last line.
#
# Runtime estimate, H200, default sweep (fp16): 24 shapes x 3 ops x 7 candidates, about 550
# timed measurements (own times spark and triton; math and plain skip seqlen 16384); each is about 10 ms of warm-up plus runs
# filling 50 ms (at least 10), with the L2 flushed before each run: about 70-100 s of timing.
# On top: the float64 references (about 25 s for the sweep), compiling the Triton kernels ahead
# in parallel (under 90 s on a fresh cache), cuDNN plans and start-up: about 3-4 minutes in
# all, under the 8-minute budget. bfloat16 too doubles it (run it separately, or raise
# BENCH_TIMEOUT where the machine allows). --quick: well under a minute
# after start-up. The sweep is stopped after $BENCH_TIMEOUT seconds (default 540); what was
# measured by then is still written (its JSON says "stopped": "interrupted", exit status 130).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import optuna, sqlalchemy, yaml" 2>/dev/null && [ -d .whl ]; then
  . tools/device_prep.sh "${SPARKTUNE_KERNELS:-}"
fi
out=${OUT:?set OUT to the directory for the results}
mkdir -p "$out"

args=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then
    args+=(--seqlens 1024,8192 --head-dims 128 --causal 0)
  else
    args+=("$a")
  fi
done

now() { "$PY" -c 'import time; print(time.time())'; }
t0=$(now)
"$PY" -m sparktune info | head -25 || true
echo
echo "== sparktune bench ${args[*]:-} (the table follows when it is done)"
rc=0
timeout "${BENCH_TIMEOUT:-540}" "$PY" -m sparktune bench ${args[@]+"${args[@]}"} --json --csv "$out/bench.csv" --out "$out" \
  > "$out/bench.json" 2> "$out/bench.log" || rc=$?
tail -5 "$out/bench.log" || true
if [ -s "$out/bench.json" ]; then
  "$PY" -m sparktune bench --from-json "$out/bench.json" | tee "$out/bench.txt" || true
fi
ls -l "$out"
echo "sparktune bench exit status $rc; total wall time $("$PY" -c "import time; print(f'{time.time() - $t0:.0f}')") s"
exit "$rc"
