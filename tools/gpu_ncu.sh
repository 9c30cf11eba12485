#!/usr/bin/env bash
# Nsight Compute report of one compiled spark kernel, for finding where its time goes (on a GPU
# machine with sparktune._C built, see tools/device_prep.sh):
#   tools/gpu_ncu.sh KERNEL [sanitize_one.py options, e.g. --causal --seqlen-q 4096]
# Profiles one launch (default problem: batch 4 x 4 heads x 4096 tokens) with the clocks left
# as they are, and writes under ${OUT:-/tmp}/ncu/: KERNEL.txt (the details page: pipe
# utilisation, shared-memory and L2 traffic, stall reasons, instruction mix) and KERNEL.top.txt
# (the SASS lines with the most warp-stall samples, and the samples by reason and by opcode,
# from tools/ncu_top_stalls.py).
set -uo pipefail
cd "$(dirname "$0")/.."
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$ncu" ] || { echo "gpu_ncu: no ncu" >&2; exit 2; }
kernel=$1; shift
out=${OUT:-/tmp}/ncu
mkdir -p "$out"
case $kernel in fwd_*) regex='fwd_kernel' ;; *) regex='bwd_kernel' ;; esac
args=(--seqlen-q 4096 --seqlen-k 4096 --batch 4 "$@")
# pipe utilisation (tensor, XU = special functions, FMA, ALU), shared-memory wavefronts, issue
metrics=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active
"$ncu" --clock-control none --kernel-name "regex:$regex" --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section InstructionStats \
  --section SourceCounters --section LaunchStats --section Occupancy \
  --metrics "$metrics" \
  --import-source no -o "$out/$kernel" -f \
  python3 tools/sanitize_one.py "$kernel" "${args[@]}" > "$out/$kernel.run.txt" 2>&1
rc=$?
"$ncu" --import "$out/$kernel.ncu-rep" --page details --print-details all > "$out/$kernel.txt" 2>&1 || true
"$ncu" --import "$out/$kernel.ncu-rep" --page raw --csv \
  --metrics "$metrics,gpu__time_duration.sum" \
  >> "$out/$kernel.txt" 2>&1 || true
"$ncu" --import "$out/$kernel.ncu-rep" --page source --print-source sass --csv > "$out/$kernel.sass.csv" 2>/dev/null || true
python3 tools/ncu_top_stalls.py "$out/$kernel.sass.csv" > "$out/$kernel.top.txt" 2>&1 || true
rm -f "$out/$kernel.sass.csv"
echo "== $kernel"
grep -iE "Duration|tensor_op_gmma|pipe_xu|pipe_fma|pipe_alu|lsu_wavefronts_mem_shared|issue_active|Registers Per|Shared Memory Configuration Size" "$out/$kernel.txt" | head -20
head -30 "$out/$kernel.top.txt"
exit $rc
