"""Exact attention math in float32 or float64, on any device: the fallback and the test oracle.

Scores are materialised, so the work is split into tiles over (batch, kv head, query rows) whose
score block stays under :data:`MAX_SCORE_ELEMENTS`; memory is bounded whatever the problem size.
Semantics are the ones every backend follows: GQA (query head h reads kv head
``h // (heads_q // heads_kv)``), causal masks aligned bottom-right (query i sees key j iff
``j <= i + seqlen_k - seqlen_q``), rows with no visible key give output 0 and log-sum-exp -inf.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .base import Backend

if TYPE_CHECKING:
    from ..problem import DeviceInfo, Problem

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "ReferenceBackend",
    "causal_visible",
    "reference_attention",
    "reference_attention_backward",
    "reference_lse",
]

#: largest score block one tile materialises (elements; 128 MiB in float64)
MAX_SCORE_ELEMENTS = 1 << 24

_COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> tuple[int, ...]:
    if q.dim() != 4 or k.dim() != 4 or (v is not None and v.dim() != 4):
        raise ValueError("reference attention takes 4-d (batch, heads, seqlen, head_dim) tensors")
    b, hq, nq, d = q.shape
    _, hkv, nk, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d or (v is not None and v.shape != k.shape):
        raise ValueError(
            f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}"
            + (f", v {tuple(v.shape)}" if v is not None else "")
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"heads_q ({hq}) must be a multiple of heads_kv ({hkv})")
    return b, hq, hkv, nq, nk, d


def _tiles(b: int, hkv: int, group: int, nq: int, nk: int) -> Iterator[tuple[slice, slice, slice]]:
    """(batch, kv head, query row) slices whose score block fits the budget; a tile grows over
    query rows first, then kv heads, then batches."""
    row = max(1, group * nk)
    qc = min(nq, max(1, MAX_SCORE_ELEMENTS // row))
    hc = bc = 1
    if qc == nq:
        hc = min(hkv, max(1, MAX_SCORE_ELEMENTS // (row * nq)))
        if hc == hkv:
            bc = min(b, max(1, MAX_SCORE_ELEMENTS // (row * nq * hkv)))
    for b0 in range(0, b, bc):
        for h0 in range(0, hkv, hc):
            for i0 in range(0, nq, qc):
                yield slice(b0, b0 + bc), slice(h0, h0 + hc), slice(i0, i0 + qc)


def causal_visible(
    seqlen_q: int, seqlen_k: int, device: Any, first_row: int = 0, num_rows: int | None = None
) -> torch.Tensor:
    """sparktune's causal mask, aligned bottom-right: a (rows, seqlen_k) boolean tensor, True
    where query i sees key j, i.e. ``j <= i + seqlen_k - seqlen_q``, for the query rows
    ``first_row`` to ``first_row + num_rows`` (default: all of them)."""
    stop = seqlen_q if num_rows is None else first_row + num_rows
    i = torch.arange(first_row, stop, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def _tile(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    rows: slice,
    seqlen_q: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One tile in the compute dtype: q (b, hkv*group, rows, d), k and v (b, hkv, nk, d).
    Returns out (b, hkv*group, rows, d) (None without v) and lse (b, hkv*group, rows)."""
    hkv, nk = k.shape[1], k.shape[2]
    qg = q.unflatten(1, (hkv, -1))  # (b, hkv, group, rows, d)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        visible = causal_visible(seqlen_q, nk, q.device, rows.start, q.shape[2])
        s = s.masked_fill(~visible, -math.inf)
    # softmax with the row maximum subtracted; fully masked rows (max -inf) give p = 0 and
    # lse = -inf without producing NaN in the values or in the gradients
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    lse = (torch.log(denom) + m).squeeze(-1).flatten(1, 2)
    if v is None:
        return None, lse
    p = e / torch.where(denom == 0, 1.0, denom)
    out = torch.matmul(p, v.unsqueeze(2)).flatten(1, 2)
    return out, lse


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    compute_dtype: torch.dtype,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> None:
    """Write attention into ``out`` and/or its log-sum-exp into ``lse`` (either may be None),
    converting to ``compute_dtype`` tile by tile."""
    b, hq, hkv, nq, nk, d = _shapes(q, k, v)
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    for bs, hs, rs in _tiles(b, hkv, group, nq, nk):
        qs = slice(hs.start * group, hs.stop * group)
        o, l_ = _tile(
            q[bs, qs, rs].to(compute_dtype),
            k[bs, hs].to(compute_dtype),
            None if out is None else v[bs, hs].to(compute_dtype),
            rs,
            nq,
            causal,
            scale,
        )
        if out is not None:
            out[bs, qs, rs].copy_(o)
        if lse is not None:
            lse[bs, qs, rs].copy_(l_)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, N, D) tensors (any strides) computed in ``compute_dtype``.

    Returns ``(out, lse)`` in ``compute_dtype``: out (B, Hq, Nq, D) and the natural-log
    log-sum-exp of the scaled scores (B, Hq, Nq). Differentiable through autograd (use
    :func:`reference_attention_backward` for gradients with bounded memory).
    """
    b, hq, _, nq, _, d = _shapes(q, k, v)
    out = torch.empty((b, hq, nq, d), dtype=compute_dtype, device=q.device)
    lse = torch.empty((b, hq, nq), dtype=compute_dtype, device=q.device)
    _attend(q, k, v, causal, scale, compute_dtype, out, lse)
    return out, lse


def reference_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Only the log-sum-exp of :func:`reference_attention`, as float32 (B, Hq, Nq)."""
    b, hq, _, nq, _, _ = _shapes(q, k, None)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    with torch.no_grad():
        _attend(q, k, None, causal, scale, compute_dtype, None, lse)
    return lse


def reference_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in ``compute_dtype`` of attention for the output gradient
    ``dout`` (B, Hq, Nq, D). Each tile recomputes its forward and runs autograd on it at once,
    so memory stays bounded like the forward's."""
    b, hq, hkv, nq, nk, d = _shapes(q, k, v)
    if tuple(dout.shape) != (b, hq, nq, d):
        raise ValueError(f"dout has shape {tuple(dout.shape)}, expected {(b, hq, nq, d)}")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dq = torch.empty(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=q.device)
    for bs, hs, rs in _tiles(b, hkv, group, nq, nk):
        qs = slice(hs.start * group, hs.stop * group)
        leaves = [
            t.detach().to(compute_dtype).requires_grad_()
            for t in (q[bs, qs, rs], k[bs, hs], v[bs, hs])
        ]
        with torch.enable_grad():
            o, _ = _tile(*leaves, rs, nq, causal, scale)
            gq, gk, gv = torch.autograd.grad(o, leaves, dout[bs, qs, rs].to(compute_dtype))
        dq[bs, qs, rs] = gq
        dk[bs, hs] += gk
        dv[bs, hs] += gv
    return dq, dk, dv


class ReferenceBackend(Backend):
    """Exact math on any device, configs "float32" and "float64" (the compute dtype).

    Slow and memory-bound by design; dispatch uses it only when nothing faster can run.
    """

    name = "reference"
    tunable = False

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        names = {v: k for k, v in _COMPUTE_DTYPES.items()}
        if compute_dtype not in names:
            raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
        first = names[compute_dtype]
        self._configs = (first, *(c for c in _COMPUTE_DTYPES if c != first))

    def configs(self, op: str = "fwd") -> Sequence[str]:
        return self._configs

    def not_supported_reasons(
        self, problem: Problem, config: str | None = None, device: DeviceInfo | None = None
    ) -> list[str]:
        if config is not None and config not in _COMPUTE_DTYPES:
            return [self._unknown(config)]
        return []

    def _unknown(self, config: str) -> str:
        return f"unknown config {config!r}; reference configs: {', '.join(self._configs)}"

    def _dtype(self, config: str) -> torch.dtype:
        if config not in _COMPUTE_DTYPES:
            raise ValueError(self._unknown(config))
        return _COMPUTE_DTYPES[config]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
        need_lse: bool = True,
    ) -> torch.Tensor | None:
        cd = self._dtype(config)
        lse = None
        if need_lse:
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        with torch.no_grad():
            _attend(q, k, v, causal, scale, cd, out, lse)
        return lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        *,
        config: str,
        causal: bool,
        scale: float,
    ) -> None:
        gq, gk, gv = reference_attention_backward(
            dout, q, k, v, causal=causal, scale=scale, compute_dtype=self._dtype(config)
        )
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)
