#!/usr/bin/env bash
# Nsight Compute on one compiled spark kernel at a sweep-sized problem (on a GPU machine with
# sparktune._C built, see tools/device_prep.sh):
#   tools/gpu_ncu.sh KERNEL [--causal]
# Profiles one launch of the kernel (batch 4 x 4 heads x 4096 tokens) with the speed-of-light,
# compute-workload (pipe utilisation: the tensor pipe's share of peak), memory and warp-state
# (stall reasons) sections, and
# writes the report under ${OUT:-/tmp}/ncu/.
set -uo pipefail
cd "$(dirname "$0")/.."
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$ncu" ] || { echo "gpu_ncu: no ncu" >&2; exit 2; }
kernel=$1; shift
out=${OUT:-/tmp}/ncu
mkdir -p "$out"
case $kernel in fwd_*) regex='fwd_kernel' ;; *) regex='bwd_kernel' ;; esac
"$ncu" --kernel-name "regex:$regex" --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats -o "$out/$kernel" -f \
  python3 tools/sanitize_one.py "$kernel" --seqlen-q 4096 --seqlen-k 4096 --batch 4 "$@" \
  > "$out/$kernel.txt" 2>&1
rc=$?
"$ncu" --import "$out/$kernel.ncu-rep" --print-summary none >> "$out/$kernel.txt" 2>&1 || true
grep -iE "tensor|Compute \(SM\) Throughput|Memory Throughput|Duration|Registers|Achieved Occupancy|Stall|Shared" "$out/$kernel.txt" | head -40
exit $rc
