"""The spark backward family: the declared space and its rules, capabilities, and on a GPU the
gradients of every compiled backward kernel against float64 autograd."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparktune.backends.reference import reference_attention
from sparktune.backends.spark import SparkBackend, load_extension
from sparktune.kernels.kernel_space import (
    BwdEntry,
    backward_space,
    forward_space,
    full_space,
    select,
)
from sparktune.problem import DeviceInfo, Problem
from tests._oracle import assert_grads_close_to_reference
from tests.test_spark import ACC16_FACTOR, DTYPES, SHAPES, _cutlass_include, needs_ext

ROOT = Path(__file__).resolve().parent.parent

_C, _C_ERR = load_extension()
KERNELS = [k["name"] for k in _C.kernels() if k["op"] == "bwd"] if _C is not None else []


# ---------------------------------------------------------------- CPU: the declared space
def test_backward_names_are_unique_and_encode_their_parameters():
    every = backward_space()
    names = [e.name for e in full_space()]
    assert len(names) == len(set(names)) == len(forward_space()) + len(every)
    assert select(full_space(), "bwd_*") == every
    # the mma.sync families (the Hopper backward is tests/test_check_sm90.py's)
    entries = [e for e in every if isinstance(e, BwdEntry)]
    e = next(e for e in entries if e.name == "bwd_sm80_f16_d128_m128n64_w8x1_acc32")
    assert (e.family, e.dtype, e.head_dim, e.block_m, e.block_n) == (80, "f16", 128, 128, 64)
    assert (e.warps_m, e.warps_n, e.accum) == (8, 1, 32)
    assert e.register_fn == "register_bwd" and e.launch_header.endswith("bwd_launch.h")
    # fp16 and fp32 accumulation on both atoms; bf16 only on m16n8k16
    assert {(e.family, e.accum) for e in entries} == {(70, 32), (70, 16), (80, 32), (80, 16)}
    assert not [e for e in entries if e.dtype == "bf16" and (e.family == 70 or e.accum == 16)]
    assert {32, 64, 128} <= {e.head_dim for e in entries if e.family == 80}
    assert {32, 64, 128} <= {e.head_dim for e in entries if e.family == 70}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.skipif(_cutlass_include() is None, reason="needs the nvidia-cutlass headers")
def test_generator_emits_backward_kernels_with_their_template(tmp_path):
    """Every declared backward entry passes the C++ rules, and the generator writes it with the
    backward launch header and registration template."""
    subprocess.run(
        [sys.executable, str(ROOT / "csrc" / "gen_kernels.py"), "--out", str(tmp_path), "--nvcc", "nvcc",
         "--include", _cutlass_include(), "--include", str(ROOT / "csrc" / "include"),
         "--filter", "bwd_*,fwd_sm80_f16_d64_m128n64_w4x1_acc32_preg"],
        check=True, capture_output=True, text=True,
    )
    rows = {r.split("\t")[0]: r.split("\t") for r in (tmp_path / "space.tsv").read_text().splitlines()}
    for e in backward_space():
        if not isinstance(e, BwdEntry):
            continue  # family 90 is not generated here (--families 70,80)
        assert rows[e.name][1] == "1", f"{e.name} excluded: {rows[e.name][4]}"
        src = (tmp_path / f"{e.name}.cu").read_text()
        assert '#include "sparktune/bwd_launch.h"' in src and "register_bwd<BwdConfig<" in src
    fwd = (tmp_path / "fwd_sm80_f16_d64_m128n64_w4x1_acc32_preg.cu").read_text()
    assert "register_fwd<FwdConfig<" in fwd
    volta = rows["bwd_sm70_f16_d128_m64n32_w2x4_acc32"]
    assert int(volta[2]) <= 96 * 1024


# ---------------------------------------------------------------- CPU: capabilities
def test_backward_without_gpu_says_why():
    b = SparkBackend()
    p = Problem("bwd", "float16", 1, 2, 2, 16, 16, 64, False)
    reasons = b.not_supported_reasons(p, None, None)
    assert reasons and ("CPU" in reasons[0] or "not installed" in reasons[0] or "GPU" in reasons[0])


@needs_ext
def test_a_kernel_of_the_other_op_is_refused_by_name():
    b = SparkBackend()
    if b.unavailable_reasons():
        pytest.skip("; ".join(b.unavailable_reasons()))
    fwd = [n for n in b.configs("fwd")]
    if not KERNELS or not fwd:
        pytest.skip("needs a compiled fwd and bwd kernel")
    k = b.kernel_info(KERNELS[0])
    dev = DeviceInfo("fake", (k["min_arch"] // 10, k["min_arch"] % 10), 1)
    p = Problem("fwd", k["dtype"], 1, 1, 1, 8, 8, k["head_dim"], False)
    assert "bwd kernel" in " ".join(b.not_supported_reasons(p, KERNELS[0], dev))
    assert "fwd kernel" in " ".join(b.not_supported_reasons(p.replace(op="bwd"), fwd[0], dev))


# ---------------------------------------------------------------- GPU: every compiled kernel
def _runnable(b: SparkBackend, name: str) -> tuple[dict, torch.dtype, int, float]:
    k = b.kernel_info(name)
    dev = DeviceInfo.from_torch("cuda")
    if dev.arch < k["min_arch"] or dev.arch not in (k.get("archs") or b.build_info()["archs"]):
        pytest.skip(f"{name} not runnable on sm_{dev.arch}")
    factor = 2.0 if k["accum"] == 32 else ACC16_FACTOR
    return k, DTYPES[k["dtype"]], k["head_dim"], factor


def _acc16_floor(name, b, dout, q, k, v, causal, scale) -> float:
    """The absolute floor of the error rule: 1e-5 for fp32 accumulation. With fp16 accumulation,
    dP = dO V^T is rounded to 11 bits before D = rowsum(dO * O) (fp32) is subtracted, so even a
    gradient whose exact value is 0 (one key: dq = dk = 0) carries an error of the order of
    eps16 times the gradients' natural size; PyTorch's own error there is 0, so the 16x factor
    alone would demand exactness. Two sizes bound it:
    - max |dv| (dv = P^T dO), measured on an H200 at 0.0019 with one key and |dv| up to 3;
    - scale * max |dP| * max(|q|, |k|): dS = P (dP - D) carries eps16 * |dP| per element, and
      dq = scale * dS K sums it with weights P that add up to 1 per row. This one grows with
      the head dim (|dP| ~ sqrt(head_dim)): with one key at hd 128 the H200 measured 0.0066,
      above eps16 * max |dv| = 0.0038."""
    if b.kernel_info(name)["accum"] != 16:
        return 1e-5
    from sparktune.backends.reference import reference_attention_backward

    _, _, dv = reference_attention_backward(dout, q, k, v, causal=causal, scale=scale)
    group = q.shape[1] // v.shape[1]
    v_q = v.double().repeat_interleave(group, dim=1)
    dp = dout.double() @ v_q.transpose(-1, -2)
    sizes = max(float(dv.abs().max()),
                scale * float(dp.abs().max()) * max(float(q.abs().max()), float(k.abs().max())))
    return float(torch.finfo(q.dtype).eps * sizes) + 1e-5


def _forward(q, k, v, causal, scale):
    """The forward's output (rounded to the input dtype) and float32 log-sum-exp, from float64."""
    out, lse = reference_attention(q, k, v, causal=causal, scale=scale)
    return out.to(q.dtype), lse.float()


def _backward(b, name, dout, q, k, v, out, lse, causal, scale, grads=None):
    if grads is None:
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    b.backward(dout, q, k, v, out, lse, *grads, config=name, causal=causal, scale=scale)
    torch.cuda.synchronize()
    return grads


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_gradients_match_float64_reference(name):
    """dq, dk, dv within the 2x rule (fp32 accumulation; ACC16_FACTOR for fp16) on the odd
    shapes; a second run on the same inputs gives the same dk and dv bits and a dq that differs
    by rounding at most (its fp32 sums are added in a different order), never by a race."""
    b = SparkBackend()
    _, dtype, d, factor = _runnable(b, name)
    eps = torch.finfo(dtype).eps
    results = []
    for (bs, hq, hk, nq, nk, causal) in SHAPES:
        shape = (bs, hq, hk, nq, nk, causal)
        scale = d ** -0.5
        q = torch.randn(bs, hq, nq, d, device="cuda", dtype=dtype)
        k = torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype)
        v = torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype)
        dout = torch.randn(bs, hq, nq, d, device="cuda", dtype=dtype)
        out, lse = _forward(q, k, v, causal, scale)
        grads = _backward(b, name, dout, q, k, v, out, lse, causal, scale)
        for g, what in zip(grads, ("dq", "dk", "dv"), strict=True):
            assert not torch.isnan(g).any(), f"{name}: unwritten or NaN {what} at {shape}"
        floor = _acc16_floor(name, b, dout, q, k, v, causal, scale)
        tols = assert_grads_close_to_reference(grads, q, k, v, dout, causal=causal, scale=scale,
                                               factor=factor, floor=floor, what=f"{name} {shape}")
        results += tols
        again = _backward(b, name, dout, q, k, v, out, lse, causal, scale)
        assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), (
            f"{name}: dk/dv moved between runs at {shape}"
        )
        dq_move = float((grads[0].float() - again[0].float()).abs().max())
        dq_size = float(grads[0].float().abs().max())
        assert dq_move <= 2 * eps * dq_size + 1e-6, (
            f"{name}: dq moved by {dq_move:.3g} between runs at {shape} (|dq| up to {dq_size:.3g})"
        )
        again_tols = assert_grads_close_to_reference(again, q, k, v, dout, causal=causal,
                                                     scale=scale, factor=factor, floor=floor)
        assert abs(again_tols[0].error - tols[0].error) <= 2 * eps * dq_size + 1e-6
    print("\n".join(str(t) for t in results))


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_strided_layouts_and_scale(name):
    """(B, N, H, D) views of a packed qkv tensor, dout and o with row strides of their own, and
    gradients written into slices of larger buffers, with a custom scale; nothing outside the
    gradient views is touched."""
    b = SparkBackend()
    _, dtype, d, factor = _runnable(b, name)
    bs, n, h = 2, 333, 3
    qkv = torch.randn(bs, n, 3, h, d, device="cuda", dtype=dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert q.stride(-1) == 1 and not q.is_contiguous()
    dout = torch.randn(bs, n, h, 2 * d, device="cuda", dtype=dtype)[..., d:].transpose(1, 2)
    for causal in (False, True):
        out, lse = _forward(q, k, v, causal, 0.3)
        out = torch.empty(bs, h, n, 2 * d, device="cuda", dtype=dtype)[..., :d].copy_(out)
        bufs = [torch.full((bs, n, h, 2 * d), float("nan"), device="cuda", dtype=dtype) for _ in range(3)]
        grads = tuple(buf[..., :d].transpose(1, 2) for buf in bufs)
        _backward(b, name, dout, q, k, v, out, lse, causal, 0.3, grads=grads)
        floor = _acc16_floor(name, b, dout, q, k, v, causal, 0.3)
        assert_grads_close_to_reference(grads, q, k, v, dout, causal=causal, scale=0.3,
                                        factor=factor, floor=floor, what=f"{name} strided causal={causal}")
        for buf in bufs:
            assert torch.isnan(buf[..., d:]).all(), "wrote outside the gradient views"


@pytest.mark.gpu
@needs_ext
def test_default_backward_config_is_compiled_and_runs():
    b = SparkBackend()
    if not KERNELS:
        pytest.skip("no bwd kernel compiled")
    dev = DeviceInfo.from_torch("cuda")
    k = b.kernel_info(KERNELS[0])
    p = Problem("bwd", k["dtype"], 1, 2, 2, 100, 100, k["head_dim"], True)
    name = b.default_config(p, dev)
    if name is None:
        pytest.skip("; ".join(b.not_supported_reasons(p, None, dev)))
    assert name.startswith("bwd_") and not b.not_supported_reasons(p, name, dev)
