"""The public entry point, ``sparktune.attention()``.

Note: the package re-exports the function under the same name as this module, so
``sparktune.attention`` is the function; reach the module through
``sys.modules["sparktune.attention"]`` or ``importlib.import_module("sparktune.attention")``.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from . import dispatch, registry
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


def _warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    if key in _warned:
        return
    _warned.add(key)
    log.info("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


#: CUDA device index -> its fingerprint (a device does not change during a process)
_cuda_infos: dict[int, DeviceInfo] = {}


def _cuda_device_info(index: int) -> DeviceInfo:
    info = _cuda_infos.get(index)
    if info is None:
        info = _cuda_infos[index] = DeviceInfo.from_torch(torch.device("cuda", index))
    return info


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
    if not 0.0 < value < math.inf:  # also false for NaN; traceable by torch.compile
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


def _checked_sizes(
    q: object, k: object, v: object, layout: object
) -> tuple[Any, Any, Any, Any, Any, Any, torch.dtype, torch.device]:
    """What :func:`_sizes` returns, from the full checks (which raise and say why)."""
    qb, kb, _ = _check_inputs(q, k, v, layout)
    b, hq, nq, d = qb.shape
    return b, hq, kb.shape[1], nq, kb.shape[2], d, qb.dtype, qb.device


def _sizes(
    q: object, k: object, v: object, layout: object
) -> tuple[int, int, int, int, int, int, torch.dtype, torch.device] | None:
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device) of inputs
    that pass every check of :func:`_check_inputs`, read with as few tensor calls as
    possible; None when a check fails or is not decided here (a last dimension of size 1 with
    another stride): then :func:`_check_inputs` decides, and says why."""
    if not (
        isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    ):
        return None
    qs, ks = q.shape, k.shape
    if len(qs) != 4 or len(ks) != 4 or v.shape != ks:
        return None
    if layout == "bhnd":
        b, hq, nq, d = qs
        _, hk, nk, dk = ks
    elif layout == "bnhd":
        b, nq, hq, d = qs
        _, nk, hk, dk = ks
    else:
        return None
    if not (b and hq and nq and d and hk and nk) or ks[0] != b or dk != d or hq % hk:
        return None
    dtype = q.dtype
    if k.dtype is not dtype or v.dtype is not dtype or dtype not in SUPPORTED_DTYPES:
        return None
    if q.stride()[3] != 1 or k.stride()[3] != 1 or v.stride()[3] != 1:
        return None
    device = q.device
    if k.device != device or v.device != device:
        return None
    return b, hq, hk, nq, nk, d, dtype, device


#: the forward problems seen, by (dtype, sizes, causal, allow_fp16_accum): a repeated shape
#: reuses its Problem (validated once, when it was made), and dispatch's memo finds it by
#: identity
_problems: dict[tuple[Any, ...], Problem] = {}
#: more distinct shapes than this (e.g. a growing decode length) start the table afresh
_PROBLEMS_MAX = 4096


def _forward_problem(key: tuple[Any, ...]) -> Problem:
    """The forward Problem of ``(dtype, batch, heads_q, heads_kv, seqlen_q, seqlen_k,
    head_dim, causal, allow_fp16_accum)``."""
    problem = _problems.get(key)
    if problem is None:
        dtype, b, hq, hk, nq, nk, d, causal, fp16 = key
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
        )
        if len(_problems) >= _PROBLEMS_MAX:
            _problems.clear()
        _problems[key] = problem
    return problem


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


#: (backend class, hook name) -> that optional hook (see backends.base.OPTIONAL_HOOKS) or None
_hooks: dict[tuple[type, str], Any] = {}


def _hook(backend: Backend, name: str) -> Any:
    """The backend's optional hook ``name``, looked up on its class, or None."""
    key = (type(backend), name)
    try:
        return _hooks[key]
    except KeyError:
        fn = _hooks[key] = getattr(key[0], name, None)
        return fn


def _forward_alloc(backend: Backend) -> Any:
    """The backend's ``forward_alloc(q, k, v, *, config, causal, scale, need_lse) -> (out,
    lse)``: its forward writing to an output it allocates itself ((B, H, N, D), any dense
    strides), for kernels that make their own output anyway (PyTorch's SDPA), so that no
    copy into a caller's buffer is needed. None when the backend has only ``forward``."""
    return _hook(backend, "forward_alloc")


def _forward_autograd(backend: Backend) -> Any:
    """The backend's ``forward_autograd(q, k, v, *, config, causal, scale) -> out``: a
    forward recorded by PyTorch's autograd with its own backward ((B, H, N, D) views in, out of
    q's shape, any strides). Used when the backward would run on the same backend, so that
    its backward reuses what its forward saved instead of running the forward again."""
    return _hook(backend, "forward_autograd")


def _forward_runner(backend: Backend) -> Any:
    """The backend's ``forward_runner(q, k, v, out, *, config, causal, scale, need_lse)``:
    a forward specialised to inputs like these, for calls repeated with an equal key."""
    return _hook(backend, "forward_runner")


#: id of a forward Problem -> (that Problem, its backward Problem)
_bwd_problems: dict[int, tuple[Problem, Problem]] = {}


def _backward_problem(problem: Problem) -> Problem:
    pair = _bwd_problems.get(id(problem))
    if pair is None or pair[0] is not problem:
        if len(_bwd_problems) >= _PROBLEMS_MAX:
            _bwd_problems.clear()
        pair = _bwd_problems[id(problem)] = (problem, problem.replace(op="bwd"))
    return pair[1]


def _native_choice(
    backend: Backend, config: str, problem: Problem, device: DeviceInfo | None, forced: bool
) -> tuple[Backend, Any, str] | None:
    """(backend, its forward_autograd, config) for a call that needs gradients, where the
    backward would run on a backend that records its forward with PyTorch's autograd: the
    forced backend when it has the hook; else the backend dispatch chooses for the backward
    problem, when it has the hook (its forward then runs with the backward's config, so that
    the backward reuses what that forward saved). None: sparktune's autograd function."""
    if forced:
        native = _forward_autograd(backend)
        return (backend, native, config) if native is not None else None
    try:
        selection = dispatch.select(_backward_problem(problem), device)
    except dispatch.NoKernelError:
        return None
    chosen = selection.candidate
    b = backend if chosen.backend == backend.name else registry.get_backend(chosen.backend)
    native = _forward_autograd(b)
    return (b, native, chosen.config) if native is not None else None


def _in_layout(out: torch.Tensor, layout: str) -> torch.Tensor:
    """A backend's own (B, H, N, D) output in the user's layout: as it is for "bhnd" (its own
    dense strides, as F.scaled_dot_product_attention returns them), contiguous otherwise."""
    if layout == "bhnd":
        return out
    out = out.transpose(1, 2)
    return out if out.is_contiguous() else out.contiguous()


def _new_output(q: torch.Tensor) -> torch.Tensor:
    """An uninitialised contiguous tensor of q's shape, dtype and device."""
    if type(q) is torch.Tensor:  # the same tensor as below, with less argument parsing
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _run(
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
    alloc = _forward_alloc(backend)
    if layout == "bhnd":
        if alloc is None:
            out = _new_output(q)
            lse = backend.forward(
                q, k, v, out, config=config, causal=causal, scale=scale, need_lse=need_lse
            )
        else:
            out, lse = alloc(
                backend, q, k, v, config=config, causal=causal, scale=scale, need_lse=need_lse
            )
    elif alloc is None:
        out = _new_output(q)
        lse = backend.forward(
            _bhnd(q, layout),
            _bhnd(k, layout),
            _bhnd(v, layout),
            _bhnd(out, layout),
            config=config,
            causal=causal,
            scale=scale,
            need_lse=need_lse,
        )
    else:
        out_bhnd, lse = alloc(
            backend,
            _bhnd(q, layout),
            _bhnd(k, layout),
            _bhnd(v, layout),
            config=config,
            causal=causal,
            scale=scale,
            need_lse=need_lse,
        )
        out = _in_layout(out_bhnd, layout)
    if need_lse and lse is None:
        raise RuntimeError(f"backend {backend.name!r} config {config!r} returned no log-sum-exp")
    return out, lse


def _forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the plan on user-layout tensors; returns (out in the user's layout, lse)."""
    return _run(plan.backend, plan.config, q, k, v, plan.layout, plan.causal, plan.scale, need_lse)


def _backward_choice(plan: _Plan) -> tuple[Backend, str] | None:
    """The backend and config for the backward: chosen by dispatch for the "bwd" problem
    (the user's forced backend, and its forward config where it offers it for "bwd", when
    one was forced); None when none can run it."""
    problem = _backward_problem(plan.problem)
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


def _grad_buffer(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient for input ``t``: ``t``'s dtype, device, shape and strides
    where ``t`` is non-overlapping and dense (a permuted layout stays permuted), contiguous
    otherwise (e.g. a slice of a packed QKV tensor)."""
    g = torch.empty_like(t)  # keeps t's strides exactly when t is non-overlapping and dense
    if g.stride() == t.stride() or g.is_contiguous():
        return g
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


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
    grads = [_grad_buffer(t) for t in (q, k, v)]
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


def _warn_fallback(
    chosen: Any, device: DeviceInfo | None, dev: torch.device, stacklevel: int = 4
) -> None:
    """The one-time warning that the forward runs on a fallback (``chosen``, a Candidate)."""
    why = (
        f"the tensors are on {dev.type}, and sparktune's GPU kernels need CUDA tensors"
        if device is None
        else "no GPU backend can run this problem here (see `sparktune info`)"
    )
    _warn_once(
        "fallback",
        f"sparktune: attention runs on the fallback {chosen.label} because {why}; "
        "expect it to be slow",
        stacklevel=stacklevel,
    )


def _op_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    layout: str,
    backend: str | None,
    config: str | None,
    allow_fp16_accum: bool,
) -> _Plan:
    """The plan of a call of the custom ops (:mod:`sparktune._ops`) on real tensors: the
    checks, Problem, dispatch and fallback warning of :func:`attention`'s eager path."""
    sizes = _sizes(q, k, v, layout)
    if sizes is None:
        sizes = _checked_sizes(q, k, v, layout)
    return _plan_for(sizes, causal, scale, layout, backend, config, allow_fp16_accum)[0]


def _plan_for(
    sizes: tuple[Any, ...],
    causal: Any,
    scale: Any,
    layout: str,
    backend: str | None,
    config: str | None,
    allow_fp16_accum: Any,
) -> tuple[_Plan, str]:
    """(the plan, the source of dispatch's selection) for checked sizes: the scale checked,
    the forward Problem, the device's fingerprint, dispatch's choice and the fallback
    warning (which points at the caller of the caller's caller: attention()'s caller)."""
    b, hq, hk, nq, nk, d, dtype, dev = sizes
    scale = 1.0 / math.sqrt(d) if scale is None else _check_scale(scale, d)
    causal = bool(causal)
    problem = _forward_problem((dtype, b, hq, hk, nq, nk, d, causal, bool(allow_fp16_accum)))
    device = _device_info(dev)
    selection = _select(problem, device, dev, backend, config)
    plan = _Plan(
        backend=registry.get_backend(selection.candidate.backend),
        config=selection.candidate.config,
        causal=causal,
        scale=scale,
        layout=layout,
        problem=problem,
        device=device,
        forced=backend is not None,
    )
    return plan, selection.source


def _gradients(ctx: Any, dout: torch.Tensor, others: int) -> tuple[torch.Tensor | None, ...]:
    """The backward of sparktune's autograd functions (q, k, v, out and lse saved, the plan in
    ``ctx.plan``): dq, dk and dv where asked for, then None for the ``others`` inputs."""
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward(ctx.plan, dout, q, k, v, out, lse)
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
        out, lse = _forward(plan, q, k, v, need_lse=True)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        return _gradients(ctx, dout, 1)  # the plan


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
    problem = _forward_problem((q.dtype, b, hq, hk, nq, nk, d, bool(causal), bool(allow_fp16_accum)))
    plan = _Plan(
        backend=backend,
        config=config,
        causal=bool(causal),
        scale=float(scale),
        layout="bhnd",
        problem=problem,
        device=_device_info(q.device),
        forced=True,
    )
    chosen = _backward_choice(plan)
    if chosen is None or chosen[0] is not backend or chosen[1] != config:
        raise dispatch.NoKernelError(f"{backend.name}:{config} cannot run the backward of {problem}")
    return _RecordedAttention.apply(q, k, v, out, lse, plan)


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
        ``out`` with q's layout, shape and dtype, a new tensor contiguous in that layout
        (except that with ``"bhnd"``, PyTorch's SDPA backends return SDPA's own output, as
        F.scaled_dot_product_attention does: dense, (B, N, H, D) in memory for flash), or
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

    When gradients are needed and the backward runs on a backend that records its forward
    with PyTorch's own autograd (``forward_autograd``: the ``torch`` backend), because it was
    forced or because dispatch chooses it for the backward problem, the forward runs there too
    (with the backward's config) and the backward is PyTorch's, from what that forward saved:
    nothing is computed twice.

    Under ``torch.compile`` (and ``torch.export``) the inputs are checked while tracing, and the
    call becomes the custom op ``sparktune::attention_fwd`` (:mod:`sparktune._ops`), whose
    backward is ``sparktune::attention_bwd``: no graph break. The kernel is chosen when the op
    runs, as above; a forced backend that cannot run the problem raises then.
    Gradients from sparktune's backward (and from the op under a compiler) keep their input's
    strides where the input is non-overlapping and dense, and are contiguous otherwise (e.g.
    for slices of a packed QKV tensor); on the native path above they are PyTorch's own, as
    with F.scaled_dot_product_attention (a leaf's ``.grad`` follows the leaf's strides either
    way, by PyTorch's rule).

    A call repeated with inputs of the same shapes, strides, dtypes and devices and the same
    arguments reuses what the first one worked out (checks, dispatch, the backend's
    ``forward_runner``): a hit costs a dictionary lookup and the launch. Forgotten when
    dispatch forgets its selections (:func:`sparktune.dispatch.reload`, a backend registered).
    """
    compiling = _is_compiling()
    if not compiling:
        try:  # every property of the call that the checks and dispatch read
            key = (
                q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
                q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                causal, type(scale), scale, layout, backend, config, allow_fp16_accum, return_lse,
            )  # fmt: skip
            hit = _hits.get(key)
        except Exception:  # noqa: BLE001 - not tensors, or unhashable arguments: checked below
            key = hit = None
        if hit is not None and hit.generation == dispatch.generation:
            if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                _counts[hit.source] += 1
                return _train(hit.plan, q, k, v, return_lse)
            if hit.run is not None:  # else only a training call made it: the full path below
                _counts[hit.source] += 1
                out, lse = hit.run(q, k, v)
                return (out, lse) if return_lse else out
    sizes = _sizes(q, k, v, layout)
    if sizes is None:  # something is wrong (this raises and says what) or unusual
        sizes = _checked_sizes(q, k, v, layout)
    if compiling:  # traced: one custom op, dispatched when it runs
        from ._ops import traced_attention

        return traced_attention(
            q, k, v, sizes[5], causal, scale, layout, backend, config, allow_fp16_accum, return_lse
        )
    generation = dispatch.generation
    plan, source = _plan_for(sizes, causal, scale, layout, backend, config, allow_fp16_accum)
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        result = _train(plan, q, k, v, return_lse)
        if key is not None:
            _remember(key, generation, source, plan, return_lse, None)
        return result
    out, lse = _run(plan.backend, plan.config, q, k, v, layout, plan.causal, plan.scale, return_lse)
    if key is not None:
        _remember(key, generation, source, plan, return_lse, (q, k, v, out, lse))
    return (out, lse) if return_lse else out


def _train(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A call that needs gradients: the backward backend's own recorded forward when it has
    one (see :func:`_native_choice`), else sparktune's autograd function."""
    native = (
        None
        if return_lse
        else _native_choice(plan.backend, plan.config, plan.problem, plan.device, plan.forced)
    )
    if native is not None:
        native_backend, forward_autograd, native_config = native
        out = forward_autograd(
            native_backend,
            _bhnd(q, plan.layout),
            _bhnd(k, plan.layout),
            _bhnd(v, plan.layout),
            config=native_config,
            causal=plan.causal,
            scale=plan.scale,
        )
        return _in_layout(out, plan.layout)
    out, lse = _AttentionFunction.apply(q, k, v, plan)
    return (out, lse) if return_lse else out


class _Hit:
    """What a call runs again when a later call has an equal key (see :func:`attention`):
    the key holds every property of the inputs and arguments that the checks and dispatch
    read, so an equal key passes the same checks and gets the same kernel. Valid while
    dispatch's generation is the one it was made in."""

    __slots__ = ("generation", "source", "plan", "run")

    def __init__(self, generation: int, source: str, plan: _Plan, run: Any) -> None:
        self.generation = generation
        self.source = source
        self.plan = plan
        #: (q, k, v) in the user's layout -> (out, lse) without autograd; None until a
        #: call without autograd made it
        self.run = run


#: call key -> its _Hit
_hits: dict[tuple[Any, ...], _Hit] = {}
#: more distinct keys than this start the table afresh
_HITS_MAX = 4096
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_counts = dispatch._counts


def _select(
    problem: Problem,
    device: DeviceInfo | None,
    dev: torch.device,
    backend: str | None,
    config: str | None,
) -> Any:
    """The forward's Selection from dispatch, with the one-time fallback warning (pointing at
    the caller of :func:`attention`, through :func:`_plan_for`)."""
    selection = dispatch.select(problem, device, backend=backend, config=config)
    chosen = selection.candidate
    if (
        selection.source != "forced"
        and (device is None or chosen.backend in FALLBACK_BACKENDS)
        and "fallback" not in _warned
    ):
        _warn_fallback(chosen, device, dev, stacklevel=6)
    return selection


def _generic_run(plan: _Plan, need_lse: bool) -> Any:
    backend, config, layout, causal, scale = (
        plan.backend, plan.config, plan.layout, plan.causal, plan.scale,
    )  # fmt: skip

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return _run(backend, config, q, k, v, layout, causal, scale, need_lse)

    return run


def _runner(plan: _Plan, need_lse: bool, made: tuple[torch.Tensor, ...]) -> Any:
    """The no-autograd forward of a hit: the backend's ``forward_runner`` for these inputs
    when it offers one and it reproduces, bit for bit, the output ``made`` by the general
    path on the same tensors; else the general path itself."""
    generic = _generic_run(plan, need_lse)
    hook = _forward_runner(plan.backend)
    if hook is None:
        return generic
    q, k, v, out, lse = made
    layout = plan.layout
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return generic  # the comparison below would synchronise a capturing stream
    try:
        fast = hook(
            plan.backend,
            _bhnd(q, layout),
            _bhnd(k, layout),
            _bhnd(v, layout),
            _bhnd(out, layout),
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
                return _in_layout(o, "bnhd"), lse

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


def _remember(
    key: tuple[Any, ...],
    generation: int,
    source: str,
    plan: _Plan,
    need_lse: Any,
    made: tuple[torch.Tensor, ...] | None,
) -> None:
    """Keep what this call ran for later calls with an equal key (not when dispatch's state
    changed meanwhile: a selection made before a reload must not outlive it). ``made``: the
    call's (q, k, v, out, lse) without autograd; None for a training call."""
    if generation != dispatch.generation:
        return
    old = _hits.get(key)
    if old is not None and old.generation == generation and made is None:
        return  # a training call: what a call without autograd made before stays
    if len(_hits) >= _HITS_MAX:
        _hits.clear()
    run = None if made is None else _runner(plan, bool(need_lse), made)
    _hits[key] = _Hit(generation, source, plan, run)
