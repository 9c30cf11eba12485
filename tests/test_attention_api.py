"""The public ``sparktune.attention()`` on CPU: results, layouts, strides, errors, warnings,
gradients."""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch

import sparktune
from sparktune import _plan as plan_mod
from sparktune import registry
from sparktune._autograd import recorded_for_backward
from sparktune.backends.base import Backend
from sparktune.backends.reference import ReferenceBackend, reference_attention
from sparktune.dispatch import NoKernelError
from tests._oracle import assert_close_to_reference, assert_grads_close_to_reference

api = importlib.import_module(
    "sparktune.attention"
)  # the module (the package exports the function)

DTYPES = [torch.float16, torch.bfloat16]

# CPU tensors always take the fallback; its warning is tested on its own below
pytestmark = pytest.mark.filterwarnings("ignore:sparktune. attention runs on the fallback")


@pytest.fixture(autouse=True)
def _fresh_warnings():
    plan_mod.warn_once.clear()
    yield
    plan_mod.warn_once.clear()


def qkv(b=2, hq=4, hkv=2, nq=17, nk=33, d=16, dtype=torch.float16, requires_grad=False):
    def make(h, n):
        return torch.randn(b, h, n, d, dtype=dtype).requires_grad_(requires_grad)

    return make(hq, nq), make(hkv, nk), make(hkv, nk)


class SpyBackend(ReferenceBackend):
    """The reference math that records what it was given (and has no backward)."""

    name = "spy"
    tunable = False
    backward = Backend.backward  # the interface's default: "no backward"

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, q, k, v, out, **kw):
        self.calls.append(
            {
                n: (t.data_ptr(), t.shape, t.stride())
                for n, t in zip("qkvo", (q, k, v, out), strict=True)
            }
        )
        return super().forward(q, k, v, out, **kw)


@pytest.fixture
def spy():
    backend = SpyBackend()
    registry.register_backend(backend)
    yield backend
    registry.unregister_backend("spy")


# -- results ----------------------------------------------------------------------------------

SHAPES = [  # (batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim)
    (1, 1, 1, 1, 1, 16),
    (2, 4, 2, 17, 33, 16),
    (1, 3, 3, 33, 17, 32),
    (2, 8, 1, 33, 33, 8),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_default_dispatch_matches_reference(dtype, shape, causal):
    q, k, v = qkv(*shape, dtype=dtype)
    out, lse = sparktune.attention(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    assert_close_to_reference(out, q, k, v, causal=causal, lse=lse)


@pytest.mark.parametrize(
    "backend,config", [("reference", None), ("reference", "float64"), ("torch", "math")]
)
def test_forced_backends_match_reference(backend, config):
    q, k, v = qkv(nq=33, nk=17)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a forced choice is not announced as a fallback
        out, lse = sparktune.attention(
            q, k, v, causal=True, scale=0.3, backend=backend, config=config, return_lse=True
        )
    assert_close_to_reference(out, q, k, v, causal=True, scale=0.3, lse=lse)
    assert torch.all(out[:, :, :16] == 0) and torch.isneginf(lse[:, :, :16]).all()


def test_forced_backend_that_cannot_run_says_why():
    q, k, v = qkv()
    with pytest.raises(NoKernelError, match=r"config 'flash' cannot run .*\n  torch: needs CUDA"):
        sparktune.attention(q, k, v, backend="torch", config="flash")
    with pytest.raises(ValueError, match="unknown backend 'nope'.*reference"):
        sparktune.attention(q, k, v, backend="nope")


# -- layouts and strides ----------------------------------------------------------------------


def test_bnhd_layout_gives_bnhd_output():
    q, k, v = qkv(nq=17, nk=17)
    qn, kn, vn = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out = sparktune.attention(qn, kn, vn, causal=True, layout="bnhd")
    assert out.shape == qn.shape and out.is_contiguous()
    expected = sparktune.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_packed_qkv_slices_reach_the_backend_uncopied(spy, layout):
    b, n, h, d = 2, 17, 4, 16
    if layout == "bnhd":
        packed = torch.randn(b, n, 3, h, d, dtype=torch.float16)
        q, k, v = (packed[:, :, i] for i in range(3))
    else:
        packed = torch.randn(b, h, 3, n, d, dtype=torch.float16)  # heads outermost, then q/k/v
        q, k, v = (packed[:, :, i] for i in range(3))
    assert not q.is_contiguous()
    out = sparktune.attention(q, k, v, layout=layout, backend="spy")
    (call,) = spy.calls
    for name, t in zip("qkv", (q, k, v), strict=True):
        view = t if layout == "bhnd" else t.transpose(1, 2)
        assert call[name] == (t.data_ptr(), view.shape, view.stride()), name
    o_view = out if layout == "bhnd" else out.transpose(1, 2)
    assert call["o"] == (out.data_ptr(), o_view.shape, o_view.stride())
    assert out.is_contiguous() and out.shape == q.shape
    views = [t if layout == "bhnd" else t.transpose(1, 2) for t in (q, k, v, out)]
    assert_close_to_reference(views[3], *views[:3])


# -- bad inputs -------------------------------------------------------------------------------

H = torch.float16


def _t(*shape, dtype=H):
    return torch.randn(*shape, dtype=dtype)


GOOD = (_t(2, 4, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16))

# fmt: off
BAD = [
    # id, (q, k, v), kwargs, error type, message pattern
    ("not-a-tensor", ([[1.0]], GOOD[1], GOOD[2]), {}, TypeError, r"q must be a torch\.Tensor, got list"),
    ("v-not-a-tensor", (GOOD[0], GOOD[1], None), {}, TypeError, r"v must be a torch\.Tensor, got NoneType"),
    ("layout", GOOD, {"layout": "nbhd"}, ValueError, r"unknown layout 'nbhd'; supported layouts: 'bhnd'.*'bnhd'"),
    ("layout-list", GOOD, {"layout": ["bhnd"]}, ValueError, r"unknown layout \['bhnd'\]; supported layouts: 'bhnd'"),
    ("ndim", (_t(4, 8, 16), GOOD[1], GOOD[2]), {}, ValueError, r"q must be 4-dimensional .* got shape \(4, 8, 16\)"),
    ("dtypes-differ", (GOOD[0], _t(2, 2, 8, 16, dtype=torch.bfloat16), GOOD[2]), {}, TypeError,
     r"same dtype, got q float16, k bfloat16, v float16"),
    ("float32", tuple(t.float() for t in GOOD), {}, TypeError,
     r"dtype float32 is not supported; sparktune.attention supports float16 and bfloat16"),
    ("float64", tuple(t.double() for t in GOOD), {}, TypeError, r"dtype float64 is not supported"),
    ("batch", (_t(3, 4, 8, 16), GOOD[1], GOOD[2]), {}, ValueError, r"batch sizes differ: q has 3, k and v have 2"),
    ("head-dim", (_t(2, 4, 8, 32), GOOD[1], GOOD[2]), {}, ValueError, r"head_dim differs: q has 32, k and v have 16"),
    ("kv-shapes", (GOOD[0], GOOD[1], _t(2, 2, 9, 16)), {}, ValueError,
     r"k and v must have the same shape, got k \(2, 2, 8, 16\) and v \(2, 2, 9, 16\)"),
    ("gqa", (_t(2, 3, 8, 16), GOOD[1], GOOD[2]), {}, ValueError,
     r"heads of q \(3\) must be a multiple of heads of k and v \(2\)"),
    ("empty-batch", (_t(0, 4, 8, 16), _t(0, 2, 8, 16), _t(0, 2, 8, 16)), {}, ValueError,
     r"q is empty \(batch=0, .*every dimension must be at least 1"),
    ("empty-seqlen-k", (GOOD[0], _t(2, 2, 0, 16), _t(2, 2, 0, 16)), {}, ValueError, r"k is empty \(.*seqlen=0"),
    ("empty-heads", (_t(2, 0, 8, 16), _t(2, 0, 8, 16), _t(2, 0, 8, 16)), {}, ValueError,
     r"q is empty \(batch=2, heads=0"),
    ("strided-last-dim", (_t(2, 4, 8, 32)[..., ::2], GOOD[1], GOOD[2]), {}, ValueError,
     r"last dimension of q must be contiguous \(stride 1\), got strides \(1024, 256, 32, 2\)"),
    ("scale-nan", GOOD, {"scale": float("nan")}, ValueError, r"scale must be a finite positive number, got nan"),
    ("scale-inf", GOOD, {"scale": math.inf}, ValueError, r"scale must be a finite positive number, got inf"),
    ("scale-zero", GOOD, {"scale": 0.0}, ValueError, r"scale must be a finite positive number, got 0.0"),
    ("scale-negative", GOOD, {"scale": -1}, ValueError, r"scale must be a finite positive number, got -1"),
    ("scale-str", GOOD, {"scale": "0.1"}, TypeError, r"scale must be a real number or None, got '0.1'"),
    ("scale-bool", GOOD, {"scale": True}, TypeError, r"scale must be a real number or None, got True"),
    ("config-without-backend", GOOD, {"config": "math"}, ValueError, r"config= needs backend="),
]
# fmt: on


@pytest.mark.parametrize(
    "inputs,kwargs,error,pattern", [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_inputs_raise(inputs, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        sparktune.attention(*inputs, **kwargs)


def test_devices_differ():
    meta = torch.empty(2, 2, 8, 16, dtype=H, device="meta")
    with pytest.raises(ValueError, match=r"same device, got q on cpu, k on meta, v on cpu"):
        sparktune.attention(GOOD[0], meta, GOOD[2])


def test_bnhd_errors_name_the_bnhd_dims():
    with pytest.raises(ValueError, match=r"\(batch, seqlen, heads, head_dim\) for layout 'bnhd'"):
        sparktune.attention(_t(8, 4, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16), layout="bnhd")
    # bnhd: heads are dimension 2
    with pytest.raises(
        ValueError, match=r"heads of q \(3\) must be a multiple of heads of k and v \(2\)"
    ):
        sparktune.attention(_t(2, 8, 3, 16), _t(2, 8, 2, 16), _t(2, 8, 2, 16), layout="bnhd")


# -- warnings ---------------------------------------------------------------------------------


def test_fallback_warning_appears_once():
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            sparktune.attention(q, k, v)
    fallback = [w for w in caught if "fallback" in str(w.message)]
    assert len(fallback) == 1, [str(w.message) for w in caught]
    assert issubclass(fallback[0].category, RuntimeWarning)
    assert "tensors are on cpu" in str(fallback[0].message)
    assert fallback[0].filename == __file__  # points at the caller


# -- autograd ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 17, 33, 16), (1, 2, 2, 33, 17, 8), (1, 1, 1, 1, 1, 8)], ids=str
)
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_reference(dtype, shape, causal):
    q, k, v = qkv(*shape, dtype=dtype, requires_grad=True)
    out = sparktune.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.dtype for g in grads] == [dtype] * 3
    assert_grads_close_to_reference(grads, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("backend,config", [("reference", "float32"), ("torch", "math")])
def test_gradients_bnhd_packed(backend, config):
    b, n, h, d = 2, 17, 4, 16
    packed = torch.randn(b, n, 3, h, d, dtype=torch.float16, requires_grad=True)
    q, k, v = (packed[:, :, i] for i in range(3))
    out = sparktune.attention(q, k, v, causal=True, layout="bnhd", backend=backend, config=config)
    dout = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, packed, dout)
    views = [t.transpose(1, 2) for t in (q, k, v)]
    assert_grads_close_to_reference(
        [grad[:, :, i].transpose(1, 2) for i in range(3)], *views, dout.transpose(1, 2), causal=True
    )


def test_backend_without_backward_falls_back_with_one_warning(spy):
    q, k, v = qkv(requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = sparktune.attention(q, k, v, causal=True, backend="spy")
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    notes = [str(w.message) for w in caught if "has no backward" in str(w.message)]
    assert len(notes) == 1 and "float32 reference" in notes[0]
    assert_grads_close_to_reference(grads, q, k, v, dout, causal=True)


class ForwardOnlyBackend(SpyBackend):
    """Offers no configuration for the backward at all."""

    name = "fwdonly"

    def configs(self, op="fwd"):
        return super().configs(op) if op == "fwd" else ()


def test_backward_without_any_kernel_falls_back_with_one_warning():
    registry.register_backend(ForwardOnlyBackend())
    try:
        q, k, v = qkv(requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sparktune.attention(q, k, v, backend="fwdonly")
            dout = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        registry.unregister_backend("fwdonly")
    (note,) = [str(w.message) for w in caught if "backward" in str(w.message)]
    assert "no backend can run the backward of Problem(op='bwd'" in note
    assert_grads_close_to_reference(grads, q, k, v, dout)


def test_backward_kernel_is_dispatched_for_the_bwd_problem(monkeypatch):
    from sparktune import dispatch

    seen = []
    real_select = dispatch.select

    def select(problem, device, **kw):
        seen.append((problem.op, kw))
        return real_select(problem, device, **kw)

    monkeypatch.setattr(dispatch, "select", select)
    q, k, v = qkv(requires_grad=True)
    sparktune.attention(q, k, v).sum().backward()
    sparktune.attention(q, k, v, backend="reference", config="float64").sum().backward()
    assert seen == [
        ("fwd", {"backend": None, "config": None}),
        ("bwd", {}),
        ("fwd", {"backend": "reference", "config": "float64"}),
        ("bwd", {"backend": "reference", "config": "float64"}),  # the forced choice holds
    ]


def test_only_requested_grads_and_lse_not_differentiable():
    q, k, v = qkv()
    k.requires_grad_()
    out, lse = sparktune.attention(q, k, v, return_lse=True)
    assert out.grad_fn is not None and not lse.requires_grad
    out.sum().backward()
    assert q.grad is None and v.grad is None and k.grad is not None


def test_no_grad_path_builds_no_graph(spy):
    q, k, v = qkv(requires_grad=True)
    with torch.no_grad():
        out = sparktune.attention(q, k, v, backend="spy")
    assert out.grad_fn is None and not out.requires_grad
    out = sparktune.attention(*(t.detach() for t in (q, k, v)), backend="spy")
    assert out.grad_fn is None


def test_return_lse_shape_for_bnhd():
    q, k, v = (t.transpose(1, 2) for t in qkv(nq=17, nk=17))
    out, lse = sparktune.attention(q, k, v, layout="bnhd", return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 17) and lse.dtype == torch.float32
    _, ref_lse = reference_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-4, atol=1e-4)


class CountingReference(ReferenceBackend):
    """The reference backend, counting its backward calls."""

    name = "counting-reference"
    tunable = False

    def __init__(self):
        super().__init__()
        self.backwards = 0

    def backward(self, *args, **kw):
        self.backwards += 1
        return super().backward(*args, **kw)


def test_recorded_for_backward_runs_the_training_backward():
    """What the tuner times for a backward candidate: autograd's engine, sparktune's autograd
    function, then that backend's backward with the config given; gradients as the math's."""
    b = CountingReference()
    registry.register_backend(b, replace=True)
    try:
        q, k, v = qkv(nq=9, nk=9)
        dout = torch.randn_like(q)
        out, lse = reference_attention(q, k, v, causal=True)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        rec = recorded_for_backward(
            b, "float32", *leaves, out.to(q.dtype), lse.float(), causal=True, scale=16**-0.5
        )
        for _ in range(2):
            grads = torch.autograd.grad(rec, leaves, dout, retain_graph=True)
        assert b.backwards == 2
        assert_grads_close_to_reference(grads, q, k, v, dout, causal=True)
        with pytest.raises(NoKernelError):
            recorded_for_backward(
                b, "no-such-config", *leaves, out, lse, causal=True, scale=0.25
            )
    finally:
        registry.unregister_backend(b.name)
