"""Running a plan: the forward on a backend in the caller's layout, and the backward on the
backend dispatch chooses for it (the float32 reference math where none has one)."""

from __future__ import annotations

import functools
import logging

import torch

from . import dispatch, registry
from ._checks import bhnd
from ._plan import FALLBACK_BACKENDS, Plan, PlanMemo, backward_problem, warn_once
from .backends.base import Backend
from .backends.reference import reference_attention_backward

__all__ = [
    "backward_choice",
    "grad_buffer",
    "in_layout",
    "new_output",
    "run_backward",
    "run_config",
    "run_features",
    "run_forward",
]

log = logging.getLogger("sparktune.attention")


def in_layout(out: torch.Tensor, layout: str) -> torch.Tensor:
    """A backend's own (B, H, N, D) output in the user's layout: as it is for "bhnd" (its own
    dense strides, as F.scaled_dot_product_attention returns them), contiguous otherwise."""
    if layout == "bhnd":
        return out
    out = out.transpose(1, 2)
    return out if out.is_contiguous() else out.contiguous()


def new_output(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of q's shape, dtype and device, with q's strides where q is
    non-overlapping and dense (a permuted view, such as the (B, H, N, D) transpose of a
    (B, N, H, D) projection that transformers passes, gets an output of the same permutation,
    as cuDNN's SDPA gives it: transposing it back costs no copy), contiguous otherwise."""
    if type(q) is torch.Tensor:  # the same tensors as below, with less argument parsing
        if q.is_contiguous() or not _dense(q):
            return torch.empty_like(q, memory_format=torch.contiguous_format)
        return torch.empty_like(q)  # preserves a dense tensor's strides
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def run_config(
    backend: Backend,
    config: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    causal: bool,
    scale: float,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``backend``'s ``config`` on user-layout tensors; returns (out, lse): out a new
    tensor of q's shape, contiguous in the user's layout, except that for "bhnd" a backend
    that allocates its own output (``forward_alloc``: PyTorch's SDPA) returns it with its
    own dense strides, as F.scaled_dot_product_attention does."""
    alloc = type(backend).forward_alloc
    if layout == "bhnd":
        if alloc is None:
            out = new_output(q)
            lse = backend.forward(
                q, k, v, out, config=config, causal=causal, scale=scale, need_lse=need_lse
            )
        else:
            out, lse = alloc(
                backend, q, k, v, config=config, causal=causal, scale=scale, need_lse=need_lse
            )
    elif alloc is None:
        out = new_output(q)
        lse = backend.forward(
            bhnd(q, layout),
            bhnd(k, layout),
            bhnd(v, layout),
            bhnd(out, layout),
            config=config,
            causal=causal,
            scale=scale,
            need_lse=need_lse,
        )
    else:
        out_bhnd, lse = alloc(
            backend,
            bhnd(q, layout),
            bhnd(k, layout),
            bhnd(v, layout),
            config=config,
            causal=causal,
            scale=scale,
            need_lse=need_lse,
        )
        out = in_layout(out_bhnd, layout)
    if need_lse and lse is None:
        raise RuntimeError(f"backend {backend.name!r} config {config!r} returned no log-sum-exp")
    return out, lse


def run_features(
    plan: Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    need_lse: bool,
    kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of a call with features (``kwargs``: the backend's feature arguments,
    docs/FEATURES.md) on user-layout tensors (packed (total, H, D) for varlen, layout
    "thd"); returns (out, a new tensor contiguous in the user's layout, lse)."""
    layout = plan.layout
    out = new_output(q)
    lse = plan.backend.forward(
        bhnd(q, layout),
        bhnd(k, layout),
        bhnd(v, layout),
        bhnd(out, layout),
        config=plan.config,
        causal=plan.causal,
        scale=plan.scale,
        need_lse=need_lse,
        **kwargs,
    )
    if need_lse and lse is None:
        raise RuntimeError(
            f"backend {plan.backend.name!r} config {plan.config!r} returned no log-sum-exp"
        )
    return out, lse


def run_forward(
    plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the plan on user-layout tensors; returns (out in the user's layout, lse)."""
    return run_config(
        plan.backend, plan.config, q, k, v, plan.layout, plan.causal, plan.scale, need_lse
    )


#: each plan's :func:`backward_choice`
_backward_choices = PlanMemo()


def backward_choice(plan: Plan) -> tuple[Backend, str] | None:
    """The backend and config for the backward: chosen by dispatch for the "bwd" problem
    (the user's forced backend, and its forward config where it offers it for "bwd", when
    one was forced); None when none can run it. Worked out once per plan and dispatch
    generation (a training step's backward on a dispatch hit asks for it again); not kept for
    a call with features, whose plan holds the call's own ALiBi slopes and generator."""
    if plan.features is not None:
        return _backward_choice(plan)
    return _backward_choices.get(plan, _backward_choice)


def _backward_choice(plan: Plan) -> tuple[Backend, str] | None:
    features = plan.features
    problem = backward_problem(plan.problem, features is not None and features.deterministic)
    try:
        if plan.forced:
            b = plan.backend
            config = plan.config if plan.config in b.configs("bwd") else None
            selection = dispatch.select(problem, plan.device, backend=b.name, config=config)
        else:
            selection = dispatch.select(problem, plan.device)
    except dispatch.NoKernelError as exc:
        log.info("sparktune: no backward kernel: %s", exc)
        return None
    chosen = selection.candidate
    if not plan.forced and plan.device is not None and chosen.backend in FALLBACK_BACKENDS:
        warn_once(
            "backward-fallback",
            f"sparktune: the backward runs on the fallback {chosen.label} because no GPU "
            "backend can run it here (see `sparktune info`); expect it to be slow",
        )
    return registry.get_backend(chosen.backend), chosen.config


def grad_buffer(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient for input ``t``: ``t``'s dtype, device, shape and strides
    where ``t`` is non-overlapping and dense (a permuted layout stays permuted), contiguous
    otherwise (e.g. a slice of a packed QKV tensor)."""
    g = torch.empty_like(t)  # keeps t's strides exactly when t is non-overlapping and dense
    if g.stride() == t.stride() or g.is_contiguous():
        return g
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is non-overlapping and dense (its elements fill its storage span)."""
    return _dense_layout(t.stride(), t.shape)


@functools.lru_cache(maxsize=1024)
def _dense_layout(strides: tuple[int, ...], shape: torch.Size) -> bool:
    dims = sorted((st, n) for st, n in zip(strides, shape, strict=True) if n > 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def _with_grad_strides(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``g`` (a gradient a backend allocated) with the strides :func:`grad_buffer` gives for
    input ``t`` (``t``'s own where it is non-overlapping and dense, contiguous otherwise),
    copied only when they differ in a dimension longer than 1."""
    gs, ts = g.stride(), t.stride()
    if _dense_layout(ts, t.shape):
        if gs == ts:
            return g
        same = all(n <= 1 or a == b for a, b, n in zip(gs, ts, t.shape, strict=True))
    else:
        same = g.is_contiguous()  # (which ignores the strides of dimensions of size 1)
    if same:
        return g
    out = grad_buffer(t)
    out.copy_(g)
    return out


def run_backward(
    plan: Plan,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kwargs: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients in the user's layout, from a backend's backward or the reference math.
    ``kwargs``: the feature arguments the forward ran with (a call with features)."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if kwargs is not None and plan.features is not None and plan.features.deterministic:
        kwargs = {**kwargs, "deterministic": True}
    choice = backward_choice(plan)
    if choice is not None and not kwargs and type(choice[0]).backward_runner is not None:
        # a backward that takes the forward's out and lse as given, into its own tensors
        b, config = choice
        given = [bhnd(t, plan.layout) for t in (dout, q, k, v, out)]
        run = b.backward_runner(*given[1:4], config=config, causal=plan.causal, scale=plan.scale)
        got = None if run is None else run(*given, lse)
        if got is not None:
            dq, dk, dv = (
                _with_grad_strides(in_layout(g, plan.layout), t)
                for g, t in zip(got, (q, k, v), strict=True)
            )
            return dq, dk, dv
    grads = [grad_buffer(t) for t in (q, k, v)]
    views = [bhnd(t, plan.layout) for t in (dout, q, k, v, out, *grads)]
    if choice is not None:
        b, config = choice
        if b.has_backward:
            try:
                if kwargs:
                    b.backward(
                        *views[:5], lse, *views[5:], config=config, causal=plan.causal,
                        scale=plan.scale, **kwargs,
                    )  # fmt: skip
                else:
                    b.backward(
                        *views[:5], lse, *views[5:], config=config, causal=plan.causal,
                        scale=plan.scale,
                    )  # fmt: skip
                return grads[0], grads[1], grads[2]
            except NotImplementedError:
                pass
        what = f"backend {b.name!r} config {config!r} has no backward"
    else:
        what = f"no backend can run the backward of {plan.problem.replace(op='bwd')}"
    warn_once(
        f"backward:{what}",
        f"sparktune: {what}; gradients are recomputed by the float32 reference math "
        "(correct but slow)",
    )
    computed = reference_attention_backward(
        *views[:4], causal=plan.causal, scale=plan.scale, compute_dtype=torch.float32,
        **(kwargs or {}),
    )
    for dst, src in zip(views[5:], computed, strict=True):
        dst.copy_(src)
    return grads[0], grads[1], grads[2]
