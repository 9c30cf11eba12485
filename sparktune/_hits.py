"""Repeated calls: what a call of ``sparktune.attention()`` worked out (checks, dispatch, the
backend's ``forward_runner``), kept under a key of every property the checks and dispatch
read, so that a later call with an equal key costs a dictionary lookup and the launch."""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import dispatch
from ._checks import bhnd
from ._execute import in_layout, run_config
from ._plan import Plan

__all__ = ["Hit", "remember", "table"]

log = logging.getLogger("sparktune.attention")


class Hit:
    """What a call runs again when a later call has an equal key (see :func:`attention`):
    the key holds every property of the inputs and arguments that the checks and dispatch
    read, so an equal key passes the same checks and gets the same kernel. Valid while
    dispatch's generation is the one it was made in."""

    __slots__ = ("generation", "source", "plan", "run")

    def __init__(self, generation: int, source: str, plan: Plan, run: Any) -> None:
        self.generation = generation
        self.source = source
        self.plan = plan
        #: (q, k, v) in the user's layout -> (out, lse) without autograd; None until a
        #: call without autograd made it
        self.run = run


#: call key -> its Hit
table: dict[tuple[Any, ...], Hit] = {}


#: more distinct keys than this start the table afresh
_HITS_MAX = 4096


def _generic_run(plan: Plan, need_lse: bool) -> Any:
    backend, config, layout, causal, scale = (
        plan.backend, plan.config, plan.layout, plan.causal, plan.scale,
    )  # fmt: skip

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return run_config(backend, config, q, k, v, layout, causal, scale, need_lse)

    return run


def _runner(plan: Plan, need_lse: bool, made: tuple[torch.Tensor, ...]) -> Any:
    """The no-autograd forward of a hit: the backend's ``forward_runner`` for these inputs
    when it offers one and it reproduces, bit for bit, the output ``made`` by the general
    path on the same tensors; else the general path itself."""
    generic = _generic_run(plan, need_lse)
    hook = type(plan.backend).forward_runner
    if hook is None:
        return generic
    q, k, v, out, lse = made
    layout = plan.layout
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return generic  # the comparison below would synchronise a capturing stream
    try:
        fast = hook(
            plan.backend,
            bhnd(q, layout),
            bhnd(k, layout),
            bhnd(v, layout),
            bhnd(out, layout),
            config=plan.config,
            causal=plan.causal,
            scale=plan.scale,
            need_lse=need_lse,
        )
        if fast is None:
            return generic
        if layout == "bhnd":
            run = fast
        else:

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
                o, lse = fast(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                return in_layout(o, "bnhd"), lse

        again, again_lse = run(q, k, v)
        same = again.shape == out.shape and torch.equal(again, out)
        if need_lse:
            same = same and again_lse is not None and torch.equal(again_lse, lse)
    except Exception as exc:  # noqa: BLE001 - the general path stays
        log.info("sparktune: %s forward_runner failed (%s); using forward", plan.backend.name, exc)
        return generic
    if not same:
        log.info(
            "sparktune: %s forward_runner(%s) differs from its forward; using forward",
            plan.backend.name,
            plan.config,
        )
        return generic
    return run


def remember(
    key: tuple[Any, ...],
    generation: int,
    source: str,
    plan: Plan,
    need_lse: Any,
    made: tuple[torch.Tensor, ...] | None,
) -> None:
    """Keep what this call ran for later calls with an equal key (not when dispatch's state
    changed meanwhile: a selection made before a reload must not outlive it). ``made``: the
    call's (q, k, v, out, lse) without autograd; None for a training call."""
    if generation != dispatch.generation:
        return
    old = table.get(key)
    if old is not None and old.generation == generation and made is None:
        return  # a training call: what a call without autograd made before stays
    if len(table) >= _HITS_MAX:
        table.clear()
    run = None if made is None else _runner(plan, bool(need_lse), made)
    table[key] = Hit(generation, source, plan, run)
