#!/usr/bin/env bash
# Set up a virtual environment in .venv with sparktune and its test tools, then run the main job:
# `sparktune info`, and on a machine with a GPU `sparktune tune --seqlen 8192 --heads 12`.
#   tools/setup.sh            set up and run the main job
#   tools/setup.sh --no-run   set up only (CI)
# Environment: PYTHON (default python3), TORCH_SPEC (used only when the chosen Python has no
# torch; default torch==2.13.0), SPARKTUNE_CUDA_ARCHS / SPARKTUNE_KERNELS (build filters).
set -euo pipefail
cd "$(dirname "$0")/.."
run_main=1
[ "${1:-}" = "--no-run" ] && run_main=0
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
if [ "$run_main" = 1 ]; then
  .venv/bin/sparktune info
  if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    .venv/bin/sparktune tune --seqlen 8192 --heads 12
  else
    echo "no GPU here: skipping 'sparktune tune --seqlen 8192 --heads 12' (it needs one)"
  fi
fi
