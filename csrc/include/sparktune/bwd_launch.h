// Host side of one backward configuration: the three launches (preprocess, main, dQ
// conversion) and registration.
#pragma once

#include <cuda_runtime.h>

#include "bwd_kernel.h"
#include "registry.h"

namespace sparktune {

template <class Traits>
cudaError_t launch_bwd(BwdParams const& p, cudaStream_t stream) {
  using T = typename Traits::Element;
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &bwd_kernel<Traits>;
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
    KernelInfo info;
    info.name = name;
    info.op = "bwd";
    info.family = Config::kFamily;
    info.atom = Config::kFamily == 70 ? "m8n8k4" : "m16n8k16";
    info.dtype = Config::kIsHalf ? "float16" : "bfloat16";
    info.head_dim = Config::kHeadDim;
    info.block_m = Config::kBlockM;
    info.block_n = Config::kBlockN;
    info.warps_m = Config::kWarpsM;
    info.warps_n = Config::kWarpsN;
    info.accum = Config::kAcc32 ? 32 : 16;
    info.softmax = "smem";  // P and dS go through shared memory
    info.threads = Config::kThreads;
    info.smem_bytes = Config::kSmemBytes;
    info.min_arch = Config::kFamily;
    info.launch_bwd = &launch_bwd<Traits>;
    registry.add(std::move(info));
  } else {
    registry.exclude(name, Config::kInvalidReason);
  }
}

}  // namespace sparktune
