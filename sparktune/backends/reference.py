"""Exact attention math in float32 or float64, on any device: the fallback and the test oracle.

Scores are materialised, so the work is split into tiles over (batch, kv head, query rows) whose
score block stays under :data:`MAX_SCORE_ELEMENTS`; memory is bounded whatever the problem size.
Semantics are the ones every backend follows: GQA (query head h reads kv head
``h // (heads_q // heads_kv)``), causal masks aligned bottom-right (query i sees key j iff
``j <= i + seqlen_k - seqlen_q``), rows with no visible key give output 0 and log-sum-exp -inf.

Every feature of docs/FEATURES.md is implemented here from its definition: sliding windows,
soft-capping, ALiBi, dropout (the keep mask of :func:`dropout_keep`, regenerated in the
backward from ``(seed, offset)``), and packed variable-length batches (``cu_seqlens_*``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..dropout import dropout_keep, dropout_key
from .base import Backend

if TYPE_CHECKING:
    from ..problem import DeviceInfo, Problem

__all__ = [
    "MAX_SCORE_ELEMENTS",
    "ReferenceBackend",
    "causal_visible",
    "dropout_keep",
    "dropout_key",
    "window_visible",
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


def window_visible(
    seqlen_q: int,
    seqlen_k: int,
    device: Any,
    first_row: int = 0,
    num_rows: int | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
) -> torch.Tensor | None:
    """The mask of ``causal`` and ``window=(left, right)`` (docs/FEATURES.md), aligned
    bottom-right: a (rows, seqlen_k) boolean tensor, True where query i sees key j, i.e.
    ``d(i) - left <= j <= d(i) + right`` with ``d(i) = i + seqlen_k - seqlen_q``, ``-1``
    unlimited and ``causal`` meaning ``right = 0``; None when nothing is masked."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    stop = seqlen_q if num_rows is None else first_row + num_rows
    d = torch.arange(first_row, stop, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones((stop - first_row, seqlen_k), dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= d - left
    if right >= 0:
        visible &= j <= d + right
    return visible


class _Feat:
    """The features of one tile's computation (see :func:`_tile`)."""

    __slots__ = ("window", "softcap", "slopes", "dropout_p", "key", "row_strides")

    def __init__(
        self,
        window: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        slopes: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        key: int = 0,
        row_strides: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        self.window = window
        self.softcap = softcap
        #: (B, Hq) float32, ALiBi slopes
        self.slopes = slopes
        self.dropout_p = dropout_p
        self.key = key
        #: the dropout row number is b * s_b + h * s_h + base + i
        self.row_strides = row_strides


def _tile(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    rows: slice,
    seqlen_q: int,
    causal: bool,
    scale: float,
    feat: _Feat | None = None,
    where: tuple[slice, slice] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One tile in the compute dtype: q (b, hkv*group, rows, d), k and v (b, hkv, nk, d).
    Returns out (b, hkv*group, rows, d) (None without v) and lse (b, hkv*group, rows).
    ``feat``: the features, with ``where`` the tile's (batch, query head) slices."""
    hkv, nk = k.shape[1], k.shape[2]
    qg = q.unflatten(1, (hkv, -1))  # (b, hkv, group, rows, d)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    if feat is None:
        if causal:
            visible = causal_visible(seqlen_q, nk, q.device, rows.start, q.shape[2])
            s = s.masked_fill(~visible, -math.inf)
    else:
        s = _feature_scores(s, rows, seqlen_q, causal, feat, where)
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
    if feat is not None and feat.dropout_p > 0:
        p = p * _keep(p.shape, rows, feat, where, q.device).to(p.dtype) / (1.0 - feat.dropout_p)
    out = torch.matmul(p, v.unsqueeze(2)).flatten(1, 2)
    return out, lse


def _head_index(where: tuple[slice, slice], shape: torch.Size, device: Any) -> tuple[Any, Any]:
    """(batch, query head) indices of a tile's (b, hkv, group, ...) scores, broadcastable."""
    bs, qs = where
    b = torch.arange(bs.start, bs.start + shape[0], device=device).view(-1, 1, 1, 1, 1)
    h = torch.arange(qs.start, qs.start + shape[1] * shape[2], device=device)
    return b, h.view(1, shape[1], shape[2], 1, 1)


def _feature_scores(
    s: torch.Tensor,
    rows: slice,
    seqlen_q: int,
    causal: bool,
    feat: _Feat,
    where: tuple[slice, slice] | None,
) -> torch.Tensor:
    """Scaled scores (b, hkv, group, rows, nk) with soft-capping, ALiBi and the mask applied,
    in the order of docs/FEATURES.md."""
    nrows, nk = s.shape[3], s.shape[4]
    if feat.softcap > 0:
        s = torch.tanh(s / feat.softcap) * feat.softcap
    if feat.slopes is not None:
        assert where is not None
        bs, qs = where
        slopes = feat.slopes[bs, qs].to(s.dtype).reshape(s.shape[0], s.shape[1], s.shape[2], 1, 1)
        d = torch.arange(rows.start, rows.start + nrows, device=s.device)[:, None] + (nk - seqlen_q)
        dist = (d - torch.arange(nk, device=s.device)[None, :]).abs().to(s.dtype)
        s = s - slopes * dist
    visible = window_visible(
        seqlen_q, nk, s.device, rows.start, nrows, causal=causal, window=feat.window
    )
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    return s


def _keep(
    shape: torch.Size, rows: slice, feat: _Feat, where: tuple[slice, slice] | None, device: Any
) -> torch.Tensor:
    """The dropout keep mask of a tile's (b, hkv, group, rows, nk) probabilities."""
    assert where is not None
    b, h = _head_index(where, shape, device)
    sb, sh, base = feat.row_strides
    i = torch.arange(rows.start, rows.start + shape[3], device=device).view(1, 1, 1, -1, 1)
    row = b * sb + h * sh + base + i
    col = torch.arange(shape[4], device=device).view(1, 1, 1, 1, -1)
    return dropout_keep(feat.key, row, col, feat.dropout_p)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    compute_dtype: torch.dtype,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    feat: _Feat | None = None,
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
            feat,
            (bs, qs),
        )
        if out is not None:
            out[bs, qs, rs].copy_(o)
        if lse is not None:
            lse[bs, qs, rs].copy_(l_)


#: the feature arguments of the reference functions and backend (docs/FEATURES.md)
FEATURE_ARGS = (
    "window", "softcap", "alibi_slopes", "dropout_p", "seed", "offset", "deterministic",
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
)  # fmt: skip


def _check_feature_args(features: dict[str, Any]) -> None:
    unknown = sorted(set(features) - set(FEATURE_ARGS))
    if unknown:
        raise TypeError(
            f"unknown feature argument(s) {', '.join(unknown)}; known: {', '.join(FEATURE_ARGS)}"
        )


def _dense_feat(batch: int, hq: int, nq: int, features: dict[str, Any]) -> _Feat | None:
    """The tile features of a dense problem, or None when none is on."""
    if not features:
        return None
    _check_feature_args(features)
    slopes = features.get("alibi_slopes")
    if slopes is not None:
        slopes = slopes.expand(batch, hq) if slopes.dim() == 1 else slopes
    dropout_p = float(features.get("dropout_p", 0.0) or 0.0)
    return _Feat(
        window=tuple(features.get("window", (-1, -1))),  # type: ignore[arg-type]
        softcap=float(features.get("softcap", 0.0) or 0.0),
        slopes=slopes,
        dropout_p=dropout_p,
        key=dropout_key(features.get("seed", 0), features.get("offset", 0)) if dropout_p else 0,
        row_strides=(hq * nq, nq, 0),
    )


def _sequences(features: dict[str, Any]) -> list[tuple[int, int, int, int]] | None:
    """(q start, q stop, k start, k stop) of each packed sequence; None for a dense problem."""
    cu_q, cu_k = features.get("cu_seqlens_q"), features.get("cu_seqlens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries, cu_seqlens_k {len(ck)}")
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """A (n, H, D) slice of a packed tensor as a (1, H, n, D) view."""
    return t.transpose(0, 1).unsqueeze(0)


def _seq_feat(
    features: dict[str, Any], b: int, hq: int, total_q: int, q0: int
) -> tuple[dict[str, Any], _Feat]:
    """The dense features and tile features of packed sequence ``b``."""
    slopes = features.get("alibi_slopes")
    if slopes is not None:
        slopes = (slopes if slopes.dim() == 1 else slopes[b]).reshape(1, hq)
    dropout_p = float(features.get("dropout_p", 0.0) or 0.0)
    feat = _Feat(
        window=tuple(features.get("window", (-1, -1))),  # type: ignore[arg-type]
        softcap=float(features.get("softcap", 0.0) or 0.0),
        slopes=slopes,
        dropout_p=dropout_p,
        key=dropout_key(features.get("seed", 0), features.get("offset", 0)) if dropout_p else 0,
        row_strides=(0, total_q, q0),
    )
    return features, feat


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    **features: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, H, N, D) tensors (any strides) computed in ``compute_dtype``.

    Returns ``(out, lse)`` in ``compute_dtype``: out (B, Hq, Nq, D) and the natural-log
    log-sum-exp of the scaled scores (B, Hq, Nq). Differentiable through autograd (use
    :func:`reference_attention_backward` for gradients with bounded memory).

    ``features``: the keyword arguments of docs/FEATURES.md (``window``, ``softcap``,
    ``alibi_slopes``, ``dropout_p`` with ``seed`` and ``offset``, and for packed
    (total, H, D) tensors ``cu_seqlens_q``/``cu_seqlens_k``; then out is (total_q, Hq, D)
    and lse (Hq, total_q)).
    """
    seqs = _sequences(features) if features else None
    if seqs is not None:
        return _varlen_forward(q, k, v, causal, scale, compute_dtype, features, seqs)
    b, hq, _, nq, _, d = _shapes(q, k, v)
    out = torch.empty((b, hq, nq, d), dtype=compute_dtype, device=q.device)
    lse = torch.empty((b, hq, nq), dtype=compute_dtype, device=q.device)
    _attend(q, k, v, causal, scale, compute_dtype, out, lse, _dense_feat(b, hq, nq, features))
    return out, lse


def _varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    compute_dtype: torch.dtype,
    features: dict[str, Any],
    seqs: list[tuple[int, int, int, int]],
    lse_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Packed sequences one by one: out (total_q, Hq, D) (None without v), lse (Hq, total_q)."""
    _check_feature_args(features)
    total_q, hq, d = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out = None if v is None else torch.zeros((total_q, hq, d), dtype=compute_dtype, device=q.device)
    lse = torch.full((hq, total_q), -math.inf, dtype=lse_dtype or compute_dtype, device=q.device)
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        if q1 == q0 or k1 == k0:  # no query, or no key: out 0, lse -inf
            continue
        _, feat = _seq_feat(features, b, hq, total_q, q0)
        _attend(
            _as_batch(q[q0:q1]),
            _as_batch(k[k0:k1]),
            None if v is None else _as_batch(v[k0:k1]),
            causal,
            scale,
            compute_dtype,
            None if out is None else _as_batch(out[q0:q1]),
            lse[:, q0:q1].unsqueeze(0),
            feat,
        )
    return out, lse


def reference_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    **features: Any,
) -> torch.Tensor:
    """Only the log-sum-exp of :func:`reference_attention`, as float32 (B, Hq, Nq) ((Hq,
    total_q) for packed sequences)."""
    seqs = _sequences(features) if features else None
    with torch.no_grad():
        if seqs is not None:
            return _varlen_forward(
                q, k, None, causal, scale, compute_dtype, features, seqs, torch.float32
            )[1]
        b, hq, _, nq, _, _ = _shapes(q, k, None)
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
        _attend(q, k, None, causal, scale, compute_dtype, None, lse, _dense_feat(b, hq, nq, features))
    return lse


def _backward_into(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    compute_dtype: torch.dtype,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    feat: _Feat | None,
) -> None:
    """Gradients of (B, H, N, D) views written into the views ``dq`` (every element), ``dk``
    and ``dv`` (accumulated: zero them first)."""
    b, hq, hkv, nq, nk, d = _shapes(q, k, v)
    group = hq // hkv
    for bs, hs, rs in _tiles(b, hkv, group, nq, nk):
        qs = slice(hs.start * group, hs.stop * group)
        leaves = [
            t.detach().to(compute_dtype).requires_grad_()
            for t in (q[bs, qs, rs], k[bs, hs], v[bs, hs])
        ]
        with torch.enable_grad():
            o, _ = _tile(*leaves, rs, nq, causal, scale, feat, (bs, qs))
            gq, gk, gv = torch.autograd.grad(o, leaves, dout[bs, qs, rs].to(compute_dtype))
        dq[bs, qs, rs] = gq
        dk[bs, hs] += gk
        dv[bs, hs] += gv


def reference_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    **features: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) in ``compute_dtype`` of attention for the output gradient
    ``dout`` (B, Hq, Nq, D), or (total_q, Hq, D) for packed sequences. Each tile recomputes
    its forward (and its dropout mask) and runs autograd on it at once, so memory stays
    bounded like the forward's. ``features`` as :func:`reference_attention`."""
    seqs = _sequences(features) if features else None
    if seqs is not None:
        _check_feature_args(features)
        if dout.shape != q.shape:
            raise ValueError(f"dout has shape {tuple(dout.shape)}, expected {tuple(q.shape)}")
        total_q, hq, d = q.shape
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
        dv = torch.zeros(v.shape, dtype=compute_dtype, device=q.device)
        for b, (q0, q1, k0, k1) in enumerate(seqs):
            if q1 == q0 or k1 == k0:
                continue
            _, feat = _seq_feat(features, b, hq, total_q, q0)
            _backward_into(
                _as_batch(dout[q0:q1]),
                _as_batch(q[q0:q1]),
                _as_batch(k[k0:k1]),
                _as_batch(v[k0:k1]),
                causal,
                scale,
                compute_dtype,
                _as_batch(dq[q0:q1]),
                _as_batch(dk[k0:k1]),
                _as_batch(dv[k0:k1]),
                feat,
            )
        return dq, dk, dv
    b, hq, hkv, nq, nk, d = _shapes(q, k, v)
    if tuple(dout.shape) != (b, hq, nq, d):
        raise ValueError(f"dout has shape {tuple(dout.shape)}, expected {(b, hq, nq, d)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dq = torch.empty(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=q.device)
    _backward_into(
        dout, q, k, v, causal, scale, compute_dtype, dq, dk, dv, _dense_feat(b, hq, nq, features)
    )
    return dq, dk, dv


class ReferenceBackend(Backend):
    """Exact math on any device, configs "float32" and "float64" (the compute dtype).

    Slow and memory-bound by design; dispatch uses it only when nothing faster can run.
    """

    name = "reference"
    tunable = False
    #: every feature of docs/FEATURES.md (the math is sequential: deterministic too)
    features = frozenset(("window", "softcap", "alibi", "dropout", "deterministic", "varlen", "decode"))

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
        **features: Any,
    ) -> torch.Tensor | None:
        cd = self._dtype(config)
        if features:
            seqs = _sequences(features)
            if seqs is not None:
                with torch.no_grad():
                    o, lse = _varlen_forward(
                        q, k, v, causal, scale, cd, features, seqs, torch.float32
                    )
                    out.copy_(o)
                return lse if need_lse else None
        lse = None
        if need_lse:
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        with torch.no_grad():
            feat = _dense_feat(q.shape[0], q.shape[1], q.shape[2], features) if features else None
            _attend(q, k, v, causal, scale, cd, out, lse, feat)
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
        **features: Any,
    ) -> None:
        gq, gk, gv = reference_attention_backward(
            dout, q, k, v, causal=causal, scale=scale, compute_dtype=self._dtype(config),
            **features,
        )
        dq.copy_(gq)
        dk.copy_(gk)
        dv.copy_(gv)
