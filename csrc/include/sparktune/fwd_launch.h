// Host side of one forward configuration: launch and registration.
#pragma once

#include <cuda_runtime.h>

#include "fwd_kernel.h"
#include "launch_common.h"
#include "registry.h"

namespace sparktune {

template <class Traits>
cudaError_t launch_fwd(FwdParams const& p, cudaStream_t stream) {
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &fwd_kernel<Traits>;
  if (cudaError_t err = ensure_smem_limit<&fwd_kernel<Traits>>(kSmem); err != cudaSuccess) return err;
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <class Config>
void register_fwd(Registry& registry, const char* name) {
  if constexpr (Config::kValid) {
    using Traits = FwdTraits<Config>;
    KernelInfo info = describe<Config>(name, "fwd", Config::kRegSoftmax ? "reg" : "smem");
    info.launch = &launch_fwd<Traits>;
    registry.add(std::move(info));
  } else {
    registry.exclude(name, Config::kInvalidReason);
  }
}

}  // namespace sparktune
