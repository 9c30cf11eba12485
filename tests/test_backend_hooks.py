"""The optional backend hooks (``forward_alloc``, ``warmup``) are declared and documented in
sparktune/backends/base.py, not defined there (callers look them up on a backend's class and
take their absence to mean "not offered"), and the built-in backends that offer them keep to
the declared signatures."""

from __future__ import annotations

import inspect

import pytest

from sparktune.backends import base
from sparktune.backends.base import (
    OPTIONAL_HOOKS,
    Backend,
    ForwardAlloc,
    ForwardAutograd,
    ForwardRunner,
    Warmup,
)
from sparktune.backends.reference import ReferenceBackend
from sparktune.backends.torch_sdpa import TorchSDPABackend

PROTOCOLS = {
    "forward_alloc": ForwardAlloc,
    "forward_autograd": ForwardAutograd,
    "forward_runner": ForwardRunner,
    "warmup": Warmup,
}


def _params(fn) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is inspect.Parameter.empty) for p in inspect.signature(fn).parameters.values()]


def test_hooks_are_declared_not_defined():
    assert set(OPTIONAL_HOOKS) == set(PROTOCOLS)
    for name in OPTIONAL_HOOKS:
        # a default on Backend would make every backend look as if it offered the hook
        assert getattr(Backend, name, None) is None, name
        assert getattr(ReferenceBackend, name, None) is None, name
        assert f"``{name}(" in Backend.__doc__, f"Backend's docstring does not document {name}"
        assert name in base.__all__ or PROTOCOLS[name].__name__ in base.__all__


def test_torch_backend_forward_alloc_keeps_to_the_declared_signature():
    assert isinstance(TorchSDPABackend(), ForwardAlloc)
    assert not isinstance(ReferenceBackend(), ForwardAlloc)
    assert _params(TorchSDPABackend.forward_alloc) == _params(ForwardAlloc.forward_alloc)


def test_triton_backend_warmup_keeps_to_the_declared_signature():
    triton_backend = pytest.importorskip("sparktune.backends.triton")
    assert [n for n, _, _ in _params(triton_backend.TritonBackend.warmup)] == [n for n, _, _ in _params(Warmup.warmup)]
    assert _params(triton_backend.TritonBackend.warmup) == _params(Warmup.warmup)


def test_forward_alloc_takes_what_forward_takes_but_out():
    fwd = [p for p in _params(Backend.forward) if p[0] != "out"]
    assert _params(ForwardAlloc.forward_alloc) == fwd


def test_torch_backend_forward_autograd_keeps_to_the_declared_signature():
    assert isinstance(TorchSDPABackend(), ForwardAutograd)
    assert not isinstance(ReferenceBackend(), ForwardAutograd)
    assert _params(TorchSDPABackend.forward_autograd) == _params(ForwardAutograd.forward_autograd)


def test_forward_runner_hooks_keep_to_the_declared_signature():
    from sparktune.backends.spark import SparkBackend

    for cls in (TorchSDPABackend, SparkBackend):
        assert _params(cls.forward_runner) == _params(ForwardRunner.forward_runner), cls
    assert not isinstance(ReferenceBackend(), ForwardRunner)
