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
  // packed sequences: one view of the whole packed tensor, whose batch stride is never used
  const bool packed = p.cu_seqlens_q != nullptr;
  return tma_pointer_ok(p.q) && tma_pointer_ok(p.k) && tma_pointer_ok(p.v) && tma_pointer_ok(p.o) &&
         ok(p.q_row_stride) && ok(p.q_head_stride) && (packed || ok(p.q_batch_stride)) &&
         ok(p.k_row_stride) && ok(p.k_head_stride) && (packed || ok(p.k_batch_stride)) &&
         ok(p.v_row_stride) && ok(p.v_head_stride) && (packed || ok(p.v_batch_stride)) &&
         ok(p.o_row_stride);
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
  // the key tail is masked, the query tail is not stored; packed sequences: one view of all
  // rows (the kernel offsets each sequence's first row), with a stand-in batch stride
  const bool packed = p.cu_seqlens_q != nullptr;
  if (packed && (p.total_q < 1 || p.total_k < 1 || p.cu_seqlens_k == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int rows_q = packed ? p.total_q : p.seqlen_q;
  const int rows_k = packed ? p.total_k : p.seqlen_k;
  const int views = packed ? 1 : p.batch;
  const int64_t qb = packed ? int64_t(rows_q) * p.q_row_stride : p.q_batch_stride;
  const int64_t kb = packed ? int64_t(rows_k) * p.k_row_stride : p.k_batch_stride;
  const int64_t vb = packed ? int64_t(rows_k) * p.v_row_stride : p.v_batch_stride;
  auto view = &tma_gmem_view<T, Traits::kHeadDim>;
  Sm90FwdArgs<Traits> args{
      p,
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.q, rows_q, p.heads_q, views, p.q_row_stride, p.q_head_stride, qb),
                    typename Traits::SmemLayoutQ{}, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.k, rows_k, p.heads_kv, views, p.k_row_stride, p.k_head_stride, kb),
                    take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{},
                    view(p.v, rows_k, p.heads_kv, views, p.v_row_stride, p.v_head_stride, vb),
                    take<0, 2>(typename Traits::SmemLayoutKV{}),
                    Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{}),
  };
  dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  if constexpr (Traits::kPersistent) {
    // Persistent blocks take tiles in static rounds (no tile counter), so the order decides
    // both what shares L2 and how evenly the rounds' work falls on the blocks: small sections,
    // whose tiles running
    // together read one or two pairs' K and V as in the non-persistent grid order (non-causal:
    // two pairs; causal: one), except causal launches of 32 row blocks or more a pair: one
    // section, the heaviest tiles of all pairs first, whose rounds are nearly even (small
    // sections restart at their heaviest tiles every few rounds, and the blocks that take those
    // fall behind). Measured on an H200 against 24 MB sections (BENCHMARKS.md, "Persistent
    // blocks"): two pairs -4% to +8% non-causal from 1k to 8k, one pair -4% to +10% causal at
    // 512-2k, one section -3% to +10% causal at 4k-8k, per kernel. With a tile counter the
    // blocks take the same order's tiles as they become free (measured with static rounds).
    args.p.tile_section = !p.causal ? 2 * p.group : grid.x >= 32 ? 0 : p.group;
    // Packed sequences keep the static rounds: their tile list holds the longest sequence's
    // row blocks for every sequence, mostly tiles past a shorter sequence's end, which a block
    // passes over in a few instructions in its static rounds but which would each cost a round
    // trip to the counter (one global atomic, in series) in the dynamic order.
    if (packed) args.p.tile_counter = nullptr;
    // one block per SM (at most one tile each)
    const int64_t tiles = int64_t(grid.x) * grid.y * grid.z;
    int sms = 0;
    if (cudaError_t err = sm_count(sms); err != cudaSuccess) return err;
    grid = dim3(unsigned(tiles < sms ? tiles : sms), 1, 1);
  } else if (p.causal) {
    // Causal launches take the sectioned order: the (head, batch) pairs in sections whose K and
    // V take at most kL2Budget together (H100/H200: 50 MB of L2), the heaviest row blocks of a
    // section first, so that the light ones fill the end of the grid: on an H200, 2-8% more
    // TFLOP/s than the grid's own order at 2k-8k tokens (BENCHMARKS.md, "Tile order").
    constexpr int64_t kL2Budget = int64_t(24) << 20;
    const int64_t kv_bytes = int64_t(p.seqlen_k) * Traits::kHeadDim * 2 * int64_t(sizeof(T));
    const int64_t kv_heads = kv_bytes > 0 ? kL2Budget / kv_bytes : 1;
    const int64_t pairs = int64_t(p.heads_kv) * p.batch;
    args.p.tile_section = int(kv_heads < 1 ? 1 : (kv_heads > pairs ? pairs : kv_heads)) * p.group;
  } else {
    args.p.tile_section = 0;  // the plain non-causal launch keeps the grid order (equal tiles)
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
