"""A forward whose backward runs on the same backend uses that backend's own autograd (the
torch backend: SDPA records its graph and its backward reuses what its forward saved)."""

from __future__ import annotations

import pytest
import torch

import sparktune
from sparktune import _autograd as autograd_mod
from sparktune.backends.reference import (
    ReferenceBackend,
    reference_attention,
    reference_attention_backward,
)
from tests._store_helpers import record as store_record


def _inputs(b=2, hq=4, hk=2, nq=37, nk=53, d=16, dtype=torch.float32, layout="bhnd"):
    shape_q = (b, hq, nq, d) if layout == "bhnd" else (b, nq, hq, d)
    shape_k = (b, hk, nk, d) if layout == "bhnd" else (b, nk, hk, d)
    q = torch.randn(shape_q, dtype=dtype, requires_grad=True)
    k = torch.randn(shape_k, dtype=dtype, requires_grad=True)
    v = torch.randn(shape_k, dtype=dtype, requires_grad=True)
    return q, k, v


_grad_fn_names = autograd_mod.graph_node_names


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("causal", [False, True])
def test_forced_torch_backend_records_pytorch_autograd(layout, causal):
    q, k, v = (t.detach().half().requires_grad_() for t in _inputs(layout=layout))
    out = sparktune.attention(q, k, v, causal=causal, layout=layout, backend="torch", config="math")
    names = _grad_fn_names(out)
    assert not any("_AttentionFunction" in n for n in names), names
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    to_bhnd = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))
    ref = reference_attention_backward(
        *(to_bhnd(t.detach().double()) for t in (dout, q, k, v)), causal=causal,
        scale=q.shape[-1] ** -0.5,
    )
    for g, r, name in zip(grads, ref, ("dq", "dk", "dv"), strict=True):
        assert g.dtype == torch.float16
        err = (to_bhnd(g).double() - r).abs().max().item()
        assert err < 2e-2, f"{name}: max error {err}"


def test_rows_without_keys_give_zero_output_and_gradients():
    # causal with seqlen_q > seqlen_k: the first rows see no key
    q, k, v = (t.detach().half().requires_grad_() for t in _inputs(nq=9, nk=4))
    out = sparktune.attention(q, k, v, causal=True, backend="torch", config="math")
    assert torch.equal(out[:, :, :5], torch.zeros_like(out[:, :, :5]))
    dq, = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert torch.equal(dq[:, :, :5], torch.zeros_like(dq[:, :, :5]))


def test_return_lse_keeps_the_sparktune_autograd_function():
    q, k, v = (t.detach().half().requires_grad_() for t in _inputs())
    out, lse = sparktune.attention(q, k, v, backend="torch", config="math", return_lse=True)
    assert any("_AttentionFunction" in n for n in _grad_fn_names(out))
    assert lse.shape == (2, 4, 37)


def test_other_backends_keep_the_sparktune_autograd_function():
    q, k, v = (t.detach().half().requires_grad_() for t in _inputs())
    out = sparktune.attention(q, k, v, backend="reference")
    assert any("_AttentionFunction" in n for n in _grad_fn_names(out))


def test_backward_chosen_on_the_torch_backend_takes_the_forward_there_too(monkeypatch):
    """Dispatch picks another backend for the forward and torch for the backward: the call
    runs the forward on torch (with the backward's config) under PyTorch's autograd, so the
    backward reuses what that forward saved."""
    from sparktune import dispatch
    from sparktune.backends.base import Candidate

    real_select = dispatch.select
    picked = {"fwd": Candidate("reference", "float32"), "bwd": Candidate("torch", "math")}

    def select(problem, device=None, **kw):
        if kw.get("backend") is None and problem.op in picked:
            return dispatch.Selection(picked[problem.op], "tuned")
        return real_select(problem, device, **kw)

    monkeypatch.setattr(dispatch, "select", select)
    q, k, v = (t.detach().half().requires_grad_() for t in _inputs())
    out = sparktune.attention(q, k, v, causal=True)
    names = _grad_fn_names(out)
    assert not any("_AttentionFunction" in n for n in names), names
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_attention_backward(*(t.detach().double() for t in (dout, q, k, v)),
                                       causal=True, scale=q.shape[-1] ** -0.5)
    for g, r in zip(grads, ref, strict=True):
        assert (g.double() - r).abs().max().item() < 2e-2

    # and with the backward on the reference backend, sparktune's own autograd function
    picked["bwd"] = Candidate("reference", "float32")
    dispatch.invalidate_selections()  # (what a training call decided is kept per selection)
    out = sparktune.attention(q, k, v, causal=True)
    assert any("_AttentionFunction" in n for n in _grad_fn_names(out))


class _RunnerBackend(ReferenceBackend):
    """A backend whose backward takes any forward's out and lse (``backward_runner``), with a
    native forward as well: it records what reached it."""

    name = "runner"

    def __init__(self, takes: bool = True):
        super().__init__()
        self.takes = takes
        self.forwards = 0
        self.given: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward_autograd(self, q, k, v, *, config, causal, scale):
        self.forwards += 1
        out, _ = reference_attention(q, k, v, causal, scale, torch.float32)
        return out.to(q.dtype)

    def backward_runner(self, q, k, v, *, config, causal, scale):
        if not self.takes:
            return None

        def run(dout, q, k, v, out, lse):
            self.given.append((out, lse))
            grads = reference_attention_backward(dout, q, k, v, causal, scale, torch.float32)
            return tuple(g.to(q.dtype) for g in grads)

        return run


def _pick(monkeypatch, fwd, bwd):
    from sparktune import dispatch

    real_select = dispatch.select
    picked = {"fwd": fwd, "bwd": bwd}

    def select(problem, device=None, **kw):
        if kw.get("backend") is None and problem.op in picked:
            return dispatch.Selection(picked[problem.op], "tuned")
        return real_select(problem, device, **kw)

    monkeypatch.setattr(dispatch, "select", select)
    # these selections carry no record: any forward may pair (the threshold has its own test)
    monkeypatch.setattr(autograd_mod, "PAIR_MIN_FORWARD_MS", 0.0)
    dispatch.invalidate_selections()  # the calls' plans made before are forgotten


@pytest.mark.parametrize("forward_ms, paired", [(0.2, False), (4.0, True)])
def test_only_a_long_forward_pairs_with_another_backends_backward(monkeypatch, forward_ms, paired):
    """A paired call costs more host time than the backward backend's native one: the forward
    dispatch chose runs paired only when its record (here of another shape, scaled by FLOPs)
    says it takes at least PAIR_MIN_FORWARD_MS; otherwise the backward's own native forward
    runs. Either way the decision is made once per plan: repeated calls ask dispatch nothing."""
    from sparktune import dispatch, registry
    from sparktune.backends.base import Candidate
    from sparktune.problem import Problem

    runner = _RunnerBackend()
    registry.register_backend(runner, replace=True)
    try:
        # the record is of a problem half as long (a quarter of the FLOPs): forward_ms / 4 there
        here = Problem("fwd", "float16", 2, 4, 2, 37, 53, 16, True)
        there = here.replace(seqlen_q=18, seqlen_k=27)
        median = forward_ms * there.flops() / here.flops()
        record = store_record(there, backend="reference", config="float32", median=median)
        real_select = dispatch.select
        asked = []

        def select(problem, device=None, **kw):
            if kw.get("backend") is None:
                asked.append(problem.op)
                if problem.op == "fwd":
                    return dispatch.Selection(Candidate("reference", "float32"), "nearest", record=record)
                return dispatch.Selection(Candidate("runner", "float32"), "tuned")
            return real_select(problem, device, **kw)

        monkeypatch.setattr(dispatch, "select", select)
        dispatch.invalidate_selections()
        q, k, v = (t.detach().half().requires_grad_() for t in _inputs())
        for _ in range(3):
            out = sparktune.attention(q, k, v, causal=True)
            assert any("_AttentionFunction" in n for n in _grad_fn_names(out)) == paired
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert runner.forwards == (0 if paired else 3)
        assert len(runner.given) == (3 if paired else 0)
        first = list(asked)
        out = sparktune.attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert asked == first  # a dispatch hit: no selection made again, forward or backward
    finally:
        registry.unregister_backend("runner")


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_a_backward_that_takes_any_forward_pairs_with_the_forward_dispatch_chose(monkeypatch, layout):
    """Dispatch picks the reference backend for the forward and a backend whose backward reads
    any forward's out and lse for the backward: the forward runs on the reference backend (not
    the backward's native forward), and the backward gets that forward's out and lse."""
    from sparktune import registry
    from sparktune.backends.base import Candidate

    runner = _RunnerBackend()
    registry.register_backend(runner, replace=True)
    try:
        _pick(monkeypatch, Candidate("reference", "float32"), Candidate("runner", "float32"))
        q, k, v = (t.detach().half().requires_grad_() for t in _inputs(layout=layout))
        out = sparktune.attention(q, k, v, causal=True, layout=layout)
        assert any("_AttentionFunction" in n for n in _grad_fn_names(out))
        assert runner.forwards == 0
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert len(runner.given) == 1
        given_out, given_lse = runner.given[0]
        to_bhnd = (lambda t: t) if layout == "bhnd" else (lambda t: t.transpose(1, 2))
        assert torch.equal(given_out, to_bhnd(out)) and given_lse.shape == (2, 4, 37)
        ref = reference_attention_backward(
            *(to_bhnd(t.detach().double()) for t in (dout, q, k, v)), causal=True,
            scale=q.shape[-1] ** -0.5,
        )
        for g, t, r, name in zip(grads, (q, k, v), ref, ("dq", "dk", "dv"), strict=True):
            assert g.shape == t.shape and g.dtype == t.dtype
            err = (to_bhnd(g).double() - r).abs().max().item()
            assert err < 2e-2, f"{name}: max error {err}"

        # a runner that turns these inputs down: the backward's own native forward, as before
        runner.takes = False
        out = sparktune.attention(q, k, v, causal=True, layout=layout)
        assert not any("_AttentionFunction" in n for n in _grad_fn_names(out))
        assert runner.forwards == 1

        # the forward on the same backend as the backward: its native path
        runner.takes = True
        _pick(monkeypatch, Candidate("runner", "float32"), Candidate("runner", "float32"))
        out = sparktune.attention(q, k, v, causal=True, layout=layout)
        assert not any("_AttentionFunction" in n for n in _grad_fn_names(out))
        assert runner.forwards == 2
    finally:
        registry.unregister_backend("runner")
