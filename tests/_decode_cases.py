"""Inputs for the decode tests and the device check: ragged lengths, contiguous or paged caches
with pages out of order (optionally shared between sequences), appends, cache_batch_idx."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    seqlens: list[int]
    table: list[list[int]] | None = None
    batch_idx: list[int] | None = None
    kwargs: dict = field(default_factory=dict)

    def call_args(self, device=None, seqlens_as_int=False):
        """Positional tensors and keyword arguments for attention_with_kvcache (clones of the
        caches: the call appends in place)."""
        dev = device or self.q.device
        kw = dict(self.kwargs)
        if seqlens_as_int:  # True: a Python int; or the integer type to give it (NumPy's)
            as_int = seqlens_as_int if callable(seqlens_as_int) else int
            kw["cache_seqlens"] = as_int(self.seqlens[0])
        else:
            kw["cache_seqlens"] = torch.tensor(self.seqlens, dtype=torch.int32, device=dev)
        if self.table is not None:
            kw["block_table"] = torch.tensor(self.table, dtype=torch.int32, device=dev)
        if self.batch_idx is not None:
            kw["cache_batch_idx"] = torch.tensor(self.batch_idx, dtype=torch.int32, device=dev)
        kc, vc = self.k_cache.clone().to(dev), self.v_cache.clone().to(dev)
        new = () if self.k is None else (self.k.to(dev), self.v.to(dev))
        return (self.q.to(dev), kc, vc, *new), kw


def make_case(*, batch=3, nq=1, hq=4, hkv=2, d=32, seqlens=(5, 0, 37), capacity=48, appends=0,
              page_size=0, share_pages=False, batch_idx=False, dtype=torch.float64, seed=0,
              **kwargs) -> Case:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    seqlens = list(seqlens)[:batch]
    assert len(seqlens) == batch
    q = rnd(batch, nq, hq, d)
    k = v = None
    if appends:
        k, v = rnd(batch, appends, hkv, d), rnd(batch, appends, hkv, d)
    table = bidx = None
    if page_size:
        per_seq = -(-capacity // page_size)
        blocks = batch * per_seq + 3
        perm = torch.randperm(blocks, generator=g).tolist()
        table = [perm[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
        if share_pages and batch > 1:
            # sequence 1 reads sequence 0's first page too (a shared prefix); only pages that
            # no append writes are shared
            assert min(seqlens[0], seqlens[1]) >= page_size
            table[1][0] = table[0][0]
        kc, vc = rnd(blocks, page_size, hkv, d), rnd(blocks, page_size, hkv, d)
    else:
        rows = batch + 2 if batch_idx else batch
        kc, vc = rnd(rows, capacity, hkv, d), rnd(rows, capacity, hkv, d)
        if batch_idx:
            bidx = torch.randperm(rows, generator=g)[:batch].tolist()
    return Case(q, kc, vc, k, v, seqlens, table, bidx, kwargs)
