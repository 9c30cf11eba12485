// The C++ kernel registry: every compiled configuration registers itself by name.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "params.h"

namespace sparktune {

constexpr int kMaxDevices = 64;

using FwdLaunchFn = cudaError_t (*)(FwdParams const&, cudaStream_t);
// the whole backward: preprocess, main kernel and dQ conversion, in order on the stream
using BwdLaunchFn = cudaError_t (*)(BwdParams const&, cudaStream_t);

struct KernelInfo {
  std::string name;
  std::string op;
  int family = 0;
  std::string atom;
  std::string dtype;
  int head_dim = 0, block_m = 0, block_n = 0, warps_m = 0, warps_n = 0;
  int accum = 32;
  std::string softmax;
  int threads = 0, smem_bytes = 0, min_arch = 0;
  FwdLaunchFn launch = nullptr;      // op "fwd"
  BwdLaunchFn launch_bwd = nullptr;  // op "bwd"
};

struct ExcludedKernel {
  std::string name;
  std::string reason;
};

class Registry {
 public:
  static Registry& instance();
  void add(KernelInfo info) { kernels_.push_back(std::move(info)); }
  void exclude(std::string name, std::string reason) {
    excluded_.push_back({std::move(name), std::move(reason)});
  }
  const std::vector<KernelInfo>& kernels() const { return kernels_; }
  const std::vector<ExcludedKernel>& excluded() const { return excluded_; }
  const KernelInfo* find(const std::string& name) const;

 private:
  std::vector<KernelInfo> kernels_;
  std::vector<ExcludedKernel> excluded_;
};

// Defined by the generated registration unit: calls every generated register_* function.
void register_all_kernels(Registry& registry);

}  // namespace sparktune
