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
# DIR is replaced only where this script wrote it (its marker file), so that a DIR given by
# mistake (the repository root, a source folder) is refused, not emptied
if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ] && [ ! -f "$dir/.ab_tree" ]; then
  echo "ab_tree: $dir exists and was not written by tools/ab_tree.sh; name an empty or new DIR" >&2
  exit 2
fi
rm -rf "$dir"
mkdir -p "$dir"
git archive "$sha" CMakeLists.txt pyproject.toml csrc sparktune tools bench | tar -x -C "$dir"
echo "$sha" > "$dir/.ab_tree"
echo "$dir"
