#!/usr/bin/env bash
# compute-sanitizer's memcheck and racecheck on compiled spark kernels (on a GPU machine, with
# sparktune._C built, see tools/device_prep.sh):
#   tools/gpu_sanitize.sh KERNEL [KERNEL ...]
# Each kernel runs once per tool and mask (tools/sanitize_one.py), logs under ${OUT:-/tmp}/sanitize/.
# Exit status 1 when a run reports an error (or fails), 0 when every run is clean.
set -uo pipefail
cd "$(dirname "$0")/.."
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$san" ] || { echo "gpu_sanitize: no compute-sanitizer" >&2; exit 2; }
logs=${OUT:-/tmp}/sanitize
mkdir -p "$logs"
rc=0
for kernel in "$@"; do
  for tool in memcheck racecheck; do
    for mask in "" --causal; do
      log="$logs/$kernel.$tool${mask:+.causal}.log"
      if "$san" --tool "$tool" --error-exitcode 9 python3 tools/sanitize_one.py "$kernel" $mask > "$log" 2>&1; then
        echo "clean  $tool $kernel ${mask:-full}"
      else
        echo "ERROR  $tool $kernel ${mask:-full} (see $log)"; rc=1
      fi
    done
  done
done
exit $rc
