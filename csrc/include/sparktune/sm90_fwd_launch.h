// Host side of one Hopper forward configuration: the TMA descriptors, the launch and the
// registration.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launch_common.h"
#include "registry.h"
#include "sm90_fwd_kernel.h"

namespace sparktune {

// TMA reads a tensor whose base address is 16-byte aligned and whose strides (in bytes) are
// multiples of 16 below 2^40.
inline bool tma_pointer_ok(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <class Element>
bool tma_stride_ok(int64_t s) {
  const int64_t bytes = s * int64_t(sizeof(Element));
  return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t(1) << 40);
}

// False when q, k, v or o break TMA's rule: the launch then refuses (the Python backend says
// why before it gets here).
template <class Element>
bool sm90_tma_compatible(FwdParams const& p) {
  auto ok = [](int64_t s) { return tma_stride_ok<Element>(s); };
  return tma_pointer_ok(p.q) && tma_pointer_ok(p.k) && tma_pointer_ok(p.v) && tma_pointer_ok(p.o) &&
         ok(p.q_row_stride) && ok(p.q_head_stride) && ok(p.q_batch_stride) &&
         ok(p.k_row_stride) && ok(p.k_head_stride) && ok(p.k_batch_stride) &&
         ok(p.v_row_stride) && ok(p.v_head_stride) && ok(p.v_batch_stride) && ok(p.o_row_stride);
}

// A (row, head_dim, head, batch) view of q, k, v or dout with the caller's strides, what the
// TMA descriptors are built from (TMA zero-fills what lies past seqlen).
template <class Element, int kHeadDim>
auto tma_gmem_view(const void* ptr, int seqlen, int heads, int batch, int64_t row, int64_t hs,
                   int64_t bs) {
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                     make_layout(make_shape(int32_t(seqlen), int32_t(kHeadDim), int32_t(heads),
                                            int32_t(batch)),
                                 make_stride(row, _1{}, hs, bs)));
}

template <class Traits>
cudaError_t launch_sm90_fwd(FwdParams const& p, cudaStream_t stream) {
  using T = typename Traits::Element;
  if (!sm90_tma_compatible<T>(p)) return cudaErrorInvalidValue;
  constexpr int kSmem = Traits::kSmemBytes;
  auto kernel = &sm90_fwd_kernel<Traits>;
  if (cudaError_t err = ensure_smem_limit<&sm90_fwd_kernel<Traits>>(kSmem); err != cudaSuccess) {
    return err;
  }
  // the key tail is masked, the query tail is not stored
  auto view = &tma_gmem_view<T, Traits::kHeadDim>;
  Sm90FwdArgs<Traits> args{
      p,
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.q, p.seqlen_q, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride,
                         p.q_batch_stride),
                    typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.k, p.seqlen_k, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride,
                         p.k_batch_stride),
                    take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.v, p.seqlen_k, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride,
                         p.v_batch_stride),
                    take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}),
  };
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  if constexpr (Traits::kPersistent) {  // one block per SM (at most one tile each)
    const int64_t tiles = int64_t(grid.x) * grid.y * grid.z;
    int sms = 0;
    if (cudaError_t err = sm_count(sms); err != cudaSuccess) return err;
    grid = dim3(unsigned(tiles < sms ? tiles : sms), 1, 1);
  }
  kernel<<<grid, Traits::kThreads, kSmem, stream>>>(args);
  return cudaGetLastError();
}

template <class Config>
void register_sm90_fwd(Registry& registry, const char* name) {
  if constexpr (Config::kValid) {
    using Traits = Sm90FwdTraits<Config>;
    KernelInfo info = describe<Config>(name, "fwd", "reg");
    info.atom = "wgmma";
    info.launch = &launch_sm90_fwd<Traits>;
    registry.add(std::move(info));
  } else {
    registry.exclude(name, Config::kInvalidReason);
  }
}

}  // namespace sparktune
