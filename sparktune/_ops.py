"""``sparktune.attention()`` as ``torch.library`` custom ops, for ``torch.compile`` and export.

- ``sparktune::attention_fwd(q, k, v, causal, scale, layout, backend, config,
  allow_fp16_accum, need_lse) -> (out, lse)``
- ``sparktune::attention_bwd(dout, q, k, v, out, lse, causal, scale, layout, backend, config,
  allow_fp16_accum) -> (dq, dk, dv)``

With features (docs/FEATURES.md; dropout aside, which runs eagerly):

- ``sparktune::attention_features_fwd(q, k, v, alibi_slopes, window, softcap, deterministic,
  causal, scale, layout, backend, config, allow_fp16_accum, need_lse) -> (out, lse)``
- ``sparktune::attention_features_bwd(dout, q, k, v, out, lse, alibi_slopes, window,
  softcap, deterministic, causal, scale, layout, backend, config, allow_fp16_accum)
  -> (dq, dk, dv)``

Tensors are in the caller's layout (``"bhnd"`` or ``"bnhd"``), as :func:`sparktune.attention`
takes them. ``scale`` None means ``1/sqrt(head_dim)``; ``backend`` and ``config`` None mean
that dispatch chooses. The kernel is chosen when the op runs, from the real tensors, by the
eager path's own machinery (Problem, dispatch, fallbacks and their warnings), so one traced
graph serves every shape that its guards admit. ``out`` has q's shape and dtype, contiguous
in the caller's layout; ``lse`` is float32 ``(B, Hq, Nq)``, contiguous, or an empty float32
tensor of shape ``(0,)`` when ``need_lse`` is False (``attention_bwd`` then recomputes it).
Gradients have their input's dtype, and its strides where the input is non-overlapping and
dense (contiguous otherwise). ``attention_fwd`` is differentiable in q, k and v through
``attention_bwd``; ``lse`` is not differentiable.

:func:`sparktune.attention` calls ``attention_fwd`` instead of its eager path while
``torch.compiler.is_compiling()`` is true.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ._checks import Features, check_features, check_scale, checked_sizes, quick_sizes, trim_window
from ._execute import grad_buffer, run_backward, run_features, run_forward
from ._plan import op_plan, plan_for

__all__ = [
    "attention_bwd",
    "attention_features_bwd",
    "attention_features_fwd",
    "attention_fwd",
    "traced_attention",
    "traced_features",
]

#: the non-tensor arguments both ops take, after their tensors
_SCALARS_SCHEMA = (
    "bool causal, float? scale, str layout, str? backend, str? config, bool allow_fp16_accum"
)
_FWD_SCHEMA = (
    f"(Tensor q, Tensor k, Tensor v, {_SCALARS_SCHEMA}, bool need_lse) -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_SCALARS_SCHEMA}) "
    "-> (Tensor, Tensor, Tensor)"
)
_NUM_SCALARS = 6
#: the shape of the lse that attention_fwd returns with need_lse=False
_NO_LSE = (0,)

#: the dispatch keys of autograd, which an op's real implementation runs without
_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor")
    if hasattr(torch._C.DispatchKey, name)
)


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Autograd's dispatch keys back on inside an op's real implementation: the torch
    backend's backward and the float32 reference fallback differentiate a recomputed forward
    with ``torch.autograd.grad``, and a custom op's implementation runs below autograd."""
    with contextlib.ExitStack() as stack:
        for key in _AUTOGRAD_KEYS:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        yield


def _bhnd_rows(q: torch.Tensor, layout: str) -> tuple[Any, Any, Any]:
    """(batch, heads_q, seqlen_q) of q given in ``layout``."""
    if layout == "bhnd":
        return q.shape[0], q.shape[1], q.shape[2]
    return q.shape[0], q.shape[2], q.shape[1]


@torch.library.custom_op("sparktune::attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd(q, k, v, causal, scale, layout, backend, config, allow_fp16_accum, need_lse):
    plan = op_plan(q, k, v, causal, scale, layout, backend, config, allow_fp16_accum)
    out, lse = run_forward(plan, q, k, v, need_lse)
    if not out.is_contiguous():  # SDPA's own layout: the op's output is contiguous
        out = out.contiguous()
    if not need_lse:
        return out, q.new_empty(_NO_LSE, dtype=torch.float32)
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.to(torch.float32, memory_format=torch.contiguous_format)
    return out, lse


@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, causal, scale, layout, backend, config, allow_fp16_accum, need_lse
):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_shape = _bhnd_rows(q, layout) if need_lse else _NO_LSE
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("sparktune::attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(
    dout, q, k, v, out, lse, causal, scale, layout, backend, config, allow_fp16_accum
):
    plan = op_plan(q, k, v, causal, scale, layout, backend, config, allow_fp16_accum)
    if lse.numel() == 0:  # from a forward run with need_lse=False
        _, lse = run_forward(plan, q, k, v, True)
    with _autograd_dispatch(), torch.no_grad():  # as the eager once-differentiable backward
        return run_backward(plan, dout, q, k, v, out, lse)


@attention_bwd.register_fake
def _attention_bwd_fake(
    dout, q, k, v, out, lse, causal, scale, layout, backend, config, allow_fp16_accum
):
    return grad_buffer(q), grad_buffer(k), grad_buffer(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scalars = tuple(inputs[3 : 3 + _NUM_SCALARS])
    ctx.mark_non_differentiable(lse)


def _attention_fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, *ctx.scalars)
    need = ctx.needs_input_grad
    return (
        dq if need[0] else None,
        dk if need[1] else None,
        dv if need[2] else None,
        *(None,) * (_NUM_SCALARS + 1),  # the scalars and need_lse
    )


attention_fwd.register_autograd(_attention_fwd_backward, setup_context=_setup_context)


def traced_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: Any,
    causal: Any,
    scale: Any,
    layout: str,
    backend: str | None,
    config: str | None,
    allow_fp16_accum: Any,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparktune.attention` while a compiler traces it, for inputs that passed its
    checks: the scale is checked, then one ``attention_fwd``. The log-sum-exp is computed
    when it is returned or when autograd may need it."""
    if scale is not None:
        scale = check_scale(scale, head_dim)
    need_lse = bool(return_lse) or (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    )
    out, lse = attention_fwd(
        q, k, v, bool(causal), scale, layout, backend, config, bool(allow_fp16_accum), need_lse
    )
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- with features

#: the feature arguments of the feature ops, after their tensors
_FEATURES_SCHEMA = "Tensor? alibi_slopes, int[] window, float softcap, bool deterministic"
_FEAT_FWD_SCHEMA = (
    f"(Tensor q, Tensor k, Tensor v, {_FEATURES_SCHEMA}, {_SCALARS_SCHEMA}, bool need_lse) "
    "-> (Tensor, Tensor)"
)
_FEAT_BWD_SCHEMA = (
    f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_FEATURES_SCHEMA}, "
    f"{_SCALARS_SCHEMA}) -> (Tensor, Tensor, Tensor)"
)
_NUM_FEATURE_ARGS = 4


def _features_plan(q, k, v, alibi_slopes, window, softcap, deterministic, causal, scale, layout,
                   backend, config, allow_fp16_accum):  # fmt: skip
    sizes = quick_sizes(q, k, v, layout)
    if sizes is None:
        sizes = checked_sizes(q, k, v, layout)
    b, hq, _, nq, nk, _, _, dev = sizes
    features = check_features(
        tuple(window), softcap, alibi_slopes, 0.0, None, deterministic, causal=bool(causal),
        batch=b, heads_q=hq, device=dev,
    )  # fmt: skip
    features.window = trim_window(features.window, nq, nk)
    plan, _ = plan_for(sizes, causal, scale, layout, backend, config, allow_fp16_accum, features)
    return plan, features.kwargs()


@torch.library.custom_op("sparktune::attention_features_fwd", mutates_args=(), schema=_FEAT_FWD_SCHEMA)
def attention_features_fwd(q, k, v, alibi_slopes, window, softcap, deterministic, causal, scale,
                           layout, backend, config, allow_fp16_accum, need_lse):  # fmt: skip
    plan, kwargs = _features_plan(
        q, k, v, alibi_slopes, window, softcap, deterministic, causal, scale, layout, backend,
        config, allow_fp16_accum,
    )  # fmt: skip
    out, lse = run_features(plan, q, k, v, need_lse, kwargs)
    if not out.is_contiguous():
        out = out.contiguous()
    if not need_lse:
        return out, q.new_empty(_NO_LSE, dtype=torch.float32)
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.to(torch.float32, memory_format=torch.contiguous_format)
    return out, lse


@attention_features_fwd.register_fake
def _attention_features_fwd_fake(q, k, v, alibi_slopes, window, softcap, deterministic, causal,
                                 scale, layout, backend, config, allow_fp16_accum, need_lse):  # fmt: skip
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_shape = _bhnd_rows(q, layout) if need_lse else _NO_LSE
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("sparktune::attention_features_bwd", mutates_args=(), schema=_FEAT_BWD_SCHEMA)
def attention_features_bwd(dout, q, k, v, out, lse, alibi_slopes, window, softcap, deterministic,
                           causal, scale, layout, backend, config, allow_fp16_accum):  # fmt: skip
    plan, kwargs = _features_plan(
        q, k, v, alibi_slopes, window, softcap, deterministic, causal, scale, layout, backend,
        config, allow_fp16_accum,
    )  # fmt: skip
    if lse.numel() == 0:
        _, lse = run_features(plan, q, k, v, True, kwargs)
    with _autograd_dispatch(), torch.no_grad():
        return run_backward(plan, dout, q, k, v, out, lse, kwargs)


@attention_features_bwd.register_fake
def _attention_features_bwd_fake(dout, q, k, v, out, lse, alibi_slopes, window, softcap,
                                 deterministic, causal, scale, layout, backend, config,
                                 allow_fp16_accum):  # fmt: skip
    return grad_buffer(q), grad_buffer(k), grad_buffer(v)


def _setup_features_context(ctx, inputs, output) -> None:
    q, k, v = inputs[:3]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.rest = tuple(inputs[3 : 3 + _NUM_FEATURE_ARGS + _NUM_SCALARS])
    ctx.mark_non_differentiable(lse)


def _attention_features_fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_features_bwd(dout, q, k, v, out, lse, *ctx.rest)
    need = ctx.needs_input_grad
    return (
        dq if need[0] else None,
        dk if need[1] else None,
        dv if need[2] else None,
        *(None,) * (_NUM_FEATURE_ARGS + _NUM_SCALARS + 1),
    )


attention_features_fwd.register_autograd(
    _attention_features_fwd_backward, setup_context=_setup_features_context
)


def traced_features(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: Features, causal: Any,
    scale: Any, layout: str, backend: str | None, config: str | None, allow_fp16_accum: Any,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A call with (checked) features while a compiler traces it: one
    ``attention_features_fwd`` (dropout is not traced: the caller runs it eagerly)."""
    need_lse = bool(return_lse) or (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    )
    out, lse = attention_features_fwd(
        q, k, v, features.alibi_slopes, list(features.window), float(features.softcap),
        bool(features.deterministic), bool(causal), scale, layout, backend, config,
        bool(allow_fp16_accum), need_lse,
    )  # fmt: skip
    return (out, lse) if return_lse else out
