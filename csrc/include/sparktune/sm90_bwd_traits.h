// The types of one Hopper backward configuration: wgmma tiled MMAs of the five products, GMMA
// shared-memory layouts (128-byte swizzle; K's 64-byte where dQ reads it in 32-column slices)
// with their transposed views, the stmatrix copy of dS^T, dQ's fp32 staging tile, and the TMA
// copy types (loads of Q, dO, K, V; the reduce-add of dQ).
// Only instantiated for a valid configuration (sm90_bwd_config.h).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>

#include <type_traits>

#include "params.h"
#include "sm90_bwd_config.h"

namespace sparktune {

using namespace cute;

template <class Config>
struct Sm90BwdTraits : Config {
  static_assert(Config::kValid, "Sm90BwdTraits instantiated for an invalid configuration");
  using Element = typename Config::Element;
  using Config::kHeadDim, Config::kBlockM, Config::kBlockN, Config::kStages,
      Config::kConsumerWarpgroups, Config::kDqCols;

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using StagesT = Int<kStages>;
  using DqCols = Int<kDqCols>;

  // ---- compute: the consumer warpgroups stacked along the keys, 64 each ----
  using AtomAlongKeys = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  // S^T = K Q^T and dP^T = V dO^T: (64 keys x block_m) per warpgroup, k = head_dim; both
  // operands K-major in shared memory (head_dim contiguous)
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, BlockM, HeadDim>>(),
      AtomAlongKeys{}));
  // the same two products with K and V as register operands (kKvRegs)
  using TiledMmaSdPRs = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, BlockM, HeadDim>>(),
      AtomAlongKeys{}));
  using TiledMmaSdPUsed = std::conditional_t<Config::kKvRegs, TiledMmaSdPRs, TiledMmaSdP>;
  // K and V from shared memory into the register A operand (ldmatrix, K-major rows)
  using SmemCopyAtomKv = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  // dV += P^T dO and dK += dS^T Q: (64 keys x head_dim) per warpgroup, k = block_m; the A
  // operand from registers, B = dO or Q read as (head_dim, block_m): MN-major
  using TiledMmaDkv = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, HeadDim, BlockM>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomAlongKeys{}));
  // dQ = dS K: (block_m x head_dim), k = block_n; the warpgroups split head_dim. A = dS read
  // from the stored dS^T (queries contiguous: MN-major), B = K read as (head_dim, block_n)
  using TiledMmaDq = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, DqCols, BlockN>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>{}));

  // ---- shared memory ----
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;  // 8 rows x 128 bytes
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim>{}));
  // K is also dQ's B operand, read MN-major in slices of kDqCols head-dim columns, one per
  // warpgroup. Its swizzle atom is no wider than a slice, so that every warpgroup's slice
  // starts on an atom (FlashAttention-3 makes the same choice): with head dim 64 and two
  // warpgroups (slices of 32 columns, 64 bytes) the 64-byte swizzle, else the 128-byte one.
  static_assert(kDqCols * int(sizeof(Element)) % 64 == 0, "dQ's head-dim slices of 64 or 128 bytes");
  using SmemAtomK = std::conditional_t<kDqCols * int(sizeof(Element)) % 128 == 0,
                                       GMMA::Layout_K_SW128_Atom<Element>,
                                       GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<HeadDim, BlockN>{}, Step<_2, _1>{})));
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim, StagesT>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<HeadDim, BlockM, StagesT>{}, Step<_2, _1, _3>{})));
  // dS (block_m x block_n) with the queries contiguous (MN-major atom: 64 x 8), two buffers;
  // dS^T is the same memory seen as (block_n, block_m), which is how the warpgroups write it
  using SmemAtomDs = GMMA::Layout_MN_SW128_Atom<Element>;
  using SmemLayoutDs = decltype(tile_to_shape(SmemAtomDs{}, Shape<BlockM, BlockN, _2>{}));
  using SmemLayoutDst = decltype(composition(
      SmemLayoutDs{}, make_ordered_layout(Shape<BlockN, BlockM, _2>{}, Step<_2, _1, _3>{})));
  // dS^T from the accumulator registers to shared memory with stmatrix: the accumulator's
  // columns (queries) are the contiguous dimension of the layout, so the non-transposing form
  using SmemCopyAtomDs = Copy_Atom<SM90_U32x4_STSM_N, Element>;

  // dQ of one query tile in fp32 (block_m x head_dim), written by the consumer warpgroups from
  // their accumulators and added to the workspace by one TMA reduce-add: 128-byte swizzled rows
  // of 32 floats (the TMA box), so that the accumulator's stores spread over the banks
  using SmemLayoutDq = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                              Shape<BlockM, HeadDim>{}));
  // one consumer warpgroup's columns of that tile (its kDqCols columns are whole 32-float
  // column blocks, so its part is contiguous: warpgroup g's starts at g * block_m * kDqCols)
  using SmemLayoutDqPart = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                                  Shape<BlockM, DqCols>{}));

  // ---- TMA: 4-D views (row, head_dim, head, batch) with the caller's strides ----
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemLayout = Layout<GmemShape, GmemStride>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          GmemLayout{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      Shape<BlockM, HeadDim>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                      Shape<BlockN, HeadDim>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{},
                                      Shape<BlockN, HeadDim>{}, _1{}));

  // the fp32 dQ workspace (row, head_dim, head, batch), rows of head_dim floats; TMA leaves
  // out the rows past seqlen_q
  using GmemTensorDq = decltype(make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)),
                                            GmemLayout{}));
  using TmaDq = decltype(make_tma_copy(SM90_TMA_REDUCE_ADD{}, GmemTensorDq{}, SmemLayoutDqPart{},
                                       Shape<BlockM, DqCols>{}, _1{}));

  static constexpr int kTmaBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kTmaBytesKV = kBlockN * kHeadDim * int(sizeof(Element));
};

// What the kernel receives: the parameter block and the four TMA descriptors (built on the
// host per launch), passed as one __grid_constant__ argument.
template <class Traits>
struct Sm90BwdArgs {
  BwdParams p;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaDq tma_dq;
};

}  // namespace sparktune
