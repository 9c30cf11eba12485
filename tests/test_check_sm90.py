"""The Hopper (sm90) family compiles: one generated forward and one backward kernel built for
sm_90a with the local nvcc, no spills, wgmma and TMA in their PTX (tools/check_sm90.py). No GPU
needed."""

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


def test_parse_ptxas_picks_the_named_entry():
    # a backward unit compiles the preprocess and dQ conversion kernels too
    log = ("ptxas info    : Compiling entry function '_Z21bwd_convert_dq_kernel' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z21bwd_convert_dq_kernel\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 24 registers, used 0 barriers\n"
           "ptxas info    : Compiling entry function '_Z15sm90_bwd_kernelI' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z15sm90_bwd_kernelI\n"
           "    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 11 barriers\n")
    assert check.parse_ptxas(log, "sm90_bwd_kernel") == {
        "registers": 168, "spill_stores": 8, "spill_loads": 12, "stack_frame": 8}
    assert check.parse_ptxas(log)["registers"] == 24


def test_parse_ptxas_entries_judges_every_instantiation():
    # the Hopper backward unit holds three instantiations of the kernel (plain, a window,
    # softcap/ALiBi): a spill in any of them must be seen
    entry = ("ptxas info    : Compiling entry function '_Z15sm90_bwd_kernelILi{m}E' for 'sm_90a'\n"
             "ptxas info    : Function properties for _Z15sm90_bwd_kernelILi{m}E\n"
             "    {f} bytes stack frame, {st} bytes spill stores, {ld} bytes spill loads\n"
             "ptxas info    : Used 168 registers, used 11 barriers\n")
    log = ("ptxas info    : Compiling entry function '_Z21bwd_convert_dq_kernel' for 'sm_90a'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 24 registers, used 0 barriers\n"
           + entry.format(m=0, f=0, st=0, ld=0) + entry.format(m=1, f=0, st=0, ld=0)
           + entry.format(m=2, f=8, st=4, ld=4))
    got = check.parse_ptxas_entries(log, "sm90_bwd_kernel")
    assert [e["spill_stores"] for e in got] == [0, 0, 4]
    assert [e["registers"] for e in got] == [168, 168, 168]
    assert check.parse_ptxas(log, "sm90_bwd_kernel")["spill_stores"] == 0  # the first only


def test_space_has_sm90_entries():
    from sparktune.kernels import kernel_space

    names = [e.name for e in kernel_space.full_space() if e.family == 90]
    assert set(check.DEFAULT.split(",")) <= set(names)
    assert {"fwd_sm90_f16_d64_m128n128_s2", "fwd_sm90_bf16_d128_m128n128_s2"} <= set(names)
    assert {"bwd_sm90_f16_d128_m64n128_s2", "bwd_sm90_bf16_d64_m128n128_s2"} <= set(names)


def test_sm90_backward_entries():
    from sparktune.kernels import kernel_space

    e = kernel_space.Bwd90Entry("bf16", 128, 64, 128, 3)
    assert e.name == "bwd_sm90_bf16_d128_m64n128_s3"
    assert e.config_type == "Sm90BwdConfig<cutlass::bfloat16_t, 128, 64, 128, 3>"
    assert e.family == 90 and e.launch_header == "sparktune/sm90_bwd_launch.h"
    bwd = [x for x in kernel_space.backward_space() if isinstance(x, kernel_space.Bwd90Entry)]
    assert {x.dtype for x in bwd} == {"f16", "bf16"} and {x.head_dim for x in bwd} >= {64, 128}
    assert kernel_space.select(kernel_space.full_space(), "bwd_sm90_f16_d128_*")
    # the overlapped order: a suffix and a template argument; off, the original name and type
    ov = kernel_space.Bwd90Entry("f16", 64, 64, 128, 3, True)
    assert ov.name == "bwd_sm90_f16_d64_m64n128_s3_ov1"
    assert ov.config_type == "Sm90BwdConfig<cutlass::half_t, 64, 64, 128, 3, true>"
    assert {"bwd_sm90_f16_d64_m64n128_s3_ov1", "bwd_sm90_bf16_d64_m64n128_s3_ov1"} <= {x.name for x in bwd}
    # K and V in registers: a second suffix and template argument, after the overlap's
    kr = kernel_space.Bwd90Entry("f16", 64, 64, 128, 2, kv_regs=True)
    assert kr.name == "bwd_sm90_f16_d64_m64n128_s2_kr1"
    assert kr.config_type == "Sm90BwdConfig<cutlass::half_t, 64, 64, 128, 2, false, true>"
    kr = kernel_space.Bwd90Entry("bf16", 64, 64, 128, 3, True, True)
    assert kr.name == "bwd_sm90_bf16_d64_m64n128_s3_ov1_kr1"
    assert kr.config_type.endswith(", 3, true, true>")
    assert {"bwd_sm90_f16_d64_m64n128_s2_kr1", "bwd_sm90_bf16_d128_m64n128_s2_kr1"} <= {x.name for x in bwd}


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
    # persistent: a third suffix and template argument, with or without the other switches
    ps = kernel_space.Fwd90Entry("bf16", 64, 128, 128, 2, persistent=True)
    assert ps.name == "fwd_sm90_bf16_d64_m128n128_s2_ps1"
    assert ps.config_type == "Sm90FwdConfig<cutlass::bfloat16_t, 64, 128, 128, 2, false, false, true>"
    ps = kernel_space.Fwd90Entry("f16", 128, 128, 128, 2, True, False, True)
    assert ps.name == "fwd_sm90_f16_d128_m128n128_s2_ov1_pp0_ps1"
    assert ps.config_type.endswith(", 2, true, false, true>")
    assert {"fwd_sm90_f16_d64_m128n128_s2_ps1", "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1_ps1"} <= names
    # three consumer warpgroups persistent, with and without the overlap (they fit since O is
    # staged in the tile's own Q slot)
    assert {"fwd_sm90_f16_d64_m192n128_s2_ps1", "fwd_sm90_f16_d64_m192n128_s2_ov1_pp0_ps1"} <= names


def test_sm90_backward_rules_say_why(tmp_path):
    """The C++ rules of the Hopper backward: which declared entries are built, and the reason
    for each that is not."""
    try:
        nvcc = check.find_nvcc()
        inc = check.cutlass_include()
    except check.ToolUnavailable as e:
        pytest.skip(f"cannot compile CUDA here: {e}")
    subprocess.run([sys.executable, str(ROOT / "csrc" / "gen_kernels.py"), "--out", str(tmp_path),
                    "--nvcc", str(nvcc), "--include", str(inc), "--include",
                    str(ROOT / "csrc" / "include"), "--filter", "bwd_sm90_*", "--families", "90"],
                   check=True, capture_output=True, text=True)
    rows = {r.split("\t")[0]: r.split("\t") for r in (tmp_path / "space.tsv").read_text().splitlines()}
    for dt in ("f16", "bf16"):
        for name in (f"bwd_sm90_{dt}_d128_m64n128_s2", f"bwd_sm90_{dt}_d64_m64n128_s2"):
            assert rows[name][1] == "1", rows[name]
            assert rows[name][3] == "384"  # two consumer warpgroups and the producer
            src = (tmp_path / f"{name}.cu").read_text()
            assert "register_sm90_bwd<Sm90BwdConfig<" in src
        assert "head dims 64 and 128" in rows[f"bwd_sm90_{dt}_d256_m64n128_s2"][4]
        assert "shared memory" in rows[f"bwd_sm90_{dt}_d128_m128n128_s2"][4]
        assert "register budget" in rows[f"bwd_sm90_{dt}_d64_m128n128_s2"][4]
        assert rows[f"bwd_sm90_{dt}_d64_m64n128_s3_ov1"][1] == "1"
        assert "overlapped order" in rows[f"bwd_sm90_{dt}_d128_m64n128_s3_ov1"][4]
        assert rows[f"bwd_sm90_{dt}_d64_m64n128_s2_kr1"][1] == "1"
        assert "K and V as register operands" in rows[f"bwd_sm90_{dt}_d128_m64n128_s2_kr1"][4]


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
    assert lines[-1] == "2 passed, 0 failed", res.stdout
    for line, name in zip(lines, check.DEFAULT.split(","), strict=False):
        assert line.startswith(name) and "spill=0/0" in line
        assert "wgmma=0 " not in line and "tma=0 " not in line


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
    assert _tma_refuses("bwd_sm90_f16_d128_m64n128_s2", [(16, 8, 128)] * 4 + [(0, 8, 128)])


def _bwd_catalogue():
    def k(name, family, bm, bn, wm, wn):
        return {"name": name, "op": "bwd", "family": family, "dtype": "float16",
                "head_dim": int(name.split("_d")[1].split("_")[0]),
                "block_m": bm, "block_n": bn, "warps_m": wm, "warps_n": wn, "accum": 32,
                "softmax": "smem", "min_arch": family, "archs": [80, 90], "smem_bytes": 1000}
    return {x["name"]: x for x in (
        k("bwd_sm80_f16_d128_m64n128_w2x4_acc32", 80, 64, 128, 2, 4),
        k("bwd_sm90_f16_d128_m64n128_s2", 90, 64, 128, 8, 1),
        k("bwd_sm90_f16_d128_m64n128_s3", 90, 64, 128, 8, 1),
        k("bwd_sm90_f16_d128_m64n64_s2", 90, 64, 64, 4, 1),
        k("bwd_sm80_f16_d64_m128n128_w2x4_acc32", 80, 128, 128, 2, 4),
        k("bwd_sm90_f16_d64_m64n128_s2", 90, 64, 128, 8, 1),
        k("bwd_sm90_f16_d64_m64n128_s2_kr1", 90, 64, 128, 8, 1),
    )}


def _spark_with(catalogue, monkeypatch):
    from sparktune.backends import spark

    b = spark.SparkBackend()
    b._kernels = catalogue
    monkeypatch.setattr(b, "unavailable_reasons", lambda: [])
    return b


def test_spark_bwd_sm90_default_and_deterministic(monkeypatch):
    from sparktune.backends import spark as spark_mod
    from sparktune.kernels import kernel_space
    from sparktune.problem import DeviceInfo, Problem

    b = _spark_with(_bwd_catalogue(), monkeypatch)
    hopper, ampere = DeviceInfo("h200", (9, 0), 132), DeviceInfo("a100", (8, 0), 108)
    p = Problem("bwd", "float16", 1, 2, 2, 4096, 4096, 128, True)
    # while a Hopper backward waits for its device check (kernel_space.UNVERIFIED) it is no
    # candidate: the sm80 default stays on sm_90, a deterministic problem has no default, and
    # the kernel runs only when forced by name
    monkeypatch.setattr(kernel_space, "UNVERIFIED", ("bwd_sm90_*",))
    assert kernel_space.is_unverified("bwd_sm90_f16_d128_m64n128_s2")
    assert b.default_config(p, hopper) == "bwd_sm80_f16_d128_m64n128_w2x4_acc32"
    det = p.replace(deterministic=True)
    assert b.default_config(det, hopper) is None
    assert b._config_reasons(det, b._catalogue()["bwd_sm90_f16_d128_m64n128_s2"], hopper) == []
    # once verified: sm_90 takes the Hopper backward's default for head dim 128 (stages 2
    # before 3)
    monkeypatch.setattr(kernel_space, "UNVERIFIED", ())
    assert b.default_config(p, hopper) == "bwd_sm90_f16_d128_m64n128_s2"
    # elsewhere family 90 is refused and the sm80 default stays
    assert b.default_config(p, ampere) == "bwd_sm80_f16_d128_m64n128_w2x4_acc32"
    assert b.feature_reasons(det) == []
    sm80 = b._catalogue()["bwd_sm80_f16_d128_m64n128_w2x4_acc32"]
    reasons = b._config_reasons(det, sm80, hopper)
    assert len(reasons) == 1 and "not bitwise reproducible" in reasons[0]
    assert b._config_reasons(det, b._catalogue()["bwd_sm90_f16_d128_m64n128_s2"], hopper) == []
    assert b.default_config(det, hopper) == "bwd_sm90_f16_d128_m64n128_s2"
    assert b.default_config(det, ampere) is None  # no deterministic backward there
    # head dim 64: the Hopper default serves every problem (kernel_space.SM90_DETERMINISTIC_ONLY
    # is empty), and a default listed there would serve deterministic problems only
    p64 = Problem("bwd", "float16", 1, 2, 2, 4096, 4096, 64, True)
    assert ("bwd", 64) not in kernel_space.SM90_DETERMINISTIC_ONLY
    # (the default there is the one with K and V in registers, not the same tiles without)
    assert b.default_config(p64, hopper) == "bwd_sm90_f16_d64_m64n128_s2_kr1"
    assert b.default_config(p64.replace(deterministic=True), hopper) == "bwd_sm90_f16_d64_m64n128_s2_kr1"
    monkeypatch.setattr(spark_mod, "SM90_DETERMINISTIC_ONLY", frozenset({("bwd", 64)}))
    assert b.default_config(p64, hopper) == "bwd_sm80_f16_d64_m128n128_w2x4_acc32"
    assert b.default_config(p64.replace(deterministic=True), hopper) == "bwd_sm90_f16_d64_m64n128_s2_kr1"


def test_gpu_check_bwd_says_where_a_gradient_is_wrong():
    """The first device run of the sm90 backward must make a layout bug recognisable: the
    worst element's index and the index runs of the wrong batches, heads, rows and columns."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_check_sm90_bwd",
                                                  ROOT / "tools" / "gpu_check_sm90_bwd.py")
    g = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(g)
    assert g._ranges([0, 1, 2, 5, 6, 9]) == "0-2,5-6,9"
    assert g._ranges(list(range(0, 40, 2)), most=2) == "0,2,... (20 runs)"
    ref = torch.zeros(2, 3, 50, 64, dtype=torch.float64)
    bad = ref.clone().half()
    bad[1, 2, 17:20, 32:64] = 1.0  # a block of rows, one warpgroup's columns
    bad[1, 2, 18, 40] = 2.0
    text = g._where(bad, ref, 0.01, "query row")
    assert "worst at (batch 1, head 2, query row 18, col 40): got 2, want 0" in text
    assert "96 of 19200 over 0.01 (0 not finite)" in text
    assert "batches 1, heads 2, query rows 17-19 of 50, cols 32-63 of 64" in text
    why, detail = [], []
    errs = g._judge((bad, ref.half(), ref.half()), (ref, ref, ref), (1e-3,) * 3, "default", why,
                    detail)
    assert errs == [2.0, 0.0, 0.0]
    assert why == ["default dq err 2 > bound 0.00201"]
    assert len(detail) == 1 and detail[0].startswith("default dq worst at (batch 1, head 2")
    bad[0, 0, 0, 0] = float("nan")
    why = []
    g._judge((ref.half(), bad, ref.half()), (ref, ref, ref), (1e-3,) * 3, "det", why, detail)
    assert why == ["det dk err nan > bound 0.00201"] and len(detail) == 1  # the first one only
    assert "(1 not finite)" in g._where(bad, ref, 0.01, "key row")


def test_register_pool_of_setmaxnreg():
    """setmaxnreg moves registers within what the block was launched with: a request beyond
    that pool is a hang on the GPU, so the compile check refuses it."""
    ptx = ("\tsetmaxnreg.inc.sync.aligned.u32 240;\n...\n"
           "\tsetmaxnreg.dec.sync.aligned.u32 24;\n")
    assert check.register_pool_reasons(ptx, 168, 384) == []  # 128 x 24 + 256 x 240 = 168 x 384
    assert check.register_pool_reasons(ptx, 240, 256) == []
    short = check.register_pool_reasons(ptx, 160, 384)
    assert len(short) == 1 and "would wait forever" in short[0]
    assert "against a launch count of 248" in check.register_pool_reasons(ptx, 248, 256)[0]
    assert check.register_pool_reasons("no setmaxnreg here", None, 384) == []
    assert "without a ptxas register count" in check.register_pool_reasons(ptx, None, 384)[0]


@pytest.mark.build
def test_sm90_backward_layouts_on_the_host():
    """Without a GPU: the backward's register reinterpretations (accumulator -> wgmma A
    operand, stmatrix of dS^T), the tiles' coverage and the transposed shared-memory views
    agree for every valid configuration (check_sm90.py --layouts)."""
    try:
        check.find_nvcc()
        check.cutlass_include()
    except check.ToolUnavailable as e:
        pytest.skip(f"cannot compile CUDA here: {e}")
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "check_sm90.py"), "--layouts",
                          "--filter", "bwd_sm90_*"],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) >= 6 and all(line.endswith(" 0 mismatches") for line in lines), res.stdout
    assert any(line.startswith("bwd_sm90_f16_d128_m64n128_s2: ") for line in lines)
