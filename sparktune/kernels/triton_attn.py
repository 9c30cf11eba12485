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

from ..dtypes import DTYPE_NAMES
from .triton_space import BwdConfig, Config, FwdConfig, padded_head_dim, parse_config

__all__ = [
    "attention_forward",
    "attention_backward",
    "warmup",
    "compiled_labels",
    "compile_offline",
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

# Sequence lengths and the GQA group size vary per call and are never specialised on
# (otherwise every odd length would compile a new kernel); strides are, since their
# divisibility decides vectorised loads.
_RUNTIME_INTS = ["seqlen_q", "seqlen_k", "group"]


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


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, lo, hi, rows, seqlen_q,
               seqlen_k, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    diag = seqlen_k - seqlen_q
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            visible = cols[None, :] < seqlen_k
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diag)
            s = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen no key yet keeps m = -inf: subtract 0 instead (p = 0, alpha = 0)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _fwd_kernel(
    Q, K, V, Out, LSE,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    seqlen_q, seqlen_k, group, qk_scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL:
        # the last row blocks see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads_q = tl.num_programs(1)
    hk = h // group

    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    q = _load_tile(q_base + rows[:, None] * stride_qn + offs_d[None, :], rows, seqlen_q, offs_d,
                   True, HEAD_DIM, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    full_end, end = _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, 0,
                               full_end, rows, seqlen_q, seqlen_k, qk_scale, False, CAUSAL,
                               HEAD_DIM, BLOCK_D, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, full_end,
                               end, rows, seqlen_q, seqlen_k, qk_scale, True, CAUSAL, HEAD_DIM,
                               BLOCK_D, BLOCK_N)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_base = Out + b * stride_ob + h * stride_oh
    _store_tile(o_base + rows[:, None] * stride_on + offs_d[None, :],
                out.to(Out.dtype.element_ty), rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    lse_base = LSE + (b * heads_q + h) * seqlen_q
    tl.store(lse_base + rows, lse, mask=rows < seqlen_q)


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
                    MASK_ROWS: tl.constexpr, MASK_CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Add the contribution of query rows [lo, hi) to the dK, dV tiles of key columns ``cols``.
    Works on transposed scores (keys x queries) so that no large tile is transposed."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    diag = seqlen_k - seqlen_q
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
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
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])
        if MASK_ROWS or MASK_CAUSAL:
            keep = cols[:, None] >= 0
            if MASK_ROWS:
                keep = keep & (rows[None, :] < seqlen_q)
            if MASK_CAUSAL:
                keep = keep & (cols[:, None] <= rows[None, :] + diag)
            pT = tl.where(keep, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
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


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DQ_ACC,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqn,
    seqlen_q, seqlen_k, group, qk_scale, scale,
    CAUSAL: tl.constexpr, DQ_ATOMIC: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_N key rows of one kv head, dK and dV summed over the query heads of
    its group and over every query row that sees them."""
    start_n = tl.program_id(0) * BLOCK_N
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads_q = tl.num_programs(1) * group
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    k = _load_tile(K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
                   cols, seqlen_k, offs_d, True, HEAD_DIM, BLOCK_D)
    v = _load_tile(V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_d[None, :],
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

    for g in range(0, group):
        h = hk * group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        dq_base = DQ_ACC + b * stride_dqb + h * stride_dqh
        lse_base = LSE + (b * heads_q + h) * seqlen_q
        delta_base = DELTA + (b * heads_q + h) * seqlen_q
        if CAUSAL:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                     delta_base, stride_qn, stride_don, stride_dqn, lo,
                                     tl.minimum(mid, seqlen_q), seqlen_q, seqlen_k, qk_scale,
                                     scale, True, True, DQ_ATOMIC, HEAD_DIM, BLOCK_D, BLOCK_M)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                 delta_base, stride_qn, stride_don, stride_dqn, mid, rows_full_end,
                                 seqlen_q, seqlen_k, qk_scale, scale, False, False, DQ_ATOMIC,
                                 HEAD_DIM, BLOCK_D, BLOCK_M)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, cols, q_base, do_base, dq_base, lse_base,
                                 delta_base, stride_qn, stride_don, stride_dqn, tail, seqlen_q,
                                 seqlen_q, seqlen_k, qk_scale, scale, True, False, DQ_ATOMIC,
                                 HEAD_DIM, BLOCK_D, BLOCK_M)

    dk = dk * scale
    _store_tile(DK + b * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :],
                dk.to(DK.dtype.element_ty), cols, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)
    _store_tile(DV + b * stride_dvb + hk * stride_dvh + cols[:, None] * stride_dvn + offs_d[None, :],
                dv.to(DV.dtype.element_ty), cols, seqlen_k, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn, lo, hi,
                  seqlen_q, seqlen_k, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    diag = seqlen_k - seqlen_q
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_base + cols[:, None] * stride_kn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_base + cols[:, None] * stride_vn + offs_d[None, :], cols, seqlen_k,
                       offs_d, MASKED, HEAD_DIM, BLOCK_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        if MASKED:
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + diag)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = tl.dot(ds, k, dq)
    return dq


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    seqlen_q, seqlen_k, group, qk_scale, scale,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one head; streams the keys it sees (no atomics)."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    heads_q = tl.num_programs(1)
    hk = h // group
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = _load_tile(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :],
                   rows, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)
    do = _load_tile(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don
                    + offs_d[None, :], rows, seqlen_q, offs_d, True, HEAD_DIM, BLOCK_D)
    row_base = (b * heads_q + h) * seqlen_q
    lse2 = tl.load(LSE + row_base + rows, mask=rows < seqlen_q, other=0.0) * _LOG2E
    delta = tl.load(DELTA + row_base + rows, mask=rows < seqlen_q, other=0.0)

    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full_end, end = _key_ranges(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn, 0,
                       full_end, seqlen_q, seqlen_k, qk_scale, False, CAUSAL, HEAD_DIM, BLOCK_D,
                       BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, rows, k_base, v_base, stride_kn, stride_vn,
                       full_end, end, seqlen_q, seqlen_k, qk_scale, True, CAUSAL, HEAD_DIM,
                       BLOCK_D, BLOCK_N)
    dq = dq * scale
    _store_tile(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :],
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


def _dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _fwd_plan(q, k, v, out, lse, cfg: FwdConfig, causal: bool, scale: float) -> _Launch:
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    return _Launch(
        _fwd_kernel,
        (triton.cdiv(seqlen_q, cfg.block_m), heads_q, batch),
        (cfg.name, "fwd", _dtype_name(q), head_dim, causal),
        (q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
         seqlen_q, seqlen_k, heads_q // heads_kv, scale * LOG2E),
        dict(CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
             num_stages=cfg.num_stages),
    )


def _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, delta, dq_acc, cfg: BwdConfig, causal: bool,
              scale: float) -> list[_Launch]:
    """The backward's launches in order: row sums, dK/dV (with atomic dQ into ``dq_acc``, or
    not), then the dQ kernel when dQ is not atomic."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    block_d = padded_head_dim(head_dim)
    dtype = _dtype_name(q)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    plans = [
        _Launch(
            _bwd_preprocess,
            (triton.cdiv(seqlen_q, _PRE_BLOCK_M), heads_q, batch),
            ("bwd_preprocess", "bwd", dtype, head_dim),
            (out, dout, delta, *_strides(out), *_strides(dout), seqlen_q),
            dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=_PRE_BLOCK_M, num_warps=_PRE_WARPS),
        ),
        _Launch(
            _bwd_dkdv_kernel,
            (triton.cdiv(seqlen_k, cfg.block_n), heads_kv, batch),
            (cfg.name, "bwd_dkdv", dtype, head_dim, causal),
            (q, k, v, dout, dk, dv, lse, delta, dq_acc, *_strides(q), *_strides(k), *_strides(v),
             *_strides(dout), *_strides(dk), *_strides(dv), *_strides(dq_acc), seqlen_q, seqlen_k,
             group, scale * LOG2E, scale),
            dict(CAUSAL=causal, DQ_ATOMIC=cfg.dq_atomic, HEAD_DIM=head_dim, BLOCK_D=block_d,
                 BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **launch),
        ),
    ]
    if not cfg.dq_atomic:
        # the mirror image of the dK/dV kernel: block_n query rows held, keys by block_m
        plans.append(_Launch(
            _bwd_dq_kernel,
            (triton.cdiv(seqlen_q, cfg.block_n), heads_q, batch),
            (cfg.name, "bwd_dq", dtype, head_dim, causal),
            (q, k, v, dout, dq, lse, delta, *_strides(q), *_strides(k), *_strides(v),
             *_strides(dout), *_strides(dq), seqlen_q, seqlen_k, group, scale * LOG2E, scale),
            dict(CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_n,
                 BLOCK_N=cfg.block_m, **launch),
        ))
    return plans


def _spec_plans(problem, cfg: Config) -> list[_Launch]:
    """The launches of ``cfg`` for ``problem`` with contiguous (B, H, N, D) stand-ins: the
    same specialisation as the (B, N, H, D) layout whenever head_dim is a multiple of 16."""
    dtype = getattr(torch, problem.dtype)
    f32 = torch.float32
    b, hq, hk, nq, nk, d = (problem.batch, problem.heads_q, problem.heads_kv, problem.seqlen_q,
                            problem.seqlen_k, problem.head_dim)

    q, out = _Spec(dtype, (b, hq, nq, d)), _Spec(dtype, (b, hq, nq, d))
    k, v = _Spec(dtype, (b, hk, nk, d)), _Spec(dtype, (b, hk, nk, d))
    lse = _Spec(f32, (b, hq, nq))
    causal = bool(problem.causal)
    if cfg.op == "fwd":
        return [_fwd_plan(q, k, v, out, lse, cfg, causal, 1.0)]
    dq_acc = _Spec(f32, (b, hq, nq, d)) if cfg.dq_atomic else q
    return _bwd_plan(q, q, k, v, out, lse, q, k, v, _Spec(f32, (b, hq, nq)), dq_acc, cfg, causal,
                     1.0)


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


def _check_shapes(q, k, v) -> None:
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


def attention_forward(q, k, v, out, lse=None, *, config: FwdConfig | str, causal: bool,
                      scale: float) -> torch.Tensor:
    """Write softmax(scale * q k^T) v into ``out`` and return the float32 log-sum-exp
    (batch, heads_q, seqlen_q) (written into ``lse`` when given, which must be contiguous)."""
    cfg = _as_config(config, "fwd")
    _check_shapes(q, k, v)
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q: {tuple(out.shape)} {out.dtype}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    rows = q.shape[:3]
    if lse is None:
        lse = torch.empty(rows, device=q.device, dtype=torch.float32)
    elif lse.shape != rows or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError("lse must be a contiguous float32 (batch, heads_q, seqlen_q) tensor")
    _run(_fwd_plan(q, k, v, out, lse, cfg, bool(causal), scale))
    return lse


def attention_backward(dout, q, k, v, out, lse, dq, dk, dv, *, config: BwdConfig | str,
                       causal: bool, scale: float) -> None:
    """Write the gradients of the forward into ``dq``, ``dk``, ``dv`` (any strides with a
    contiguous last dimension; dk/dv have kv heads, summed over each GQA group)."""
    cfg = _as_config(config, "bwd")
    _check_shapes(q, k, v)
    for name, grad, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v), ("dout", dout, q),
                            ("out", out, q)):
        if grad.shape != ref.shape or grad.dtype != ref.dtype:
            raise ValueError(f"{name} must have the shape and dtype of its input: "
                             f"{tuple(grad.shape)} {grad.dtype} vs {tuple(ref.shape)} {ref.dtype}")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    rows = q.shape[:3]
    lse = lse.to(torch.float32).contiguous()
    if lse.shape != rows:
        raise ValueError(f"lse must be (batch, heads_q, seqlen_q), got {tuple(lse.shape)}")
    delta = torch.empty(rows, device=q.device, dtype=torch.float32)
    if cfg.dq_atomic:
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    else:
        dq_acc = dq  # not read by the kernel; any tensor of the right kind
    for plan in _bwd_plan(dout, q, k, v, out, lse, dq, dk, dv, delta, dq_acc, cfg, bool(causal),
                          scale):
        _run(plan)
    if cfg.dq_atomic:
        dq.copy_(dq_acc)


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


def compile_offline(problem, config: Config | str, arch: int) -> list[dict]:
    """Compile ``config``'s kernels for ``problem`` for the NVIDIA GPU ``sm_<arch>`` without
    needing one (Triton's compiler and its bundled ptxas). Returns, per kernel, its name, the
    shared memory Triton allocates (bytes), registers per thread and stack bytes per thread
    (spills; both from the cubin, when Triton's cuobjdump is found) and the seconds taken. For checking the support
    rules; nothing is loaded on a device (Triton's on-disk cache is used as usual)."""
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import native_specialize_impl

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    cfg = _as_config(config, problem.op)
    results = []
    for plan in _spec_plans(problem, cfg):
        fn = plan.kernel
        options = {key: plan.kwargs[key] for key in ("num_warps", "num_stages") if key in plan.kwargs}
        values = dict(zip((p.name for p in fn.params), plan.args, strict=False))
        values.update({k: v for k, v in plan.kwargs.items() if k not in options})
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
        t0 = time.perf_counter()
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options)
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
