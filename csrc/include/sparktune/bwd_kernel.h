// The backward kernels.
//
// 1. bwd_preprocess_kernel: D = rowsum(dO * O) per query row, and a zeroed fp32 dQ workspace.
// 2. bwd_kernel: one thread block per (key block, kv head, batch). K and V stay in shared
//    memory; for every query head of the kv head's group and every query row block that sees
//    the key block it recomputes S = Q K^T and P = exp2(S * scale_log2 - lse * log2(e)), then
//        dV += P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dK += dS^T Q,   dQ += dS K.
//    dK and dV stay in registers over the whole walk and are written once; dQ is added into the
//    fp32 workspace with atomics (other key blocks add to the same rows). P and dS go through
//    shared memory, from where every product reads them in the orientation it needs.
// 3. bwd_convert_dq_kernel: dQ = scale * workspace, in the input type, with dq's strides.
// (1 and 3 have packed-sequence variants, bwd_preprocess_packed_kernel and
// bwd_convert_dq_packed_kernel, for the family 90 backward.)
#pragma once

#include <cmath>

#include "bwd_traits.h"
#include "fragment.h"
#include "fwd_kernel.h"  // copy_tile_rows, gemm_ss, as_float
#include "params.h"

namespace sparktune {

using namespace cute;

constexpr float kLog2e = 1.44269504088896340736f;

// ---- the row kernels (preprocess and dQ conversion): kRowLanes lanes per query row, each
// moving 16 bytes per pass along the head dimension ----
constexpr int kRowKernelThreads = 128;
constexpr int kRowLanes = 8;
constexpr int kRowKernelRows = kRowKernelThreads / kRowLanes;

// One lane's share of a query row, for both layouts' kernels below: the partial rowsum(dO * O)
// over its columns (returned), and its columns of the row's fp32 dQ workspace zeroed.
template <class T>
CUTE_DEVICE float preprocess_row(T const* o, T const* dout, float* acc, int head_dim, int lane) {
  constexpr int kVec = 16 / sizeof(T);
  float sum = 0.f;
  for (int c = lane * kVec; c < head_dim; c += kVec * kRowLanes) {
    const uint4 o_raw = *reinterpret_cast<uint4 const*>(o + c);
    const uint4 do_raw = *reinterpret_cast<uint4 const*>(dout + c);
    T const* o_v = reinterpret_cast<T const*>(&o_raw);
    T const* do_v = reinterpret_cast<T const*>(&do_raw);
    CUTE_UNROLL
    for (int i = 0; i < kVec; ++i) sum = fmaf(float(o_v[i]), float(do_v[i]), sum);
  }
  for (int c = lane * 4; c < head_dim; c += 4 * kRowLanes) {
    *reinterpret_cast<float4*>(acc + c) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  return sum;
}

// 16 bytes of the input type T at out: scale * v[i] for the 16 / sizeof(T) floats of v.
template <class T>
CUTE_DEVICE void store_scaled16(float const* v, T* out, float scale) {
  constexpr int kVec = 16 / sizeof(T);
  uint4 raw;
  T* o = reinterpret_cast<T*>(&raw);
  CUTE_UNROLL
  for (int i = 0; i < kVec; ++i) o[i] = static_cast<T>(v[i] * scale);
  *reinterpret_cast<uint4*>(out) = raw;
}

// v[i] += src[i] for the kVec floats at src (16-byte aligned), in float4 loads.
template <int kVec>
CUTE_DEVICE void add_floats(float* v, float const* src) {
  CUTE_UNROLL
  for (int i = 0; i < kVec; i += 4) {
    const float4 a = *reinterpret_cast<float4 const*>(src + i);
    v[i + 0] += a.x;
    v[i + 1] += a.y;
    v[i + 2] += a.z;
    v[i + 3] += a.w;
  }
}

// One lane's columns of a query row of dQ: scale * workspace, in the input type.
template <class T>
CUTE_DEVICE void convert_dq_row(float const* acc, T* dq, int head_dim, float scale, int lane) {
  constexpr int kVec = 16 / sizeof(T);
  for (int c = lane * kVec; c < head_dim; c += kVec * kRowLanes) {
    float v[kVec] = {};
    add_floats<kVec>(v, acc + c);
    store_scaled16(v, dq + c, scale);
  }
}

template <class T>
__global__ void __launch_bounds__(kRowKernelThreads)
    bwd_preprocess_kernel(__grid_constant__ const BwdParams p) {
  const int row = blockIdx.x * kRowKernelRows + threadIdx.x / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const bool live = row < p.seqlen_q;
  const int64_t stat_row = (int64_t(batch) * p.heads_q + head) * p.seqlen_q + row;
  float sum = 0.f;
  if (live) {
    T const* o = static_cast<T const*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
                 row * p.o_row_stride;
    T const* dout = static_cast<T const*>(p.dout) + batch * p.do_batch_stride +
                    head * p.do_head_stride + row * p.do_row_stride;
    sum = preprocess_row(o, dout, p.dq_accum + stat_row * p.head_dim, p.head_dim, lane);
  }
  sum = allreduce_xor<kRowLanes / 2>(sum, SumOp{});
  if (live && lane == 0) p.dsum[stat_row] = sum;
}

template <class T>
__global__ void __launch_bounds__(kRowKernelThreads)
    bwd_convert_dq_kernel(__grid_constant__ const BwdParams p) {
  const int row = blockIdx.x * kRowKernelRows + threadIdx.x / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  if (row >= p.seqlen_q) return;
  float const* acc =
      p.dq_accum + ((int64_t(batch) * p.heads_q + head) * p.seqlen_q + row) * p.head_dim;
  T* dq = static_cast<T*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride +
          row * p.dq_row_stride;
  convert_dq_row(acc, dq, p.head_dim, p.scale, lane);
}

// The group split's sum (BwdParams::group_split): key row `row` of kv head blockIdx.y and batch
// blockIdx.z, dK = scale * (part 0 + part 1 + ...) and dV = part 0 + part 1 + ..., the parts
// added in order, in the input type with dk's and dv's strides.
template <class T>
__global__ void __launch_bounds__(kRowKernelThreads)
    bwd_sum_dkv_kernel(__grid_constant__ const BwdParams p) {
  const int row = blockIdx.x * kRowKernelRows + threadIdx.x / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  if (row >= p.seqlen_k) return;
  constexpr int kVec = 16 / sizeof(T);
  // (2, batch, heads_kv * split, seqlen_k, head_dim): part s of this head at head * split + s
  const int64_t which_elems = int64_t(p.batch) * p.heads_kv * p.group_split * p.seqlen_k * p.head_dim;
  const int64_t part_elems = int64_t(p.seqlen_k) * p.head_dim;
  const int64_t first =
      ((int64_t(batch) * p.heads_kv + head) * p.group_split * p.seqlen_k + row) * p.head_dim;
  CUTE_UNROLL
  for (int which = 0; which < 2; ++which) {
    float const* part = p.dkv_part + which * which_elems + first;
    T* out = which == 0 ? static_cast<T*>(p.dk) + batch * p.dk_batch_stride +
                              head * p.dk_head_stride + row * p.dk_row_stride
                        : static_cast<T*>(p.dv) + batch * p.dv_batch_stride +
                              head * p.dv_head_stride + row * p.dv_row_stride;
    const float scale = which == 0 ? p.scale : 1.f;
    for (int c = lane * kVec; c < p.head_dim; c += kVec * kRowLanes) {
      float sum[kVec] = {};
      for (int s = 0; s < p.group_split; ++s) add_floats<kVec>(sum, part + s * part_elems + c);
      store_scaled16(sum, out + c, scale);
    }
  }
}

// The same two row kernels for packed sequences (the family 90 backward's; BwdParams says
// how the tensors are laid out): the grid walks the packed rows (blockIdx.x) of every query
// head (blockIdx.y), which are each one row of some sequence, so neither needs cu_seqlens.
// D goes to dsum (heads_q, total_q) and the zeroed workspace is (total_q, heads_q, head_dim).
template <class T>
__global__ void __launch_bounds__(kRowKernelThreads)
    bwd_preprocess_packed_kernel(__grid_constant__ const BwdParams p) {
  const int row = blockIdx.x * kRowKernelRows + threadIdx.x / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const int head = blockIdx.y;
  const bool live = row < p.total_q;
  float sum = 0.f;
  if (live) {
    T const* o = static_cast<T const*>(p.o) + int64_t(row) * p.o_row_stride + head * p.o_head_stride;
    T const* dout =
        static_cast<T const*>(p.dout) + int64_t(row) * p.do_row_stride + head * p.do_head_stride;
    float* acc = p.dq_accum + (int64_t(row) * p.heads_q + head) * p.head_dim;
    sum = preprocess_row(o, dout, acc, p.head_dim, lane);
  }
  sum = allreduce_xor<kRowLanes / 2>(sum, SumOp{});
  if (live && lane == 0) p.dsum[int64_t(head) * p.total_q + row] = sum;
}

template <class T>
__global__ void __launch_bounds__(kRowKernelThreads)
    bwd_convert_dq_packed_kernel(__grid_constant__ const BwdParams p) {
  const int row = blockIdx.x * kRowKernelRows + threadIdx.x / kRowLanes;
  const int lane = threadIdx.x % kRowLanes;
  const int head = blockIdx.y;
  if (row >= p.total_q) return;
  float const* acc = p.dq_accum + (int64_t(row) * p.heads_q + head) * p.head_dim;
  T* dq = static_cast<T*>(p.dq) + int64_t(row) * p.dq_row_stride + head * p.dq_head_stride;
  convert_dq_row(acc, dq, p.head_dim, p.scale, lane);
}

// dq[r][c] += acc for the fragment's elements of rows below rows_left. Where two neighbouring
// elements of the fragment are neighbouring columns of one row (the m16n8k16 accumulator holds
// column pairs) and the GPU adds float2 atomically (sm_90 and later), a pair is one atomic.
template <int kHeadDim, class Acc, class Coord>
CUTE_DEVICE void add_dq(float* dq, Acc const& acc, Coord const& coord, int rows_left) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kPairs = decltype(size(acc))::value % 2 == 0;
#else
  constexpr bool kPairs = false;
#endif
  if constexpr (kPairs) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const int r = get<0>(coord(i)), c = get<1>(coord(i));
      if (get<0>(coord(i + 1)) == r && get<1>(coord(i + 1)) == c + 1 && c % 2 == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (r < rows_left) {
          atomicAdd(reinterpret_cast<float2*>(dq + r * kHeadDim + c),
                    make_float2(static_cast<float>(acc(i)), static_cast<float>(acc(i + 1))));
        }
#endif
      } else {
        CUTE_UNROLL
        for (int j = i; j < i + 2; ++j) {
          if (get<0>(coord(j)) < rows_left) {
            atomicAdd(dq + get<0>(coord(j)) * kHeadDim + get<1>(coord(j)),
                      static_cast<float>(acc(j)));
          }
        }
      }
    }
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const int r = get<0>(coord(i));
      if (r < rows_left) {
        atomicAdd(dq + r * kHeadDim + get<1>(coord(i)), static_cast<float>(acc(i)));
      }
    }
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads)
    bwd_kernel(__grid_constant__ const BwdParams p) {
  using T = typename Traits::Element;
  using Family = typename Traits::Family;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  constexpr bool kAsync = Family::kAsyncCopy;
  constexpr bool kAcc32 = Traits::kAcc32;
  // threads tid, tid + kThreads, ... below kBlockM load one query row's lse and D each
  constexpr int kStatIters = (kBlockM + kThreads - 1) / kThreads;

  extern __shared__ __align__(128) char smem[];

  const int n_block = blockIdx.x;  // under a causal mask the first key blocks are the heaviest
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tid = threadIdx.x;
  const int col0 = n_block * kBlockN;
  const int diag = p.seqlen_k - p.seqlen_q;  // causal: row i sees column j iff j <= i + diag

  // Query row blocks that see this key block: all, or under a causal mask those from the
  // first row i with col0 <= i + diag on. Masked blocks: every one when the key block holds the
  // key tail, else the ones crossing the diagonal ([m_begin, m_diag_end)) and the last one when
  // it holds the query tail. Each query head visits the masked blocks first, then the unmasked
  // ones, each kind in its own loop so that the unmasked blocks carry no mask code.
  const int m_end = ceil_div(p.seqlen_q, kBlockM);
  const int m_begin = p.causal ? max(0, col0 - diag) / kBlockM : 0;
  const bool row_tail = p.seqlen_q % kBlockM != 0;
  int m_diag_end = m_begin;
  if (col0 + kBlockN > p.seqlen_k) {
    m_diag_end = m_end;
  } else if (p.causal) {  // unmasked from the first m with col0 + kBlockN - 1 <= m * kBlockM + diag
    const int y = col0 + kBlockN - 1 - diag;
    m_diag_end = min(m_end, max(m_begin, y <= 0 ? 0 : ceil_div(y, kBlockM)));
  }
  const bool tail_apart = row_tail && m_diag_end < m_end;
  const int n_diag = m_diag_end - m_begin;
  const int n_masked = n_diag + (tail_apart ? 1 : 0);
  const int n_visits = m_end - m_begin;
  // the row block of a head's t-th visit
  auto visit_m = [&](int t) {
    return t < n_diag ? m_begin + t : t < n_masked ? m_end - 1 : m_diag_end + (t - n_masked);
  };

  // ---- shared memory ----
  T* smem_k = reinterpret_cast<T*>(smem);
  T* smem_v = smem_k + kBlockN * kHeadDim;
  T* smem_q = smem_v + kBlockN * kHeadDim;
  T* smem_do = smem_q + kBlockM * kHeadDim;
  T* smem_p = smem_do + kBlockM * kHeadDim;
  T* smem_ds = smem_p + kBlockM * kBlockN;
  float* smem_lse = reinterpret_cast<float*>(smem_ds + kBlockM * kBlockN);  // base 2, +inf: no key
  float* smem_dsum = smem_lse + kBlockM;
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQt{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutP{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutP{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPt{});

  // ---- global -> shared copies ----
  auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tQsdO = gmem_thr.partition_D(sdO);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(tile_q));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(tile_kv));

  // Q and dO of (query head g of the group, row block m); kCheckRows zero-fills the query tail
  auto load_q_do = [&](int g, int m, auto check_tag) {
    constexpr bool kCheckRows = decltype(check_tag)::value;
    const int head = kv_head * p.group + g;
    const int64_t row0 = int64_t(m) * kBlockM;
    T const* q_ptr = static_cast<T const*>(p.q) + batch * p.q_batch_stride +
                     head * p.q_head_stride + row0 * p.q_row_stride;
    T const* do_ptr = static_cast<T const*>(p.dout) + batch * p.do_batch_stride +
                      head * p.do_head_stride + row0 * p.do_row_stride;
    Tensor gQ = make_tensor(make_gmem_ptr(q_ptr), tile_q, make_stride(p.q_row_stride, _1{}));
    Tensor gdO = make_tensor(make_gmem_ptr(do_ptr), tile_q, make_stride(p.do_row_stride, _1{}));
    const int rows_left = p.seqlen_q - m * kBlockM;
    copy_tile_rows<kCheckRows>(gmem_copy, gmem_thr.partition_S(gQ), tQsQ, tQcQ, rows_left);
    copy_tile_rows<kCheckRows>(gmem_copy, gmem_thr.partition_S(gdO), tQsdO, tQcQ, rows_left);
    if constexpr (kAsync) cp_async_fence();
  };
  // lse (to base 2; +inf for rows past the end and rows with no visible key, so that their P is
  // exp2(-inf) = 0) and D of (g, m), into registers; stored to shared memory separately so that
  // the loads can be in flight during a product
  auto load_stats = [&](int g, int m, float (&lse)[kStatIters], float (&dsum)[kStatIters]) {
    const int head = kv_head * p.group + g;
    const int64_t base = (int64_t(batch) * p.heads_q + head) * p.seqlen_q;
    CUTE_UNROLL
    for (int i = 0; i < kStatIters; ++i) {
      const int r = tid + i * kThreads;
      const int row = m * kBlockM + r;
      lse[i] = INFINITY;
      dsum[i] = 0.f;
      if (r < kBlockM && row < p.seqlen_q) {
        const float l = p.lse[base + row];
        lse[i] = l == -INFINITY ? INFINITY : l * kLog2e;
        dsum[i] = p.dsum[base + row];
      }
    }
  };
  auto store_stats = [&](float const (&lse)[kStatIters], float const (&dsum)[kStatIters]) {
    CUTE_UNROLL
    for (int i = 0; i < kStatIters; ++i) {
      const int r = tid + i * kThreads;
      if (r < kBlockM) {
        smem_lse[r] = lse[i];
        smem_dsum[r] = dsum[i];
      }
    }
  };

  // ---- MMA partitions and shared -> register copies ----
  // S = Q K^T and dP = dO V^T
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tSrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tSrV = thr_sdp.partition_fragment_B(sV);
  auto s2r_sdp_a = make_tiled_copy_A(typename Family::SmemCopyAtom{}, mma_sdp);
  auto s2r_sdp_a_thr = s2r_sdp_a.get_thread_slice(tid);
  Tensor tSsQ = s2r_sdp_a_thr.partition_S(sQ);
  Tensor tSsdO = s2r_sdp_a_thr.partition_S(sdO);
  auto s2r_sdp_b = make_tiled_copy_B(typename Family::SmemCopyAtom{}, mma_sdp);
  auto s2r_sdp_b_thr = s2r_sdp_b.get_thread_slice(tid);
  Tensor tSsK = s2r_sdp_b_thr.partition_S(sK);
  Tensor tSsV = s2r_sdp_b_thr.partition_S(sV);
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tSsP = thr_sdp.partition_C(sP);
  Tensor tSsdS = thr_sdp.partition_C(sdS);

  // dV += P^T dO and dK += dS^T Q: every operand read transposed
  typename Traits::TiledMmaKV mma_kv;
  auto thr_kv = mma_kv.get_thread_slice(tid);
  Tensor tVrPt = thr_kv.partition_fragment_A(sPt);
  Tensor tVrdOt = thr_kv.partition_fragment_B(sdOt);
  Tensor tKrdSt = thr_kv.partition_fragment_A(sdSt);
  Tensor tKrQt = thr_kv.partition_fragment_B(sQt);
  auto s2r_kv_a = make_tiled_copy_A(typename Family::SmemCopyAtomTransposed{}, mma_kv);
  auto s2r_kv_a_thr = s2r_kv_a.get_thread_slice(tid);
  Tensor tVsPt = s2r_kv_a_thr.partition_S(sPt);
  Tensor tKsdSt = s2r_kv_a_thr.partition_S(sdSt);
  auto s2r_kv_b = make_tiled_copy_B(typename Family::SmemCopyAtomTransposed{}, mma_kv);
  auto s2r_kv_b_thr = s2r_kv_b.get_thread_slice(tid);
  Tensor tVsdOt = s2r_kv_b_thr.partition_S(sdOt);
  Tensor tKsQt = s2r_kv_b_thr.partition_S(sQt);
  // dK and dV totals: fp32 in either accumulation mode
  Tensor acc_dv = make_tensor<float>(partition_fragment_C(mma_kv, tile_kv).layout());
  Tensor acc_dk = make_tensor<float>(partition_fragment_C(mma_kv, tile_kv).layout());
  clear(acc_dv);
  clear(acc_dk);

  // dQ = dS K
  typename Traits::TiledMmaQ mma_q;
  auto thr_q = mma_q.get_thread_slice(tid);
  Tensor tQrdS = thr_q.partition_fragment_A(sdS);
  Tensor tQrKt = thr_q.partition_fragment_B(sKt);
  auto s2r_q_a = make_tiled_copy_A(typename Family::SmemCopyAtom{}, mma_q);
  auto s2r_q_a_thr = s2r_q_a.get_thread_slice(tid);
  Tensor tQsdS = s2r_q_a_thr.partition_S(sdS);
  auto s2r_q_b = make_tiled_copy_B(typename Family::SmemCopyAtomTransposed{}, mma_q);
  auto s2r_q_b_thr = s2r_q_b.get_thread_slice(tid);
  Tensor tQsKt = s2r_q_b_thr.partition_S(sKt);
  Tensor tQcdQ = thr_q.partition_C(make_identity_tensor(tile_q));

  // acc (fp32) += A B over one row block. With fp16 accumulation the MMAs of the row block
  // accumulate in fp16 and the block's product is then added to the fp32 total, so that the
  // sum over a long sequence is not rounded to fp16 at every step.
  auto accumulate_kv = [&](auto& acc, auto& rA, auto& rB, auto const& sA, auto const& sB) {
    if constexpr (kAcc32) {
      gemm_ss(mma_kv, acc, rA, rB, sA, sB, s2r_kv_a, s2r_kv_a_thr, s2r_kv_b, s2r_kv_b_thr);
    } else {
      Tensor part = partition_fragment_C(mma_kv, tile_kv);
      clear(part);
      gemm_ss(mma_kv, part, rA, rB, sA, sB, s2r_kv_a, s2r_kv_a_thr, s2r_kv_b, s2r_kv_b_thr);
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) acc(i) += static_cast<float>(part(i));
    }
  };

  // ---- K, V of this block and the first query block ----
  {
    T const* k_ptr = static_cast<T const*>(p.k) + batch * p.k_batch_stride +
                     kv_head * p.k_head_stride + int64_t(col0) * p.k_row_stride;
    T const* v_ptr = static_cast<T const*>(p.v) + batch * p.v_batch_stride +
                     kv_head * p.v_head_stride + int64_t(col0) * p.v_row_stride;
    Tensor gK = make_tensor(make_gmem_ptr(k_ptr), tile_kv, make_stride(p.k_row_stride, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(v_ptr), tile_kv, make_stride(p.v_row_stride, _1{}));
    copy_tile_rows(gmem_copy, gmem_thr.partition_S(gK), gmem_thr.partition_D(sK), tKVcKV,
                   p.seqlen_k - col0);
    copy_tile_rows(gmem_copy, gmem_thr.partition_S(gV), gmem_thr.partition_D(sV), tKVcKV,
                   p.seqlen_k - col0);
    load_q_do(0, visit_m(0), cute::true_type{});
    float lse[kStatIters], dsum[kStatIters];
    load_stats(0, visit_m(0), lse, dsum);
    store_stats(lse, dsum);
  }

  const float scale_log2 = p.scale_log2;

  // One query row block m of query head g. kMask: the block holds a tail or crosses the
  // diagonal; masked and unmasked blocks run as separate loops so that the unmasked ones carry
  // no mask code.
  auto step = [&](const int g, const int t, auto mask_tag) __attribute__((always_inline)) {
    constexpr bool kMask = decltype(mask_tag)::value;
    const int head = kv_head * p.group + g;
    const int m = visit_m(t);
    const int row0 = m * kBlockM;
    if constexpr (kAsync) cp_async_wait<0>();
    __syncthreads();  // Q, dO, lse and D of (g, m) are visible; the last dQ product is done with dS

    // S = Q K^T, dP = dO V^T
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, tSsQ, tSsK, s2r_sdp_a, s2r_sdp_a_thr, s2r_sdp_b,
            s2r_sdp_b_thr);
    gemm_ss(mma_sdp, acc_dp, tSrdO, tSrV, tSsdO, tSsV, s2r_sdp_a, s2r_sdp_a_thr, s2r_sdp_b,
            s2r_sdp_b_thr);
    decltype(auto) s = as_float(acc_s);
    decltype(auto) dp = as_float(acc_dp);

    // P = exp2(S * scale_log2 - lse_2), zero where masked; dS = P * (dP - D)
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) {
      const int r = get<0>(tScS(i));
      float pv = exp2f(fmaf(s(i), scale_log2, -smem_lse[r]));
      if constexpr (kMask) {
        const int col = col0 + get<1>(tScS(i));
        if (col >= p.seqlen_k || (p.causal && col > row0 + r + diag)) pv = 0.f;
      }
      s(i) = pv;
      dp(i) = pv * (dp(i) - smem_dsum[r]);
    }
    cute::copy(convert_fragment<T>(s), tSsP);
    cute::copy(convert_fragment<T>(dp), tSsdS);
    __syncthreads();  // P and dS are visible

    // dV += P^T dO, dK += dS^T Q
    accumulate_kv(acc_dv, tVrPt, tVrdOt, tVsPt, tVsdOt);
    accumulate_kv(acc_dk, tKrdSt, tKrQt, tKsdSt, tKsQt);

    // the next block's Q and dO stream in during the dQ product
    const bool last_visit = t + 1 == n_visits;
    const int next_g = last_visit ? g + 1 : g;
    const int next_m = visit_m(last_visit ? 0 : t + 1);
    const bool has_next = next_g < p.group;
    float next_lse[kStatIters], next_dsum[kStatIters];
    __syncthreads();  // everyone is done with Q and dO (and read lse and D before the last sync)
    if (has_next) {
      if (row_tail && next_m == m_end - 1) {
        load_q_do(next_g, next_m, cute::true_type{});
      } else {
        load_q_do(next_g, next_m, cute::false_type{});
      }
      load_stats(next_g, next_m, next_lse, next_dsum);
    }

    // dQ += dS K, added into the fp32 workspace (scaled by the softmax scale at conversion)
    Tensor acc_dq = partition_fragment_C(mma_q, tile_q);
    clear(acc_dq);
    gemm_ss(mma_q, acc_dq, tQrdS, tQrKt, tQsdS, tQsKt, s2r_q_a, s2r_q_a_thr, s2r_q_b,
            s2r_q_b_thr);
    float* dq_ptr =
        p.dq_accum + ((int64_t(batch) * p.heads_q + head) * p.seqlen_q + row0) * kHeadDim;
    add_dq<kHeadDim>(dq_ptr, acc_dq, tQcdQ, kMask ? p.seqlen_q - row0 : kBlockM);
    if (has_next) store_stats(next_lse, next_dsum);  // lse and D were last read before P
  };

  for (int g = 0; g < p.group; ++g) {
    int t = 0;
    for (; t < n_masked; ++t) step(g, t, cute::true_type{});
    for (; t < n_visits; ++t) step(g, t, cute::false_type{});
  }

  // ---- epilogue: dK (times the softmax scale) and dV, written once through shared memory ----
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
  Tensor rdK = convert_fragment<T>(acc_dk);
  Tensor rdV = convert_fragment<T>(acc_dv);
  if constexpr (kAsync) cp_async_wait<0>();
  __syncthreads();  // everyone is done with K and V
  cute::copy(rdK, thr_kv.partition_C(sK));
  cute::copy(rdV, thr_kv.partition_C(sV));
  __syncthreads();
  T* dk_ptr = static_cast<T*>(p.dk) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
              int64_t(col0) * p.dk_row_stride;
  T* dv_ptr = static_cast<T*>(p.dv) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
              int64_t(col0) * p.dv_row_stride;
  Tensor gdK = make_tensor(make_gmem_ptr(dk_ptr), tile_kv, make_stride(p.dk_row_stride, _1{}));
  Tensor gdV = make_tensor(make_gmem_ptr(dv_ptr), tile_kv, make_stride(p.dv_row_stride, _1{}));
  typename Traits::GmemTiledCopyOut gmem_copy_out;
  auto gmem_thr_out = gmem_copy_out.get_thread_slice(tid);
  Tensor tKsdK = gmem_thr_out.partition_S(sK);
  Tensor tVsdV = gmem_thr_out.partition_S(sV);
  Tensor tKgdK = gmem_thr_out.partition_D(gdK);
  Tensor tVgdV = gmem_thr_out.partition_D(gdV);
  Tensor tKVc = gmem_thr_out.partition_D(make_identity_tensor(tile_kv));
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tKsdK); ++m) {
    if (col0 + get<0>(tKVc(0, m, 0)) < p.seqlen_k) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tKsdK); ++k) {
        cute::copy(gmem_copy_out, tKsdK(_, m, k), tKgdK(_, m, k));
        cute::copy(gmem_copy_out, tVsdV(_, m, k), tVgdV(_, m, k));
      }
    }
  }
}

}  // namespace sparktune
