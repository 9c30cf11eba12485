// The rules of one backward configuration: sizes, warp arrangements of the three products,
// shared-memory budget and validity, as compile-time constants read by the kernels and by the
// build-time space probe alike.
//
// One thread block owns a block of kBlockN key/value rows and walks the query rows in blocks of
// kBlockM. Its products and their (M x N, reduction K) shapes:
//   S = Q K^T, dP = dO V^T          kBlockM x kBlockN, K = head_dim   warps kWarpsM x kWarpsN
//   dV += P^T dO, dK += dS^T Q      kBlockN x head_dim, K = kBlockM   warps kKVWarpsM x kKVWarpsN
//   dQ = dS K                       kBlockM x head_dim, K = kBlockN   warps kQWarpsM x kQWarpsN
// The name's warp arrangement is the first one; the others are derived (bwd_warps_along_m).
#pragma once

#include <cutlass/numeric_types.h>

#include <type_traits>

namespace sparktune {

// Warps along M for a rows x cols product split over `warps` warps: of the power-of-two splits
// whose warp tiles divide the product evenly, the one with the squarest per-warp tile (the
// fewest operand registers per MMA); 0 when none divides it.
constexpr int bwd_warps_along_m(int rows, int cols, int warps, int warp_tile_m, int warp_tile_n) {
  int best = 0, best_skew = 0;
  for (int wm = 1; wm <= warps; wm *= 2) {
    const int wn = warps / wm;
    if (warps % wm != 0 || rows % (warp_tile_m * wm) != 0 || cols % (warp_tile_n * wn) != 0) {
      continue;
    }
    const int tm = rows / wm, tn = cols / wn;
    const int skew = tm > tn ? tm / tn : tn / tm;
    if (best == 0 || skew < best_skew || (skew == best_skew && tm <= tn)) {
      best = wm;
      best_skew = skew;
    }
  }
  return best;
}

template <int kFamily_, class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsM_,
          int kWarpsN_, bool kAcc32_>
struct BwdConfig {
  using Element = Element_;
  static constexpr int kFamily = kFamily_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kWarps = kWarpsM * kWarpsN;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kAcc32 = kAcc32_;
  static constexpr bool kIsHalf = std::is_same_v<Element, cutlass::half_t>;

  static constexpr int kWarpTileM = kFamily == 70 ? 32 : 16;
  static constexpr int kWarpTileN = kFamily == 70 ? 8 : 16;
  static constexpr int kMaxSmemBytes = kFamily == 70 ? 96 * 1024 : 227 * 1024;

  // warp arrangements of the dK/dV products (kBlockN x head_dim) and the dQ product
  static constexpr int kKVWarpsM =
      bwd_warps_along_m(kBlockN, kHeadDim, kWarps, kWarpTileM, kWarpTileN);
  static constexpr int kQWarpsM =
      bwd_warps_along_m(kBlockM, kHeadDim, kWarps, kWarpTileM, kWarpTileN);
  static constexpr int kKVWarpsN = kKVWarpsM > 0 ? kWarps / kKVWarpsM : 0;
  static constexpr int kQWarpsN = kQWarpsM > 0 ? kWarps / kQWarpsM : 0;

  // shared-memory rows as in the forward: 64- or 32-element swizzled chunks, 16-byte copies
  static constexpr int kSmemChunk = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemChunk == 64 ? 3 : 2;
  static constexpr int kVecElems = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = kSmemChunk / kVecElems;
  static constexpr int kGmemRowsPerPass = kThreads / kGmemThreadsPerRow;
  // P and dS (kBlockM x kBlockN, input type) are swizzled in chunks of 64 or 32 columns
  static constexpr int kPChunk = kBlockN % 64 == 0 ? 64 : 32;

  static constexpr int kSmemKV = 2 * kBlockN * kHeadDim * int(sizeof(Element));  // K, V
  static constexpr int kSmemQdO = 2 * kBlockM * kHeadDim * int(sizeof(Element));  // Q, dO
  static constexpr int kSmemPdS = 2 * kBlockM * kBlockN * int(sizeof(Element));   // P, dS
  static constexpr int kSmemRowStats = 2 * kBlockM * 4;  // lse (base 2) and D per query row
  static constexpr int kSmemBytes = kSmemKV + kSmemQdO + kSmemPdS + kSmemRowStats;

  // ---- Volta register budget (family 70) ----
  // A thread has at most 255 registers (under the kernel's launch bounds also at most 64K /
  // threads); past that ptxas spills. Estimate per thread, in 32-bit registers, calibrated on
  // the sm_70 ptxas reports of Volta backward configurations (tools/check_sm70.py,
  // docs/VOLTA.md):
  //  - dK and dV, fp32 and held for the whole walk: 2 x block_n x head_dim elements over the
  //    block's threads;
  //  - plus the larger of the two phases of a step: S and dP (2 x block_m x block_n elements),
  //    or dQ (block_m x head_dim) together with the next row block's Q and dO, which on Volta
  //    (no cp.async) pass through registers on their way to shared memory (2 x block_m x
  //    head_dim fp16 elements, two per register);
  //  - counted as fp32 with either accumulation (the step converts S, dP, the dK/dV partials
  //    and dQ to fp32), and with fp16 accumulation also the fp16 partial of one dK/dV product
  //    (block_n x head_dim elements, two per register);
  //  - kVoltaRegOverhead for the rest: the operand fragments of the k-slices in flight,
  //    addresses, the row statistics and the loop state.
  // With it, every estimate up to 255 compiled without a spill and the smallest estimate that
  // spilled was 263 (head dim 128, 64 x 32, eight warps, fp16 accumulation: 8 B).
  static constexpr int kVoltaRegOverhead = 159;
  static constexpr int kAccRegsKV = 2 * kBlockN * kHeadDim / kThreads;
  static constexpr int kAccRegsSdP = 2 * kBlockM * kBlockN / kThreads;
  static constexpr int kAccRegsQ = kBlockM * kHeadDim / kThreads;
  static constexpr int kStageRegsQdO = 2 * kBlockM * kHeadDim / kThreads / 2;
  static constexpr int kAccRegsPartial = kAcc32 ? 0 : kBlockN * kHeadDim / kThreads / 2;
  static constexpr int kRegsStep = kAccRegsSdP > kAccRegsQ + kStageRegsQdO
                                       ? kAccRegsSdP
                                       : kAccRegsQ + kStageRegsQdO;
  static constexpr int kRegEstimate =
      kAccRegsKV + kRegsStep + kAccRegsPartial + kVoltaRegOverhead;
  static constexpr int kRegLimit = 65536 / kThreads < 255 ? 65536 / kThreads : 255;

  // ---- validity rules, each with the reason reported for an excluded configuration ----
  static constexpr bool kTypeOk = (kIsHalf || kFamily == 80) && (kIsHalf || kAcc32);
  static constexpr bool kHeadDimOk = kHeadDim % 32 == 0 && kHeadDim >= 32 && kHeadDim <= 256;
  static constexpr bool kTileOk = kBlockM % (kWarpTileM * kWarpsM) == 0 &&
                                  kBlockN % (kWarpTileN * kWarpsN) == 0 && kBlockN % 32 == 0 &&
                                  kBlockM % 16 == 0;
  static constexpr bool kKVTileOk = kKVWarpsM > 0;
  static constexpr bool kQTileOk = kQWarpsM > 0;
  static constexpr bool kCopyOk =
      kGmemRowsPerPass > 0 && kBlockM % kGmemRowsPerPass == 0 && kBlockN % kGmemRowsPerPass == 0;
  static constexpr bool kSmemOk = kSmemBytes <= kMaxSmemBytes;
  static constexpr bool kThreadsOk = kThreads <= 1024;
  static constexpr bool kRegsOk = kFamily != 70 || kRegEstimate <= kRegLimit;

  static constexpr bool kValid = kTypeOk && kHeadDimOk && kTileOk && kKVTileOk && kQTileOk &&
                                 kCopyOk && kSmemOk && kThreadsOk && kRegsOk;
  static constexpr const char* kInvalidReason =
      !kTypeOk      ? "bf16 needs the m16n8k16 family and fp32 accumulation"
      : !kHeadDimOk ? "head dim must be a multiple of 32 in [32, 256]"
      : !kTileOk    ? "block_m and block_n must be multiples of the warp tile times the warp arrangement (block_n also of 32)"
      : !kKVTileOk  ? "the dK/dV product (block_n x head_dim) cannot be split over the warps"
      : !kQTileOk   ? "the dQ product (block_m x head_dim) cannot be split over the warps"
      : !kCopyOk    ? "block_m and block_n must be multiples of the rows one 16-byte copy pass covers"
      : !kSmemOk    ? (kFamily == 70 ? "shared memory exceeds Volta's 96 KB per block"
                                     : "shared memory exceeds 227 KB per block")
      : !kThreadsOk ? "more than 1024 threads"
      : !kRegsOk    ? "Volta register budget: dK, dV and the step's accumulators of a thread and its operands need more than the registers it has (ptxas would spill)"
                    : "";
};

}  // namespace sparktune
