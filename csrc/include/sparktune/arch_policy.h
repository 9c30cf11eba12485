// MMA families as policy types: everything that differs between Volta (mma.m8n8k4, plain loads)
// and Ampere-and-later (mma.m16n8k16, cp.async, ldmatrix) lives here.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/arch/mma_sm70.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>

#include <type_traits>

namespace sparktune {

using namespace cute;

// Volta: one 8x8x4 product per quadpair; a warp arranges its four quadpairs along M, so a
// warp tile is 32x8. Operands reach registers through plain shared-memory loads.
template <class Element, bool kAcc32>
struct Sm70Family {
  static_assert(std::is_same_v<Element, cutlass::half_t>, "Volta tensor cores take fp16 only");
  static constexpr int kFamily = 70;
  static constexpr int kMinArch = 70;
  static constexpr int kWarpTileM = 32;
  static constexpr int kWarpTileN = 8;
  static constexpr int kMaxSmemBytes = 96 * 1024;
  static constexpr bool kAsyncCopy = false;
  using Atom = std::conditional_t<kAcc32, SM70_8x8x4_F32F16F16F32_TN, SM70_8x8x4_F16F16F16F16_TN>;
  template <int kWarpsM, int kWarpsN>
  using TiledMma = TiledMMA<MMA_Atom<Atom>,
                            Layout<Shape<Int<4 * kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<kWarpTileM * kWarpsM>, Int<kWarpTileN * kWarpsN>, _4>>;
  using GmemCopyAtom = Copy_Atom<UniversalCopy<cute::uint128_t>, Element>;
  using SmemCopyAtom = Copy_Atom<DefaultCopy, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<DefaultCopy, Element>;
};

// Ampere and later: m16n8k16 per warp, two n8 atoms side by side so a warp tile is 16x16;
// cp.async for global->shared, ldmatrix (plain and transposed) for shared->registers.
template <class Element, bool kAcc32>
struct Sm80Family {
  static constexpr bool kIsHalf = std::is_same_v<Element, cutlass::half_t>;
  static_assert(kIsHalf || kAcc32, "bf16 tensor cores accumulate in fp32 only");
  static constexpr int kFamily = 80;
  static constexpr int kMinArch = 80;
  static constexpr int kWarpTileM = 16;
  static constexpr int kWarpTileN = 16;
  static constexpr int kMaxSmemBytes = 227 * 1024;
  static constexpr bool kAsyncCopy = true;
  using Atom = std::conditional_t<
      kIsHalf,
      std::conditional_t<kAcc32, SM80_16x8x16_F32F16F16F32_TN, SM80_16x8x16_F16F16F16F16_TN>,
      SM80_16x8x16_F32BF16BF16F32_TN>;
  template <int kWarpsM, int kWarpsN>
  using TiledMma = TiledMMA<MMA_Atom<Atom>,
                            Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<kWarpTileM * kWarpsM>, Int<kWarpTileN * kWarpsN>, _16>>;
  using GmemCopyAtom = Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>;
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
};

}  // namespace sparktune
