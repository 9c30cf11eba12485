"""The benchmark sweep: shapes, the loop over shapes, ops and candidates, and its results.

For every shape the inputs are made once and the float64 references computed once (on first
need); then for every op and candidate: plan (or the reason it cannot run), prepare, run once
and measure the peak memory, check against the reference, then time with the timer (on a GPU
the tuner's :class:`~sparktune.tune.CudaEventTimer`). A candidate that raises (out of memory
included) is recorded as failed with the message; the sweep goes on unless the CUDA context is
left unusable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.base import Candidate
from ..problem import DeviceInfo, Problem
from ..tune import Timing
from ._candidates import CANDIDATES, Context, Option, Plan, TunedRecords, plan_case
from ._check import Inputs, References, make_inputs

__all__ = [
    "DEFAULT_HEAD_DIMS",
    "DEFAULT_HEADS",
    "DEFAULT_SEQLENS",
    "DEFAULT_TOKENS",
    "FORMAT",
    "MEMORY_NOTE",
    "OPS",
    "BenchReport",
    "BenchRow",
    "Sweep",
    "SweepSettings",
    "WallClockTimer",
    "case_flops",
    "recipe_shapes",
    "sweep_shapes",
]

log = logging.getLogger(__name__)

OPS: tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
DEFAULT_SEQLENS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS: tuple[int, ...] = (64, 128)
DEFAULT_HEADS = 12
DEFAULT_TOKENS = 16384
#: identifies the JSON document
FORMAT = "sparktune-bench/1"
MEMORY_NOTE = (
    "peak_mem_bytes: torch.cuda.max_memory_allocated() while the candidate is prepared and runs "
    "once, minus what was allocated before (the inputs and the references): outputs, workspace "
    "and, for the backward, what the forward saved. input_bytes: q, k, v (and dout for a "
    "backward); add it for the total."
)
_MAX_MESSAGE = 500


def case_flops(shape: Problem, op: str) -> float:
    """FLOPs of ``op`` on ``shape`` as FlashAttention counts them (Problem.flops): forward
    4*B*H*Nq*Nk*D, halved when causal; backward 2.5x that; forward+backward 3.5x."""
    fwd = shape.replace(op="fwd").flops()
    bwd = shape.replace(op="bwd").flops()
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[op]


def sweep_shapes(
    *,
    dtypes: Sequence[str],
    head_dims: Sequence[int],
    causal: Sequence[bool],
    seqlens: Sequence[int],
    heads: int,
    tokens: int,
) -> list[Problem]:
    """The forward Problems of the sweep (batch = tokens / seqlen; with the defaults,
    FlashAttention-2's long-sequence benchmark: 16k tokens, seqlen 512-16k, hd 64 and 128,
    causal and not); raises ValueError when tokens is not a multiple of a seqlen."""
    out = []
    for dtype in dtypes:
        for d in head_dims:
            for c in causal:
                for n in seqlens:
                    if tokens % n or tokens < n:
                        raise ValueError(f"--tokens {tokens} is not a multiple of seqlen {n}")
                    out.append(Problem("fwd", dtype, tokens // n, heads, heads, n, n, d, bool(c)))
    return out


def recipe_shapes(problems: Iterable[Problem]) -> tuple[list[Problem], tuple[str, ...]]:
    """(forward shapes in order, ops) of a recipe's problems: its ops, and forward+backward
    when it has both."""
    shapes: list[Problem] = []
    ops: set[str] = set()
    for p in problems:
        ops.add(p.op)
        s = p.replace(op="fwd")
        if s not in shapes:
            shapes.append(s)
    chosen = [o for o in ("fwd", "bwd") if o in ops]
    if len(chosen) == 2:
        chosen.append("fwd+bwd")
    return shapes, tuple(chosen)


class WallClockTimer:
    """Host wall-clock timing for CPU tensors: ``warmup`` runs, then ``runs`` timed runs."""

    def __init__(self, *, runs: int = 5, warmup: int = 1) -> None:
        self.runs = runs
        self.warmup = warmup

    def measure(self, fn: Callable[[], object], *, candidate: Any = None, problem: Any = None) -> Timing:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing.of(times)


# --------------------------------------------------------------------------- results


@dataclass
class BenchRow:
    """One candidate on one shape and op."""

    dtype: str
    op: str
    head_dim: int
    causal: bool
    seqlen: int
    seqlen_k: int
    batch: int
    heads: int
    heads_kv: int
    candidate: str
    #: "ok", "wrong", "failed", "unavailable", "skipped" or "not run"
    status: str
    kernel: str = ""
    reason: str = ""
    median_ms: float | None = None
    q1_ms: float | None = None
    q3_ms: float | None = None
    min_ms: float | None = None
    runs: int = 0
    tflops: float | None = None
    baseline: str = ""
    speedup: float | None = None
    peak_mem_bytes: int | None = None
    input_bytes: int = 0
    error: float | None = None
    error_limit: float | None = None
    flops: float = 0.0
    #: the options tried (``own``: one per backend, and the backends that could not run)
    tried: list[dict[str, Any]] = field(default_factory=list)
    #: timing passes made (the faster pass's figures are kept)
    passes: int = 1

    @property
    def shape_key(self) -> tuple[Any, ...]:
        return (self.head_dim, self.causal, self.seqlen, self.seqlen_k, self.batch, self.heads, self.heads_kv)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("error", "error_limit"):
            if d[k] is not None and not math.isfinite(d[k]):
                d[k] = None if math.isnan(d[k]) else "inf"
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchRow:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in ("dtype", "op", "head_dim", "causal", "seqlen", "batch", "heads", "candidate", "status") if n not in d]
        if missing:
            raise ValueError(f"a result lacks {', '.join(missing)}")
        kw = {k: v for k, v in d.items() if k in names}
        kw.setdefault("seqlen_k", kw["seqlen"])
        kw.setdefault("heads_kv", kw["heads"])
        for k in ("error", "error_limit"):
            if kw.get(k) == "inf":
                kw[k] = math.inf
        return cls(**kw)


@dataclass
class BenchReport:
    """Everything a run produced: ``meta`` (versions, device, settings, wall time, notes) and
    the rows, in the order measured."""

    meta: dict[str, Any]
    rows: list[BenchRow]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.meta, "results": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, doc: Any) -> BenchReport:
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"not a sparktune bench JSON document (no \"format\": \"{FORMAT}\")")
        results = doc.get("results")
        if not isinstance(results, list):
            raise ValueError("the document has no \"results\" list")
        meta = {k: v for k, v in doc.items() if k not in ("format", "results")}
        return cls(meta, [BenchRow.from_json(r) for r in results])

    @property
    def baseline(self) -> str:
        return str(self.meta.get("settings", {}).get("baseline", "flash"))

    def set_speedups(self, baseline: str) -> None:
        """speedup = the baseline's median time over the row's, per shape and op."""
        base: dict[tuple[Any, ...], float] = {}
        for r in self.rows:
            if r.candidate == baseline and r.status == "ok" and r.median_ms:
                base[(r.dtype, r.op, r.shape_key)] = r.median_ms
        for r in self.rows:
            r.baseline = baseline
            b = base.get((r.dtype, r.op, r.shape_key))
            r.speedup = b / r.median_ms if b is not None and r.status == "ok" and r.median_ms else None

    def wrong(self) -> list[str]:
        """Every result that failed the reference check (an option of ``own`` included)."""
        out = []
        for r in self.rows:
            if r.status == "wrong":
                out.append(f"{r.candidate} {r.kernel}")
            else:
                out += [f"{r.candidate} {t.get('kernel')}" for t in r.tried if t.get("status") == "wrong"]
        return out


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


# --------------------------------------------------------------------------- the sweep


@dataclass
class SweepSettings:
    ops: tuple[str, ...] = OPS
    candidates: tuple[str, ...] = CANDIDATES
    baseline: str = "flash"
    #: math and plain are skipped when one N^2 score matrix would need more bytes
    max_quadratic_bytes: float = float(4 << 30)
    seed: int = 0
    #: "cuda", "cuda:N" or "cpu"
    torch_device: str = "cuda"
    #: the tuning database ``own`` reads (None: $SPARKTUNE_DB or the default)
    db: Any = None
    #: worker processes compiling Triton kernels ahead of the sweep
    compile_processes: int = 1
    #: timing passes over a shape's candidates, in alternating order; a candidate's faster
    #: median counts (the candidate timed first after the reference is not always the one
    #: that pays for the GPU settling)
    passes: int = 2


class SweepStopped(RuntimeError):
    pass


#: progress(row, done, total)
ProgressFn = Callable[[BenchRow, int, int], None]


class Sweep:
    """Runs ``settings.ops`` x ``settings.candidates`` on each shape (forward Problems)."""

    def __init__(
        self,
        shapes: Sequence[Problem],
        settings: SweepSettings,
        *,
        timer: Any,
        device: DeviceInfo | None,
        progress: ProgressFn | None = None,
    ) -> None:
        self.shapes = list(shapes)
        self.settings = settings
        self.timer = timer
        self.device = device
        self.progress = progress
        #: where notes on the way go (e.g. compiling ahead); None: nowhere
        self.say: Callable[[str], None] | None = None
        self.cuda = torch.device(settings.torch_device).type == "cuda"
        self.tuned = TunedRecords(device, settings.db)
        self.context = Context(device, settings.torch_device, settings.max_quadratic_bytes, self.tuned)

    @property
    def total(self) -> int:
        return len(self.shapes) * len(self.settings.ops) * len(self.settings.candidates) * max(1, self.settings.passes)

    # ------------------------------------------------------------------ memory

    def _mem_begin(self) -> int | None:
        if not self.cuda:
            return None
        dev = torch.device(self.settings.torch_device)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)

    def _mem_peak(self, base: int | None) -> int | None:
        if base is None:
            return None
        dev = torch.device(self.settings.torch_device)
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - base)

    def _alive(self) -> str:
        if not self.cuda:
            return ""
        try:
            torch.cuda.synchronize(torch.device(self.settings.torch_device))
        except Exception as exc:  # noqa: BLE001
            return _short(exc)
        return ""

    # ------------------------------------------------------------------ one option

    def _measure(self, option: Option, shape: Problem, op: str, inputs: Inputs, refs: References, candidate: str) -> dict[str, Any]:
        try:
            refs.expected(op)  # computed outside the candidate's scope and memory figure
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the float64 reference
            if self.cuda:
                torch.cuda.empty_cache()
            return {"kernel": option.label, "status": "failed", "reason": f"computing the reference: {_short(exc)}"}
        try:
            return self._measure_checked(option, shape, op, inputs, refs, candidate)
        except Exception as exc:  # noqa: BLE001 - e.g. the candidate's scope or the check raised
            if self.cuda:
                torch.cuda.empty_cache()
            return {"kernel": option.label, "status": "failed", "reason": _short(exc)}

    def _measure_checked(
        self, option: Option, shape: Problem, op: str, inputs: Inputs, refs: References, candidate: str
    ) -> dict[str, Any]:
        res: dict[str, Any] = {"kernel": option.label, "status": "failed", "reason": ""}
        fn = outs = timing = None
        try:
            with option.scope(), torch.set_grad_enabled(op != "fwd"):
                base = self._mem_begin()
                try:
                    fn = option.make(inputs)
                    outs = fn()
                    res["peak_mem_bytes"] = self._mem_peak(base)
                except Exception as exc:  # noqa: BLE001 - a failing candidate is a result
                    res["reason"] = f"while checking: {_short(exc)}"
                    return res
                check = refs.check(op, outs)
                outs = None
                res["error"], res["error_limit"] = check.error, check.limit
                if not check.ok:
                    res["status"], res["reason"] = "wrong", check.message
                    return res
                try:
                    timing = self.timer.measure(
                        fn,
                        candidate=Candidate(option.backend or candidate, option.kernel),
                        problem=shape.replace(op="bwd" if op == "bwd" else "fwd"),
                    )
                except Exception as exc:  # noqa: BLE001
                    res["reason"] = f"while timing: {_short(exc)}"
                    return res
        finally:
            fn = outs = None
            if self.cuda and timing is None:  # what a failure left allocated goes back
                torch.cuda.empty_cache()
        q1, q3 = timing.quartiles_ms
        res.update(
            status="ok", median_ms=timing.median_ms, q1_ms=q1, q3_ms=q3, min_ms=timing.min_ms,
            runs=timing.runs, tflops=case_flops(shape, op) / (timing.median_ms * 1e-3) / 1e12,
        )
        return res

    # ------------------------------------------------------------------ one candidate

    def _row(self, shape: Problem, op: str, candidate: str, status: str, **kw: Any) -> BenchRow:
        return BenchRow(
            dtype=shape.dtype, op=op, head_dim=shape.head_dim, causal=shape.causal,
            seqlen=shape.seqlen_q, seqlen_k=shape.seqlen_k, batch=shape.batch,
            heads=shape.heads_q, heads_kv=shape.heads_kv, candidate=candidate, status=status,
            flops=case_flops(shape, op), **kw,
        )

    def _run_candidate(self, shape: Problem, op: str, candidate: str, plan: Plan, inputs: Inputs | None, refs: References | None) -> BenchRow:
        in_bytes = inputs.nbytes(op) if inputs is not None else 0
        if not plan.options:
            return self._row(
                shape, op, candidate, "skipped" if plan.skipped else "unavailable",
                reason="; ".join(plan.reasons) or "no option", input_bytes=in_bytes,
            )
        assert inputs is not None and refs is not None
        tried = [{"kernel": n, "status": "unavailable", "reason": r} for n, r in plan.unavailable]
        results = []
        for option in plan.options:
            res = self._measure(option, shape, op, inputs, refs, candidate)
            results.append(res)
            if res["status"] == "failed":
                broken = self._alive()
                if broken:
                    raise SweepStopped(
                        f"the CUDA context is unusable after {candidate} ({option.label}) failed "
                        f"on {_case_text(shape, op)}: {broken}"
                    )
        ok = [r for r in results if r["status"] == "ok"]
        if ok:
            best = min(ok, key=lambda r: r["median_ms"])
        else:
            best = next((r for r in results if r["status"] == "wrong"), results[0])
        if len(plan.options) > 1 or plan.unavailable:
            tried = [
                {k: r.get(k) for k in ("kernel", "status", "reason", "median_ms", "tflops")} for r in results
            ] + tried
        else:
            tried = []
        fields = {k: v for k, v in best.items() if k not in ("status", "kernel", "reason")}
        reason = best["reason"]
        if not ok and len(results) > 1:
            reason = "; ".join(f"{r['kernel']}: {r['reason']}" for r in results)
        return self._row(
            shape, op, candidate, best["status"], kernel=best["kernel"], reason=reason,
            input_bytes=in_bytes, tried=tried, **fields,
        )

    # ------------------------------------------------------------------ compile ahead

    def _compile_ahead(self, plans: dict[tuple[int, str, str], Plan]) -> None:
        # one job per config, dtype, head dim, mask and op; a size Triton specialises on
        # differently (e.g. a batch of 1) compiles on first use, before the timing
        jobs: dict[tuple[Any, ...], tuple[Problem, str]] = {}
        for plan in plans.values():
            for option in plan.options:
                for backend, problem, config in option.compile:
                    key = (problem.op, problem.dtype, problem.head_dim, problem.causal, problem.group_size > 1, config)
                    if backend == "triton":
                        jobs.setdefault(key, (problem, config))
        if not jobs or not self.cuda:
            return
        if self.say is not None:
            self.say(f"compiling {len(jobs)} Triton kernel variant(s) ahead of the timing")
        try:
            from ..backends.triton import warmup_jobs

            warmup_jobs(list(jobs.values()), processes=self.settings.compile_processes)
        except Exception as exc:  # noqa: BLE001 - compilation errors surface in the runs
            log.info("sparktune bench: compiling the Triton kernels ahead failed: %s", _short(exc))

    # ------------------------------------------------------------------ the sweep

    def run(self) -> BenchReport:
        start = time.monotonic()
        s = self.settings
        rows: list[BenchRow] = []
        stopped = ""
        done = 0
        plans: dict[tuple[int, str, str], Plan] = {}
        try:
            for i, shape in enumerate(self.shapes):
                for op in s.ops:
                    for cand in s.candidates:
                        try:
                            plans[(i, op, cand)] = plan_case(cand, shape, op, self.context)
                        except Exception as exc:  # noqa: BLE001 - planning errors are reasons
                            plans[(i, op, cand)] = Plan(reasons=[f"planning raised {_short(exc)}"])
            self._compile_ahead(plans)
            for i, shape in enumerate(self.shapes):
                runnable = any(plans[(i, op, c)].options for op in s.ops for c in s.candidates)
                inputs = make_inputs(shape, s.torch_device, s.seed + i) if runnable else None
                refs = References(inputs, shape.dtype) if inputs is not None else None
                try:
                    for op in s.ops:
                        best: dict[str, BenchRow] = {}
                        for n in range(max(1, s.passes)):
                            for cand in s.candidates if n % 2 == 0 else reversed(s.candidates):
                                before = best.get(cand)
                                if before is None:
                                    row = self._run_candidate(shape, op, cand, plans[(i, op, cand)], inputs, refs)
                                elif before.status != "ok":
                                    row = before  # only what ran is timed again
                                else:
                                    again = self._run_candidate(shape, op, cand, plans[(i, op, cand)], inputs, refs)
                                    faster = again.status == "ok" and again.median_ms < before.median_ms
                                    row = again if faster else before
                                    row.passes = n + 1
                                best[cand] = row
                                done += 1
                                if self.progress is not None:
                                    self.progress(row, done, self.total)
                        rows.extend(best[c] for c in s.candidates)
                finally:
                    inputs = refs = None
                    if self.cuda:
                        torch.cuda.empty_cache()
        except SweepStopped as exc:
            stopped = str(exc)
        except KeyboardInterrupt:
            stopped = "interrupted"
        if stopped:
            measured = {(r.dtype, r.op, r.shape_key, r.candidate) for r in rows}
            for shape in self.shapes:
                for op in s.ops:
                    for cand in s.candidates:
                        row = self._row(shape, op, cand, "not run", reason=f"the sweep stopped: {stopped}")
                        if (row.dtype, row.op, row.shape_key, row.candidate) not in measured:
                            rows.append(row)
        report = BenchReport(self._meta(time.monotonic() - start, stopped), rows)
        report.set_speedups(s.baseline)
        return report

    def _meta(self, wall: float, stopped: str) -> dict[str, Any]:
        from .. import __version__
        from ..dispatch import build_id

        s = self.settings
        if self.device is not None:
            d = self.device
            device: dict[str, Any] = {
                "type": "cuda", "name": d.name, "capability": list(d.capability), "sm_count": d.sm_count,
                "driver": d.driver, "cuda": d.cuda,
            }
        else:
            import platform

            device = {"type": "cpu", "name": platform.processor() or platform.machine() or "cpu"}
        timer = self.timer
        timer_info = {"kind": type(timer).__name__}
        for k in ("warmup_ms", "rep_ms", "min_runs", "max_runs", "max_rel_iqr", "flush_l2", "runs", "warmup"):
            if hasattr(timer, k):
                timer_info[k] = getattr(timer, k)
        return {
            "sparktune": __version__,
            "torch": str(torch.__version__),
            "build_id": build_id(),
            "device": device,
            "settings": {
                "ops": list(s.ops),
                "candidates": list(s.candidates),
                "baseline": s.baseline,
                "max_quadratic_bytes": s.max_quadratic_bytes if math.isfinite(s.max_quadratic_bytes) else None,
                "seed": s.seed,
                "timer": timer_info,
            },
            "tuning_store": {"where": self.tuned.where, "note": self.tuned.note} if self.device is not None else None,
            "memory": MEMORY_NOTE if self.cuda else "peak memory is measured on CUDA devices only",
            "wall_s": round(wall, 3),
            "stopped": stopped,
        }


def _case_text(shape: Problem, op: str) -> str:
    return (
        f"{op} {shape.dtype} hd {shape.head_dim} {'causal' if shape.causal else 'non-causal'} "
        f"seqlen {shape.seqlen_q} batch {shape.batch} heads {shape.heads_q}"
    )

