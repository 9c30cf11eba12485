"""The timing statistics and the reference check the tuner applies to every candidate."""

from __future__ import annotations

import math

import pytest
import torch

from sparktune.backends.base import Candidate
from sparktune.backends.reference import ReferenceBackend, reference_attention
from sparktune.tune import ERROR_FACTOR, CostTimer, CudaEventTimer, Timing, Workload, lowp_attention
from tests._store_helpers import problem

REF = Candidate("reference", "float32")


def test_timing_statistics():
    t = Timing.of([5.0, 1.0, 2.0, 3.0, 4.0])
    assert (t.runs, t.median_ms, t.min_ms, t.max_ms) == (5, 3.0, 1.0, 5.0)
    assert t.quartiles_ms == (2.0, 4.0)
    assert t.rel_iqr == pytest.approx(2 / 3)
    assert Timing.of([2.0]).quartiles_ms == (2.0, 2.0)
    with pytest.raises(ValueError):
        Timing.of([])


def test_cost_timer_runs_the_candidate_once():
    calls = []
    timer = CostTimer(lambda c, p: 2.0, runs=5, jitter=0.1)
    t = timer.measure(lambda: calls.append(1), candidate=REF, problem=problem())
    assert calls == [1] and t.median_ms == 2.0 and t.min_ms == pytest.approx(1.8)
    with pytest.raises(RuntimeError, match="boom"):
        timer.measure(lambda: (_ for _ in ()).throw(RuntimeError("boom")), candidate=REF, problem=problem())
    with pytest.raises(RuntimeError, match="no known cost"):
        CostTimer(lambda c, p: None).measure(lambda: None, candidate=REF, problem=problem())


SHAPES = [
    {},
    {"causal": True},
    {"causal": True, "seqlen_q": 48, "seqlen_k": 16},  # rows with no visible key
    {"heads_q": 4, "heads_kv": 2, "seqlen_q": 17, "seqlen_k": 33},
    {"dtype": "bfloat16"},
]


def _small(**kw):
    base = {"batch": 2, "heads_q": 2, "heads_kv": 2, "seqlen_q": 40, "seqlen_k": 40, "head_dim": 32}
    base.update(kw)
    return problem(**base)


@pytest.mark.parametrize("shape", SHAPES)
def test_lowp_baseline_is_close_but_not_exact(shape):
    p = _small(**shape)
    t = Workload(p, "cpu").inputs(0)
    out64, lse64 = reference_attention(t["q"], t["k"], t["v"], p.causal, 1 / math.sqrt(p.head_dim), torch.float64)
    out, lse = lowp_attention(t["q"], t["k"], t["v"], causal=p.causal, scale=1 / math.sqrt(p.head_dim))
    err = (out.double() - out64).abs().max().item()
    tol = 0.05 if p.dtype == "bfloat16" else 0.01
    assert 0 < err < tol
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse64))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_reference_kernel_passes_and_wrong_ones_fail(shape, op):
    p = _small(op=op, **shape)
    w = Workload(p, "cpu", seed=3)
    backend = ReferenceBackend()
    fn, outs = w.launch(backend, REF, w.check_inputs(), fill=float("nan"))
    fn()
    ok = w.check(outs)
    assert ok.ok and ok.error <= ok.limit, ok
    name = "out" if op == "fwd" else "dq"
    # a kernel that is off by a bit more than twice PyTorch's error fails
    bad = dict(outs)
    bad[name] = outs[name] + 3 * w._references()[name][1]
    assert not w.check(bad).ok
    # a kernel that leaves part of its output unwritten (still NaN) fails
    holes = dict(outs)
    holes[name] = outs[name].clone()
    holes[name][0, 0, -1, -1] = float("nan")
    res = w.check(holes)
    assert not res.ok and res.error == math.inf


def test_lse_of_fully_masked_rows_must_be_minus_inf():
    p = _small(causal=True, seqlen_q=48, seqlen_k=16)
    w = Workload(p, "cpu")
    fn, outs = w.launch(ReferenceBackend(), REF, w.check_inputs())
    fn()
    outs["lse"] = torch.nan_to_num(outs["lse"], neginf=0.0)
    res = w.check(outs)
    assert not res.ok and "-inf" in res.message


def test_fp16_accumulation_gets_a_documented_allowance():
    strict = Workload(_small(), "cpu")._references()["out"][1]
    loose = Workload(_small(allow_fp16_accum=True), "cpu")._references()["out"][1]
    assert loose > strict and ERROR_FACTOR == 2.0


@pytest.mark.gpu
def test_cuda_event_timer_on_a_gpu():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    t = CudaEventTimer(rep_ms=20).measure(lambda: a @ a)
    assert t.runs >= 10 and 0 < t.min_ms <= t.median_ms <= t.max_ms


@pytest.mark.parametrize("shape", SHAPES)
def test_torch_backward_is_measured_as_the_backward_of_its_recorded_forward(shape):
    """A backend with forward_autograd (torch) is timed, for the backward, as what dispatch
    runs: PyTorch's backward of that backend's own recorded forward, no second forward. Its
    gradients pass the same check; each call recomputes nothing but the backward."""
    from sparktune.backends.base import Candidate
    from sparktune.backends.torch_sdpa import TorchSDPABackend

    p = _small(op="bwd", **shape)
    w = Workload(p, "cpu", seed=3)
    backend = TorchSDPABackend()
    calls = []
    real = TorchSDPABackend._sdpa
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchSDPABackend, "_sdpa", staticmethod(lambda *a: calls.append(1) or real(*a)))
        fn, outs = w.launch(backend, Candidate("torch", "math"), w.check_inputs(), fill=float("nan"))
        assert len(calls) == 1  # the one recorded forward
        fn()
        fn()
        assert len(calls) == 1  # the timed calls run the backward only
    res = w.check(outs)
    assert res.ok and res.error <= res.limit, res
