// Host side of one Hopper backward configuration: the TMA descriptors (loads of Q, dO, K, V; the
// reduce-add into the fp32 dQ workspace), the three launches
// (preprocess, main kernel, dQ conversion) and the registration.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launch_common.h"
#include "registry.h"
#include "sm90_bwd_kernel.h"
#include "sm90_fwd_launch.h"  // sm90_tma_compatible, tma_gmem_view

namespace sparktune {

template <class Traits>
cudaError_t launch_sm90_bwd(BwdParams const& p, cudaStream_t stream) {
  using T = typename Traits::Element;
  // TMA reads q, k, v (the forward's rule) and dout
  if (!sm90_tma_compatible<T>(p) || !tma_pointer_ok(p.dout) ||
      !tma_stride_ok<T>(p.do_row_stride) || !tma_stride_ok<T>(p.do_head_stride) ||
      !tma_stride_ok<T>(p.do_batch_stride)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &sm90_bwd_kernel<Traits>;
  if (cudaError_t err = ensure_smem_limit<&sm90_bwd_kernel<Traits>>(kSmem); err != cudaSuccess) {
    return err;
  }
  auto view = &tma_gmem_view<T, Traits::kHeadDim>;
  using TileQ = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  using TileKV = Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>;
  auto smem_q = take<0, 2>(typename Traits::SmemLayoutQ{});
  Sm90BwdArgs<Traits> args{
      p,
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.q, p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride,
                         p.q_batch_stride),
                    smem_q, TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.dout, p.seqlen_q, p.heads_q, p.batch, p.do_row_stride,
                         p.do_head_stride, p.do_batch_stride),
                    smem_q, TileQ{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.k, p.seqlen_k, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride,
                         p.k_batch_stride),
                    typename Traits::SmemLayoutK{}, TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.v, p.seqlen_k, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride,
                         p.v_batch_stride),
                    typename Traits::SmemLayoutV{}, TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_REDUCE_ADD{},
                    make_tensor(make_gmem_ptr(p.dq_accum),
                                make_layout(make_shape(int32_t(p.seqlen_q), int32_t(Traits::kHeadDim),
                                                       int32_t(p.heads_q), int32_t(p.batch)),
                                            make_stride(int64_t(Traits::kHeadDim), _1{},
                                                        int64_t(p.seqlen_q) * Traits::kHeadDim,
                                                        int64_t(p.heads_q) * p.seqlen_q * Traits::kHeadDim))),
                    typename Traits::SmemLayoutDqPart{},
                    Shape<Int<Traits::kBlockM>, Int<Traits::kDqCols>>{}, _1{}),
  };
  dim3 row_grid(ceil_div(p.seqlen_q, kRowKernelRows), p.heads_q, p.batch);
  bwd_preprocess_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // key blocks along x (deterministic causal: from the last one): in deterministic mode a
  // block waits only for blocks of lower index (launched before it)
  dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(args);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  bwd_convert_dq_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
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
