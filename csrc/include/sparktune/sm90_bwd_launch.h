// Host side of one Hopper backward configuration: the TMA descriptors (loads of Q, dO, K, V; the
// reduce-add into the fp32 dQ workspace), the three launches
// (preprocess, main kernel, dQ conversion; their packed-sequence forms when cu_seqlens are
// set), a fourth with a group split (the sum of dK's and dV's parts) and the registration.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "launch_common.h"
#include "registry.h"
#include "sm90_bwd_kernel.h"
#include "sm90_bwd_order.h"
#include "sm90_fwd_launch.h"  // sm90_tma_compatible, tma_gmem_view

namespace sparktune {

template <class Traits>
cudaError_t launch_sm90_bwd(BwdParams const& p, cudaStream_t stream) {
  using T = typename Traits::Element;
  // packed sequences: one view of all rows of each tensor (the kernel offsets each sequence's
  // first row), with a stand-in batch stride that no coordinate steps
  const bool packed = p.cu_seqlens_q != nullptr;
  if (packed && (p.total_q < 1 || p.total_k < 1 || p.cu_seqlens_k == nullptr)) {
    return cudaErrorInvalidValue;
  }
  // TMA reads q, k, v (the forward's rule) and dout
  if (!sm90_tma_compatible<T>(p) || !tma_pointer_ok(p.dout) ||
      !tma_stride_ok<T>(p.do_row_stride) || !tma_stride_ok<T>(p.do_head_stride) ||
      !(packed || tma_stride_ok<T>(p.do_batch_stride))) {
    return cudaErrorInvalidValue;
  }
  // the group split (BwdParams::group_split): dense only, a divisor of the group, with partials
  const int split = p.group_split;
  if (split < 1 || p.group % split != 0 || (split > 1 && (packed || p.dkv_part == nullptr))) {
    return cudaErrorInvalidValue;
  }
  constexpr int kSmem = Traits::kSmemBytes;
  // the instantiation with the features' code (sm90::BwdMode): soft-capping or ALiBi, else a
  // sliding window, else none
  const int mode = p.softcap > 0.f || p.alibi_slopes != nullptr ? sm90::kBwdScores
                   : p.window_left >= 0 || p.window_right >= 0  ? sm90::kBwdBand
                                                                : sm90::kBwdPlain;
  auto kernel = mode == sm90::kBwdScores ? &sm90_bwd_kernel<Traits, sm90::kBwdScores>
                : mode == sm90::kBwdBand ? &sm90_bwd_kernel<Traits, sm90::kBwdBand>
                                         : &sm90_bwd_kernel<Traits, sm90::kBwdPlain>;
  cudaError_t err =
      mode == sm90::kBwdScores ? ensure_smem_limit<&sm90_bwd_kernel<Traits, sm90::kBwdScores>>(kSmem)
      : mode == sm90::kBwdBand ? ensure_smem_limit<&sm90_bwd_kernel<Traits, sm90::kBwdBand>>(kSmem)
                               : ensure_smem_limit<&sm90_bwd_kernel<Traits, sm90::kBwdPlain>>(kSmem);
  if (err != cudaSuccess) return err;
  const int rows_q = packed ? p.total_q : p.seqlen_q;
  const int rows_k = packed ? p.total_k : p.seqlen_k;
  const int views = packed ? 1 : p.batch;
  const int64_t qb = packed ? int64_t(rows_q) * p.q_row_stride : p.q_batch_stride;
  const int64_t dob = packed ? int64_t(rows_q) * p.do_row_stride : p.do_batch_stride;
  const int64_t kb = packed ? int64_t(rows_k) * p.k_row_stride : p.k_batch_stride;
  const int64_t vb = packed ? int64_t(rows_k) * p.v_row_stride : p.v_batch_stride;
  // the fp32 dQ workspace (row, head_dim, head, batch): (batch, heads_q, seqlen_q, head_dim),
  // packed (total_q, heads_q, head_dim); TMA leaves out the rows past seqlen_q (packed: total_q)
  constexpr int64_t kD = Traits::kHeadDim;
  const int64_t dq_row = packed ? int64_t(p.heads_q) * kD : kD;
  const int64_t dq_head = packed ? kD : int64_t(p.seqlen_q) * kD;
  const int64_t dq_batch = int64_t(p.heads_q) * rows_q * kD;
  auto view = &tma_gmem_view<T, Traits::kHeadDim>;
  using TileQ = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  auto smem_q = take<0, 2>(typename Traits::SmemLayoutQ{});
  Sm90BwdArgs<Traits> args{
      p,
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.q, rows_q, p.heads_q, views, p.q_row_stride, p.q_head_stride, qb),
                    smem_q, TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.dout, rows_q, p.heads_q, views, p.do_row_stride, p.do_head_stride, dob),
                    smem_q, TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.k, rows_k, p.heads_kv, views, p.k_row_stride, p.k_head_stride, kb),
                    typename Traits::SmemLayoutK{}, TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.v, rows_k, p.heads_kv, views, p.v_row_stride, p.v_head_stride, vb),
                    typename Traits::SmemLayoutV{}, TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_REDUCE_ADD{},
                    make_tensor(make_gmem_ptr(p.dq_accum),
                                make_layout(make_shape(int32_t(rows_q), int32_t(Traits::kHeadDim),
                                                       int32_t(p.heads_q), int32_t(views)),
                                            make_stride(dq_row, _1{}, dq_head, dq_batch))),
                    typename Traits::SmemLayoutDqPart{},
                    Shape<Int<Traits::kBlockM>, Int<Traits::kDqCols>>{}, _1{}),
  };
  // the row kernels: every (row, head) of each batch, packed every packed row of each head
  dim3 row_grid = packed ? dim3(ceil_div(p.total_q, kRowKernelRows), p.heads_q, 1)
                         : dim3(ceil_div(p.seqlen_q, kRowKernelRows), p.heads_q, p.batch);
  if (packed) {
    bwd_preprocess_packed_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  } else {
    bwd_preprocess_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // key blocks along x (deterministic causal: from the last one), or along y in the sectioned
  // order below: in deterministic mode a block waits only for blocks of its own pair with a
  // lower key index (launched before it). Packed: the longest sequence's key blocks
  // (p.seqlen_k), for every sequence as the batch; a block past its sequence's keys leaves at
  // once.
  const int key_blocks = ceil_div(p.seqlen_k, Traits::kBlockN);
  // (with the group split, each kv head is `split` (kv head, part) pairs of the grid)
  dim3 grid(key_blocks, p.heads_kv * split, p.batch);
  args.p.tile_section = 0;
  args.p.part_heads = p.group / split;
  if (p.causal || p.window_right >= 0) {
    // Limited on the right: key blocks of unequal weight (causal: the first the heaviest).
    // The (kv head, batch) pairs in sections whose Q, dO and fp32 dQ workspace take at most
    // the budget together, each section's key blocks heaviest first across its pairs. An
    // 8 MB budget (SPARKTUNE_SM90_BWD_L2_MB, read at each launch; 0: one pair after another),
    // measured on an H100 against one pair after another (BENCHMARKS.md, "Sectioned block
    // order in the backward"): head dim 64 causal +2% to +6% at 1k-8k, head dim 128 +1-2% at
    // 1k-2k; a 24 MB budget lost 6% at head dim 128 with 1k, the whole grid (key-major) more.
    // (sm90_bwd_order.h: unset, a grid of few pairs is one section.)
    int64_t budget_mb = -1;
    if (const char* env = std::getenv("SPARKTUNE_SM90_BWD_L2_MB"); env != nullptr && *env != 0) {
      budget_mb = std::atoll(env);
      budget_mb = budget_mb < 0 ? 0 : budget_mb;
    }
    int sms = 0;
    if (cudaError_t e = sm_count(sms); e != cudaSuccess) return e;
    const int64_t pair_bytes =
        int64_t(args.p.part_heads) * p.seqlen_q * Traits::kHeadDim * (2 * int64_t(sizeof(T)) + 4);
    const int64_t pairs = int64_t(p.heads_kv) * split * p.batch;
    const int64_t per = sm90_bwd_section_pairs(pairs, key_blocks, pair_bytes, sms, budget_mb);
    if (per > 1 && key_blocks <= 65535) {  // (grid y's limit)
      args.p.tile_section = int(per);
      grid = dim3(unsigned(per), unsigned(key_blocks), unsigned(ceil_div(pairs, per)));
    }
  }
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(args);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (split > 1) {
    const dim3 key_grid(ceil_div(p.seqlen_k, kRowKernelRows), p.heads_kv, p.batch);
    bwd_sum_dkv_kernel<T><<<key_grid, kRowKernelThreads, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (packed) {
    bwd_convert_dq_packed_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  } else {
    bwd_convert_dq_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <class Config>
void register_sm90_bwd(Registry& registry, const char* name) {
  if constexpr (Config::kValid) {
    using Traits = Sm90BwdTraits<Config>;
    // P^T and dS^T stay in registers for dV and dK; dS^T goes through shared memory for dQ
    KernelInfo info = describe<Config>(name, "bwd", "smem");
    info.atom = "wgmma";
    info.launch_bwd = &launch_sm90_bwd<Traits>;
    registry.add(std::move(info));
  } else {
    registry.exclude(name, Config::kInvalidReason);
  }
}

}  // namespace sparktune
