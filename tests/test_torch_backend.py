"""The torch SDPA backend: its support rules (CPU) and every config against the float64
reference on odd shapes (GPU)."""

from __future__ import annotations

import math

import pytest
import torch

import sparktune
import sparktune.backends.torch_sdpa as tsdpa
from sparktune.backends.reference import reference_attention
from sparktune.backends.torch_sdpa import CONFIGS, TorchSDPABackend
from sparktune.problem import DeviceInfo, Problem
from tests._oracle import assert_close_to_reference, assert_grads_close_to_reference

H200 = DeviceInfo("NVIDIA H200", (9, 0), 132)
A10 = DeviceInfo("NVIDIA A10", (8, 6), 72)
V100 = DeviceInfo("Tesla V100", (7, 0), 80)
T4 = DeviceInfo("Tesla T4", (7, 5), 40)


def problem(op="fwd", dtype="float16", b=2, hq=4, hkv=2, nq=128, nk=128, d=64, causal=False):
    return Problem(op, dtype, b, hq, hkv, nq, nk, d, causal)


# -- rules (no GPU needed) --------------------------------------------------------------------


@pytest.fixture
def cuda_torch(monkeypatch):
    """Pretend this torch can run every SDPA backend, to test the shape/device rules alone."""
    monkeypatch.setattr(tsdpa, "_config_unavailable", lambda config: ())


def reasons(p, config, device):
    return " | ".join(TorchSDPABackend().not_supported_reasons(p, config, device))


def test_cpu_tensors_run_only_math():
    b = TorchSDPABackend()
    p = problem()
    assert b.not_supported_reasons(p, "math", None) == []
    for config in ("flash", "cudnn", "efficient"):
        assert b.not_supported_reasons(p, config, None), config
    assert b.candidates(p, None)[0].config == "math"
    assert b.not_supported_reasons(p, None, None) == []  # some config can run it


def test_unknown_config():
    assert "unknown config 'fast'" in reasons(problem(), "fast", None)


def test_rules_on_a_capable_gpu(cuda_torch):
    for config in CONFIGS:
        assert reasons(problem(), config, H200) == "", config
        assert reasons(problem(causal=True), config, H200) == "", config  # square causal


def test_non_square_causal_only_on_math_and_efficient(cuda_torch):
    p = problem(nq=17, nk=33, causal=True)
    assert "top-left" in reasons(p, "flash", H200)
    assert "top-left" in reasons(p, "cudnn", H200)
    assert reasons(p, "efficient", H200) == ""
    assert reasons(p, "math", H200) == ""


def test_architecture_rules(cuda_torch):
    assert "needs sm_80+ (device is sm_70)" in reasons(problem(), "flash", V100)
    assert "needs sm_80+ (device is sm_75)" in reasons(problem(), "cudnn", T4)
    assert reasons(problem(), "efficient", V100) == ""
    old = DeviceInfo("Tesla P100", (6, 0), 56)
    assert "needs sm_70+ (device is sm_60)" in reasons(problem(), "efficient", old)


def test_head_dim_rules(cuda_torch):
    for config in ("flash", "cudnn", "efficient"):
        assert "head_dim 20 is not a multiple of 8" in reasons(problem(d=20), config, H200)
    assert reasons(problem(d=20), "math", H200) == ""
    assert "head_dim 264 > 256" in reasons(problem(d=264), "flash", H200)
    assert "head_dim 256 > 128" in reasons(problem(d=256), "cudnn", H200)
    assert reasons(problem(d=256), "flash", H200) == ""
    assert "needs sm_80 or sm_90" in reasons(problem(op="bwd", d=256), "flash", A10)
    assert reasons(problem(op="bwd", d=256), "flash", H200) == ""


def test_all_reasons_when_no_config_fits(cuda_torch, monkeypatch):
    monkeypatch.setattr(tsdpa, "CONFIGS", {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"})
    text = " | ".join(TorchSDPABackend().not_supported_reasons(problem(d=20), None, V100))
    assert text.startswith("flash: ") and " | cudnn: " in text


def test_bottom_right_mask():
    m = tsdpa._bottom_right_mask(3, 5, torch.device("cpu"))
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    m = tsdpa._bottom_right_mask(4, 2, torch.device("cpu"))
    # rows 0-1 see nothing: opened so torch gives no NaN (the backend zeroes them)
    assert m.tolist() == [[1, 1], [1, 1], [1, 0], [1, 1]]


# -- every config against the reference (GPU) -------------------------------------------------

GPU_SHAPES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
    (1, 1, 1, 1, 1, 64),
    (2, 3, 3, 17, 17, 64),
    (1, 4, 2, 33, 33, 128),
    (2, 4, 1, 113, 203, 64),
    (1, 2, 2, 203, 113, 32),
    (1, 2, 2, 1000, 1000, 64),
    (1, 2, 2, 65, 65, 256),
    (1, 2, 2, 17, 33, 20),
]
GPU_DTYPES = [torch.float16, torch.bfloat16]


def _skip_unless_supported(op, dtype, shape, causal, config):
    b, hq, hkv, nq, nk, d = shape
    p = Problem(op, str(dtype).removeprefix("torch."), b, hq, hkv, nq, nk, d, causal)
    why = TorchSDPABackend().not_supported_reasons(p, config, DeviceInfo.from_torch())
    if why:
        if config == "math":
            pytest.fail(f"math must run everything, but says: {why}")
        pytest.skip(f"torch:{config} does not support {p}: {'; '.join(why)}")


def _inputs(shape, dtype, requires_grad=False):
    b, hq, hkv, nq, nk, d = shape

    def make(h, n):
        return torch.randn(b, h, n, d, dtype=dtype, device="cuda").requires_grad_(requires_grad)

    return make(hq, nq), make(hkv, nk), make(hkv, nk)


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_reference(config, dtype, shape, causal):
    _skip_unless_supported("fwd", dtype, shape, causal, config)
    q, k, v = _inputs(shape, dtype)
    scale = 1.3 / math.sqrt(shape[-1])
    backend = TorchSDPABackend()
    out = torch.full_like(q, float("nan"))
    lse = backend.forward(q, k, v, out, config=config, causal=causal, scale=scale, need_lse=True)
    assert lse is not None and lse.device == q.device
    assert_close_to_reference(
        out, q, k, v, causal=causal, scale=scale, lse=lse, what=f"torch:{config}"
    )
    out2 = torch.full_like(q, float("nan"))
    assert (
        backend.forward(q, k, v, out2, config=config, causal=causal, scale=scale, need_lse=False)
        is None
    )
    assert_close_to_reference(
        out2, q, k, v, causal=causal, scale=scale, what=f"torch:{config} no lse"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 33, 33, 64), (1, 2, 1, 113, 203, 128), (1, 2, 2, 203, 113, 64)], ids=str
)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_reference(config, dtype, shape, causal):
    _skip_unless_supported("bwd", dtype, shape, causal, config)
    q, k, v = _inputs(shape, dtype, requires_grad=True)
    out = sparktune.attention(q, k, v, causal=causal, backend="torch", config=config)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close_to_reference(grads, q, k, v, dout, causal=causal, what=f"torch:{config}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_packed_and_misaligned_views(config, offset):
    b, n, h, d = 2, 33, 4, 64
    shape = (b, h, h, n, n, d)
    _skip_unless_supported("fwd", torch.float16, shape, True, config)
    packed = torch.randn(b, n, 3, h, d + offset, dtype=torch.float16, device="cuda")
    q, k, v = (packed[:, :, i, :, offset:] for i in range(3))
    out, lse = sparktune.attention(
        q, k, v, causal=True, layout="bnhd", backend="torch", config=config, return_lse=True
    )
    assert out.shape == q.shape and out.is_contiguous()
    views = [t.transpose(1, 2) for t in (q, k, v, out)]
    assert_close_to_reference(views[3], *views[:3], causal=True, lse=lse, what=f"torch:{config}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_default_dispatch_on_gpu(dtype, causal):
    q, k, v = _inputs((2, 8, 2, 257, 257, 128), dtype, requires_grad=True)
    out, lse = sparktune.attention(q, k, v, causal=causal, return_lse=True)
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse, what="default dispatch")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close_to_reference(grads, q, k, v, dout, causal=causal, what="default dispatch")


# -- the backward from another backend's forward (GPU) ---------------------------------------


def test_backward_runner_is_made_once_per_signature(monkeypatch):
    """A training step asks for the runner in its forward and again in its backward: it is made
    once for the same config, shapes, strides, mask and scale (and, for "auto", the same SDPA
    switches and grad mode), again when any of them differs."""
    made = []

    def fake(config, q, k, v, causal, scale):
        made.append((config, q.stride(), causal, scale))
        return ("run", len(made))

    monkeypatch.setattr(tsdpa, "_backward_op", fake)
    monkeypatch.setattr(tsdpa, "_RUNNERS", {})
    backend = TorchSDPABackend()
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))

    def ask(config="cudnn", q=q, causal=False, scale=0.25):
        return backend.backward_runner(q, k, v, config=config, causal=causal, scale=scale)

    first = ask()
    assert ask() is first and ask(q=q.clone()) is first and len(made) == 1
    assert ask(causal=True) is not first and ask(scale=0.5) is not first and len(made) == 3
    permuted = torch.randn(1, 8, 2, 16).transpose(1, 2)  # the same shape, other strides
    assert ask(q=permuted) is not first and len(made) == 4
    auto = ask("auto")
    assert ask("auto") is auto and len(made) == 5
    with torch.no_grad():  # SDPA's own choice may read grad mode
        assert ask("auto") is not auto
        assert ask("cudnn") is first  # a forced kernel does not
    flash_on = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(not flash_on)
    try:
        assert ask("auto") is not auto and len(made) == 7
    finally:
        torch.backends.cuda.enable_flash_sdp(flash_on)
    assert ask("auto") is auto
    assert ask("efficient") is None and len(made) == 7  # not a runner config: never made
    monkeypatch.setattr(tsdpa, "_RUNNERS_MAX", 2)
    monkeypatch.setattr(tsdpa, "_RUNNERS", {})
    for s in (0.1, 0.2, 0.3):
        ask(scale=s)
    assert len(tsdpa._RUNNERS) <= 2  # bounded: it starts again when full


@pytest.mark.gpu
@pytest.mark.parametrize("config", tsdpa.RUNNER_BACKWARD_CONFIGS)
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 33, 33, 64), (1, 2, 1, 113, 203, 128), (1, 2, 2, 203, 113, 64),
     (2, 3, 3, 1000, 1000, 128), (1, 4, 4, 4097, 4097, 64), (1, 8, 2, 1, 17, 128)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_backward_runner_takes_another_forwards_output_and_lse(config, dtype, shape, causal, layout):
    """cuDNN's and flash's backward ops (and SDPA's own choice where it is one of them) run
    from an output and a log-sum-exp that another implementation computed (here the float32
    reference), on odd shapes, GQA and (B, N, H, D) views; gradients obey the 2x rule against
    float64, and the backend's ``backward`` writes the same bits into its buffers."""
    _skip_unless_supported("bwd", dtype, shape, causal, config)
    b, hq, hk, nq, nk, d = shape

    def make(h, n):  # (B, H, N, D) views, of (B, N, H, D) storage for "bnhd"
        if layout == "bnhd":
            return torch.randn(b, n, h, d, dtype=dtype, device="cuda").transpose(1, 2)
        return torch.randn(b, h, n, d, dtype=dtype, device="cuda")

    q, k, v = make(hq, nq), make(hk, nk), make(hk, nk)
    scale = 1.3 / math.sqrt(d)
    backend = TorchSDPABackend()
    run = backend.backward_runner(q, k, v, config=config, causal=causal, scale=scale)
    kernel = tsdpa._auto_kernel(q, k, v, causal, scale) if config == "auto" else config
    expected = (
        kernel in ("cudnn", "flash")
        and not (causal and nq != nk)
        and tsdpa._borrowable(kernel, q, k, causal, op="bwd")
    )
    if not expected:
        assert run is None
        pytest.skip(f"torch:{config} ({kernel}) recomputes its forward for {shape}")
    assert run is not None
    out, lse = reference_attention(q, k, v, causal, scale, torch.float32)
    out = out.to(dtype)
    dout = torch.randn_like(out)
    grads = run(dout, q, k, v, out, lse)
    assert grads is not None
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == dtype
    assert_grads_close_to_reference(grads, q, k, v, dout, causal=causal, scale=scale, what=f"torch:{config} runner")
    buffers = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    backend.backward(dout, q, k, v, out, lse, *buffers, config=config, causal=causal, scale=scale)
    assert_grads_close_to_reference(
        tuple(buffers), q, k, v, dout, causal=causal, scale=scale, what=f"torch:{config} backward"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_training_call_pairs_another_forward_with_the_cudnn_backward(monkeypatch, layout):
    """Dispatch gives the forward to another backend (Triton's when it runs, else the
    reference) and the backward to torch:cudnn: the call runs that forward and cuDNN's backward
    from its output and log-sum-exp, with gradients right."""
    from sparktune import dispatch, registry
    from sparktune.backends.base import Candidate

    shape = (2, 4, 4, 1000, 1000, 128)
    _skip_unless_supported("bwd", torch.bfloat16, shape, True, "cudnn")
    fwd = Candidate("reference", "float32")
    try:
        triton_backend = registry.get_backend("triton")
        p = Problem("fwd", "bfloat16", 2, 4, 4, 1000, 1000, 128, True)
        cfg = triton_backend.default_config(p, DeviceInfo.from_torch())
        if cfg is not None and not triton_backend.runnable_reasons(p, cfg, DeviceInfo.from_torch()):
            fwd = Candidate("triton", cfg)
    except Exception:  # noqa: BLE001 - the reference forward serves
        pass
    real_select = dispatch.select
    picked = {"fwd": fwd, "bwd": Candidate("torch", "cudnn")}

    def select(problem, device=None, **kw):
        if kw.get("backend") is None and problem.op in picked:
            return dispatch.Selection(picked[problem.op], "tuned")
        return real_select(problem, device, **kw)

    monkeypatch.setattr(dispatch, "select", select)
    from sparktune import _autograd

    monkeypatch.setattr(_autograd, "PAIR_MIN_FORWARD_MS", 0.0)  # these selections have no record
    dispatch.invalidate_selections()
    calls = []
    real_op = tsdpa._backward_op

    def spy(config, *args):
        run = real_op(config, *args)
        calls.append((config, run is not None))
        return run

    monkeypatch.setattr(tsdpa, "_backward_op", spy)
    monkeypatch.setattr(tsdpa, "_RUNNERS", {})  # none made by the tests before
    b, hq, hk, n, _, d = shape
    dims = (b, n, "h", d) if layout == "bnhd" else (b, "h", n, d)
    q, k, v = (
        torch.randn([h if x == "h" else x for x in dims], dtype=torch.bfloat16, device="cuda").requires_grad_()
        for h in (hq, hk, hk)
    )
    out = sparktune.attention(q, k, v, causal=True, layout=layout)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dispatch.invalidate_selections()
    assert calls and all(c == ("cudnn", True) for c in calls), calls
    views = [t.transpose(1, 2) if layout == "bnhd" else t for t in (*grads, q, k, v, dout)]
    assert_grads_close_to_reference(tuple(views[:3]), *views[3:], causal=True, what=f"{fwd.label} + cudnn")
