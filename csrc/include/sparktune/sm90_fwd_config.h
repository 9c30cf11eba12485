// The rules of one Hopper (sm_90a) forward configuration: sizes, shared memory, threads,
// register split and validity, as compile-time constants. The space probe of gen_kernels.py and
// the kernel read the same rules, so "which tiles fit" is written once.
//
// The family: one producer warpgroup (its first warp issues the TMA loads; the warpgroup gives
// its registers to the consumers with setmaxnreg) and block_m / 64 consumer warpgroups of 64
// query rows each. S = Q K^T and O += P V run on wgmma (both operands of S in shared memory, P
// from registers); K and V stream through a pipeline of `stages` shared-memory slots guarded by
// mbarriers (full: the TMA transaction landed; empty: every consumer warp is done with it).
//
// A third switch, kPersistent ("ps1"): one block per SM walks a list of (row block, head,
// batch) tiles, heaviest causal tiles first, either in static rounds that alternate direction
// over the blocks or, when the launch is given a tile counter (FwdParams::tile_counter), taking
// the next tile of the list from that counter whenever it is free (sm90_fwd_kernel.h,
// sm90_fwd_launch.h); the barriers are set up once, Q has two slots (the next tile's Q lands
// while the current tile runs), the producer loads the next tile's K/V while the consumers
// still finish the current tile, and O goes out through its tile's own Q slot, which is
// released once the epilogue has read it. The producer tells the consumers which tile a Q slot
// holds through one int per slot next to the barriers.
//
// Two scheduling switches (both off: the original kernel, instruction for instruction):
// - kOverlap ("ov1"): software pipelining inside each consumer warpgroup. A step issues
//   S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back as two wgmma commit groups, waits for
//   the first only, and does the softmax of S_j while the tensor cores still run P_{j-1} V_{j-1};
//   O is rescaled and P_j written once the second group is done. P_{j-1} (16-bit) therefore
//   lives next to S_j (fp32) and O: exactly what the register rule below already counts.
// - kPingpong ("pp1"): the two consumer warpgroups take turns issuing their GEMMs (a pair of
//   named barriers), so that one warpgroup's softmax runs under the other's GEMMs. It orders
//   the per-step burst of both GEMMs that only the overlapped order has, so it needs kOverlap,
//   and it alternates between exactly two warpgroups.
#pragma once

#include <cutlass/numeric_types.h>

#include <type_traits>

namespace sparktune {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_,
          bool kOverlap_ = false, bool kPingpong_ = false, bool kPersistent_ = false>
struct Sm90FwdConfig {
  using Element = Element_;
  static constexpr int kFamily = 90;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kPingpong = kPingpong_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr bool kIsHalf = std::is_same_v<Element, cutlass::half_t>;
  static constexpr bool kAcc32 = true;  // wgmma with 16-bit inputs: fp32 accumulators here

  // one wgmma warpgroup per 64 query rows, plus the producer warpgroup
  static constexpr int kWarpgroupRows = 64;
  static constexpr int kConsumerWarpgroups = kBlockM / kWarpgroupRows;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // the registry's warp arrangement: all consumer warps along M
  static constexpr int kWarpsM = kConsumerWarpgroups * 4;
  static constexpr int kWarpsN = 1;

  // ---- registers: setmaxnreg moves the producer's registers to the consumers ----
  // A block of kThreads threads may hold 64K registers; the producer keeps kProducerRegs per
  // thread and each consumer thread gets the rest, rounded down to a multiple of 8 (setmaxnreg's
  // granule) and capped at 240.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegsRaw = (65536 - 128 * kProducerRegs) / (kConsumerThreads > 0 ? kConsumerThreads : 1);
  static constexpr int kConsumerRegs = (kConsumerRegsRaw > 240 ? 240 : kConsumerRegsRaw) / 8 * 8;
  // What a consumer thread keeps live across a key block: the O accumulator (64 x head_dim
  // fp32 per warpgroup), S (64 x block_n fp32) and P (64 x block_n 16-bit), 128 threads each;
  // kRegOverhead for the row statistics, addresses, descriptors and loop state: ptxas -v for
  // sm_90a fits head dim 64 with block_n 128 under three consumer warpgroups (160 registers a
  // thread) without a spill, which the estimate must not refuse.
  static constexpr int kRegOverhead = 32;
  static constexpr int kRegsO = 64 * kHeadDim / 128;
  static constexpr int kRegsS = 64 * kBlockN / 128;
  static constexpr int kRegsP = kRegsS / 2;
  static constexpr int kRegEstimate = kRegsO + kRegsS + kRegsP + kRegOverhead;

  // ---- shared memory: the Q slots, then the K and V slots, then the barriers ----
  // Every tile starts on a 1024-byte boundary (the 128-byte swizzle of TMA and wgmma repeats
  // every 1024 bytes); kSmemAlign more bytes let the kernel align the dynamic window itself.
  // Persistent blocks keep two Q slots (tile i + 1's Q loads while tile i runs); O of a tile is
  // staged in its own Q slot either way (the warpgroup's rows are free once its last S product
  // has completed).
  static constexpr int kSmemAlign = 1024;
  static constexpr int kQSlots = kPersistent ? 2 : 1;
  static constexpr int kSmemQSlot = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemQ = kQSlots * kSmemQSlot;
  static constexpr int kSmemKVStage = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemK = kStages * kSmemKVStage;
  static constexpr int kSmemV = kStages * kSmemKVStage;
  // barriers: per Q slot full/empty, and per stage K full/empty and V full/empty (8 bytes each);
  // persistent: then the tile number of each Q slot (4 bytes each)
  static constexpr int kSmemBarriers = (2 * kQSlots + 4 * kStages) * 8;
  static constexpr int kSmemSlotTiles = kPersistent ? kQSlots * 4 : 0;
  static constexpr int kSmemBarrierPad = (kSmemBarriers + kSmemSlotTiles + 127) / 128 * 128;
  static constexpr int kSmemBytes = kSmemAlign + kSmemQ + kSmemK + kSmemV + kSmemBarrierPad;
  static constexpr int kMaxSmemBytes = 227 * 1024;

  // ---- validity rules, each with the reason reported for an excluded configuration ----
  // Head dim 256 keeps a 64 x 256 fp32 O accumulator per warpgroup (128 registers a thread):
  // ptxas -v for sm_90a spilled 32 B (block_n 64) and 52 B (block_n 80) with this kernel, so it
  // waits for a kernel that splits O (e.g. over head-dim halves).
  static constexpr bool kHeadDimOk = kHeadDim == 64 || kHeadDim == 128;
  static constexpr bool kBlockMOk = kBlockM % kWarpgroupRows == 0 && kConsumerWarpgroups >= 1 &&
                                    kConsumerWarpgroups <= 3;
  // wgmma's N is a multiple of 8 up to 256; block_n is S's N and P.V's K (a multiple of 16),
  // and one TMA box (at most 256 rows)
  static constexpr bool kBlockNOk = kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 256;
  static constexpr bool kStagesOk = kStages >= 2 && kStages <= 4;
  static constexpr bool kSmemOk = kSmemBytes <= kMaxSmemBytes;
  static constexpr bool kRegsOk = kRegEstimate <= kConsumerRegs;
  // ping-pong: the GEMM bursts of the overlapped order, alternating between two warpgroups
  static constexpr bool kPingpongOk = !kPingpong || (kOverlap && kConsumerWarpgroups == 2);

  static constexpr bool kValid =
      kHeadDimOk && kBlockMOk && kBlockNOk && kStagesOk && kSmemOk && kRegsOk && kPingpongOk;
  static constexpr const char* kInvalidReason =
      !kHeadDimOk  ? "the sm90 family is built for head dims 64 and 128 (256: the 64 x 256 fp32 O accumulator of a warpgroup spills)"
      : !kBlockMOk ? "block_m must be 64, 128 or 192 (one to three consumer warpgroups of 64 rows)"
      : !kBlockNOk ? "block_n must be a multiple of 16 in [16, 256] (wgmma N, P.V's K, one TMA box)"
      : !kStagesOk ? "the K/V pipeline has 2 to 4 stages"
      : !kSmemOk   ? "shared memory exceeds 227 KB per block"
      : !kRegsOk   ? "register budget: O, S and P of a consumer thread need more registers than setmaxnreg can give it (ptxas would spill)"
      : !kPingpongOk ? "ping-pong alternates the GEMM bursts of the overlapped order (ov1) between exactly two consumer warpgroups (block_m 128)"
                   : "";
};

}  // namespace sparktune
