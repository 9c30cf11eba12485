"""The checks of ``sparktune.attention()``'s inputs, shared by the eager call, the custom ops
and :func:`sparktune.dispatch.explain`: what is wrong is raised with what is supported."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .dtypes import DTYPE_NAMES

__all__ = [
    "LAYOUTS",
    "SUPPORTED_DTYPES",
    "bhnd",
    "check_inputs",
    "check_scale",
    "checked_sizes",
    "dtype_name",
    "quick_sizes",
]


#: layout name -> what the four dimensions are
LAYOUTS = {
    "bhnd": "(batch, heads, seqlen, head_dim)",
    "bnhd": "(batch, seqlen, heads, head_dim)",
}


#: input dtypes and their names in the problem key
SUPPORTED_DTYPES = DTYPE_NAMES


def bhnd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, H, N, D) view of ``t`` given in ``layout`` (never a copy)."""
    return t if layout == "bhnd" else t.transpose(1, 2)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    value = float(scale)
    if not 0.0 < value < math.inf:  # also false for NaN; traceable by torch.compile
        raise ValueError(f"scale must be a finite positive number, got {scale!r}")
    return value


def check_inputs(
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
            f"q, k and v must have the same dtype, got q {dtype_name(q.dtype)}, "
            f"k {dtype_name(k.dtype)}, v {dtype_name(v.dtype)}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"dtype {dtype_name(q.dtype)} is not supported; sparktune.attention supports "
            + " and ".join(SUPPORTED_DTYPES.values())
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    qb, kb, vb = (bhnd(t, layout) for t in (q, k, v))
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


def checked_sizes(
    q: object, k: object, v: object, layout: object
) -> tuple[Any, Any, Any, Any, Any, Any, torch.dtype, torch.device]:
    """What :func:`quick_sizes` returns, from the full checks (which raise and say why)."""
    qb, kb, _ = check_inputs(q, k, v, layout)
    b, hq, nq, d = qb.shape
    return b, hq, kb.shape[1], nq, kb.shape[2], d, qb.dtype, qb.device


def quick_sizes(
    q: object, k: object, v: object, layout: object
) -> tuple[int, int, int, int, int, int, torch.dtype, torch.device] | None:
    """(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype, device) of inputs
    that pass every check of :func:`check_inputs`, read with as few tensor calls as
    possible; None when a check fails or is not decided here (a last dimension of size 1 with
    another stride): then :func:`check_inputs` decides, and says why."""
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
