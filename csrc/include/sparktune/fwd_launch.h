// Host side of one forward configuration: launch and registration.
#pragma once

#include <cuda_runtime.h>

#include "fwd_kernel.h"
#include "registry.h"

namespace sparktune {

template <class Traits>
cudaError_t launch_fwd(FwdParams const& p, cudaStream_t stream) {
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &fwd_kernel<Traits>;
  if constexpr (kSmem > 48 * 1024) {
    // raise the dynamic shared-memory limit once per device
    static bool configured[kMaxDevices] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    if (device < 0 || device >= kMaxDevices || !configured[device]) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
      if (err != cudaSuccess) return err;
      if (device >= 0 && device < kMaxDevices) configured[device] = true;
    }
  }
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <class Config>
void register_fwd(Registry& registry, const char* name) {
  if constexpr (Config::kValid) {
    using Traits = FwdTraits<Config>;
    KernelInfo info;
    info.name = name;
    info.op = "fwd";
    info.family = Config::kFamily;
    info.atom = Config::kFamily == 70 ? "m8n8k4" : "m16n8k16";
    info.dtype = Config::kIsHalf ? "float16" : "bfloat16";
    info.head_dim = Config::kHeadDim;
    info.block_m = Config::kBlockM;
    info.block_n = Config::kBlockN;
    info.warps_m = Config::kWarpsM;
    info.warps_n = Config::kWarpsN;
    info.accum = Config::kAcc32 ? 32 : 16;
    info.softmax = Config::kRegSoftmax ? "reg" : "smem";
    info.threads = Config::kThreads;
    info.smem_bytes = Config::kSmemBytes;
    info.min_arch = Config::kFamily;
    info.launch = &launch_fwd<Traits>;
    registry.add(std::move(info));
  } else {
    registry.exclude(name, Config::kInvalidReason);
  }
}

}  // namespace sparktune
