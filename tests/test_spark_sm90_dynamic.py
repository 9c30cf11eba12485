"""The dynamic tile schedule of the persistent Hopper forward kernels (``fwd_sm90_*_ps1``):
the spark backend gives such a launch a zeroed int32 tile counter while SPARKTUNE_SM90_DYNAMIC
is on (not for packed sequences, not for other kernels), on the CPU with a stand-in module; on
an sm_90 GPU, the dynamic and the static schedules give the same bits and the kernel leaves the
counter zero."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sparktune.backends import spark
from sparktune.kernels.kernel_space import is_persistent_sm90_fwd

PS1 = "fwd_sm90_f16_d64_m128n128_s2_ps1"
PS1_EX = "fwd_sm90_f16_d64_m192n128_s2_ps1_ex2"  # a (made-up) suffix after _ps1: still persistent


def test_env_switch():
    assert spark._dynamic_from_env({}) is False
    assert spark._dynamic_from_env({"SPARKTUNE_SM90_DYNAMIC": "1"}) is True
    assert spark._dynamic_from_env({"SPARKTUNE_SM90_DYNAMIC": " 1 "}) is True
    assert spark._dynamic_from_env({"SPARKTUNE_SM90_DYNAMIC": "0"}) is False


class _FakeModule:
    """Records the fwd calls; reads the tile counter while the launch holds it."""

    def __init__(self):
        self.calls = []

    def fwd(self, *args, **kwargs):
        ptr = kwargs.get("tile_counter")
        self.calls.append((args, kwargs, None if ptr is None else ctypes.c_int32.from_address(ptr).value))


@pytest.fixture
def fake(monkeypatch):
    mod = _FakeModule()
    monkeypatch.setattr(spark, "load_extension", lambda: (mod, None))
    # CPU tensors stand in for CUDA ones: their device index (None) is the "current" device
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    return mod


def _qkv(b=1, h=2, n=64, d=64):
    return [torch.zeros(b, h, n, d, dtype=torch.float16) for _ in range(3)]


@pytest.mark.parametrize("dynamic", [True, False])
def test_forward_passes_a_zeroed_counter_to_persistent_sm90_kernels(fake, monkeypatch, dynamic):
    monkeypatch.setattr(spark, "SM90_DYNAMIC", dynamic)
    b = spark.SparkBackend()
    q, k, v = _qkv()
    for config in (PS1, PS1_EX, "fwd_sm90_f16_d64_m128n128_s2", "fwd_sm90_f16_d64_m192n128_s2_ex2",
                   "fwd_sm80_f16_d64_m128n64_w4x1_acc32_preg"):
        fake.calls.clear()
        b.forward(q, k, v, torch.empty_like(q), config=config, causal=True, scale=0.125)
        (args, kwargs, value), = fake.calls
        assert args[0] == config and args[-1] == 1234  # the stream is the last positional one
        if dynamic and config in (PS1, PS1_EX):
            assert set(kwargs) == {"tile_counter"} and kwargs["tile_counter"] != 0 and value == 0
        else:
            assert kwargs == {}


def test_packed_calls_keep_the_static_rounds(fake, monkeypatch):
    monkeypatch.setattr(spark, "SM90_DYNAMIC", True)
    b = spark.SparkBackend()
    q, k, v = (torch.zeros(40, 2, 64, dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    b.forward(q, k, v, torch.empty_like(q), config=PS1, causal=True, scale=0.125, cu_seqlens_q=cu,
              cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25)
    (args, kwargs, _), = fake.calls
    assert args[-4:] == (cu.data_ptr(), cu.data_ptr(), 40, 40) and kwargs == {}


@pytest.mark.parametrize("dynamic", [True, False])
def test_forward_runner_passes_the_counter_too(fake, monkeypatch, dynamic):
    monkeypatch.setattr(spark, "SM90_DYNAMIC", dynamic)
    b = spark.SparkBackend()
    q, k, v = _qkv()
    for config in (PS1, "fwd_sm90_f16_d64_m128n128_s2"):
        run = b.forward_runner(q, k, v, torch.empty_like(q), config=config, causal=False,
                               scale=0.125)
        for _ in range(2):  # a fresh counter per call
            fake.calls.clear()
            out, lse = run(q, k, v)
            (args, kwargs, value), = fake.calls
            assert args[0] == config and args[-1] == 1234 and args[5] == lse.data_ptr()
            if dynamic and config == PS1:
                assert set(kwargs) == {"tile_counter"} and value == 0
            else:
                assert kwargs == {}


# ---------------------------------------------------------------- GPU: both schedules
def _ps1_kernels():
    mod, _ = spark.load_extension()
    if mod is None:
        return []
    return sorted(k["name"] for k in mod.kernels()
                  if is_persistent_sm90_fwd(k["name"]))


#: (batch, heads_q, heads_kv, seqlen_q, seqlen_k, causal): several tiles per block, uneven
#: causal tiles, rows that see no key (seqlen_q > seqlen_k), GQA, fewer tiles than SMs
GPU_SHAPES = [
    (4, 16, 16, 2048, 2048, True),
    (3, 12, 4, 777, 1500, True),
    (2, 8, 8, 1000, 300, True),
    (2, 8, 2, 1000, 1000, False),
    (1, 2, 2, 200, 200, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name", _ps1_kernels())
def test_dynamic_and_static_schedules_give_the_same_bits(name, monkeypatch):
    from sparktune.problem import DeviceInfo

    if DeviceInfo.from_torch("cuda").arch != 90:
        pytest.skip("sm_90a kernels run on sm_90 only")
    b = spark.SparkBackend()
    info = b.kernel_info(name)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[info["dtype"]]
    d = info["head_dim"]
    mod, _ = spark.load_extension()
    for bs, hq, hk, nq, nk, causal in GPU_SHAPES:
        q = torch.randn(bs, hq, nq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(bs, hk, nk, d, device="cuda", dtype=dtype) for _ in range(2))
        runs = []
        for dynamic in (False, True, True):
            monkeypatch.setattr(spark, "SM90_DYNAMIC", dynamic)
            out = torch.full_like(q, float("nan"))
            lse = b.forward(q, k, v, out, config=name, causal=causal, scale=d ** -0.5)
            runs.append((out, lse))
        torch.cuda.synchronize()
        what = f"{name} {(bs, hq, hk, nq, nk, causal)}"
        assert not torch.isnan(runs[0][0]).any(), what
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), what
        # the kernel leaves its counter zero (the last claim resets it)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        out, lse = torch.empty_like(q), torch.empty(bs, hq, nq, device="cuda")
        mod.fwd(name, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                bs, hq, hk, nq, nk, d, q.stride()[:3], k.stride()[:3], v.stride()[:3],
                out.stride()[:3], d ** -0.5, causal, torch.cuda.current_stream().cuda_stream,
                tile_counter=counter.data_ptr())
        torch.cuda.synchronize()
        assert int(counter.item()) == 0, what
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), what


@pytest.mark.gpu
@pytest.mark.parametrize("name", _ps1_kernels()[:2])
def test_packed_launch_ignores_a_counter(name):
    from sparktune.problem import DeviceInfo

    if DeviceInfo.from_torch("cuda").arch != 90:
        pytest.skip("sm_90a kernels run on sm_90 only")
    b = spark.SparkBackend()
    info = b.kernel_info(name)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[info["dtype"]]
    d, hq, hk = info["head_dim"], 8, 2
    lens = [5, 1000, 0, 300, 2049]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lens)
    q = torch.randn(total, hq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    out = torch.empty_like(q)
    lse = b.forward(q, k, v, out, config=name, causal=True, scale=d ** -0.5, cu_seqlens_q=cu,
                    cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    mod, _ = spark.load_extension()
    counter = torch.full((1,), 7, dtype=torch.int32, device="cuda")  # not zero: must go unread
    out2, lse2 = torch.empty_like(q), torch.empty_like(lse)
    views = [(t.shape[0] * t.stride(0), t.stride(1), t.stride(0)) for t in (q, k, v, out2)]
    mod.fwd(name, q.data_ptr(), k.data_ptr(), v.data_ptr(), out2.data_ptr(), lse2.data_ptr(),
            len(lens), hq, hk, max(lens), max(lens), d, *views, d ** -0.5, True,
            torch.cuda.current_stream().cuda_stream, cu.data_ptr(), cu.data_ptr(), total, total,
            tile_counter=counter.data_ptr())
    torch.cuda.synchronize()
    assert int(counter.item()) == 7
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
