"""The Hopper (sm90) family compiles: one generated forward kernel built for sm_90a with the
local nvcc, no spills, wgmma and TMA in its PTX (tools/check_sm90.py). No GPU needed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_sm90", ROOT / "tools" / "check_sm90.py")
check = importlib.util.module_from_spec(_spec)
sys.modules["check_sm90"] = check
_spec.loader.exec_module(check)


def test_parse_ptxas():
    log = ("ptxas info    : Function properties for _Z3fooPi\n"
           "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 16 barriers\n")
    assert check.parse_ptxas(log) == {"registers": 168, "spill_stores": 8, "spill_loads": 4,
                                      "stack_frame": 0}


def test_space_has_sm90_entries():
    from sparktune.kernels import kernel_space

    names = [e.name for e in kernel_space.forward_space() if e.family == 90]
    assert check.DEFAULT in names
    assert {"fwd_sm90_f16_d64_m128n128_s2", "fwd_sm90_bf16_d128_m128n128_s2"} <= set(names)


@pytest.mark.build
def test_one_sm90_kernel_compiles_without_spills():
    try:
        check.find_nvcc()
        check.cutlass_include()
    except check.ToolUnavailable as e:
        pytest.skip(f"cannot compile CUDA here: {e}")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_sm90.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == "1 passed, 0 failed", res.stdout
    assert lines[0].startswith(check.DEFAULT) and "spill=0/0" in lines[0]
    assert "wgmma=0 " not in lines[0]
