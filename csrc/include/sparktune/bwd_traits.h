// One traits type per backward configuration: the shared-memory layouts (and the transposed
// views the products read), the three tiled MMAs and the copies, derived at compile time.
#pragma once

#include "arch_policy.h"
#include "bwd_config.h"

namespace sparktune {

using namespace cute;

// A (cols, rows) view of a (rows, cols) shared-memory layout: the same bytes, read transposed.
template <class Layout, int kRows, int kCols>
using TransposedView =
    decltype(composition(Layout{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));

// The types of a valid configuration. Only instantiated when Config::kValid.
template <class Config>
struct BwdTraits : Config {
  using Element = typename Config::Element;
  using Config::kHeadDim, Config::kBlockM, Config::kBlockN, Config::kWarpsM, Config::kWarpsN,
      Config::kThreads, Config::kAcc32, Config::kSmemChunk, Config::kSwizzleBits,
      Config::kVecElems, Config::kGmemThreadsPerRow, Config::kGmemRowsPerPass, Config::kPChunk;
  static_assert(Config::kValid, "BwdTraits instantiated for an invalid configuration");
  using Family = std::conditional_t<Config::kFamily == 70, Sm70Family<Element, Config::kAcc32>,
                                    Sm80Family<Element, Config::kAcc32>>;
  // what the MMAs accumulate in; dK and dV sum the per-row-block products in fp32 regardless
  using ElementAccum = std::conditional_t<Config::kAcc32, float, Element>;

  // ---- shared memory ----
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kSmemChunk>>, Stride<Int<kSmemChunk>, _1>>{}));
  // Q and dO: (block_m, head_dim); K and V: (block_n, head_dim)
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutQt = TransposedView<SmemLayoutQ, kBlockM, kHeadDim>;   // B of dK += dS^T Q
  using SmemLayoutKt = TransposedView<SmemLayoutKV, kBlockN, kHeadDim>;  // B of dQ = dS K
  // P and dS: (block_m, block_n)
  using SmemLayoutPAtom = decltype(composition(
      Swizzle<kPChunk == 64 ? 3 : 2, 3, 3>{},
      Layout<Shape<_8, Int<kPChunk>>, Stride<Int<kPChunk>, _1>>{}));
  using SmemLayoutP = decltype(tile_to_shape(SmemLayoutPAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPt = TransposedView<SmemLayoutP, kBlockM, kBlockN>;  // A of dV/dK products

  // ---- compute ----
  using TiledMmaSdP = typename Family::template TiledMma<kWarpsM, kWarpsN>;
  using TiledMmaKV = typename Family::template TiledMma<Config::kKVWarpsM, Config::kKVWarpsN>;
  using TiledMmaQ = typename Family::template TiledMma<Config::kQWarpsM, Config::kQWarpsN>;

  // ---- copies ----
  using GmemLayoutThr = Layout<Shape<Int<kGmemRowsPerPass>, Int<kGmemThreadsPerRow>>,
                               Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(typename Family::GmemCopyAtom{}, GmemLayoutThr{},
                                                 Layout<Shape<_1, Int<kVecElems>>>{}));
  // dK, dV: shared -> global with plain 16-byte stores
  using GmemTiledCopyOut = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemLayoutThr{},
      Layout<Shape<_1, Int<kVecElems>>>{}));
};

}  // namespace sparktune
