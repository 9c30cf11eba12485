"""Backend capabilities are data on :class:`Backend`: the optional hooks (``backward_runner``,
``forward_alloc``, ``forward_autograd``, ``forward_runner``, ``warmup``) are declared there as None and documented
in its docstring, ``has_backward`` says whether a backend differentiates, and
``runnable_reasons`` is the one answer to "can this backend run this problem". The built-in
backends that offer a hook keep to its documented signature."""

from __future__ import annotations

import inspect

import pytest

from sparktune.backends import base
from sparktune.backends.base import OPTIONAL_HOOKS, Backend
from sparktune.backends.reference import ReferenceBackend
from sparktune.backends.torch_sdpa import TorchSDPABackend
from sparktune.problem import Problem


# the documented signatures of the optional hooks (see Backend's docstring)
def backward_runner(self, q, k, v, *, config, causal, scale): ...


def forward_alloc(self, q, k, v, *, config, causal, scale, need_lse=True): ...


def forward_autograd(self, q, k, v, *, config, causal, scale): ...


def forward_runner(self, q, k, v, out, *, config, causal, scale, need_lse=True): ...


def warmup(self, problem, configs=None, *, processes=1): ...


SIGNATURES = {f.__name__: f for f in (backward_runner, forward_alloc, forward_autograd, forward_runner, warmup)}


def _params(fn) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]


def test_hooks_are_declared_as_none():
    assert set(OPTIONAL_HOOKS) == set(SIGNATURES)
    for name in OPTIONAL_HOOKS:
        # declared on Backend as "not offered", so a backend without it answers None
        assert name in vars(Backend) and getattr(Backend, name) is None, name
        assert getattr(ReferenceBackend, name) is None, name
        assert f"``{name}(" in Backend.__doc__, f"Backend's docstring does not document {name}"
    assert "OPTIONAL_HOOKS" in base.__all__


def test_torch_backend_forward_alloc_keeps_to_the_declared_signature():
    assert TorchSDPABackend.forward_alloc is not None
    assert _params(TorchSDPABackend.forward_alloc) == _params(forward_alloc)


def test_triton_backend_warmup_keeps_to_the_declared_signature():
    triton_backend = pytest.importorskip("sparktune.backends.triton")
    assert [n for n, _, _ in _params(triton_backend.TritonBackend.warmup)] == [n for n, _, _ in _params(warmup)]
    assert _params(triton_backend.TritonBackend.warmup) == _params(warmup)


def test_forward_alloc_takes_what_forward_takes_but_out():
    fwd = [p for p in _params(Backend.forward) if p[0] != "out"]
    assert _params(forward_alloc) == fwd


def test_torch_backend_backward_runner_keeps_to_the_declared_signature():
    assert TorchSDPABackend.backward_runner is not None
    assert _params(TorchSDPABackend.backward_runner) == _params(backward_runner)


def test_torch_backend_forward_autograd_keeps_to_the_declared_signature():
    assert TorchSDPABackend.forward_autograd is not None
    assert _params(TorchSDPABackend.forward_autograd) == _params(forward_autograd)


def test_forward_runner_hooks_keep_to_the_declared_signature():
    from sparktune.backends.spark import SparkBackend

    for cls in (TorchSDPABackend, SparkBackend):
        assert _params(cls.forward_runner) == _params(forward_runner), cls
    assert ReferenceBackend.forward_runner is None


class _ForwardOnly(Backend):
    name = "forward-only"

    def configs(self, op="fwd"):
        return ("default",)

    def not_supported_reasons(self, problem, config=None, device=None):
        return []

    def forward(self, q, k, v, out, *, config, causal, scale, need_lse=True):
        raise AssertionError("not run here")


class _WithBackward(_ForwardOnly):
    name = "with-backward"

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, *, config, causal, scale):
        raise AssertionError("not run here")


class _Raising(_ForwardOnly):
    name = "raising"

    def not_supported_reasons(self, problem, config=None, device=None):
        raise RuntimeError("cannot tell")


class _Unavailable(_WithBackward):
    name = "unavailable"

    def unavailable_reasons(self):
        return ["its extension did not load"]


FWD = Problem("fwd", "float16", 1, 2, 2, 16, 16, 16, False)
BWD = FWD.replace(op="bwd")


def test_has_backward_is_data_and_follows_an_overridden_backward():
    assert Backend.has_backward is False
    assert _ForwardOnly.has_backward is False
    assert _WithBackward.has_backward is True
    assert ReferenceBackend.has_backward and TorchSDPABackend.has_backward

    class _SaysNo(_WithBackward):
        has_backward = False

    assert _SaysNo.has_backward is False


def test_runnable_reasons_is_every_rule_together():
    assert _ForwardOnly().runnable_reasons(FWD) == []
    assert _ForwardOnly().runnable_reasons(BWD) == ["backend 'forward-only' has no backward"]
    assert _WithBackward().runnable_reasons(BWD) == []
    assert _Unavailable().runnable_reasons(FWD) == ["its extension did not load"]
    (reason,) = _Raising().runnable_reasons(FWD)
    assert "RuntimeError" in reason and "cannot tell" in reason
    assert ReferenceBackend().runnable_reasons(BWD, None, None) == []
