"""Timing harnesses. The tuner takes any object with ``measure(fn, candidate=, problem=)``:
:class:`CudaEventTimer` on the GPU, :class:`CostTimer` where the costs are known in advance
(tests of the tuner itself, dry runs of a recipe)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..backends.base import Candidate
    from ..problem import Problem

__all__ = ["CostTimer", "CudaClock", "CudaEventTimer", "DeviceClock", "Timer", "Timing"]


@dataclass(frozen=True)
class Timing:
    """Times of the runs of one candidate, in milliseconds, as measured, and the burst floor:
    the time per call of a burst of back-to-back calls (None when no burst was timed).

    ``min_ms``, ``quartiles_ms`` and ``max_ms`` describe the runs alone. ``median_ms`` is the
    time candidates are ranked by: the runs' median, or, when the burst floor exceeds it, the
    median of the runs each counted at least the floor (a call cannot finish faster than the
    host can issue it)."""

    times_ms: tuple[float, ...]
    floor_ms: float | None = None

    @classmethod
    def of(cls, times: list[float] | tuple[float, ...], floor_ms: float | None = None) -> Timing:
        if not times:
            raise ValueError("a timing needs at least one run")
        return cls(tuple(float(t) for t in times), None if floor_ms is None else float(floor_ms))

    @property
    def runs(self) -> int:
        return len(self.times_ms)

    @property
    def runs_median_ms(self) -> float:
        """The median of the runs alone."""
        return statistics.median(self.times_ms)

    @property
    def floored(self) -> bool:
        """Whether the burst floor exceeds the runs' median (and so sets ``median_ms``)."""
        return self.floor_ms is not None and self.floor_ms > self.runs_median_ms

    @property
    def median_ms(self) -> float:
        floor = self.floor_ms
        if floor is not None and floor > self.runs_median_ms:
            return statistics.median([max(t, floor) for t in self.times_ms])
        return self.runs_median_ms

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def max_ms(self) -> float:
        return max(self.times_ms)

    @property
    def quartiles_ms(self) -> tuple[float, float]:
        if len(self.times_ms) < 2:
            return self.times_ms[0], self.times_ms[0]
        q1, _, q3 = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return q1, q3

    @property
    def rel_iqr(self) -> float:
        """Interquartile range of the runs over their median: the spread the shared GPU left."""
        q1, q3 = self.quartiles_ms
        med = self.runs_median_ms
        return (q3 - q1) / med if med > 0 else 0.0


class Timer(Protocol):
    def measure(self, fn: Callable[[], object], *, candidate: Candidate | None, problem: Problem) -> Timing:
        """Run ``fn`` (one launch of the candidate on prepared inputs) and time it."""
        ...


class DeviceClock(Protocol):
    """What :class:`CudaEventTimer` needs from the device: timing events (objects with
    ``record()``, ``synchronize()`` and ``elapsed_time(end)`` in ms, as ``torch.cuda.Event``),
    a synchronisation of the whole device, and an operation that overwrites a buffer larger
    than the L2 cache."""

    def event(self) -> Any: ...

    def synchronize(self) -> None: ...

    def l2_flush(self) -> Callable[[], object]: ...


class CudaClock:
    """The CUDA device's clock: CUDA events, ``torch.cuda.synchronize`` and a zeroed buffer
    twice the size of L2 (allocated on first use)."""

    def __init__(self, device: object = None) -> None:
        self.device = device
        self._flush_buf: Any = None

    def event(self) -> Any:
        import torch

        return torch.cuda.Event(enable_timing=True)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def l2_flush(self) -> Callable[[], object]:
        import torch

        if self._flush_buf is None:
            dev = torch.device(self.device if self.device is not None else "cuda")
            l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or (64 << 20)
            self._flush_buf = torch.empty(2 * l2, dtype=torch.int8, device=dev)
        return self._flush_buf.zero_


class CudaEventTimer:
    """CUDA-event timing with the L2 cache flushed before every run.

    A few runs estimate the cost; then warm-up for about ``warmup_ms``, then enough runs to
    fill about ``rep_ms`` (at least ``min_runs``, at most ``max_runs``); when the runs'
    interquartile range exceeds ``max_rel_iqr`` of the median, as many runs again are added
    once. Each run: zero a buffer twice the size of L2 (outside the timed region), record the
    start event, launch, record the end event; one synchronisation at the end.

    A run timed alone hides the host's cost of issuing it (the flush before it keeps the GPU
    busy meanwhile), but a call cannot finish faster than the host can issue it: a burst of
    back-to-back calls (``burst_ms`` of them, no flush, two events around the whole burst)
    gives the rate the host sustains, the burst floor (:attr:`Timing.floor_ms`). The runs are
    kept as measured; the time candidates are ranked by counts every run at least the floor
    (:attr:`Timing.median_ms`). For small problems this is what separates a kernel with a
    cheap launch from one whose launch costs more than its GPU time.

    ``clock``: where the events, the synchronisation and the flush come from (default: the
    CUDA device ``device``).
    """

    def __init__(
        self,
        *,
        warmup_ms: float = 25.0,
        rep_ms: float = 100.0,
        min_runs: int = 10,
        max_runs: int = 500,
        max_rel_iqr: float = 0.02,
        flush_l2: bool = True,
        device: object = None,
        burst_ms: float = 20.0,
        clock: DeviceClock | None = None,
    ) -> None:
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.min_runs = min_runs
        self.max_runs = max_runs
        self.max_rel_iqr = max_rel_iqr
        self.flush_l2 = flush_l2
        self.device = device
        self.burst_ms = burst_ms
        self.clock: DeviceClock = clock if clock is not None else CudaClock(device)

    def _flush(self) -> Callable[[], object]:
        if not self.flush_l2:
            return lambda: None
        return self.clock.l2_flush()

    def _runs(self, fn: Callable[[], object], n: int) -> list[float]:
        flush = self._flush()
        starts = [self.clock.event() for _ in range(n)]
        ends = [self.clock.event() for _ in range(n)]
        for s, e in zip(starts, ends, strict=True):
            flush()
            s.record()
            fn()
            e.record()
        ends[-1].synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]

    def measure(self, fn: Callable[[], object], *, candidate: Candidate | None = None, problem: Problem | None = None) -> Timing:
        self.clock.synchronize()
        estimate = max(statistics.median(self._runs(fn, 3)), 1e-4)
        for _ in range(max(1, min(self.max_runs, math.ceil(self.warmup_ms / estimate)))):
            fn()
        n = max(self.min_runs, min(self.max_runs, math.ceil(self.rep_ms / estimate)))
        times = self._runs(fn, n)
        if Timing.of(times).rel_iqr > self.max_rel_iqr and 2 * n <= self.max_runs:
            times = times + self._runs(fn, n)
        return Timing.of(times, floor_ms=self._burst_ms(fn, estimate))

    def _burst_ms(self, fn: Callable[[], object], estimate: float) -> float | None:
        """Time per call of a burst of back-to-back calls (at least 5, at most 200); None when
        bursts are off (``burst_ms`` <= 0)."""
        if self.burst_ms <= 0:
            return None
        k = max(5, min(200, math.ceil(self.burst_ms / estimate)))
        start, end = self.clock.event(), self.clock.event()
        self.clock.synchronize()
        start.record()
        for _ in range(k):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / k


class CostTimer:
    """Reports known costs instead of measuring: ``cost(candidate, problem)`` gives the time in
    ms (None: the candidate cannot be timed, an error). ``fn`` still runs once, so a candidate
    that raises fails exactly as it would on the GPU. The runs are spread by ``jitter`` around
    the cost, deterministically."""

    def __init__(self, cost: Callable[[Candidate | None, Problem], float | None], *, runs: int = 5, jitter: float = 0.01) -> None:
        self.cost = cost
        self.runs = runs
        self.jitter = jitter
        self.calls: list[str] = []

    def measure(self, fn: Callable[[], object], *, candidate: Candidate | None = None, problem: Problem) -> Timing:
        fn()
        ms = self.cost(candidate, problem)
        self.calls.append(candidate.label if candidate is not None else "<baseline>")
        if ms is None:
            raise RuntimeError(f"no known cost for {candidate.label if candidate else 'the baseline'}")
        half = max(1, self.runs // 2)
        return Timing.of([ms * (1 + self.jitter * (i - half) / half) for i in range(self.runs)])
