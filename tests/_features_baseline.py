"""Attention with the features of docs/FEATURES.md, written from the definitions, in the
inputs' own dtype: float64 gives the exact values, fp16/bf16 PyTorch's own error (the baseline
of FlashAttention's 2x rule). Shared by the Triton feature tests and the device check
(tools/gpu_check_triton_features.py); the dropout keep mask is an input.
"""

from __future__ import annotations

import math

import torch

__all__ = ["dense_attention", "feature_attention"]


def dense_attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                     keep=None, dropout_p=0.0):
    """docs/FEATURES.md for (B, H, N, D) tensors in their own dtype (softmax in float32 for low
    precision, as PyTorch's plain path): returns (out, lse). ``slopes`` is (B, Hq) float;
    ``keep`` the (B, Hq, Nq, Nk) dropout keep mask."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    nq, nk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    diag = i + nk - nq
    if slopes is not None:
        s = s - (slopes[:, :, None, None] * (diag - j).abs()).to(s.dtype)
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    s = s.masked_fill(~visible, -math.inf)
    work = s if s.dtype == torch.float64 else s.float()
    lse = torch.logsumexp(work, -1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(work - safe[..., None]).to(q.dtype)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    return p @ v, lse


def feature_attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
               keep=None, dropout_p=0.0, cu_q=None, cu_k=None):
    """Dense (B, H, N, D) or, with cu_q/cu_k, packed (total, H, D) attention (lse (Hq, total_q));
    slopes (Hq,) or (B, Hq)."""
    if slopes is not None and slopes.dim() == 1:
        batch = q.shape[0] if cu_q is None else len(cu_q) - 1
        slopes = slopes[None].expand(batch, -1)
    if slopes is not None:
        slopes = slopes.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if cu_q is None:
        return dense_attention(q, k, v, scale=scale, causal=causal, window=window,
                                softcap=softcap, slopes=slopes, keep=keep, dropout_p=dropout_p)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [t[r].transpose(0, 1)[None] for t, r in ((q, rq), (k, rk), (v, rk))]
        kb = None if keep is None else keep[:, rq, : rk.stop - rk.start][None]
        o, lse = dense_attention(*seq, scale=scale, causal=causal, window=window,
                                  softcap=softcap, slopes=None if slopes is None else slopes[b:b + 1],
                                  keep=kb, dropout_p=dropout_p)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)
