"""From the ranked records of a device to a selection: a forced choice, the fastest tuned
record of the problem, the fastest record of the nearest tuned shape of the same kind, or the
default for the device's architecture.

The nearest shape generalises: a record serves problems that differ from it only in batch,
head count, GQA ratio (grouped or not must agree: a kernel that reads grouped K/V as they are
and one that needs them repeated rank differently) and sequence lengths within
:data:`NEAREST_MAX_OCTAVES` octaves, since the ranking of kernels follows the work per key
block, which those do not change. Where nothing is in reach the default is measured, not a
preference for sparktune's own kernels: from sm_80 on, PyTorch SDPA's own choice
(``torch:auto``), which every measured model shape on the H200 ranks first or level with the
best; on Volta, where SDPA has no flash path, sparktune's kernels first (a model until
measured)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..backends.base import Backend, Candidate
from ..problem import DeviceInfo, Problem
from ..registry import backends, get_backend

if TYPE_CHECKING:
    from ..db import Record

__all__ = [
    "CPU_DECODE_DEFAULT_ORDER",
    "DECODE_DEFAULT_ORDER",
    "DEFAULT_ORDER",
    "FEATURE_DEFAULT_ORDER",
    "HOPPER_FEATURE_FWD_ORDER",
    "HOPPER_VARLEN_ORDER",
    "NEAREST_MAX_OCTAVES",
    "SOURCES",
    "VOLTA_DEFAULT_ORDER",
    "default_order",
    "NoKernelError",
    "Selection",
    "Table",
    "forced",
    "heuristic_default",
    "resolve",
    "table_of",
]

#: preference for a problem no record reaches, from sm_80 on (and for tensors off the GPU):
#: PyTorch SDPA's own choice first, the oracle last
DEFAULT_ORDER = ("torch", "spark", "triton", "reference")
#: the same before sm_80 (Volta), where SDPA has no flash kernel: sparktune's kernels first
VOLTA_DEFAULT_ORDER = ("spark", "triton", "torch", "reference")
#: decode problems on a GPU (docs/DECODING.md): the split-KV Triton kernels (no host sync, CUDA
#: graph capturable; level with SDPA on the sliced cache under graphs on the H200), then SDPA
#: on the sliced cache, then the reference math
DECODE_DEFAULT_ORDER = ("triton", "torch", "reference")
#: decode problems on CPU tensors: Triton under its interpreter, else the reference math
CPU_DECODE_DEFAULT_ORDER = ("triton", "reference", "torch")
#: problems with attention features (window, soft-capping, ALiBi, dropout, packed sequences) on
#: a GPU from sm_80 on: the Triton family first, which runs each of them in one kernel; the
#: torch backend's default there is FlexAttention, whose block mask is built for every call
#: (bench/varlen.py on an H200, 8 x 2048 packed causal, bf16: dispatch with DEFAULT_ORDER
#: 11 / 17 TFLOP/s forward / forward+backward, the Triton family forced 216 / 185)
FEATURE_DEFAULT_ORDER = ("triton", "torch", "spark", "reference")
#: the Problem.features that take FEATURE_DEFAULT_ORDER
_TRITON_FIRST_FEATURES = frozenset({"window", "softcap", "alibi", "dropout", "varlen"})
#: the forward and the backward of packed sequences with no other feature (the backward may be
#: deterministic) on a Hopper GPU: the family 90 kernels run them (one TMA view of the packed
#: rows, each sequence's tiles offset into it), then the order above (the forward: bench/varlen.py
#: on an H200 says by how much, BENCHMARKS.md)
HOPPER_VARLEN_ORDER = ("spark", "triton", "torch", "reference")
_HOPPER_VARLEN_FEATURES = frozenset({"varlen", "deterministic"})
#: the forward and the backward of sliding windows, soft-capping or ALiBi (packed or not,
#: deterministic or not; no dropout) on a Hopper GPU: the family 90 kernels run them (a window's
#: key blocks, or query blocks, skipped; softcap and ALiBi on the scores in registers), then the
#: order above; dropout keeps FEATURE_DEFAULT_ORDER
HOPPER_FEATURE_FWD_ORDER = ("spark", "triton", "torch", "reference")
#: the features of a forward or backward problem that the family 90 kernels run (any combination)
_HOPPER_FWD_FEATURES = frozenset({"window", "softcap", "alibi", "varlen", "deterministic"})
#: those that make the Hopper order HOPPER_FEATURE_FWD_ORDER (without them: packed sequences
#: alone, HOPPER_VARLEN_ORDER)
_HOPPER_SCORE_FEATURES = frozenset({"window", "softcap", "alibi"})
#: the first architecture where SDPA's own choice is the default
SDPA_DEFAULT_MIN_ARCH = 80
#: a record serves shapes whose seqlen_q and seqlen_k are each within this many octaves
NEAREST_MAX_OCTAVES = 1.0
#: where a selection came from, in the order they are tried
SOURCES = ("forced", "tuned", "nearest", "default")


class NoKernelError(ValueError):
    """No backend can run the problem; the message lists every backend's reasons."""


@dataclass(frozen=True)
class Selection:
    candidate: Candidate
    #: "forced", "tuned", "nearest" or "default"
    source: str
    detail: str = ""
    #: the tuning record behind a "tuned" or "nearest" selection
    record: Record | None = field(default=None, compare=False, repr=False)


# --------------------------------------------------------------------------- the records of a device


def _kind(p: Problem) -> tuple[Any, ...]:
    """Problems of one kind can share a kernel choice: everything but the sizes and the GQA
    ratio (whether K/V are grouped at all is part of the kind; the features and a window's
    extent are)."""
    kind = (p.op, p.dtype, p.head_dim, p.causal, p.allow_fp16_accum, p.group_size > 1, p.seqlen_q == p.seqlen_k)
    if p.features:  # a feature (and a window's extent) changes what runs and its cost
        kind += (p.window, p.softcap, p.alibi, p.dropout, p.deterministic, p.varlen)
    if p.op == "decode":  # a paged cache, its page size and appends change what runs
        kind += (p.page_size, p.appends > 0)
    return kind


def _octaves(a: Problem, b: Problem) -> float:
    """The larger of the octaves between the two shapes' seqlen_q and seqlen_k."""
    return max(abs(math.log2(a.seqlen_q / b.seqlen_q)), abs(math.log2(a.seqlen_k / b.seqlen_k)))


def _distance(a: Problem, b: Problem) -> float:
    """How far two shapes of one kind are: octaves of seqlen_q and seqlen_k, and half-weight
    octaves of the number of (batch, head) rows and of the GQA ratio."""
    return (
        abs(math.log2(a.seqlen_q / b.seqlen_q))
        + abs(math.log2(a.seqlen_k / b.seqlen_k))
        + 0.5 * abs(math.log2((a.batch * a.heads_q) / (b.batch * b.heads_q)))
        + 0.5 * abs(math.log2(a.group_size / b.group_size))
    )


@dataclass
class Table:
    """The usable records of one device model and build, fastest first per problem."""

    ranked: dict[Problem, list[Record]]
    by_kind: dict[tuple[Any, ...], list[Problem]]
    sources: list[str]


def table_of(ranked: dict[Problem, list[Record]], sources: list[str]) -> Table:
    """The table of ranked records, with the problems of each kind listed for the nearest
    shape."""
    by_kind: dict[tuple[Any, ...], list[Problem]] = {}
    for p in ranked:
        by_kind.setdefault(_kind(p), []).append(p)
    return Table(ranked, by_kind, sources)


# --------------------------------------------------------------------------- resolution
def _runnable_reasons(
    registered: dict[str, Backend], cand: Candidate, problem: Problem, device: DeviceInfo | None
) -> list[str]:
    b = registered.get(cand.backend)
    if b is None:
        return [f"backend {cand.backend!r} is not registered"]
    return b.runnable_reasons(problem, cand.config, device)


def _reasons_text(reasons: dict[str, list[str]]) -> str:
    lines = []
    for name, rs in reasons.items():
        lines.append(f"  {name}: " + ("; ".join(rs) if rs else "(no reason given)"))
    return "\n".join(lines)


def forced(problem: Problem, device: DeviceInfo | None, backend: str, config: str | None) -> Selection:
    """The choice asked for by the caller (``backend=``, ``config=``), if it can run. A forced
    backend without a backward is still chosen for the "bwd" problem: the call then says that
    it has none and recomputes the gradients with the reference math."""
    b = get_backend(backend)
    reasons = (
        b.unavailable_reasons()
        or b.feature_reasons(problem)
        or b.not_supported_reasons(problem, config, device)
    )
    if reasons:
        what = f"backend {backend!r}" + (f" config {config!r}" if config else "")
        raise NoKernelError(f"{what} cannot run {problem}:\n" + _reasons_text({backend: reasons}))
    cfg = config or b.default_config(problem, device)
    if cfg is None:
        raise NoKernelError(f"backend {backend!r} has no configuration for {problem}")
    return Selection(Candidate(backend, cfg), "forced", "asked for by the caller")


def heuristic_default(
    problem: Problem, device: DeviceInfo | None, *, registered: dict[str, Backend] | None = None
) -> Selection:
    """The choice for a problem no record reaches: the first backend in
    :func:`default_order` for the device (then any plugin) that can run it, with that
    backend's default config (the torch backend's is SDPA's own choice on a GPU)."""
    all_reasons: dict[str, list[str]] = {}
    registered = backends() if registered is None else registered
    kind = _default_kind(device, problem)
    preferred = _order(kind)
    order = [n for n in preferred if n in registered] + [n for n in registered if n not in preferred]
    for name in order:
        b = registered[name]
        reasons = b.runnable_reasons(problem, None, device)
        try:
            cfg = None if reasons else b.default_config(problem, device)
        except Exception as exc:  # noqa: BLE001
            reasons, cfg = [f"raised {type(exc).__name__}: {exc}"], None
        if reasons:
            all_reasons[name] = reasons
            continue
        if cfg is None:
            all_reasons[name] = ["no configuration supports this problem"]
            continue
        if problem.op == "decode":
            why = "the decode default order (docs/DECODING.md): no record reaches this shape"
        elif kind == "volta":
            why = "before sm_80 sparktune's kernels come first (SDPA has no flash path there)"
        elif kind == "hopper-varlen":
            why = (
                "packed sequences on sm_90: the Hopper kernels first (forward and backward), then "
                "the Triton family: no record reaches this shape"
            )
        elif kind == "hopper-features":
            why = (
                "windows, soft-capping or ALiBi on sm_90: the Hopper kernels first (forward and "
                "backward), then the Triton family: no record reaches this shape"
            )
        elif kind == "features":
            why = "with attention features the Triton family comes first: no record reaches this shape"
        else:
            why = "PyTorch SDPA's own choice comes first: no record reaches this shape"
        return Selection(Candidate(name, cfg), "default", f"default for the architecture ({name}: {why})")
    raise NoKernelError(f"no backend can run {problem}:\n" + _reasons_text(all_reasons))


def _default_kind(device: DeviceInfo | None, problem: Problem | None) -> str:
    """Which of the default orders applies (orders with equal contents are told apart here)."""
    if problem is not None and problem.op == "decode":
        return "cpu-decode" if device is None else "decode"
    if device is not None and device.arch < SDPA_DEFAULT_MIN_ARCH:
        return "volta"
    if device is not None and problem is not None and problem.features & _TRITON_FIRST_FEATURES:
        if device.arch == 90:
            feats = problem.features
            if feats & _HOPPER_SCORE_FEATURES:
                if problem.op in ("fwd", "bwd") and feats <= _HOPPER_FWD_FEATURES:
                    return "hopper-features"
            elif (
                problem.op in ("fwd", "bwd")
                and "varlen" in feats
                and feats <= _HOPPER_VARLEN_FEATURES
            ):
                return "hopper-varlen"
        return "features"
    return "plain"


#: kind -> the name of its order in this module (read at each call: tests replace them)
_ORDERS = {
    "cpu-decode": "CPU_DECODE_DEFAULT_ORDER", "decode": "DECODE_DEFAULT_ORDER",
    "volta": "VOLTA_DEFAULT_ORDER", "hopper-varlen": "HOPPER_VARLEN_ORDER",
    "hopper-features": "HOPPER_FEATURE_FWD_ORDER", "features": "FEATURE_DEFAULT_ORDER",
    "plain": "DEFAULT_ORDER",
}  # fmt: skip


def _order(kind: str) -> tuple[str, ...]:
    return globals()[_ORDERS[kind]]


def default_order(device: DeviceInfo | None, problem: Problem | None = None) -> tuple[str, ...]:
    """The backends' order of preference for a problem no record reaches on ``device``."""
    return _order(_default_kind(device, problem))


def _shape_text(p: Problem) -> str:
    return f"batch {p.batch}, heads {p.heads_q}/{p.heads_kv}, seqlen {p.seqlen_q}/{p.seqlen_k}"


def _from_records(
    records: Iterable[Record],
    problem: Problem,
    device: DeviceInfo,
    registered: dict[str, Backend],
    rejected: list[str] | None,
) -> Record | None:
    for r in records:
        reasons = _runnable_reasons(registered, Candidate(r.backend, r.config), problem, device)
        if not reasons:
            return r
        if rejected is not None:
            rejected.append(f"{r.label} ({r.median_ms:.4g} ms): " + "; ".join(reasons))
    return None


def resolve(
    problem: Problem,
    device: DeviceInfo | None,
    registered: dict[str, Backend],
    table: Table | None,
    rejected: list[str] | None = None,
) -> Selection:
    """The tuned record of the problem, else of the nearest tuned shape, in ``table`` (the
    records of ``device``; None without a device), else the heuristic default. ``rejected``
    receives the records passed over, with the reasons."""
    if device is not None and table is not None:
        exact = table.ranked.get(problem)
        if exact:
            r = _from_records(exact, problem, device, registered, rejected)
            if r is not None:
                return Selection(
                    Candidate(r.backend, r.config),
                    "tuned",
                    f"fastest tuned record for this problem ({r.median_ms:.4g} ms, {r.source})",
                    r,
                )
        near = sorted(
            (
                p
                for p in table.by_kind.get(_kind(problem), ())
                if p != problem and _octaves(p, problem) <= NEAREST_MAX_OCTAVES
            ),
            key=lambda p: (_distance(p, problem), p.seqlen_q, p.seqlen_k, p.batch, p.heads_q),
        )
        for p in near:
            r = _from_records(table.ranked[p], problem, device, registered, rejected)
            if r is not None:
                return Selection(
                    Candidate(r.backend, r.config),
                    "nearest",
                    f"nearest tuned shape: {_shape_text(p)} (distance {_distance(p, problem):.2g}: "
                    "the same kind, where batch, heads and the GQA ratio do not change the ranking; "
                    f"{r.median_ms:.4g} ms there, {r.source})",
                    r,
                )
    return heuristic_default(problem, device, registered=registered)
