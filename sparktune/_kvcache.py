"""Decoding against a KV cache: ``sparktune.attention_with_kvcache`` (docs/DECODING.md).

One module for the decode path's parts, kept apart from the dense call so that each can change
alone: the checks of a call's inputs (host-side shape checks always; value checks of
``cache_seqlens``, the block table and ``cache_batch_idx`` where they cost no device sync, or
when the caller asks), the decode problem key (:class:`DecodeKey`), appending new keys and
values in place, the three ways to compute it (the float32/float64 reference math, PyTorch's
SDPA on the sliced cache, the split-KV Triton kernels of :mod:`sparktune.kernels.triton_decode`)
and the per-call choice between them.

Semantics (FlashAttention-2's ``flash_attn_with_kvcache``, the names are ours):

- ``q`` is ``(B, Nq, Hq, D)``; the cache is ``(B_cache, N_max, Hkv, D)``, or with
  ``block_table`` ``(num_blocks, page_size, Hkv, D)`` pages addressed by
  ``block_table[b, j // page_size]`` (int32 ``(B, max_blocks)``).
- ``k``/``v`` ``(B, Nnew, Hkv, D)``, when given, are written at positions
  ``cache_seqlens[b] .. cache_seqlens[b] + Nnew - 1`` before attending; the queries then see
  ``L_b = cache_seqlens[b] + Nnew`` keys, and causal alignment is bottom-right: query ``i``
  sees key ``j`` iff ``j <= i + L_b - Nq``. Windows, softcap and ALiBi follow docs/FEATURES.md
  with ``Nk = L_b``.
- A row that sees no key (``L_b = 0``, or causal with ``Nq > L_b``) gives 0 and lse ``-inf``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_scale, check_softcap, check_window
from .problem import Problem

__all__ = [
    "attention_with_kvcache",
    "DecodeKey",
    "DecodeInputs",
    "check_kvcache",
    "check_values",
    "append_kv",
    "reference_decode",
    "sdpa_decode",
    "decode_reasons",
    "decode_problem",
    "DECODE_BACKENDS",
    "DecodeChoice",
    "choose_decode",
    "select_decode",
    "set_decode_choice",
]

#: the backends that run decode problems, in the order a default is looked for
DECODE_BACKENDS = ("triton", "torch", "reference")
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: the reference also takes float32 and float64 inputs (its own math precision)
_REFERENCE_DTYPES = {**_DTYPES, torch.float32: "float32", torch.float64: "float64"}


def cache_bucket(capacity: int) -> int:
    """The cache-length bucket of the key: the next power of two of the capacity (>= 16)."""
    return max(16, 1 << max(0, capacity - 1).bit_length())


@dataclass(frozen=True)
class DecodeKey:
    """The decode problem kind: what a decode kernel's choice depends on.

    ``cache_len`` is the power-of-two bucket of the cache's capacity (``N_max``, or
    ``max_blocks * page_size`` when paged): the host never reads the actual lengths, which live
    on the device. ``page_size`` is 0 for a contiguous cache."""

    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    cache_len: int
    head_dim: int
    causal: bool
    page_size: int = 0
    appends: int = 0
    window_left: int = -1
    window_right: int = -1
    softcap: bool = False
    alibi: bool = False

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def features(self) -> frozenset[str]:
        return frozenset(
            name
            for name, on in (
                ("window", self.window_left != -1 or self.window_right != -1),
                ("softcap", self.softcap),
                ("alibi", self.alibi),
            )
            if on
        )

    def key(self) -> str:
        """The string key, e.g. ``dec:bfloat16:b8:h32/8:q1:c8192:d128:causal:page256``."""
        parts = [
            "dec",
            self.dtype,
            f"b{self.batch}",
            f"h{self.heads_q}/{self.heads_kv}",
            f"q{self.seqlen_q}",
            f"c{self.cache_len}",
            f"d{self.head_dim}",
            "causal" if self.causal else "full",
        ]
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if self.appends:
            parts.append(f"new{self.appends}")
        if self.window_left != -1 or self.window_right != -1:
            parts.append(f"w{self.window_left}/{self.window_right}")
        if self.softcap:
            parts.append("softcap")
        if self.alibi:
            parts.append("alibi")
        return ":".join(parts)

    def bytes_read(self, mean_len: float) -> float:
        """Bytes of K and V a call reads at mean cache length ``mean_len`` (the bandwidth
        numerator; queries and outputs are negligible)."""
        item = 2 if self.dtype in ("float16", "bfloat16") else 4
        return 2.0 * self.batch * self.heads_kv * mean_len * self.head_dim * item


@dataclass
class DecodeInputs:
    """A checked call: tensors as given, the normalised options and the key."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    cache_seqlens: torch.Tensor | int
    block_table: torch.Tensor | None
    cache_batch_idx: torch.Tensor | None
    causal: bool
    scale: float
    window: tuple[int, int]
    softcap: float
    alibi_slopes: torch.Tensor | None
    capacity: int
    page_size: int
    key: DecodeKey


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_integral(x: object) -> bool:
    """An integer of any kind (Python's, NumPy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int32_vector(t: object, name: str, length: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one per sequence), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}: they must share a device")
    if length > 1 and t.stride(0) != 1:
        # the Triton kernels read entry b at offset b
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride()}; "
                         f"pass {name}.contiguous()")
    return t


def check_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    *,
    cache_seqlens: Any,
    block_table: Any = None,
    causal: bool = True,
    scale: Any = None,
    window: Any = (-1, -1),
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    cache_batch_idx: Any = None,
    reference_dtypes: bool = False,
) -> DecodeInputs:
    """Check a call's inputs on the host (shapes, dtypes, devices, strides; nothing that needs
    the device's values) and build its key. Raises ``TypeError``/``ValueError`` naming what is
    wrong and what is supported."""
    dtypes = _REFERENCE_DTYPES if reference_dtypes else _DTYPES
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-d, got shape {tuple(t.shape)}")
    if q.dtype not in dtypes:
        raise TypeError(f"q has dtype {q.dtype}; supported: {', '.join(dtypes.values())}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}, q {q.dtype}: they must match")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: they must share a device")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must have the same shape")
    batch, nq, hq, d = q.shape
    rows_c, n_c, hkv, dk = k_cache.shape
    if batch < 1 or nq < 1 or hq < 1 or d < 1:
        raise ValueError(f"q must not be empty (every dimension at least 1), got shape "
                         f"{tuple(q.shape)}")
    if dk != d:
        raise ValueError(f"k_cache has head_dim {dk}, q {d}: they must match")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of the cache's heads ({hkv})")
    if rows_c < 1 or n_c < 1:
        raise ValueError(f"the cache must not be empty, got shape {tuple(k_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if k_cache.data_ptr() == v_cache.data_ptr() and k_cache.numel():
        raise ValueError("k_cache and v_cache must be different tensors")

    # pages
    if block_table is not None:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be an int32 tensor, got {type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
            raise ValueError(f"block_table must be (batch={batch}, max_blocks >= 1), got "
                             f"{tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"block_table is on {block_table.device}, q on {q.device}")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            # the Triton kernels read entry (b, j) at b * stride(0) + j
            raise ValueError(f"block_table must have a contiguous last dimension (stride 1), got "
                             f"strides {block_table.stride()}; the row stride may be anything")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for a contiguous cache; with block_table the "
                             "table says where each sequence's pages are")
        page_size = n_c
        capacity = block_table.shape[1] * page_size
    else:
        page_size = 0
        capacity = n_c
        if cache_batch_idx is not None:
            _int32_vector(cache_batch_idx, "cache_batch_idx", batch, q.device)
        elif rows_c != batch:
            raise ValueError(f"the cache has {rows_c} sequences, q {batch}: pass cache_batch_idx "
                             "to map each sequence to a cache row, or a cache of q's batch")

    # appends
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    appends = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != hkv or t.shape[3] != d:
                raise ValueError(f"{name} must be (batch={batch}, Nnew, heads_kv={hkv}, "
                                 f"head_dim={d}), got {tuple(t.shape)}")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), "
                                 f"got {t.dtype} on {t.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous last dimension, got strides "
                                 f"{t.stride()}")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        appends = k.shape[1]
        if appends > capacity:
            raise ValueError(f"{appends} new tokens do not fit a cache of capacity {capacity}")

    # lengths
    if _is_int(cache_seqlens):
        if not 0 <= cache_seqlens <= capacity - appends:
            raise ValueError(f"cache_seqlens ({cache_seqlens}) + new tokens ({appends}) must be "
                             f"between 0 and the cache's capacity ({capacity})")
    else:
        _int32_vector(cache_seqlens, "cache_seqlens", batch, q.device)

    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    # as sparktune.attention checks them (the same errors and messages)
    scale = check_scale(scale, d)
    left, right = check_window(window, causal)
    softcap = check_softcap(softcap)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a float32 tensor")
        if tuple(alibi_slopes.shape) not in ((hq,), (batch, hq)):
            raise ValueError(f"alibi_slopes must be ({hq},) or ({batch}, {hq}), got "
                             f"{tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}")
        if alibi_slopes.stride(-1) != 1:
            raise ValueError("alibi_slopes must have a contiguous last dimension")

    key = DecodeKey(
        dtype=dtypes[q.dtype], batch=batch, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
        cache_len=cache_bucket(capacity), head_dim=d, causal=causal, page_size=page_size,
        appends=appends, window_left=left, window_right=right, softcap=float(softcap) > 0,
        alibi=alibi_slopes is not None,
    )
    return DecodeInputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                        causal, scale, (left, right), float(softcap), alibi_slopes, capacity,
                        page_size, key)


def check_values(inp: DecodeInputs) -> None:
    """Check the device-resident values: lengths within the capacity, the pages a sequence uses
    within the cache, ``cache_batch_idx`` within the cache's rows. Reads them on the host (a
    device sync on CUDA)."""
    appends = inp.key.appends
    batch = inp.key.batch
    if isinstance(inp.cache_seqlens, torch.Tensor):
        lens = inp.cache_seqlens.tolist()
        for b, n in enumerate(lens):
            if not 0 <= n <= inp.capacity - appends:
                raise ValueError(f"cache_seqlens[{b}] = {n} (+ {appends} new tokens) is outside "
                                 f"0..{inp.capacity} (the cache's capacity)")
    else:
        lens = [inp.cache_seqlens] * batch
    if inp.block_table is not None:
        table = inp.block_table.tolist()
        blocks = inp.k_cache.shape[0]
        ps = inp.page_size
        for b in range(batch):
            used = -(-(lens[b] + appends) // ps)
            for i, page in enumerate(table[b][:used]):
                if not 0 <= page < blocks:
                    raise ValueError(f"block_table[{b}, {i}] = {page} is not a page of the cache "
                                     f"(0..{blocks - 1}); sequence {b} uses its first {used} "
                                     "entries")
    if inp.cache_batch_idx is not None:
        rows = inp.k_cache.shape[0]
        for b, r in enumerate(inp.cache_batch_idx.tolist()):
            if not 0 <= r < rows:
                raise ValueError(f"cache_batch_idx[{b}] = {r} is not a row of the cache (0..{rows - 1})")


def seqlens_tensor(inp: DecodeInputs) -> torch.Tensor:
    """``cache_seqlens`` as an int32 device tensor (a Python int becomes a filled one)."""
    cs = inp.cache_seqlens
    if isinstance(cs, torch.Tensor):
        return cs
    return torch.full((inp.key.batch,), cs, dtype=torch.int32, device=inp.q.device)


def _positions(inp: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the new tokens go: (row or page index, slot) per (b, t), int64 ``(B, Nnew)``."""
    appends = inp.key.appends
    dev = inp.q.device
    pos = seqlens_tensor(inp).to(torch.int64)[:, None] + torch.arange(appends, device=dev)
    if inp.block_table is not None:
        ps = inp.page_size
        page = torch.gather(inp.block_table.to(torch.int64), 1,
                            (pos // ps).clamp_(max=inp.block_table.shape[1] - 1))
        return page, pos % ps
    if inp.cache_batch_idx is not None:
        rows = inp.cache_batch_idx.to(torch.int64)[:, None].expand_as(pos)
    else:
        rows = torch.arange(inp.key.batch, device=dev)[:, None].expand_as(pos)
    return rows, pos


def append_kv(inp: DecodeInputs) -> None:
    """Write ``k``/``v`` into the cache at ``cache_seqlens`` (torch indexing; the values must
    have been checked: :func:`check_values`). Several sequences must not write one slot."""
    if inp.k is None or inp.key.appends == 0:
        return
    rows, slots = _positions(inp)
    inp.k_cache[rows, slots] = inp.k
    inp.v_cache[rows, slots] = inp.v


def _gather_keys(inp: DecodeInputs, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's first ``length`` keys and values, ``(length, Hkv, D)``."""
    if inp.block_table is not None:
        ps = inp.page_size
        pages = inp.block_table[b, : -(-length // ps)].to(torch.int64)
        kk = inp.k_cache[pages].flatten(0, 1)[:length]
        vv = inp.v_cache[pages].flatten(0, 1)[:length]
        return kk, vv
    row = int(inp.cache_batch_idx[b]) if inp.cache_batch_idx is not None else b
    return inp.k_cache[row, :length], inp.v_cache[row, :length]


def _host_lengths(inp: DecodeInputs) -> list[int]:
    appends = inp.key.appends
    cs = inp.cache_seqlens
    if isinstance(cs, torch.Tensor):
        return [n + appends for n in cs.tolist()]
    return [cs + appends] * inp.key.batch


def _visible(nq: int, nk: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """Boolean (Nq, Nk): query i sees key j (bottom-right alignment, docs/FEATURES.md)."""
    i = torch.arange(nq, device=device)[:, None]
    j = torch.arange(nk, device=device)[None, :]
    diag = i + nk - nq
    ok = torch.ones(nq, nk, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def reference_decode(inp: DecodeInputs, math_dtype: torch.dtype = torch.float32,
                     return_lse: bool = False, out_dtype: torch.dtype | None = None):
    """The reference math: per sequence, the softmax over its visible keys in ``math_dtype``
    (float32 or float64; the tuner's check also runs it in the input dtype). Appends must
    already be done. Reads the lengths on the host. The output is in ``out_dtype`` (default:
    q's dtype)."""
    q = inp.q
    batch, nq, hq, d = q.shape
    hkv = inp.k_cache.shape[2]
    group = hq // hkv
    out = torch.zeros(batch, nq, hq, d, dtype=math_dtype, device=q.device)
    lse = torch.full((batch, hq, nq), -math.inf, dtype=torch.float32, device=q.device)
    for b, length in enumerate(_host_lengths(inp)):
        if length == 0:
            continue
        kk, vv = _gather_keys(inp, b, length)
        kk = kk.to(math_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, L, D)
        vv = vv.to(math_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
        qq = q[b].to(math_dtype).transpose(0, 1)  # (Hq, Nq, D)
        s = (qq @ kk.transpose(1, 2)) * inp.scale  # (Hq, Nq, L)
        if inp.softcap > 0:
            s = inp.softcap * torch.tanh(s / inp.softcap)
        if inp.alibi_slopes is not None:
            slopes = inp.alibi_slopes if inp.alibi_slopes.dim() == 1 else inp.alibi_slopes[b]
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(length, device=q.device)[None, :]
            dist = (i + length - nq - j).abs().to(math_dtype)
            s = s - slopes.to(math_dtype)[:, None, None] * dist
        ok = _visible(nq, length, inp.causal, inp.window, q.device)
        s = s.masked_fill(~ok, -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # (Hq, Nq)
        p = torch.exp(s - row_lse[..., None])
        p = torch.nan_to_num(p, nan=0.0)  # rows with no visible key
        out[b] = (p @ vv).transpose(0, 1)
        lse[b] = row_lse.float()
    out = out.to(out_dtype or q.dtype)
    return (out, lse) if return_lse else out


def sdpa_decode(inp: DecodeInputs, return_lse: bool = False):
    """PyTorch's SDPA on the sliced cache, what a caller would write: one call over the whole
    batch when every sequence has the same length and the cache is contiguous, else one per
    sequence (pages gathered first). Reads the lengths on the host (a sync)."""
    import torch.nn.functional as F

    if return_lse:
        raise ValueError("the torch decode path returns no log-sum-exp")
    q = inp.q
    batch, nq, hq, d = q.shape
    hkv = inp.k_cache.shape[2]
    lengths = _host_lengths(inp)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)

    def mask_for(length: int):
        if not inp.causal and inp.window == (-1, -1) and inp.alibi_slopes is None:
            return None
        if inp.alibi_slopes is None and inp.window == (-1, -1) and nq == 1:
            return None  # one causal query sees every key
        ok = _visible(nq, length, inp.causal, inp.window, q.device)
        return ok

    def run(qb, kb, vb, length, b):
        m = mask_for(length)
        if inp.alibi_slopes is not None:
            slopes = inp.alibi_slopes if inp.alibi_slopes.dim() == 1 else inp.alibi_slopes[b]
            i = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(length, device=q.device)[None, :]
            bias = -slopes[:, None, None] * (i + length - nq - j).abs().float()
            bias = bias.masked_fill(~m, -math.inf).to(q.dtype)
            m = bias
        return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, scale=inp.scale,
                                              enable_gqa=hq != hkv)

    uniform = (len(set(lengths)) == 1 and inp.block_table is None and inp.cache_batch_idx is None
               and (inp.alibi_slopes is None or inp.alibi_slopes.dim() == 1))
    if uniform and lengths[0] > 0:
        n = lengths[0]
        qb = q.transpose(1, 2)
        kb = inp.k_cache[:, :n].transpose(1, 2)
        vb = inp.v_cache[:, :n].transpose(1, 2)
        o = run(qb, kb, vb, n, 0)
        out.copy_(o.transpose(1, 2))
    else:
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            kk, vv = _gather_keys(inp, b, n)
            o = run(q[b : b + 1].transpose(1, 2), kk[None].transpose(1, 2),
                    vv[None].transpose(1, 2), n, b)
            out[b] = o[0].transpose(0, 1)
    if inp.causal and nq > 1:
        # rows that see no key (Nq > L): SDPA gives NaN there, the contract says 0
        out = torch.nan_to_num(out, nan=0.0)
    return out


# ---------------------------------------------------------------------------------------------
# choosing a path: the decode Problem through dispatch (the tuned records, the nearest, the
# default order), with an in-process memo in front


#: DecodeKey -> its Problem (the store's key; float32/float64 keys have none)
_problems: dict[DecodeKey, Problem] = {}
_PROBLEMS_MAX = 4096


def decode_problem(key: DecodeKey) -> Problem | None:
    """The :class:`~sparktune.problem.Problem` of op "decode" of a key, what the tuning store
    and dispatch know it by (``seqlen_q`` = Nq, ``seqlen_k`` = the cache-length bucket); None
    for float32/float64 inputs, which only the reference runs."""
    p = _problems.get(key)
    if p is None:
        if key.dtype not in ("float16", "bfloat16"):
            return None
        p = Problem(
            op="decode", dtype=key.dtype, batch=key.batch, heads_q=key.heads_q,
            heads_kv=key.heads_kv, seqlen_q=key.seqlen_q, seqlen_k=key.cache_len,
            head_dim=key.head_dim, causal=key.causal, window_left=key.window_left,
            window_right=key.window_right, softcap=key.softcap, alibi=key.alibi,
            page_size=key.page_size, appends=key.appends,
        )  # fmt: skip
        if len(_problems) >= _PROBLEMS_MAX:
            _problems.clear()
        _problems[key] = p
    return p


def decode_reasons(backend: str, key: DecodeKey, device: torch.device,
                   need_lse: bool = False, config: str | None = None) -> list[str]:
    """Why ``backend`` (with ``config``) cannot run ``key`` on ``device`` (empty: it can): the
    registered backend's answer for the decode Problem, and that the torch path returns no
    log-sum-exp."""
    if backend not in DECODE_BACKENDS:
        return [f"unknown decode backend {backend!r}; known: {', '.join(DECODE_BACKENDS)}"]
    problem = decode_problem(key)
    if problem is None:  # float32/float64: the reference math only
        if backend == "reference":
            return []
        return [f"{backend}: decode takes float16/bfloat16, got {key.dtype}"]
    from . import registry
    from ._plan import device_info

    try:
        b = registry.get_backend(backend)
    except Exception as exc:  # noqa: BLE001 - not registered in this process
        return [f"{backend}: {exc}"]
    reasons = [f"{backend}: {r}" for r in b.runnable_reasons(problem, config, device_info(device))]
    if need_lse and backend == "torch":
        reasons.append("torch: SDPA returns no log-sum-exp here")
    return reasons


@dataclass(frozen=True)
class DecodeChoice:
    """The path of a decode call and where it came from (dispatch's sources: "forced",
    "tuned", "nearest", "default"; "chosen" for :func:`set_decode_choice`)."""

    backend: str
    config: str | None
    source: str
    detail: str = ""


#: (key, device) -> (backend, config): in-process overrides (:func:`set_decode_choice`)
_chosen: dict[tuple[DecodeKey, str], tuple[str, str | None]] = {}
#: (key, device, need_lse) -> the choice; valid for dispatch's generation ``_memo_generation``
_memo: dict[tuple[DecodeKey, str, bool], DecodeChoice] = {}
_memo_generation = -1
#: (key, device, need_lse, backend, config) of forced choices found able to run the key
_forced_ok: set[tuple[DecodeKey, str, bool, str, str | None]] = set()


def set_decode_choice(key: DecodeKey, device: torch.device | str, backend: str,
                      config: str | None = None) -> None:
    """Make ``backend``/``config`` the choice for ``key`` on ``device`` in this process, over
    the tuned records (an in-process override; tuning stores records that dispatch reads)."""
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r}; known: {', '.join(DECODE_BACKENDS)}")
    _chosen[(key, str(torch.device(device)))] = (backend, config)
    _memo.clear()
    _plans.clear()


def _no_kernel(message: str) -> Exception:
    from .dispatch._resolve import NoKernelError

    return NoKernelError(message)


def choose_decode(key: DecodeKey, device: torch.device, need_lse: bool = False,
                  backend: str | None = None, config: str | None = None) -> DecodeChoice:
    """The path of one call: forced (``backend=``), else an in-process override, else
    dispatch's selection for the decode Problem (the tuned record of this device and build,
    the nearest tuned shape of the same kind, else the default order: Triton, SDPA on the
    sliced cache, the reference; on CPU tensors Triton under the interpreter, else the
    reference). A call that asks for the log-sum-exp never gets the torch path. Memoised per
    (key, device, need_lse) while dispatch's state is unchanged."""
    from . import dispatch

    global _memo_generation
    dev = str(device)
    dispatch.check_config_has_backend(backend, config)
    if backend is not None:
        forced_key = (key, dev, need_lse, backend, config)
        if forced_key not in _forced_ok:
            reasons = decode_reasons(backend, key, device, need_lse, config)
            if reasons:
                raise _no_kernel(f"backend {backend!r} cannot run {key.key()}: " + "; ".join(reasons))
            _forced_ok.add(forced_key)
        return DecodeChoice(backend, config, "forced", "asked for by the caller")
    if _memo_generation != dispatch.generation:
        _memo.clear()
        _memo_generation = dispatch.generation
    memo_key = (key, dev, need_lse)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    choice = None
    chosen = _chosen.get((key, dev))
    if chosen is not None and not decode_reasons(chosen[0], key, device, need_lse, chosen[1]):
        choice = DecodeChoice(chosen[0], chosen[1], "chosen", "set_decode_choice in this process")
    problem = decode_problem(key)
    if choice is None and problem is not None:
        from ._plan import device_info

        sel = dispatch.select(problem, device_info(device), count=False)
        if need_lse and sel.candidate.backend == "torch":
            # the torch path has no log-sum-exp: the first of the others that runs it
            for name in ("triton", "reference"):
                if not decode_reasons(name, key, device, True):
                    choice = DecodeChoice(name, None, "default",
                                          f"{sel.candidate.label} returns no log-sum-exp")
                    break
        else:
            choice = DecodeChoice(sel.candidate.backend, sel.candidate.config, sel.source, sel.detail)
    if choice is None:
        why = [r for name in DECODE_BACKENDS for r in decode_reasons(name, key, device, need_lse)]
        raise _no_kernel(f"no decode backend runs {key.key()}: " + "; ".join(why))
    _memo[memo_key] = choice
    return choice


def select_decode(key: DecodeKey, device: torch.device, need_lse: bool = False,
                  backend: str | None = None, config: str | None = None) -> tuple[str, str | None]:
    """(backend, config) of :func:`choose_decode`."""
    c = choose_decode(key, device, need_lse, backend, config)
    return c.backend, c.config


# ---------------------------------------------------------------------------------------------
# repeated calls: the checked plan of a call signature


class _Plan:
    """What a call worked out from its signature (every property of the inputs and arguments
    that :func:`check_kvcache` and the choice read): a later call with an equal signature
    passes the same checks and takes the same path, so it only rebuilds its
    :class:`DecodeInputs` around its own tensors and launches."""

    __slots__ = ("generation", "choice", "key", "causal", "scale", "window", "softcap",
                 "capacity", "page_size", "check", "launcher", "seqlens", "math_dtype")

    def __init__(self, generation: int, choice: DecodeChoice, inp: DecodeInputs, check: bool,
                 launcher: Any) -> None:
        self.generation = generation
        self.choice = choice
        self.key = inp.key
        self.causal, self.scale, self.window, self.softcap = inp.causal, inp.scale, inp.window, inp.softcap
        self.capacity, self.page_size = inp.capacity, inp.page_size
        self.check = check
        self.launcher = launcher
        #: an int cache_seqlens as a device tensor (the int is part of the signature), made by
        #: the first call of the plan outside a CUDA graph capture
        self.seqlens: torch.Tensor | None = None
        self.math_dtype = torch.float64 if inp.q.dtype == torch.float64 else torch.float32


#: call signature -> its plan
_plans: dict[tuple[Any, ...], _Plan] = {}
#: more distinct signatures than this start the table afresh
_PLANS_MAX = 4096


def _meta(t: Any) -> Any:
    """What the checks read of an optional tensor argument."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def _run(plan: _Plan, inp: DecodeInputs, return_lse: bool):
    choice = plan.choice
    name = choice.backend
    if name == "triton":  # kernels and empty outputs: nothing autograd records
        cs = inp.cache_seqlens
        if isinstance(cs, torch.Tensor):
            seqlens = cs
        else:
            seqlens = plan.seqlens
            if seqlens is None:
                seqlens = seqlens_tensor(inp)
                if inp.q.device.type != "cuda":
                    plan.seqlens = seqlens
                elif not torch.cuda.is_current_stream_capturing():
                    # kept for the later calls (on any stream): complete it now, once; a tensor
                    # made while a graph is captured is filled only when it replays: not kept
                    torch.cuda.current_stream(inp.q.device).synchronize()
                    plan.seqlens = seqlens
        return plan.launcher.run(inp, seqlens, return_lse)
    with torch.no_grad():
        append_kv(inp)
        if name == "torch":
            return sdpa_decode(inp, return_lse)
        math_dtype = plan.math_dtype
        if choice.config == "float64":
            math_dtype = torch.float64
        return reference_decode(inp, math_dtype, return_lse)


# ---------------------------------------------------------------------------------------------
# the public function


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor | int,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    return_lse: bool = False,
    check_bounds: bool | None = None,
    backend: str | None = None,
    config: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few query tokens against a KV cache (docs/DECODING.md), inference only.

    Args:
        q: ``(B, Nq, Hq, D)`` queries (Nq = 1 for plain decoding, a few for speculative).
        k_cache, v_cache: ``(B_cache, N_max, Hkv, D)``, or ``(num_blocks, page_size, Hkv, D)``
            with ``block_table``; updated in place when ``k``/``v`` are given.
        k, v: ``(B, Nnew, Hkv, D)`` new tokens, written at ``cache_seqlens`` before attending.
        cache_seqlens: int32 ``(B,)`` tensor, or an integer (Python's or NumPy's) for every
            sequence: the valid length of each cache before the append.
        block_table: int32 ``(B, max_blocks)`` page indices (paged cache).
        causal: bottom-right alignment (query ``i`` sees key ``j <= i + L - Nq``).
        scale, window, softcap, alibi_slopes: as ``sparktune.attention`` (docs/FEATURES.md).
        cache_batch_idx: int32 ``(B,)``: the cache row of each sequence (contiguous cache).
        return_lse: also return the float32 ``(B, Hq, Nq)`` natural log-sum-exp.
        check_bounds: check the device-resident values on the host (lengths within the
            capacity, pages and rows within the cache). ``None`` (default): check where it costs
            no device sync (CPU tensors, or a path that reads the lengths anyway); the Triton
            path then clamps every index so that a bad value never reads or writes outside the
            cache. ``True``: always check (one sync). ``False``: never.
        backend, config: force a decode path (``"triton"``, ``"torch"``, ``"reference"``) and
            its config (a Triton decode config name, ``"auto"`` for torch, ``"float32"`` or
            ``"float64"`` for the reference's math).

    Returns:
        ``(B, Nq, Hq, D)`` in q's dtype (and the lse when asked).
    """
    if torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k_cache, "requires_grad", False)
        or getattr(v_cache, "requires_grad", False) or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False)
    ):
        raise ValueError("attention_with_kvcache is inference only: no autograd (call it under "
                         "torch.no_grad() or with tensors that do not require grad)")
    if (
        type(cache_seqlens) is not int and not isinstance(cache_seqlens, torch.Tensor)
        and _is_integral(cache_seqlens)
    ):
        cache_seqlens = int(cache_seqlens)  # a NumPy integer: as a Python int
    from . import dispatch

    try:  # what the checks and the choice read: shapes, strides, dtypes, devices, arguments
        sig = (
            q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
            k_cache.dtype, k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype,
            v_cache.device, _meta(k), _meta(v), type(cache_seqlens),
            cache_seqlens if type(cache_seqlens) is int else _meta(cache_seqlens),
            _meta(block_table), _meta(cache_batch_idx), _meta(alibi_slopes), causal,
            type(scale), scale, type(window), window, type(softcap), softcap, return_lse,
            check_bounds, backend, config, k_cache.data_ptr() == v_cache.data_ptr(),
        )  # fmt: skip
        plan = _plans.get(sig)
    except Exception:  # noqa: BLE001 - not tensors, or unhashable arguments: checked below
        sig = plan = None
    if plan is not None and plan.generation == dispatch.generation:
        inp = DecodeInputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx,
                           plan.causal, plan.scale, plan.window, plan.softcap, alibi_slopes,
                           plan.capacity, plan.page_size, plan.key)
        if plan.check:
            check_values(inp)
        counts = dispatch._counts
        if plan.choice.source in counts:
            counts[plan.choice.source] += 1
        return _run(plan, inp, return_lse)

    inp = check_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        cache_batch_idx=cache_batch_idx, reference_dtypes=backend == "reference",
    )
    generation = dispatch.generation
    choice = choose_decode(inp.key, q.device, return_lse, backend, config)
    name = choice.backend
    if choice.source in dispatch._counts:
        dispatch._counts[choice.source] += 1
    host_reads = name != "triton"  # the torch and reference paths read the lengths anyway
    check = bool(check_bounds or (check_bounds is None and (q.device.type == "cpu" or host_reads)))
    if check:
        check_values(inp)
    launcher = None
    if name == "triton":
        from .kernels import triton_decode

        launcher = triton_decode.DecodeLauncher(inp, choice.config)
    plan = _Plan(generation, choice, inp, check, launcher)
    if sig is not None:
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[sig] = plan
    return _run(plan, inp, return_lse)
