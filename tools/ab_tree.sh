#!/usr/bin/env bash
# The files of commit REV that a build and the benchmarks need (CMakeLists.txt, pyproject.toml,
# csrc, sparktune, tools, bench; about 1.6 MB), written to DIR (a relative DIR is under the
# repository root; default .dev/ab/SHORT_SHA), for
# tools/gpu_ab.sh on a GPU machine, which has no git history:
#   tools/ab_tree.sh REV [DIR]      -> prints DIR
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: tools/ab_tree.sh REV [DIR]" >&2
  exit 2
fi
sha=$(git rev-parse --short --verify "$1^{commit}") || { echo "ab_tree: no commit $1" >&2; exit 2; }
dir=${2:-.dev/ab/$sha}
rm -rf "$dir"
mkdir -p "$dir"
git archive "$sha" CMakeLists.txt pyproject.toml csrc sparktune tools bench | tar -x -C "$dir"
echo "$dir"
