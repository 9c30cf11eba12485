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

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

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
    "DECODE_BACKENDS",
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


def _int32_vector(t: object, name: str, length: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},) (one per sequence), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}: they must share a device")
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
    if batch < 1 or nq < 1 or hq < 1:
        raise ValueError(f"q must not be empty, got shape {tuple(q.shape)}")
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
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    scale = float(scale)
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(_is_int(w) and w >= -1 for w in window)):
        raise ValueError(f"window must be a pair of ints >= -1 (-1: unlimited), got {window!r}")
    left, right = int(window[0]), int(window[1])
    if causal:
        right = -1
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (
        math.isfinite(softcap) and softcap >= 0
    ):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
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
                     return_lse: bool = False):
    """The reference math: per sequence, the softmax over its visible keys in ``math_dtype``
    (float32 or float64). Appends must already be done. Reads the lengths on the host."""
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
    out = out.to(q.dtype)
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
# choosing a path


@functools.cache
def _triton_unavailable() -> tuple[str, ...]:
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return (f"triton is not importable ({type(e).__name__}: {e})",)
    return ()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def decode_reasons(backend: str, key: DecodeKey, device: torch.device,
                   need_lse: bool = False) -> list[str]:
    """Why ``backend`` cannot run ``key`` on ``device`` (empty: it can)."""
    reasons: list[str] = []
    if backend == "reference":
        return reasons
    if backend == "torch":
        if key.softcap:
            reasons.append("torch: SDPA has no softcap")
        if need_lse:
            reasons.append("torch: SDPA returns no log-sum-exp here")
        if key.dtype not in ("float16", "bfloat16"):
            reasons.append(f"torch: decode takes float16/bfloat16, got {key.dtype}")
        return reasons
    if backend == "triton":
        from .kernels import triton_decode

        reasons.extend(_triton_unavailable())
        interpret = triton_decode.INTERPRET if not reasons else False
        if device.type != "cuda" and not interpret:
            reasons.append(f"triton: runs on CUDA devices (or under TRITON_INTERPRET=1), "
                           f"got {device.type}")
        elif device.type == "cuda" and _capability(device.index or 0) < (8, 0):
            reasons.append("triton: decode kernels need sm_80 or later")
        if not reasons:
            reasons.extend(triton_decode.not_supported_reasons(key))
        return reasons
    return [f"unknown decode backend {backend!r}; known: {', '.join(DECODE_BACKENDS)}"]


#: (key, device) -> (backend, config), the per-process choice (set by tuning or by hand)
_chosen: dict[tuple[DecodeKey, str], tuple[str, str | None]] = {}
#: (key, device, need_lse) -> (backend, config), the memo of resolved defaults
_memo: dict[tuple[DecodeKey, str, bool], tuple[str, str | None]] = {}
#: (key, device, need_lse, backend) of forced backends found able to run the key
_forced_ok: set[tuple[DecodeKey, str, bool, str]] = set()


def set_decode_choice(key: DecodeKey, device: torch.device | str, backend: str,
                      config: str | None = None) -> None:
    """Make ``backend``/``config`` the choice for ``key`` on ``device`` in this process (what a
    tuning run of decode problems records)."""
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r}; known: {', '.join(DECODE_BACKENDS)}")
    _chosen[(key, str(torch.device(device)))] = (backend, config)
    _memo.clear()


def select_decode(key: DecodeKey, device: torch.device, need_lse: bool = False,
                  backend: str | None = None, config: str | None = None) -> tuple[str, str | None]:
    """The (backend, config) for one call: forced, else the recorded choice, else the first of
    :data:`DECODE_BACKENDS` that can run it (Triton with its default rule on sm_80+, SDPA on
    other GPUs, the reference on CPU). A dict lookup after the first call of a key."""
    if backend is not None:
        forced_key = (key, str(device), need_lse, backend)
        if forced_key not in _forced_ok:
            reasons = decode_reasons(backend, key, device, need_lse)
            if reasons:
                from .dispatch._resolve import NoKernelError

                raise NoKernelError(f"backend {backend!r} cannot run {key.key()}: "
                                    + "; ".join(reasons))
            _forced_ok.add(forced_key)
        return backend, config
    memo_key = (key, str(device), need_lse)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    chosen = _chosen.get((key, str(device)))
    if chosen is not None and not decode_reasons(chosen[0], key, device, need_lse):
        _memo[memo_key] = chosen
        return chosen
    why = []
    order = DECODE_BACKENDS if device.type == "cuda" else ("triton", "reference")
    for name in order:
        reasons = decode_reasons(name, key, device, need_lse)
        if not reasons:
            _memo[memo_key] = (name, None)
            return name, None
        why.extend(reasons)
    from .dispatch._resolve import NoKernelError

    raise NoKernelError(f"no decode backend runs {key.key()}: " + "; ".join(why))


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
        cache_seqlens: int32 ``(B,)`` tensor, or an int: the valid length of each cache
            before the append.
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
        backend, config: force a decode path (``"triton"``, ``"torch"``, ``"reference"``).

    Returns:
        ``(B, Nq, Hq, D)`` in q's dtype (and the lse when asked).
    """
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)
    ):
        raise ValueError("attention_with_kvcache is inference only: no autograd (call it under "
                         "torch.no_grad() or with tensors that do not require grad)")
    inp = check_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        cache_batch_idx=cache_batch_idx, reference_dtypes=backend == "reference",
    )
    name, cfg = select_decode(inp.key, q.device, return_lse, backend, config)
    host_reads = name != "triton"  # the torch and reference paths read the lengths anyway
    if check_bounds or (check_bounds is None and (q.device.type == "cpu" or host_reads)):
        check_values(inp)
    with torch.no_grad():
        if name == "triton":
            from .kernels import triton_decode

            return triton_decode.decode(inp, config=cfg, return_lse=return_lse)
        append_kv(inp)
        if name == "torch":
            return sdpa_decode(inp, return_lse)
        math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return reference_decode(inp, math_dtype, return_lse)
