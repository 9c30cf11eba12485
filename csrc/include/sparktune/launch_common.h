// What every configuration's host side shares: the dynamic shared-memory opt-in, the SM count
// and the registry entry built from the configuration's compile-time rules.
#pragma once

#include <cuda_runtime.h>

#include "registry.h"

namespace sparktune {

// Raise kKernel's dynamic shared-memory limit to `bytes` once per device (needed above 48 KB).
template <auto kKernel>
cudaError_t ensure_smem_limit(int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  static bool configured[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable && configured[device]) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && cacheable) configured[device] = true;
  return err;
}

// The SM count of the current device, asked once per device (persistent grids size by it).
inline cudaError_t sm_count(int& out) {
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable && cached[device] > 0) {
    out = cached[device];
    return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(&out, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess && cacheable) cached[device] = out;
  return err;
}

// The registry entry of a valid configuration, less its launch function.
template <class Config>
KernelInfo describe(const char* name, const char* op, const char* softmax) {
  KernelInfo info;
  info.name = name;
  info.op = op;
  info.family = Config::kFamily;
  info.atom = Config::kFamily == 70 ? "m8n8k4" : "m16n8k16";
  info.dtype = Config::kIsHalf ? "float16" : "bfloat16";
  info.head_dim = Config::kHeadDim;
  info.block_m = Config::kBlockM;
  info.block_n = Config::kBlockN;
  info.warps_m = Config::kWarpsM;
  info.warps_n = Config::kWarpsN;
  info.accum = Config::kAcc32 ? 32 : 16;
  info.softmax = softmax;
  info.threads = Config::kThreads;
  info.smem_bytes = Config::kSmemBytes;
  info.min_arch = Config::kFamily;
  return info;
}

}  // namespace sparktune
