// One traits type per forward configuration: derives every layout, the tiled MMA, the copies
// and the shared-memory budget at compile time, and says (kValid / kInvalidReason) when a
// configuration cannot work. The registry reads these constants, so the host never keeps a
// second copy of "which tiles fit".
#pragma once

#include "arch_policy.h"
#include "fwd_config.h"

namespace sparktune {

using namespace cute;

// The types of a valid configuration. Only instantiated when Config::kValid.
template <class Config>
struct FwdTraits : Config {
  using Element = typename Config::Element;
  using Config::kHeadDim, Config::kBlockM, Config::kBlockN, Config::kWarpsM, Config::kWarpsN,
      Config::kThreads, Config::kAcc32, Config::kSmemChunk, Config::kSwizzleBits,
      Config::kVecElems, Config::kGmemThreadsPerRow, Config::kGmemRowsPerPass, Config::kPChunk;
  static_assert(Config::kValid, "FwdTraits instantiated for an invalid configuration");
  using Family = std::conditional_t<Config::kFamily == 70, Sm70Family<Element, Config::kAcc32>,
                                    Sm80Family<Element, Config::kAcc32>>;
  using ElementAccum = std::conditional_t<Config::kAcc32, float, Element>;

  // ---- shared memory ----
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kSmemChunk>>, Stride<Int<kSmemChunk>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V seen as (head_dim, block_n): the B operand of P.V, read transposed
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  // P (kShared policy): (block_m, block_n) in the input type
  using SmemLayoutPAtom = decltype(composition(
      Swizzle<kPChunk == 64 ? 3 : 2, 3, 3>{},
      Layout<Shape<_8, Int<kPChunk>>, Stride<Int<kPChunk>, _1>>{}));
  using SmemLayoutP = decltype(tile_to_shape(SmemLayoutPAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // ---- compute ----
  using TiledMma = typename Family::template TiledMma<kWarpsM, kWarpsN>;

  // ---- copies ----
  using GmemLayoutThr = Layout<Shape<Int<kGmemRowsPerPass>, Int<kGmemThreadsPerRow>>,
                               Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(typename Family::GmemCopyAtom{}, GmemLayoutThr{},
                                                 Layout<Shape<_1, Int<kVecElems>>>{}));
  // output: shared -> global with plain 16-byte stores
  using GmemTiledCopyO = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                                                  GmemLayoutThr{}, Layout<Shape<_1, Int<kVecElems>>>{}));
};

}  // namespace sparktune
