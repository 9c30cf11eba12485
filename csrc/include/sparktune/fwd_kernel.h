// The forward kernel: one thread block per (query row block, head, batch). The Q tile stays in
// shared memory, K/V tiles stream through it (next tile in flight while the current one is
// used), the softmax is computed online and O is written once.
#pragma once

#include <cmath>

#include "fragment.h"
#include "fwd_traits.h"
#include "params.h"

namespace sparktune {

using namespace cute;

constexpr float kLn2 = 0.69314718055994530942f;

// Global -> shared copy of one tile. With kCheckRows, rows past `rows_left` are zero-filled;
// without, the whole tile is known to be in bounds and no predicate is evaluated.
template <bool kCheckRows = true, class TiledCopy, class Src, class Dst, class Coord>
CUTE_DEVICE void copy_tile_rows(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                Coord const& coord, int rows_left) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (!kCheckRows || get<0>(coord(0, m, 0)) < rows_left) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) cute::copy(tiled_copy, src(_, m, k), dst(_, m, k));
    } else {
      cute::clear(dst(_, m, _));
    }
  }
}

// acc += A * B with both operands read from shared memory, one k-slice ahead.
template <class TiledMma, class Acc, class RA, class RB, class SA, class SB, class CopyA,
          class ThrCopyA, class CopyB, class ThrCopyB>
CUTE_DEVICE void gemm_ss(TiledMma& mma, Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB,
                         CopyA const& copy_a, ThrCopyA const& thr_a, CopyB const& copy_b,
                         ThrCopyB const& thr_b) {
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  constexpr int kSlices = decltype(size<2>(rA))::value;
  cute::copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  cute::copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < kSlices; ++i) {
    if (i + 1 < kSlices) {
      cute::copy(copy_a, sA(_, _, i + 1), rA_view(_, _, i + 1));
      cute::copy(copy_b, sB(_, _, i + 1), rB_view(_, _, i + 1));
    }
    cute::gemm(mma, rA(_, _, i), rB(_, _, i), acc);
  }
}

// acc += A * B with A already in registers.
template <class TiledMma, class Acc, class RA, class RB, class SB, class CopyB, class ThrCopyB>
CUTE_DEVICE void gemm_rs(TiledMma& mma, Acc& acc, RA const& rA, RB& rB, SB const& sB,
                         CopyB const& copy_b, ThrCopyB const& thr_b) {
  Tensor rB_view = thr_b.retile_D(rB);
  constexpr int kSlices = decltype(size<2>(rA))::value;
  cute::copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int i = 0; i < kSlices; ++i) {
    if (i + 1 < kSlices) cute::copy(copy_b, sB(_, _, i + 1), rB_view(_, _, i + 1));
    cute::gemm(mma, rA(_, _, i), rB(_, _, i), acc);
  }
}

// The S accumulator as fp32: itself when it already is, else a converted copy.
template <class Acc>
CUTE_DEVICE decltype(auto) as_float(Acc& acc) {
  if constexpr (std::is_same_v<typename Acc::value_type, float>) {
    return (acc);
  } else {
    Tensor s = make_tensor<float>(acc.layout());
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = static_cast<float>(acc(i));
    return s;
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    fwd_kernel(__grid_constant__ const FwdParams p) {
  using T = typename Traits::Element;
  using Family = typename Traits::Family;
  using AccO = typename Traits::ElementAccum;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr bool kAsync = Family::kAsyncCopy;
  constexpr float kNegInf = -INFINITY;

  extern __shared__ __align__(128) char smem[];

  // the last row blocks see the most keys under a causal mask: schedule them first
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;
  const int kv_head = head / p.group;
  const int row0 = m_block * kBlockM;
  const int diag = p.seqlen_k - p.seqlen_q;  // causal: row i sees column j iff j <= i + diag

  // Key blocks this row block sees; they are visited last to first, so the masked ones
  // (the tail and the diagonal) come first.
  int n_blocks = ceil_div(p.seqlen_k, kBlockN);
  if (p.causal) {
    const int last_col = min(p.seqlen_k - 1, row0 + kBlockM - 1 + diag);
    n_blocks = last_col < 0 ? 0 : min(n_blocks, last_col / kBlockN + 1);
  }

  // ---- global tensors ----
  T const* q_ptr = static_cast<T const*>(p.q) + batch * p.q_batch_stride + head * p.q_head_stride;
  T const* k_ptr = static_cast<T const*>(p.k) + batch * p.k_batch_stride + kv_head * p.k_head_stride;
  T const* v_ptr = static_cast<T const*>(p.v) + batch * p.v_batch_stride + kv_head * p.v_head_stride;
  T* o_ptr = static_cast<T*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
  auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  Tensor gQ = local_tile(make_tensor(make_gmem_ptr(q_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}),
                                     make_stride(p.q_row_stride, _1{})),
                         tile_q, make_coord(m_block, 0));
  Tensor gK = local_tile(make_tensor(make_gmem_ptr(k_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}),
                                     make_stride(p.k_row_stride, _1{})),
                         tile_kv, make_coord(_, 0));  // (BN, D, n)
  Tensor gV = local_tile(make_tensor(make_gmem_ptr(v_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}),
                                     make_stride(p.v_row_stride, _1{})),
                         tile_kv, make_coord(_, 0));
  Tensor gO = local_tile(make_tensor(make_gmem_ptr(o_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}),
                                     make_stride(p.o_row_stride, _1{})),
                         tile_q, make_coord(m_block, 0));

  // ---- shared tensors ----
  T* smem_q = reinterpret_cast<T*>(smem);
  T* smem_k = smem_q + kBlockM * kHeadDim;
  T* smem_v = smem_k + kBlockN * kHeadDim;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVt{});
  // kShared softmax only: S (fp32, padded rows), P, and one float per row
  float* smem_s = reinterpret_cast<float*>(smem + Traits::kSmemQ + Traits::kSmemKV);
  T* smem_p = reinterpret_cast<T*>(smem + Traits::kSmemQ + Traits::kSmemKV + Traits::kSmemS);
  float* smem_row = reinterpret_cast<float*>(smem + Traits::kSmemQ + Traits::kSmemKV +
                                             Traits::kSmemS + Traits::kSmemP);

  // ---- global -> shared copies ----
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(tile_q));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(tile_kv));

  // ---- MMA partitions and shared -> register copies ----
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
  Tensor acc_o = partition_fragment_C(tiled_mma, tile_q);
  clear(acc_o);

  auto s2r_q = make_tiled_copy_A(typename Family::SmemCopyAtom{}, tiled_mma);
  auto s2r_q_thr = s2r_q.get_thread_slice(tid);
  Tensor tSsQ = s2r_q_thr.partition_S(sQ);
  auto s2r_k = make_tiled_copy_B(typename Family::SmemCopyAtom{}, tiled_mma);
  auto s2r_k_thr = s2r_k.get_thread_slice(tid);
  Tensor tSsK = s2r_k_thr.partition_S(sK);
  auto s2r_v = make_tiled_copy_B(typename Family::SmemCopyAtomTransposed{}, tiled_mma);
  auto s2r_v_thr = s2r_v.get_thread_slice(tid);
  Tensor tOsVt = s2r_v_thr.partition_S(sVt);

  // coordinates (row, col) of every accumulator element this thread holds
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(tile_q));

  // ---- softmax state ----
  // kRegisters: one (max, sum) per accumulator row this thread holds; the sum is the thread's
  // partial sum, reduced over the row's lanes at the end. kShared: one per row it owns there.
  constexpr int kStateRows = [] {
    if constexpr (Traits::kRegSoftmax) {
      return int(decltype(size<0>(rowcol_view(decltype(tScS.layout()){})))::value);
    } else {
      return kBlockM / Traits::kRowsPerPass;
    }
  }();
  float row_max[kStateRows];
  float row_sum[kStateRows];
  CUTE_UNROLL
  for (int r = 0; r < kStateRows; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.f;
  }
  const float scale_log2 = p.scale_log2;

  if (n_blocks > 0) {
    copy_tile_rows(gmem_copy, tQgQ, tQsQ, tQcQ, p.seqlen_q - row0);
    const int n_last = n_blocks - 1;
    copy_tile_rows(gmem_copy, tKgK(_, _, _, n_last), tKsK, tKVcKV, p.seqlen_k - n_last * kBlockN);
    if constexpr (kAsync) cp_async_fence();
  }

  // One key block. kMask: the block holds the key tail or crosses the causal diagonal. Masked
  // and unmasked blocks run as separate loops so that the unmasked ones carry no mask code.
  // Always inlined where it is called directly (Volta, below); other families call it through
  // `step_call`.
  auto step = [&](const int n, auto mask_tag) __attribute__((always_inline)) {
    constexpr bool kMask = decltype(mask_tag)::value;
    if constexpr (kAsync) cp_async_wait<0>();
    __syncthreads();  // K[n] is in shared memory; everyone is done with V[n+1] and P
    // only the last key block can hold the tail, and it is always a masked one
    copy_tile_rows<kMask>(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, p.seqlen_k - n * kBlockN);
    if constexpr (kAsync) cp_async_fence();

    // S = Q K^T
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, s2r_q, s2r_q_thr, s2r_k, s2r_k_thr);
    decltype(auto) s = as_float(acc_s);

    // mask the key tail and, when causal, what lies above the diagonal
    if constexpr (kMask) {
      const int col0 = n * kBlockN;
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) {
        const int col = col0 + get<1>(tScS(i));
        const int row = row0 + get<0>(tScS(i));
        if (col >= p.seqlen_k || (p.causal && col > row + diag)) s(i) = kNegInf;
      }
    }

    if constexpr (!Traits::kRegSoftmax) {
      // S -> shared memory; each row is then reduced by the kRowThreads lanes that own it
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) {
        smem_s[get<0>(tScS(i)) * Traits::kSRowPitch + get<1>(tScS(i))] = s(i);
      }
    }

    // V[n] has landed and everyone is done with K[n] (and, for kShared, S is visible): start
    // K[n-1] now so that it streams in while the softmax and P.V run
    if constexpr (kAsync) cp_async_wait<0>();
    __syncthreads();
    if (n > 0) {
      copy_tile_rows<false>(gmem_copy, tKgK(_, _, _, n - 1), tKsK, tKVcKV, 0);
      if constexpr (kAsync) cp_async_fence();
    }

    if constexpr (Traits::kRegSoftmax) {
      Tensor s_rc = make_tensor(s.data(), rowcol_view(s.layout()));
      Tensor o_rc = make_tensor(acc_o.data(), rowcol_view(acc_o.layout()));
      CUTE_UNROLL
      for (int r = 0; r < kStateRows; ++r) {
        // the four lanes of a quad share a row
        const float mx = allreduce_xor<2>(row_max_of(s_rc, r, row_max[r]), MaxOp{});
        float alpha;
        const float base = softmax_row_step(row_max[r], mx, scale_log2, alpha);
        const float sum = exp2_row(s_rc, r, scale_log2, base);
        row_sum[r] = row_sum[r] * alpha + sum;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) {
          o_rc(r, c) = static_cast<AccO>(static_cast<float>(o_rc(r, c)) * alpha);
        }
      }
    } else {
      constexpr int kRT = Traits::kRowThreads;
      Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutP{});
      const int lane_in_row = tid % kRT;
      CUTE_UNROLL
      for (int rr = 0; rr < kStateRows; ++rr) {
        const int r = tid / kRT + rr * Traits::kRowsPerPass;
        float const* srow = smem_s + r * Traits::kSRowPitch;
        float mx = row_max[rr];
        CUTE_UNROLL
        for (int c = lane_in_row; c < kBlockN; c += kRT) mx = fmaxf(mx, srow[c]);
        mx = allreduce_xor<kRT / 2>(mx, MaxOp{});
        float alpha;
        const float base = softmax_row_step(row_max[rr], mx, scale_log2, alpha);
        float sum = 0.f;
        CUTE_UNROLL
        for (int c = lane_in_row; c < kBlockN; c += kRT) {
          const float e = exp2f(fmaf(srow[c], scale_log2, -base));
          sP(r, c) = static_cast<T>(e);
          sum += e;
        }
        row_sum[rr] = row_sum[rr] * alpha + sum;
        if (lane_in_row == 0) smem_row[r] = alpha;
      }
      __syncthreads();  // P and the row rescale factors are visible
    }

    // O += P V
    if constexpr (Traits::kRegSoftmax) {
      Tensor rP = convert_fragment<T>(s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(rP.layout()));
      gemm_rs(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, s2r_v, s2r_v_thr);
    } else {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_o); ++i) {
        acc_o(i) = static_cast<AccO>(static_cast<float>(acc_o(i)) * smem_row[get<0>(tOcO(i))]);
      }
      Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutP{});
      Tensor tOrP = thr_mma.partition_fragment_A(sP);
      auto s2r_p = make_tiled_copy_A(typename Family::SmemCopyAtom{}, tiled_mma);
      auto s2r_p_thr = s2r_p.get_thread_slice(tid);
      Tensor tOsP = s2r_p_thr.partition_S(sP);
      gemm_ss(tiled_mma, acc_o, tOrP, tOrVt, tOsP, tOsVt, s2r_p, s2r_p_thr, s2r_v, s2r_v_thr);
    }
  };

  auto needs_mask = [&](int n) {
    return (n + 1) * kBlockN > p.seqlen_k || (p.causal && (n + 1) * kBlockN - 1 > row0 + diag);
  };
  // Volta calls `step` directly: left to itself, the compiler keeps the masked step as a call
  // there, and everything it captures by reference (the accumulators, the fragments) then lives
  // in local memory. Other families call it through a plain lambda, which leaves the inlining
  // to the compiler.
  auto step_call = [&](const int n, auto mask_tag) { step(n, mask_tag); };
  int n = n_blocks - 1;
  if constexpr (Family::kFamily == 70) {
    for (; n >= 0 && needs_mask(n); --n) step(n, cute::true_type{});
    for (; n >= 0; --n) step(n, cute::false_type{});
  } else {
    for (; n >= 0 && needs_mask(n); --n) step_call(n, cute::true_type{});
    for (; n >= 0; --n) step_call(n, cute::false_type{});
  }

  // ---- epilogue: O /= rowsum, log-sum-exp, O written once ----
  float* lse_ptr = p.lse + (int64_t(batch) * p.heads_q + head) * p.seqlen_q;
  if constexpr (Traits::kRegSoftmax) {
    Tensor o_rc = make_tensor(acc_o.data(), rowcol_view(acc_o.layout()));
    Tensor c_rc = make_tensor(tScS.data(), rowcol_view(tScS.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kStateRows; ++r) {
      const float sum = allreduce_xor<2>(row_sum[r], SumOp{});
      const bool empty = !(sum > 0.f);  // no visible key in this row
      const float inv = empty ? 0.f : 1.f / sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) {
        o_rc(r, c) = static_cast<AccO>(static_cast<float>(o_rc(r, c)) * inv);
      }
      if (get<1>(c_rc(r, 0)) == 0) {  // the lane holding column 0 writes the row's statistic
        const int row = row0 + get<0>(c_rc(r, 0));
        if (row < p.seqlen_q) {
          lse_ptr[row] = empty ? kNegInf : (row_max[r] * scale_log2 + log2f(sum)) * kLn2;
        }
      }
    }
  } else {
    constexpr int kRT = Traits::kRowThreads;
    const int lane_in_row = tid % kRT;
    __syncthreads();  // everyone is done reading the last alphas
    CUTE_UNROLL
    for (int rr = 0; rr < kStateRows; ++rr) {
      const int r = tid / kRT + rr * Traits::kRowsPerPass;
      const float sum = allreduce_xor<kRT / 2>(row_sum[rr], SumOp{});
      const bool empty = !(sum > 0.f);
      if (lane_in_row == 0) {
        smem_row[r] = empty ? 0.f : 1.f / sum;
        if (row0 + r < p.seqlen_q) {
          lse_ptr[row0 + r] = empty ? kNegInf : (row_max[rr] * scale_log2 + log2f(sum)) * kLn2;
        }
      }
    }
    __syncthreads();
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) {
      acc_o(i) = static_cast<AccO>(static_cast<float>(acc_o(i)) * smem_row[get<0>(tOcO(i))]);
    }
  }

  Tensor rO = convert_fragment<T>(acc_o);
  __syncthreads();  // sQ is free: its last reader was the final S product
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor tOsO_mma = thr_mma.partition_C(sO);
  cute::copy(rO, tOsO_mma);
  __syncthreads();
  typename Traits::GmemTiledCopyO gmem_copy_o;
  auto gmem_thr_o = gmem_copy_o.get_thread_slice(tid);
  Tensor tOsO = gmem_thr_o.partition_S(sO);
  Tensor tOgO = gmem_thr_o.partition_D(gO);
  Tensor tOcO_g = gmem_thr_o.partition_D(make_identity_tensor(tile_q));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tOsO); ++m) {
    if (row0 + get<0>(tOcO_g(0, m, 0)) < p.seqlen_q) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tOsO); ++k) cute::copy(gmem_copy_o, tOsO(_, m, k), tOgO(_, m, k));
    }
  }
}

}  // namespace sparktune
