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


def test_sm90_scheduling_switches_are_name_suffixes():
    from sparktune.kernels import kernel_space

    e = kernel_space.Fwd90Entry("f16", 128, 128, 128, 2)
    assert e.name == "fwd_sm90_f16_d128_m128n128_s2"  # switches off: the original name and type
    assert e.config_type == "Sm90FwdConfig<cutlass::half_t, 128, 128, 128, 2>"
    ov = kernel_space.Fwd90Entry("f16", 128, 128, 128, 2, True, True)
    assert ov.name == "fwd_sm90_f16_d128_m128n128_s2_ov1_pp1"
    assert ov.config_type.endswith(", 2, true, true>")
    names = {x.name for x in kernel_space.forward_space() if x.family == 90}
    assert {"fwd_sm90_f16_d64_m128n128_s2_ov1_pp0", "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1"} <= names


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


def test_spark_says_sm90a_runs_on_sm90_only():
    from sparktune.backends.spark import SparkBackend, _tma_refuses
    from sparktune.problem import DeviceInfo, Problem

    k = {"name": "fwd_sm90_f16_d128_m128n128_s2", "op": "fwd", "family": 90, "dtype": "float16",
         "head_dim": 128, "accum": 32, "min_arch": 90, "archs": [90], "smem_bytes": 164992}
    p = Problem("fwd", "float16", 1, 2, 2, 16, 16, 128, False)
    b = SparkBackend()
    assert b._config_reasons(p, k, DeviceInfo("h100", (9, 0), 132)) == []
    for cap in ((10, 0), (8, 0)):
        reasons = b._config_reasons(p, k, DeviceInfo("other", cap, 1))
        assert len(reasons) == 1 and "sm_90 (Hopper) only" in reasons[0]
    assert _tma_refuses(k["name"], [(16, 8, 128)] * 3 + [(0, 8, 128)])
    assert not _tma_refuses(k["name"], [(16, 8, 128)] * 4)
    assert not _tma_refuses("fwd_sm80_f16_d128_m128n64_w4x1_acc32_preg", [(0, 8, 128)] * 4)
