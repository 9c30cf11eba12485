"""The tuner: one Optuna study per problem over the candidates that can run it.

Candidates are filtered by ``not_supported_reasons`` before Optuna sees them. The heuristic
default is enqueued first, then every backend's own default and every candidate of a backend
with at most ``SMALL_BACKEND`` of them. When the space fits the trial budget every candidate is
enqueued (exhaustive); otherwise TPE chooses after those. Each trial checks the candidate against
the reference first (a wrong kernel is pruned, its error recorded), then times it; a candidate
that raises is recorded as failed and the study goes on. Every measured candidate is stored.

Screening (successive halving in one step): a study of more than ``SCREEN_ABOVE`` candidates
times each with a short timing first (the ``screen_timer``), then gives full timings only to
the finalists: the best ``SCREEN_KEEP`` (at least ``SCREEN_FRACTION`` of those measured) and
every candidate within ``SCREEN_MARGIN`` of the best. A candidate left with its short timing
that still reads faster than the best finalist is timed in full too, so the winner always
holds a full timing that no stored timing beats. The Optuna study keeps the screening values.

Studies can live in the tuning database (Optuna's RDB storage). Each finished trial carries
the whole measurement (status, run times, error and bound, host, time) as one user attribute,
so a study that another worker started and could not finish is resumed with ``resume=True``:
its finished candidates are taken over, not measured again, and its trials left running by a
dead worker are marked failed. TPE uses the constant liar, so workers sharing a study do not
all propose the candidates that are still being measured.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..backends.base import Backend, Candidate
from ..problem import DeviceInfo, Problem
from ..registry import backends as _registered
from ._timing import CudaEventTimer, Timer, Timing

if TYPE_CHECKING:
    from ..db import Record, Store

__all__ = [
    "BASELINE",
    "DEFAULT_TRIALS",
    "Measurement",
    "TuneAborted",
    "TuneResult",
    "Tuner",
    "tunable_candidates",
]

log = logging.getLogger(__name__)

#: trials per problem when neither the caller nor a recipe says
DEFAULT_TRIALS = 100
#: the pseudo-candidate a timer is given for PyTorch's default SDPA
BASELINE = Candidate("sdpa", "default")
#: backends with at most this many candidates for a problem are measured entirely, first
SMALL_BACKEND = 4
#: at most this many trials are asked per measured candidate (repeats are not measured again)
_ASKS_PER_TRIAL = 3
#: messages stored for failed candidates are cut to this length
_MAX_MESSAGE = 2000
#: studies of more candidates than this screen them with short timings first
SCREEN_ABOVE = 8
#: finalists after screening: at least this many ...
SCREEN_KEEP = 4
#: ... and at least this fraction of the candidates timed ...
SCREEN_FRACTION = 0.25
#: ... and every candidate whose short timing is within this factor of the best one
SCREEN_MARGIN = 1.15


class TuneAborted(RuntimeError):
    """Tuning cannot go on (e.g. a candidate left the CUDA context unusable). ``result`` holds
    what the problem's study measured before it stopped."""

    result: TuneResult | None = None


@dataclass
class Measurement:
    """What one candidate did on one problem."""

    candidate: Candidate
    status: str  # "ok", "wrong" or "failed"
    timing: Timing | None = None
    tflops: float | None = None
    error: float | None = None
    error_limit: float | None = None
    message: str = ""
    trial: int | None = None
    #: where and when it was measured, for a measurement taken over from an earlier attempt of
    #: the study (None: here and now)
    host: str | None = None
    measured_at: datetime | None = None
    #: the timing is a screening's short one (the candidate was not a finalist)
    screened: bool = False

    @property
    def resumed(self) -> bool:
        return self.measured_at is not None

    @property
    def median_ms(self) -> float | None:
        return self.timing.median_ms if self.timing is not None else None


@dataclass
class TuneResult:
    problem: Problem
    device: DeviceInfo
    build_id: str
    measurements: list[Measurement] = field(default_factory=list)
    baseline: Timing | None = None
    #: "exhaustive", "tpe" or "none" (no candidate)
    mode: str = "none"
    study_name: str = ""
    trials: int = 0
    wall_s: float = 0.0
    #: backend -> why it offered no candidate
    excluded: dict[str, list[str]] = field(default_factory=dict)
    #: why the study stopped before its budget ("" when it did not)
    stopped: str = ""
    #: wall seconds spent per phase of the study (warmup, check, inputs, timing, baseline;
    #: the finalists' full timings count under inputs and timing): where a study's time goes
    phases_s: dict[str, float] = field(default_factory=dict)

    def ranked(self) -> list[Measurement]:
        """Timed candidates, fastest first: those with full timings, then those left with a
        screening's short one."""
        ok = [m for m in self.measurements if m.status == "ok" and m.timing is not None]
        return sorted(ok, key=lambda m: (m.screened, m.timing.median_ms, m.candidate.label))  # type: ignore[union-attr]

    @property
    def best(self) -> Measurement | None:
        r = self.ranked()
        return r[0] if r else None

    def speedup(self, m: Measurement) -> float | None:
        if self.baseline is None or m.timing is None:
            return None
        return self.baseline.median_ms / m.timing.median_ms

    def to_json(self) -> dict[str, Any]:
        from ..db import problem_key

        def entry(m: Measurement) -> dict[str, Any]:
            t = m.timing
            q1, q3 = t.quartiles_ms if t else (None, None)
            return {
                "candidate": m.candidate.label,
                "backend": m.candidate.backend,
                "config": m.candidate.config,
                "status": m.status,
                "median_ms": t.median_ms if t else None,
                "min_ms": t.min_ms if t else None,
                "q1_ms": q1,
                "q3_ms": q3,
                "max_ms": t.max_ms if t else None,
                "floor_ms": t.floor_ms if t else None,
                "runs": t.runs if t else 0,
                "screened": m.screened,
                "tflops": m.tflops,
                "speedup_vs_sdpa": self.speedup(m),
                "error": m.error,
                "error_limit": m.error_limit,
                "message": m.message,
            }

        best = self.best
        return {
            "key": problem_key(self.problem),
            "problem": self.problem.as_dict(),
            "device": {
                "name": self.device.name,
                "capability": list(self.device.capability),
                "sm_count": self.device.sm_count,
                "driver": self.device.driver,
                "cuda": self.device.cuda,
            },
            "build_id": self.build_id,
            "mode": self.mode,
            "study": self.study_name,
            "trials": self.trials,
            "wall_s": round(self.wall_s, 3),
            "phases_s": {k: round(v, 3) for k, v in self.phases_s.items()},
            "stopped": self.stopped,
            "baseline_sdpa_ms": self.baseline.median_ms if self.baseline else None,
            "best": entry(best) if best else None,
            "candidates": [entry(m) for m in self.ranked()]
            + [entry(m) for m in self.measurements if m.status != "ok"],
            "excluded": self.excluded,
        }


def tunable_candidates(
    problem: Problem,
    device: DeviceInfo | None,
    *,
    only: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> tuple[list[Candidate], dict[str, list[str]]]:
    """Every candidate of every tunable backend that can run ``problem`` on ``device``, and for
    each backend that offers none, why. ``only`` keeps the named backends; ``exclude`` drops
    candidates whose label matches one of the glob patterns (e.g. ``"spark:*_acc16"``)."""
    cands: list[Candidate] = []
    excluded: dict[str, list[str]] = {}
    for name, b in _registered().items():
        if only is not None and name not in only:
            continue
        if not b.tunable:
            continue
        try:
            reasons = b.runnable_reasons(problem, None, device)
            found = [] if reasons else b.candidates(problem, device)
        except Exception as exc:  # noqa: BLE001 - a broken backend is reported, not fatal
            reasons, found = [f"listing candidates raised {type(exc).__name__}: {exc}"], []
        found = [c for c in found if not any(fnmatch.fnmatchcase(c.label, pat) for pat in exclude)]
        if not found and not reasons:
            reasons = ["no configuration supports this problem"]
        if reasons:
            excluded[name] = reasons
        cands.extend(found)
    return cands, excluded


def _screening(timer: CudaEventTimer) -> CudaEventTimer:
    """The short timing of a screening, for a study timed by ``timer``: a fifth of its
    warm-up and timed runs, no second round for a wide spread, a shorter burst."""
    return CudaEventTimer(
        warmup_ms=timer.warmup_ms / 5,
        rep_ms=timer.rep_ms / 5,
        min_runs=5,
        max_runs=timer.max_runs,
        max_rel_iqr=math.inf,
        flush_l2=timer.flush_l2,
        device=timer.device,
        burst_ms=timer.burst_ms / 4,
    )


def _tflops(problem: Problem, timing: Timing) -> float:
    return problem.flops() / (timing.median_ms * 1e-3) / 1e12


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _library_version() -> str:
    try:
        from .. import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001
        return ""


def _host() -> str:
    try:
        return socket.gethostname()
    except OSError:  # pragma: no cover
        return ""


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


_TRIAL_STATE = {"ok": "COMPLETE", "wrong": "PRUNED", "failed": "FAIL"}


def _measurement_from_trial(t: Any, labels: dict[str, Candidate]) -> Measurement | None:
    """The measurement a finished trial recorded (see ``Tuner._tell``), or None when the trial
    does not carry a complete one (it is then measured again)."""
    from ._timing import Timing

    attrs = t.user_attrs.get("sparktune")
    cand = labels.get(t.params.get("candidate"))
    if not isinstance(attrs, dict) or cand is None:
        return None
    status = attrs.get("status")
    if _TRIAL_STATE.get(status) != t.state.name:
        return None

    def num(key: str) -> float | None:
        v = attrs.get(key)
        if v == "inf":
            return math.inf
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    timing = None
    if status == "ok":
        times = attrs.get("times_ms")
        if not isinstance(times, list) or not times or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in times
        ):
            return None
        timing = Timing.of(times, floor_ms=num("floor_ms"))
    try:
        at = datetime.fromisoformat(str(attrs.get("at", "")).replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return Measurement(
        cand, status, timing, num("tflops"), num("error"), num("error_limit"), str(attrs.get("message", "")),
        trial=t.number, host=str(attrs.get("host", "")), measured_at=at,
    )


def _is_optuna_storage(obj: Any) -> bool:
    import optuna

    return isinstance(obj, optuna.storages.BaseStorage)


#: callback(result so far, the newest measurement, trials done, trials planned)
ProgressFn = Callable[[TuneResult, Measurement, int, int], None]


class Tuner:
    """Tunes problems on one device.

    ``device``/``torch_device``: the fingerprint records are keyed on, and where tensors live
    (on a GPU: ``DeviceInfo.from_torch()`` and ``"cuda"``). ``timer``: a :class:`CudaEventTimer`
    by default. ``trials``/``timeout`` (seconds): the budget of one problem. ``storage``: an
    Optuna storage URL (the tuning database's, so optuna-dashboard shows the studies) or None
    for in-memory studies. ``store``: where the records go (None: nowhere).

    A study runs in memory and is written to ``storage`` when it ends (its finished trials,
    in one pass): an RDB storage costs several database round trips per trial, seconds per
    study. With ``live_storage`` (set by the distributed :class:`Worker`, whose studies another
    worker may take over) every trial is stored as it ends instead.
    """

    def __init__(
        self,
        *,
        device: DeviceInfo,
        torch_device: Any = "cuda",
        timer: Timer | None = None,
        store: Store | None = None,
        trials: int | None = None,
        timeout: float | None = None,
        storage: Any = None,
        backends: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        seed: int = 0,
        baseline: bool = True,
        progress: ProgressFn | None = None,
        warmup_processes: int | None = None,
        run: str = "",
        live_storage: bool = False,
        screen_timer: Timer | None | bool = True,
    ) -> None:
        if timer is None:
            timer = CudaEventTimer(device=torch_device)
        if screen_timer is True:  # the default: a short version of a CUDA-event timer
            screen_timer = _screening(timer) if isinstance(timer, CudaEventTimer) else None
        #: the short timing of a screening (None or False: no screening)
        self.screen_timer = screen_timer or None
        self.device = device
        self.torch_device = torch_device
        self.timer = timer
        self.store = store
        self.trials = trials if trials is not None else DEFAULT_TRIALS
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self.timeout = timeout
        self.backends = list(backends) if backends is not None else None
        if self.backends is not None:
            known = _registered()
            unknown = [b for b in self.backends if b not in known]
            if unknown:
                raise ValueError(
                    f"unknown backend {', '.join(map(repr, unknown))} to tune; registered backends: {', '.join(known)}"
                )
        if storage is not None and not _is_optuna_storage(storage):
            from ..db import optuna_storage  # the database driver: only for a stored study

            storage = optuna_storage(storage)
        self.storage = storage
        self.exclude = list(exclude)
        self.seed = seed
        self.baseline = baseline
        self.progress = progress
        self.warmup_processes = warmup_processes if warmup_processes is not None else max(1, os.cpu_count() or 1)
        #: the name of a distributed run: its studies are its own (a new run measures anew)
        self.run = run
        #: store each trial in ``storage`` as it ends (else the study, when it ends)
        self.live_storage = live_storage
        #: the phases of the study being run (its TuneResult.phases_s)
        self._phases: dict[str, float] = {}

    # ------------------------------------------------------------------ planning

    def candidates(self, problem: Problem) -> tuple[list[Candidate], dict[str, list[str]]]:
        return tunable_candidates(problem, self.device, only=self.backends, exclude=self.exclude)

    def plan(self, problem: Problem) -> tuple[list[Candidate], str, int]:
        """(candidates in trial order, mode, trials): the seeds (:meth:`seeds`) first;
        exhaustive when every candidate fits the budget."""
        return self._plan(problem)[:3]

    def _plan(self, problem: Problem) -> tuple[list[Candidate], str, int, int, dict[str, list[str]]]:
        """:meth:`plan`, how many of the first candidates are seeds, and the backends left out
        with their reasons."""
        cands, excluded = self.candidates(problem)
        seeds = self.seeds(problem, cands)
        cands = seeds + [c for c in cands if c not in seeds]
        if not cands:
            return [], "none", 0, 0, excluded
        if len(cands) <= self.trials:
            return cands, "exhaustive", len(cands), len(seeds), excluded
        return cands, "tpe", self.trials, len(seeds), excluded

    def seeds(self, problem: Problem, cands: list[Candidate]) -> list[Candidate]:
        """The candidates measured first, before TPE chooses (of ``cands``): the heuristic
        default, then every other backend's own default for the problem, then every candidate
        of the backends that offer at most ``SMALL_BACKEND`` of them (PyTorch's SDPA backends),
        so that even a small budget measures each backend's best guess and the cheap few."""
        from ..dispatch import NoKernelError, heuristic_default

        out: list[Candidate] = []
        try:
            default = heuristic_default(problem, self.device).candidate
        except NoKernelError:
            default = None
        if default in cands:
            out.append(default)
        for name, backend in _registered().items():
            try:
                config = backend.default_config(problem, self.device)
            except Exception:  # noqa: BLE001 - a backend without a default adds none
                continue
            c = Candidate(name, config) if config is not None else None
            if c is not None and c in cands and c not in out:
                out.append(c)
        per_backend: dict[str, list[Candidate]] = {}
        for c in cands:
            per_backend.setdefault(c.backend, []).append(c)
        for group in per_backend.values():
            if len(group) <= SMALL_BACKEND:
                out += [c for c in group if c not in out]
        return out

    @staticmethod
    def space_id(cands: Iterable[Candidate]) -> str:
        """A short hash of a candidate set: studies (and leases) are per space."""
        return hashlib.sha1("\n".join(sorted(c.label for c in cands)).encode()).hexdigest()[:10]

    def _study_name(self, problem: Problem, cands: list[Candidate]) -> str:
        from ..db import problem_key
        from ..dispatch import build_id

        d = self.device
        name = f"sparktune/{problem_key(problem)}/{d.name} sm_{d.arch}/{build_id()}/{self.space_id(cands)}"
        return f"{name}/run:{self.run}" if self.run else name

    def _warmup(self, problem: Problem, cands: list[Candidate]) -> None:
        """Let backends that compile on first use (they define ``warmup(problem, configs, *,
        processes)``) compile the candidates ahead of the study, in parallel."""
        by_backend: dict[str, list[str]] = {}
        for c in cands:
            by_backend.setdefault(c.backend, []).append(c.config)
        registered = _registered()
        for name, configs in by_backend.items():
            warm = getattr(registered.get(name), "warmup", None)
            if not callable(warm):
                continue
            try:
                warm(problem, configs, processes=self.warmup_processes)
            except Exception as exc:  # noqa: BLE001 - compilation errors surface in the trials
                log.info("sparktune: warmup of %s failed: %s", name, _short(exc))

    # ------------------------------------------------------------------ one candidate

    def _cuda_alive(self) -> str:
        import torch

        if torch.device(self.torch_device).type != "cuda":
            return ""
        try:
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            return _short(exc)
        return ""

    def _evaluate(
        self, workload: Any, cand: Candidate, trial_number: int, timer: Timer | None = None
    ) -> Measurement:
        """Check ``cand`` against the reference, then time it with ``timer`` (default: the
        full timer)."""
        import torch

        backend = _registered().get(cand.backend)
        if backend is None:
            return Measurement(cand, "failed", message=f"backend {cand.backend!r} is no longer registered")
        t0 = time.monotonic()
        try:
            fn, outs = workload.launch(backend, cand, workload.check_inputs(), fill=float("nan"))
            with torch.no_grad():
                fn()
            if torch.device(self.torch_device).type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
            return Measurement(cand, "failed", message=f"while checking: {_short(exc)}")
        try:
            result = workload.check(outs)
        except Exception as exc:  # noqa: BLE001 - outputs the check cannot even compare
            return Measurement(cand, "failed", message=f"while checking its outputs: {_short(exc)}")
        finally:
            self._phase("check", t0)
        if not result.ok:
            return Measurement(cand, "wrong", error=result.error, error_limit=result.limit, message=result.message)
        del outs
        try:
            timing = self._time(workload, backend, cand, trial_number, timer or self.timer)
        except Exception as exc:  # noqa: BLE001
            return Measurement(cand, "failed", error=result.error, error_limit=result.limit, message=f"while timing: {_short(exc)}")
        return Measurement(
            cand, "ok", timing, _tflops(workload.problem, timing), result.error, result.limit, screened=timer is not None
        )

    def _time(self, workload: Any, backend: Backend, cand: Candidate, trial_number: int, timer: Timer) -> Timing:
        import torch

        t0 = time.monotonic()
        fresh = workload.inputs(self.seed + 1 + trial_number)
        fn, _ = workload.launch(backend, cand, fresh)
        t0 = self._phase("inputs", t0)
        with torch.no_grad():
            timing = timer.measure(fn, candidate=cand, problem=workload.problem)
        self._phase("timing", t0)
        return timing

    def _phase(self, name: str, since: float) -> float:
        """Add the wall time since ``since`` to phase ``name`` of the current study; now."""
        now = time.monotonic()
        self._phases[name] = self._phases.get(name, 0.0) + now - since
        return now

    def _finalists(self, workload: Any, result: TuneResult) -> None:
        """Full timings for the finalists of a screening (see the module's docstring), in
        place of their short ones; a candidate that fails its full timing is recorded as
        failed."""

        def retime(m: Measurement) -> None:
            backend = _registered().get(m.candidate.backend)
            try:
                if backend is None:
                    raise RuntimeError(f"backend {m.candidate.backend!r} is no longer registered")
                m.timing = self._time(workload, backend, m.candidate, m.trial or 0, self.timer)
                m.tflops = _tflops(workload.problem, m.timing)
            except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
                m.status, m.timing, m.tflops = "failed", None, None
                m.message = f"while timing: {_short(exc)}"
            m.screened = False

        screened = sorted(
            (m for m in result.measurements if m.screened and m.status == "ok" and m.timing is not None),
            key=lambda m: (m.timing.median_ms, m.candidate.label),  # type: ignore[union-attr]
        )
        if not screened:
            return
        keep = max(SCREEN_KEEP, math.ceil(SCREEN_FRACTION * len(screened)))
        fastest = screened[0].timing.median_ms  # type: ignore[union-attr]
        for i, m in enumerate(screened):
            if i < keep or m.timing.median_ms <= SCREEN_MARGIN * fastest:  # type: ignore[union-attr]
                retime(m)
        while True:  # no short timing may read faster than the best full one
            full = [m.timing.median_ms for m in result.measurements if m.status == "ok" and not m.screened and m.timing is not None]
            best = min(full) if full else math.inf
            late = [m for m in result.measurements if m.screened and m.timing is not None and m.timing.median_ms < best]
            if not late:
                break
            for m in late:
                retime(m)

    def _baseline(self, workload: Any) -> Timing | None:
        import torch

        try:
            inputs = workload.inputs(self.seed + 10_000)
            with torch.enable_grad():  # the backward baseline differentiates SDPA's forward
                fn = workload.sdpa_baseline(inputs)
                return self.timer.measure(fn, candidate=BASELINE, problem=workload.problem)
        except Exception as exc:  # noqa: BLE001 - the baseline is informative only
            log.info("sparktune: PyTorch SDPA baseline not timed for %s: %s", workload.problem, _short(exc))
            return None

    # ------------------------------------------------------------------ one problem

    def tune(self, problem: Problem, *, resume: bool = False) -> TuneResult:
        """Tune ``problem``. With ``resume``, the study's finished trials (an earlier attempt
        of this study, e.g. by a worker that died) count as measured, and its running trials
        are marked failed: only the distributed runner, which holds the problem's lease, may
        ask for it."""
        import optuna
        from optuna.distributions import CategoricalDistribution
        from optuna.trial import TrialState

        from ..dispatch import build_id
        from ._decode_workload import DecodeWorkload
        from ._workload import Workload

        start = time.monotonic()
        result = TuneResult(problem, self.device, build_id())
        self._phases = result.phases_s
        order, mode, planned, n_seeds, result.excluded = self._plan(problem)
        result.mode = mode
        if not order:
            result.stopped = "no candidate can run this problem"
            return result
        labels = {c.label: c for c in order}
        dist = CategoricalDistribution(sorted(labels))
        result.study_name = self._study_name(problem, order)
        sampler = (
            optuna.samplers.TPESampler(
                seed=self.seed, n_startup_trials=min(10, max(1, planned // 4)), constant_liar=True
            )
            if mode == "tpe"
            else optuna.samplers.RandomSampler(seed=self.seed)
        )
        live = self.storage is not None and (self.live_storage or resume)
        study = optuna.create_study(
            storage=self.storage if live else None,
            study_name=result.study_name,
            direction="minimize",
            sampler=sampler,
            load_if_exists=True,
        )
        measured: dict[str, Measurement] = {}
        queued: set[str] = set()
        if resume:
            queued = self._resume(study, labels, result, measured, TrialState)
            if self.progress is not None:
                for i, m in enumerate(result.measurements, 1):
                    self.progress(result, m, i, planned)
        first = order if mode == "exhaustive" else order[: max(1, n_seeds)]
        for c in first:
            if c.label not in measured and c.label not in queued:
                study.enqueue_trial({"candidate": c.label})
        if mode == "exhaustive":
            t0 = time.monotonic()
            self._warmup(problem, [c for c in order if c.label not in measured])
            self._phase("warmup", t0)
        screen = self.screen_timer if planned > SCREEN_ABOVE else None

        if problem.op == "decode":
            workload: Any = DecodeWorkload(problem, self.torch_device, seed=self.seed)
        else:
            workload = Workload(problem, self.torch_device, seed=self.seed)
        deadline = start + self.timeout if self.timeout is not None else None
        asks = 0
        # the budget counts measured candidates: a trial that proposes a measured candidate
        # again is answered from memory; asks are capped in case the sampler keeps doing so
        max_asks = _ASKS_PER_TRIAL * planned
        try:
            while asks < max_asks and len(measured) < planned:
                if deadline is not None and time.monotonic() > deadline:
                    result.stopped = f"timeout of {self.timeout:g} s reached"
                    break
                trial = study.ask({"candidate": dist})
                asks += 1
                label = trial.params["candidate"]
                m = measured.get(label)
                fresh = m is None
                try:
                    if m is None:
                        m = self._evaluate(workload, labels[label], trial.number, screen)
                        m.trial = trial.number
                        measured[label] = m
                        result.measurements.append(m)
                    self._tell(study, trial, m, TrialState)
                except BaseException:
                    study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
                    raise
                if fresh and self.progress is not None:
                    self.progress(result, m, len(measured), planned)
                if m.status == "failed" and fresh:
                    broken = self._cuda_alive()
                    if broken:
                        aborted = TuneAborted(
                            f"the CUDA context is unusable after {label} failed ({broken}); the "
                            f"results so far are saved; tune again with --exclude '{label}'"
                        )
                        aborted.result = result
                        raise aborted
            if len(measured) < planned and not result.stopped:
                result.stopped = f"the sampler proposed measured candidates {asks} times; {len(measured)} measured"
            if screen is not None:
                self._finalists(workload, result)
            if self.baseline and result.ranked():
                t0 = time.monotonic()
                result.baseline = self._baseline(workload)
                self._phase("baseline", t0)
        finally:  # what was measured is stored even when tuning stops on an error
            result.trials = asks
            self._save(result)
            if self.storage is not None and not live:
                self._store_study(study, TrialState)
            result.wall_s = time.monotonic() - start
        return result

    def _store_study(self, study: Any, TrialState: Any) -> None:  # noqa: N803
        """Write an in-memory study's finished trials to the Optuna storage (appended to a
        study of the same name, as a live study would be); a failure is one warning, never
        an error: the records are in the tuning database already."""
        import optuna

        finished = [
            t
            for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        ]
        if not finished:
            return
        try:
            target = optuna.create_study(
                storage=self.storage,
                study_name=study.study_name,
                direction="minimize",
                load_if_exists=True,
            )
            target.add_trials(finished)
        except Exception as exc:  # noqa: BLE001 - the study is a view; the records are saved
            log.warning("sparktune: the Optuna study %s was not stored: %s", study.study_name, _short(exc))

    @staticmethod
    def _resume(
        study: Any, labels: dict[str, Candidate], result: TuneResult, measured: dict[str, Measurement], TrialState: Any  # noqa: N803
    ) -> set[str]:
        """Take over an earlier attempt of the study: its finished measurements, and the
        candidates it enqueued but did not start (returned). Its running trials belong to a
        worker that is gone (the caller holds the lease): they are marked failed."""
        queued: set[str] = set()
        for t in study.get_trials(deepcopy=False):
            if t.state == TrialState.RUNNING:
                study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            elif t.state == TrialState.WAITING:
                fixed = t.system_attrs.get("fixed_params") or {}
                queued.add(fixed.get("candidate"))
            else:
                m = _measurement_from_trial(t, labels)
                if m is not None and m.candidate.label not in measured:
                    measured[m.candidate.label] = m
                    result.measurements.append(m)
        return queued

    @staticmethod
    def _tell(study: Any, trial: Any, m: Measurement, TrialState: Any) -> None:  # noqa: N803
        # one attribute (one storage round trip) with the whole measurement, so that another
        # worker can take the study over: status, run times, error and bound, message, where
        attrs: dict[str, Any] = {
            "status": m.status,
            "host": m.host if m.host is not None else _host(),
            "at": _iso(m.measured_at or datetime.now(timezone.utc)),
        }
        if m.error is not None:
            attrs["error"] = m.error if m.error != float("inf") else "inf"
            attrs["error_limit"] = m.error_limit
        if m.message:
            attrs["message"] = m.message
        if m.timing is not None:
            attrs["tflops"] = m.tflops
            attrs["runs"] = m.timing.runs
            attrs["times_ms"] = list(m.timing.times_ms)
            if m.timing.floor_ms is not None:
                attrs["floor_ms"] = m.timing.floor_ms
        trial.set_user_attr("sparktune", attrs)
        if m.status == "ok":
            assert m.timing is not None
            study.tell(trial, m.timing.median_ms, skip_if_finished=True)
        elif m.status == "wrong":
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
        else:
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

    # ------------------------------------------------------------------ storing

    def records(self, result: TuneResult) -> list[Record]:
        import torch

        from ..db import Record, now_utc

        when = now_utc()
        out = []
        for m in result.measurements:
            t = m.timing
            q1, q3 = t.quartiles_ms if t else (None, None)
            out.append(
                Record(
                    problem=result.problem,
                    device=result.device,
                    build_id=result.build_id,
                    backend=m.candidate.backend,
                    config=m.candidate.config,
                    status=m.status,
                    median_ms=t.median_ms if t else None,
                    min_ms=t.min_ms if t else None,
                    max_ms=t.max_ms if t else None,
                    q1_ms=q1,
                    q3_ms=q3,
                    floor_ms=t.floor_ms if t else None,
                    runs=t.runs if t else 0,
                    tflops=m.tflops,
                    error=m.error if m.error is None or m.error != float("inf") else None,
                    error_limit=m.error_limit,
                    message=m.message,
                    measured_at=m.measured_at or when,
                    **({"host": m.host} if m.host is not None else {}),
                    version=_library_version(),
                    torch_version=str(torch.__version__),
                )
            )
        return out

    def _save(self, result: TuneResult) -> None:
        if self.store is None or not result.measurements:
            return
        self.store.add(self.records(result))
        from .. import dispatch

        dispatch.reload()
