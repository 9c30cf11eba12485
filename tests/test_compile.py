"""``sparktune.attention()`` under ``torch.compile``: the ``sparktune::attention_fwd`` and
``sparktune::attention_bwd`` custom ops (``torch.library.opcheck``), a model compiled with
``fullgraph=True`` against the same model run eagerly (CPU, and CUDA on a GPU machine), graph
breaks, errors, and the strides of the gradients."""

from __future__ import annotations

import functools
import importlib
import re

import pytest
import torch
from torch import nn

import sparktune
from sparktune import _ops
from sparktune import _plan as plan_mod
from sparktune._execute import grad_buffer
from sparktune.dispatch import NoKernelError
from tests._oracle import assert_close_to_reference, assert_grads_close_to_reference

api = importlib.import_module("sparktune.attention")

# CPU tensors always take the fallback (tests/test_attention_api.py tests its warning)
pytestmark = pytest.mark.filterwarnings("ignore:sparktune. attention runs on the fallback")

#: what opcheck runs when it is given no test_utils
OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)
#: opcheck utilities that compare only metadata (no values), for the GPU check
OPCHECK_METADATA_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# -- inputs -----------------------------------------------------------------------------------


def make_qkv(
    b=2,
    hq=4,
    hk=2,
    nq=9,
    nk=13,
    d=16,
    *,
    dtype=torch.float16,
    layout="bhnd",
    form="contiguous",
    device="cpu",
    requires_grad=False,
):
    """q, k, v in ``layout``, as leaves. ``form``: "contiguous" in the layout; "permuted":
    dense but laid out as the other layout (a transposed contiguous tensor); "packed": slices
    of one (B, N, Hq + 2 Hkv, D) tensor (needs nq == nk), not dense."""

    def as_layout(t_bnhd):
        return t_bnhd if layout == "bnhd" else t_bnhd.transpose(1, 2)

    if form == "packed":
        assert nq == nk
        packed = torch.randn(b, nq, hq + 2 * hk, d, dtype=dtype, device=device)
        tensors = [as_layout(t) for t in packed.split([hq, hk, hk], dim=2)]
    else:
        tensors = []
        for h, n in ((hq, nq), (hk, nk), (hk, nk)):
            if (form == "permuted") == (layout == "bhnd"):
                t = as_layout(torch.randn(b, n, h, d, dtype=dtype, device=device))
            else:
                t = torch.randn(b, h, n, d, dtype=dtype, device=device)
                t = t if layout == "bhnd" else t.transpose(1, 2)
            tensors.append(t)
        if form == "contiguous":
            assert all(t.is_contiguous() for t in tensors)
    return tuple(t.detach().requires_grad_(requires_grad) for t in tensors)


def bhnd(t, layout):
    return t if layout == "bhnd" else t.transpose(1, 2)


# -- opcheck ----------------------------------------------------------------------------------

# (name, make_qkv arguments, attention_fwd's scalars: causal, scale, backend, config,
#  allow_fp16_accum, need_lse)
FWD_CASES = [
    ("gqa-bhnd-fp16", {"dtype": torch.float16}, (False, None, None, None, False, True)),
    ("gqa-bhnd-bf16-causal", {"dtype": torch.bfloat16}, (True, None, None, None, False, True)),
    (
        "gqa-bnhd-fp16-causal-long-q",  # rows that see no key
        {"dtype": torch.float16, "layout": "bnhd", "nq": 13, "nk": 9},
        (True, 0.3, None, None, False, True),
    ),
    (
        "bnhd-bf16-reference",
        {"dtype": torch.bfloat16, "layout": "bnhd", "hq": 3, "hk": 3},
        (False, None, "reference", "float64", False, True),
    ),
    (
        "bhnd-reference-causal-fp16-accum",
        {"dtype": torch.float16, "nq": 13, "nk": 13},
        (True, 0.25, "reference", None, True, True),
    ),
    (
        "permuted-bhnd-causal",
        {"dtype": torch.bfloat16, "form": "permuted"},
        (True, None, None, None, False, True),
    ),
    (
        "permuted-bnhd",
        {"dtype": torch.float16, "layout": "bnhd", "form": "permuted"},
        (False, None, "reference", "float32", False, True),
    ),
    (
        "packed-bnhd-causal",
        {"dtype": torch.float16, "layout": "bnhd", "form": "packed", "nq": 11, "nk": 11},
        (True, None, None, None, False, True),
    ),
    (
        "packed-bhnd",
        {"dtype": torch.bfloat16, "form": "packed", "nq": 11, "nk": 11},
        (False, None, "reference", "float32", False, True),
    ),
    ("no-lse", {"dtype": torch.float16, "layout": "bnhd"}, (True, None, None, None, False, False)),
]


def _fwd_args(kwargs, scalars, requires_grad):
    layout = kwargs.get("layout", "bhnd")
    q, k, v = make_qkv(**kwargs, requires_grad=requires_grad)
    causal, scale, backend, config, fp16, need_lse = scalars
    return (q, k, v, causal, scale, layout, backend, config, fp16, need_lse)


@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize(
    "kwargs,scalars", [c[1:] for c in FWD_CASES], ids=[c[0] for c in FWD_CASES]
)
def test_opcheck_attention_fwd(kwargs, scalars, requires_grad):
    args = _fwd_args(kwargs, scalars, requires_grad)
    result = torch.library.opcheck(torch.ops.sparktune.attention_fwd.default, args)
    assert set(result) == set(OPCHECK_UTILS) and set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize(
    "kwargs,scalars", [c[1:] for c in FWD_CASES], ids=[c[0] for c in FWD_CASES]
)
def test_opcheck_attention_bwd(kwargs, scalars):
    q, k, v, causal, scale, layout, backend, config, fp16, need_lse = _fwd_args(
        kwargs, scalars, False
    )
    out, lse = _ops.attention_fwd(q, k, v, causal, scale, layout, backend, config, fp16, need_lse)
    # an output gradient with other strides than out's (a slice of a wider tensor)
    wide = torch.randn(*out.shape[:-1], out.shape[-1] + 8, dtype=out.dtype)
    dout = wide[..., : out.shape[-1]]
    args = (dout, q, k, v, out, lse, causal, scale, layout, backend, config, fp16)
    result = torch.library.opcheck(torch.ops.sparktune.attention_bwd.default, args)
    assert set(result) == set(OPCHECK_UTILS) and set(result.values()) == {"SUCCESS"}, result


# -- the ops' results -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,scalars", [c[1:] for c in FWD_CASES], ids=[c[0] for c in FWD_CASES]
)
def test_ops_match_reference_with_the_promised_metadata(kwargs, scalars):
    q, k, v, causal, scale, layout, backend, config, fp16, need_lse = _fwd_args(
        kwargs, scalars, False
    )
    out, lse = _ops.attention_fwd(q, k, v, causal, scale, layout, backend, config, fp16, need_lse)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    qb, kb, vb = (bhnd(t, layout) for t in (q, k, v))
    assert lse.dtype == torch.float32 and lse.is_contiguous()
    if need_lse:
        assert lse.shape == qb.shape[:3]
    else:
        assert lse.shape == (0,)
    assert_close_to_reference(
        bhnd(out, layout), qb, kb, vb, causal=causal, scale=scale, lse=lse if need_lse else None
    )
    dout = torch.randn_like(out)
    grads = _ops.attention_bwd(
        dout, q, k, v, out, lse, causal, scale, layout, backend, config, fp16
    )
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype
        if kwargs.get("form") == "packed":
            assert g.is_contiguous()
        else:
            assert g.stride() == t.stride()
    assert_grads_close_to_reference(
        [bhnd(g, layout) for g in grads], qb, kb, vb, bhnd(dout, layout), causal=causal, scale=scale
    )


def test_bwd_recomputes_a_missing_lse():
    q, k, v = make_qkv(nq=13, nk=9)
    scalars = (True, None, "bhnd", None, None, False)
    out, lse = _ops.attention_fwd(q, k, v, *scalars, True)
    out_no_lse, no_lse = _ops.attention_fwd(q, k, v, *scalars, False)
    assert no_lse.shape == (0,)
    torch.testing.assert_close(out_no_lse, out, rtol=0, atol=0)
    dout = torch.randn_like(out)
    expected = _ops.attention_bwd(dout, q, k, v, out, lse, *scalars)
    got = _ops.attention_bwd(dout, q, k, v, out, no_lse, *scalars)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_op_lse_is_not_differentiable():
    q, k, v = make_qkv(requires_grad=True)
    out, lse = _ops.attention_fwd(q, k, v, False, None, "bhnd", None, None, False, True)
    assert out.requires_grad and not lse.requires_grad
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    eager = sparktune.attention(q, k, v)
    (dq_eager,) = torch.autograd.grad(eager.float().sum(), q)
    torch.testing.assert_close(dq, dq_eager, rtol=0, atol=0)


# -- a compiled model -------------------------------------------------------------------------


class Block(nn.Module):
    """A QKV projection, sparktune.attention on its (packed) head slices, an output
    projection."""

    def __init__(self, dim=32, heads=4, heads_kv=2, head_dim=16, *, layout="bnhd", causal=True):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, head_dim
        self.layout, self.causal = layout, causal
        self.qkv = nn.Linear(dim, (heads + 2 * heads_kv) * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, self.heads + 2 * self.heads_kv, self.head_dim)
        q, k, v = qkv.split([self.heads, self.heads_kv, self.heads_kv], dim=2)
        if self.layout == "bhnd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = sparktune.attention(q, k, v, causal=self.causal, layout=self.layout)
        if self.layout == "bhnd":
            o = o.transpose(1, 2)
        return self.out(o.reshape(b, n, -1))


def _tolerance(dtype):
    return {torch.float16: 5e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-5)


def assert_close(actual, expected, what):
    """Close within the dtype's rounding, relative to the largest value of ``expected``."""
    tol = _tolerance(expected.dtype)
    atol = tol * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=tol, atol=atol, msg=lambda m: f"{what}: {m}")


def run_model(fn, model, x):
    """(output, gradients of the input and of every parameter of ``model``) of ``fn(x)`` (the
    model or its compiled form), for a random output gradient (the same for every run)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = fn(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
    y.backward(dy)
    grads = {"x": x.grad, **{n: p.grad for n, p in model.named_parameters()}}
    return y.detach(), grads


def compare_compiled(model, xs, *, backend, dynamic=None):
    """Run ``model`` compiled (fullgraph) and eagerly on every input of ``xs``; compare."""
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    for x in xs:
        y_c, g_c = run_model(compiled, model, x)
        y_e, g_e = run_model(model, model, x)
        assert y_c.shape == y_e.shape and y_c.dtype == y_e.dtype
        assert_close(y_c, y_e, f"{backend} output, input {tuple(x.shape)}")
        assert g_c.keys() == g_e.keys()
        for name in g_e:
            assert g_c[name] is not None and g_c[name].dtype == g_e[name].dtype, name
            assert_close(g_c[name], g_e[name], f"{backend} gradient of {name}")


@functools.cache
def _inductor_works() -> str | None:
    """Why inductor cannot compile on this machine's CPU (None when it can)."""
    try:
        fn = torch.compile(lambda t: (t * 2).sin(), backend="inductor", fullgraph=True)
        t = torch.randn(8)
        torch.testing.assert_close(fn(t), (t * 2).sin())
    except Exception as exc:  # noqa: BLE001 - any failure is the reason to skip
        return f"inductor cannot compile on this CPU: {type(exc).__name__}: {exc}"
    finally:
        torch._dynamo.reset()
    return None


BACKENDS = [
    "eager",
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtype,layout,causal",
    [(torch.bfloat16, "bnhd", True), (torch.float16, "bhnd", False)],
    ids=["bf16-bnhd-causal", "fp16-bhnd"],
)
def test_compiled_model_matches_eager(backend, dtype, layout, causal):
    if backend == "inductor" and (why := _inductor_works()):
        pytest.skip(why)
    model = Block(layout=layout, causal=causal).to(dtype)
    compare_compiled(model, [torch.randn(2, 17, 32, dtype=dtype)], backend=backend)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_dynamic_shapes_compile_once(backend):
    if backend == "inductor" and (why := _inductor_works()):
        pytest.skip(why)
    from torch._dynamo.utils import counters

    counters.clear()
    model = Block().to(torch.bfloat16)
    xs = [torch.randn(2, n, 32, dtype=torch.bfloat16) for n in (17, 40)]
    compare_compiled(model, xs, backend=backend, dynamic=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_no_graph_break_and_the_op_is_in_the_graph():
    model = Block().to(torch.bfloat16)
    x = torch.randn(2, 17, 32, dtype=torch.bfloat16)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    (graph,) = explanation.graphs
    assert "torch.ops.sparktune.attention_fwd" in graph.code


def test_compiled_backward_has_no_graph_break():
    from torch._dynamo.utils import counters

    counters.clear()
    model = Block().to(torch.bfloat16)
    compiled = torch.compile(model, backend="aot_eager")  # not fullgraph: breaks are counted
    run_model(compiled, model, torch.randn(2, 17, 32, dtype=torch.bfloat16))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_call_uses_the_op_and_eager_call_does_not(monkeypatch):
    plans = []
    real = plan_mod.op_plan

    def recording(*args):
        plans.append(args[3:])
        return real(*args)

    monkeypatch.setattr(_ops, "op_plan", recording)
    q, k, v = make_qkv(requires_grad=True)
    eager = sparktune.attention(q, k, v, causal=True, scale=0.5)
    eager.sum().backward()
    assert plans == []
    fn = torch.compile(
        lambda a, b, c: sparktune.attention(a, b, c, causal=True, scale=0.5),
        backend="aot_eager",
        fullgraph=True,
    )
    fn(q, k, v).sum().backward()
    expected = (True, 0.5, "bhnd", None, None, False)
    assert plans == [expected, expected]  # the forward, then the backward


def test_compiled_return_lse_and_forced_backend():
    q, k, v = make_qkv(nq=13, nk=9, requires_grad=True)

    def fn(a, b, c):
        return sparktune.attention(
            a, b, c, causal=True, backend="reference", config="float64", return_lse=True
        )

    out, lse = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    out_e, lse_e = fn(q, k, v)
    assert out.requires_grad and not lse.requires_grad
    torch.testing.assert_close(out, out_e, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_e, rtol=0, atol=0)
    assert torch.isneginf(lse[:, :, :4]).all()


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_compiled_scale_given_as_an_input(dynamic):
    q, k, v = make_qkv()

    def fn(a, b, c, scale):
        return sparktune.attention(a, b, c, scale=scale)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for scale in (0.3, 0.45, 2):
        torch.testing.assert_close(compiled(q, k, v, scale), fn(q, k, v, scale), rtol=0, atol=0)
    with pytest.raises(Exception, match=re.escape("scale must be a finite positive number")):
        compiled(q, k, v, -0.5)


def test_exported_model_has_the_op_and_a_dynamic_seqlen():
    model = Block().to(torch.bfloat16)
    x = torch.randn(2, 17, 32, dtype=torch.bfloat16)
    seqlen = torch.export.Dim("seqlen", min=2, max=1024)
    exported = torch.export.export(model, (x,), dynamic_shapes=({1: seqlen},))
    assert "sparktune.attention_fwd" in str(exported.graph)
    with torch.no_grad():
        for n in (17, 30):
            x = torch.randn(2, n, 32, dtype=torch.bfloat16)
            assert_close(exported.module()(x), model(x), f"exported, seqlen {n}")


# -- errors -----------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype)


_K = _t(2, 2, 8, 16)
# (name, (q, k, v), kwargs, error, message)
BAD = [
    ("heads", (_t(2, 3, 8, 16), _K, _K), {}, ValueError,
     "heads of q (3) must be a multiple of heads of k and v (2)"),
    ("dtype", (_t(2, 4, 8, 16).float(), _K.float(), _K.float()), {}, TypeError,
     "dtype float32 is not supported"),
    ("layout", (_t(2, 4, 8, 16), _K, _K), {"layout": "nbhd"}, ValueError, "unknown layout 'nbhd'"),
    ("scale", (_t(2, 4, 8, 16), _K, _K), {"scale": -1.0}, ValueError,
     "scale must be a finite positive number, got -1.0"),
    ("scale-str", (_t(2, 4, 8, 16), _K, _K), {"scale": "0.1"}, TypeError,
     "scale must be a real number or None, got '0.1'"),
    ("strided-last-dim", (_t(2, 4, 8, 32)[..., ::2], _K, _K), {}, ValueError,
     "last dimension of q must be contiguous"),
]  # fmt: skip


@pytest.mark.parametrize(
    "inputs,kwargs,error,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_compiled_bad_inputs_raise_the_eager_errors(inputs, kwargs, error, message):
    def fn(q, k, v):
        return sparktune.attention(q, k, v, **kwargs)

    with pytest.raises(error, match=re.escape(message)):
        fn(*inputs)
    # without fullgraph, the frame that raises runs eagerly: the very same error
    with pytest.raises(error, match=re.escape(message)):
        torch.compile(fn, backend="aot_eager")(*inputs)
    # with fullgraph, Dynamo reports the error it observed, message included
    with pytest.raises(Exception, match=re.escape(message)):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)


def test_compiled_forced_backend_that_cannot_run_says_why():
    q, k, v = make_qkv()

    def fn(a, b, c):
        return sparktune.attention(a, b, c, backend="torch", config="flash")

    with pytest.raises(NoKernelError, match=r"config 'flash' cannot run .*\n  torch: needs CUDA"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)


# -- gradient strides -------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gradients_keep_dense_strides(compiled, layout):
    q, k, v = make_qkv(layout=layout, form="permuted", dtype=torch.bfloat16, requires_grad=True)
    assert not q.is_contiguous()

    def fn(a, b, c):
        return sparktune.attention(a, b, c, causal=True, layout=layout)

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape
        if compiled:  # eager on CPU runs the native path (torch:math): PyTorch's strides
            assert g.stride() == t.stride(), (g.stride(), t.stride())
    assert_grads_close_to_reference(
        [bhnd(g, layout) for g in grads],
        *(bhnd(t, layout) for t in (q, k, v)),
        bhnd(dout, layout),
        causal=True,
    )


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_eager_gradients_of_sparktunes_backward_keep_dense_strides(layout):
    # the reference backend has a backward and no native forward: sparktune's own backward
    q, k, v = make_qkv(layout=layout, form="permuted", dtype=torch.bfloat16, requires_grad=True)
    out = sparktune.attention(q, k, v, causal=True, layout=layout, backend="reference")
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.stride() == t.stride(), (g.stride(), t.stride())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_gradients_of_packed_slices_are_contiguous(compiled, layout):
    q, k, v = make_qkv(nq=11, nk=11, layout=layout, form="packed", requires_grad=True)

    def fn(a, b, c):
        return sparktune.attention(a, b, c, causal=True, layout=layout)

    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape
        if compiled:  # eager on CPU runs the native path (torch:math): PyTorch's strides
            assert g.is_contiguous()
    assert_grads_close_to_reference(
        [bhnd(g, layout) for g in grads],
        *(bhnd(t, layout) for t in (q, k, v)),
        bhnd(dout, layout),
        causal=True,
    )


def test_grad_buffer_rules():
    dense = torch.randn(2, 5, 3, 8).transpose(1, 2)
    assert grad_buffer(dense).stride() == dense.stride()
    packed = torch.randn(2, 5, 9, 8)[:, :, :3]
    g = grad_buffer(packed)
    assert g.is_contiguous() and g.shape == packed.shape
    # a non-dense tensor whose own strides torch would read as channels-last
    odd = torch.randn(2, 16, 3, 5).permute(0, 2, 3, 1)[..., :8]
    g = grad_buffer(odd)
    assert g.is_contiguous() and g.dtype == odd.dtype
    half = torch.randn(2, 4, 6, 8, dtype=torch.bfloat16)
    assert grad_buffer(half).dtype == torch.bfloat16


# -- on a GPU (run on a GPU machine; skipped here) --------------------------------------------


GPU_DTYPES = [torch.float16, torch.bfloat16]


def _skip_unsupported_gpu_dtype(dtype):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bf16 needs sm_80 or later")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout,causal", [("bnhd", True), ("bhnd", False)])
def test_gpu_compiled_model_matches_eager(backend, dtype, layout, causal):
    _skip_unsupported_gpu_dtype(dtype)
    model = Block(dim=256, heads=4, heads_kv=2, head_dim=64, layout=layout, causal=causal)
    model = model.to("cuda", dtype)
    x = torch.randn(2, 128, 256, device="cuda", dtype=dtype)
    compare_compiled(model, [x], backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_gpu_dynamic_shapes_compile_once(backend):
    from torch._dynamo.utils import counters

    counters.clear()
    model = Block(dim=256, heads=4, heads_kv=2, head_dim=64).to("cuda", torch.float16)
    xs = [torch.randn(2, n, 256, device="cuda", dtype=torch.float16) for n in (100, 257)]
    compare_compiled(model, xs, backend=backend, dynamic=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
def test_gpu_no_graph_break():
    model = Block(dim=256, heads=4, heads_kv=2, head_dim=64).to("cuda", torch.float16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.float16)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert "torch.ops.sparktune.attention_fwd" in explanation.graphs[0].code


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["contiguous", "permuted", "packed"])
@pytest.mark.parametrize("layout,causal", [("bnhd", True), ("bhnd", False)])
def test_gpu_opcheck_metadata(form, layout, causal):
    """The fake implementations give the metadata of the GPU kernels' results (values are
    compared by the tests above: kernels with atomics are not bitwise reproducible)."""
    q, k, v = make_qkv(
        2, 4, 2, 128, 128, 64, layout=layout, form=form, device="cuda", requires_grad=True
    )
    fwd_args = (q, k, v, causal, None, layout, None, None, False, True)
    torch.library.opcheck(
        torch.ops.sparktune.attention_fwd.default, fwd_args, test_utils=OPCHECK_METADATA_UTILS
    )
    with torch.no_grad():
        out, lse = _ops.attention_fwd(*fwd_args)
    assert out.is_contiguous() and lse.is_contiguous() and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    bwd_args = (
        dout,
        *(t.detach() for t in (q, k, v)),
        out,
        lse,
        causal,
        None,
        layout,
        None,
        None,
        False,
    )
    torch.library.opcheck(
        torch.ops.sparktune.attention_bwd.default, bwd_args, test_utils=OPCHECK_METADATA_UTILS
    )


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["permuted", "packed"])
def test_gpu_compiled_gradient_strides(form):
    q, k, v = make_qkv(
        2, 4, 2, 128, 128, 64, layout="bnhd", form=form, device="cuda", requires_grad=True
    )

    def fn(a, b, c):
        return sparktune.attention(a, b, c, causal=True, layout="bnhd")

    eager = fn(q, k, v)
    dout = torch.randn_like(eager)
    grads_e = torch.autograd.grad(eager, (q, k, v), dout)
    out = torch.compile(fn, backend="inductor", fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert_close(out, eager, "compiled output")
    for name, g, ge, t in zip("qkv", grads, grads_e, (q, k, v), strict=True):
        # compiled: the op's rule; eager may be the native path, with PyTorch's strides
        if form == "permuted":
            assert g.stride() == t.stride(), name
        else:
            assert g.is_contiguous(), name
        assert ge.shape == t.shape, name
        assert_close(g, ge, f"compiled d{name}")
