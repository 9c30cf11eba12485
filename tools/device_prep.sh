#!/usr/bin/env bash
# On a GPU machine without network: install the carried wheels (.whl/) into /tmp/site and build
# sparktune._C in place for the local GPU. Source it:  . tools/device_prep.sh 'KERNEL_PATTERNS'
# With "prebuilt" instead of patterns, sparktune/_C*.so was built elsewhere for this Python
# (no torch linkage: tools/devbuild.sh 90 PATTERNS python3.12) and carried: wheels only.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${1:-}" != prebuilt ]; then
  export CUTLASS_INCLUDE=/tmp/site/cutlass_library/source/include
  export PYBIND11_DIR=$(python3 -m pybind11 --cmakedir)
  cap=$(python3 -c 'import torch; a,b=torch.cuda.get_device_capability(); print(f"{a}{b}")')
  JOBS=$(nproc) tools/devbuild.sh "$cap" "${1:-}" python3 > "${OUT:-/tmp}/build.log" 2>&1 || { tail -50 "${OUT:-/tmp}/build.log"; false; }
  grep -E "spill|error" "${OUT:-/tmp}/build.log" | grep -v "0 bytes spill" | head -20
fi
python3 -c "import sparktune._C as C; print('sparktune._C:', len(C.kernels()), 'kernels for', C.build_info()['archs'])"
