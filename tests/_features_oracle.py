"""A float64 oracle of the attention features, written from the definitions of
docs/FEATURES.md with nothing tiled or shared with sparktune's reference backend (except the
dropout keep mask, whose generator is part of the definition):

    oracle(q, k, v, causal=..., scale=..., window=..., softcap=..., alibi=..., dropout_p=...,
           seed=..., offset=...) -> (out, lse)              # dense (B, H, N, D)
    varlen_oracle(q, k, v, cu_q, cu_k, **same) -> (out, lse)  # packed (total, H, D)

Differentiable by autograd (inputs are converted to float64 in the graph).
"""

from __future__ import annotations

import math

import torch

from sparktune.dropout import dropout_keep, dropout_key


def _masked_softmax(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the last dimension, rows of -inf giving 0 (and lse -inf) without NaN."""
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    den = e.sum(dim=-1, keepdim=True)
    lse = (torch.log(den) + m).squeeze(-1)
    return e / torch.where(den == 0, torch.ones_like(den), den), lse


def _one(q, k, v, *, causal, scale, window, softcap, slopes, dropout_p, key, row, col):
    """One problem (B, Hq, Nq, D) in float64; slopes (B, Hq) or None; row/col the dropout
    numbering (broadcastable to (B, Hq, Nq, Nk))."""
    _, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hk, dim=1)
    v = v.repeat_interleave(hq // hk, dim=1)
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(d) if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq, dtype=torch.float64)[:, None]
    j = torch.arange(nk, dtype=torch.float64)[None, :]
    diag = i + nk - nq
    if slopes is not None:
        s = s - slopes[:, :, None, None].double() * (diag - j).abs()
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    s = s.masked_fill(~visible, -math.inf)
    p, lse = _masked_softmax(s)
    if dropout_p:
        p = p * dropout_keep(key, row, col, dropout_p).double() / (1 - dropout_p)
    return p @ v, lse


def oracle(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi=None,
           dropout_p=0.0, seed=0, offset=0):
    b, hq, nq, _ = q.shape
    nk = k.shape[2]
    slopes = None if alibi is None else alibi.expand(b, hq) if alibi.dim() == 1 else alibi
    bi = torch.arange(b).view(-1, 1, 1, 1)
    hi = torch.arange(hq).view(1, -1, 1, 1)
    ii = torch.arange(nq).view(1, 1, -1, 1)
    row = (bi * hq + hi) * nq + ii
    col = torch.arange(nk).view(1, 1, 1, -1)
    return _one(
        q.double(), k.double(), v.double(), causal=causal, scale=scale, window=window,
        softcap=softcap, slopes=slopes, dropout_p=dropout_p, key=dropout_key(seed, offset),
        row=row, col=col,
    )


def varlen_oracle(q, k, v, cu_q, cu_k, *, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                  alibi=None, dropout_p=0.0, seed=0, offset=0):
    tq, hq, d = q.shape
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(q[q0:q1].double() * 0)
            lses.append(torch.full((hq, q1 - q0), -math.inf, dtype=torch.float64))
            continue
        slopes = None
        if alibi is not None:
            slopes = (alibi if alibi.dim() == 1 else alibi[b]).reshape(1, hq)
        hi = torch.arange(hq).view(1, -1, 1, 1)
        ii = torch.arange(q0, q1).view(1, 1, -1, 1)
        o, lse = _one(
            q[q0:q1].double().transpose(0, 1)[None], k[k0:k1].double().transpose(0, 1)[None],
            v[k0:k1].double().transpose(0, 1)[None], causal=causal, scale=scale, window=window,
            softcap=softcap, slopes=slopes, dropout_p=dropout_p, key=dropout_key(seed, offset),
            row=hi * tq + ii, col=torch.arange(k1 - k0).view(1, 1, 1, -1),
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
