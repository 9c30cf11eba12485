"""The Triton backend: config space and support rules, and the kernels run under Triton's CPU
interpreter on tiny shapes against a float64 reference (forward and backward).

Triton picks the interpreter when ``triton`` itself is imported (``TRITON_INTERPRET=1``), and
that choice holds for the whole process. So the kernel tests (``test_interp_*``) run in a child
pytest process started once with that variable set, and each one here reports its own outcome
from the child's report; this process, and whatever else runs in it, keeps Triton as it was.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os

import pytest
import torch

from sparktune.kernels import triton_space as space
from sparktune.problem import DeviceInfo, Problem
from tests._interp import delegated, in_child, run_child

try:  # the project's shared oracle when present; this file carries its own otherwise
    from tests._oracle import assert_close_to_reference, assert_grads_close_to_reference
except Exception:  # noqa: BLE001 - any import problem means: use the local reference
    assert_close_to_reference = assert_grads_close_to_reference = None

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108)
RTX4090 = DeviceInfo("NVIDIA GeForce RTX 4090", (8, 9), 128)
V100 = DeviceInfo("Tesla V100-SXM2-32GB", (7, 0), 80)

# tiny tiles keep the interpreter fast; the names parse like any other config
FWD_TEST_CONFIGS = ("tfwd_m16n16_w1s1", "tfwd_m32n16_w2s1")
BWD_TEST_CONFIGS = ("tbwd_m16n16_w1s1", "tbwd_m16n32_w1s1", "tbwd_m16n32_w1s1_dqatomic")
#: absolute slack on top of FlashAttention's 2x rule (cases like seqlen 1 are exact in both)
FLOOR = 1e-5


def _problem(op="fwd", dtype="float16", b=2, hq=4, hk=2, nq=128, nk=128, d=64, causal=False):
    return Problem(op, dtype, b, hq, hk, nq, nk, d, causal)


# ------------------------------------------------------------------------------------------
# the config space (pure Python, always runs)
# ------------------------------------------------------------------------------------------


def test_config_names_round_trip():
    for cfg in (*space.FWD_SPACE, *space.BWD_SPACE):
        assert space.parse_config(cfg.name) == cfg
    assert space.parse_config("tfwd_m128n64_w8s3") == space.FwdConfig(128, 64, 8, 3)
    atomic = space.parse_config("tbwd_m64n128_w8s2_dqatomic")
    assert atomic == space.BwdConfig(64, 128, 8, 2, dq_atomic=True)


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("fwd_m128n64_w8s3", "not a Triton config name"),
        ("tfwd_m96n64_w8s3", "power of two"),
        ("tfwd_m8n64_w4s3", ">= 16"),
        ("tfwd_m64n64_w3s3", "num_warps"),
        ("tfwd_m64n64_w4s0", "num_stages"),
        ("tfwd_m64n64_w4s2_dqatomic", "backward option"),
    ],
)
def test_bad_config_names(name, fragment):
    with pytest.raises(ValueError, match=fragment):
        space.parse_config(name)


def test_space_is_unique_and_named_by_op():
    fwd = [c.name for c in space.FWD_SPACE]
    bwd = [c.name for c in space.BWD_SPACE]
    assert len(set(fwd)) == len(fwd) and len(set(bwd)) == len(bwd)
    assert all(n.startswith("tfwd_") for n in fwd) and all(n.startswith("tbwd_") for n in bwd)
    assert any(c.dq_atomic for c in space.BWD_SPACE) and any(not c.dq_atomic for c in space.BWD_SPACE)


def test_padded_head_dim():
    assert [space.padded_head_dim(d) for d in (32, 33, 64, 72, 96, 128, 160, 256)] == [
        32, 64, 64, 128, 128, 128, 256, 256
    ]


def test_config_filter_reasons():
    big = space.parse_config("tfwd_m128n128_w8s4")
    reasons = space.config_reasons(big, _problem(d=128), H200)
    assert reasons and "shared memory" in reasons[0] and "227 KiB" in reasons[0]
    # the same config fits at head_dim 32
    assert space.config_reasons(big, _problem(d=32), H200) == []
    # register pressure: 128 rows x 256 columns of fp32 over 4 warps
    regs = space.config_reasons(space.parse_config("tfwd_m128n32_w4s2"), _problem(d=256), H200)
    assert any("registers" in r for r in regs)
    # 99 KiB parts refuse what an H200 runs
    mid = space.parse_config("tfwd_m128n64_w8s3")
    assert space.config_reasons(mid, _problem(d=128), H200) == []
    assert space.config_reasons(mid, _problem(d=128), RTX4090)
    # wrong op
    assert "bwd config" in space.config_reasons(space.BWD_SPACE[0], _problem(), H200)[0]


def test_every_declared_config_fits_somewhere():
    for cfg in space.FWD_SPACE:
        assert not space.config_reasons(cfg, _problem(d=64), H200), cfg.name
    for cfg in space.BWD_SPACE:
        assert not space.config_reasons(cfg, _problem("bwd", d=32), H200), cfg.name


@pytest.mark.parametrize(
    "d, causal, expected",
    [
        (64, False, "tfwd_m128n64_w8s3"),
        (64, True, "tfwd_m128n64_w8s3"),
        (128, False, "tfwd_m128n128_w8s3"),
        (128, True, "tfwd_m128n128_w8s3"),
        (96, False, "tfwd_m128n128_w8s3"),
        (32, True, "tfwd_m128n64_w8s3"),
    ],
)
def test_defaults_on_h200_follow_the_sweep(d, causal, expected):
    assert space.default_config_name(_problem(d=d, causal=causal), H200) == expected


def test_defaults_fit_every_supported_problem():
    for device in (H200, A100, RTX4090):
        for op in ("fwd", "bwd"):
            for d in (32, 48, 64, 80, 96, 128, 160, 192, 256):
                for causal in (False, True):
                    p = _problem(op, d=d, causal=causal)
                    name = space.default_config_name(p, device)
                    if name is None:
                        # only the backward at head_dim > 128 may not fit a 99 KiB part
                        assert op == "bwd" and d > 128 and device is RTX4090, (op, d, device.name)
                        continue
                    assert not space.config_reasons(space.parse_config(name), p, device)


# ------------------------------------------------------------------------------------------
# the backend's support rules (no kernel runs)
# ------------------------------------------------------------------------------------------


@pytest.fixture
def backend():
    from sparktune.backends.triton import TritonBackend

    return TritonBackend()


def test_backend_loads_from_the_registry_path():
    module, _, attr = "sparktune.backends.triton:TritonBackend".partition(":")
    cls = getattr(importlib.import_module(module), attr)
    assert cls.name == "triton" and cls.tunable


def test_backend_configs(backend):
    assert list(backend.configs("fwd")) == [c.name for c in space.FWD_SPACE]
    assert list(backend.configs("bwd")) == [c.name for c in space.BWD_SPACE]
    with pytest.raises(ValueError):
        backend.configs("both")


def test_backend_reasons(backend, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = _problem(d=128)
    assert backend.not_supported_reasons(p, "tfwd_m128n64_w8s3", H200) == []
    volta = backend.not_supported_reasons(p, "tfwd_m128n64_w8s3", V100)
    assert any("Triton has no tensor-core path before sm_80 (Volta); use the spark backend" in r
               for r in volta)
    assert any("head_dim 512" in r for r in backend.not_supported_reasons(_problem(d=512), None, H200))
    assert any("head_dim 16" in r for r in backend.not_supported_reasons(_problem(d=16), None, H200))
    assert any("needs CUDA tensors" in r for r in backend.not_supported_reasons(p, None, None))
    assert "not a Triton config name" in backend.not_supported_reasons(p, "flash", H200)[0]
    assert any("shared memory" in r
               for r in backend.not_supported_reasons(p, "tfwd_m128n128_w8s4", H200))
    assert backend.default_config(p, V100) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.not_supported_reasons(p, "tfwd_m16n16_w1s1", None) == []


def test_backend_candidates_are_filtered(backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # available without a GPU
    if backend.unavailable_reasons():
        pytest.skip("; ".join(backend.unavailable_reasons()))
    p = _problem("bwd", d=128)
    names = [c.config for c in backend.candidates(p, H200)]
    assert names and all(not backend.not_supported_reasons(p, n, H200) for n in names)
    assert len(names) < len(space.BWD_SPACE)  # some do not fit at head_dim 128


# ------------------------------------------------------------------------------------------
# kernels under the interpreter
# ------------------------------------------------------------------------------------------


#: set in the child process that runs the kernels under the interpreter
_CHILD_FLAG = "_SPARKTUNE_TRITON_INTERPRETED"
IN_CHILD = in_child(_CHILD_FLAG)
#: the child runs every interpreted test; a generous bound for 2 slow, shared cores
_CHILD_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def child_report(tmp_path_factory):
    return run_child(__file__, _CHILD_FLAG, tmp_path_factory, timeout_s=_CHILD_TIMEOUT_S, what="kernel tests")


def _delegated(request) -> bool:
    return delegated(request, IN_CHILD)


@pytest.fixture
def kernels():
    """The kernel module, imported in the child (where TRITON_INTERPRET=1 came first)."""
    from sparktune.kernels import triton_attn

    assert triton_attn.INTERPRET, "TRITON_INTERPRET was not set when the kernels were imported"
    return triton_attn


def _attention(q, k, v, causal, scale):
    """softmax(scale q k^T) v in the dtype of the inputs, bottom-right causal, GQA by repeat.
    Rows that see no key give output 0 and lse -inf."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    nq, nk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).to(s.dtype)
    p = torch.exp(s - safe[..., None])
    return p @ v, lse


def _make(shape_b_h_n_d, dtype, bnhd):
    b, h, n, d = shape_b_h_n_d
    if bnhd:  # (B, N, H, D) storage seen as a (B, H, N, D) view: strided, no copy
        return torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2)
    return torch.randn(b, h, n, d, dtype=dtype)


def _empty_like_layout(t):
    """An uninitialised tensor with t's shape and strides (poisoned with NaN)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return out.fill_(float("nan"))


# (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal, dtype, bnhd)
CASES = [
    (1, 1, 1, 1, 1, 32, False, torch.float16, False),
    (2, 2, 2, 17, 17, 64, True, torch.float16, False),
    (1, 4, 2, 33, 17, 32, True, torch.bfloat16, False),  # rows with no visible key, GQA
    (1, 3, 1, 17, 33, 32, True, torch.float16, False),  # MQA, more keys than queries
    (2, 2, 1, 33, 33, 64, False, torch.bfloat16, True),  # (B, N, H, D) strided view, GQA
    (1, 2, 2, 17, 17, 48, False, torch.float16, False),  # head dim padded to 64
    (1, 2, 2, 1, 17, 32, True, torch.float16, False),  # one query sees every key
    (1, 2, 2, 17, 1, 32, True, torch.bfloat16, True),  # one key: most rows see nothing
    (1, 2, 1, 20, 33, 32, False, torch.float16, True),
]


def _case_id(c):
    b, hq, hk, nq, nk, d, causal, dtype, bnhd = c
    dt = "f16" if dtype == torch.float16 else "bf16"
    return f"b{b}h{hq}x{hk}_q{nq}k{nk}_d{d}_{'causal' if causal else 'full'}_{dt}{'_bnhd' if bnhd else ''}"


def _check(name, got, oracle, lowp, floor):
    """FlashAttention's rule: the kernel's error against the float64 oracle is at most twice
    PyTorch's own error in the same precision (plus a small floor for exact-ish cases)."""
    got, oracle, lowp = got.double(), oracle.double(), lowp.double()
    err = (got - oracle).abs().max().item()
    ref_err = (lowp - oracle).abs().max().item()
    assert math.isfinite(err), f"{name}: non-finite values"
    assert err <= 2 * ref_err + floor, f"{name}: error {err:.3g} > 2 x torch's {ref_err:.3g} + {floor}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interp_forward_backward_against_float64(request, case):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    b, hq, hk, nq, nk, d, causal, dtype, bnhd = case
    torch.manual_seed(nq * 131 + nk * 7 + d + hq)
    q = _make((b, hq, nq, d), dtype, bnhd)
    k = _make((b, hk, nk, d), dtype, bnhd)
    v = _make((b, hk, nk, d), dtype, bnhd)
    dout = _make((b, hq, nq, d), dtype, bnhd)
    scale = 1.0 / math.sqrt(d)
    floor = FLOOR

    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, lse64 = _attention(q64, k64, v64, causal, scale)
    o64.backward(dout.double())
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    olow, _ = _attention(ql, kl, vl, causal, scale)
    olow.backward(dout)
    no_key = torch.isneginf(lse64)
    shared = assert_close_to_reference is not None

    for fwd in FWD_TEST_CONFIGS:
        out = _empty_like_layout(q)
        lse = kernels.attention_forward(q, k, v, out, config=fwd, causal=causal, scale=scale)
        assert out.stride() == q.stride()
        assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32 and lse.is_contiguous()
        if shared:
            assert_close_to_reference(out, q, k, v, causal=causal, scale=scale, lse=lse,
                                      floor=floor, what=fwd)
        else:
            _check(f"{fwd} out", out, o64, olow, floor)
            finite = ~no_key
            if finite.any():
                lse_err = (lse[finite].double() - lse64[finite]).abs().max().item()
                assert lse_err < 1e-3, f"{fwd} lse: error {lse_err:.3g}"
        assert torch.equal(torch.isneginf(lse), no_key), f"{fwd}: rows with lse -inf"
        assert (out[no_key] == 0).all(), f"{fwd}: rows that see no key must be 0"

    out = _empty_like_layout(q)
    lse = kernels.attention_forward(q, k, v, out, config=FWD_TEST_CONFIGS[0], causal=causal,
                                    scale=scale)
    for bwd in BWD_TEST_CONFIGS:
        dq, dk, dv = (_empty_like_layout(t) for t in (q, k, v))
        kernels.attention_backward(dout, q, k, v, out, lse, dq, dk, dv, config=bwd,
                                   causal=causal, scale=scale)
        assert dq.stride() == q.stride() and dk.stride() == k.stride()
        if shared:
            assert_grads_close_to_reference((dq, dk, dv), q, k, v, dout, causal=causal,
                                            scale=scale, floor=floor, what=bwd)
        else:
            for gname, g, g64, glow in (("dq", dq, q64.grad, ql.grad),
                                        ("dk", dk, k64.grad, kl.grad),
                                        ("dv", dv, v64.grad, vl.grad)):
                _check(f"{bwd} {gname}", g, g64, glow, floor)
        assert (dq[no_key] == 0).all(), f"{bwd}: rows that see no key have zero dq"


def test_interp_backend_runs_cpu_tensors(request, backend, caplog):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 17, 32, dtype=torch.float16) for _ in range(3))
    out = torch.empty_like(q)
    p = Problem("fwd", "float16", 1, 2, 2, 17, 17, 32, True)
    assert backend.unavailable_reasons() == []
    assert backend.not_supported_reasons(p, "tfwd_m16n16_w1s1", None) == []
    config = "tfwd_m16n32_w1s1"
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        lse = backend.forward(q, k, v, out, config=config, causal=True, scale=0.2)
        backend.forward(q, k, v, out, config=config, causal=True, scale=0.2)
    compiled = [r for r in caplog.records if config in r.getMessage()]
    assert len(compiled) == 1, "the first use of a config is logged once"
    assert any(label[0] == config for label in kernels.compiled_labels())
    o64, lse64 = _attention(q.double(), k.double(), v.double(), True, 0.2)
    assert (out.double() - o64).abs().max().item() < 2e-3
    assert (lse.double() - lse64).abs().max().item() < 1e-3
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    backend.backward(torch.ones_like(q), q, k, v, out, lse, dq, dk, dv,
                     config="tbwd_m16n16_w1s1", causal=True, scale=0.2)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert backend.warmup(p, ["tfwd_m16n16_w1s1"]) == {}  # nothing to compile in the interpreter


def test_interp_kernel_rejects_bad_inputs(request):
    if _delegated(request):
        return
    kernels = request.getfixturevalue("kernels")
    q = torch.randn(1, 2, 8, 32, dtype=torch.float16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="multiple"):
        kernels.attention_forward(q, q[:, :1].repeat(1, 3, 1, 1), q[:, :1].repeat(1, 3, 1, 1), out,
                                  config="tfwd_m16n16_w1s1", causal=False, scale=1.0)
    with pytest.raises(ValueError, match="bwd config"):
        kernels.attention_forward(q, q, q, out, config="tbwd_m16n16_w1s1", causal=False, scale=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.randn(1, 2, 32, 8, dtype=torch.float16).transpose(2, 3)
        kernels.attention_forward(t, t, t, torch.empty_like(t), config="tfwd_m16n16_w1s1",
                                  causal=False, scale=1.0)
    with pytest.raises(ValueError, match="float16 or all bfloat16"):
        f = q.float()
        kernels.attention_forward(f, f, f, f.clone(), config="tfwd_m16n16_w1s1", causal=False,
                                  scale=1.0)


# ------------------------------------------------------------------------------------------
# compiling for a GPU that is not there (Triton's compiler and bundled ptxas, no device)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, config, arch",
    [("fwd", "tfwd_m64n64_w4s2", 90), ("bwd", "tbwd_m32n64_w4s2", 80)],
)
def test_compiles_offline_within_the_estimate(op, config, arch):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: this process has no compiler-backed kernels")
    from sparktune.kernels import triton_attn

    p = _problem(op, d=64, causal=True)
    kernels = triton_attn.compile_offline(p, config, arch)
    expected = {"fwd": ["_fwd_kernel"], "bwd": ["_bwd_preprocess", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]}
    assert [k["kernel"] for k in kernels] == expected[op]
    estimate = space.parse_config(config).smem_bytes(64)
    for k in kernels:
        assert 0 < k["shared"] <= estimate, k
        assert k["regs"] is None or k["regs"] <= 255, k


def test_warmup_jobs_compile_in_workers_only_after_a_cache_miss(monkeypatch):
    """Jobs run in this process while they load from Triton's cache; from the first one that
    compiles, the rest go to the worker pool (and are then loaded here)."""
    import concurrent.futures
    import types

    tb = importlib.import_module("sparktune.backends.triton")
    here, pooled = [], []
    slow = {"b"}
    clock = [0.0]

    def one(p, c):
        here.append(c)
        clock[0] += 1.0 if c in slow and c not in pooled else 0.01
        return c, 0.0, None

    def pool_one(p, c):
        pooled.append(c)
        return c, 1.0, None

    class FakePool:
        def submit(self, fn, p, c):
            fut = concurrent.futures.Future()
            fut.set_result(pool_one(p, c))
            return fut

    monkeypatch.setattr(tb, "_kernels", lambda: types.SimpleNamespace(INTERPRET=False))
    monkeypatch.setattr(tb, "_warmup_one", one)
    monkeypatch.setattr(tb, "_workers", lambda n: FakePool())
    monkeypatch.setattr(tb.time, "monotonic", lambda: clock[0])
    p = Problem(op="fwd", dtype="float16", batch=1, heads_q=2, heads_kv=2, seqlen_q=64,
                seqlen_k=64, head_dim=64, causal=False)
    jobs = [(p, c) for c in ("f", "a", "b", "c", "d")]
    slow.add("f")  # the first job is slow (Triton starting in this process): it does not count
    out = tb.warmup_jobs(jobs, processes=4)
    assert pooled == ["c", "d"]  # "a" was a cache hit, "b" compiled here: the rest in workers
    assert here == ["f", "a", "b", "c", "d"]  # the pooled ones loaded here afterwards
    assert set(out) == {f"{c} float16 d64 causal=0" for c in "fabcd"}
    # one process: everything here, no pool
    here.clear(), pooled.clear()
    tb.warmup_jobs(jobs, processes=1)
    assert pooled == [] and here == ["f", "a", "b", "c", "d"]
