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


def _forward(q, k, v, causal, scale, **features):
    """The forward's output (rounded to the input dtype) and float32 log-sum-exp, from float64."""
    out, lse = reference_attention(q, k, v, causal=causal, scale=scale, **features)
    return out.to(q.dtype), lse.float()


def _backward(b, name, dout, q, k, v, out, lse, causal, scale, grads=None, **options):
    """``options``: the backend's backward keywords (deterministic, window, ...)."""
    if grads is None:
        grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    b.backward(dout, q, k, v, out, lse, *grads, config=name, causal=causal, scale=scale, **options)
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


# ---------------------------------------------------------------- packed sequences (varlen)
I32 = torch.int32
SM90_PACKED = "bwd_sm90_f16_d64_m64n128_s2"  # (a name: the CPU checks below never launch it)


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=I32, device=device)


def _packed_args(device="cpu", dtype=torch.float16, d=64, **changes):
    """A valid packed backward call of two sequences (4 and 6 queries, 5 and 7 keys; 4 query
    heads, 2 kv heads), with ``changes`` applied to its arguments."""
    lq, lk, hq, hk = [4, 6], [5, 7], 4, 2
    q = torch.randn(sum(lq), hq, d, device=device, dtype=dtype)
    k = torch.randn(sum(lk), hk, d, device=device, dtype=dtype)
    args = dict(
        dout=torch.randn_like(q), q=q, k=k, v=torch.randn_like(k), out=torch.randn_like(q),
        lse=torch.randn(hq, sum(lq), device=device), dq=torch.empty_like(q),
        dk=torch.empty_like(k), dv=torch.empty_like(k), config=SM90_PACKED, causal=True,
        scale=d ** -0.5, cu_seqlens_q=_cu(lq, device), cu_seqlens_k=_cu(lk, device),
        max_seqlen_q=max(lq), max_seqlen_k=max(lk),
    )  # fmt: skip
    args.update(changes)
    return args


def _call(b, args):
    args = dict(args)
    pos = [args.pop(n) for n in ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")]
    return b.backward(*pos, **args)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(config="bwd_sm80_f16_d64_m128n64_w8x1_acc32"),
         r"packed sequences run on the family 90 kernels only \(bwd_sm90_\*"),
        (dict(q=torch.zeros(1, 10, 4, 64, dtype=torch.float16)),
         r"packed sequences need \(total, heads, head_dim\) tensors: q has shape \(1, 10, 4, 64\)"),
        (dict(lse=torch.zeros(1, 4, 10)), r"lse must be float32 of shape \(4, 10\)"),
        (dict(lse=torch.zeros(4, 10, dtype=torch.float64)), r"lse must be float32 of shape \(4, 10\)"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 12])), r"cu_seqlens_k must be a contiguous 1-d int32 tensor"),
        (dict(max_seqlen_q=None), r"varlen needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k"),
        (dict(cu_seqlens_k=None), r"varlen needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k"),
        (dict(max_seqlen_k=6), r"max_seqlen_k \(6\) is smaller than the longest sequence \(7\)"),
        (dict(cu_seqlens_q=_cu([4, 5])), r"the last entry of cu_seqlens_q \(9\) must be the number of packed tokens \(10\)"),
        (dict(cu_seqlens_q=_cu([4, 6, 0])), r"cu_seqlens_q \(4,\) and cu_seqlens_k \(3,\) must have the same length"),
        (dict(dropout_p=0.1), r"runs packed sequences, deterministic mode, sliding windows, softcap and ALiBi, not \['dropout_p'\]"),
        (dict(window=(2, 2), config="bwd_sm80_f16_d64_m128n64_w8x1_acc32"),
         r"sliding windows, softcap and ALiBi run on the family 90 backward only \(bwd_sm90_\*\)"),
        (dict(window=(-2, 2)), r"window sides must be >= 0, or -1 for unlimited, got \(-2, 2\)"),
        (dict(softcap=-1.0), r"softcap must be finite and >= 0"),
        (dict(alibi_slopes=torch.zeros(3)), r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(3,\)"),
        (dict(dk=torch.empty(12, 4, 64, dtype=torch.float16)), r"dk has shape \(12, 4, 64\), expected \(12, 2, 64\)"),
        (dict(v=torch.zeros(12, 2, 32, dtype=torch.float16)), r"k and v must be \(total_k, heads_kv, 64\) alike"),
        (dict(dq=torch.empty(10, 4, 64, dtype=torch.bfloat16)), r"dq is torch.bfloat16 on cpu, q is torch.float16"),
        (dict(out=torch.zeros(10, 4, 72, dtype=torch.float16)[..., 4:68]),
         r"16-byte aligned rows: out's data pointer"),
        (dict(dout=torch.zeros(10, 4, 68, dtype=torch.float16)[..., :64]),
         r"16-byte aligned rows: dout's data pointer and its batch, head and row strides"),
        (dict(scale=0.0), r"scale must be a finite positive number"),
        ({}, r"spark kernels need CUDA tensors, the inputs are on cpu"),
    ],
)
def test_packed_backward_arguments_say_what_is_wrong(changes, match):
    """The packed backward's checks, all before the compiled module is reached (no GPU or
    extension needed): the kernel family, the (total, H, D) shapes, the (Hq, total_q)
    log-sum-exp, the boundaries as the forward takes them and their values as
    varlen_attention checks them, the features, dtypes, alignment; valid CPU tensors are
    refused last."""
    with pytest.raises(ValueError, match=match):
        _call(SparkBackend(), _packed_args(**changes))


def test_packed_backward_with_no_query_or_no_key_writes_zeros():
    """No key at all (or no query at all): every gradient is 0, written without a launch."""
    hq, hk, d = 4, 2, 64  # (as _packed_args)
    b = SparkBackend()
    for lk in ([0, 0], None):
        if lk is None:  # no query: total_q 0, the keys of both sequences see nothing
            args = _packed_args()
            q = torch.zeros(0, hq, d, dtype=torch.float16)
            args.update(q=q, out=q.clone(), dout=q.clone(), dq=q.clone(), lse=torch.zeros(hq, 0),
                        cu_seqlens_q=_cu([0, 0]), max_seqlen_q=0)
        else:
            k = torch.zeros(0, hk, d, dtype=torch.float16)
            args = _packed_args(k=k, v=k.clone(), dk=k.clone(), dv=k.clone(),
                                cu_seqlens_k=_cu(lk), max_seqlen_k=0)
        for g in ("dq", "dk", "dv"):
            args[g].fill_(float("nan"))
        _call(b, args)
        for g in ("dq", "dk", "dv"):
            assert torch.equal(args[g], torch.zeros_like(args[g])), g
    # a max length 0 while a sequence has keys is a wrong max length, not an empty batch
    with pytest.raises(ValueError, match=r"max_seqlen_k \(0\) is smaller than the longest sequence \(7\)"):
        _call(b, _packed_args(max_seqlen_k=0))


#: packed batches for the family 90 backward: (query lengths, key lengths, heads_q, heads_kv).
#: Odd lengths whose sequences start anywhere in a tile, an empty sequence, a sequence with
#: queries and no key and one with keys and no query, seqlen_q != seqlen_k both ways (causal
#: rows that see no key), several key blocks per sequence (4097 keys), GQA 4:1, 3:1 (MQA).
VARLEN_CASES = [
    ([1, 17, 1000, 0, 4097, 129], [1, 17, 1000, 0, 4097, 129], 4, 4),
    ([5, 300, 64, 9, 0, 200], [700, 3, 64, 0, 33, 200], 8, 2),
    ([333, 1], [129, 2048], 3, 1),
]
SM90_KERNELS = [n for n in KERNELS if n.startswith("bwd_sm90_")]


def _packed_problem(dtype, d, lq, lk, hq, hk, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, dout, _cu(lq, "cuda"), _cu(lk, "cuda")


def _packed_backward(b, name, dout, q, k, v, out, lse, cu_q, cu_k, lq, lk, causal, deterministic,
                     scale=None):
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b.backward(dout, q, k, v, out, lse, *grads, config=name, causal=causal, scale=scale,
               deterministic=deterministic, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
               max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    torch.cuda.synchronize()
    return grads


def _check_packed_grads(grads, q, k, v, dout, lq, lk, causal, what) -> list:
    """Every element written; per sequence dq, dk, dv within the 2x rule against float64
    autograd of that sequence alone (a sequence's rows as a (1, H, n, D) view); the rows of a
    sequence with no key (dq) or no query (dk, dv) exactly 0."""
    for g, gname in zip(grads, ("dq", "dk", "dv"), strict=True):
        assert not torch.isnan(g).any(), f"{what}: unwritten or NaN {gname}"
    view = lambda t, a, z: t[a:z].transpose(0, 1).unsqueeze(0)  # noqa: E731
    scale = q.shape[-1] ** -0.5
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    tols = []
    for s in range(len(lq)):
        q0, q1, k0, k1 = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if q1 == q0 or k1 == k0:  # nothing to see or nobody looking: zero gradients
            for g, a, z, gname in ((grads[0], q0, q1, "dq"), (grads[1], k0, k1, "dk"), (grads[2], k0, k1, "dv")):
                assert torch.equal(g[a:z], torch.zeros_like(g[a:z])), f"{what} seq {s}: {gname} not 0"
            continue
        seq = (view(grads[0], q0, q1), view(grads[1], k0, k1), view(grads[2], k0, k1))
        tols += assert_grads_close_to_reference(
            seq, view(q, q0, q1), view(k, k0, k1), view(v, k0, k1), view(dout, q0, q1),
            causal=causal, scale=scale, what=f"{what} seq {s} ({q1 - q0}/{k1 - k0})")
    return tols


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", SM90_KERNELS)
def test_sm90_packed_gradients_match_float64_reference(name):
    """Every family 90 backward on packed (total, H, D) batches (VARLEN_CASES), causal and
    not, from the float64 forward's output (rounded to the input dtype) and (Hq, total_q)
    log-sum-exp: each sequence's dq, dk, dv within the 2x rule (:func:`_check_packed_grads`);
    a second run gives the same dk and dv bits and a dq that differs by rounding at most."""
    from sparktune.backends.reference import reference_attention

    b = SparkBackend()
    _, dtype, d, _ = _runnable(b, name)  # (skips where the GPU is not sm_90)
    eps = torch.finfo(dtype).eps
    results = []
    for i, (lq, lk, hq, hk) in enumerate(VARLEN_CASES):
        q, k, v, dout, cu_q, cu_k = _packed_problem(dtype, d, lq, lk, hq, hk, seed=i)
        for causal in (False, True):
            what = f"{name} {lq} {lk} {hq}/{hk} causal={causal}"
            out, lse = reference_attention(q, k, v, causal, d ** -0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            out, lse = out.to(dtype), lse.float()
            assert tuple(lse.shape) == (hq, sum(lq))
            args = (b, name, dout, q, k, v, out, lse, cu_q, cu_k, lq, lk, causal)
            grads = _packed_backward(*args, False)
            results += _check_packed_grads(grads, q, k, v, dout, lq, lk, causal, what)
            again = _packed_backward(*args, False)
            assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2]), (
                f"{what}: dk/dv moved between runs"
            )
            dq_move = float((grads[0].float() - again[0].float()).abs().max())
            dq_size = float(grads[0].float().abs().max())
            assert dq_move <= 2 * eps * dq_size + 1e-6, f"{what}: dq moved by {dq_move:.3g} between runs"
    print("\n".join(str(t) for t in results))


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", SM90_KERNELS)
def test_sm90_packed_deterministic_gradients_are_repeatable(name):
    """The deterministic mode on packed batches: three runs give the same dq, dk and dv (the
    dQ counters per sequence, query head and row block; the tiles' rows past a sequence add
    only zeros to the next one's rows), within the 2x rule as well."""
    from sparktune.backends.reference import reference_attention

    b = SparkBackend()
    _, dtype, d, _ = _runnable(b, name)  # (skips where the GPU is not sm_90)
    for i, (lq, lk, hq, hk) in enumerate(VARLEN_CASES):
        q, k, v, dout, cu_q, cu_k = _packed_problem(dtype, d, lq, lk, hq, hk, seed=10 + i)
        for causal in (False, True):
            what = f"{name} deterministic {lq} {lk} {hq}/{hk} causal={causal}"
            out, lse = reference_attention(q, k, v, causal, d ** -0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
            args = (b, name, dout, q, k, v, out.to(dtype), lse.float(), cu_q, cu_k, lq, lk, causal)
            runs = [_packed_backward(*args, True) for _ in range(3)]
            _check_packed_grads(runs[0], q, k, v, dout, lq, lk, causal, what)
            for r in runs[1:]:
                for g0, g, gname in zip(runs[0], r, ("dq", "dk", "dv"), strict=True):
                    assert torch.equal(g0, g), f"{what}: {gname} differs between deterministic runs"


@pytest.mark.gpu
@needs_ext
def test_packed_training_call_forced_to_spark_runs_the_sm90_backward():
    """``varlen_attention(..., backend="spark")`` with gradients on sm_90 (GQA, causal,
    deterministic): the sm90 forward, then the backward on the family 90 kernel dispatch
    chooses for the packed "bwd" problem, from that forward's output and log-sum-exp: the
    same gradients, bit for bit, as that backward called directly on them."""
    import sparktune
    from sparktune import dispatch

    dev = DeviceInfo.from_torch("cuda")
    if dev.arch != 90:
        pytest.skip("needs sm_90")
    b = SparkBackend()
    lq, lk, hq, hk, d = [300, 1, 1000, 0, 513], [200, 7, 1000, 5, 513], 8, 2, 128
    scale = 0.1  # given to both calls (the same float)
    ran = []
    for dtype in (torch.bfloat16, torch.float16):
        tag = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
        if not any(n.startswith(f"bwd_sm90_{tag}_d{d}_") for n in SM90_KERNELS) or not any(
            n.startswith(f"fwd_sm90_{tag}_d{d}_") for n in b.configs("fwd")
        ):
            continue
        q, k, v, dout, cu_q, cu_k = _packed_problem(dtype, d, lq, lk, hq, hk, seed=7)
        p = Problem("bwd", {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], len(lq), hq,
                    hk, max(lq), max(lk), d, True, False, deterministic=True, varlen=True,
                    total_q=sum(lq), total_k=sum(lk))
        config = dispatch.select(p, dev, backend="spark").candidate.config
        assert config.startswith("bwd_sm90_"), config
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = sparktune.varlen_attention(*leaves, cu_q, cu_k, max(lq), max(lk), causal=True,
                                              scale=scale, deterministic=True, backend="spark",
                                              return_lse=True)
        out.backward(dout)
        direct = _packed_backward(b, config, dout, q, k, v, out.detach(), lse, cu_q, cu_k, lq, lk,
                                  True, True, scale=scale)
        for leaf, g, gname in zip(leaves, direct, ("dq", "dk", "dv"), strict=True):
            assert not torch.isnan(g).any(), f"{tag} {gname}: unwritten or NaN"
            assert torch.equal(leaf.grad, g), f"{tag} {gname}: the training call differs from {config}"
        ran.append(tag)
    if not ran:
        pytest.skip(f"needs an sm90 forward and backward of head dim {d} (fp16 or bf16)")


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", SM90_KERNELS)
def test_sm90_backward_block_orders_give_the_same_gradients(name, monkeypatch):
    """The family 90 backward's causal and windowed launches take their blocks in sections of
    (kv head, batch) pairs whose size follows an L2 budget (SPARKTUNE_SM90_BWD_L2_MB, read at
    each launch; 0: one pair after another): budgets that give sections of 1, 3, 4 (the last
    section short) and all 9 pairs of a GQA problem, and the default (unset: a grid of at most
    two waves is one section), give bit-identical gradients in
    deterministic mode (each dQ sum in its fixed order, dk and dv of each key block alone), the
    same dk and dv bits and a dq within rounding in the default mode, within the 2x rule of
    float64 autograd."""
    b = SparkBackend()
    _, dtype, d, _ = _runnable(b, name)  # (skips where the GPU is not sm_90)
    eps = torch.finfo(dtype).eps
    # the group split changes how dk and dv are summed: kept off here (its own test below)
    monkeypatch.setenv("SPARKTUNE_SM90_BWD_GROUP_SPLIT", "1")
    bs, hq, hk, n = 3, 6, 3, 1000
    pair_mb = (hq // hk) * n * d * (2 * 2 + 4) / 2**20  # Q, dO and the fp32 dQ workspace
    # 1, 3, 4, 9 pairs; "" the default (9 pairs x 8 key blocks fit two waves: one section)
    budgets = ["0", str(int(3 * pair_mb) + 1), str(int(4 * pair_mb) + 1), "100000", ""]
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, dout = (torch.randn(bs, h, n, d, device="cuda", dtype=dtype, generator=gen)
                     for h in (hq, hk, hk, hq))
    scale = d ** -0.5
    for causal, window in ((True, None), (False, (300, 40))):
        kw = {"window": window} if window else {}
        out, lse = _forward(q, k, v, causal, scale, **kw)
        runs = {}
        for det in (True, False):
            for mb in budgets:
                if mb:
                    monkeypatch.setenv("SPARKTUNE_SM90_BWD_L2_MB", mb)
                else:
                    monkeypatch.delenv("SPARKTUNE_SM90_BWD_L2_MB", raising=False)
                runs[det, mb] = _backward(b, name, dout, q, k, v, out, lse, causal, scale,
                                          deterministic=det, **kw)
        what = f"{name} causal={causal} window={window}"
        first = runs[True, "0"]
        if not window:
            assert_grads_close_to_reference(first, q, k, v, dout, causal=causal, scale=scale, what=what)
        for (det, mb), grads in runs.items():
            for g0, g, gname in zip(first, grads, ("dq", "dk", "dv"), strict=True):
                assert not torch.isnan(g).any(), f"{what} budget {mb} MB: unwritten or NaN {gname}"
                if det or gname != "dq":
                    assert torch.equal(g0, g), f"{what} det={det} budget {mb} MB: {gname} differs"
                else:
                    move = float((g0.float() - g.float()).abs().max())
                    assert move <= 2 * eps * float(g0.float().abs().max()) + 1e-6, (
                        f"{what} budget {mb} MB: dq moved by {move:.3g}")


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", SM90_KERNELS)
def test_sm90_backward_group_split_gives_the_same_gradients(name, monkeypatch):
    """The group split (sparktune.kernels.sm90_bwd_split; SPARKTUNE_SM90_BWD_GROUP_SPLIT, read
    at each call): a GQA 8:2 problem's groups walked by 1, 2 and 4 blocks each, and the rule's
    own choice ("rule": this small grid splits), causal, non-causal and a sliding window. Each
    within the 2x rule of float64 autograd; dk and dv of the splits within a few roundings of
    the unsplit ones (their fp32 parts are added in another order); in deterministic mode dq's
    bits the same whatever the split (each row block's sum in the same key-block order) and
    every split's three gradients the same bits on a second run."""
    from sparktune.kernels.sm90_bwd_split import group_split

    b = SparkBackend()
    k_info, dtype, d, _ = _runnable(b, name)  # (skips where the GPU is not sm_90)
    eps = torch.finfo(dtype).eps
    bs, hq, hk, n = 2, 8, 2, 777
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    monkeypatch.delenv("SPARKTUNE_SM90_BWD_GROUP_SPLIT", raising=False)
    chosen = group_split(bs, hk, hq // hk, n, n, k_info["block_m"], k_info["block_n"], d, 2, True,
                         None, sms, environ={"SPARKTUNE_SM90_BWD_GROUP_SPLIT": "rule"})
    assert chosen > 1, f"the rule no longer splits this problem ({chosen}): pick another"
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(bs, h, n, d, device="cuda", dtype=dtype, generator=gen)
                     for h in (hq, hk, hk, hq))
    scale = d ** -0.5
    for causal, window in ((True, None), (False, None), (False, (200, 30))):
        kw = {"window": window} if window else {}
        out, lse = _forward(q, k, v, causal, scale, **kw)
        what = f"{name} causal={causal} window={window}"
        runs = {}
        for split in ("1", "2", "4", "rule"):
            monkeypatch.setenv("SPARKTUNE_SM90_BWD_GROUP_SPLIT", split)
            for det in (True, False):
                runs[split, det] = _backward(b, name, dout, q, k, v, out, lse, causal, scale,
                                             deterministic=det, **kw)
            again = _backward(b, name, dout, q, k, v, out, lse, causal, scale,
                              deterministic=True, **kw)
            for g0, g, gname in zip(runs[split, True], again, ("dq", "dk", "dv"), strict=True):
                assert torch.equal(g0, g), f"{what} split {split}: {gname} moved"
            if not window:
                assert_grads_close_to_reference(runs[split, False], q, k, v, dout, causal=causal,
                                                scale=scale, what=f"{what} split {split}")
        base = runs["1", True]
        for (split, det), grads in runs.items():
            for g0, g, gname in zip(base, grads, ("dq", "dk", "dv"), strict=True):
                assert not torch.isnan(g).any(), f"{what} split {split}: unwritten or NaN {gname}"
                if det and gname == "dq":
                    assert torch.equal(g0, g), f"{what} split {split}: deterministic dq differs"
                    continue
                move = float((g0.float() - g.float()).abs().max())
                assert move <= 4 * eps * float(g0.float().abs().max()) + 1e-6, (
                    f"{what} split {split} det={det}: {gname} moved by {move:.3g}")
