"""FlashAttention-2 in Triton: forward, and backward with a separate dQ pass or atomic dQ.

Layout contract: tensors are (batch, heads, seqlen, head_dim) views with any batch/head/row
strides and a contiguous last dimension; the kernels take the three strides of each tensor.
Log-sum-exp and the backward's row sums are float32, contiguous (batch, heads_q, seqlen_q).

Masking: the key loops are split into blocks every row of the tile sees completely (no mask
work at all) and the few blocks on the causal diagonal or past the end of the sequence (masked).
Causal masks are aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
A row that sees no key has output 0, log-sum-exp -inf and zero gradients.

Scores are kept in base 2: ``qk_scale = scale * log2(e)`` folds the softmax scale into the
exponent, and only the stored log-sum-exp is converted back to natural log.

Features (docs/FEATURES.md), each a constexpr switch, so that the plain kernels compile to the
code they had before the features existed:

- WINDOW: a band ``d(i) - left <= j <= d(i) + right`` (``d(i) = i + seqlen_k - seqlen_q``).
  The loops run over the blocks of the band only (unmasked inside it, masked on its two
  edges), so a window costs time in proportion to its visible area. ``causal`` with an
  unlimited left side stays the CAUSAL kernel; a side wider than the sequences is unlimited.
- SOFTCAP: ``cap * tanh(s / cap)`` on the scaled scores; the backward multiplies dS by
  ``1 - tanh^2``.
- ALIBI: ``- slope[b, h] * |d(i) - j|`` after the softcap.
- DROPOUT: the keep mask of :mod:`sparktune.dropout` (the reference's own), a 32-bit hash
  per (row of the log-sum-exp layout, key) from the call's (seed, offset), so the backward
  regenerates it; :func:`dropout_mask` returns it. The log-sum-exp is that of the undropped probabilities.
- VARLEN: packed (total, heads, head_dim) tensors, sequence ``b`` rows ``cu[b]:cu[b + 1]``;
  the grid covers the longest sequence and programs past a sequence's end return at once.
  The log-sum-exp is (heads_q, total_q).
- Deterministic backward: the dK/dV kernel sums GQA groups in a loop and the separate dQ
  kernel has no atomics, so every config without ``_dqatomic`` is bitwise reproducible; the
  atomic ones are refused when ``deterministic=True``.

Interpreter: Triton decides when it is imported whether ``@triton.jit`` builds GPU kernels or
interpreted ones (environment variable ``TRITON_INTERPRET=1``); with the interpreter the same
code runs on CPU tensors (slowly: tests only).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import MockTensor

from .._checks import check_packed_boundaries
from ..dropout import dropout_key, dropout_threshold
from ..dtypes import DTYPE_NAMES
from .triton_space import BwdConfig, Config, FwdConfig, padded_head_dim, parse_config

__all__ = [
    "attention_forward",
    "attention_backward",
    "dropout_mask",
    "warmup",
    "compiled_labels",
    "compile_offline",
    "compile_launch_offline",
    "INTERPRET",
]

log = logging.getLogger(__name__)

#: whether this module's kernels were built for Triton's CPU interpreter
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter() -> None:
    """Work around three defects of Triton 3.6's CPU interpreter (interpreter only; each fix is
    applied once and only where the defect shows):

    - scalars are 1-element arrays turned into loop bounds with ``int(array)``, which NumPy
      >= 2.4 refuses for arrays that are not 0-d: ``__index__`` takes the element explicitly;
    - ``tl.dot`` multiplies bfloat16 operands as their uint16 bit patterns: bfloat16 operands
      are widened to float32 first (exact: products of bfloat16 values are exact in float32,
      and the accumulation is float32 either way, as on the GPU);
    - float32 -> bfloat16 casts truncate, where the GPU rounds to nearest even (the bias shows
      in the backward's sums): they round to nearest even.
    """
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        original = getattr(interpreter, "_patch_lang_tensor", None)
        if original is not None and not getattr(original, "_sparktune_fixed", False):

            def patch_lang_tensor(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

            patch_lang_tensor._sparktune_fixed = True
            interpreter._patch_lang_tensor = patch_lang_tensor

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is not None and not getattr(create_dot, "_sparktune_fixed", False):

        def widened_dot(self, a, b, d, *args, **kwargs):
            if a.dtype.scalar == tl.bfloat16:
                a = self.cast_impl(a, tl.float32)
            if b.dtype.scalar == tl.bfloat16:
                b = self.cast_impl(b, tl.float32)
            return create_dot(self, a, b, d, *args, **kwargs)

        widened_dot._sparktune_fixed = True
        builder.create_dot = widened_dot

    cast_impl = getattr(builder, "cast_impl", None)
    if cast_impl is not None and not getattr(cast_impl, "_sparktune_fixed", False):

        def rounded_cast(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
                # round to nearest, ties to even: add 0x7fff plus the lowest kept bit
                bits = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                return interpreter.TensorHandle((bits >> np.uint32(16)).astype(np.uint16),
                                                tl.bfloat16)
            return cast_impl(self, src, dst_type)

        rounded_cast._sparktune_fixed = True
        builder.cast_impl = rounded_cast


if INTERPRET:
    _fix_interpreter()

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# the same constants as seen from inside the kernels
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)
#: rows per program of the backward's preprocessing kernel (a bandwidth-bound row sum)
_PRE_BLOCK_M = 64
_PRE_WARPS = 4
#: a softcap argument of tanh beyond this many (base-2 exponent units) saturates to +-1
_TANH_CLAMP = tl.constexpr(64.0)
#: the softcap's tanh is the GPU's instruction (the interpreter computes it from exp2)
_HW_TANH = tl.constexpr(not INTERPRET)

# Sequence lengths and the GQA group size vary per call and are never specialised on
# (otherwise every odd length would compile a new kernel); strides are, since their
# divisibility decides vectorised loads. The feature arguments (window sides, dropout seed and
# offset words, the packed row count of varlen) vary per call too.
_RUNTIME_INTS = ["seqlen_q", "seqlen_k", "group"]
_FEATURE_INTS = ["win_left", "win_right", "drop_key", "drop_thr", "total_q",
                 "stride_ab"]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptrs, rows, nrows, cols, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Load a (rows x BLOCK_D) tile; pad rows >= nrows (when MASK_ROWS) and columns >= HEAD_DIM
    (when the head dim is not a power of two) with zeros."""
    if MASK_ROWS:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows[:, None] < nrows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < nrows) & (cols[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _store_tile(ptrs, x, rows, nrows, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < nrows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < nrows) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """For the query rows [start_m, start_m + BLOCK_M): keys [0, full_end) are seen by every
    row (whole blocks of BLOCK_N), keys [full_end, end) need a mask (diagonal, tail)."""
    whole_blocks_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        # the first row of the tile sees keys j <= start_m + diag, the last one one more each row
        end = tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + diag, 0))
        seen_by_all = tl.maximum(start_m + diag + 1, 0)
        full_end = tl.minimum((seen_by_all // BLOCK_N) * BLOCK_N, whole_blocks_end)
    else:
        end = seqlen_k
        full_end = whole_blocks_end
    return full_end, end


@triton.jit
def _band_ranges(start, diag, before, after, n_stream, BLOCK_OWN: tl.constexpr,
                 BLOCK_STREAM: tl.constexpr):
    """A band mask: own row ``r`` sees streamed index ``x`` iff
    ``r + diag - before <= x <= r + diag + after`` and ``0 <= x < n_stream``. For the own rows
    [start, start + BLOCK_OWN) returns (lo, full_lo, full_hi, hi): streamed indices [lo, hi)
    are seen by some row (lo aligned to BLOCK_STREAM), and whole blocks in [full_lo, full_hi)
    are seen by every row (no mask); the rest of [lo, hi) needs one. Everything outside
    [lo, hi) is skipped, so the cost follows the visible band, not the sequence length."""
    first = start + diag
    last = start + BLOCK_OWN - 1 + diag
    lo = (tl.maximum(first - before, 0) // BLOCK_STREAM) * BLOCK_STREAM
    hi = tl.maximum(tl.minimum(last + after + 1, n_stream), lo)
    # every own row sees [last - before, first + after]; whole streamed blocks only
    full_lo = tl.cdiv(tl.maximum(last - before, 0), BLOCK_STREAM) * BLOCK_STREAM
    full_hi = (tl.maximum(tl.minimum(first + after + 1, n_stream), 0) // BLOCK_STREAM) * BLOCK_STREAM
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _visible(qi, kj, seqlen_q, seqlen_k, diag, win_left, win_right, CHECK_Q: tl.constexpr,
             CHECK_K: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Whether query ``qi`` sees key ``kj`` (broadcast index tensors): inside the sequence
    (rows checked when CHECK_Q, keys when CHECK_K), on or below the diagonal (CAUSAL), inside
    the window (WINDOW)."""
    if CHECK_K:
        visible = kj < seqlen_k
        if CHECK_Q:
            visible = visible & (qi < seqlen_q)
    else:
        visible = qi < seqlen_q
    if CAUSAL:
        visible = visible & (kj <= qi + diag)
    if WINDOW:
        visible = visible & (kj <= qi + diag + win_right) & (kj >= qi + diag - win_left)
    return visible


@triton.jit
def _tanh(x):
    """tanh: on the GPU the hardware's ``tanh.approx.f32`` (one special-function operation,
    relative error about 2^-11, as FlashAttention's softcap); under the interpreter, which runs
    no PTX, from one exp2 and a division (saturating to +-1, never NaN)."""
    if _HW_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.math.exp2(tl.minimum(x * (2.0 * _LOG2E), _TANH_CLAMP))
        return 1.0 - tl.math.fdiv(2.0, e + 1.0)


@triton.jit
def _modified_scores(qk, qi, kj, diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP: tl.constexpr,
                     ALIBI: tl.constexpr):
    """Scores in base 2 (natural scores times log2 e) after the softcap and the ALiBi bias
    (``qi``/``kj``: broadcastable float32 query and key indices, ``diag`` their offset).
    Returns (scores, tanh of the capped argument; the scores themselves without SOFTCAP)."""
    if SOFTCAP:
        t = _tanh(qk * cap_in)
        s = t * cap_out
    else:
        s = qk * qk_scale
        t = s
    if ALIBI:
        # qi, kj are float32 indices (exact below 2^24): one subtraction per score, no
        # integer-to-float conversion
        s = s - slope2 * tl.abs(qi + diag - kj)
    return s, t


@triton.jit
def _mix32(x):
    """sparktune.dropout.mix32 on uint32 (products wrap modulo 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _dropout_keep(row_ids, kj, drop_key, drop_thr):
    """The keep mask of sparktune.dropout for (row, key) pairs: ``row_ids`` (int64) in the
    log-sum-exp's layout, ``kj`` the key index within the sequence; ``drop_key`` and
    ``drop_thr`` are the call's key and threshold as int32 bit patterns."""
    rows = row_ids + kj * 0
    cols = (kj + row_ids * 0).to(tl.uint32)
    lo = (rows & 0xFFFFFFFF).to(tl.uint32)
    hi = (rows >> 32).to(tl.uint32)
    u = _mix32(_mix32(_mix32(drop_key.to(tl.uint32) ^ lo) ^ hi) ^ cols)
    return u >= drop_thr.to(tl.uint32)


@triton.jit(do_not_specialize=["drop_key", "drop_thr", "nrows", "ncols"])
def _dropout_mask_kernel(Keep, nrows, ncols, drop_key, drop_thr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(rows[:, None].to(tl.int64), cols[None, :], drop_key, drop_thr)
    ptrs = Keep + rows[:, None].to(tl.int64) * ncols + cols[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < nrows) & (cols[None, :] < ncols))


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi, rows, seqlen_q,
               seqlen_k, qk_scale, win_left, win_right, cap_in, cap_out, slope2, row_base,
               drop_key, drop_thr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    diag = seqlen_k - seqlen_q
    rows_f = rows.to(tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        cols_f = cols.to(tl.float32)
        k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            if SOFTCAP or ALIBI:
                s, _ = _modified_scores(qk, rows_f[:, None], cols_f[None, :], diag, qk_scale,
                                        cap_in, cap_out, slope2, SOFTCAP, ALIBI)
            else:
                s = qk * qk_scale
            visible = _visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, diag, win_left,
                               win_right, False, True, CAUSAL, WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: subtract 0 instead (p = 0, alpha = 0)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        elif SOFTCAP or ALIBI:
            s, _ = _modified_scores(qk, rows_f[:, None], cols_f[None, :], diag, qk_scale,
                                    cap_in, cap_out, slope2, SOFTCAP, ALIBI)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            # the softmax sum counts every probability; only the output sees the dropped ones
            p = tl.where(_dropout_keep(row_base + rows[:, None], cols[None, :], drop_key,
                                       drop_thr), p, 0.0)
        v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_RUNTIME_INTS + _FEATURE_INTS)
def _fwd_kernel(
    Q, K, V, Out, LSE, Alibi, CuQ, CuK,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    seqlen_q, seqlen_k, group, qk_scale,
    win_left, win_right, cap_in, cap_out, stride_ab, drop_scale, drop_key, drop_thr, total_q,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    if CAUSAL or WINDOW:
        # the last row blocks see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads_q = tl.num_programs(1)
    hk = h // group

    start_m = pid_m * BLOCK_M
    if VARLEN:
        # sequence b is rows cu[b]:cu[b + 1] of the packed tensors; the grid covers the longest
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        seqlen_k = tl.load(CuK + b + 1) - k_start
        if start_m >= seqlen_q:
            return
        q_off = q_start.to(tl.int64) * stride_qn
        k_off = k_start.to(tl.int64) * stride_kn
        v_off = k_start.to(tl.int64) * stride_vn
        o_off = q_start.to(tl.int64) * stride_on
        row_base = h * total_q + q_start
    else:
        q_off = b * stride_qb
        k_off = b * stride_kb
        v_off = b * stride_vb
        o_off = b * stride_ob
        row_base = (b * heads_q + h) * seqlen_q
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = Q + q_off + h * stride_qh
    k_base = K + k_off + hk * stride_kh
    v_base = V + v_off + hk * stride_vh
    q = _load_tile(q_base + rows[:, None] * stride_qn + offs_d[None, :], rows, seqlen_q, offs_d,
                   True, HEAD_DIM, BLOCK_D)
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h) * _LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    if WINDOW:
        lo, full_lo, full_hi, hi = _band_ranges(start_m, seqlen_k - seqlen_q, win_left,
                                                win_right, seqlen_k, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo,
                                   full_lo, rows, seqlen_q, seqlen_k, qk_scale, win_left,
                                   win_right, cap_in, cap_out, slope2, row_base, drop_key,
                                   drop_thr, True, False, True, SOFTCAP, ALIBI,
                                   DROPOUT, HEAD_DIM, BLOCK_D, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   full_lo, full_hi, rows, seqlen_q, seqlen_k, qk_scale, win_left,
                                   win_right, cap_in, cap_out, slope2, row_base, drop_key,
                                   drop_thr, False, False, True, SOFTCAP, ALIBI,
                                   DROPOUT, HEAD_DIM, BLOCK_D, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   full_hi, hi, rows, seqlen_q, seqlen_k, qk_scale, win_left,
                                   win_right, cap_in, cap_out, slope2, row_base, drop_key,
                                   drop_thr, True, False, True, SOFTCAP, ALIBI,
                                   DROPOUT, HEAD_DIM, BLOCK_D, BLOCK_N)
    else:
        full_end, end = _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, 0,
                                   full_end, rows, seqlen_q, seqlen_k, qk_scale, win_left,
                                   win_right, cap_in, cap_out, slope2, row_base, drop_key,
                                   drop_thr, False, CAUSAL, False, SOFTCAP, ALIBI,
                                   DROPOUT, HEAD_DIM, BLOCK_D, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                                   full_end, end, rows, seqlen_q, seqlen_k, qk_scale, win_left,
                                   win_right, cap_in, cap_out, slope2, row_base, drop_key,
                                   drop_thr, True, CAUSAL, False, SOFTCAP, ALIBI,
                                   DROPOUT, HEAD_DIM, BLOCK_D, BLOCK_N)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        out = out * drop_scale
    o_base = Out + o_off + h * stride_oh
    _store_tile(o_base + rows[:, None] * stride_on + offs_d[None, :],
                out.to(Out.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    tl.store(LSE + row_base + rows, lse, mask=rows < seqlen_q)


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seqlen_q"])
def _bwd_preprocess(
    Out, DO, DELTA,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    seqlen_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta[i] = sum_d dO[i, d] * Out[i, d] (float32), the row term of the softmax gradient."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + offs_d[None, :],
                   rows, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don
                    + offs_d[None, :], rows, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    base = DELTA + (b * tl.num_programs(1) + h) * seqlen_q
    tl.store(base + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base, delta_base,
                    stride_qn, stride_don, stride_dqn, lo, hi, seqlen_q, seqlen_k, qk_scale, scale,
                    win_left, win_right, cap_in, cap_out, slope2, drop_scale, row_base,
                    drop_key, drop_thr,
                    MASK_ROWS: tl.constexpr, MASK_CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASK_WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                    ALIBI: tl.constexpr = False, DROPOUT: tl.constexpr = False):
    """Add the contribution of query rows [lo, hi) to the dK, dV tiles of key columns ``cols``.
    Works on transposed scores (keys x queries) so that no large tile is transposed."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    diag = seqlen_k - seqlen_q
    cols_f = cols.to(tl.float32)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        rows_f = rows.to(tl.float32)
        q = _load_tile(q_base + rows[:, None] * stride_qn + offs_d[None, :], rows, seqlen_q,
                       offs_d, MASK_ROWS, HEAD_DIM, BLOCK_D)
        do = _load_tile(do_base + rows[:, None] * stride_don + offs_d[None, :], rows, seqlen_q,
                        offs_d, MASK_ROWS, HEAD_DIM, BLOCK_D)
        if MASK_ROWS:
            lse2 = tl.load(lse_base + rows, mask=rows < seqlen_q, other=0.0) * _LOG2E
            delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse2 = tl.load(lse_base + rows) * _LOG2E
            delta = tl.load(delta_base + rows)
        # P^T = exp(S^T - lse): probabilities recomputed from the forward's log-sum-exp
        if SOFTCAP or ALIBI:
            sT, tT = _modified_scores(tl.dot(k, tl.trans(q)), rows_f[None, :], cols_f[:, None],
                                      diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI)
            pT = tl.math.exp2(sT - lse2[None, :])
        else:
            pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASK_ROWS or MASK_CAUSAL or MASK_WINDOW:
            keep = cols[:, None] >= 0
            if MASK_ROWS:
                keep = keep & (rows[None, :] < seqlen_q)
            if MASK_CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :] + diag)
            if MASK_WINDOW:
                keep = keep & (cols[:, None] <= rows[None, :] + diag + win_right)
                keep = keep & (cols[:, None] >= rows[None, :] + diag - win_left)
            pT = tl.where(keep, pT, 0.0)
        if DROPOUT:
            kept = _dropout_keep(row_base + rows[None, :], cols[:, None], drop_key,
                                 drop_thr)
            # dV sees the kept probabilities (rescaled once at the end), dP the kept gradients
            dv = tl.dot(tl.where(kept, pT, 0.0).to(do.dtype), do, dv)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        if DROPOUT:
            dpT = tl.where(kept, dpT * drop_scale, 0.0)
        if SOFTCAP:
            # d(cap tanh(x / cap)) / dx = 1 - tanh^2
            dsT = (pT * (dpT - delta[None, :]) * (1.0 - tT * tT)).to(q.dtype)
        else:
            dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(dsT), k) * scale
            ptrs = dq_base + rows[:, None] * stride_dqn + offs_d[None, :]
            if HEAD_DIM == BLOCK_D:
                tl.atomic_add(ptrs, dq, mask=rows[:, None] < seqlen_q, sem="relaxed")
            else:
                tl.atomic_add(ptrs, dq, mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM),
                              sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=_RUNTIME_INTS + _FEATURE_INTS)
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DQ_ACC, Alibi, CuQ, CuK,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    seqlen_q, seqlen_k, group, qk_scale, scale,
    win_left, win_right, cap_in, cap_out, stride_ab, drop_scale, drop_key, drop_thr, total_q,
    CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False,
):
    """One program: BLOCK_N key rows of one kv head, dK and dV summed over the query heads of
    its group and over every query row that sees them."""
    start_n = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads_q = tl.num_programs(1) * group
    if VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        seqlen_k = tl.load(CuK + b + 1) - k_start
        if start_n >= seqlen_k:
            return
        q_off = q_start.to(tl.int64) * stride_qn
        do_off = q_start.to(tl.int64) * stride_don
        dq_off = q_start.to(tl.int64) * stride_dqn
        k_off = k_start.to(tl.int64) * stride_kn
        v_off = k_start.to(tl.int64) * stride_vn
        dk_off = k_start.to(tl.int64) * stride_dkn
        dv_off = k_start.to(tl.int64) * stride_dvn
    else:
        q_off = b * stride_qb
        do_off = b * stride_dob
        dq_off = b * stride_dqb
        k_off = b * stride_kb
        v_off = b * stride_vb
        dk_off = b * stride_dkb
        dv_off = b * stride_dvb
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k = _load_tile(K + k_off + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
                   cols, seqlen_k, offs_d, True, HEAD_DIM, BLOCK_D)
    v = _load_tile(V + v_off + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :],
                   cols, seqlen_k, offs_d, True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # query rows [lo, mid) touch the diagonal (masked), [mid, seqlen_q) see every key of the
    # block (only the final partial block of rows is masked)
    if CAUSAL:
        diag = seqlen_k - seqlen_q
        lo = (tl.maximum(start_n - diag, 0) // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
        mid = tl.maximum(mid, lo)
    else:
        lo = 0
        mid = 0
    rows_full_end = (seqlen_q // BLOCK_M) * BLOCK_M
    tail = tl.maximum(mid, rows_full_end)
    if WINDOW:
        # key j is seen by the query rows i with j - diag - right <= i <= j - diag + left: the
        # same band with the roles of rows and keys swapped
        w_lo, w_full_lo, w_full_hi, w_hi = _band_ranges(start_n, seqlen_q - seqlen_k, win_right,
                                                        win_left, seqlen_q, BLOCK_N, BLOCK_M)

    for g in range(0, group):
        h = hk * group + g
        q_base = Q + q_off + h * stride_qh
        do_base = DO + do_off + h * stride_doh
        dq_base = DQ_ACC + dq_off + h * stride_dqh
        if VARLEN:
            row_base = h * total_q + q_start
        else:
            row_base = (b * heads_q + h) * seqlen_q
        lse_base = LSE + row_base
        delta_base = DELTA + row_base
        slope2 = 0.0
        if ALIBI:
            slope2 = tl.load(Alibi + b * stride_ab + h) * _LOG2E
        if WINDOW:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                     delta_base, stride_qn, stride_don, stride_dqn, w_lo,
                                     w_full_lo, seqlen_q, seqlen_k, qk_scale, scale, win_left,
                                     win_right, cap_in, cap_out, slope2, drop_scale,
                                     row_base, drop_key, drop_thr, True, False,
                                     DQ_ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, True, SOFTCAP, ALIBI,
                                     DROPOUT)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                     delta_base, stride_qn, stride_don, stride_dqn, w_full_lo,
                                     w_full_hi, seqlen_q, seqlen_k, qk_scale, scale, win_left,
                                     win_right, cap_in, cap_out, slope2, drop_scale,
                                     row_base, drop_key, drop_thr, False, False,
                                     DQ_ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, False, SOFTCAP, ALIBI,
                                     DROPOUT)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                     delta_base, stride_qn, stride_don, stride_dqn, w_full_hi,
                                     w_hi, seqlen_q, seqlen_k, qk_scale, scale, win_left,
                                     win_right, cap_in, cap_out, slope2, drop_scale,
                                     row_base, drop_key, drop_thr, True, False,
                                     DQ_ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, True, SOFTCAP, ALIBI,
                                     DROPOUT)
        else:
            if CAUSAL:
                dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                         delta_base, stride_qn, stride_don, stride_dqn, lo,
                                         tl.minimum(mid, seqlen_q), seqlen_q, seqlen_k, qk_scale,
                                         scale, win_left, win_right, cap_in, cap_out, slope2,
                                         drop_scale, row_base, drop_key, drop_thr, True, True, DQ_ATOMIC, HEAD_DIM, BLOCK_D,
                                         BLOCK_M, False, SOFTCAP, ALIBI, DROPOUT)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                     delta_base, stride_qn, stride_don, stride_dqn, mid,
                                     rows_full_end, seqlen_q, seqlen_k, qk_scale, scale, win_left,
                                     win_right, cap_in, cap_out, slope2, drop_scale,
                                     row_base, drop_key, drop_thr, False, False,
                                     DQ_ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, False, SOFTCAP, ALIBI,
                                     DROPOUT)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                     delta_base, stride_qn, stride_don, stride_dqn, tail,
                                     seqlen_q, seqlen_q, seqlen_k, qk_scale, scale, win_left,
                                     win_right, cap_in, cap_out, slope2, drop_scale,
                                     row_base, drop_key, drop_thr, True, False,
                                     DQ_ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M, False, SOFTCAP, ALIBI,
                                     DROPOUT)

    dk = dk * scale
    if DROPOUT:
        dv = dv * drop_scale
    _store_tile(DK + dk_off + hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :],
                dk.to(DK.dtype.element_ty), cols, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_tile(DV + dv_off + hk * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :],
                dv.to(DV.dtype.element_ty), cols, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn, lo, hi,
                  seqlen_q, seqlen_k, qk_scale, win_left, win_right, cap_in, cap_out, slope2,
                  drop_scale, row_base, drop_key, drop_thr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = False,
                  SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                  DROPOUT: tl.constexpr = False):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    diag = seqlen_k - seqlen_q
    rows_f = rows.to(tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        cols_f = cols.to(tl.float32)
        k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        if SOFTCAP or ALIBI:
            s, t = _modified_scores(tl.dot(q, tl.trans(k)), rows_f[:, None], cols_f[None, :],
                                    diag, qk_scale, cap_in, cap_out, slope2, SOFTCAP, ALIBI)
            p = tl.math.exp2(s - lse2[:, None])
        else:
            p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            keep = _visible(rows[:, None], cols[None, :], seqlen_q, seqlen_k, diag, win_left,
                            win_right, False, True, CAUSAL, WINDOW)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        if DROPOUT:
            kept = _dropout_keep(row_base + rows[:, None], cols[None, :], drop_key,
                                 drop_thr)
            dp = tl.where(kept, dp * drop_scale, 0.0)
        if SOFTCAP:
            ds = (p * (dp - delta[:, None]) * (1.0 - t * t)).to(k.dtype)
        else:
            ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq)
    return dq


@triton.jit(do_not_specialize=_RUNTIME_INTS + _FEATURE_INTS)
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, Alibi, CuQ, CuK,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    seqlen_q, seqlen_k, group, qk_scale, scale,
    win_left, win_right, cap_in, cap_out, stride_ab, drop_scale, drop_key, drop_thr, total_q,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False,
):
    """One program: BLOCK_M query rows of one head; streams the keys it sees (no atomics)."""
    pid_m = tl.program_id(0)
    if CAUSAL or WINDOW:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads_q = tl.num_programs(1)
    hk = h // group
    start_m = pid_m * BLOCK_M
    if VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        seqlen_k = tl.load(CuK + b + 1) - k_start
        if start_m >= seqlen_q:
            return
        q_off = q_start.to(tl.int64) * stride_qn
        do_off = q_start.to(tl.int64) * stride_don
        dq_off = q_start.to(tl.int64) * stride_dqn
        k_off = k_start.to(tl.int64) * stride_kn
        v_off = k_start.to(tl.int64) * stride_vn
        row_base = h * total_q + q_start
    else:
        q_off = b * stride_qb
        do_off = b * stride_dob
        dq_off = b * stride_dqb
        k_off = b * stride_kb
        v_off = b * stride_vb
        row_base = (b * heads_q + h) * seqlen_q
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = _load_tile(Q + q_off + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :],
                   rows, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + do_off + h * stride_doh + rows[:, None] * stride_don
                    + offs_d[None, :], rows, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)
    lse2 = tl.load(LSE + row_base + rows, mask=rows < seqlen_q, other=0.0) * _LOG2E
    delta = tl.load(DELTA + row_base + rows, mask=rows < seqlen_q, other=0.0)
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h) * _LOG2E

    k_base = K + k_off + hk * stride_kh
    v_base = V + v_off + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if WINDOW:
        lo, full_lo, full_hi, hi = _band_ranges(start_m, seqlen_k - seqlen_q, win_left,
                                                win_right, seqlen_k, BLOCK_M, BLOCK_N)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn,
                           lo, full_lo, seqlen_q, seqlen_k, qk_scale, win_left, win_right,
                           cap_in, cap_out, slope2, drop_scale, row_base, drop_key,
                           drop_thr, True, False, HEAD_DIM, BLOCK_D, BLOCK_N,
                           True, SOFTCAP, ALIBI, DROPOUT)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn,
                           full_lo, full_hi, seqlen_q, seqlen_k, qk_scale, win_left, win_right,
                           cap_in, cap_out, slope2, drop_scale, row_base, drop_key,
                           drop_thr, False, False, HEAD_DIM, BLOCK_D, BLOCK_N,
                           True, SOFTCAP, ALIBI, DROPOUT)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn,
                           full_hi, hi, seqlen_q, seqlen_k, qk_scale, win_left, win_right,
                           cap_in, cap_out, slope2, drop_scale, row_base, drop_key,
                           drop_thr, True, False, HEAD_DIM, BLOCK_D, BLOCK_N,
                           True, SOFTCAP, ALIBI, DROPOUT)
    else:
        full_end, end = _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn,
                           0, full_end, seqlen_q, seqlen_k, qk_scale, win_left, win_right,
                           cap_in, cap_out, slope2, drop_scale, row_base, drop_key,
                           drop_thr, False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N,
                           False, SOFTCAP, ALIBI, DROPOUT)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn,
                           full_end, end, seqlen_q, seqlen_k, qk_scale, win_left, win_right,
                           cap_in, cap_out, slope2, drop_scale, row_base, drop_key,
                           drop_thr, True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N,
                           False, SOFTCAP, ALIBI, DROPOUT)
    dq = dq * scale
    _store_tile(DQ + dq_off + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :],
                dq.to(DQ.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)


# --------------------------------------------------------------------------------------------
# launch plans: one description of every kernel launch, used to run, to warm up and to compile
# for a GPU that is not there
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Launch:
    kernel: object
    grid: tuple[int, int, int]
    #: (config or kernel name, kernel kind, dtype, head_dim[, causal]): the compile-log label
    label: tuple
    args: tuple
    kwargs: dict


class _Spec(MockTensor):
    """Stands in for a tensor when nothing runs: a dtype and strides (Triton specialises on
    the dtype, on pointer alignment, reported as 16 bytes, and on strides divisible by 16)."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], strides=None) -> None:
        super().__init__(dtype, list(shape))
        if strides is None:  # contiguous
            strides, step = [], 1
            for size in reversed(shape):
                strides.insert(0, step)
                step *= size
        self._strides = tuple(strides)

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]


def _strides(t) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ValueError(f"the last dimension must be contiguous, got strides {tuple(t.stride())}")
    return t.stride(0), t.stride(1), t.stride(2)


def _packed_strides(t) -> tuple[int, int, int]:
    """(batch, head, row) strides of a packed (total, heads, head_dim) tensor: no batch stride
    (the kernels find each sequence's first row from cu_seqlens)."""
    if t.stride(-1) != 1:
        raise ValueError(f"the last dimension must be contiguous, got strides {tuple(t.stride())}")
    return 0, t.stride(1), t.stride(0)


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _int32_word(value: int) -> int:
    """An unsigned 32-bit value as an int32 kernel argument: its bit pattern (so the argument
    keeps one type, and one compiled kernel, for any value)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclass(frozen=True)
class _Features:
    """The features of one call, normalised for the kernels: the mask kind (CAUSAL is the plain
    causal kernel; WINDOW a band with both sides explicit), the runtime arguments, and the
    extra tensors (``None`` where off)."""

    causal: bool = False
    window: bool = False
    win_left: int = 0
    win_right: int = 0
    softcap: float = 0.0
    alibi: object = None
    dropout_p: float = 0.0
    seed: int = 0
    offset: int = 0
    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def tag(self) -> str:
        """The features on, joined by '+' ('' for the plain kernels)."""
        names = (("window", self.window), ("softcap", self.softcap > 0),
                 ("alibi", self.alibi is not None), ("dropout", self.dropout_p > 0),
                 ("varlen", self.varlen))
        return "+".join(name for name, on in names if on)

    def constexprs(self) -> dict:
        return dict(WINDOW=self.window, SOFTCAP=self.softcap > 0, ALIBI=self.alibi is not None,
                    DROPOUT=self.dropout_p > 0, VARLEN=self.varlen)

    def runtime_args(self, scale: float, total_q: int) -> tuple:
        """(win_left, win_right, cap_in, cap_out, stride_ab, drop_scale, drop_key,
        drop_thr, total_q), in the kernels' order."""
        cap = self.softcap
        cap_in, cap_out = (scale / cap, cap * LOG2E) if cap > 0 else (0.0, 0.0)
        stride_ab = 0
        if self.alibi is not None and len(self.alibi.shape) == 2:
            stride_ab = self.alibi.stride(0)
        p = self.dropout_p
        drop_scale = 1.0 / (1.0 - p) if p > 0 else 1.0
        words = (_int32_word(dropout_key(self.seed, self.offset)), _int32_word(dropout_threshold(p))) if p > 0 else (0, 0)
        return (self.win_left, self.win_right, cap_in, cap_out, stride_ab, drop_scale, *words, total_q)


def _normalise_window(causal: bool, window, seqlen_q: int, seqlen_k: int) -> tuple[bool, bool, int, int]:
    """(causal, window, left, right) for the kernels from the caller's ``causal`` and
    ``window=(left, right)`` (-1: unlimited). ``causal`` sets right = 0. A side wide enough to
    reach past every key (at these lengths, or these maximum lengths for varlen) is
    unlimited; what is left is the plain kernel (no window), the causal kernel (left unlimited,
    right 0) or the band kernel, where an unlimited side becomes a bound no key reaches."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0 or -1 (unlimited), got {(left, right)}")
    if causal:
        right = 0
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1 and not causal:
        right = -1
    if left == -1 and right == -1:
        return False, False, 0, 0
    if left == -1 and right == 0:
        return True, False, 0, 0
    unlimited = seqlen_q + seqlen_k + 1
    return (False, True, unlimited if left == -1 else left, unlimited if right == -1 else right)


def _features(q, k, *, causal, window, softcap, alibi_slopes, dropout_p, seed, offset,
              cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> _Features:
    """Check and normalise the feature arguments of a call (q, k already shape-checked: dense
    (B, H, N, D) when cu_seqlens_q is None, else packed (total, H, D))."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        batch, nq, nk = check_packed_boundaries(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k)
    else:
        batch, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    heads_q = q.shape[1]
    is_causal, is_window, left, right = _normalise_window(bool(causal), window, nq, nk)
    softcap = float(softcap or 0.0)
    if not softcap >= 0 or math.isinf(softcap):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap}")
    if alibi_slopes is not None:
        if alibi_slopes.dtype != torch.float32:
            raise ValueError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((heads_q,), (batch, heads_q)):
            raise ValueError(f"alibi_slopes must be ({heads_q},) or ({batch}, {heads_q}), got "
                             f"{tuple(alibi_slopes.shape)}")
        if alibi_slopes.stride(-1) != 1:
            raise ValueError("alibi_slopes must have a contiguous last dimension")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}")
    p = float(dropout_p or 0.0)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    return _Features(
        causal=is_causal, window=is_window, win_left=left, win_right=right, softcap=softcap,
        alibi=alibi_slopes, dropout_p=p, seed=int(seed), offset=int(offset),
        cu_seqlens_q=cu_seqlens_q if varlen else None,
        cu_seqlens_k=cu_seqlens_k if varlen else None,
        max_seqlen_q=nq if varlen else 0, max_seqlen_k=nk if varlen else 0,
    )


def _label(cfg_name: str, kind: str, dtype: str, head_dim: int, causal: bool,
           feat: _Features) -> tuple:
    label = (cfg_name, kind, dtype, head_dim, causal)
    return label + (feat.tag,) if feat.tag else label


def _extras(feat: _Features, dummy) -> tuple:
    """The Alibi, CuQ and CuK pointer arguments (``dummy`` where a feature is off: never
    read)."""
    return (dummy if feat.alibi is None else feat.alibi,
            dummy if feat.cu_seqlens_q is None else feat.cu_seqlens_q,
            dummy if feat.cu_seqlens_k is None else feat.cu_seqlens_k)


def _fwd_plan(q, k, v, out, lse, cfg: FwdConfig, causal: bool, scale: float,
              feat: _Features | None = None) -> _Launch:
    if feat is None:
        feat = _Features(causal=causal)
    if feat.varlen:
        total_q, heads_q, head_dim = q.shape
        heads_kv = k.shape[1]
        batch = feat.cu_seqlens_q.shape[0] - 1
        seqlen_q, seqlen_k = feat.max_seqlen_q, feat.max_seqlen_k
        strides = _packed_strides
    else:
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_k = k.shape[1], k.shape[2]
        total_q = 0
        strides = _strides
    causal = feat.causal
    return _Launch(
        _fwd_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        _label(cfg.name, "fwd", _dtype_name(q), head_dim, causal, feat),
        (q, k, v, out, lse, *_extras(feat, lse), *strides(q), *strides(k), *strides(v),
         *strides(out), seqlen_q, seqlen_k, heads_q // heads_kv, scale * LOG2E,
         *feat.runtime_args(scale, total_q)),
        dict(CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **feat.constexprs(),
             num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )


def _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, delta, dq_acc, cfg: BwdConfig, causal: bool,
              scale: float, feat: _Features | None = None) -> list[_Launch]:
    """The backward's launches in order: row sums, dK/dV (with atomic dQ into ``dq_acc``, or
    not), then the dQ kernel when dQ is not atomic."""
    if feat is None:
        feat = _Features(causal=causal)
    if feat.varlen:
        total_q, heads_q, head_dim = q.shape
        heads_kv = k.shape[1]
        batch = feat.cu_seqlens_q.shape[0] - 1
        seqlen_q, seqlen_k = feat.max_seqlen_q, feat.max_seqlen_k
        strides = _packed_strides
        # the row sums see the packed rows as one sequence of total_q rows
        pre_grid = (triton.cdiv(total_q, _PRE_BLOCK_M), heads_q, 1)
        pre_rows = total_q
    else:
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_k = k.shape[1], k.shape[2]
        total_q = 0
        strides = _strides
        pre_grid = (triton.cdiv(seqlen_q, _PRE_BLOCK_M), heads_q, batch)
        pre_rows = seqlen_q
    causal = feat.causal
    group = heads_q // heads_kv
    block_d = padded_head_dim(head_dim)
    dtype = _dtype_name(q)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    extras = _extras(feat, lse)
    runtime = feat.runtime_args(scale, total_q)
    plans = [
        _Launch(
            _bwd_preprocess,
            pre_grid,
            ("bwd_preprocess", "bwd", dtype, head_dim),
            (out, dout, delta, *strides(out), *strides(dout), pre_rows),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=_PRE_BLOCK_M, num_warps=_PRE_WARPS),
        ),
        _Launch(
            _bwd_dkdv_kernel,
            (triton.cdiv(seqlen_k, cfg.block_n), heads_kv, batch),
            _label(cfg.name, "bwd_dkdv", dtype, head_dim, causal, feat),
            (q, k, v, dout, dk, dv, lse, delta, dq_acc, *extras, *strides(q), *strides(k),
             *strides(v), *strides(dout), *strides(dk), *strides(dv), *strides(dq_acc),
             seqlen_q, seqlen_k, group, scale * LOG2E, scale, *runtime),
            dict(CAUSAL=causal, DQ_ATOMIC=cfg.dq_atomic, HEAD_DIM=head_dim, BLOCK_D=block_d,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **feat.constexprs(), **launch),
        ),
    ]
    if not cfg.dq_atomic:
        # the mirror image of the dK/dV kernel: block_n query rows held, keys by block_m
        plans.append(_Launch(
            _bwd_dq_kernel,
            (triton.cdiv(seqlen_q, cfg.block_n), heads_q, batch),
            _label(cfg.name, "bwd_dq", dtype, head_dim, causal, feat),
            (q, k, v, dout, dq, lse, delta, *extras, *strides(q), *strides(k), *strides(v),
             *strides(dout), *strides(dq), seqlen_q, seqlen_k, group, scale * LOG2E, scale,
             *runtime),
            dict(CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_n,
                 BLOCK_N=cfg.block_m, **feat.constexprs(), **launch),
        ))
    return plans


def _problem_features(problem, dummy_alibi, dummy_cu) -> _Features:
    """The features of ``problem`` (fields of docs/FEATURES.md, read with defaults so that a
    Problem without them is plain), with stand-ins for the extra tensors."""
    varlen = bool(getattr(problem, "varlen", False))
    left = int(getattr(problem, "window_left", -1))
    right = int(getattr(problem, "window_right", -1))
    window = None if (left, right) == (-1, -1) else (left, right)
    causal, is_window, wl, wr = _normalise_window(bool(problem.causal), window, problem.seqlen_q,
                                                  problem.seqlen_k)
    return _Features(
        causal=causal, window=is_window, win_left=wl, win_right=wr,
        softcap=1.0 if getattr(problem, "softcap", False) else 0.0,
        alibi=dummy_alibi if getattr(problem, "alibi", False) else None,
        dropout_p=0.1 if getattr(problem, "dropout", False) else 0.0,
        cu_seqlens_q=dummy_cu if varlen else None, cu_seqlens_k=dummy_cu if varlen else None,
        max_seqlen_q=problem.seqlen_q if varlen else 0,
        max_seqlen_k=problem.seqlen_k if varlen else 0,
    )


def _spec_plans(problem, cfg: Config) -> list[_Launch]:
    """The launches of ``cfg`` for ``problem`` with contiguous (B, H, N, D) stand-ins (packed
    (total, H, D) ones for varlen): the same specialisation as the (B, N, H, D) layout
    whenever head_dim is a multiple of 16."""
    dtype = getattr(torch, problem.dtype)
    f32 = torch.float32
    b, hq, hk, nq, nk, d = (problem.batch, problem.heads_q, problem.heads_kv, problem.seqlen_q,
                            problem.seqlen_k, problem.head_dim)
    feat = _problem_features(problem, _Spec(f32, (hq,)), _Spec(torch.int32, (b + 1,)))
    if feat.varlen:
        tq = int(getattr(problem, "total_q", 0) or b * nq)
        tk = int(getattr(problem, "total_k", 0) or b * nk)
        q, out = _Spec(dtype, (tq, hq, d)), _Spec(dtype, (tq, hq, d))
        k, v = _Spec(dtype, (tk, hk, d)), _Spec(dtype, (tk, hk, d))
        lse = _Spec(f32, (hq, tq))
        acc_shape = (tq, hq, d)
    else:
        q, out = _Spec(dtype, (b, hq, nq, d)), _Spec(dtype, (b, hq, nq, d))
        k, v = _Spec(dtype, (b, hk, nk, d)), _Spec(dtype, (b, hk, nk, d))
        lse = _Spec(f32, (b, hq, nq))
        acc_shape = (b, hq, nq, d)
    causal = bool(problem.causal)
    if cfg.op == "fwd":
        return [_fwd_plan(q, k, v, out, lse, cfg, causal, 1.0, feat)]
    dq_acc = _Spec(f32, acc_shape) if cfg.dq_atomic else q
    return _bwd_plan(q, q, k, v, out, lse, q, k, v, _Spec(f32, lse.shape), dq_acc, cfg, causal,
                     1.0, feat)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

_compiled: dict[tuple, float] = {}
_compiled_lock = threading.Lock()


def compiled_labels() -> dict[tuple, float]:
    """(config, kernel, dtype, head_dim[, causal]) -> compile seconds, for every kernel variant
    this process has compiled (or loaded from Triton's disk cache)."""
    with _compiled_lock:
        return dict(_compiled)


def _run(plan: _Launch, warmup: bool = False) -> float | None:
    """Launch (or with ``warmup`` only compile) ``plan``. The first use of a variant compiles
    it, timed and logged once; Triton keeps the compiled kernel in its process-wide cache (and
    on disk). Returns the compile seconds on a first use, else None."""
    with _compiled_lock:
        first = plan.label not in _compiled
    if not first:
        if not warmup:
            plan.kernel[plan.grid](*plan.args, **plan.kwargs)
        return None
    t0 = time.perf_counter()
    if warmup:
        if not INTERPRET:
            plan.kernel.warmup(*plan.args, grid=plan.grid, **plan.kwargs)
    else:
        plan.kernel[plan.grid](*plan.args, **plan.kwargs)
    seconds = time.perf_counter() - t0
    with _compiled_lock:
        if plan.label in _compiled:
            return None
        _compiled[plan.label] = seconds
    log.info("triton: compiled %s (%s)%s in %.2f s", plan.label[0],
             ", ".join(map(str, plan.label[1:])), " ahead of time" if warmup else "", seconds)
    return seconds


def _check_shapes(q, k, v, varlen: bool = False) -> None:
    if varlen:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError("varlen q, k, v must be packed (total_tokens, heads, head_dim) tensors")
        _, heads_q, head_dim = q.shape
        heads_kv = k.shape[1]
        if k.shape != v.shape or k.shape[2] != head_dim:
            raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    else:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("q, k, v must be (batch, heads, seqlen, head_dim) views")
        batch, heads_q, _, head_dim = q.shape
        heads_kv = k.shape[1]
        if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
            raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPE_NAMES:
        raise ValueError(f"q, k, v must all be float16 or all bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")


def _as_config(config: Config | str, op: str) -> Config:
    cfg = parse_config(config) if isinstance(config, str) else config
    if cfg.op != op:
        raise ValueError(f"{cfg.name} is a {cfg.op} config, not a {op} one")
    return cfg


def _lse_rows(q, varlen: bool) -> tuple[int, ...]:
    """The log-sum-exp's shape: (batch, heads_q, seqlen_q), or (heads_q, total_q) for varlen."""
    return (q.shape[1], q.shape[0]) if varlen else tuple(q.shape[:3])


def attention_forward(q, k, v, out, lse=None, *, config: FwdConfig | str, causal: bool,
                      scale: float, window=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                      dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                      max_seqlen_k=None, deterministic: bool = False) -> torch.Tensor:
    """Write softmax(scale * q k^T) v into ``out`` and return the float32 log-sum-exp
    (batch, heads_q, seqlen_q) (written into ``lse`` when given, which must be contiguous).

    Features (docs/FEATURES.md): ``window=(left, right)`` (-1 unlimited, bottom-right aligned;
    ``causal`` sets right = 0), ``softcap`` > 0, ``alibi_slopes`` (fp32 (Hq,) or (B, Hq)),
    ``dropout_p`` with ``seed``/``offset`` (see :func:`dropout_mask`), and varlen: packed
    (total, H, D) q/k/v/out with int32 ``cu_seqlens_q``/``cu_seqlens_k`` and the maximum
    lengths; the log-sum-exp is then (heads_q, total_q). ``deterministic`` is accepted and
    changes nothing: the forward has no atomics, every config is reproducible."""
    del deterministic
    cfg = _as_config(config, "fwd")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_shapes(q, k, v, varlen)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q: {tuple(out.shape)} {out.dtype}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    feat = _features(q, k, causal=causal, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    rows = _lse_rows(q, varlen)
    if lse is None:
        lse = torch.empty(rows, device=q.device, dtype=torch.float32)
    elif tuple(lse.shape) != rows or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 {rows} tensor")
    if q.shape[0] == 0 or (varlen and feat.max_seqlen_q == 0):
        return lse
    _run(_fwd_plan(q, k, v, out, lse, cfg, bool(causal), scale, feat))
    return lse


def attention_backward(dout, q, k, v, out, lse, dq, dk, dv, *, config: BwdConfig | str,
                       causal: bool, scale: float, window=(-1, -1), softcap: float = 0.0,
                       alibi_slopes=None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, deterministic: bool = False) -> None:
    """Write the gradients of the forward into ``dq``, ``dk``, ``dv`` (any strides with a
    contiguous last dimension; dk/dv have kv heads, summed over each GQA group). The feature
    arguments must be those of the forward (dropout regenerates its mask from seed and offset).
    ``deterministic=True`` needs a config without atomic dQ (then the gradients are bitwise
    reproducible: every sum has a fixed order)."""
    cfg = _as_config(config, "bwd")
    if deterministic and cfg.dq_atomic:
        raise ValueError(
            f"{cfg.name} adds dQ with float atomics, whose order varies run to run: "
            f"deterministic=True needs a config without _dqatomic (e.g. "
            f"{cfg.name.removesuffix('_dqatomic')})")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    _check_shapes(q, k, v, varlen)
    for name, grad, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v), ("dout", dout, q),
                            ("out", out, q)):
        if grad.shape != ref.shape or grad.dtype != ref.dtype:
            raise ValueError(f"{name} must have the shape and dtype of its input: "
                             f"{tuple(grad.shape)} {grad.dtype} vs {tuple(ref.shape)} {ref.dtype}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    feat = _features(q, k, causal=causal, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    rows = _lse_rows(q, varlen)
    lse = lse.to(torch.float32).contiguous()
    if tuple(lse.shape) != rows:
        raise ValueError(f"lse must be {rows}, got {tuple(lse.shape)}")
    if varlen and (feat.max_seqlen_q == 0 or feat.max_seqlen_k == 0):
        # no query or no key anywhere: every gradient is zero (otherwise every row of every
        # sequence is written, zero where it sees nothing)
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    if q.shape[0] == 0:
        return
    delta = torch.empty(rows, device=q.device, dtype=torch.float32)
    if cfg.dq_atomic:
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    else:
        dq_acc = dq  # not read by the kernel; any tensor of the right kind
    for plan in _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, delta, dq_acc, cfg, bool(causal),
                          scale, feat):
        _run(plan)
    if cfg.dq_atomic:
        dq.copy_(dq_acc)


def dropout_mask(shape, dropout_p: float, seed: int, offset: int, *, device=None) -> torch.Tensor:
    """The keep mask the kernels apply for ``dropout_p``, ``seed`` and ``offset``: a bool tensor
    of ``shape``, True where a probability is kept (then scaled by 1 / (1 - dropout_p)).
    ``shape`` is the log-sum-exp's shape plus the keys: (B, Hq, Nq, Nk) for dense attention,
    (Hq, total_q, max_seqlen_k) for varlen, where row r of sequence b and key j (counted from
    the sequence's first key) is ``mask[h, r, j]``."""
    *rows_shape, ncols = (int(s) for s in shape)
    nrows = math.prod(rows_shape)
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if device is None:
        device = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
    keep = torch.empty((nrows, ncols), dtype=torch.int8, device=device)
    if keep.numel():
        block_m, block_n = (16, 16) if INTERPRET else (64, 64)
        grid = (triton.cdiv(nrows, block_m), triton.cdiv(ncols, block_n))
        _dropout_mask_kernel[grid](keep, nrows, ncols, _int32_word(dropout_key(seed, offset)),
                                   _int32_word(dropout_threshold(p)), BLOCK_M=block_m, BLOCK_N=block_n)
    return keep.view(torch.bool).reshape(*rows_shape, ncols)


# --------------------------------------------------------------------------------------------
# ahead-of-time compilation
# --------------------------------------------------------------------------------------------


def warmup(problem, configs: Iterable[Config | str]) -> dict[str, float]:
    """Compile ``configs`` for ``problem`` (a :class:`sparktune.problem.Problem`) without running
    anything; returns config name -> seconds spent compiling now. Kernels land in Triton's
    in-process and on-disk caches, so the first real call does not pay the compilation. Inputs
    are assumed to have the stride divisibility of contiguous (B, H, N, D) tensors (another
    layout may compile once more). A no-op under the interpreter."""
    timings: dict[str, float] = {}
    for config in configs:
        cfg = _as_config(config, problem.op)
        timings[cfg.name] = sum(_run(plan, warmup=True) or 0.0 for plan in _spec_plans(problem, cfg))
    return timings


#: the launch options of a kernel call that are compile options, not kernel parameters
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def compile_launch_offline(fn, args, kwargs: dict, arch: int):
    """Compile the kernel of the launch ``fn[grid](*args, **kwargs)`` for the NVIDIA GPU
    ``sm_<arch>`` without needing one (Triton's compiler and its bundled ptxas), specialised on
    the arguments as a launch would be; returns Triton's compiled kernel (its ``asm`` holds the
    PTX and the cubin)."""
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import native_specialize_impl

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = {key: kwargs[key] for key in _LAUNCH_OPTIONS if key in kwargs}
    values = dict(zip((p.name for p in fn.params), args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k not in options})
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
            continue
        ty, attr = native_specialize_impl(BaseBackend, value, param.is_const,
                                          not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)
        signature[param.name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options)


def compile_offline(problem, config: Config | str, arch: int) -> list[dict]:
    """Compile ``config``'s kernels for ``problem`` for the NVIDIA GPU ``sm_<arch>`` without
    needing one (Triton's compiler and its bundled ptxas). Returns, per kernel, its name, the
    shared memory Triton allocates (bytes), registers per thread and stack bytes per thread
    (spills; both from the cubin, when Triton's cuobjdump is found) and the seconds taken. For checking the support
    rules; nothing is loaded on a device (Triton's on-disk cache is used as usual)."""
    cfg = _as_config(config, problem.op)
    results = []
    for plan in _spec_plans(problem, cfg):
        fn = plan.kernel
        t0 = time.perf_counter()
        compiled = compile_launch_offline(fn, plan.args, plan.kwargs, arch)
        seconds = time.perf_counter() - t0
        regs, spilled = _resource_usage(compiled.asm.get("cubin"))
        results.append(dict(kernel=getattr(fn, "__name__", plan.label[1]), shared=compiled.metadata.shared, regs=regs,
                            spilled=spilled, seconds=seconds))
    return results


def _resource_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers per thread, stack + local bytes per thread) of a cubin's kernel, read with the
    cuobjdump that ships with Triton; (None, None) when it cannot be read."""
    import re
    import subprocess
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None, None
    # the last function listed is the kernel (helpers are inlined); spills land on the stack
    regs = re.findall(r"REG:(\d+)", text)
    stack = re.findall(r"STACK:(\d+)", text)
    local = re.findall(r"LOCAL:(\d+)", text)
    if not regs:
        return None, None
    spilled = int(stack[-1]) if stack else 0
    spilled += int(local[-1]) if local else 0
    return int(regs[-1]), spilled
