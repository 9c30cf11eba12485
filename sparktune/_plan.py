"""The plan of one call: the forward Problem (cached per shape), the device's fingerprint,
dispatch's selection with the one-time fallback warning, and the backend and config chosen."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from . import dispatch, registry
from ._checks import SUPPORTED_DTYPES, check_scale, checked_sizes, quick_sizes
from ._warnings import Once
from .backends.base import Backend
from .problem import DeviceInfo, Problem

__all__ = [
    "FALLBACK_BACKENDS",
    "Plan",
    "backward_problem",
    "device_info",
    "forward_problem",
    "op_plan",
    "plan_for",
    "select_forward",
    "warn_once",
]

log = logging.getLogger("sparktune.attention")

#: the one-time warnings of a call (the fallbacks, a backward on the reference math)
warn_once = Once(log, logging.INFO, warn=True)


#: backends that mean "no fast kernel ran"
FALLBACK_BACKENDS = ("reference",)


#: CUDA device index -> its fingerprint (a device does not change during a process)
_cuda_infos: dict[int, DeviceInfo] = {}


def _cuda_device_info(index: int) -> DeviceInfo:
    info = _cuda_infos.get(index)
    if info is None:
        info = _cuda_infos[index] = DeviceInfo.from_torch(torch.device("cuda", index))
    return info


def device_info(device: torch.device) -> DeviceInfo | None:
    """The fingerprint of a CUDA device (cached per index); None for any other device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_info(index)


#: the forward problems seen, by (dtype, sizes, causal, allow_fp16_accum): a repeated shape
#: reuses its Problem (validated once, when it was made), and dispatch's memo finds it by
#: identity
_problems: dict[tuple[Any, ...], Problem] = {}


#: more distinct shapes than this (e.g. a growing decode length) start the table afresh
_PROBLEMS_MAX = 4096


def forward_problem(key: tuple[Any, ...]) -> Problem:
    """The forward Problem of ``(dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
    head_dim, causal, allow_fp16_accum)``, followed for a call with features by
    ``(window_left, window_right, softcap, alibi, dropout, varlen, total_q, total_k)``."""
    problem = _problems.get(key)
    if problem is None:
        dtype, b, hq, hk, nq, nk, d, causal, fp16, *features = key
        extra = (
            dict(zip(_FEATURE_FIELDS, features, strict=True)) if features else {}
        )
        problem = Problem(
            op="fwd",
            dtype=SUPPORTED_DTYPES[dtype],
            batch=b,
            heads_q=hq,
            heads_kv=hk,
            seqlen_q=nq,
            seqlen_k=nk,
            head_dim=d,
            causal=causal,
            allow_fp16_accum=fp16,
            **extra,
        )
        if len(_problems) >= _PROBLEMS_MAX:
            _problems.clear()
        _problems[key] = problem
    return problem


#: the feature fields that follow the plain ones in a call's key (see forward_problem)
_FEATURE_FIELDS = (
    "window_left", "window_right", "softcap", "alibi", "dropout", "varlen", "total_q", "total_k",
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What one call runs: the chosen backend and config, and what the backward needs to
    choose its own kernel."""

    backend: Backend
    config: str
    causal: bool
    scale: float
    layout: str
    problem: Problem
    device: DeviceInfo | None
    #: the user forced ``backend`` (and maybe ``config``): the backward keeps to it
    forced: bool
    #: the call's features (:class:`sparktune._checks.Features`), None for a plain call
    features: Any = None


class PlanMemo:
    """What a call works out from its plan alone, once per plan and dispatch generation (a
    repeated call on a dispatch hit has the same Plan object): :meth:`get` computes it the
    first time and returns the kept value while dispatch's selections stand. Holds at most
    ``limit`` plans, then starts again."""

    __slots__ = ("_table", "_limit")

    def __init__(self, limit: int = 1024) -> None:
        #: id of a Plan -> (that Plan, dispatch's generation, the value)
        self._table: dict[int, tuple[Plan, int, Any]] = {}
        self._limit = limit

    def get(self, plan: Plan, compute: Any) -> Any:
        """``compute(plan)``, or what it gave for this plan in this dispatch generation."""
        kept = self._table.get(id(plan))
        if kept is not None and kept[0] is plan and kept[1] == dispatch.generation:
            return kept[2]
        generation = dispatch.generation
        value = compute(plan)
        if len(self._table) >= self._limit:
            self._table.clear()
        self._table[id(plan)] = (plan, generation, value)
        return value


#: id of a forward Problem -> (that Problem, its backward Problem)
_bwd_problems: dict[int, tuple[Problem, Problem]] = {}


def backward_problem(problem: Problem, deterministic: bool = False) -> Problem:
    if deterministic:
        return problem.replace(op="bwd", deterministic=True)
    pair = _bwd_problems.get(id(problem))
    if pair is None or pair[0] is not problem:
        if len(_bwd_problems) >= _PROBLEMS_MAX:
            _bwd_problems.clear()
        pair = _bwd_problems[id(problem)] = (problem, problem.replace(op="bwd"))
    return pair[1]


def select_forward(
    problem: Problem,
    device: DeviceInfo | None,
    dev: torch.device,
    backend: str | None,
    config: str | None,
) -> Any:
    """The forward's Selection from dispatch, with the one-time fallback warning (pointing at
    the caller of :func:`attention`, through :func:`plan_for`)."""
    selection = dispatch.select(problem, device, backend=backend, config=config)
    chosen = selection.candidate
    if (
        selection.source != "forced"
        and (device is None or chosen.backend in FALLBACK_BACKENDS)
        and "fallback" not in warn_once
    ):
        warn_fallback(chosen, device, dev, stacklevel=6)
    return selection


def warn_fallback(
    chosen: Any, device: DeviceInfo | None, dev: torch.device, stacklevel: int = 4
) -> None:
    """The one-time warning that the forward runs on a fallback (``chosen``, a Candidate)."""
    why = (
        f"the tensors are on {dev.type}, and sparktune's GPU kernels need CUDA tensors"
        if device is None
        else "no GPU backend can run this problem here (see `sparktune info`)"
    )
    warn_once(
        "fallback",
        f"sparktune: attention runs on the fallback {chosen.label} because {why}; "
        "expect it to be slow",
        stacklevel=stacklevel,
    )


def op_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    layout: str,
    backend: str | None,
    config: str | None,
    allow_fp16_accum: bool,
) -> Plan:
    """The plan of a call of the custom ops (:mod:`sparktune._ops`) on real tensors: the
    checks, Problem, dispatch and fallback warning of :func:`attention`'s eager path."""
    sizes = quick_sizes(q, k, v, layout)
    if sizes is None:
        sizes = checked_sizes(q, k, v, layout)
    return plan_for(sizes, causal, scale, layout, backend, config, allow_fp16_accum)[0]


def plan_for(
    sizes: tuple[Any, ...],
    causal: Any,
    scale: Any,
    layout: str,
    backend: str | None,
    config: str | None,
    allow_fp16_accum: Any,
    features: Any = None,
    totals: tuple[int, int] | None = None,
    warn: bool = True,
) -> tuple[Plan, str]:
    """(the plan, the source of dispatch's selection) for checked sizes: the scale checked,
    the forward Problem, the device's fingerprint, dispatch's choice and the fallback
    warning (which points at the caller of the caller's caller: attention()'s caller).
    ``features``: a call's checked :class:`~sparktune._checks.Features`; ``totals``: the
    packed (total_q, total_k) of a varlen call (sizes then hold the longest sequences)."""
    b, hq, hk, nq, nk, d, dtype, dev = sizes
    scale = 1.0 / math.sqrt(d) if scale is None else check_scale(scale, d)
    causal = bool(causal)
    key: tuple[Any, ...] = (dtype, b, hq, hk, nq, nk, d, causal, bool(allow_fp16_accum))
    if features is not None or totals is not None:
        wl, wr = features.window if features is not None else (-1, -1)
        key += (
            wl,
            wr,
            bool(features is not None and features.softcap),
            bool(features is not None and features.alibi_slopes is not None),
            bool(features is not None and features.dropout_p),
            totals is not None,
            *(totals or (0, 0)),
        )
    problem = forward_problem(key)
    device = device_info(dev)
    if warn:
        selection = select_forward(problem, device, dev, backend, config)
    else:
        selection = dispatch.select(problem, device, backend=backend, config=config)
    plan = Plan(
        backend=registry.get_backend(selection.candidate.backend),
        config=selection.candidate.config,
        causal=causal,
        scale=scale,
        layout=layout,
        problem=problem,
        device=device,
        forced=backend is not None,
        features=features,
    )
    return plan, selection.source
