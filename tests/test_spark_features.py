"""Sliding windows, soft-capping and ALiBi on the Hopper forward (``fwd_sm90_*``,
docs/FEATURES.md): on the CPU, what the spark backend passes to the compiled module (a stand-in
records the calls) and what it refuses; on an sm_90 GPU, every compiled family 90 forward against
attention in float64 with the same features (sparktune's reference math), with FlashAttention's
rule (max abs error at most twice PyTorch's own error in the inputs' dtype, plus 1e-5; PyTorch's
own error from the definitions in tests/_features_baseline.py), the log-sum-exp included (-inf
exactly where a row sees no key), dense and packed, a repeat run bit-identical, and a training
call that runs this forward with the Triton family's backward."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import zlib

import pytest
import torch

from sparktune.backends import spark
from sparktune.backends.spark import SparkBackend, load_extension
from sparktune.dtypes import TORCH_DTYPES
from sparktune.kernels.kernel_space import is_persistent_sm90_fwd
from sparktune.problem import DeviceInfo, Problem

_C, _C_ERR = load_extension()
KERNELS90 = sorted(k["name"] for k in _C.kernels() if k["name"].startswith("fwd_sm90_")) if _C else []
needs_ext = pytest.mark.skipif(_C is None, reason=f"sparktune._C not built: {_C_ERR}")
FLOOR = 1e-5


# ---------------------------------------------------------------- CPU: the arguments passed on
class _FakeModule:
    """Records the fwd calls (and the first ALiBi slope, read while the call holds it)."""

    def __init__(self):
        self.calls = []

    def fwd(self, *args, **kwargs):
        ptr = kwargs.get("alibi_slopes")
        slope = None if not ptr else ctypes.c_float.from_address(ptr).value
        self.calls.append((args, kwargs, slope))


@pytest.fixture
def fake(monkeypatch):
    mod = _FakeModule()
    monkeypatch.setattr(spark, "load_extension", lambda: (mod, None))
    monkeypatch.setattr(spark, "SM90_DYNAMIC", False)
    # CPU tensors stand in for CUDA ones: their device index (None) is the "current" device
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    return mod


SM90 = "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1"


def _dense(b=2, hq=4, hk=2, nq=100, nk=300, d=128):
    q = torch.zeros(b, hq, nq, d, dtype=torch.bfloat16)
    k, v = (torch.zeros(b, hk, nk, d, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def test_forward_passes_window_softcap_and_alibi_to_the_kernel(fake):
    b = SparkBackend()
    q, k, v = _dense()
    slopes = torch.arange(1, 5, dtype=torch.float32)
    b.forward(q, k, v, torch.empty_like(q), config=SM90, causal=True, scale=0.1, window=(50, -1),
              softcap=30.0, alibi_slopes=slopes.expand(2, 4))
    (args, kwargs, slope), = fake.calls
    assert args[0] == SM90 and args[-1] == 1234 and args[-2] is True  # causal, stream
    assert kwargs == dict(window_left=50, window_right=-1, softcap=30.0,
                          alibi_slopes=slopes.data_ptr(), alibi_batch_stride=0)
    assert slope == 1.0
    # one feature at a time; (B, Hq) slopes with their batch stride; a wide side unlimited
    fake.calls.clear()
    per_batch = torch.full((2, 4), 0.25)
    b.forward(q, k, v, torch.empty_like(q), config=SM90, causal=False, scale=0.1,
              alibi_slopes=per_batch)
    b.forward(q, k, v, torch.empty_like(q), config=SM90, causal=False, scale=0.1,
              window=(300, 7))
    b.forward(q, k, v, torch.empty_like(q), config=SM90, causal=False, scale=0.1, softcap=5)
    b.forward(q, k, v, torch.empty_like(q), config=SM90, causal=False, scale=0.1)
    got = [(kw, s) for _, kw, s in fake.calls]
    assert got == [
        (dict(alibi_slopes=per_batch.data_ptr(), alibi_batch_stride=4), 0.25),
        (dict(window_left=-1, window_right=7), None),
        (dict(softcap=5.0), None),
        ({}, None),  # plain: the arguments of before
    ]


def test_packed_forward_passes_the_features_too(fake):
    b = SparkBackend()
    q, k, v = (torch.zeros(40, 2, 64, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    slopes = torch.full((2, 2), 0.5)
    b.forward(q, k, v, torch.empty_like(q), config="fwd_sm90_f16_d64_m192n128_s2", causal=False,
              scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25,
              window=(3, 25), alibi_slopes=slopes)
    (args, kwargs, slope), = fake.calls
    assert args[-4:] == (cu.data_ptr(), cu.data_ptr(), 40, 40)
    # the right side reaches past every key of the longest sequence (25 rows): unlimited
    assert kwargs == dict(window_left=3, window_right=-1, alibi_slopes=slopes.data_ptr(),
                          alibi_batch_stride=2)
    assert slope == 0.5


@pytest.mark.parametrize(
    "config,kw,match",
    [
        ("fwd_sm80_bf16_d128_m128n64_w4x1_acc32_preg", dict(window=(3, -1)),
         r"window: the spark backend runs these on the family 90 forward only \(fwd_sm90_\*\)"),
        ("fwd_sm80_bf16_d128_m128n64_w4x1_acc32_preg", dict(softcap=2.0, alibi_slopes=torch.ones(4)),
         "softcap, alibi_slopes: the spark backend runs these on the family 90 forward only"),
        (SM90, dict(dropout_p=0.1, seed=1, offset=0),
         r"not \['dropout_p', 'offset', 'seed'\]"),
        (SM90, dict(window=(-3, 0)), "window sides must be >= 0, or -1 for unlimited"),
        (SM90, dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    ],
)
def test_forward_refuses_what_it_cannot_run(fake, config, kw, match):
    q, k, v = _dense()
    with pytest.raises((ValueError, TypeError), match=match):
        SparkBackend().forward(q, k, v, torch.empty_like(q), config=config, causal=True,
                               scale=0.1, **kw)
    assert fake.calls == []


# ---------------------------------------------------------------- GPU: every family 90 forward
def _runnable(name):
    """(backend, torch dtype, head dim) of a compiled family 90 forward; skips the test where
    the GPU cannot run it."""
    b = SparkBackend()
    k = b.kernel_info(name)
    dev = DeviceInfo.from_torch("cuda")
    if dev.arch != 90 or b.not_supported_reasons(Problem("fwd", k["dtype"], 1, 1, 1, 1, 1, k["head_dim"], False),
                                                 name, dev):
        pytest.skip(f"{name} not runnable on sm_{dev.arch}")
    return b, TORCH_DTYPES[k["dtype"]], k["head_dim"]


#: dense cases: (id, (batch, heads_q, heads_kv, seqlen_q, seqlen_k), causal, window, softcap,
#: alibi (None, "h" for (Hq,) slopes, "bh" for (B, Hq)), scale (None: head_dim ** -0.5))
DENSE = [
    ("causal_left255_gqa", (2, 4, 2, 1000, 1000), True, (255, -1), 0.0, None, None),
    ("both_sides", (1, 3, 3, 1000, 1000), False, (100, 37), 0.0, None, None),
    ("right_only_nq<nk", (1, 2, 1, 777, 1000), False, (-1, 100), 0.0, None, None),
    ("left_only_nq>nk", (1, 2, 2, 1000, 777), False, (300, -1), 0.0, None, None),
    ("wider_than_seq_causal", (2, 2, 2, 17, 17), True, (100, 100), 0.0, None, None),
    ("wider_than_seq_full", (1, 2, 1, 1000, 1000), False, (5000, 5000), 0.0, None, None),
    ("left0_causal", (1, 2, 2, 1000, 1000), True, (0, -1), 0.0, None, None),
    ("diagonal_only", (1, 2, 2, 17, 17), False, (0, 0), 0.0, None, None),
    # more queries than keys: rows whose band holds no key (out 0, lse -inf), whole row blocks
    # of them (no key block at all) with (0, 0)
    ("empty_rows", (1, 4, 4, 1000, 517), False, (64, 16), 0.0, None, None),
    ("empty_row_blocks", (2, 2, 2, 1000, 100), False, (0, 0), 0.0, None, None),
    ("empty_row_blocks_causal", (1, 2, 2, 1000, 300), True, (20, -1), 0.0, None, None),
    ("one_row", (2, 2, 2, 1, 1), False, (0, 0), 0.0, None, None),
    ("one_row_many_keys", (1, 2, 2, 1, 300), False, (5, 3), 0.0, None, None),
    ("seq4097_causal_left1023", (1, 2, 1, 4097, 4097), True, (1023, -1), 0.0, None, None),
    ("few_rows_long_keys", (1, 4, 4, 17, 4097), False, (200, 30), 0.0, None, None),
    ("softcap30_causal_gqa", (2, 4, 1, 1000, 1000), True, (-1, -1), 30.0, None, 0.5),
    ("softcap50_nq<nk", (1, 2, 2, 17, 1000), False, (-1, -1), 50.0, None, 0.5),
    ("softcap2", (1, 2, 2, 300, 300), True, (-1, -1), 2.0, None, None),
    ("alibi_h_causal", (2, 4, 4, 1000, 1000), True, (-1, -1), 0.0, "h", None),
    ("alibi_bh_full_gqa", (2, 4, 2, 777, 1000), False, (-1, -1), 0.0, "bh", None),
    ("all_causal_gqa", (1, 8, 2, 1537, 1537), True, (255, -1), 30.0, "bh", 0.4),
    ("all_full_empty_rows", (2, 4, 4, 1000, 517), False, (64, 16), 5.0, "h", None),
    ("all_4097", (1, 2, 2, 4097, 4097), True, (2047, -1), 20.0, "h", None),
]

#: packed cases: (id, query lengths, key lengths, heads_q, heads_kv, causal, window, softcap,
#: alibi, scale): empty sequences, queries without keys, seqlen_q != seqlen_k both ways
VARLEN = [
    ("varlen_causal_window", [1, 17, 1000, 0, 4097, 128], [1, 17, 1000, 0, 4097, 128], 4, 4, True,
     (255, -1), 0.0, None, None),
    ("varlen_two_sided_softcap_alibi", [5, 300, 64, 9], [700, 3, 64, 0], 8, 2, False, (32, 16), 30.0,
     "bh", 0.5),
    ("varlen_left0_alibi_mqa", [333, 1], [129, 2048], 3, 1, True, (0, -1), 0.0, "h", None),
]


def _slopes(kind, batch, hq, gen):
    if kind is None:
        return None
    shape = (hq,) if kind == "h" else (batch, hq)
    return torch.rand(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.2


def _max_err(a, ref, where=None):
    diff = (a.double() - ref.double()).abs()
    if where is not None:
        diff = diff[where]
    return float(diff.max()) if diff.numel() else 0.0


def _check(what, out, lse, q, k, v, causal, scale, kw, cu=None):
    """``out`` and ``lse`` (dense (B, Hq, Nq) or packed (Hq, total_q)) against float64 with the
    2x rule; rows that see no key: out exactly 0, lse -inf."""
    from sparktune.backends.reference import reference_attention
    from tests._features_baseline import feature_attention

    ref_kw = dict(kw)
    if cu is not None:
        ref_kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    ref, ref_lse = reference_attention(q, k, v, causal=causal, scale=scale, **ref_kw)
    low, low_lse = feature_attention(
        q, k, v, scale=scale, causal=causal, window=kw.get("window", (-1, -1)),
        softcap=kw.get("softcap", 0.0), slopes=kw.get("alibi_slopes"),
        cu_q=None if cu is None else cu[0].tolist(), cu_k=None if cu is None else cu[1].tolist(),
    )
    assert not torch.isnan(out).any(), f"{what}: unwritten or NaN output"
    err, base = _max_err(out, ref), _max_err(low, ref)
    assert err <= 2 * base + FLOOR, f"{what}: out error {err:.3g} > 2 x torch's {base:.3g} + {FLOOR}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse -inf rows differ from the reference"
    lerr, lbase = _max_err(lse, ref_lse, ~empty), _max_err(low_lse, ref_lse, ~empty)
    assert lerr <= 2 * lbase + FLOOR, f"{what}: lse error {lerr:.3g} > 2 x torch's {lbase:.3g} + {FLOOR}"
    rows_out = out.transpose(0, 1) if cu is not None else out  # rows of the lse's layout
    assert (rows_out[empty] == 0).all(), f"{what}: rows that see no key must be 0"
    return empty


def _dense_kw(window, softcap, slopes):
    kw = {}
    if window != (-1, -1):
        kw["window"] = window
    if softcap:
        kw["softcap"] = softcap
    if slopes is not None:
        kw["alibi_slopes"] = slopes
    return kw


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", KERNELS90)
def test_sm90_features_match_float64_reference(name):
    """Every family 90 forward with windows (one-sided, two-sided, wider than the sequence, left
    0, with causal, seqlen_q != seqlen_k both ways, rows and whole row blocks with an empty
    band), softcap, ALiBi (Hq,) and (B, Hq) and their combinations, GQA and MQA, lengths 1, 17,
    1000 and 4097; out and lse against float64 with the 2x rule; a repeat run bit-identical;
    the public call with the backend forced gives the same bits."""
    import sparktune

    b, dtype, d = _runnable(name)
    saw_empty = False
    for case_id, (bs, hq, hk, nq, nk), causal, window, softcap, alibi, scale in DENSE:
        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case_id} {d}".encode()))
        q = torch.randn(bs, hq, nq, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        scale = d ** -0.5 if scale is None else scale
        kw = _dense_kw(window, softcap, _slopes(alibi, bs, hq, gen))
        runs = []
        for _ in range(2):
            out = torch.full_like(q, float("nan"))
            runs.append((out, b.forward(q, k, v, out, config=name, causal=causal, scale=scale, **kw)))
        torch.cuda.synchronize()
        (out, lse), (out2, lse2) = runs
        what = f"{name} {case_id}"
        assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{what}: results moved between runs"
        saw_empty |= bool(_check(what, out, lse, q, k, v, causal, scale, kw).any())
        api, api_lse = sparktune.attention(q, k, v, causal=causal, scale=scale, backend="spark",
                                           config=name, return_lse=True, **kw)
        assert torch.equal(api, out) and torch.equal(api_lse, lse), f"{what}: the public call differs"
    assert saw_empty, "no case had rows that see no key"


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", KERNELS90)
def test_sm90_packed_features_match_float64_reference(name):
    """Every family 90 forward on packed (total, H, D) batches with windows, softcap and ALiBi
    (per sequence: its own diagonal and band, its own (B, Hq) slope row), against float64 with
    the 2x rule, lse (Hq, total_q) included; a repeat run bit-identical; the public call with
    the backend forced gives the same bits."""
    import sparktune

    b, dtype, d = _runnable(name)
    for case_id, lq, lk, hq, hk, causal, window, softcap, alibi, scale in VARLEN:
        gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case_id} {d}".encode()))
        cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        scale = d ** -0.5 if scale is None else scale
        kw = _dense_kw(window, softcap, _slopes(alibi, len(lq), hq, gen))
        packed = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        runs = []
        for _ in range(2):
            out = torch.full_like(q, float("nan"))
            runs.append((out, b.forward(q, k, v, out, config=name, causal=causal, scale=scale,
                                        **packed, **kw)))
        torch.cuda.synchronize()
        (out, lse), (out2, lse2) = runs
        what = f"{name} {case_id}"
        assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{what}: results moved between runs"
        assert tuple(lse.shape) == (hq, sum(lq))
        _check(what, out, lse, q, k, v, causal, scale, kw, cu=(cu_q, cu_k))
        api = sparktune.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                         scale=scale, backend="spark", config=name, **kw)
        assert torch.equal(api, out), f"{what}: the public call differs"


@pytest.mark.gpu
@needs_ext
@pytest.mark.parametrize("name", [n for n in KERNELS90 if is_persistent_sm90_fwd(n)][:2])
def test_sm90_persistent_schedules_agree_with_windows(name, monkeypatch):
    """A persistent kernel's static and dynamic tile schedules give the same bits with a window
    and softcap (tiles of uneven work, and tiles with no key block at all)."""
    b, dtype, d = _runnable(name)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for (bs, hq, hk, nq, nk), causal, window in (((3, 12, 4, 2048, 2048), True, (511, -1)),
                                                 ((2, 8, 8, 1000, 300), False, (0, 50))):
        q = torch.randn(bs, hq, nq, d, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
        runs = []
        for dynamic in (False, True):
            monkeypatch.setattr(spark, "SM90_DYNAMIC", dynamic)
            out = torch.full_like(q, float("nan"))
            runs.append((out, b.forward(q, k, v, out, config=name, causal=causal, scale=d ** -0.5,
                                        window=window, softcap=20.0)))
        torch.cuda.synchronize()
        assert not torch.isnan(runs[0][0]).any()
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), (name, window)


@pytest.mark.gpu
@needs_ext
def test_training_call_with_a_window_on_hopper_runs_the_sm90_forward_and_backward():
    """A causal sliding-window call with softcap and ALiBi, with gradients and no backend
    forced, on sm_90: dispatch runs the sm90 forward and the sm90 backward
    (HOPPER_FEATURE_FWD_ORDER, both); out, dq, dk, dv against float64 autograd, within twice
    the error of the same call run by the Triton family alone (plus 1e-5)."""
    import importlib

    import sparktune
    from sparktune import dispatch
    from tests._features_oracle import oracle

    _resolve = importlib.import_module("sparktune.dispatch._resolve")
    dev = DeviceInfo.from_torch("cuda")
    default = "fwd_sm90_bf16_d128_m128n128_s2_ov1_pp1"
    if dev.arch != 90 or default not in KERNELS90:
        pytest.skip(f"needs sm_90 and {default} (the default)")
    b, hq, hk, n, d = 2, 8, 2, 1000, 128
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (hq, hk, hk))
    dout = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    slopes = torch.rand(hq, device="cuda", generator=gen) * 0.1
    kw = dict(causal=True, window=(255, -1), softcap=30.0, alibi_slopes=slopes)
    ex = sparktune.explain(q, k=k, **kw)
    assert _resolve.default_order(dev, ex.problem) == _resolve.HOPPER_FEATURE_FWD_ORDER
    fwd = dispatch.select(ex.problem, dev)
    bwd = dispatch.select(dataclasses.replace(ex.problem, op="bwd"), dev)
    if fwd.source == "default":  # (a tuned record may name another sm90 forward)
        assert fwd.candidate.backend == "spark", fwd
    assert fwd.candidate.config.startswith("fwd_sm90_"), fwd
    if bwd.source == "default":
        assert bwd.candidate.backend == "spark", bwd
    assert bwd.candidate.config.startswith("bwd_sm90_"), bwd

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparktune.attention(*leaves, backend=backend, **kw)
        out.backward(dout)
        return [out.detach(), *(t.grad for t in leaves)]

    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = oracle(*leaves, causal=True, window=(255, -1), softcap=30.0, alibi=slopes.cpu())
    ref_out.backward(dout.cpu().double())
    ref = [ref_out.detach(), *(t.grad for t in leaves)]
    ours, triton = run(None), run("triton")
    # the forward was the chosen sm90 kernel's (the same bits as the backend called directly)
    direct = torch.empty_like(q)
    SparkBackend().forward(q, k, v, direct, config=fwd.candidate.config, causal=True,
                           scale=d ** -0.5, window=(255, -1), softcap=30.0, alibi_slopes=slopes)
    assert torch.equal(ours[0], direct)
    for what, a, t, r in zip(("out", "dq", "dk", "dv"), ours, triton, ref, strict=True):
        err = float((a.cpu().double() - r).abs().max())
        base = float((t.cpu().double() - r).abs().max())
        assert math.isfinite(err) and err <= 2 * base + 1e-5, (
            f"{what}: error {err:.3g} > 2 x {base:.3g} (Triton alone)"
        )

