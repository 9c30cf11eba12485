"""The spark backend (compiled CUDA/CuTe family): the declared space, the build rules, and on a
GPU every compiled forward kernel against the float64 reference."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparktune.backends.spark import SparkBackend, load_extension
from sparktune.dtypes import TORCH_DTYPES
from sparktune.kernels.kernel_space import forward_space, select
from sparktune.problem import DeviceInfo, Problem

ROOT = Path(__file__).resolve().parent.parent

_C, _C_ERR = load_extension()
KERNELS = [k["name"] for k in _C.kernels() if k["op"] == "fwd"] if _C is not None else []
needs_ext = pytest.mark.skipif(_C is None, reason=f"sparktune._C not built: {_C_ERR}")


# ---------------------------------------------------------------- CPU: the declared space
def test_space_names_are_unique_and_encode_their_parameters():
    entries = forward_space()
    names = [e.name for e in entries]
    assert len(names) == len(set(names))
    e = next(e for e in entries if e.name == "fwd_sm80_f16_d128_m128n64_w4x1_acc32_preg")
    assert (e.family, e.dtype, e.head_dim, e.block_m, e.block_n) == (80, "f16", 128, 128, 64)
    assert (e.warps_m, e.warps_n, e.accum, e.softmax) == (4, 1, 32, "preg")
    # Volta has no bf16 tensor cores and no register-softmax layout: none declared
    assert not [e for e in entries if e.family == 70 and (e.dtype == "bf16" or e.softmax == "preg")]


def test_select_filters_by_shell_patterns():
    entries = forward_space()
    picked = select(entries, "fwd_sm70_*_d64_*, fwd_sm80_bf16_d128_m128n64_w4x1_acc32_preg")
    assert picked and all(
        e.name.startswith("fwd_sm70_") and "_d64_" in e.name
        or e.name == "fwd_sm80_bf16_d128_m128n64_w4x1_acc32_preg"
        for e in picked
    )
    assert select(entries, "") == entries
    assert select(entries, "no_such_kernel") == []


def _cutlass_include() -> str | None:
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
    return str(inc) if (inc / "cute" / "tensor.hpp").exists() else None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.skipif(_cutlass_include() is None, reason="needs the nvidia-cutlass headers")
def test_compile_time_rules_exclude_what_cannot_fit(tmp_path):
    """The generator asks the C++ rules: Volta configurations over 96 KB and bad warp tilings
    are excluded with a reason, valid ones get a source file."""
    pats = ("fwd_sm70_f16_d128_m128n64_w4x1_acc32_psmem,fwd_sm70_f16_d64_m64n64_w2x2_acc32_psmem,"
            "fwd_sm70_f16_d128_m64n64_w2x1_acc32_psmem,fwd_sm80_f16_d32_m64n64_w8x1_acc32_preg")
    subprocess.run(
        [sys.executable, str(ROOT / "csrc" / "gen_kernels.py"), "--out", str(tmp_path), "--nvcc", "nvcc",
         "--include", _cutlass_include(), "--include", str(ROOT / "csrc" / "include"), "--filter", pats],
        check=True, capture_output=True, text=True,
    )
    rows = {r.split("\t")[0]: r.split("\t") for r in (tmp_path / "space.tsv").read_text().splitlines()}
    big = rows["fwd_sm70_f16_d128_m128n64_w4x1_acc32_psmem"]
    assert big[1] == "0" and "96 KB" in big[4] and int(big[2]) > 96 * 1024
    ok = rows["fwd_sm70_f16_d64_m64n64_w2x2_acc32_psmem"]
    assert ok[1] == "1" and (tmp_path / "fwd_sm70_f16_d64_m64n64_w2x2_acc32_psmem.cu").exists()
    spills = rows["fwd_sm70_f16_d128_m64n64_w2x1_acc32_psmem"]  # Volta register rule
    assert spills[1] == "0" and "register budget" in spills[4]
    bad = rows["fwd_sm80_f16_d32_m64n64_w8x1_acc32_preg"]
    assert bad[1] == "0" and "warp tile" in bad[4]
    reg = (tmp_path / "register_all.cu").read_text()
    assert 'registry.exclude("fwd_sm70_f16_d128_m128n64_w4x1_acc32_psmem"' in reg


@pytest.mark.build
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.skipif(_cutlass_include() is None, reason="needs the nvidia-cutlass headers")
@pytest.mark.skipif(os.environ.get("SPARKTUNE_SKIP_BUILD_TEST") == "1", reason="SPARKTUNE_SKIP_BUILD_TEST=1")
def test_one_kernel_of_each_atom_compiles_for_sm80(tmp_path):
    """A template that no longer compiles must turn CI red: build one m16n8k16 and one m8n8k4
    kernel for sm_80 (in parallel) and require no register spills."""
    names = ["fwd_sm80_f16_d64_m128n64_w4x1_acc32_preg", "fwd_sm70_f16_d64_m64n64_w2x2_acc32_psmem"]
    subprocess.run(
        [sys.executable, str(ROOT / "csrc" / "gen_kernels.py"), "--out", str(tmp_path), "--nvcc", "nvcc",
         "--include", _cutlass_include(), "--include", str(ROOT / "csrc" / "include"), "--filter", ",".join(names)],
        check=True, capture_output=True, text=True,
    )
    procs = []
    for n in names:
        cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "--use_fast_math", "-arch=sm_80",
               "-Xptxas=-v,-warn-spills", f"-I{_cutlass_include()}", f"-I{ROOT / 'csrc' / 'include'}",
               "-c", str(tmp_path / f"{n}.cu"), "-o", str(tmp_path / f"{n}.o")]
        procs.append((n, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for n, p in procs:
        log = p.communicate()[0]
        assert p.returncode == 0, f"{n} failed to compile:\n{log[-4000:]}"
        assert "spill" not in log.replace("0 bytes spill", ""), f"{n} spills registers:\n{log}"


# ---------------------------------------------------------------- CPU: capabilities
def test_packed_problems_run_on_the_hopper_family_only():
    """varlen is declared by the backend, and each kernel says whether it runs it: the family 90
    forward and backward do (the backward deterministic too); the other families refuse with
    the reason, forward and backward."""
    import dataclasses

    b = SparkBackend()
    assert "varlen" in b.features
    p = Problem("fwd", "bfloat16", 8, 16, 16, 2048, 2048, 128, True, False, varlen=True,
                total_q=16384, total_k=16384)
    bwd = dataclasses.replace(p, op="bwd")
    k90 = dict(dtype="bfloat16", head_dim=128, accum=32, family=90, op="fwd")
    assert b._config_reasons(p, k90, None) == []
    assert b._config_reasons(bwd, {**k90, "op": "bwd"}, None) == []
    assert b._config_reasons(dataclasses.replace(bwd, deterministic=True), {**k90, "op": "bwd"}, None) == []
    for family in (80, 70):
        for problem in (p, bwd):
            kernel = {**k90, "family": family, "op": problem.op}
            reasons = b._config_reasons(problem, kernel, None)
            assert any("family 90 forward and backward only" in r and f"family {family} {problem.op}" in r
                       for r in reasons), reasons
    dense = dataclasses.replace(p, varlen=False, total_q=0, total_k=0)
    assert b._config_reasons(dense, {**k90, "family": 80}, None) == []
    assert b._config_reasons(dataclasses.replace(dense, op="bwd"), {**k90, "family": 80, "op": "bwd"}, None) == []


@pytest.mark.parametrize(
    "features,text",
    [
        (dict(window_left=255, window_right=-1, causal=True), "sliding windows"),
        (dict(window_left=3, window_right=7), "sliding windows"),
        (dict(softcap=True), "soft-capping"),
        (dict(alibi=True), "ALiBi"),
        (dict(window_left=63, window_right=-1, causal=True, softcap=True, alibi=True, varlen=True,
              total_q=16384, total_k=16384),
         "sliding windows and soft-capping and ALiBi"),  # (packed sequences: fwd and bwd)
    ],
)
def test_window_softcap_alibi_run_on_the_hopper_forward_only(features, text):
    """window, softcap and alibi are declared by the backend, alone or together (and with
    packed sequences); the family 90 forward and backward take them, every other kernel says
    which it lacks and where they run."""
    import dataclasses

    b = SparkBackend()
    assert {"window", "softcap", "alibi", "varlen"} <= b.features
    assert "dropout" not in b.features
    p = Problem("fwd", "bfloat16", 8, 16, 16, 2048, 2048, 128, features.get("causal", False),
                False, **{k: v for k, v in features.items() if k != "causal"})
    assert b.feature_reasons(p) == []
    k90 = dict(dtype="bfloat16", head_dim=128, accum=32, family=90, op="fwd")
    bwd = dataclasses.replace(p, op="bwd")
    assert b._config_reasons(p, k90, None) == []
    assert b._config_reasons(bwd, {**k90, "op": "bwd"}, None) == []
    for kernel, problem in (({**k90, "family": 80}, p), ({**k90, "family": 70}, p),
                            ({**k90, "family": 80, "op": "bwd"}, bwd)):
        reasons = b._config_reasons(problem, kernel, None)
        want = (f"{text} run on the family 90 forward and backward only (fwd_sm90_*, bwd_sm90_*, "
                f"sm_90); this is a family {kernel['family']} {kernel['op']} kernel")
        assert want in reasons, reasons
    # dropout is not the backend's: refused before any kernel is asked
    dropout = dataclasses.replace(p, dropout=True)
    assert b.feature_reasons(dropout) == ["backend 'spark' does not support the feature 'dropout'"]


def test_feature_arguments_of_the_hopper_forward():
    """What forward passes to the kernel for window, softcap and alibi_slopes: a side that
    reaches past every key unlimited (so that any int fits the kernel's int32), ALiBi's batch
    stride 0 for (Hq,) slopes and for a broadcast (B, Hq) view; each bad argument raises with
    what is wrong."""
    from sparktune.backends.spark import _feature_args

    cpu = torch.device("cpu")

    def args(window=None, softcap=0.0, alibi=None, b=2, hq=4, nq=100, nk=300):
        return _feature_args(window, softcap, alibi, b, hq, nq, nk, cpu)

    assert args((5, 7)) == dict(window_left=5, window_right=7)
    assert args((0, 0)) == dict(window_left=0, window_right=0)
    assert args((299, 99)) == dict(window_left=299, window_right=99)
    assert args((300, 100)) == dict(window_left=-1, window_right=-1)
    assert args((2**40, -1)) == dict(window_left=-1, window_right=-1)
    assert args([-1, 3]) == dict(window_left=-1, window_right=3)
    assert args(softcap=30) == dict(softcap=30.0)
    heads = torch.rand(4)
    kw = args(alibi=heads)
    assert kw["alibi_slopes"] is heads and kw["alibi_batch_stride"] == 0
    kw = args(alibi=heads.expand(2, 4))
    assert kw["alibi_slopes"].data_ptr() == heads.data_ptr() and kw["alibi_batch_stride"] == 0
    per_batch = torch.rand(2, 4)
    assert args(alibi=per_batch)["alibi_batch_stride"] == 4
    strided = torch.rand(4, 2)[:, 0]  # stride 2: copied to a contiguous tensor
    kw = args(alibi=strided)
    assert kw["alibi_slopes"].is_contiguous() and torch.equal(kw["alibi_slopes"], strided)
    for bad, exc, match in (
        (dict(window=(3,)), TypeError, "window must be a pair of ints"),
        (dict(window=(1.5, 2)), TypeError, "window must be a pair of ints"),
        (dict(window=(True, 2)), TypeError, "window must be a pair of ints"),
        (dict(window=(-2, 2)), ValueError, r"window sides must be >= 0, or -1 for unlimited, got \(-2, 2\)"),
        (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be finite and >= 0"),
        (dict(softcap=float("nan")), ValueError, "softcap must be finite and >= 0"),
        (dict(alibi=torch.rand(4, dtype=torch.float64)), TypeError, "alibi_slopes must be a float32 tensor"),
        (dict(alibi=torch.rand(3)), ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(3,\)"),
        (dict(alibi=torch.rand(3, 4)), ValueError, r"got \(3, 4\)"),
    ):
        with pytest.raises(exc, match=match):
            args(**bad)
    with pytest.raises(ValueError, match="alibi_slopes is on cpu, the inputs on meta"):
        _feature_args(None, 0.0, heads, 2, 4, 100, 300, torch.device("meta"))


def test_backend_without_gpu_says_why():
    b = SparkBackend()
    p = Problem("fwd", "float16", 1, 2, 2, 16, 16, 64, False)
    reasons = b.not_supported_reasons(p, None, None)
    assert reasons and ("CPU" in reasons[0] or "not installed" in reasons[0] or "GPU" in reasons[0])


@needs_ext
def test_capability_reasons_name_the_mismatch():
    b = SparkBackend()
    if b.unavailable_reasons():
        pytest.skip("; ".join(b.unavailable_reasons()))
    name = KERNELS[0]
    k = b.kernel_info(name)
    dev = DeviceInfo("fake", (k["min_arch"] // 10, k["min_arch"] % 10), 1)
    other = "bfloat16" if k["dtype"] == "float16" else "float16"
    p = Problem("fwd", other, 1, 1, 1, 8, 8, k["head_dim"] + 32 if k["head_dim"] < 256 else 32, False)
    text = " ".join(b.not_supported_reasons(p, name, dev))
    assert other in text and "head_dim" in text


# ---------------------------------------------------------------- GPU: every compiled kernel
from tests._oracle import assert_close_to_reference  # noqa: E402

# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, causal)
SHAPES = [
    (1, 2, 2, 1, 1, False),
    (2, 3, 3, 17, 17, True),
    (2, 3, 3, 17, 17, False),
    (1, 2, 2, 1000, 1000, True),
    (1, 2, 1, 4097, 4097, False),
    (1, 2, 1, 4097, 4097, True),
    (2, 4, 2, 17, 1000, True),     # seqlen_q < seqlen_k, causal aligned bottom-right
    (1, 2, 2, 1000, 17, True),     # seqlen_q > seqlen_k: the top rows see no key
    (1, 8, 2, 300, 300, True),     # GQA
    (1, 4, 1, 129, 257, False),    # MQA
]
DTYPES = TORCH_DTYPES


def _run(b, name, q, k, v, causal, scale=None, layout_out=None):
    d = q.shape[-1]
    scale = scale if scale is not None else d ** -0.5
    out = layout_out if layout_out is not None else torch.full_like(q, float("nan"))
    lse = b.forward(q, k, v, out, config=name, causal=causal, scale=scale)
    torch.cuda.synchronize()
    return out, lse


def _runnable(name):
    """(backend, kernel info, torch dtype, head dim) of a compiled kernel; skips the test where
    the GPU cannot run it."""
    b = SparkBackend()
    k = b.kernel_info(name)
    dtype, d = DTYPES[k["dtype"]], k["head_dim"]
    dev = DeviceInfo.from_torch("cuda")
    if b.not_supported_reasons(Problem("fwd", k["dtype"], 1, 1, 1, 1, 1, d, False, True), name, dev):
        pytest.skip(f"{name} not runnable on sm_{dev.arch}")
    return b, k, dtype, d


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_matches_float64_reference(name):
    b, k, dtype, d = _runnable(name)
    factor = 2.0 if k["accum"] == 32 else ACC16_FACTOR
    results = []
    for (bs, hq, hk, nq, nk, causal) in SHAPES:
        q = torch.randn(bs, hq, nq, d, device="cuda", dtype=dtype)
        kk = torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype)
        v = torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype)
        out, lse = _run(b, name, q, kk, v, causal)
        assert not torch.isnan(out).any(), f"{name}: unwritten or NaN output at {(bs, hq, hk, nq, nk, causal)}"
        tol = assert_close_to_reference(out, q, kk, v, causal=causal, lse=lse, factor=factor,
                                        what=f"{name} {(bs, hq, hk, nq, nk, causal)}")
        results.append(tol)
        if k["accum"] == 16:
            _check_acc16_rel(out, q, kk, v, causal, None, f"{name} {(bs, hq, hk, nq, nk, causal)}")
        # the same inputs again: a deterministic kernel gives the same bits (a race would not)
        out2, lse2 = _run(b, name, q, kk, v, causal)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{name}: results moved between runs"
    print("\n".join(str(t) for t in results))


#: fp16 accumulation rounds every partial sum of Q.K^T and P.V, and the running O, to 11 bits;
#: the caller opts into that trade (allow_fp16_accum=True), and its error grows with seqlen_k.
#: The rule for those kernels: max abs error at most 16x PyTorch's own error (fp32-accumulating
#: kernels: FlashAttention's 2x) and relative L2 error at most ACC16_REL_L2. Measured on an H200
#: on the shapes below: the m16n8k16 fp16-accumulating kernel reached 4.8x, the m8n8k4 one
#: 10.8x (both at seqlen 4097); every fp32-accumulating kernel stayed under 2x.
ACC16_FACTOR = 16.0
ACC16_REL_L2 = 5e-3


def _check_acc16_rel(out, q, k, v, causal, scale, what):
    from sparktune.backends.reference import reference_attention

    ref, _ = reference_attention(q, k, v, causal=causal, scale=scale)
    rel = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    print(f"{what}: relative L2 error {rel:.3g}")
    assert rel <= ACC16_REL_L2, f"{what}: relative L2 error {rel:.3g} > {ACC16_REL_L2}"


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_strided_layouts_and_scale(name):
    """(B, N, H, D) views of a packed qkv tensor and an output slice, with a custom scale."""
    b, k, dtype, d = _runnable(name)
    bs, n, h = 2, 333, 3
    qkv = torch.randn(bs, n, 3, h, d, device="cuda", dtype=dtype)
    q, kk, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views, no copy
    assert q.stride(-1) == 1 and not q.is_contiguous()
    out_buf = torch.full((bs, n, h, 2 * d), float("nan"), device="cuda", dtype=dtype)
    out = out_buf[..., :d].transpose(1, 2)
    factor = 2.0 if k["accum"] == 32 else ACC16_FACTOR
    for causal in (False, True):
        _run(b, name, q, kk, v, causal, scale=0.3, layout_out=out)
        assert_close_to_reference(out, q, kk, v, causal=causal, scale=0.3, factor=factor,
                                  what=f"{name} strided causal={causal}")
        if k["accum"] == 16:
            _check_acc16_rel(out, q, kk, v, causal, 0.3, f"{name} strided causal={causal}")
    assert torch.isnan(out_buf[..., d:]).all(), "wrote outside the output view"


#: packed batches for the family 90 forward: (query lengths, key lengths, heads_q, heads_kv);
#: odd lengths, an empty sequence, a sequence with queries and no key, queries past the keys
#: and keys past the queries (causal rows that see no key), GQA 4:1 and MQA
VARLEN_CASES = [
    ([1, 17, 1000, 0, 4097, 128], [1, 17, 1000, 0, 4097, 128], 4, 4),
    ([5, 300, 64, 9], [700, 3, 64, 0], 8, 2),
    ([333, 1], [129, 2048], 3, 1),
]


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", [n for n in KERNELS if n.startswith("fwd_sm90_")])
def test_sm90_packed_sequences_match_float64_reference(name):
    """Every family 90 forward on packed (total, H, D) batches, each sequence against the
    float64 reference with the 2x rule, the log-sum-exp (heads_q, total_q) included; a repeat
    run is bit-identical; the public call with the backend forced gives the same."""
    import sparktune

    b, k, dtype, d = _runnable(name)
    for lq, lk, hq, hk in VARLEN_CASES:
        cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype)
        kk = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype)
        v = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype)
        for causal in (False, True):
            runs = []
            for _ in range(2):
                out = torch.full_like(q, float("nan"))
                lse = b.forward(q, kk, v, out, config=name, causal=causal, scale=d**-0.5,
                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                                max_seqlen_k=max(lk))
                runs.append((out, lse))
            torch.cuda.synchronize()
            (out, lse), (out2, lse2) = runs
            what = f"{name} {lq} {lk} {hq}/{hk} causal={causal}"
            assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{what}: results moved between runs"
            assert tuple(lse.shape) == (hq, sum(lq))
            for s in range(len(lq)):
                q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
                if q1 == q0:
                    continue
                if k1 == k0:  # no key: zeros and -inf
                    assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1])), what
                    assert torch.isneginf(lse[:, q0:q1]).all(), what
                    continue
                view = lambda t, a, z: t[a:z].transpose(0, 1).unsqueeze(0)  # noqa: E731
                assert_close_to_reference(view(out, q0, q1), view(q, q0, q1), view(kk, k0, k1),
                                          view(v, k0, k1), causal=causal,
                                          lse=lse[:, q0:q1].unsqueeze(0), what=f"{what} seq {s}")
            api = sparktune.varlen_attention(q, kk, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                             backend="spark", config=name)
            assert torch.equal(api, out), f"{what}: the public call differs"


@pytest.mark.gpu
@needs_ext
def test_packed_training_call_on_hopper_matches_float64_reference():
    """A packed causal call with gradients and no backend forced, on sm_90: dispatch runs the
    sm90 forward and the sm90 backward (HOPPER_VARLEN_ORDER), the backward from the forward's
    output and log-sum-exp; out, dq, dk, dv against float64 autograd, within twice the error of
    the same call run by the Triton family alone (plus 1e-5)."""
    import importlib

    import sparktune
    from sparktune import dispatch
    from tests._features_oracle import varlen_oracle

    _resolve = importlib.import_module("sparktune.dispatch._resolve")

    dev = DeviceInfo.from_torch("cuda")
    if dev.arch != 90 or "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1" not in KERNELS:
        pytest.skip("needs sm_90 and fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1 (the default)")
    bwd_default = "bwd_sm90_bf16_d128_m64n128_s2"
    if bwd_default not in [k["name"] for k in _C.kernels()]:
        pytest.skip(f"needs {bwd_default} (the default)")
    lq, hq, hk, d = [300, 1, 1000, 0, 513], 8, 2, 128
    cu = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    p = Problem("fwd", "bfloat16", len(lq), hq, hk, max(lq), max(lq), d, True, False, varlen=True,
                total_q=sum(lq), total_k=sum(lq))
    assert _resolve.default_order(dev, p) == _resolve.HOPPER_VARLEN_ORDER
    for op, family in (("fwd", "fwd_sm90_"), ("bwd", "bwd_sm90_")):
        chosen = dispatch.select(p.replace(op=op), dev).candidate
        assert chosen.backend == "spark" and chosen.config.startswith(family), (op, chosen)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (hq, hk, hk))
    dout = torch.randn(sum(lq), hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparktune.varlen_attention(*leaves, cu, cu, max(lq), max(lq), causal=True,
                                         backend=backend)
        out.backward(dout)
        return [out.detach(), *(t.grad for t in leaves)]

    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = varlen_oracle(*leaves, cu.cpu(), cu.cpu(), causal=True)
    ref_out.backward(dout.cpu().double())
    ref = [ref_out.detach(), *(t.grad for t in leaves)]
    ours, triton = run(None), run("triton")
    for name, a, t, r in zip(("out", "dq", "dk", "dv"), ours, triton, ref, strict=True):
        err = float((a.cpu().double() - r).abs().max())
        base = float((t.cpu().double() - r).abs().max())
        assert err <= 2 * base + 1e-5, f"{name}: error {err:.3g} > 2 x {base:.3g} (Triton alone)"
