// sparktune._C: the compiled kernel family behind a small pybind11 interface. No torch here:
// pointers, strides, sizes and a stream handle come in as integers (csrc/INTERFACE.md).
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <sstream>
#include <tuple>

#include "sparktune/registry.h"

namespace py = pybind11;
using sparktune::BwdParams;
using sparktune::FwdParams;
using sparktune::KernelInfo;
using sparktune::Registry;

namespace sparktune {
extern const char* kBuildSpaceId;
}

#ifndef SPARKTUNE_VERSION
#define SPARKTUNE_VERSION "0.0.0"
#endif
#ifndef SPARKTUNE_ARCHS
#define SPARKTUNE_ARCHS ""
#endif
#ifndef SPARKTUNE_FAMILY70_ARCHS
#define SPARKTUNE_FAMILY70_ARCHS ""
#endif
#ifndef SPARKTUNE_FAMILY80_ARCHS
#define SPARKTUNE_FAMILY80_ARCHS ""
#endif
#ifndef SPARKTUNE_FAMILY90_ARCHS
#define SPARKTUNE_FAMILY90_ARCHS ""
#endif
#ifndef SPARKTUNE_KERNEL_FILTER
#define SPARKTUNE_KERNEL_FILTER ""
#endif

namespace {

using Strides = std::tuple<int64_t, int64_t, int64_t>;

std::vector<int> parse_archs(const std::string& s);

py::dict kernel_dict(const KernelInfo& k) {
  py::dict d;
  d["name"] = k.name;
  d["op"] = k.op;
  d["family"] = k.family;
  d["atom"] = k.atom;
  d["dtype"] = k.dtype;
  d["head_dim"] = k.head_dim;
  d["block_m"] = k.block_m;
  d["block_n"] = k.block_n;
  d["warps_m"] = k.warps_m;
  d["warps_n"] = k.warps_n;
  d["accum"] = k.accum;
  d["softmax"] = k.softmax;
  d["threads"] = k.threads;
  d["smem_bytes"] = k.smem_bytes;
  d["min_arch"] = k.min_arch;
  // the GPUs this kernel has machine code for (its family's build architectures)
  d["archs"] = parse_archs(k.family == 70   ? SPARKTUNE_FAMILY70_ARCHS
                           : k.family == 90 ? SPARKTUNE_FAMILY90_ARCHS
                                            : SPARKTUNE_FAMILY80_ARCHS);
  return d;
}

std::vector<int> parse_archs(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ';')) {
    if (!item.empty()) out.push_back(std::stoi(item));
  }
  return out;
}

// Checks shared by every launch, and the fields of FwdParams (also the base of BwdParams).
const KernelInfo& find_kernel(const std::string& name, const char* op) {
  const KernelInfo* info = Registry::instance().find(name);
  if (info == nullptr) throw std::invalid_argument("unknown kernel '" + name + "'");
  if (info->op != op) {
    throw std::invalid_argument("kernel '" + name + "' is a " + info->op + " kernel, not " + op);
  }
  return *info;
}

void fill_common(FwdParams& p, const KernelInfo& info, uintptr_t q, uintptr_t k, uintptr_t v,
                 uintptr_t o, uintptr_t lse, int batch, int heads_q, int heads_kv, int seqlen_q,
                 int seqlen_k, int head_dim, Strides qs, Strides ks, Strides vs, Strides os,
                 double scale, bool causal) {
  if (head_dim != info.head_dim) {
    throw std::invalid_argument("kernel '" + info.name + "' is built for head_dim " +
                                std::to_string(info.head_dim) + ", got " +
                                std::to_string(head_dim));
  }
  if (batch < 1 || heads_q < 1 || heads_kv < 1 || seqlen_q < 1 || seqlen_k < 1 ||
      heads_q % heads_kv != 0) {
    throw std::invalid_argument("invalid sizes: batch, heads and seqlens must be positive and "
                                "heads_q a multiple of heads_kv");
  }
  if (batch > 65535 || heads_q > 65535) {
    throw std::invalid_argument("batch and heads_q must be at most 65535");
  }
  if (!(scale > 0.0) || !std::isfinite(scale)) {
    throw std::invalid_argument("scale must be a finite positive number");
  }
  p.q = reinterpret_cast<const void*>(q);
  p.k = reinterpret_cast<const void*>(k);
  p.v = reinterpret_cast<const void*>(v);
  p.o = reinterpret_cast<void*>(o);
  p.lse = reinterpret_cast<float*>(lse);
  std::tie(p.q_batch_stride, p.q_head_stride, p.q_row_stride) = qs;
  std::tie(p.k_batch_stride, p.k_head_stride, p.k_row_stride) = ks;
  std::tie(p.v_batch_stride, p.v_head_stride, p.v_row_stride) = vs;
  std::tie(p.o_batch_stride, p.o_head_stride, p.o_row_stride) = os;
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.group = heads_q / heads_kv;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal;
}

// Packed sequences (cu_seqlens set): the family 90 kernels only, with both boundary arrays and
// both totals (the boundaries' values are the caller's to check: reading them here would wait
// for the device).
void fill_packed(FwdParams& p, const KernelInfo& info, const char* op, uintptr_t cu_seqlens_q,
                 uintptr_t cu_seqlens_k, int total_q, int total_k) {
  if (cu_seqlens_q == 0 && cu_seqlens_k == 0) {
    if (total_q != 0 || total_k != 0) {
      throw std::invalid_argument("total_q and total_k are for packed sequences (with "
                                  "cu_seqlens_q and cu_seqlens_k) only");
    }
    return;
  }
  if (info.family != 90) {
    throw std::invalid_argument("kernel '" + info.name + "' (family " +
                                std::to_string(info.family) + " " + op +
                                ") has no packed-sequence mode (the family 90 forward and "
                                "backward have: fwd_sm90_*, bwd_sm90_*)");
  }
  if (cu_seqlens_q == 0 || cu_seqlens_k == 0 || total_q < 1 || total_k < 1) {
    throw std::invalid_argument("packed sequences need cu_seqlens_q, cu_seqlens_k and "
                                "total_q, total_k >= 1");
  }
  p.cu_seqlens_q = reinterpret_cast<const int*>(cu_seqlens_q);
  p.cu_seqlens_k = reinterpret_cast<const int*>(cu_seqlens_k);
  p.total_q = total_q;
  p.total_k = total_k;
}

void check_launch(cudaError_t err, const std::string& name) {
  if (err != cudaSuccess) {
    throw std::runtime_error("kernel '" + name + "' failed to launch: " + cudaGetErrorString(err));
  }
}

// The attention features of the family 90 forward and backward (FwdParams): checked, then set.
void fill_features(FwdParams& p, const KernelInfo& info, int window_left, int window_right,
                   double softcap, uintptr_t alibi_slopes, int64_t alibi_batch_stride) {
  const bool on = window_left != -1 || window_right != -1 || softcap != 0.0 || alibi_slopes != 0;
  if (on && info.family != 90) {
    throw std::invalid_argument("kernel '" + info.name +
                                "' has no sliding window, softcap or ALiBi (the family 90 "
                                "kernels, fwd_sm90_* and bwd_sm90_*, have them)");
  }
  if (window_left < -1 || window_right < -1) {
    throw std::invalid_argument("window sides must be >= 0, or -1 for unlimited, got (" +
                                std::to_string(window_left) + ", " +
                                std::to_string(window_right) + ")");
  }
  if (!(softcap >= 0.0) || !std::isfinite(softcap)) {
    throw std::invalid_argument("softcap must be finite and >= 0 (0 for off)");
  }
  if (alibi_batch_stride < 0) {
    throw std::invalid_argument("alibi_batch_stride must be >= 0 (0: one slope per head)");
  }
  p.window_left = window_left;
  p.window_right = window_right;
  if (softcap > 0.0) {
    p.softcap = static_cast<float>(softcap);
    p.softcap_in = static_cast<float>(double(p.scale) / softcap);
    p.softcap_log2 = static_cast<float>(softcap * 1.4426950408889634);
  }
  p.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  p.alibi_batch_stride = alibi_batch_stride;
}

void fwd(const std::string& name, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o,
         uintptr_t lse, int batch, int heads_q, int heads_kv, int seqlen_q, int seqlen_k,
         int head_dim, Strides qs, Strides ks, Strides vs, Strides os, double scale, bool causal,
         uintptr_t stream, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q,
         int total_k, uintptr_t tile_counter, int window_left, int window_right, double softcap,
         uintptr_t alibi_slopes, int64_t alibi_batch_stride) {
  const KernelInfo& info = find_kernel(name, "fwd");
  if (tile_counter != 0 && info.family != 90) {
    throw std::invalid_argument("kernel '" + name +
                                "' has no tile counter (tile_counter is for family 90)");
  }
  FwdParams p;
  fill_common(p, info, q, k, v, o, lse, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim,
              qs, ks, vs, os, scale, causal);
  fill_packed(p, info, "fwd", cu_seqlens_q, cu_seqlens_k, total_q, total_k);
  fill_features(p, info, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride);
  p.tile_counter = reinterpret_cast<int*>(tile_counter);
  check_launch(info.launch(p, reinterpret_cast<cudaStream_t>(stream)), name);
}

void bwd(const std::string& name, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o,
         uintptr_t lse, uintptr_t dout, uintptr_t dq, uintptr_t dk, uintptr_t dv,
         uintptr_t dq_accum, uintptr_t dsum, int batch, int heads_q, int heads_kv, int seqlen_q,
         int seqlen_k, int head_dim, Strides qs, Strides ks, Strides vs, Strides os, Strides dos,
         Strides dqs, Strides dks, Strides dvs, double scale, bool causal, uintptr_t stream,
         uintptr_t dq_semaphore, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q,
         int total_k, int window_left, int window_right, double softcap, uintptr_t alibi_slopes,
         int64_t alibi_batch_stride, int group_split, uintptr_t dkv_part) {
  const KernelInfo& info = find_kernel(name, "bwd");
  if (dq_semaphore != 0 && info.family != 90) {
    throw std::invalid_argument("kernel '" + name +
                                "' has no deterministic mode (dq_semaphore is for family 90)");
  }
  if (group_split != 1) {
    const int group = heads_kv > 0 ? heads_q / heads_kv : 0;
    if (info.family != 90 || group_split < 1 || group % group_split != 0 || dkv_part == 0 ||
        cu_seqlens_q != 0) {
      throw std::invalid_argument(
          "kernel '" + name + "': group_split " + std::to_string(group_split) +
          " needs a family 90 backward, a divisor of the group (" + std::to_string(group) +
          " query heads per kv head), a dkv_part workspace and dense (not packed) tensors");
    }
  }
  BwdParams p;
  fill_common(p, info, q, k, v, o, lse, batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim,
              qs, ks, vs, os, scale, causal);
  fill_packed(p, info, "bwd", cu_seqlens_q, cu_seqlens_k, total_q, total_k);
  fill_features(p, info, window_left, window_right, softcap, alibi_slopes, alibi_batch_stride);
  p.dout = reinterpret_cast<const void*>(dout);
  p.dq = reinterpret_cast<void*>(dq);
  p.dk = reinterpret_cast<void*>(dk);
  p.dv = reinterpret_cast<void*>(dv);
  p.dq_accum = reinterpret_cast<float*>(dq_accum);
  p.dsum = reinterpret_cast<float*>(dsum);
  p.dq_semaphore = reinterpret_cast<int*>(dq_semaphore);
  p.group_split = group_split;
  p.dkv_part = reinterpret_cast<float*>(dkv_part);
  std::tie(p.do_batch_stride, p.do_head_stride, p.do_row_stride) = dos;
  std::tie(p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride) = dqs;
  std::tie(p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride) = dks;
  std::tie(p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride) = dvs;
  check_launch(info.launch_bwd(p, reinterpret_cast<cudaStream_t>(stream)), name);
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "sparktune compiled attention kernels";
  m.def("build_info", [] {
    py::dict d;
    d["version"] = SPARKTUNE_VERSION;
    d["cuda_version"] = std::to_string(CUDART_VERSION / 1000) + "." +
                        std::to_string((CUDART_VERSION % 1000) / 10);
    d["archs"] = parse_archs(SPARKTUNE_ARCHS);
    d["build_id"] = std::string(sparktune::kBuildSpaceId) + "-" + SPARKTUNE_ARCHS;
    d["kernel_filter"] = SPARKTUNE_KERNEL_FILTER;
    return d;
  });
  m.def("kernels", [] {
    py::list out;
    for (const auto& k : Registry::instance().kernels()) out.append(kernel_dict(k));
    return out;
  });
  m.def("excluded", [] {
    py::list out;
    for (const auto& e : Registry::instance().excluded()) {
      py::dict d;
      d["name"] = e.name;
      d["reason"] = e.reason;
      out.append(d);
    }
    return out;
  });
  m.def("fwd", &fwd, py::arg("name"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("batch"), py::arg("heads_q"), py::arg("heads_kv"),
        py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("head_dim"), py::arg("q_strides"),
        py::arg("k_strides"), py::arg("v_strides"), py::arg("o_strides"), py::arg("scale"),
        py::arg("causal"), py::arg("stream"), py::arg("cu_seqlens_q") = 0,
        py::arg("cu_seqlens_k") = 0, py::arg("total_q") = 0, py::arg("total_k") = 0,
        py::arg("tile_counter") = 0, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("softcap") = 0.0, py::arg("alibi_slopes") = 0, py::arg("alibi_batch_stride") = 0);
  m.def("bwd", &bwd, py::arg("name"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
        py::arg("lse"), py::arg("dout"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
        py::arg("dq_accum"), py::arg("dsum"), py::arg("batch"), py::arg("heads_q"),
        py::arg("heads_kv"), py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("head_dim"),
        py::arg("q_strides"), py::arg("k_strides"), py::arg("v_strides"), py::arg("o_strides"),
        py::arg("dout_strides"), py::arg("dq_strides"), py::arg("dk_strides"),
        py::arg("dv_strides"), py::arg("scale"), py::arg("causal"), py::arg("stream"),
        py::arg("dq_semaphore") = 0, py::arg("cu_seqlens_q") = 0, py::arg("cu_seqlens_k") = 0,
        py::arg("total_q") = 0, py::arg("total_k") = 0, py::arg("window_left") = -1,
        py::arg("window_right") = -1, py::arg("softcap") = 0.0, py::arg("alibi_slopes") = 0,
        py::arg("alibi_batch_stride") = 0, py::arg("group_split") = 1, py::arg("dkv_part") = 0);
}
