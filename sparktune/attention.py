"""The public entry point, ``sparktune.attention()``.

Note: the package re-exports the function under the same name as this module, so
``sparktune.attention`` is the function; reach the module through
``sys.modules["sparktune.attention"]`` or ``importlib.import_module("sparktune.attention")``.

The call's parts live in their own modules: the input checks (:mod:`sparktune._checks`), the
plan and its caches (:mod:`sparktune._plan`), running it (:mod:`sparktune._execute`),
gradients (:mod:`sparktune._autograd`), repeated calls (:mod:`sparktune._hits`) and the custom
ops for ``torch.compile`` (:mod:`sparktune._ops`).
"""

from __future__ import annotations

import torch

from . import dispatch
from ._autograd import train
from ._checks import LAYOUTS, SUPPORTED_DTYPES, checked_sizes, quick_sizes
from ._execute import run_config
from ._hits import remember
from ._hits import table as _hits
from ._ops import traced_attention
from ._plan import plan_for

__all__ = ["attention", "LAYOUTS", "SUPPORTED_DTYPES"]

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
#: dispatch's counts of selections by source, which a hit counts too
counts = dispatch._counts


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
                counts[hit.source] += 1
                return train(hit.plan, q, k, v, return_lse)
            if hit.run is not None:  # else only a training call made it: the full path below
                counts[hit.source] += 1
                out, lse = hit.run(q, k, v)
                return (out, lse) if return_lse else out
    sizes = quick_sizes(q, k, v, layout)
    if sizes is None:  # something is wrong (this raises and says what) or unusual
        sizes = checked_sizes(q, k, v, layout)
    if compiling:  # traced: one custom op, dispatched when it runs
        return traced_attention(
            q, k, v, sizes[5], causal, scale, layout, backend, config, allow_fp16_accum, return_lse
        )
    generation = dispatch.generation
    plan, source = plan_for(sizes, causal, scale, layout, backend, config, allow_fp16_accum)
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        result = train(plan, q, k, v, return_lse)
        if key is not None:
            remember(key, generation, source, plan, return_lse, None)
        return result
    out, lse = run_config(
        plan.backend, plan.config, q, k, v, layout, plan.causal, plan.scale, return_lse
    )
    if key is not None:
        remember(key, generation, source, plan, return_lse, (q, k, v, out, lse))
    return (out, lse) if return_lse else out
