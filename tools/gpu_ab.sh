#!/usr/bin/env bash
# A/B of two builds on a GPU machine: this working tree ("new") against an older tree ("old",
# written by tools/ab_tree.sh REV and carried along), both built for the local GPU with the same
# kernels, then COMMAND run in each tree in alternating processes (new, old, new, old, ...),
# ROUNDS times each, so that both builds meet the same machine state. Logs under
# ${OUT:-/tmp}/ab/: build_new.log, build_old.log, new_R.log and old_R.log for R = 1..ROUNDS.
#   tools/gpu_ab.sh OLD_DIR 'KERNEL_PATTERNS' ROUNDS -- COMMAND...
# e.g. tools/gpu_ab.sh .dev/ab/92531ce 'fwd_sm90_f16_*ps1' 2 -- \
#        python3 bench/spark_fwd.py --configs NAMES --each --rounds 2
# COMMAND runs in each tree's root with that tree first on PYTHONPATH (after /tmp/site, where
# tools/device_prep.sh installs the carried wheels). Exit status: 2 for bad arguments, 1 when
# a build fails, else 0 (each run's status is printed, not judged).
set -uo pipefail
usage() { echo "usage: tools/gpu_ab.sh OLD_DIR 'KERNEL_PATTERNS' ROUNDS -- COMMAND..." >&2; }
if [ $# -lt 5 ] || [ "$4" != "--" ]; then usage; exit 2; fi
if [ ! -f "$1/CMakeLists.txt" ] || [ ! -d "$1/sparktune" ]; then
  echo "gpu_ab: $1 is not a tree from tools/ab_tree.sh (no CMakeLists.txt or sparktune/)" >&2
  exit 2
fi
case $3 in ''|*[!0-9]*) echo "gpu_ab: ROUNDS must be a positive integer, not '$3'" >&2; exit 2 ;; esac
[ "$3" -ge 1 ] || { echo "gpu_ab: ROUNDS must be at least 1" >&2; exit 2; }
old=$(cd "$1" && pwd)
patterns=$2
rounds=$3
shift 4
cd "$(dirname "$0")/.."
new=$PWD
out=${OUT:-/tmp}/ab
mkdir -p "$out"
# the new tree: wheels into /tmp/site and sparktune/_C in place (sets CUTLASS_INCLUDE and
# PYBIND11_DIR for the second build)
. tools/device_prep.sh "$patterns" > "$out/build_new.log" 2>&1 || {
  echo "gpu_ab: the build of this tree failed ($out/build_new.log)" >&2; tail -20 "$out/build_new.log" >&2; exit 1; }
cap=$(python3 -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")')
(cd "$old" && rm -f sparktune/_C*.so && JOBS=$(nproc) tools/devbuild.sh "$cap" "$patterns" python3) \
  > "$out/build_old.log" 2>&1 || {
  echo "gpu_ab: the build of $old failed ($out/build_old.log)" >&2; tail -20 "$out/build_old.log" >&2; exit 1; }
for r in $(seq 1 "$rounds"); do
  for v in new old; do
    if [ "$v" = new ]; then dir=$new; else dir=$old; fi
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir "$@") > "$out/${v}_$r.log" 2>&1
    echo "gpu_ab: $v round $r: exit $?"
  done
done
