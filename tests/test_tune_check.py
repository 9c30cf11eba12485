"""The timing statistics and the reference check the tuner applies to every candidate."""

from __future__ import annotations

import math
import time

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


def test_timing_keeps_the_runs_and_the_burst_floor_apart():
    runs = [5.0, 1.0, 2.0, 3.0, 4.0]
    t = Timing.of(runs, floor_ms=3.5)
    # the runs as measured
    assert (t.times_ms, t.min_ms, t.max_ms, t.quartiles_ms, t.runs_median_ms) == (tuple(runs), 1.0, 5.0, (2.0, 4.0), 3.0)
    assert t.rel_iqr == pytest.approx(2 / 3)
    # ranked by the runs each counted at least the floor: [3.5, 3.5, 3.5, 4, 5]
    assert t.floored and t.floor_ms == 3.5 and t.median_ms == 3.5
    # an even count: [2.6, 2.6, 3, 4] -> 2.8, as the timer always ranked it
    assert Timing.of([1.0, 2.0, 3.0, 4.0], floor_ms=2.6).median_ms == pytest.approx(2.8)
    # a floor under the runs' median changes nothing but is kept
    low = Timing.of(runs, floor_ms=2.9)
    assert not low.floored and low.median_ms == 3.0 and low.floor_ms == 2.9
    assert Timing.of(runs).floor_ms is None and not Timing.of(runs).floored


class _SimulatedGPU:
    """A device clock for CudaEventTimer without a GPU: one stream, on which work starts when
    the GPU is free and the host has issued it. The host spends ``issue_ms`` issuing each
    kernel (and the flush); a kernel runs for the next of ``gpu_ms`` (in turn); the L2 flush
    keeps the GPU busy for ``flush_ms``; events take no time."""

    def __init__(self, gpu_ms, *, issue_ms, flush_ms=1.0):
        self.gpu_ms, self.issue_ms, self.flush_ms = list(gpu_ms), issue_ms, flush_ms
        self.host = self.gpu_free = 0.0
        self.launches = 0

    def _enqueue(self, duration, host_cost):
        self.host += host_cost
        start = max(self.gpu_free, self.host)
        self.gpu_free = start + duration
        return start

    def kernel(self):
        self._enqueue(self.gpu_ms[self.launches % len(self.gpu_ms)], self.issue_ms)
        self.launches += 1

    # the DeviceClock interface
    def event(self):
        gpu = self

        class Event:
            t = None

            def record(self):
                self.t = gpu._enqueue(0.0, 0.0)

            def synchronize(self):
                gpu.host = max(gpu.host, self.t)

            def elapsed_time(self, end):
                return end.t - self.t

        return Event()

    def synchronize(self):
        self.host = max(self.host, self.gpu_free)

    def l2_flush(self):
        return lambda: self._enqueue(self.flush_ms, self.issue_ms)


def test_burst_floor_of_a_launch_bound_kernel():
    """10-14 us of GPU time, 50 us to issue: timed alone (the flush hides the issue) each run
    measures its GPU time; a burst runs at the host's rate. The runs are kept as measured, the
    floor apart, and the candidate is ranked at the floor."""
    gpu = [0.010, 0.011, 0.012, 0.013, 0.014]
    sim = _SimulatedGPU(gpu, issue_ms=0.05)
    t = CudaEventTimer(warmup_ms=0.1, rep_ms=0.2, max_rel_iqr=1.0, clock=sim).measure(sim.kernel)
    assert t.runs >= 10 and all(min(gpu) - 1e-9 <= x <= max(gpu) + 1e-9 for x in t.times_ms)
    assert t.min_ms == pytest.approx(0.010) and t.max_ms == pytest.approx(0.014)
    q1, q3 = t.quartiles_ms
    assert q1 < t.runs_median_ms < q3 and t.runs_median_ms == pytest.approx(0.012, abs=0.001)
    assert t.floor_ms == pytest.approx(0.05, rel=0.1)
    assert t.floored and t.median_ms == t.floor_ms  # every run is below the floor
    # what is stored from it: the runs' spread, never copies of the median
    assert len({t.min_ms, q1, q3, t.max_ms, t.median_ms}) == 5


def test_burst_floor_of_a_gpu_bound_kernel():
    """About 1 ms of GPU time per kernel: the burst takes as long as the GPU, the floor stays
    under the runs' median and the candidate is ranked by its runs; the floor is kept."""
    gpu = [0.8, 1.0, 1.0, 1.0, 1.0]
    sim = _SimulatedGPU(gpu, issue_ms=0.05, flush_ms=0.5)
    t = CudaEventTimer(warmup_ms=2.0, rep_ms=20.0, clock=sim).measure(sim.kernel)
    assert t.runs_median_ms == pytest.approx(1.0) and t.min_ms == pytest.approx(0.8)
    assert not t.floored and t.median_ms == t.runs_median_ms
    assert t.floor_ms == pytest.approx(0.96, abs=0.02)


def test_no_burst_no_floor():
    sim = _SimulatedGPU([0.01], issue_ms=0.05)
    t = CudaEventTimer(warmup_ms=0.1, rep_ms=0.2, burst_ms=0, clock=sim).measure(sim.kernel)
    assert t.floor_ms is None and t.median_ms == pytest.approx(0.01)


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


def _host_ms_per_sleep(cycles, n=40):
    """The duration of ``torch.cuda._sleep(cycles)`` by the host's clock: ``n`` of them back
    to back, one synchronisation (the gaps between kernels are about a microsecond)."""
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


@pytest.mark.gpu
@pytest.mark.parametrize("target_ms", [0.2, 2.0])
def test_cuda_event_timer_measures_a_kernel_of_known_duration(target_ms):
    """``torch.cuda._sleep`` spins for a number of GPU clock cycles; calibrated against the
    host's clock (independent of CUDA events), it is a kernel of known duration. The runs'
    median, the burst floor and the median ranked by must each find it within 5%."""
    per_ms = 1e6 / _host_ms_per_sleep(1_000_000, n=20)
    cycles = int(target_ms * per_ms)
    before = _host_ms_per_sleep(cycles)
    t = CudaEventTimer(rep_ms=50).measure(lambda: torch.cuda._sleep(cycles))
    after = _host_ms_per_sleep(cycles)
    lo, hi = min(before, after) * 0.95, max(before, after) * 1.05
    assert 0.5 * target_ms < before < 2 * target_ms, (before, target_ms)
    for name in ("runs_median_ms", "floor_ms", "median_ms"):
        assert lo <= getattr(t, name) <= hi, (name, getattr(t, name), before, after)
    assert t.runs >= 10 and lo <= t.quartiles_ms[0] <= t.quartiles_ms[1] <= hi


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
