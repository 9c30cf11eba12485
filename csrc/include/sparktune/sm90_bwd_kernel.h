// The Hopper backward kernel: one thread block per (key block, kv head, batch), in the order
// the launch sets (sm90_bwd_launch.h: causal and windowed launches in sections of pairs); with
// a group split (BwdParams::group_split) one per (key block, kv head, part of its group, batch).
//
// Warpgroup 0 is the producer: it gives its registers away (setmaxnreg); its first thread
// loads K and V once and then, for every query head of the kv head's group and every query
// row block that sees the key block, the Q and dO tiles into a ring of `stages` slots (TMA,
// one "full" transaction barrier per slot). A slot is free again when every consumer warp has
// arrived on its "empty" barrier. Its third warp adds the consumers' dQ tiles to the workspace.
//
// Warpgroups 1.. are consumers of 64 keys each. Per query tile, with wgmma:
//     S^T = K Q^T,  dP^T = V dO^T                      (shared x shared, back to back)
//     P^T = exp2(S^T * scale_log2 - lse_log2)          (masked: key tail, causal diagonal)
//                   (the consumers load a step's log-sum-exp and D rows from global memory
//                    two steps ahead and store them into a shared double buffer)
//     dS^T = P^T * (dP^T - D)
//     dV += P^T dO                                      (P^T as a register operand)
//     dQ_part = dS K                                    (dS^T through shared memory)
//     dK += dS^T Q                                      (dS^T as a register operand)
// issued in that order, so that dK's product runs while dQ's part goes to shared memory.
// dK and dV stay in registers for the whole walk (the GQA group's heads included: summed on
// chip) and are written once. Each warpgroup writes its columns of a step's dQ part to a
// shared fp32 tile, which the producer's third warp adds into the fp32 workspace with one TMA
// reduce-add per warpgroup while the consumers go on; with a semaphore workspace
// (deterministic mode) it adds a row block's tile only when the key blocks before this one in
// a fixed order have added theirs (ascending key blocks; causal: descending, with the grid
// launched from the last key block, so that no key block waits on one still walking rows it
// reaches later). dS^T has two shared buffers so that one named barrier per step suffices.
// Every plain shared-memory access (statistics, dQ's tile) goes through pointers derived from
// the kernel's shared window by offsets, so that it compiles to shared-memory instructions: a
// base aligned through an integer made them generic loads and stores, whose waits held the
// consumers (about 30% of the backward's time on an H200).
//
// Packed sequences (p.cu_seqlens_q set; BwdParams says how the tensors are laid out): the grid's
// batch index is the sequence, whose first rows and lengths the block reads from cu_seqlens; a
// key block past its sequence's keys returns at once. The TMA descriptors see each packed
// tensor as one (total, head_dim, heads, 1) view and the block reaches its sequence's rows
// through a domain offset of its first row (any row: TMA coordinates are elements, not tiles).
// What lies past the sequence in a tile is the next sequence's rows, or zeros past the total:
// keys past seqlen_k are masked (P^T = 0) and never written; query rows past seqlen_q get the
// statistics lse = +inf and D = 0, so that their P^T, and with it their dS^T, are exactly 0
// (for finite inputs: an inf or NaN in the neighbouring sequence's rows would reach this one's
// products). Their dQ rows, added by the tile's TMA reduce-add to the next sequence's rows of
// the workspace (past total_q TMA leaves them out), are therefore +-0 (sums of 0 * K), and
// x + (+-0) is x for every x but -0, so those adds change no sum, in whatever order they
// happen: also in deterministic mode, where they do not wait for the next sequence's turns.
// (A sum that starts at the workspace's +0 is -0 only where an add flushed a negative
// subnormal result to -0; a +0 added after it makes that zero +0: the sign of a zero, never a
// value.) The causal diagonal is each sequence's (seqlen_k - seqlen_q).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cmath>

#include "bwd_kernel.h"       // bwd_preprocess_kernel, bwd_convert_dq_kernel, kLog2e
#include "fragment.h"
#include "params.h"
#include "sm90_bwd_traits.h"
#include "sm90_fwd_kernel.h"  // sm90::rowcol_view, acc_as_operand_a, wgmma_gemm

namespace sparktune {

using namespace cute;

namespace sm90 {

// Shared memory of one backward block, from a 1024-byte aligned base: K, V, the Q slots, the
// dO slots, the two dS buffers, dQ's fp32 tile (each a multiple of 1024 bytes), then two
// buffers of statistics and the barriers.
template <class Traits>
struct BwdSharedStorage {
  using T = typename Traits::Element;
  static_assert(Traits::kSmemK % 1024 == 0 && Traits::kSmemQStage % 1024 == 0 &&
                    Traits::kSmemDsBuf % 1024 == 0 && Traits::kSmemDq % 1024 == 0,
                "every tile must start on a 1024-byte boundary");
  static constexpr int kOffV = Traits::kSmemK;
  static constexpr int kOffQ = kOffV + Traits::kSmemV;
  static constexpr int kOffDo = kOffQ + Traits::kSmemQ;
  static constexpr int kOffDs = kOffDo + Traits::kSmemDo;
  static constexpr int kOffDq = kOffDs + Traits::kSmemDs;
  static constexpr int kOffStats = kOffDq + Traits::kSmemDq;
  static constexpr int kOffBarriers = kOffStats + Traits::kSmemStats;
  char* base;
  CUTE_DEVICE T* k() const { return reinterpret_cast<T*>(base); }
  CUTE_DEVICE T* v() const { return reinterpret_cast<T*>(base + kOffV); }
  CUTE_DEVICE T* q() const { return reinterpret_cast<T*>(base + kOffQ); }
  CUTE_DEVICE T* dout() const { return reinterpret_cast<T*>(base + kOffDo); }
  CUTE_DEVICE T* ds() const { return reinterpret_cast<T*>(base + kOffDs); }
  CUTE_DEVICE float* dq() const { return reinterpret_cast<float*>(base + kOffDq); }
  // buffer b (0, 1): block_m log-sum-exps in base 2, then block_m D values
  CUTE_DEVICE float* stats(int b) const {
    return reinterpret_cast<float*>(base + kOffStats) + b * 2 * Traits::kBlockM;
  }
  // barrier order: K/V full, then per stage Q/dO full, slot empty
  CUTE_DEVICE uint64_t* barriers() const { return reinterpret_cast<uint64_t*>(base + kOffBarriers); }
  CUTE_DEVICE uint64_t* kv_full() const { return barriers(); }
  CUTE_DEVICE uint64_t* qdo_full() const { return barriers() + 1; }
  CUTE_DEVICE uint64_t* empty() const { return barriers() + 1 + Traits::kStages; }
};

// Named barriers (hardware ids 1..15; 0 is __syncthreads) with the compiler told that memory
// is ordered around them: shared-memory accesses stay on their side of an arrive or a sync.
CUTE_DEVICE void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" : : "r"(id), "r"(threads) : "memory");
}
CUTE_DEVICE void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" : : "r"(id), "r"(threads) : "memory");
}

CUTE_DEVICE int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// A release store at GPU scope: whatever this thread has observed before it (the other
// consumer threads' dQ atomics, through the named barrier that precedes it) is visible to a
// thread whose acquire load reads the value.
CUTE_DEVICE void store_release(int* ptr, int v) {
  asm volatile("st.global.release.gpu.b32 [%0], %1;" : : "l"(ptr), "r"(v) : "memory");
}

// Where a consumer thread's dQ accumulator elements go in the shared fp32 tile
// (Traits::SmemLayoutDq: column blocks of 32 floats, 128-byte rows swizzled in 16-byte chunks
// by row % 8), worked out from the wgmma accumulator layout so that every store is one of four
// per-thread bases plus a constant (CuTe's swizzled view of the same tile, or (row, col)
// arithmetic per element, made ptxas spill). Element v = e + 2 h + 4 j of m-tile mt of thread
// (warpgroup g, warp w, lane l) is row 64 mt + 16 w + l / 4 + 8 h, column
// g * kDqCols + 8 j + 2 (l % 4) + e. tools/check_sm90.py --layouts compares every offset with
// the layout at the coordinates CuTe gives the accumulator.
template <int kBlockM, int kDqCols>
struct DqStore {
  static_assert(kDqCols % 32 == 0, "dQ's per-warpgroup columns are whole 32-float blocks");
  int chunk[4];  // per thread: the offset of its elements in 16-byte chunk group a = j % 4
  CUTE_HOST_DEVICE explicit DqStore(int ctid) {
    const int g = ctid / 128, w = ctid % 128 / 32, l = ctid % 32;
    const int x = l / 4, q = l % 4 / 2;
    const int base = g * (kDqCols / 32) * (kBlockM * 32) + (16 * w + x) * 32 + 2 * (l % 2);
    CUTE_UNROLL
    for (int a = 0; a < 4; ++a) chunk[a] = base + ((2 * a + q) ^ x) * 4;
  }
  CUTE_HOST_DEVICE int offset(int v, int mt) const {
    const int e = v % 2, h = v / 2 % 2, j = v / 4;
    return chunk[j % 4] + (j / 4) * (kBlockM * 32) + mt * 64 * 32 + h * 8 * 32 + e;
  }
};

// Wait until this thread's committed bulk (TMA) stores and reductions are complete, not only
// read from shared memory, then order them before this thread's later generic accesses.
CUTE_DEVICE void bulk_wait_complete() {
  asm volatile("cp.async.bulk.wait_group 0;" : : : "memory");
  asm volatile("fence.proxy.async.global;" : : : "memory");
}

// The band of a sequence (docs/FEATURES.md; the forward's): row i sees key j of [0, seqlen_k)
// iff i + diag - left <= j <= i + diag + right, diag = seqlen_k - seqlen_q. Causal is right = 0;
// a side that is unlimited (-1) or reaches past every key is the width that just reaches them
// all (left = seqlen_k, right = seqlen_q), so that the bounds stay small integers and the plain
// problem is the band that holds every (row, key).
CUTE_DEVICE int band_left(BwdParams const& p, int seqlen_k) {
  return p.window_left >= 0 && p.window_left < seqlen_k ? p.window_left : seqlen_k;
}
CUTE_DEVICE int band_right(BwdParams const& p, int seqlen_q) {
  return p.causal ? 0 : p.window_right >= 0 && p.window_right < seqlen_q ? p.window_right : seqlen_q;
}
// The backward kernel's instantiations (sm90_bwd_kernel's kMode): no feature; a sliding
// window; soft-capping or ALiBi, with or without a window.
enum BwdMode : int { kBwdPlain = 0, kBwdBand = 1, kBwdScores = 2 };

// Deterministic mode: whether the key blocks add a row block's dQ from the last one down (a
// band limited on the right: causal, or a window's right side), with the grid launched from
// the last key block; else from the first one up. One rule for the whole launch.
CUTE_DEVICE bool bwd_descending(BwdParams const& p) { return p.causal || p.window_right >= 0; }

// The query row blocks a key block sees: [m_begin, m_end), those with a row whose band meets
// one of the block's keys (the keys past seqlen_k left out). Causal (bottom-right): key j is
// seen by rows i >= j - (seqlen_k - seqlen_q); a window's left side also bounds the rows from
// above (i <= j - diag + left). The lengths are the block's sequence's (packed: its own, else
// the problem's). kFeatures: the kernel instantiation with windows; without, the plain rule
// alone (causal or not), in the code the plain kernel always had.
template <bool kFeatures>
struct BwdWalk {
  int m_begin, m_end;
  CUTE_DEVICE BwdWalk(BwdParams const& p, int seqlen_q, int seqlen_k, int n_block, int block_m,
                      int block_n) {
    const int diag = seqlen_k - seqlen_q;
    const int key0 = n_block * block_n;
    if constexpr (kFeatures) {
      const int key_last = min(key0 + block_n, seqlen_k) - 1;
      const int first_row = key0 - diag - band_right(p, seqlen_q);  // <= seqlen_q - 1
      const int last_row = key_last - diag + band_left(p, seqlen_k);
      m_begin = first_row <= 0 ? 0 : first_row / block_m;
      m_end = last_row < 0 ? 0 : min((seqlen_q + block_m - 1) / block_m, last_row / block_m + 1);
    } else {
      m_end = (seqlen_q + block_m - 1) / block_m;
      m_begin = 0;
      if (p.causal) {
        const int first_row = key0 - diag;
        m_begin = first_row <= 0 ? 0 : first_row / block_m;
      }
    }
  }
  CUTE_DEVICE bool empty() const { return m_begin >= m_end; }
  // Deterministic mode: the place of key block n_block among the key blocks that add to row
  // block m, [n_first(m), n_last(m)] (exactly those whose walk holds m). Ascending (a band
  // unlimited on the right): n_first first. Descending (descending()): n_last first, which
  // reaches row block m on its first step. Either way a key block waits only for key blocks
  // of the same (kv head, batch) with a lower blockIdx.x (the descending grid is reversed),
  // which the hardware dispatches first: they are resident or finished even when the grid is
  // larger than what fits at once, and the first in the order never waits. Packed: the key
  // blocks of the block's sequence (those past it return at once and take no turn).
  CUTE_DEVICE static bool descending(BwdParams const& p) {
    return kFeatures ? bwd_descending(p) : p.causal;
  }
  CUTE_DEVICE static int turn(BwdParams const& p, int seqlen_q, int seqlen_k, int n_block, int m,
                              int block_m, int block_n) {
    const int diag = seqlen_k - seqlen_q;
    if (descending(p)) {
      const int n_blocks = (seqlen_k + block_n - 1) / block_n;
      const int last_row = min((m + 1) * block_m, seqlen_q) - 1;
      const int right = kFeatures ? band_right(p, seqlen_q) : 0;
      const int n_last = min(n_blocks - 1, (last_row + diag + right) / block_n);
      return n_last - n_block;
    }
    if constexpr (!kFeatures) return n_block;
    const int lo = m * block_m + diag - band_left(p, seqlen_k);  // the first row's first key
    return n_block - (lo <= 0 ? 0 : lo / block_n);
  }
  // steps of the whole walk: every query head of the group times the row blocks
  CUTE_DEVICE int steps(int group) const { return empty() ? 0 : group * (m_end - m_begin); }
};

// Step t of the walk, worked out from t alone (so that producer and consumers keep one counter
// alive, not five): the group's head g, the row block m, the pipeline slot and its phase, and
// the dS buffer.
template <int kStages>
struct BwdStep {
  int g, m, stage, phase, buf;
  template <class Walk>
  CUTE_DEVICE BwdStep(Walk const& walk, int t) {
    const int per_head = walk.m_end - walk.m_begin;
    g = t / per_head;
    m = walk.m_begin + (t - g * per_head);
    stage = t % kStages;
    phase = (t / kStages) & 1;
    buf = t & 1;
  }
};

}  // namespace sm90

// Three instantiations, which the launch picks (sm90::BwdMode): kPlain has no code for the
// attention features and masks as it always did (key tail, causal diagonal), so that the plain
// kernel's code and register allocation stay its own (the band's masks in it measured 2-3%
// slower at head dim 64); kBand adds a sliding window's walk and masks; kScores soft-capping
// and ALiBi (with any window) in passes of their own (one instantiation for all three spilled
// at head dim 128).
template <class Traits, int kMode>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sm90_bwd_kernel(__grid_constant__ const Sm90BwdArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kFeatures = kMode != sm90::kBwdPlain;  // a band (window) may be on
  constexpr bool kScores = kMode == sm90::kBwdScores;   // softcap or ALiBi may be on
  using T = typename Traits::Element;
  using Storage = sm90::BwdSharedStorage<Traits>;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerThreads = Traits::kConsumerThreads;
  constexpr int kConsumerWarps = kConsumerThreads / 32;
  constexpr float kInf = INFINITY;
  // named barriers (sm90::bar_sync / bar_arrive): the consumer warpgroups' dS^T and their
  // statistics; between one consumer warpgroup and the producer's dQ warp (kHandoff threads),
  // that warpgroup's columns of dQ's tile (ids kBarDqFull + g, kBarDqEmpty + g)
  constexpr int kBarDsReady = 1;
  constexpr int kBarStats = 2;
  constexpr int kBarDqFull = 3;
  constexpr int kBarDqEmpty = 3 + Traits::kConsumerWarpgroups;
  static_assert(kBarDqEmpty + Traits::kConsumerWarpgroups <= 16, "16 named barriers");
  constexpr int kHandoff = 128 + 32;
  static_assert(cosize_v<typename Traits::SmemLayoutK> * sizeof(T) == Traits::kSmemK &&
                    cosize_v<typename Traits::SmemLayoutV> * sizeof(T) == Traits::kSmemV &&
                    cosize_v<typename Traits::SmemLayoutQ> * sizeof(T) == Traits::kSmemQ &&
                    cosize_v<typename Traits::SmemLayoutDs> * sizeof(T) == Traits::kSmemDs,
                "the shared-memory rule of sm90_bwd_config.h disagrees with the layouts");

  BwdParams const& p = args.p;
  extern __shared__ char smem_raw[];
  // The 1024-byte aligned base as smem_raw plus an offset (not through an integer), so that
  // the compiler keeps it in the shared state space: the statistics and dQ's tile are then
  // read and written with shared-memory instructions, not generic ones.
  const Storage st{smem_raw + sm90::align_pad<Traits::kSmemAlign>(smem_raw)};

  const bool deterministic = p.dq_semaphore != nullptr;
  // deterministic and limited on the right (causal, a window): the grid runs from the last key
  // block (see BwdWalk::turn)
  using Walk = sm90::BwdWalk<kFeatures>;
  // The grid: (key block, kv head, batch), or with p.tile_section > 0 (sm90_bwd_launch.h) the
  // (kv head, batch) pairs in sections of that many, (pair within the section, key block,
  // section), so that the key blocks of one index start together across a section's pairs
  // (the heaviest first, but for the deterministic mode's reversed order above); either way a
  // pair's key blocks are dispatched in the order of their grid index, which that mode needs.
  const bool sectioned = p.tile_section > 0;
  const int key_index = sectioned ? blockIdx.y : blockIdx.x;
  const int key_blocks = sectioned ? gridDim.y : gridDim.x;
  const int n_block = deterministic && Walk::descending(p) ? key_blocks - 1 - key_index : key_index;
  // With p.group_split = S > 1 a "kv head" of the grid (vhead) is a (kv head, part) pair, the
  // part fastest: the kv head's group of query heads in S parts of p.group / S heads each, every
  // part a block of its own, whose dK and dV go to the fp32 partials p.dkv_part (summed by
  // bwd_sum_dkv_kernel). The block's query heads are then vhead * (p.group / S) onwards, with
  // or without the split. Only vhead stays live (the rest is worked out where it is used).
  int vhead = blockIdx.y, batch = blockIdx.z;
  if (sectioned) {
    const int vheads = p.heads_kv * p.group_split;
    const int pair = blockIdx.z * p.tile_section + blockIdx.x;
    if (pair >= vheads * p.batch) return;  // the last section's missing pairs
    batch = pair / vheads;
    vhead = pair - batch * vheads;
  }
  // (the query heads this block walks: p.part_heads, group / split, read where it is used: a
  // parameter, no register)
  const int key0 = n_block * kBlockN;
  // The block's sequence: its lengths and first rows (0 unless packed, where sequence `batch`
  // is rows cu_seqlens[batch] .. of the packed tensors and the grid spans the longest one)
  const bool varlen = p.cu_seqlens_q != nullptr;
  int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, q_first = 0, k_first = 0;
  if (varlen) {
    q_first = p.cu_seqlens_q[batch];
    k_first = p.cu_seqlens_k[batch];
    seqlen_q = p.cu_seqlens_q[batch + 1] - q_first;
    seqlen_k = p.cu_seqlens_k[batch + 1] - k_first;
    // a key block past the sequence's keys (an empty sequence's every one) has nothing to
    // write and adds nothing (the whole block leaves, before any barrier)
    if (key0 >= seqlen_k) return;
  }
  // the batch index of the dense tensors and of the TMA views (packed: the one view, 0)
  const int view = varlen ? 0 : batch;
  const int diag = seqlen_k - seqlen_q;  // causal: row i sees key j iff j <= i + diag
  const int warpgroup = threadIdx.x / 128;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const Walk walk(p, seqlen_q, seqlen_k, n_block, kBlockM, kBlockN);

  auto& kv_full = *reinterpret_cast<FullBarrier*>(st.kv_full());
  auto qdo_full = reinterpret_cast<FullBarrier*>(st.qdo_full());
  auto empty = reinterpret_cast<Barrier*>(st.empty());
  if (threadIdx.x == 0) {
    // the TMA descriptors (kernel parameters) into the cache now, not at the first load
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_dq.get_tma_descriptor());
    kv_full.init(1);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      qdo_full[s].init(1);
      empty[s].init(kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  Tensor sK = make_tensor(make_smem_ptr(st.k()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(st.v()), typename Traits::SmemLayoutV{});
  Tensor sKt = make_tensor(make_smem_ptr(st.k()), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(st.q()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(st.q()), typename Traits::SmemLayoutQt{});
  Tensor sDo = make_tensor(make_smem_ptr(st.dout()), typename Traits::SmemLayoutQ{});
  Tensor sDot = make_tensor(make_smem_ptr(st.dout()), typename Traits::SmemLayoutQt{});
  Tensor sDs = make_tensor(make_smem_ptr(st.ds()), typename Traits::SmemLayoutDs{});
  Tensor sDst = make_tensor(make_smem_ptr(st.ds()), typename Traits::SmemLayoutDst{});

  if (warpgroup == 0) {
    // ================================ producer ================================
    // the kv head of K and V, worked out before the producer gives its registers away (the
    // build that spilled in the one-consumer configurations divided after it; with this and the
    // 40 registers of sm90_bwd_config.h, ptxas spills nowhere)
    int kv_head = vhead / p.group_split;
    asm volatile("" : "+r"(kv_head));
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (walk.empty()) return;
    if (warp == 0 && lane == 0) {
      auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
      auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
      // packed: one (total, D, heads, 1) view each, the sequence's rows reached by an offset
      const int views = varlen ? 1 : p.batch;
      const int rows_q = varlen ? p.total_q : p.seqlen_q;
      const int rows_k = varlen ? p.total_k : p.seqlen_k;
      Tensor mQ = args.tma_q.get_tma_tensor(make_shape(rows_q, kHeadDim, p.heads_q, views));
      Tensor mDo = args.tma_do.get_tma_tensor(make_shape(rows_q, kHeadDim, p.heads_q, views));
      Tensor mK = args.tma_k.get_tma_tensor(make_shape(rows_k, kHeadDim, p.heads_kv, views));
      Tensor mV = args.tma_v.get_tma_tensor(make_shape(rows_k, kHeadDim, p.heads_kv, views));
      Tensor gK = local_tile(domain_offset(make_coord(k_first, _0{}), mK(_, _, kv_head, view)),
                             tile_kv, make_coord(n_block, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(k_first, _0{}), mV(_, _, kv_head, view)),
                             tile_kv, make_coord(n_block, _0{}));
      auto [tKgK, tKsK] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                        group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                        group_modes<0, 2>(gV));
      kv_full.arrive_and_expect_tx(2 * Traits::kTmaBytesKV);
      cute::copy(args.tma_k.with(reinterpret_cast<uint64_t&>(kv_full)), tKgK, tKsK);
      cute::copy(args.tma_v.with(reinterpret_cast<uint64_t&>(kv_full)), tVgV, tVsV);

      for (int t = 0; t < walk.steps(p.part_heads); ++t) {
        const sm90::BwdStep<kStages> at(walk, t);
        const int head = vhead * p.part_heads + at.g;
        Tensor gQ = local_tile(domain_offset(make_coord(q_first, _0{}), mQ(_, _, head, view)),
                               tile_q, make_coord(at.m, _0{}));
        Tensor gDo = local_tile(domain_offset(make_coord(q_first, _0{}), mDo(_, _, head, view)),
                                tile_q, make_coord(at.m, _0{}));
        Tensor sQs = sQ(_, _, at.stage);
        Tensor sDos = sDo(_, _, at.stage);
        auto [tQgQ, tQsQ] = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQs),
                                          group_modes<0, 2>(gQ));
        auto [tDogDo, tDosDo] = tma_partition(args.tma_do, _0{}, Layout<_1>{},
                                              group_modes<0, 2>(sDos), group_modes<0, 2>(gDo));
        empty[at.stage].wait(at.phase ^ 1);
        qdo_full[at.stage].arrive_and_expect_tx(2 * Traits::kTmaBytesQ);
        cute::copy(args.tma_q.with(reinterpret_cast<uint64_t&>(qdo_full[at.stage])), tQgQ, tQsQ);
        cute::copy(args.tma_do.with(reinterpret_cast<uint64_t&>(qdo_full[at.stage])), tDogDo,
                   tDosDo);
      }
    } else if (warp == 2) {
      // dQ: each consumer warpgroup's columns of a step's tile, once that warpgroup has
      // written them, added to the workspace (one handoff per warpgroup, so that neither waits
      // for the other's stores)
      // packed: the (total_q, D, heads_q, 1) workspace, the sequence's rows reached by an
      // offset (a tile's rows past the sequence add +-0 to the next one's: see the top)
      Tensor mDq = args.tma_dq.get_tma_tensor(make_shape(varlen ? p.total_q : p.seqlen_q, kHeadDim,
                                                         p.heads_q, varlen ? 1 : p.batch));
      // the semaphores' row blocks per (batch, head): the longest sequence's when packed
      const int sem_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
      auto thr_tma_dq = args.tma_dq.get_slice(_0{});
      const int steps = walk.steps(p.part_heads);
      for (int t = 0; t < steps; ++t) {
        const sm90::BwdStep<kStages> at(walk, t);
        const int head = vhead * p.part_heads + at.g;
        int* sem = nullptr;
        int turn = 0;
        CUTE_UNROLL
        for (int g = 0; g < Traits::kConsumerWarpgroups; ++g) {
          Tensor sDqPart = make_tensor(make_smem_ptr(st.dq() + g * kBlockM * Traits::kDqCols),
                                       typename Traits::SmemLayoutDqPart{});
          Tensor gDq = local_tile(domain_offset(make_coord(q_first, _0{}), mDq(_, _, head, view)),
                                  Shape<Int<kBlockM>, Int<Traits::kDqCols>>{}, make_coord(at.m, g));
          sm90::bar_sync(kBarDqFull + g, kHandoff);
          if (lane == 0) {
            if (deterministic && g == 0) {
              sem = p.dq_semaphore + (int64_t(batch) * p.heads_q + head) * sem_blocks + at.m;
              turn = Walk::turn(p, seqlen_q, seqlen_k, n_block, at.m, kBlockM, kBlockN);
              while (sm90::load_acquire(sem) != turn) __nanosleep(32);
              asm volatile("fence.proxy.async.global;" : : : "memory");
            }
            cute::copy(args.tma_dq, thr_tma_dq.partition_S(sDqPart), thr_tma_dq.partition_D(gDq));
            tma_store_arrive();
            if (!deterministic) tma_store_wait<0>();  // read: the warpgroup may overwrite it
          }
          __syncwarp();
          if (!deterministic && t + 1 < steps) sm90::bar_arrive(kBarDqEmpty + g, kHandoff);
        }
        if (deterministic) {
          if (lane == 0) {
            sm90::bulk_wait_complete();  // the sums are in global memory, then the next turn
            sm90::store_release(sem, turn + 1);
          }
          __syncwarp();
          if (t + 1 < steps) {
            CUTE_UNROLL
            for (int g = 0; g < Traits::kConsumerWarpgroups; ++g) {
              sm90::bar_arrive(kBarDqEmpty + g, kHandoff);
            }
          }
        }
      }
      if (lane == 0) sm90::bulk_wait_complete();
    }
    return;
  }

  // ================================ consumers ================================
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int ctid = threadIdx.x - 128;

  typename Traits::TiledMmaSdPUsed mma_sdp;  // kKvRegs: K and V as register operands
  typename Traits::TiledMmaDkv mma_dkv;
  typename Traits::TiledMmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(ctid);
  auto thr_dkv = mma_dkv.get_thread_slice(ctid);
  auto thr_dq = mma_dq.get_thread_slice(ctid);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);     // (MMA, MMA_M, MMA_K)
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stages)
  Tensor tPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tPrDo = thr_sdp.partition_fragment_B(sDo);
  Tensor tVrDot = thr_dkv.partition_fragment_B(sDot);  // (MMA, MMA_N, MMA_K, stages)
  Tensor tKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tQrDs = thr_dq.partition_fragment_A(sDs);    // (MMA, MMA_M, MMA_K, 2)
  Tensor tQrKt = thr_dq.partition_fragment_B(sKt);
  auto copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomDs{}, mma_sdp);
  auto thr_copy_ds = copy_ds.get_thread_slice(ctid);
  Tensor tDSsDst = thr_copy_ds.partition_D(sDst);     // (CPY, CPY_M, CPY_N, 2)

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of every S^T element this thread holds
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
  Tensor c_rc = make_tensor(tScS.data(), sm90::rowcol_view(tScS.layout()));
  const sm90::DqStore<kBlockM, Traits::kDqCols> dq_store(ctid);

  // The statistics of step t (log-sum-exp in base 2, +inf past seqlen_q or for a row with no
  // visible key so that P = 0 there; D, 0 past seqlen_q): consumer thread i < 2 block_m loads
  // one value from global memory at the end of step t - 2 (a whole step for the load to
  // arrive; after that step's last fence, which would wait for it) and stores it into shared
  // buffer t % 2 before the consumers' dS^T barrier of step t - 1, which orders it before
  // every read in step t; the next store to that buffer, in step t + 1, follows step t's
  // barrier, after which no thread reads step t's statistics. The load keeps the raw value
  // (nothing waits for it until the store).
  static_assert(2 * kBlockM <= kConsumerThreads, "one statistic per consumer thread");
  // Row r of the group's head g is element stat0 + g * stat_stride + r of lse and D: (batch,
  // heads_q, seqlen_q), or packed (heads_q, total_q) from the sequence's first row on.
  const int64_t stat0 = varlen ? int64_t(vhead) * p.part_heads * p.total_q + q_first
                               : (int64_t(batch) * p.heads_q + vhead * p.part_heads) * p.seqlen_q;
  const int stat_stride = varlen ? p.total_q : p.seqlen_q;
  auto load_stat = [&](int t) -> float {
    const sm90::BwdStep<kStages> at(walk, t);
    const int row = at.m * kBlockM + ctid % kBlockM;
    const int64_t i = stat0 + int64_t(at.g) * stat_stride + row;
    if (ctid < kBlockM) return row < seqlen_q ? p.lse[i] : -kInf;
    return row < seqlen_q ? p.dsum[i] : 0.f;
  };
  auto store_stat = [&](int t, float v) {
    if (ctid < kBlockM) v = v == -kInf ? kInf : v * kLog2e;
    if (ctid < 2 * kBlockM) st.stats(t & 1)[ctid] = v;
  };

  // S^T = K Q^T and dP^T = V dO^T of step `at`, back to back (two wgmma batches), once its Q
  // and dO have landed
  using Step = sm90::BwdStep<kStages>;
  auto issue_sdp = [&](Step const& at, auto& acc_s, auto& acc_dp) {
    qdo_full[at.stage].wait(at.phase);
    sm90::wgmma_gemm<true, Traits::kKvRegs>(mma_sdp, tSrK, tSrQ(_, _, _, at.stage), acc_s);
    sm90::wgmma_gemm<true, Traits::kKvRegs>(mma_sdp, tPrV, tPrDo(_, _, _, at.stage), acc_dp);
  };
  // The band of the block's sequence (sm90::band_left/right) and the score features
  // (docs/FEATURES.md; the forward's definitions): softcap > 0 makes the score of q.k
  // softcap * tanh(q.k * scale / softcap), ALiBi then adds -slope * |i + diag - j| with the
  // slope of the step's query head.
  // (Worked out from the parameters at each step, where they are used: no registers held.)
  // P^T = exp2(S^T * scale_log2 - lse_log2), zero where the key is not visible, then dS^T =
  // P^T * (dP^T - D), in the accumulators of step `at`: S^T's batch is complete once at most
  // wait_s batches are pending, dP^T's once wait_dp are (the batches issued after them).
  auto softmax_ds = [&](Step const& at, auto& acc_s, auto& acc_dp, auto wait_s, auto wait_dp) {
    const int row0 = at.m * kBlockM;
    const int left = sm90::band_left(p, seqlen_k);
    const int right = sm90::band_right(p, seqlen_q);
    const bool softcap_on = kScores && p.softcap > 0.f;
    const bool alibi_on = kScores && p.alibi_slopes != nullptr;
    float const* lse_s = st.stats(at.buf);
    float const* d_s = lse_s + kBlockM;
    Tensor s_rc = make_tensor(acc_s.data(), sm90::rowcol_view(acc_s.layout()));
    Tensor dp_rc = make_tensor(acc_dp.data(), sm90::rowcol_view(acc_dp.layout()));
    // the statistics of this thread's columns (queries; the same in every row of the view)
    // into registers while the products run
    constexpr int kCols = decltype(size<1>(s_rc))::value;
    // a thread's columns come in pairs of neighbouring queries (c even, c + 1): one 8-byte load
    // of each statistic per pair
    static_assert(kCols % 2 == 0, "accumulator columns in pairs");
    float lse_r[kCols], d_r[kCols];
    auto load_pairs = [&](float* dst, float const* src) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; c += 2) {
        const float2 v = *reinterpret_cast<float2 const*>(src + get<1>(c_rc(0, c)));
        dst[c] = v.x;
        dst[c + 1] = v.y;
      }
    };
    // dS^T = P^T (dP^T - D) once dP^T's product is done, P^T in S^T's registers (the plain
    // order's last pass, also ALiBi's)
    auto ds_from_p = [&]() {
      load_pairs(d_r, d_s);
      warpgroup_wait<decltype(wait_dp)::value>();  // dP^T is done
      warpgroup_fence_operand(acc_dp);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(dp_rc); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(dp_rc); ++c) {
          dp_rc(r, c) = s_rc(r, c) * (dp_rc(r, c) - d_r[c]);
        }
      }
    };
    // a key of the tile outside some row's band (the key tail, the band's right edge, its left
    // edge; the rows past seqlen_q need no mask: their P^T is 0 through lse = +inf)
    // (worked out where the plain kernel always did: after S^T's wait)
    auto tile_masked = [&]() {
      if constexpr (kFeatures) {
        const int row_last = min(row0 + kBlockM, seqlen_q) - 1;
        return key0 + kBlockN > seqlen_k || key0 + kBlockN - 1 > row0 + diag + right ||
               key0 < row_last + diag - left;
      } else {
        return key0 + kBlockN > seqlen_k || (p.causal && key0 + kBlockN - 1 > row0 + diag);
      }
    };
    if constexpr (kScores) {
      // Scores changed by the features (this instantiation runs only calls with softcap or
      // ALiBi on). The score is tanh(q.k softcap_in) (soft-capped; exponent multiplier softcap
      // log2 e) or q.k (scale log2 e); ALiBi's term in the exponent's units is its slope times
      // log2 e times the distance (the multiplier cancels the forward's division of the slope
      // by softcap or by scale).
      // ALiBi alone: the plain order, P^T under dP^T's product, then dS^T. Soft-capped: the
      // tanh in place under dP^T's product, then dP^T - D times soft-capping's derivative
      // 1 - t^2 (t at hand in S^T's registers), then the exponentials and dS^T (two passes with
      // a fence between, so that ptxas keeps no tile-wide temporaries in flight: one pass
      // spilled at head dim 128).
      const float mult = softcap_on ? p.softcap_log2 : p.scale_log2;
      const float cap_in = p.softcap_in;
      const float alibi_log2 =
          alibi_on ? p.alibi_slopes[int64_t(batch) * p.alibi_batch_stride + vhead * p.part_heads +
                                    at.g] * kLog2e
                   : 0.f;
      // |i + diag - j| for query i = row0 + qi, key j: the thread's distance at its first
      // column, plus each element's column offset from it (a constant); exact below 2^24
      const int col_base = get<1>(c_rc(0, 0));
      // P^T = exp2(score * mult + ALiBi - lse) (zero where hidden) into S^T's registers, and
      // with kScaleDp dP^T (already dP^T - D, times 1 - t^2) multiplied by it: dS^T. Column
      // pairs outermost, each pair's log-sum-exps read from shared memory there (not held for
      // the whole tile).
      auto pass = [&](auto mask_tag, auto scale_dp_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        constexpr bool kScaleDp = decltype(scale_dp_tag)::value;
        CUTE_UNROLL
        for (int c0 = 0; c0 < kCols; c0 += 2) {
          const float2 lse2 = *reinterpret_cast<float2 const*>(lse_s + get<1>(c_rc(0, c0)));
          CUTE_UNROLL
          for (int r = 0; r < size<0>(s_rc); ++r) {
            const int key = key0 + get<0>(c_rc(r, 0));
            const float dist0 = float(row0 + col_base + diag - key);
            const int lo_q = key - row0 - diag - right;  // hidden: qi < lo_q or qi > hi_q
            const int hi_q = key - row0 - diag + left;
            CUTE_UNROLL
            for (int c = c0; c < c0 + 2; ++c) {
              const int qi = get<1>(c_rc(r, c));
              float bias = c == c0 ? -lse2.x : -lse2.y;
              if (alibi_on) bias = fmaf(-alibi_log2, fabsf(dist0 + float(qi - col_base)), bias);
              float e = exp2f(fmaf(s_rc(r, c), mult, bias));
              if constexpr (kMask) {
                const bool hidden = (key >= seqlen_k) | (qi < lo_q) | (qi > hi_q);
                e = hidden ? 0.f : e;
              }
              s_rc(r, c) = e;
              if constexpr (kScaleDp) dp_rc(r, c) *= e;
            }
          }
        }
      };
      warpgroup_wait<decltype(wait_s)::value>();  // S^T is done, dP^T may still run
      warpgroup_fence_operand(acc_s);
      if (!softcap_on) {
        if (tile_masked()) {
          pass(cute::true_type{}, cute::false_type{});
        } else {
          pass(cute::false_type{}, cute::false_type{});
        }
        ds_from_p();
        return;
      }
      sm90::softcap_tanh(acc_s, cap_in);
      warpgroup_fence_operand(acc_s);
      warpgroup_wait<decltype(wait_dp)::value>();  // dP^T is done
      warpgroup_fence_operand(acc_dp);
      CUTE_UNROLL
      for (int c0 = 0; c0 < kCols; c0 += 2) {
        const float2 d2 = *reinterpret_cast<float2 const*>(d_s + get<1>(c_rc(0, c0)));
        CUTE_UNROLL
        for (int r = 0; r < size<0>(s_rc); ++r) {
          CUTE_UNROLL
          for (int c = c0; c < c0 + 2; ++c) {
            const float t = s_rc(r, c);
            dp_rc(r, c) = (dp_rc(r, c) - (c == c0 ? d2.x : d2.y)) * fmaf(-t, t, 1.f);
          }
        }
      }
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      if (tile_masked()) {
        pass(cute::true_type{}, cute::true_type{});
      } else {
        pass(cute::false_type{}, cute::true_type{});
      }
      return;
    }
    load_pairs(lse_r, lse_s);
    warpgroup_wait<decltype(wait_s)::value>();  // S^T is done
    warpgroup_fence_operand(acc_s);
    const bool masked = tile_masked();
    if (!masked) {
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s_rc); ++r) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) {
          s_rc(r, c) = exp2f(fmaf(s_rc(r, c), p.scale_log2, -lse_r[c]));
        }
      }
    } else {
      // the exponential of every element, then a select: no branch per element
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s_rc); ++r) {
        const int key = key0 + get<0>(c_rc(r, 0));
        // hidden left of query lo_q (the band's right edge; causal: the diagonal) and, with
        // features, right of query hi_q (its left edge)
        const int lo_q = kFeatures ? key - row0 - diag - right : p.causal ? key - row0 - diag : 0;
        const int hi_q = key - row0 - diag + left;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) {
          const int qi = get<1>(c_rc(r, c));
          const bool hidden =
              kFeatures ? (key >= seqlen_k) | (qi < lo_q) | (qi > hi_q) : (key >= seqlen_k) | (qi < lo_q);
          const float e = exp2f(fmaf(s_rc(r, c), p.scale_log2, -lse_r[c]));
          s_rc(r, c) = hidden ? 0.f : e;
        }
      }
    }
    ds_from_p();
  };
  // dS^T (16-bit) of step `at` to its shared buffer, where dQ's product reads it as dS
  auto store_ds = [&](Step const& at, auto const& rDs) {
    cute::copy(copy_ds, thr_copy_ds.retile_S(rDs), tDSsDst(_, _, _, at.buf));
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> wgmma reads
  };
  // dQ's part of step t to shared memory, for the dQ warp's reduce-add; the tile is free again
  // once that warp's TMA has read the previous step's
  auto stage_dq = [&](const int t, auto const& acc_dq) {
    if (t > 0) sm90::bar_sync(kBarDqEmpty + warpgroup - 1, kHandoff);
    // element pairs (v, v + 1) are neighbouring columns of one row: one 8-byte store each
    static_assert(decltype(size<0>(acc_dq))::value % 2 == 0, "accumulators hold column pairs");
    CUTE_UNROLL
    for (int mt = 0; mt < size<1>(acc_dq); ++mt) {
      CUTE_UNROLL
      for (int v = 0; v < size<0>(acc_dq); v += 2) {
        *reinterpret_cast<float2*>(st.dq() + dq_store.offset(v, mt)) =
            make_float2(acc_dq(v, mt, 0), acc_dq(v + 1, mt, 0));
      }
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores -> the TMA's reads
    sm90::bar_arrive(kBarDqFull + warpgroup - 1, kHandoff);
  };
  // the slot of a step's Q and dO is read (every lane's reads before the arrive)
  auto release_slot = [&](Step const& at) {
    __syncwarp();
    if (lane == 0) empty[at.stage].arrive();
  };

  const int steps = walk.steps(p.part_heads);
  // the statistics of step 0 in their buffer, those of step 1 loaded (the value for step
  // t + 1 is loaded one step before it is stored), K and V landed
  float pending = 0.f;
  if (steps > 0) {
    store_stat(0, ctid < 2 * kBlockM ? load_stat(0) : 0.f);
    pending = ctid < 2 * kBlockM && steps > 1 ? load_stat(1) : 0.f;
    sm90::bar_sync(kBarStats, kConsumerThreads);
    kv_full.wait(0);
    if constexpr (Traits::kKvRegs) {
      // this warpgroup's 64 keys of K and V into the register operands, once for the walk
      auto copy_kv = make_tiled_copy_A(typename Traits::SmemCopyAtomKv{}, mma_sdp);
      auto thr_copy_kv = copy_kv.get_thread_slice(ctid);
      cute::copy(copy_kv, thr_copy_kv.partition_S(sK), thr_copy_kv.retile_D(tSrK));
      cute::copy(copy_kv, thr_copy_kv.partition_S(sV), thr_copy_kv.retile_D(tPrV));
    }
  }
  if (steps > 0 && !Traits::kOverlap) {
    for (int t = 0; t < steps; ++t) {
      const Step at(walk, t);
      const int stage = at.stage;
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      issue_sdp(at, acc_s, acc_dp);
      softmax_ds(at, acc_s, acc_dp, Int<1>{}, Int<0>{});
      Tensor rP = convert_fragment<T>(acc_s);
      Tensor rDs = convert_fragment<T>(acc_dp);
      // dS^T to shared memory before the register operands go in flight
      store_ds(at, rDs);
      if (t + 1 < steps) store_stat(t + 1, pending);  // ordered by the barrier below

      Tensor tVrP = make_tensor(rP.data(), sm90::acc_as_operand_a(rP.layout()));
      Tensor tKrDs = make_tensor(rDs.data(), sm90::acc_as_operand_a(rDs.layout()));
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      // dV += P^T dO; then, once every warpgroup's keys of dS^T are in shared memory, dQ part
      // = dS K and dK += dS^T Q behind it. Waiting for all but the last batch leaves dK's
      // product running while dQ's tile goes to shared memory, so the tensor cores are not
      // idle during those stores.
      sm90::wgmma_gemm<false, true>(mma_dkv, tVrP, tVrDot(_, _, _, stage), acc_dv);
      sm90::bar_sync(kBarDsReady, kConsumerThreads);
      sm90::wgmma_gemm<true, false>(mma_dq, tQrDs(_, _, _, at.buf), tQrKt, acc_dq);
      sm90::wgmma_gemm<false, true>(mma_dkv, tKrDs, tKrQt(_, _, _, stage), acc_dk);
      warpgroup_wait<1>();  // dV and dQ are done
      warpgroup_fence_operand(acc_dq);
      stage_dq(t, acc_dq);
      if (t + 2 < steps && ctid < 2 * kBlockM) pending = load_stat(t + 2);
      warpgroup_wait<0>();  // dK is done: dS^T leaves the registers
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      release_slot(at);
    }
  }
  if (steps > 0 && Traits::kOverlap) {
    // ---- the overlapped order (ov1): step t + 1's softmax under step t's dV, dQ, dK ----
    // Iteration t issues S^T and dP^T of step t + 1, then dV, dQ and dK of step t (whose P^T
    // and dS^T were made in iteration t - 1), and makes P^T and dS^T of step t + 1 while the
    // last four run. The 16-bit P^T and dS^T of step t are held as the register operands of
    // dV and dK until those are done, next to step t + 1's fp32 accumulators (the register
    // rule of sm90_bwd_config.h counts both); the Q/dO ring holds steps t, t + 1 and the load
    // of t + 2 (three stages). dS^T of step t + 1 goes to its shared buffer once dK of step t
    // is done; the buffer was last read by dQ of step t - 1, which every warpgroup finished
    // before the barrier of iteration t. The statistics of step t + 2 go to their buffer
    // after that barrier (that buffer held step t's, last read in iteration t - 1), loaded
    // from global memory in iteration t - 1.
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
    Tensor rP = make_fragment_like<T>(acc_s);
    Tensor rDs = make_fragment_like<T>(acc_dp);
    Tensor tVrP = make_tensor(rP.data(), sm90::acc_as_operand_a(rP.layout()));
    Tensor tKrDs = make_tensor(rDs.data(), sm90::acc_as_operand_a(rDs.layout()));
    const Step first(walk, 0);
    issue_sdp(first, acc_s, acc_dp);
    softmax_ds(first, acc_s, acc_dp, Int<1>{}, Int<0>{});
    sm90::convert_into(acc_s, rP);
    sm90::convert_into(acc_dp, rDs);
    store_ds(first, rDs);
    if (steps > 1) store_stat(1, pending);  // ordered by iteration 0's barrier
    if (steps > 2 && ctid < 2 * kBlockM) pending = load_stat(2);
    // iteration t; kNext: a step t + 1 follows (every iteration but the last, which is peeled
    // off so that no wgmma batch or wait of the loop depends on a run-time condition)
    auto iteration = [&](const int t, auto next_tag) {
      constexpr bool kNext = decltype(next_tag)::value;
      const Step at(walk, t);
      [[maybe_unused]] const Step nx(walk, t + 1);  // step t + 1 (used where kNext)
      const int stage = at.stage;
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      if constexpr (kNext) issue_sdp(nx, acc_s, acc_dp);
      sm90::wgmma_gemm<false, true>(mma_dkv, tVrP, tVrDot(_, _, _, stage), acc_dv);
      sm90::bar_sync(kBarDsReady, kConsumerThreads);  // every warpgroup's dS^T of step t
      if (t + 2 < steps) store_stat(t + 2, pending);  // ordered by iteration t + 1's barrier
      sm90::wgmma_gemm<true, false>(mma_dq, tQrDs(_, _, _, at.buf), tQrKt, acc_dq);
      sm90::wgmma_gemm<false, true>(mma_dkv, tKrDs, tKrQt(_, _, _, stage), acc_dk);
      if constexpr (kNext) {
        // pending: S^T, dP^T (step t + 1), dV, dQ, dK (step t)
        softmax_ds(nx, acc_s, acc_dp, Int<4>{}, Int<3>{});
      }
      warpgroup_wait<1>();  // dV and dQ of step t are done: P^T's registers are free
      warpgroup_fence_operand(acc_dq);
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(rP);
      stage_dq(t, acc_dq);
      if (t + 3 < steps && ctid < 2 * kBlockM) pending = load_stat(t + 3);
      if constexpr (kNext) sm90::convert_into(acc_s, rP);
      warpgroup_wait<0>();  // dK of step t is done: dS^T's registers and the slot are free
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(rDs);
      release_slot(at);
      if constexpr (kNext) {
        sm90::convert_into(acc_dp, rDs);
        store_ds(nx, rDs);
      }
    };
    for (int t = 0; t + 1 < steps; ++t) iteration(t, cute::true_type{});
    iteration(steps - 1, cute::false_type{});
  }

  // ---- epilogue: dK (times the softmax scale) and dV, straight from the accumulators ----
  Tensor tDcD = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  if (p.group_split > 1) {
    // a part of the group: its fp32 sums as they are (dense only; the scale comes with the
    // sum), into p.dkv_part (2, batch, heads_kv * split, seqlen_k, head_dim) at the grid's
    // (kv head, part) pair vhead: dK's parts, then dV's
    const int64_t part_elems = int64_t(p.batch) * p.heads_kv * p.group_split * p.seqlen_k * kHeadDim;
    float* dk_part = p.dkv_part + (int64_t(view) * p.heads_kv * p.group_split + vhead) *
                                      p.seqlen_k * kHeadDim;
    float* dv_part = dk_part + part_elems;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); i += 2) {
      const int key = key0 + get<0>(tDcD(i));
      const int64_t at = int64_t(key) * kHeadDim + get<1>(tDcD(i));
      if (get<0>(tDcD(i + 1)) != get<0>(tDcD(i)) || get<1>(tDcD(i + 1)) != get<1>(tDcD(i)) + 1) {
        CUTE_UNROLL
        for (int j = i; j < i + 2; ++j) {  // not a pair: one element each
          const int kj = key0 + get<0>(tDcD(j));
          if (kj < seqlen_k) {
            dk_part[int64_t(kj) * kHeadDim + get<1>(tDcD(j))] = acc_dk(j);
            dv_part[int64_t(kj) * kHeadDim + get<1>(tDcD(j))] = acc_dv(j);
          }
        }
        continue;
      }
      if (key >= seqlen_k) continue;
      *reinterpret_cast<float2*>(dk_part + at) = make_float2(acc_dk(i), acc_dk(i + 1));
      *reinterpret_cast<float2*>(dv_part + at) = make_float2(acc_dv(i), acc_dv(i + 1));
    }
    return;
  }
  // (packed: view 0, the sequence's rows from k_first on, its keys only; dense: k_first 0)
  T* dk_ptr = static_cast<T*>(p.dk) + view * p.dk_batch_stride + int64_t(k_first) * p.dk_row_stride +
              vhead * p.dk_head_stride;  // (no split: vhead is the kv head)
  T* dv_ptr = static_cast<T*>(p.dv) + view * p.dv_batch_stride + int64_t(k_first) * p.dv_row_stride +
              vhead * p.dv_head_stride;
  const float scale = p.scale;
  static_assert(decltype(size(acc_dk))::value % 2 == 0, "accumulators hold column pairs");
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int key = key0 + get<0>(tDcD(i));
    const int col = get<1>(tDcD(i));
    // the wgmma accumulator holds neighbouring columns (c, c + 1) of one row in i, i + 1
    if (get<0>(tDcD(i + 1)) != get<0>(tDcD(i)) || get<1>(tDcD(i + 1)) != col + 1) {
      CUTE_UNROLL
      for (int j = i; j < i + 2; ++j) {  // not a pair: one element each
        const int kj = key0 + get<0>(tDcD(j));
        if (kj < seqlen_k) {
          dk_ptr[int64_t(kj) * p.dk_row_stride + get<1>(tDcD(j))] = static_cast<T>(acc_dk(j) * scale);
          dv_ptr[int64_t(kj) * p.dv_row_stride + get<1>(tDcD(j))] = static_cast<T>(acc_dv(j));
        }
      }
      continue;
    }
    if (key >= seqlen_k) continue;
    T* k_row = dk_ptr + int64_t(key) * p.dk_row_stride + col;
    T* v_row = dv_ptr + int64_t(key) * p.dv_row_stride + col;
    using Pair = cutlass::Array<T, 2>;
    Pair kp, vp;
    kp[0] = static_cast<T>(acc_dk(i) * scale);
    kp[1] = static_cast<T>(acc_dk(i + 1) * scale);
    vp[0] = static_cast<T>(acc_dv(i));
    vp[1] = static_cast<T>(acc_dv(i + 1));
    *reinterpret_cast<Pair*>(k_row) = kp;
    *reinterpret_cast<Pair*>(v_row) = vp;
  }
#else
  __trap();  // sm_90a only (wgmma, TMA, setmaxnreg)
#endif
}

}  // namespace sparktune
