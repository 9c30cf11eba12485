// The rules of one forward configuration: sizes, shared-memory budget and validity, as
// compile-time constants. Host-only code (the space probe run at build time) and the kernels
// read the same rules, so "which tiles fit" is written once.
#pragma once

#include <cutlass/numeric_types.h>

#include <type_traits>

namespace sparktune {

// Softmax policies. kRegisters: S stays in the accumulator registers, row statistics are
// reduced with warp shuffles and P is re-laid out in registers as the A operand of P.V (needs
// the m16n8k16 layout and all warps along M). kShared: S goes through shared memory, rows
// are reduced by the threads that own them there and P is read back as an A operand; works
// for every atom and every warp arrangement.
enum class SoftmaxPolicy { kRegisters, kShared };

template <int kFamily_, class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsM_,
          int kWarpsN_, bool kAcc32_, SoftmaxPolicy kSoftmax_>
struct FwdConfig {
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
  static constexpr SoftmaxPolicy kSoftmax = kSoftmax_;
  static constexpr bool kRegSoftmax = kSoftmax == SoftmaxPolicy::kRegisters;
  static constexpr bool kIsHalf = std::is_same_v<Element, cutlass::half_t>;

  // the per-warp tile of the family's MMA arrangement (see arch_policy.h)
  static constexpr int kWarpTileM = kFamily == 70 ? 32 : 16;
  static constexpr int kWarpTileN = kFamily == 70 ? 8 : 16;
  static constexpr int kMaxSmemBytes = kFamily == 70 ? 96 * 1024 : 227 * 1024;

  // Shared-memory rows are cut into 64-element (128-byte) or 32-element chunks and swizzled so
  // that 16-byte accesses of a warp hit distinct banks.
  static constexpr int kSmemChunk = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kSmemChunk == 64 ? 3 : 2;
  static constexpr int kVecElems = 16 / sizeof(Element);  // one 16-byte access
  static constexpr int kGmemThreadsPerRow = kSmemChunk / kVecElems;
  static constexpr int kGmemRowsPerPass = kThreads / kGmemThreadsPerRow;
  // kShared softmax: each row is owned by kRowThreads consecutive lanes (a power of two <= 32)
  static constexpr int kRowThreads =
      kThreads >= kBlockM ? (kThreads / kBlockM > 32 ? 32 : kThreads / kBlockM) : 1;
  static constexpr int kRowsPerPass = kThreads / kRowThreads;
  // P (kShared policy) is swizzled in chunks of 64 or 32 columns; S is fp32 with padded rows
  static constexpr int kPChunk = kBlockN % 64 == 0 ? 64 : 32;
  static constexpr int kSRowPitch = kBlockN + 4;

  static constexpr int kSmemQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemKV = 2 * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemS = kRegSoftmax ? 0 : kBlockM * kSRowPitch * 4;
  static constexpr int kSmemP = kRegSoftmax ? 0 : kBlockM * kBlockN * int(sizeof(Element));
  static constexpr int kSmemRowStats = kRegSoftmax ? 0 : kBlockM * 4;
  static constexpr int kSmemBytes = kSmemQ + kSmemKV + kSmemS + kSmemP + kSmemRowStats;

  // ---- Volta register budget (family 70) ----
  // A thread has at most 255 registers (under the kernel's launch bounds also at most 64K /
  // threads); past that ptxas spills. Estimate per thread, calibrated on the sm_70 ptxas reports
  // of every declared Volta configuration (tools/check_sm70.py, table in docs/VOLTA.md):
  //  - the accumulators: O is (block_m / warps_m) x (head_dim / warps_n) elements per warp and
  //    S (block_m / warps_m) x (block_n / warps_n), over the warp's 32 lanes, one register per
  //    fp32 element and one per two fp16 elements (with fp16 accumulation S is converted to
  //    fp32 element by element on its way to shared memory);
  //  - half a register per row of the warp tile: warps of 64 rows spilled with 16 accumulator
  //    registers fewer than warps of 32 rows;
  //  - kVoltaRegOverhead for the rest: the operand fragments of the k-slices in flight (plain
  //    16-bit shared-memory loads on Volta), addresses, loop and softmax state.
  // With it, every estimate up to 255 compiled without a spill and the smallest estimate that
  // spilled was 271; estimates of 256 to 270 did not occur.
  static constexpr int kVoltaRegOverhead = 159;
  static constexpr int kWarpRows = kBlockM / kWarpsM;
  static constexpr int kAccRegsO = kWarpRows * (kHeadDim / kWarpsN) / 32 / (kAcc32 ? 1 : 2);
  static constexpr int kAccRegsS = kWarpRows * (kBlockN / kWarpsN) / 32 / (kAcc32 ? 1 : 2);
  static constexpr int kRegEstimate = kAccRegsO + kAccRegsS + kWarpRows / 2 + kVoltaRegOverhead;
  static constexpr int kRegLimit = 65536 / kThreads < 255 ? 65536 / kThreads : 255;

  // ---- validity rules, each with the reason reported for an excluded configuration ----
  static constexpr bool kTypeOk = (kIsHalf || kFamily == 80) && (kIsHalf || kAcc32);
  static constexpr bool kHeadDimOk = kHeadDim % 32 == 0 && kHeadDim >= 32 && kHeadDim <= 256;
  static constexpr bool kTileOk = kBlockM % (kWarpTileM * kWarpsM) == 0 &&
                                  kBlockN % (kWarpTileN * kWarpsN) == 0 &&
                                  kHeadDim % (kWarpTileN * kWarpsN) == 0 && kBlockN % 32 == 0;
  static constexpr bool kSoftmaxOk = !kRegSoftmax || (kFamily == 80 && kWarpsN == 1);
  static constexpr bool kCopyOk =
      kGmemRowsPerPass > 0 && kBlockM % kGmemRowsPerPass == 0 && kBlockN % kGmemRowsPerPass == 0;
  static constexpr bool kRowsOk =
      kRegSoftmax || (kBlockM % kRowsPerPass == 0 && (kRowThreads & (kRowThreads - 1)) == 0 &&
                      kBlockN % kRowThreads == 0);
  static constexpr bool kSmemOk = kSmemBytes <= kMaxSmemBytes;
  static constexpr bool kThreadsOk = kThreads <= 1024;
  static constexpr bool kRegsOk = kFamily != 70 || kRegEstimate <= kRegLimit;

  static constexpr bool kValid = kTypeOk && kHeadDimOk && kTileOk && kSoftmaxOk && kCopyOk &&
                                 kRowsOk && kSmemOk && kThreadsOk && kRegsOk;
  static constexpr const char* kInvalidReason =
      !kTypeOk      ? "bf16 needs the m16n8k16 family and fp32 accumulation"
      : !kHeadDimOk ? "head dim must be a multiple of 32 in [32, 256]"
      : !kTileOk    ? "block_m, block_n and head_dim must be multiples of the warp tile times the warp arrangement (block_n also of 32)"
      : !kSoftmaxOk ? "register softmax needs the m16n8k16 atom and all warps along M"
      : !kCopyOk    ? "block_m and block_n must be multiples of the rows one 16-byte copy pass covers"
      : !kRowsOk    ? "shared-memory softmax cannot split the rows evenly over the threads"
      : !kSmemOk    ? (kFamily == 70 ? "shared memory exceeds Volta's 96 KB per block"
                                     : "shared memory exceeds 227 KB per block")
      : !kThreadsOk ? "more than 1024 threads"
      : !kRegsOk    ? "Volta register budget: the O and S accumulators of a thread and its operands need more than the registers it has (ptxas would spill)"
                    : "";
};

}  // namespace sparktune
