// The types of one Hopper forward configuration: wgmma tiled MMAs, GMMA shared-memory layouts
// (128-byte swizzle, what both TMA and wgmma read) and the TMA copy types. Only instantiated for
// a valid configuration (sm90_fwd_config.h).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>

#include "params.h"
#include "sm90_fwd_config.h"

namespace sparktune {

using namespace cute;

template <class Config>
struct Sm90FwdTraits : Config {
  static_assert(Config::kValid, "Sm90FwdTraits instantiated for an invalid configuration");
  using Element = typename Config::Element;
  using Config::kHeadDim, Config::kBlockM, Config::kBlockN, Config::kStages,
      Config::kConsumerWarpgroups;

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using StagesT = Int<kStages>;

  // ---- compute: the warpgroups stacked along M, each owning 64 query rows ----
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  // S = Q K^T: (64 x block_n) per warpgroup, k = head_dim, both operands K-major in shared memory
  using TiledMmaS = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, BlockN, HeadDim>>(), AtomLayout{}));
  // O += P V: (64 x head_dim) per warpgroup, k = block_n; P from registers (K-major), V read
  // as (head_dim, block_n) with head_dim contiguous: an MN-major B operand, no transpose
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, HeadDim, BlockN>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayout{}));

  // ---- shared memory ----
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 128 bytes, swizzled
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim, StagesT>{}));
  // V's slots seen as (head_dim, block_n, stages)
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<HeadDim, BlockN, StagesT>{}, Step<_2, _1, _3>{})));

  // ---- TMA: a 4-D view (row, head_dim, head, batch) of q, k or v with the caller's strides ----
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemLayout = Layout<GmemShape, GmemStride>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          GmemLayout{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<BlockM, HeadDim>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutKV{}), Shape<BlockN, HeadDim>{}, _1{}));

  static constexpr int kTmaBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kTmaBytesKV = kBlockN * kHeadDim * int(sizeof(Element));

  // ---- output: shared -> global in 16-byte stores, one warpgroup per 64 rows ----
  static constexpr int kVecElems = 16 / int(sizeof(Element));
  static constexpr int kStoreThreadsPerRow = kHeadDim / kVecElems;
  static constexpr int kStoreRowsPerPass = 128 / kStoreThreadsPerRow;
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
      Layout<Shape<Int<kStoreRowsPerPass>, Int<kStoreThreadsPerRow>>,
             Stride<Int<kStoreThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kVecElems>>>{}));
};

// What the kernel receives: the parameter block and the three TMA descriptors (built on the
// host per launch), passed as one __grid_constant__ argument.
template <class Traits>
struct Sm90FwdArgs {
  FwdParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
};

}  // namespace sparktune
