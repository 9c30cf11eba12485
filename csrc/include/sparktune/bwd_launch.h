// Host side of one backward configuration: the three launches (preprocess, main, dQ
// conversion) and registration.
#pragma once

#include <cuda_runtime.h>

#include "bwd_kernel.h"
#include "launch_common.h"
#include "registry.h"

namespace sparktune {

template <class Traits>
cudaError_t launch_bwd(BwdParams const& p, cudaStream_t stream) {
  using T = typename Traits::Element;
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &bwd_kernel<Traits>;
  if (cudaError_t err = ensure_smem_limit<&bwd_kernel<Traits>>(kSmem); err != cudaSuccess) return err;
  dim3 row_grid(ceil_div(p.seqlen_q, kRowKernelRows), p.heads_q, p.batch);
  bwd_preprocess_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  bwd_convert_dq_kernel<T><<<row_grid, kRowKernelThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <class Config>
void register_bwd(Registry& registry, const char* name) {
  if constexpr (Config::kValid) {
    using Traits = BwdTraits<Config>;
    // P and dS go through shared memory
    KernelInfo info = describe<Config>(name, "bwd", "smem");
    info.launch_bwd = &launch_bwd<Traits>;
    registry.add(std::move(info));
  } else {
    registry.exclude(name, Config::kInvalidReason);
  }
}

}  // namespace sparktune
