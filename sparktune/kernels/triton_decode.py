"""Split-KV decoding in Triton (flash-decoding): a few query tokens against a long KV cache.

Three kernels:

- ``_append_kernel`` writes the new keys and values at ``cache_seqlens`` (contiguous or paged),
  masked so that a position past the capacity, a page index outside the cache or a cache row
  outside it is never written (nothing is written for such a token).
- ``_decode_kernel``: grid ``(splits, batch * heads_kv)``. One program holds every query row of
  one kv head's GQA group (``group * Nq`` rows, padded to a tile of at least 16) and streams its
  share of the sequence's visible keys in tiles of ``BLOCK_N``, so each K/V tile is read once
  for the whole group. The keys ``[lo, L)`` (``L = cache_seqlens[b] + Nnew`` clamped to the
  capacity, ``lo`` the window's first key) are cut into ``splits`` chunks of whole tiles; a
  program past the end writes an empty partial. Paged caches: each key's page is read from
  the block table per tile (clamped into the cache). With one split the program writes the
  output directly; otherwise it writes a float32 partial output and its base-2 log-sum-exp.
- ``_combine_kernel`` merges the partials of one query row (a chunk of its head dim per
  program, all splits loaded at once): weights
  ``2^(lse_s - max)``, output ``sum w_s o_s / sum w_s``, lse ``max + log2(sum w)``.

On sm_90 and later the three are launched with programmatic dependent launch (``PDL``): each
kernel may be scheduled while the kernel before it in the stream finishes, and waits
(``griddepcontrol.wait``) before its first memory access until that kernel has completed and
its writes are visible; the split-KV kernel lets the combine kernel be scheduled at once, so
that the combine's launch overlaps the split-KV kernel instead of following it.

Scores are base 2 as in :mod:`triton_attn` (``qk_scale = scale * log2 e``); softcap and ALiBi
follow docs/FEATURES.md. A row with no visible key gives 0 and lse ``-inf``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_attn import _LN2, _LOG2E, INTERPRET, LOG2E, _tanh

try:  # programmatic dependent launch (sm_90 and later; Triton 3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without them: PDL stays off (_pdl_for)
    gdc_launch_dependents = gdc_wait = None

try:  # the launch hooks the direct launch checks (_Launch)
    from triton import knobs as _knobs
except ImportError:  # a Triton without them: every launch goes through JITFunction.run
    _knobs = None
from .triton_decode_space import (
    DecodeConfig,
    blocks_per_sm,
    default_decode_config,
    num_splits,
    parse_decode_config,
    problem_reasons,
)

__all__ = ["DecodeLauncher", "decode", "not_supported_reasons", "INTERPRET", "splits_for"]

#: head-dim columns per program of the combine kernel (more programs for small batches)
_COMBINE_DC = 64


@triton.jit
def _append_kernel(Knew, Vnew, Kc, Vc, Seqlens, Table, BatchIdx,
                   stride_nb, stride_nn, stride_nh, stride_wb, stride_wn, stride_wh,
                   stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_tb,
                   heads_kv, capacity, cache_rows, max_blocks,
                   PAGE_SIZE: tl.constexpr, BATCH_IDX: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # nothing is read or written before the kernel before this one has completed
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    t = tl.program_id(1)
    pos = tl.load(Seqlens + b) + t
    ok = (pos >= 0) & (pos < capacity)
    pos = tl.minimum(tl.maximum(pos, 0), capacity - 1)
    if PAGE_SIZE > 0:
        blk = pos // PAGE_SIZE
        page = tl.load(Table + b * stride_tb + blk)
        ok = ok & (page >= 0) & (page < cache_rows)
        page = tl.minimum(tl.maximum(page, 0), cache_rows - 1)
        k_off = page.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_kn
        v_off = page.to(tl.int64) * stride_vb + (pos % PAGE_SIZE) * stride_vn
    else:
        if BATCH_IDX:
            row = tl.load(BatchIdx + b)
            ok = ok & (row >= 0) & (row < cache_rows)
            row = tl.minimum(tl.maximum(row, 0), cache_rows - 1)
        else:
            row = b
        k_off = row.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kn
        v_off = row.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vn
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    mask = ok & (hs[:, None] < heads_kv) & (ds[None, :] < HEAD_DIM)
    kn = tl.load(Knew + b * stride_nb + t * stride_nn + hs[:, None] * stride_nh + ds[None, :],
                 mask=mask, other=0.0)
    vn = tl.load(Vnew + b * stride_wb + t * stride_wn + hs[:, None] * stride_wh + ds[None, :],
                 mask=mask, other=0.0)
    tl.store(Kc + k_off + hs[:, None] * stride_kh + ds[None, :], kn, mask=mask)
    tl.store(Vc + v_off + hs[:, None] * stride_vh + ds[None, :], vn, mask=mask)


@triton.jit(do_not_specialize=["n_append", "seqlen_q", "group", "win_left", "win_right",
                               "num_splits", "stride_ab"])
def _decode_kernel(Q, K, V, Seqlens, Table, BatchIdx, Slopes, Out, Ws,
                   stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                   stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
                   stride_tb, stride_ab, ws_opart, ws_lpart,
                   n_append, seqlen_q, group, heads_kv, capacity, cache_rows, max_blocks,
                   qk_scale, cap_in, cap_out, win_left, win_right, num_splits,
                   PAGE_SIZE: tl.constexpr, BATCH_IDX: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, SOFTCAP: tl.constexpr,
                   ALIBI: tl.constexpr, SPLIT: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:  # (the combine kernel, launched after this one, is scheduled at once and waits)
        gdc_wait()
        gdc_launch_dependents()
    split = tl.program_id(0)
    bh = tl.program_id(1)
    Lse = Ws  # the float32 workspace: the lse, then the partial outputs and their lse
    Opart = Ws + ws_opart
    Lpart = Ws + ws_lpart
    b = bh // heads_kv
    hk = bh % heads_kv
    L = tl.load(Seqlens + b) + n_append
    L = tl.minimum(tl.maximum(L, 0), capacity)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < group * seqlen_q
    qi = rows % seqlen_q
    h = hk * group + rows // seqlen_q
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < HEAD_DIM
    q = tl.load(Q + b * stride_qb + qi[:, None] * stride_qn + h[:, None] * stride_qh + ds[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    diag = qi + L - seqlen_q

    lo = 0
    if WINDOW_L:
        # the window's first key, rounded down to a whole tile (the mask hides the keys before
        # it), so that every tile starts at a multiple of BLOCK_N
        lo = (tl.maximum(L - seqlen_q - win_left, 0) // BLOCK_N) * BLOCK_N
    hi = L
    span = tl.maximum(hi - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    if ALIBI:
        slope2 = tl.load(Slopes + b * stride_ab + h, mask=row_ok, other=0.0) * _LOG2E
    if BATCH_IDX:
        row = tl.load(BatchIdx + b)
        row = tl.minimum(tl.maximum(row, 0), cache_rows - 1)
    else:
        row = b
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        kj = start_n + tl.arange(0, BLOCK_N)
        k_ok = kj < end
        if PAGE_SIZE >= BLOCK_N and PAGE_SIZE % BLOCK_N == 0:
            # a tile lies in one page: one table read per tile, contiguous rows within it
            blk = start_n // PAGE_SIZE
            page = tl.load(Table + b * stride_tb + tl.minimum(blk, max_blocks - 1))
            page = tl.minimum(tl.maximum(page, 0), cache_rows - 1).to(tl.int64)
            slot = kj - blk * PAGE_SIZE
            k_off = page * stride_kb + slot * stride_kn
            v_off = page * stride_vb + slot * stride_vn
        elif PAGE_SIZE > 0:
            blk = kj // PAGE_SIZE
            page = tl.load(Table + b * stride_tb + blk, mask=k_ok & (blk < max_blocks), other=0)
            page = tl.minimum(tl.maximum(page, 0), cache_rows - 1).to(tl.int64)
            slot = kj % PAGE_SIZE
            k_off = page * stride_kb + slot * stride_kn
            v_off = page * stride_vb + slot * stride_vn
        else:
            # the keys as segments of 4 tiles, addressed like pages: the first key of the tile's
            # segment, then the tile's keys relative to it. (Addressed from the tile's own first
            # key, or per key, the compiler keeps the loop's loads' addresses in registers:
            # 105 a thread against 72 for sm_90, 4 blocks an SM instead of 7, and at batch 8 the
            # grid of the default split rule needed a second wave: 0.79x the paged cache's
            # bandwidth on an H200.)
            seg = start_n // (4 * BLOCK_N)
            slot = kj - seg * (4 * BLOCK_N)
            first = tl.cast(seg, tl.int64) * (4 * BLOCK_N)
            k_off = row.to(tl.int64) * stride_kb + first * stride_kn + slot * stride_kn
            v_off = row.to(tl.int64) * stride_vb + first * stride_vn + slot * stride_vn
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + k_off[:, None] + ds[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_off[:, None] + ds[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            s = _tanh(qk * cap_in) * cap_out
        else:
            s = qk * qk_scale
        if ALIBI:
            dist = tl.abs(diag[:, None] - kj[None, :]).to(tl.float32)
            s = s - slope2[:, None] * dist
        mask = k_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            mask = mask & (kj[None, :] <= diag[:, None])
        if WINDOW_L:
            mask = mask & (kj[None, :] >= diag[:, None] - win_left)
        if WINDOW_R:
            mask = mask & (kj[None, :] <= diag[:, None] + win_right)
        s = tl.where(mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if SPLIT:
        part = (bh * num_splits + split) * BLOCK_M + rows
        tl.store(Opart + part[:, None] * BLOCK_D + ds[None, :], o, mask=row_ok[:, None])
        tl.store(Lpart + part, lse2, mask=row_ok)
    else:
        tl.store(Out + b * stride_ob + qi[:, None] * stride_on + h[:, None] * stride_oh + ds[None, :],
                 o.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + (b * heads_kv * group + h) * seqlen_q + qi, lse2 * _LN2,
                 mask=row_ok)


@triton.jit(do_not_specialize=["seqlen_q", "group", "num_splits"])
def _combine_kernel(Ws, Out, stride_ob, stride_on, stride_oh, ws_opart, ws_lpart, seqlen_q,
                    group, heads_kv, num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
                    PDL: tl.constexpr):
    """Grid (batch * heads_kv, group * Nq, BLOCK_D // BLOCK_DC): one program merges one query
    row's chunk of the head dim over all splits at once (the first chunk writes the lse)."""
    if PDL:  # the split-KV kernel's partials are complete and visible past this wait
        gdc_wait()
    Lse = Ws
    Opart = Ws + ws_opart
    Lpart = Ws + ws_lpart
    bh = tl.program_id(0)
    r = tl.program_id(1)
    dc = tl.program_id(2)
    b = bh // heads_kv
    hk = bh % heads_kv
    qi = r % seqlen_q
    h = hk * group + r // seqlen_q
    ss = tl.arange(0, BLOCK_S)
    s_ok = ss < num_splits
    part = (bh * num_splits + ss) * BLOCK_M + r
    ls = tl.load(Lpart + part, mask=s_ok, other=float("-inf"))
    m = tl.max(ls, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(ls - m_safe)
    total = tl.sum(w, 0)
    ds = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
    o = tl.load(Opart + part[:, None] * BLOCK_D + ds[None, :], mask=s_ok[:, None], other=0.0)
    seen = total > 0.0
    o = tl.sum(w[:, None] * o, 0) / tl.where(seen, total, 1.0)
    tl.store(Out + b * stride_ob + qi * stride_on + h * stride_oh + ds, o.to(Out.dtype.element_ty),
             mask=ds < HEAD_DIM)
    if dc == 0:
        lse2 = tl.where(seen, m_safe + tl.math.log2(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(Lse + (b * heads_kv * group + h) * seqlen_q + qi, lse2 * _LN2)


def not_supported_reasons(key) -> list[str]:
    """Why the kernels cannot run a :class:`sparktune._kvcache.DecodeKey` (empty: they can)."""
    return problem_reasons(key)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


#: whether plans made from now on launch their kernels with programmatic dependent launch where
#: the GPU has it (sm_90 and later; see the module's docstring); False: plain stream order
PDL = True


def _pdl_for(device: torch.device) -> bool:
    """Whether a plan on ``device`` launches with programmatic dependent launch."""
    return (PDL and not INTERPRET and gdc_wait is not None and device.type == "cuda"
            and torch.cuda.get_device_properties(device).major >= 9)


def _launch_pdl(pdl: bool) -> dict:
    """The launch option of a plan's kernels (only where it is on: the interpreter takes none)."""
    return {"launch_pdl": True} if pdl else {}


#: whether a plan's later launches may call the compiled kernel directly (see :class:`_Launch`);
#: False sends every launch through ``JITFunction.run`` (the GPU test compares the two)
DIRECT_LAUNCH = True


def _hook_idle(hook) -> bool:
    """True when a Triton launch hook is unset: ``None`` (older releases) or a ``HookChain``
    with no function in it (Triton 3.6: the knob is a chain object, never ``None``)."""
    if hook is None:
        return True
    calls = getattr(hook, "calls", None)
    return isinstance(calls, list) and not calls


def _current_device() -> int:
    """The current CUDA device's index, without torch.cuda's lazy-init wrapper (a plan's first
    launch has initialised CUDA already)."""
    get = getattr(torch._C, "_cuda_getDevice", None)
    return get() if get is not None else torch.cuda.current_device()


def _direct_stream(device: int | None):
    """The raw current stream of ``device`` when a plan's launches may call their compiled
    kernels directly now (the switch on, no launch hook set, ``device`` current), else None.
    Asked once a call, for all of its launches."""
    if not DIRECT_LAUNCH or _knobs is None or INTERPRET or device is None:
        return None
    rt = _knobs.runtime
    if not (_hook_idle(rt.launch_enter_hook) and _hook_idle(rt.launch_exit_hook)):
        return None
    if _current_device() != device:
        return None
    return torch._C._cuda_getCurrentRawStream(device)


class _Launch:
    """One kernel launch of a plan: ``fn[grid](*tensors, *scalars, **kw)``, with the call's
    own tensors. The first launch goes through Triton's ``JITFunction.run`` (binding the
    arguments, the specialisation key, compiling or finding the kernel) and keeps the
    ``CompiledKernel`` it returns; later launches call that kernel's launcher with the argument
    list ``JITFunction.run`` would build (the tensors, the plan's scalars, the compile-time
    constants in parameter order) while

    - every tensor has the 16-byte alignment of the first launch (Triton specialises on it; the
      scalars are the plan's and never change). Only the first ``checked`` tensors are looked
      at: the others are the plan's own fresh allocations, which torch's allocator aligns to
      far more than 16 bytes;
    - no launch hook is set (profilers such as Proton install one) and
    - the current device is the plan's (these two: :func:`_direct_stream`, once a call).

    Anything else, Triton's interpreter, or a Triton whose objects do not look as expected,
    takes ``JITFunction.run`` again. ``direct`` counts the direct launches (the GPU test checks
    that they happen and that they give the JIT path's bits)."""

    __slots__ = ("fn", "grid", "grid3", "scalars", "kw", "tail", "compiled", "aligned", "device",
                 "direct", "checked")

    def __init__(self, fn, grid, scalars, kw, device: torch.device, checked: int | None = None) -> None:
        self.fn, self.grid, self.scalars, self.kw = fn, tuple(grid), tuple(scalars), kw
        self.grid3 = (*self.grid, 1, 1)[:3]  # the launcher takes x, y and z
        # the constexpr parameters' values, when they are the kernel's last parameters in the
        # order of its signature (what Triton's binder hands the launcher after the others)
        names = list(getattr(fn, "arg_names", ()) or ())
        consts = [n for n in names if n in kw]
        tail_ok = bool(names) and names[len(names) - len(consts):] == consts
        self.tail = tuple(kw[n] for n in consts) if tail_ok else None
        self.compiled = None
        self.aligned: tuple[bool, ...] | None = None
        self.device = device.index if device.type == "cuda" else None
        self.direct = 0
        self.checked = checked

    def __call__(self, *tensors) -> None:
        self.go(_direct_stream(self.device) if self.compiled is not None else None, tensors)

    def go(self, stream, tensors: tuple) -> None:
        """Launch on ``tensors``; ``stream``: :func:`_direct_stream`'s answer for this call."""
        c = self.compiled
        if c is not None and stream is not None and tuple(
                t.data_ptr() % 16 == 0 for t in tensors[:self.checked]) == self.aligned:
            g = self.grid3
            c.run(g[0], g[1], g[2], stream, c.function, c.packed_metadata, None, None, None,
                  *tensors, *self.scalars, *self.tail)
            self.direct += 1
            return
        k = self.fn[self.grid](*tensors, *self.scalars, **self.kw)
        if (c is None and not INTERPRET and _knobs is not None and self.tail is not None
                and self.device is not None
                and len(tensors) + len(self.scalars) + len(self.tail) == len(self.fn.arg_names)
                and all(hasattr(k, a) for a in ("run", "function", "packed_metadata"))
                and hasattr(torch._C, "_cuda_getCurrentRawStream")):
            self.compiled = k
            self.aligned = tuple(t.data_ptr() % 16 == 0 for t in tensors[:self.checked])


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few "SMs" so that tests exercise several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(cfg: DecodeConfig, key, device: torch.device, capacity: int,
               per_sm: int | None = None) -> int:
    return num_splits(cfg, key.batch, key.heads_kv, _sm_count(device), capacity, per_sm)


def _occupancy(compiled, device: torch.device) -> int | None:
    """Programs of a compiled Triton kernel one SM of ``device`` holds at once, or None where
    that is not known (the interpreter; a Triton whose kernel object does not say)."""
    if compiled is None or device.type != "cuda":
        return None
    try:
        n_regs = int(compiled.n_regs)
        warps = int(compiled.metadata.num_warps)
        shared = int(compiled.metadata.shared)
    except (AttributeError, TypeError, ValueError):
        return None
    props = torch.cuda.get_device_properties(device)
    return blocks_per_sm(
        n_regs, warps, shared,
        regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
        threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048),
        smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 233472),
    )


@functools.lru_cache(maxsize=256)
def _config(name: str | None, head_dim: int) -> DecodeConfig:
    return parse_decode_config(name or default_decode_config(head_dim))


class DecodeLauncher:
    """The launches of one call signature (shapes, strides, dtypes, devices, options: what
    :func:`sparktune._kvcache.check_kvcache` read), worked out once: the config, the number of
    splits, the grids, the scalar arguments and the compile-time constants. ``run(inp)``
    then allocates the outputs and launches the kernels with the call's tensors only."""

    __slots__ = ("batch", "nq", "hq", "splits", "block_m", "block_d", "ws_size", "lse_shape",
                 "dev_index", "has_table", "has_bidx", "has_slopes", "appends", "dev", "launches",
                 "cfg", "fitted", "pdl")

    def __init__(self, inp, config: str | None = None) -> None:
        self.cfg = _config(config, inp.key.head_dim)
        # the split rule's count until the kernel's occupancy is known (after its first launch,
        # see run): then whole waves (triton_decode_space.num_splits)
        self.fitted = False
        self._build(inp, splits_for(self.cfg, inp.key, inp.q.device, inp.capacity))

    def _build(self, inp, splits: int) -> None:
        key = inp.key
        cfg = self.cfg
        q, kc, vc = inp.q, inp.k_cache, inp.v_cache
        batch, nq, hq, d = q.shape
        hkv = key.heads_kv
        group = key.group_size
        dev = q.device
        table = inp.block_table
        bidx = inp.cache_batch_idx
        slopes = inp.alibi_slopes
        block_d = _pow2(d)
        self.batch, self.nq, self.hq, self.dev = batch, nq, hq, dev
        self.has_table, self.has_bidx, self.has_slopes = table is not None, bidx is not None, slopes is not None
        self.appends = key.appends
        self.block_d = block_d
        t_stride = table.stride(0) if table is not None else 0
        t_blocks = table.shape[1] if table is not None else 1
        pdl = _pdl_for(dev)
        self.pdl = pdl
        append = None
        if key.appends:
            kn, vn = inp.k, inp.v
            append = _Launch(
                _append_kernel, (batch, key.appends),
                (kn.stride(0), kn.stride(1), kn.stride(2), vn.stride(0), vn.stride(1), vn.stride(2),
                 kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                 t_stride, hkv, inp.capacity, kc.shape[0], t_blocks),
                dict(PAGE_SIZE=inp.page_size, BATCH_IDX=bidx is not None, HEAD_DIM=d,
                     BLOCK_H=_pow2(hkv, 1), BLOCK_D=block_d, PDL=pdl, num_warps=1,
                     **_launch_pdl(pdl)),
                dev,
            )
        block_m = _pow2(group * nq)
        self.splits, self.block_m = splits, block_m
        # one float32 workspace a call: the lse (B, Hq, Nq), then (split) the partial outputs
        # and their lse, each part starting on a multiple of 16 elements
        lse_n = batch * hq * nq
        ws_opart = -(-lse_n // 16) * 16
        ws_lpart = ws_opart + -(-(batch * hkv * splits * block_m * block_d) // 16) * 16
        self.ws_size = ws_lpart + batch * hkv * splits * block_m if splits > 1 else lse_n
        self.lse_shape = (batch, hq, nq)
        self.dev_index = dev.index if dev.type == "cuda" else None
        left, right = inp.window
        softcap = inp.softcap
        scale = inp.scale
        # out is allocated dense in q's shape: its strides are those of a contiguous tensor
        o_strides = (nq * hq * d, hq * d, d)
        decode = _Launch(
            _decode_kernel, (splits, batch * hkv),
            (q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
             vc.stride(0), vc.stride(1), vc.stride(2), *o_strides, t_stride,
             slopes.stride(0) if slopes is not None and slopes.dim() == 2 else 0,
             ws_opart, ws_lpart, key.appends, nq, group, hkv, inp.capacity, kc.shape[0], t_blocks,
             scale * LOG2E, (scale / softcap) if softcap > 0 else 0.0, softcap * LOG2E,
             left, right, splits),
            dict(PAGE_SIZE=inp.page_size, BATCH_IDX=bidx is not None, CAUSAL=inp.causal,
                 WINDOW_L=left >= 0, WINDOW_R=right >= 0, SOFTCAP=softcap > 0,
                 ALIBI=slopes is not None, SPLIT=splits > 1, HEAD_DIM=d, BLOCK_D=block_d,
                 BLOCK_M=block_m, BLOCK_N=cfg.block_n, PDL=pdl, num_warps=cfg.warps,
                 num_stages=cfg.stages, **_launch_pdl(pdl)),
            dev, checked=7,  # the call's tensors; then out and the workspace
        )
        combine = None
        if splits > 1:
            block_dc = min(block_d, _COMBINE_DC)
            combine = _Launch(
                _combine_kernel, (batch * hkv, group * nq, block_d // block_dc),
                (*o_strides, ws_opart, ws_lpart, nq, group, hkv, splits),
                dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_S=_pow2(splits, 2),
                     BLOCK_DC=block_dc, PDL=pdl, num_warps=4, **_launch_pdl(pdl)),
                dev, checked=0,  # the workspace and out only
            )
        #: (append or None, split-KV, combine or None)
        self.launches = (append, decode, combine)

    def run(self, inp, seqlens: torch.Tensor, return_lse: bool = False):
        """Launch on a call of this signature (``seqlens``: its int32 lengths on the device)."""
        q = inp.q
        dev = self.dev
        table = inp.block_table if self.has_table else seqlens
        bidx = inp.cache_batch_idx if self.has_bidx else seqlens
        append, decode, combine = self.launches
        stream = _direct_stream(self.dev_index) if decode.compiled is not None else None
        if append is not None:
            append.go(stream, (inp.k, inp.v, inp.k_cache, inp.v_cache, seqlens, table, bidx))
        out = torch.empty(q.shape, dtype=q.dtype, device=dev)
        ws = torch.empty(self.ws_size, dtype=torch.float32, device=dev)
        decode.go(stream, (q, inp.k_cache, inp.v_cache, seqlens, table, bidx,
                           inp.alibi_slopes if self.has_slopes else seqlens, out, ws))
        if combine is not None:
            combine.go(stream, (ws, out))
        if not self.fitted:
            self._fit(inp, decode)
        if return_lse:
            return out, ws[: self.batch * self.hq * self.nq].view(self.lse_shape)
        return out

    def _fit(self, inp, decode: _Launch) -> None:
        """Once, after the first launch: the split count for the compiled kernel's occupancy.
        A different count rebuilds the launches (the next call compiles the kernel again only
        where one split replaces several: its SPLIT constant changes)."""
        self.fitted = True
        per_sm = _occupancy(decode.compiled, self.dev)
        if per_sm is None:
            return
        splits = splits_for(self.cfg, inp.key, self.dev, inp.capacity, per_sm)
        if splits != self.splits:
            self._build(inp, splits)


def decode(inp, *, config: str | None = None, return_lse: bool = False):
    """Run a checked :class:`sparktune._kvcache.DecodeInputs`: append, split-KV, combine."""
    from .._kvcache import seqlens_tensor

    return DecodeLauncher(inp, config).run(inp, seqlens_tensor(inp), return_lse)
