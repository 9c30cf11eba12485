// The rules of one Hopper (sm_90a) backward configuration: sizes, shared memory, threads,
// register split and validity, as compile-time constants read by the space probe of
// gen_kernels.py and by the kernel (sm90_bwd_kernel.h), so "which tiles fit" is written once.
//
// The family: one thread block per (key block of block_n keys, kv head, batch). A producer
// warpgroup loads K and V once, then Q and dO tiles of block_m query rows through a ring of
// `stages` slots (TMA). block_n / 64 consumer warpgroups own 64 keys each and compute, per
// query tile (its log-sum-exp and D rows loaded by the consumers a step ahead), the
// transposed products S^T = K Q^T and dP^T = V dO^T (so that the 64 x block_m accumulators are
// indexed by key and P^T, dS^T feed dV += P^T dO and dK += dS^T Q as register operands), then
// dQ = dS K with dS^T going through shared memory; each warpgroup computes head_dim / W columns
// of dQ into a shared fp32 tile, which a producer warp adds to the fp32 workspace with one TMA
// reduce-add (in deterministic mode in a fixed key-block order).
//
// A switch, kOverlap ("ov1"): software pipelining inside each consumer warpgroup. Iteration t
// issues S^T and dP^T of step t + 1 ahead of dV, dQ and dK of step t and makes step t + 1's
// P^T and dS^T while those four products run, so that the exponentials, the dS^T arithmetic
// and its stores no longer leave the tensor cores idle between the two halves of a step. It
// holds step t's 16-bit P^T and dS^T next to step t + 1's fp32 S^T and dP^T (the register rule
// counts both) and needs three Q/dO stages (steps t and t + 1 are read while t + 2 loads).
//
// A switch, kKvRegs ("kr1"): each consumer warpgroup loads its 64 keys of K and V from shared
// memory into registers once (ldmatrix) and S^T, dP^T take them as register operands, so that
// those two products read only Q and dO from shared memory (half the shared-memory traffic of
// a shared x shared wgmma of N = block_m). dQ still reads K from shared memory.
#pragma once

#include <cutlass/numeric_types.h>

#include <type_traits>

namespace sparktune {

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_,
          bool kOverlap_ = false, bool kKvRegs_ = false>
struct Sm90BwdConfig {
  using Element = Element_;
  static constexpr int kFamily = 90;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per thread block
  static constexpr int kStages = kStages_;  // depth of the Q / dO ring
  static constexpr bool kOverlap = kOverlap_;
  static constexpr bool kKvRegs = kKvRegs_;
  static constexpr bool kIsHalf = std::is_same_v<Element, cutlass::half_t>;
  static constexpr bool kAcc32 = true;

  // one consumer warpgroup per 64 keys, plus the producer warpgroup
  static constexpr int kWarpgroupRows = 64;
  static constexpr int kConsumerWarpgroups = kBlockN / kWarpgroupRows;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  // the registry's warp arrangement (of S^T = K Q^T): consumer warps along the keys
  static constexpr int kWarpsM = kConsumerWarpgroups * 4;
  static constexpr int kWarpsN = 1;
  // dQ's columns per consumer warpgroup
  static constexpr int kDqCols = kHeadDim / (kConsumerWarpgroups > 0 ? kConsumerWarpgroups : 1);

  // ---- registers (setmaxnreg moves the producer's registers to the consumers) ----
  // The block starts with the registers of its launch (ptxas gives every thread the most that
  // __launch_bounds__(kThreads, 1) allows: 65536 / kThreads rounded down to 8, at most 255);
  // setmaxnreg only moves registers within that pool, so the producer's kProducerRegs plus the
  // consumers' share must fit it, or the consumers' setmaxnreg.inc waits forever. Each consumer
  // thread gets the rest, rounded down to a multiple of 8 and capped at 240.
  // The producer keeps 24, or 40 with one consumer warpgroup, whose 240 leave the pool room.
  static constexpr int kLaunchRegsRaw = 65536 / kThreads;
  static constexpr int kProducerRegs = kConsumerThreads == 128 ? 40 : 24;
  static constexpr int kLaunchRegs = (kLaunchRegsRaw > 255 ? 255 : kLaunchRegsRaw) / 8 * 8;
  static constexpr int kRegPool = kLaunchRegs * kThreads;
  static constexpr int kConsumerRegsRaw =
      (kRegPool - 128 * kProducerRegs) / (kConsumerThreads > 0 ? kConsumerThreads : 1);
  static constexpr int kConsumerRegs = (kConsumerRegsRaw > 240 ? 240 : kConsumerRegsRaw) / 8 * 8;
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kRegPool || kConsumerThreads == 0,
                "setmaxnreg would ask for more registers than the block was launched with");
  // What a consumer thread keeps live at the peak of a step: dK and dV (64 x head_dim fp32 per
  // warpgroup, held over the whole walk), S^T and dP^T (64 x block_m fp32) and their 16-bit
  // copies P^T and dS^T (half as many registers); kRegOverhead for addresses, descriptors,
  // coordinates and loop state. ptxas -v for sm_90a: head dim 64 with block_m 128 (272 by this
  // count) made ptxas serialize the wgmma for lack of registers; head dim 128 with block_m 64
  // (240) is at the edge: it spilled 4 B while dS^T went to shared memory in element stores
  // (one swizzled address each), none with stmatrix.
  static constexpr int kRegOverhead = 16;
  static constexpr int kRegsDkv = 2 * 64 * kHeadDim / 128;
  static constexpr int kRegsSdP = 2 * 64 * kBlockM / 128;
  // The overlapped order (kOverlap) makes the next step's S^T and dP^T (fp32) while this
  // step's 16-bit P^T and dS^T wait for dV and dK (the same peak as the plain order's
  // conversion) and dQ's part (block_m x kDqCols fp32) lands: that part comes on top.
  static constexpr int kRegsDq = kBlockM * kDqCols / 128;
  // K and V in registers (kKvRegs, "kr1"): a warpgroup's 64 keys of each as 16-bit A
  // operands of S^T and dP^T, loaded once per block
  static constexpr int kRegsKv = 2 * 64 * kHeadDim / 256;
  static constexpr int kRegEstimate = kRegsDkv + kRegsSdP + kRegsSdP / 2 + kRegOverhead +
                                      (kOverlap ? kRegsDq : 0) + (kKvRegs ? kRegsKv : 0);

  // ---- shared memory: K, V, the Q and dO slots, two dS^T buffers, dQ's fp32 tile, two buffers
  // of statistics (LSE in base 2 and D, fp32), barriers
  static constexpr int kSmemAlign = 1024;
  static constexpr int kSmemK = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemV = kSmemK;
  static constexpr int kSmemQStage = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemQ = kStages * kSmemQStage;
  static constexpr int kSmemDo = kSmemQ;
  static constexpr int kSmemDsBuf = kBlockM * kBlockN * int(sizeof(Element));
  static constexpr int kSmemDs = 2 * kSmemDsBuf;
  static constexpr int kSmemDq = kBlockM * kHeadDim * 4;  // dQ of one tile in fp32
  static constexpr int kSmemStats = 2 * 2 * kBlockM * 4;
  // mbarriers: K/V full, and per stage Q/dO full and slot empty (dQ's tile is handed over with
  // named barriers)
  static constexpr int kSmemBarriers = (1 + 2 * kStages) * 8;
  static constexpr int kSmemTail = (kSmemStats + kSmemBarriers + 127) / 128 * 128;
  static constexpr int kSmemBytes =
      kSmemAlign + kSmemK + kSmemV + kSmemQ + kSmemDo + kSmemDs + kSmemDq + kSmemTail;
  static constexpr int kMaxSmemBytes = 227 * 1024;

  // ---- validity rules, each with the reason reported for an excluded configuration ----
  static constexpr bool kHeadDimOk = kHeadDim == 64 || kHeadDim == 128;
  static constexpr bool kBlockNOk = kBlockN % kWarpgroupRows == 0 && kConsumerWarpgroups >= 1 &&
                                    kConsumerWarpgroups <= 2;
  // block_m is S^T's N (wgmma N up to 256, a multiple of 16 as the K of dV/dK), dQ's M
  // (64-row wgmma tiles) and one TMA box
  static constexpr bool kBlockMOk = kBlockM % 64 == 0 && kBlockM >= 64 && kBlockM <= 128;
  static constexpr bool kStagesOk = kStages >= 2 && kStages <= 3;
  static constexpr bool kOverlapOk = !kOverlap || kStages == 3;
  static constexpr bool kSmemOk = kSmemBytes <= kMaxSmemBytes;
  static constexpr bool kRegsOk = kRegEstimate <= kConsumerRegs;

  static constexpr bool kValid =
      kHeadDimOk && kBlockNOk && kBlockMOk && kStagesOk && kOverlapOk && kSmemOk && kRegsOk;
  static constexpr const char* kInvalidReason =
      !kHeadDimOk  ? "the sm90 backward is built for head dims 64 and 128 (256: dK and dV of a warpgroup, 2 x 64 x 256 fp32, do not fit the registers)"
      : !kBlockNOk ? "block_n must be 64 or 128 (one or two consumer warpgroups of 64 keys)"
      : !kBlockMOk ? "block_m must be 64 or 128 (S^T's N, dQ's 64-row wgmma tiles)"
      : !kStagesOk ? "the Q/dO pipeline has 2 or 3 stages"
      : !kOverlapOk ? "the overlapped order (ov1) reads two steps' Q and dO while a third loads: it needs 3 stages"
      : !kSmemOk   ? "shared memory exceeds 227 KB per block"
      : !kRegsOk   ? (kKvRegs ? "register budget: K and V as register operands come on top of dK, dV, S^T, dP^T, P^T and dS^T, more than setmaxnreg can give a consumer thread"
                      : kOverlap ? "register budget: the overlapped order holds dK, dV, the next step's S^T and dP^T, this step's P^T and dS^T and dQ's part, more than setmaxnreg can give a consumer thread"
                                   : "register budget: dK, dV, S^T, dP^T, P^T and dS^T of a consumer thread need more registers than setmaxnreg can give it (ptxas would spill or serialize the wgmma)")
                   : "";
};

}  // namespace sparktune
