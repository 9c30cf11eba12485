"""Decoding against a KV cache, written from the definitions (docs/DECODING.md) for the tests
and the device check: independent of sparktune's reference backend and of its append code.

Each sequence's keys are built as a Python list of positions: the cache's first
``cache_seqlens[b]`` entries (walking the block table page by page when paged) followed by
the new tokens; each query row then takes the softmax over the keys it sees.
"""

from __future__ import annotations

import math

import torch


def logical_keys(k_cache, v_cache, k_new, v_new, b, length, table, batch_idx):
    """Sequence b's keys and values after the append, (L, Hkv, D) each."""
    ks, vs = [], []
    for j in range(length):
        if table is not None:
            ps = k_cache.shape[1]
            page = table[b][j // ps]
            ks.append(k_cache[page, j % ps])
            vs.append(v_cache[page, j % ps])
        else:
            row = batch_idx[b] if batch_idx is not None else b
            ks.append(k_cache[row, j])
            vs.append(v_cache[row, j])
    if k_new is not None:
        for t in range(k_new.shape[1]):
            ks.append(k_new[b, t])
            vs.append(v_new[b, t])
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if not ks:
        return k_cache.new_zeros(0, hkv, d), v_cache.new_zeros(0, hkv, d)
    return torch.stack(ks), torch.stack(vs)


def expected_caches(k_cache, v_cache, k_new, v_new, seqlens, table, batch_idx):
    """The caches after the append: a copy with each new token at its position."""
    kc, vc = k_cache.clone(), v_cache.clone()
    if k_new is None:
        return kc, vc
    for b, n in enumerate(seqlens):
        for t in range(k_new.shape[1]):
            pos = n + t
            if table is not None:
                ps = kc.shape[1]
                page, slot = table[b][pos // ps], pos % ps
            else:
                page, slot = (batch_idx[b] if batch_idx is not None else b), pos
            kc[page, slot] = k_new[b, t]
            vc[page, slot] = v_new[b, t]
    return kc, vc


def decode_oracle(q, k_cache, v_cache, k_new=None, v_new=None, *, seqlens, table=None,
                  batch_idx=None, causal=True, scale=None, window=(-1, -1), softcap=0.0,
                  slopes=None, math_dtype=torch.float64):
    """(out (B, Nq, Hq, D) in math_dtype, lse (B, Hq, Nq) float64). ``seqlens``, ``table`` and
    ``batch_idx`` are Python lists; the caches are the ones before the append."""
    batch, nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    appends = 0 if k_new is None else k_new.shape[1]
    out = torch.zeros(batch, nq, hq, d, dtype=math_dtype)
    lse = torch.full((batch, hq, nq), -math.inf, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for b in range(batch):
        length = seqlens[b] + appends
        kk, vv = logical_keys(k_cache.cpu(), v_cache.cpu(), None if k_new is None else k_new.cpu(),
                              None if v_new is None else v_new.cpu(), b, seqlens[b], table,
                              batch_idx)
        kk, vv = kk.to(math_dtype), vv.to(math_dtype)
        for h in range(hq):
            hk = h // group
            for i in range(nq):
                diag = i + length - nq
                cols = [j for j in range(length)
                        if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)]
                if not cols:
                    continue
                qv = q[b, i, h].cpu().to(math_dtype)
                s = (kk[cols, hk] @ qv) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if slopes is not None:
                    slope = float(slopes[h] if slopes.dim() == 1 else slopes[b, h])
                    s = s - slope * torch.tensor([abs(diag - j) for j in cols], dtype=math_dtype)
                m = s.max()
                p = torch.exp(s - m)
                out[b, i, h] = (p @ vv[cols, hk]) / p.sum()
                lse[b, h, i] = float(m) + math.log(float(p.double().sum()))
    return out, lse
