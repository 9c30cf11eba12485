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

import dataclasses
import math
from typing import Any

import torch

from . import dispatch, registry
from ._autograd import FeatureAttention, train
from ._checks import (
    LAYOUTS,
    NO_WINDOW,
    OFF,
    SUPPORTED_DTYPES,
    Features,
    check_cu_seqlens,
    check_features,
    check_scale,
    check_varlen_inputs,
    checked_sizes,
    draw_seed_offset,
    quick_sizes,
    trim_window,
)
from ._execute import run_config, run_features
from ._hits import remember
from ._hits import table as _hits
from ._ops import traced_attention, traced_features
from ._plan import FALLBACK_BACKENDS, plan_for

__all__ = ["attention", "varlen_attention", "LAYOUTS", "SUPPORTED_DTYPES"]

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
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = OFF,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = OFF,
    generator: torch.Generator | None = None,
    deterministic: bool = False,
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
        window: ``(left, right)``: query i sees key j iff ``d(i) - left <= j <= d(i) + right``
            with ``d(i) = i + Nk - Nq`` (bottom-right, like ``causal``); -1 is unlimited on
            that side, and ``causal=True`` is ``right = 0``.
        softcap: > 0 replaces each scaled score s by ``softcap * tanh(s / softcap)``.
        alibi_slopes: float32 ``(Hq,)`` or ``(B, Hq)`` on q's device: adds
            ``-slope * |d(i) - j|`` to the (soft-capped) scores.
        dropout_p: drops attention probabilities with this probability (scaling the kept ones
            by ``1 / (1 - dropout_p)``), whenever it is > 0: pass 0 in evaluation. The mask
            comes from ``generator`` (default: the device's default generator), advanced once
            per call, and the backward regenerates it.
        deterministic: the backward runs only on kernels whose gradients are bitwise
            reproducible.
        See docs/FEATURES.md for the exact definitions. A backend that lacks a feature is
        never chosen for a call that uses it (a forced one raises and says why).

    Returns:
        ``out`` with q's layout, shape and dtype, a new tensor with q's strides where q is
        non-overlapping and dense (a permuted view gets an output of the same permutation, as
        cuDNN's SDPA gives it) and contiguous in that layout otherwise (except that with
        ``"bhnd"``, PyTorch's SDPA backends return SDPA's own output, as
        F.scaled_dot_product_attention does: dense, (B, N, H, D) in memory for flash), or
        ``(out, lse)``. Under ``torch.compile`` the output is contiguous in the layout.

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
    nothing is computed twice. Where that backward takes another backend's output and
    log-sum-exp (``backward_runner``: cuDNN's and flash's backward ops) and dispatch gives the
    forward to another backend whose record takes at least 0.5 ms
    (``sparktune._autograd.PAIR_MIN_FORWARD_MS``: shorter ones do not win back the paired
    call's host time), that forward runs, and the backward reads what it saved: a training
    call pairs the fastest forward with the fastest backward.

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
    if (
        window is not NO_WINDOW
        or softcap is not OFF
        or alibi_slopes is not None
        or dropout_p is not OFF
        or deterministic is not False
    ) and not _all_off(window, softcap, alibi_slopes, dropout_p, deterministic):
        # a feature is on: its own path (a plain call pays the identity checks alone)
        return _with_features(
            q, k, v, causal, scale, layout, backend, config, allow_fp16_accum, return_lse,
            window, softcap, alibi_slopes, dropout_p, generator, deterministic,
        )  # fmt: skip
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


def _all_off(window: Any, softcap: Any, alibi_slopes: Any, dropout_p: Any, deterministic: Any) -> bool:
    """The feature arguments given explicitly with their "off" values (anything unusual is
    left to the checks of the feature path)."""
    return (
        alibi_slopes is None
        and deterministic is False
        and type(window) is tuple
        and window == NO_WINDOW
        and type(softcap) in (int, float)
        and softcap == 0
        and type(dropout_p) in (int, float)
        and dropout_p == 0
    )


def _needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


#: the calls with features seen: key (the call's shapes, strides, dtypes, devices and
#: arguments; ALiBi's shape, strides, dtype and device, not its values) -> (dispatch
#: generation, plan, source, window, softcap, dropout_p), so that a repeated call skips the
#: checks and dispatch (the slopes and generator are the call's own)
_feature_hits: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_FEATURE_HITS_MAX = 1024


def _with_features(
    q: Any, k: Any, v: Any, causal: Any, scale: Any, layout: Any, backend: Any, config: Any,
    allow_fp16_accum: Any, return_lse: Any, window: Any, softcap: Any, alibi_slopes: Any,
    dropout_p: Any, generator: Any, deterministic: Any,
) -> Any:  # fmt: skip
    """:func:`attention` with features: checked, planned for the problem with them, and run
    through sparktune's autograd function when gradients are needed. Under torch.compile the
    checks run while tracing and the call becomes the custom op
    ``sparktune::attention_features_fwd``; with dropout it runs eagerly (a graph break: the
    mask's seed and offset are drawn from the generator per call, which a graph cannot hold).
    """
    compiling = _is_compiling()
    key = hit = None
    if not compiling:
        try:  # what the checks and dispatch read (ALiBi's layout, not its values)
            key = (
                q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
                v.dtype, q.device, k.device, v.device, causal, type(scale), scale, layout,
                backend, config, allow_fp16_accum, return_lse, type(window), window,
                type(softcap), softcap, type(dropout_p), dropout_p, generator is None,
                deterministic,
                None if alibi_slopes is None else (
                    alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                    alibi_slopes.device,
                ),
            )  # fmt: skip
            hit = _feature_hits.get(key)
        except Exception:  # noqa: BLE001 - not tensors, or unhashable arguments: checked below
            key = None
        if hit is not None and hit[0] == dispatch.generation:
            _, plan, source, w, cap, p = hit
            pb = plan.problem
            slopes = alibi_slopes
            if slopes is not None and slopes.dim() == 1:
                slopes = slopes.expand(pb.batch, pb.heads_q)
            features = Features(w, cap, slopes, p, generator if p else None, deterministic)
            return _run_plan(q, k, v, plan, source, features, return_lse)
    sizes = quick_sizes(q, k, v, layout)
    if sizes is None:
        sizes = checked_sizes(q, k, v, layout)
    b, hq, _, nq, nk, _, _, dev = sizes
    features = check_features(
        window, softcap, alibi_slopes, dropout_p, generator, deterministic,
        causal=bool(causal), batch=b, heads_q=hq, device=dev,
    )  # fmt: skip
    features.window = trim_window(features.window, nq, nk)
    if features.off:  # every feature off after all: the plain call
        return attention(
            q, k, v, causal=causal, scale=scale, layout=layout, backend=backend, config=config,
            allow_fp16_accum=allow_fp16_accum, return_lse=return_lse,
        )  # fmt: skip
    if compiling:
        if features.dropout_p:
            return _eager_features(
                q, k, v, sizes, features, causal, scale, layout, backend, config,
                allow_fp16_accum, return_lse,
            )  # fmt: skip
        if scale is not None:
            scale = check_scale(scale, sizes[5])
        return traced_features(
            q, k, v, features, causal, scale, layout, backend, config, allow_fp16_accum,
            return_lse,
        )  # fmt: skip
    generation = dispatch.generation
    plan, source = plan_for(
        sizes, causal, scale, layout, backend, config, allow_fp16_accum, features
    )
    if key is not None and generation == dispatch.generation:
        # the plan keeps the features without the call's tensors (its backward reads only
        # whether the call asked for deterministic gradients)
        static = Features(
            features.window, features.softcap, None, features.dropout_p, None,
            features.deterministic,
        )  # fmt: skip
        plan = dataclasses.replace(plan, features=static)
        if len(_feature_hits) >= _FEATURE_HITS_MAX:
            _feature_hits.clear()
        _feature_hits[key] = (
            generation, plan, source, features.window, features.softcap, features.dropout_p,
        )  # fmt: skip
    return _run_plan(q, k, v, plan, source, features, return_lse)


def _run_plan(
    q: Any, k: Any, v: Any, plan: Any, source: str, features: Any, return_lse: Any
) -> Any:
    """Run a call with features on its plan (dropout's seed and offset drawn here)."""
    counts[source] += 1
    p = plan.problem
    kwargs = features.kwargs(
        *_seed_offset(features, q.device, p.batch * p.heads_q * p.seqlen_q * p.seqlen_k)
    )
    if _needs_grad(q, k, v):
        out, lse = FeatureAttention.apply(q, k, v, plan, kwargs)
    else:
        out, lse = run_features(plan, q, k, v, bool(return_lse), kwargs)
    return (out, lse) if return_lse else out


def _run_with_features(
    q: Any, k: Any, v: Any, sizes: Any, features: Any, causal: Any, scale: Any, layout: Any,
    backend: Any, config: Any, allow_fp16_accum: Any, return_lse: Any,
) -> Any:  # fmt: skip
    plan, source = plan_for(
        sizes, causal, scale, layout, backend, config, allow_fp16_accum, features
    )
    return _run_plan(q, k, v, plan, source, features, return_lse)


#: :func:`_run_with_features` outside a compiler's graph (dropout under torch.compile)
_eager_features = torch._disable_dynamo(_run_with_features)


def _seed_offset(features: Any, device: torch.device, count: int) -> tuple[int, int]:
    if not features.dropout_p:
        return 0, 0
    return draw_seed_offset(features.generator, device, count)


# torch._disable_dynamo: torch.compiler.disable that imports Dynamo (and Triton) only when
# called, so that importing sparktune stays light
@torch._disable_dynamo
def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = NO_WINDOW,
    softcap: float = OFF,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = OFF,
    generator: torch.Generator | None = None,
    deterministic: bool = False,
    backend: str | None = None,
    config: str | None = None,
    allow_fp16_accum: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a batch of packed sequences of different lengths, no padding.

    Args:
        q: ``(total_q, Hq, D)``, the queries of every sequence one after the other.
        k, v: ``(total_k, Hkv, D)``; ``Hq`` a multiple of ``Hkv`` (GQA).
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` prefix sums on the inputs' device:
            sequence b is rows ``cu[b]:cu[b+1]``; non-decreasing (empty sequences are
            allowed), from 0 to the totals.
        max_seqlen_q, max_seqlen_k: at least the longest sequence.
        causal, scale, window, softcap, alibi_slopes (``(Hq,)`` or ``(B, Hq)``), dropout_p,
        generator, deterministic, backend, config, allow_fp16_accum: as
        :func:`attention`, with lengths, rows and diagonals per sequence.
        return_lse: also return the float32 log-sum-exp, ``(Hq, total_q)``.

    Returns:
        ``out`` ``(total_q, Hq, D)`` (rows of a sequence with no key are 0), or
        ``(out, lse)``. Differentiable in q, k and v.

    Dispatch chooses among the backends that declare "varlen" for the packed problem (key:
    batch = B, seqlen = the longest sequences, plus the totals), for the forward and, with
    gradients, for the backward (the "bwd" problem, with ``deterministic``): with no record
    and no other feature, on sm_90 the Hopper kernels first (``fwd_sm90_*`` and
    ``bwd_sm90_*``, the backward from the forward's output and log-sum-exp), otherwise (other
    features, other GPUs) the Triton family first (docs/FEATURES.md). Where only the reference
    math can run it (and no backend was forced), each sequence runs as its own
    :func:`attention` call instead, on the fastest kernel for it: exact, a launch per
    sequence (with dropout, each sequence then draws its own mask).
    """
    tq, tk, hq, hk, d, dtype, dev = check_varlen_inputs(q, k, v)
    cq, ck, mq, mk = check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tq, tk, dev
    )
    nb = len(cq) - 1
    features = check_features(
        window, softcap, alibi_slopes, dropout_p, generator, deterministic,
        causal=bool(causal), batch=nb, heads_q=hq, device=dev,
    )  # fmt: skip
    longest_q = max(cq[i + 1] - cq[i] for i in range(nb))
    longest_k = max(ck[i + 1] - ck[i] for i in range(nb))
    if longest_q == 0 or longest_k == 0:  # no query, or no key anywhere: zeros
        # no kernel is planned: what planning checks is checked here, so that a bad argument
        # raises whatever the lengths
        if scale is not None:
            check_scale(scale, d)
        dispatch.check_config_has_backend(backend, config)
        if backend is not None:
            registry.get_backend(backend)  # raises for an unknown name, listing the known ones
        out = q * 0 if _needs_grad(q, k, v) else torch.zeros_like(q)
        lse = torch.full((hq, tq), -math.inf, dtype=torch.float32, device=dev)
        return (out, lse) if return_lse else out
    sizes = (nb, hq, hk, longest_q, longest_k, d, dtype, dev)
    plan, source = plan_for(
        sizes, causal, scale, "thd", backend, config, allow_fp16_accum, features, (tq, tk),
        warn=False,
    )  # fmt: skip
    if backend is None and plan.backend.name in FALLBACK_BACKENDS:
        return _per_sequence(
            q, k, v, cq, ck, causal, scale, features, allow_fp16_accum, return_lse
        )
    counts[source] += 1
    kwargs = features.kwargs(*_seed_offset(features, dev, hq * sum(
        (cq[i + 1] - cq[i]) * (ck[i + 1] - ck[i]) for i in range(nb)
    )))  # fmt: skip
    kwargs.update(
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=mq,
        max_seqlen_k=mk,
    )
    if _needs_grad(q, k, v):
        out, lse = FeatureAttention.apply(q, k, v, plan, kwargs)
    else:
        out, lse = run_features(plan, q, k, v, bool(return_lse), kwargs)
    return (out, lse) if return_lse else out


def _per_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cq: list[int], ck: list[int],
    causal: Any, scale: Any, features: Any, allow_fp16_accum: Any, return_lse: Any,
) -> Any:  # fmt: skip
    """:func:`varlen_attention` as one :func:`attention` call per sequence (``(1, n, H, D)``
    views, nothing copied in), concatenated; differentiable through autograd."""
    outs, lses = [], []
    hq = q.shape[1]
    slopes = features.alibi_slopes
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(q[q0:q1] * 0)
            lses.append(q.new_full((hq, q1 - q0), -math.inf, dtype=torch.float32))
            continue
        res = attention(
            q[q0:q1].unsqueeze(0), k[k0:k1].unsqueeze(0), v[k0:k1].unsqueeze(0),
            causal=causal, scale=scale, layout="bnhd", allow_fp16_accum=allow_fp16_accum,
            return_lse=return_lse, window=features.window, softcap=features.softcap,
            alibi_slopes=None if slopes is None else slopes[b],
            dropout_p=features.dropout_p, generator=features.generator,
            deterministic=features.deterministic,
        )  # fmt: skip
        if return_lse:
            outs.append(res[0][0])
            lses.append(res[1][0])
        else:
            outs.append(res[0])
    out = torch.cat(outs) if outs else q * 0
    if return_lse:
        return out, torch.cat(lses, dim=1)
    return out
