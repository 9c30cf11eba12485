"""Calls that need gradients: sparktune's autograd functions, the native path where the
backward's backend records its own forward with PyTorch's autograd, and
:func:`recorded_for_backward`, which the tuner times."""

from __future__ import annotations

from typing import Any

import torch

from . import dispatch, registry
from ._checks import bhnd
from ._execute import backward_choice, in_layout, run_backward, run_features, run_forward
from ._plan import Plan, PlanMemo, backward_problem, device_info, forward_problem
from .backends.base import Backend
from .problem import DeviceInfo, Problem

__all__ = ["FeatureAttention", "native_choice", "recorded_for_backward", "train"]


#: each plan's :func:`_training_choice`: what a training call on a dispatch hit decides once
_training_choices = PlanMemo()
#: a forward dispatch chose over the backward backend's own runs paired with that backward
#: (:func:`_unless_backward_takes_forward`) only when its record says it takes at least this
#: long (milliseconds; a nearest record's time scaled by the FLOPs ratio). A paired call costs
#: about twice the host time of SDPA's own pair (Python in its backward: on the H200 about
#: 0.55-0.6 ms against 0.2-0.3 ms a call), which a call that is short on the GPU pays in full
#: where a training step is bound by the host; from here the forward and backward take about
#: three times that on the GPU, and the paired forward's saving is no longer lost in it
PAIR_MIN_FORWARD_MS = 0.5


def _forward_ms(plan: Plan) -> float | None:
    """The forward's time for the plan's problem as its dispatch record says (a nearest
    record's time scaled by the FLOPs ratio); None without a record."""
    try:
        selection = dispatch.select(plan.problem, plan.device)
    except dispatch.NoKernelError:
        return None
    record = selection.record
    if record is None or record.median_ms is None:
        return None
    flops = record.problem.flops()
    scale = plan.problem.flops() / flops if flops > 0 else 1.0
    return float(record.median_ms) * scale


def _training_choice(plan: Plan) -> tuple[Any, bool]:
    """(:func:`native_choice` for the plan, whether its forward may pair with another
    backend's backward), worked out once per plan and dispatch generation."""
    return _training_choices.get(plan, _decide_training)


def _decide_training(plan: Plan) -> tuple[Any, bool]:
    native = native_choice(plan.backend, plan.config, plan.problem, plan.device, plan.forced)
    pair = False
    if native is not None and not plan.forced and native[0] is not plan.backend:
        ms = _forward_ms(plan)
        pair = ms >= PAIR_MIN_FORWARD_MS if ms is not None else PAIR_MIN_FORWARD_MS <= 0
    return native, pair


def graph_node_names(t: torch.Tensor) -> set[str]:
    """The class names of every autograd node ``t``'s gradient would run through (which
    backward a call recorded: sparktune's ``_AttentionFunction``, or PyTorch's own SDPA
    nodes): for tests and benchmarks."""
    names: set[str] = set()
    todo, seen = [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def native_choice(
    backend: Backend, config: str, problem: Problem, device: DeviceInfo | None, forced: bool
) -> tuple[Backend, Any, str] | None:
    """(backend, its forward_autograd, config) for a call that needs gradients, where the
    backward would run on a backend that records its forward with PyTorch's autograd: the
    forced backend when it has the hook; else the backend dispatch chooses for the backward
    problem, when it has the hook (its forward then runs with the backward's config, so that
    the backward reuses what that forward saved). None: sparktune's autograd function."""
    if forced:
        native = type(backend).forward_autograd
        return (backend, native, config) if native is not None else None
    try:
        selection = dispatch.select(backward_problem(problem), device)
    except dispatch.NoKernelError:
        return None
    chosen = selection.candidate
    b = backend if chosen.backend == backend.name else registry.get_backend(chosen.backend)
    native = type(b).forward_autograd
    return (b, native, chosen.config) if native is not None else None


def _gradients(ctx: Any, dout: torch.Tensor | None, others: int) -> tuple[torch.Tensor | None, ...]:
    """The backward of sparktune's autograd functions (q, k, v, out and lse saved, the plan in
    ``ctx.plan``): dq, dk and dv where asked for, then None for the ``others`` inputs. ``dout``
    None (gradients are not materialised): the output took no part in what is differentiated."""
    if dout is None:
        return (None,) * (3 + others)
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = run_backward(ctx.plan, dout, q, k, v, out, lse)
    need = ctx.needs_input_grad
    return (
        dq if need[0] else None,
        dk if need[1] else None,
        dv if need[2] else None,
        *(None,) * others,
    )


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):  # type: ignore[override]
        out, lse = run_forward(plan, q, k, v, need_lse=True)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros made for the log-sum-exp's gradient
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        return _gradients(ctx, dout, 1)  # the plan


class FeatureAttention(torch.autograd.Function):
    """A call with features (or varlen): ``apply(q, k, v, plan, kwargs)`` -> (out, lse), the
    backend's feature arguments in ``kwargs`` (the dropout mask's seed and offset among them,
    so that the backward regenerates the same mask)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, kwargs):  # type: ignore[override]
        out, lse = run_features(plan, q, k, v, True, kwargs)
        ctx.plan = plan
        ctx.kwargs = kwargs
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = run_backward(ctx.plan, dout, q, k, v, out, lse, ctx.kwargs)
        need = ctx.needs_input_grad
        return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None


class _RecordedAttention(torch.autograd.Function):
    """:class:`_AttentionFunction` with the forward's results given: its backward is the
    same code a training step runs."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, plan):  # type: ignore[override]
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):  # type: ignore[override]
        return _gradients(ctx, dout, 3)  # out, lse and the plan


def recorded_for_backward(
    backend: Backend,
    config: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    allow_fp16_accum: bool = False,
) -> torch.Tensor:
    """``out`` ((B, H, N, D) tensors, q/k/v requiring gradients) recorded by autograd so
    that its backward is what a training call of :func:`attention` runs when dispatch gives
    the backward to ``backend:config``: autograd's engine, sparktune's autograd function and
    its gradient buffers, then the backend's ``backward``. The tuner times backward
    candidates this way, so that what the call path costs on the host counts. Raises
    :class:`~sparktune.dispatch.NoKernelError` when the backend cannot run it there."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    problem = forward_problem((q.dtype, b, hq, hk, nq, nk, d, bool(causal), bool(allow_fp16_accum)))
    plan = Plan(
        backend=backend,
        config=config,
        causal=bool(causal),
        scale=float(scale),
        layout="bhnd",
        problem=problem,
        device=device_info(q.device),
        forced=True,
    )
    chosen = backward_choice(plan)
    if chosen is None or chosen[0] is not backend or chosen[1] != config:
        raise dispatch.NoKernelError(
            f"{backend.name}:{config} cannot run the backward of {problem}"
        )
    return _RecordedAttention.apply(q, k, v, out, lse, plan)


def _unless_backward_takes_forward(
    plan: Plan, native: tuple[Backend, Any, str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[Backend, Any, str] | None:
    """``native``, unless its backend's backward runs from another backend's forward for these
    inputs (``backward_runner``): then None, so that the forward dispatch chose (faster than
    the backward's own, by its records) runs in sparktune's autograd function and the backward
    takes its output and log-sum-exp."""
    b, _, config = native
    if type(b).backward_runner is None:
        return native
    views = [bhnd(t, plan.layout) for t in (q, k, v)]
    run = b.backward_runner(*views, config=config, causal=plan.causal, scale=plan.scale)
    return native if run is None else None


def train(
    plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A call that needs gradients: the backward backend's own recorded forward when it has
    one (see :func:`native_choice`), unless that backward takes the forward dispatch chose and
    that forward is long enough to pay for the pairing (:data:`PAIR_MIN_FORWARD_MS`); else
    sparktune's autograd function."""
    native = None
    if not return_lse:
        native, pair = _training_choice(plan)
        if pair:
            native = _unless_backward_takes_forward(plan, native, q, k, v)
    if native is not None:
        native_backend, forward_autograd, native_config = native
        out = forward_autograd(
            native_backend,
            bhnd(q, plan.layout),
            bhnd(k, plan.layout),
            bhnd(v, plan.layout),
            config=native_config,
            causal=plan.causal,
            scale=plan.scale,
        )
        return in_layout(out, plan.layout)
    out, lse = _AttentionFunction.apply(q, k, v, plan)
    return (out, lse) if return_lse else out
