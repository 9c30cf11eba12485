"""The public entry point, ``sparktune.attention()``.

Note: the package re-exports the function under the same name as this module, so
``sparktune.attention`` is the function; reach the module through
``sys.modules["sparktune.attention"]`` or ``importlib.import_module("sparktune.attention")``.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import warnings
from dataclasses import dataclass

import torch

from .backends.base import Backend
from .problem import DeviceInfo, Problem

__all__ = ["attention", "LAYOUTS", "SUPPORTED_DTYPES"]

log = logging.getLogger(__name__)

#: layout name -> what the four dimensions are
LAYOUTS = {
    "bhnd": "(batch, heads, seqlen, head_dim)",
    "bnhd": "(batch, seqlen, heads, head_dim)",
}
#: input dtypes and their names in the problem key
SUPPORTED_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: backends that mean "no fast kernel ran"
FALLBACK_BACKENDS = ("reference",)

#: keys of the one-time warnings already given in this process
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    log.info("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.cache
def _cuda_device_info(index: int) -> DeviceInfo:
    return DeviceInfo.from_torch(torch.device("cuda", index))


def _device_info(device: torch.device) -> DeviceInfo | None:
    """The fingerprint of a CUDA device (cached per index); None for any other device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_info(index)


def _bhnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, N, D) view of ``t`` given in ``layout`` (never a copy)."""
    return t if layout == "bhnd" else t.transpose(1, 2)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return value


def _check_inputs(
    q: object, k: object, v: object, layout: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the user's tensors; return their (B, H, N, D) views."""
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if layout not in LAYOUTS:
        supported = ", ".join(f"{n!r} {dims}" for n, dims in LAYOUTS.items())
        raise ValueError(f"unknown layout {layout!r}; supported layouts: {supported}")
    dims = LAYOUTS[layout]
    for name, t in tensors.items():
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-dimensional {dims} for layout {layout!r}, "
                f"got shape {tuple(t.shape)}"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
            f"v on {v.device}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must have the same dtype, got q {_dtype_name(q.dtype)}, "
            f"k {_dtype_name(k.dtype)}, v {_dtype_name(v.dtype)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"dtype {_dtype_name(q.dtype)} is not supported; sparktune.attention supports "
            + " and ".join(SUPPORTED_DTYPES.values())
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    qb, kb, vb = (_bhnd(t, layout) for t in (q, k, v))
    if qb.shape[0] != kb.shape[0]:
        raise ValueError(f"batch sizes differ: q has {qb.shape[0]}, k and v have {kb.shape[0]}")
    if qb.shape[3] != kb.shape[3]:
        raise ValueError(f"head_dim differs: q has {qb.shape[3]}, k and v have {kb.shape[3]}")
    for name, t in zip(tensors, (qb, kb, vb), strict=True):
        if t.numel() == 0:
            b, h, n, d = t.shape
            raise ValueError(
                f"{name} is empty (batch={b}, heads={h}, seqlen={n}, head_dim={d}); "
                "every dimension must be at least 1"
            )
    if qb.shape[1] % kb.shape[1]:
        raise ValueError(
            f"heads of q ({qb.shape[1]}) must be a multiple of heads of k and v ({kb.shape[1]})"
        )
    for name, t in tensors.items():
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise ValueError(
                f"the last dimension of {name} must be contiguous (stride 1), got strides "
                f"{tuple(t.stride())}; other strides may be anything"
            )
    return qb, kb, vb


@dataclass(frozen=True)
class _Plan:
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


def _forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the plan on user-layout tensors; returns (out in the user's layout, lse)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = plan.backend.forward(
        _bhnd(q, plan.layout),
        _bhnd(k, plan.layout),
        _bhnd(v, plan.layout),
        _bhnd(out, plan.layout),
        config=plan.config,
        causal=plan.causal,
        scale=plan.scale,
        need_lse=need_lse,
    )
    if need_lse and lse is None:
        raise RuntimeError(
            f"backend {plan.backend.name!r} config {plan.config!r} returned no log-sum-exp"
        )
    return out, lse


def _backward_choice(plan: _Plan) -> tuple[Backend, str] | None:
    """The backend and config for the backward: chosen by dispatch for the "bwd" problem
    (the user's forced backend, and its forward config where it offers it for "bwd", when
    one was forced); None when none can run it."""
    from . import dispatch, registry

    problem = plan.problem.replace(op="bwd")
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
        _warn_once(
            "backward-fallback",
            f"sparktune: the backward runs on the fallback {chosen.label} because no GPU "
            "backend can run it here (see `sparktune info`); expect it to be slow",
        )
    return registry.get_backend(chosen.backend), chosen.config


def _backward(
    plan: _Plan,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients in the user's layout, from a backend's backward or the reference math."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
    bhnd = [_bhnd(t, plan.layout) for t in (dout, q, k, v, out, *grads)]
    choice = _backward_choice(plan)
    if choice is not None:
        b, config = choice
        if type(b).backward is not Backend.backward:
            try:
                b.backward(
                    *bhnd[:5], lse, *bhnd[5:], config=config, causal=plan.causal, scale=plan.scale
                )
                return grads[0], grads[1], grads[2]
            except NotImplementedError:
                pass
        what = f"backend {b.name!r} config {config!r} has no backward"
    else:
        what = f"no backend can run the backward of {plan.problem.replace(op='bwd')}"
    from .backends.reference import reference_attention_backward

    _warn_once(
        f"backward:{what}",
        f"sparktune: {what}; gradients are recomputed by the float32 reference math "
        "(correct but slow)",
    )
    computed = reference_attention_backward(
        *bhnd[:4], causal=plan.causal, scale=plan.scale, compute_dtype=torch.float32
    )
    for dst, src in zip(bhnd[5:], computed, strict=True):
        dst.copy_(src)
    return grads[0], grads[1], grads[2]


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):  # type: ignore[override]
        out, lse = _forward(plan, q, k, v, need_lse=True)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.plan, dout, q, k, v, out, lse)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhnd",
    backend: str | None = None,
    config: str | None = None,
    allow_fp16_accum: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention ``softmax(q @ k^T * scale) @ v`` with the fastest kernel available.

    Args:
        q: queries, ``(B, Hq, Nq, D)`` for ``layout="bhnd"`` or ``(B, Nq, Hq, D)`` for
            ``"bnhd"``. Any strides with a contiguous last dimension (slices of a packed QKV
            tensor run as they are; nothing is copied).
        k, v: keys and values, ``(B, Hkv, Nk, D)`` in the same layout; ``Hq`` must be a
            multiple of ``Hkv`` (grouped-query attention: query head h reads kv head
            ``h // (Hq // Hkv)``).
        causal: mask aligned to the bottom-right corner: query i sees keys
            ``j <= i + Nk - Nq``. Rows that see no key give 0.
        scale: score scale, default ``1 / sqrt(D)``; a finite positive number.
        layout: ``"bhnd"`` or ``"bnhd"``.
        backend, config: force a backend (``"spark"``, ``"triton"``, ``"torch"``,
            ``"reference"`` or a plugin) and optionally one of its configs; by default
            :func:`sparktune.dispatch.select` chooses.
        allow_fp16_accum: let kernels accumulate in float16 where they offer it.
        return_lse: also return the row log-sum-exp of the scaled scores, float32
            ``(B, Hq, Nq)`` whatever the layout (not differentiable).

    Returns:
        ``out`` with q's layout, shape and dtype (a new contiguous tensor in that layout), or
        ``(out, lse)``.

    Inputs must be float16 or bfloat16 on every device: the problem key, the kernels and the
    tuning store know only these (float32 attention is available from
    :func:`sparktune.backends.reference.reference_attention`).

    Raises:
        TypeError: an input is not a tensor; dtypes differ or are not float16/bfloat16;
            scale is not a number.
        ValueError: unknown layout; not 4-d; devices differ; k and v shapes differ; batch or
            head_dim mismatch; Hq not a multiple of Hkv; an empty dimension; a last dimension
            that is not contiguous; scale not finite and positive; a backend/config that cannot
            run the problem (:class:`sparktune.dispatch.NoKernelError`, listing why).

    Gradients flow to inputs that require them. The backward kernel is chosen like the
    forward's, for the problem with ``op="bwd"`` (a forced backend stays forced, with its
    forward config where it offers it for the backward); where the chosen backend has no
    backward, or none can run it, the float32 reference math recomputes the gradients (a
    one-time warning says so).
    Running on a fallback (CPU tensors, or the reference backend) is announced once per process.
    """
    qb, kb, _ = _check_inputs(q, k, v, layout)
    scale = _check_scale(scale, qb.shape[3])
    problem = Problem(
        op="fwd",
        dtype=SUPPORTED_DTYPES[q.dtype],
        batch=qb.shape[0],
        heads_q=qb.shape[1],
        heads_kv=kb.shape[1],
        seqlen_q=qb.shape[2],
        seqlen_k=kb.shape[2],
        head_dim=qb.shape[3],
        causal=bool(causal),
        allow_fp16_accum=bool(allow_fp16_accum),
    )
    device = _device_info(q.device)

    from . import dispatch, registry

    selection = dispatch.select(problem, device, backend=backend, config=config)
    chosen = selection.candidate
    if selection.source != "forced" and (device is None or chosen.backend in FALLBACK_BACKENDS):
        why = (
            f"the tensors are on {q.device.type}, and sparktune's GPU kernels need CUDA tensors"
            if device is None
            else "no GPU backend can run this problem here (see `sparktune info`)"
        )
        _warn_once(
            "fallback",
            f"sparktune: attention runs on the fallback {chosen.label} because {why}; "
            "expect it to be slow",
        )
    plan = _Plan(
        backend=registry.get_backend(chosen.backend),
        config=chosen.config,
        causal=bool(causal),
        scale=scale,
        layout=layout,
        problem=problem,
        device=device,
        forced=backend is not None,
    )

    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, lse = _AttentionFunction.apply(q, k, v, plan)
    else:
        out, lse = _forward(plan, q, k, v, need_lse=return_lse)
    return (out, lse) if return_lse else out
