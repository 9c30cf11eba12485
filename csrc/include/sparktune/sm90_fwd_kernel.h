// The Hopper forward kernel: one thread block per (query row block, head, batch).
//
// Warpgroup 0 is the producer: it gives most of its registers away (setmaxnreg) and one thread
// issues the TMA loads, Q once and K/V block by block into a ring of `stages` slots. Each slot
// has a "full" barrier (the TMA transaction bytes landed) and an "empty" barrier (every consumer
// warp is done reading it), for K and V separately, so S = Q K^T can start before V arrives.
// Warpgroups 1.. are consumers of 64 query rows each: S on wgmma from shared memory, the online
// softmax in registers (base 2), P converted in registers and O += P V on wgmma with P as the
// register operand. The epilogue divides by the row sums, writes the log-sum-exp, and stores O
// through shared memory (the consumer's own rows of the Q tile) in 16-byte rows.
//
// Persistent (kPersistent): one block per SM runs tile after tile; only the producer thread
// walks the block's tiles (static rounds, or the next tile from a global counter) and tells the
// consumers each one through the Q slot it loads (see "tile messages" below).
//
// Attention features (runtime, docs/FEATURES.md): a sliding window limits the key blocks a row
// block visits to those that meet its band (key_range: the producer loads and the consumers
// walk the same range) and the element mask to the blocks at the band's edges and the key
// tail; soft-capping and ALiBi change the scores in registers before the mask (modify_s).
// The plain path (no window, softcap or ALiBi) visits and masks the blocks it always did.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cmath>

#include "fragment.h"
#include "params.h"
#include "sm90_fwd_traits.h"

namespace sparktune {

using namespace cute;

namespace sm90 {

constexpr float kLn2 = 0.69314718055994530942f;

// A wgmma accumulator fragment ((2 cols, 2 row halves, N/8 col groups), M, N) seen as
// ((2 row halves, M) rows, (2 cols, N/8 groups, N) cols).
template <class L>
CUTE_HOST_DEVICE constexpr auto rowcol_view(L const& l) {
  static_assert(decltype(rank<0>(l))::value == 3, "expects a wgmma accumulator layout");
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The same accumulator seen as the register A operand of the next wgmma (k = 16 per
// instruction): two neighbouring 8-column groups hold the 16 k-columns of one A fragment, so
// ((2,2,N/8), M, N) becomes ((2,2,2), M, N/16) without moving a register.
template <class L>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(L const& l) {
  static_assert(decltype(rank<0>(l))::value == 3, "expects a wgmma accumulator layout");
  auto groups = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(groups)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(groups), get<2>(l))));
}

// acc (+)= A * B over every k-block, issued as one wgmma batch; the caller waits for it.
// kRegA: A is a register fragment (else a shared-memory descriptor fragment).
template <bool kZeroInit, bool kRegA, class TiledMma, class FragA, class FragB, class FragC>
CUTE_DEVICE void wgmma_gemm(TiledMma& mma, FragA const& a, FragB const& b, FragC& c) {
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<FragA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(const_cast<FragA&>(a));
}

// dst = src converted element by element (packed f32 -> f16x2 / bf16x2), into an existing
// register fragment of the same shape.
template <class Src, class Dst>
CUTE_DEVICE void convert_into(Src const& src, Dst& dst) {
  using From = typename Src::value_type;
  using To = typename Dst::value_type;
  constexpr int N = decltype(size(src))::value;
  static_assert(N == decltype(size(dst))::value, "fragments of different sizes");
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(src.data()));
}

// tanh on the special-function unit (tanh.approx.f32: one instruction, relative error about
// 2^-11), for the soft-capped scores
CUTE_DEVICE float tanh_approx(const float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// acc(i) = tanh(acc(i) * cap_in) for every element of a fragment: the soft-capped scores, in
// the forward and in the backward. (A share of these on the FMA pipe, as a polynomial, was
// slower in both: BENCHMARKS.md, "Soft-capping's tanh partly on the FMA pipe".)
template <class Frag>
CUTE_DEVICE void softcap_tanh(Frag& acc, const float cap_in) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); ++i) acc(i) = tanh_approx(acc(i) * cap_in);
}

// Bytes from a shared-memory pointer to the next multiple of kAlign of its shared address.
template <int kAlign>
CUTE_DEVICE int align_pad(const void* smem) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return int((kAlign - a % kAlign) % kAlign);
}

// Shared memory of one block, from a 1024-byte aligned base: the Q slots, the K slots, the V
// slots (each tile a multiple of 1024 bytes, so each starts on a swizzle period), then the
// barriers.
template <class Traits>
struct SharedStorage {
  using T = typename Traits::Element;
  static_assert(Traits::kSmemQSlot % 1024 == 0 && Traits::kSmemKVStage % 1024 == 0,
                "every tile must start on a 1024-byte boundary");
  static constexpr int kQSlots = Traits::kQSlots;
  char* base;
  CUTE_DEVICE T* q(int slot) const { return reinterpret_cast<T*>(base + slot * Traits::kSmemQSlot); }
  CUTE_DEVICE T* k() const { return reinterpret_cast<T*>(base + Traits::kSmemQ); }
  CUTE_DEVICE T* v() const { return reinterpret_cast<T*>(base + Traits::kSmemQ + Traits::kSmemK); }
  CUTE_DEVICE uint64_t* barriers() const {
    return reinterpret_cast<uint64_t*>(base + Traits::kSmemQ + Traits::kSmemK + Traits::kSmemV);
  }
  // barrier order: per Q slot full, per Q slot empty, then per stage K full, K empty, V full,
  // V empty
  CUTE_DEVICE uint64_t* q_full() const { return barriers(); }
  CUTE_DEVICE uint64_t* q_empty() const { return barriers() + kQSlots; }
  CUTE_DEVICE uint64_t* k_full() const { return barriers() + 2 * kQSlots; }
  CUTE_DEVICE uint64_t* k_empty() const { return barriers() + 2 * kQSlots + Traits::kStages; }
  CUTE_DEVICE uint64_t* v_full() const { return barriers() + 2 * kQSlots + 2 * Traits::kStages; }
  CUTE_DEVICE uint64_t* v_empty() const { return barriers() + 2 * kQSlots + 3 * Traits::kStages; }
  // persistent: per Q slot, the tile number its current use carries (after the barriers)
  CUTE_DEVICE int* slot_tile() const {
    return reinterpret_cast<int*>(barriers() + 2 * kQSlots + 4 * Traits::kStages);
  }
};

}  // namespace sm90

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sm90_fwd_kernel(__grid_constant__ const Sm90FwdArgs<Traits> args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = typename Traits::Element;
  using Storage = sm90::SharedStorage<Traits>;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kConsumerWarps = Traits::kConsumerWarpgroups * 4;
  constexpr float kNegInf = -INFINITY;
  static_assert(cosize_v<typename Traits::SmemLayoutQ> * sizeof(T) == Traits::kSmemQSlot &&
                cosize_v<typename Traits::SmemLayoutKV> * sizeof(T) == Traits::kSmemK,
                "the shared-memory rule of sm90_fwd_config.h disagrees with the layouts");

  FwdParams const& p = args.p;
  extern __shared__ char smem_raw[];
  // align the dynamic window to 1024 bytes (the swizzle period; kSmemBytes has room for it) as
  // smem_raw plus an offset, not through an integer, so that the compiler keeps the pointers in
  // the shared state space: O's staging in the epilogue then uses shared-memory instructions,
  // not generic ones
  const Storage st{smem_raw + sm90::align_pad<Traits::kSmemAlign>(smem_raw)};

  // Tiles: (row block, head, batch). The sectioned order (p.tile_section > 0): the (head,
  // batch) pairs in sections of p.tile_section (whose K and V fit in L2 together), each
  // section's tiles by row block, the last first, so that under a causal mask the heaviest
  // tiles of a section start first and the light ones fill the end. Without kPersistent a block
  // runs the tile of its place in launch order (x fastest) in that order, or of its grid
  // coordinates (row blocks reversed) when p.tile_section is 0; with it, block b of the 1-D
  // grid takes tile numbers of the sectioned order, its first one b (next_tile, below).
  // Windows (FwdParams::window_*) keep these orders: the last row blocks carry at least the
  // work of the first under a causal band or one limited on the right (heaviest first still),
  // nearly the same under a two-sided band; a band limited on the left only gives the first
  // row blocks the most work, which these orders start last (the same results, a less even
  // spread).
  const int num_m_blocks = ceil_div(p.seqlen_q, kBlockM);
  const int num_tiles = Traits::kPersistent ? num_m_blocks * p.heads_q * p.batch : 1;
  // Persistent, static (p.tile_counter null): the tiles of the sectioned order go out in rounds
  // of gridDim.x, alternately forward and backward over the blocks (block b takes tile r G + b
  // in even rounds and r G + G - 1 - b in odd ones), so that under a causal mask no block takes
  // the heaviest tile of every round; tile numbers past the end are skipped. (Round robin in one
  // direction left the first blocks with up to a few row blocks more work per round than the
  // last.)
  // Persistent, dynamic (p.tile_counter set): after tile b a block takes tile
  // G + atomicAdd(counter, 1) once its producer has issued the loads of its current tile, so
  // the tiles of the same order go to whichever block is free first: greedy longest-first
  // scheduling under a causal mask, where the static rounds fix each block's share in advance.
  // A tile number of num_tiles or more ends the block's walk either way.
  const int rounds = Traits::kPersistent ? ceil_div(num_tiles, int(gridDim.x)) : 1;
  auto round_tile = [&](const int r) {
    if constexpr (!Traits::kPersistent) {
      return 0;
    } else {
      const int g = int(gridDim.x), b = int(blockIdx.x);
      return r * g + ((r & 1) ? g - 1 - b : b);
    }
  };
  struct Tile {
    int m_block, head, batch;
  };
  auto sectioned = [&](const int t) {  // tile t of the sectioned, heaviest-first order
    const int hb = p.heads_q * p.batch;
    const int section = p.tile_section > 0 && p.tile_section < hb ? p.tile_section : hb;
    const int per_section = num_m_blocks * section;
    const int s = t / per_section;
    const int local = t - s * per_section;
    const int width = min(section, hb - s * section);  // the last section may be narrower
    const int pair = s * section + local % width;
    return Tile{num_m_blocks - 1 - local / width, pair % p.heads_q, pair / p.heads_q};
  };
  auto tile_at = [&](const int t) {
    if constexpr (Traits::kPersistent) {
      return sectioned(t);
    } else {
      if (p.tile_section > 0) {  // the blocks in launch order (x fastest), renumbered
        const int y = int(blockIdx.y) + int(gridDim.y) * int(blockIdx.z);
        return sectioned(int(blockIdx.x) + int(gridDim.x) * y);
      }
      return Tile{int(gridDim.x) - 1 - int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
    }
  };
  // The tile's sequence: its lengths, causal diagonal and first rows (0 unless packed, where
  // sequence b is rows cu_seqlens[b] .. of the packed tensors; see FwdParams)
  const bool varlen = p.cu_seqlens_q != nullptr;
  int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, q_first = 0, k_first = 0;
  int diag = seqlen_k - seqlen_q;  // causal: row i sees column j iff j <= i + diag
  auto enter = [&](const int batch) {
    if (varlen) {
      q_first = p.cu_seqlens_q[batch];
      k_first = p.cu_seqlens_k[batch];
      seqlen_q = p.cu_seqlens_q[batch + 1] - q_first;
      seqlen_k = p.cu_seqlens_k[batch + 1] - k_first;
      diag = seqlen_k - seqlen_q;
    }
  };
  const int warpgroup = threadIdx.x / 128;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // The band of the tile's sequence (docs/FEATURES.md): row i sees the keys j of [0, seqlen_k)
  // with i + diag - left <= j <= i + diag + right. Causal is right = 0. A side that is unlimited
  // (-1) or reaches past every key of the sequence is the width that just reaches them all
  // (left = seqlen_k, right = seqlen_q), so that the bounds below stay small integers.
  auto band_left = [&]() {
    return p.window_left >= 0 && p.window_left < seqlen_k ? p.window_left : seqlen_k;
  };
  auto band_right = [&]() {
    return p.causal ? 0 : p.window_right >= 0 && p.window_right < seqlen_q ? p.window_right : seqlen_q;
  };
  // Key blocks [first, end) a row block sees (those that meet the band of one of its rows),
  // visited last to first, so that the blocks masked at the band's right edge and the key tail
  // come first and those masked at its left edge last. Producer and consumers walk the same
  // sequence; an empty range (first == end) when no row of the block sees a key.
  struct KeyRange {
    int first, end;
  };
  auto key_range = [&](const int row0) {
    if (row0 >= seqlen_q) return KeyRange{0, 0};  // a packed sequence shorter than the grid's rows
    const int lo = max(0, row0 + diag - band_left());  // the first row's first key
    const int hi = min(seqlen_k - 1, row0 + kBlockM - 1 + diag + band_right());  // the last row's last
    return hi < lo ? KeyRange{0, 0} : KeyRange{lo / kBlockN, hi / kBlockN + 1};
  };

  constexpr int kQSlots = Traits::kQSlots;
  auto q_full = reinterpret_cast<FullBarrier*>(st.q_full());
  auto q_empty = reinterpret_cast<EmptyBarrier*>(st.q_empty());
  auto k_full = reinterpret_cast<FullBarrier*>(st.k_full());
  auto v_full = reinterpret_cast<FullBarrier*>(st.v_full());
  auto k_empty = reinterpret_cast<EmptyBarrier*>(st.k_empty());
  auto v_empty = reinterpret_cast<EmptyBarrier*>(st.v_empty());
  if (threadIdx.x == 0) {
    // the TMA descriptors (kernel parameters) into the cache now, not at the first load
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
    CUTE_UNROLL
    for (int s = 0; s < kQSlots; ++s) {
      q_full[s].init(1);
      q_empty[s].init(kConsumerWarps);
    }
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      k_full[s].init(1);
      v_full[s].init(1);
      k_empty[s].init(kConsumerWarps);
      v_empty[s].init(kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Q slot s (use u of this block, counting the tiles that load a Q and, persistent, the
  // messages without one, is slot u % kQSlots with barrier phase (u / kQSlots) & 1)
  auto q_slot = [&](const int slot) {
    return make_tensor(make_smem_ptr(st.q(slot)), typename Traits::SmemLayoutQ{});
  };
  Tensor sK = make_tensor(make_smem_ptr(st.k()), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(st.v()), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v()), typename Traits::SmemLayoutVt{});

  // Tile messages (persistent): every tile the producer sends, and at last the end of the walk,
  // takes the block's next use of a Q slot (use u: slot u % kQSlots, phase (u / kQSlots) & 1).
  // The producer thread waits until the consumers have released the slot, stores the tile
  // number in the slot's word, then arrives on the slot's full barrier: with Q's transaction
  // bytes for a tile with key blocks, without bytes for a tile whose rows see no key (causal,
  // seqlen_q > seqlen_k, or a window: the consumers write zeros) and for the end (tile number
  // num_tiles).
  // The arrive releases the store and a completed wait on that phase acquires it, so lane 0 of
  // each consumer warp reads the number after its wait (and shuffles it to its warp); that
  // lane releases the slot once its warp is done with the tile (after the O staging), before
  // the producer writes its word again. Packed rows
  // past their sequence's end (nothing to write) get no message. Both sides count the slot uses
  // alike (q_round), and the consumers never walk the tile order themselves.
  const uint32_t slot_tile_addr = cute::cast_smem_ptr_to_uint(st.slot_tile());
  auto send_tile = [&](const int slot, const int t) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(slot_tile_addr + 4 * slot), "r"(t) : "memory");
  };
  auto receive_tile = [&](const int slot) {
    int t;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(t) : "r"(slot_tile_addr + 4 * slot) : "memory");
    return t;
  };

  if (warpgroup == 0) {
    // ================================ producer ================================
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp == 0 && lane == 0) {
      auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
      auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
      // packed: one (total, D, heads, 1) view each, the sequence's rows reached by an offset
      const int views = varlen ? 1 : p.batch;
      Tensor mQ = args.tma_q.get_tma_tensor(
          make_shape(varlen ? p.total_q : p.seqlen_q, kHeadDim, p.heads_q, views));
      Tensor mK = args.tma_k.get_tma_tensor(
          make_shape(varlen ? p.total_k : p.seqlen_k, kHeadDim, p.heads_kv, views));
      Tensor mV = args.tma_v.get_tma_tensor(
          make_shape(varlen ? p.total_k : p.seqlen_k, kHeadDim, p.heads_kv, views));
      // block b's tiles: b, then the next tile of its static rounds or the counter's next one
      int r = 0;
      auto next_tile = [&]() -> int {
        if constexpr (!Traits::kPersistent) {
          return num_tiles;
        } else {
          if (p.tile_counter != nullptr) {
            // (through a warp reduction over this one thread: its result is a uniform register,
            // like the rest of the walk; the atomic's own vector register would pull the tile
            // coordinates out of the uniform registers and spill the producer's 24)
            const int claimed = __reduce_max_sync(1u, unsigned(atomicAdd(p.tile_counter, 1)));
            // the launch adds num_tiles times in all (once per tile after the first G, once
            // per block at the end), so the add that returned num_tiles - 1 was the last one:
            // the counter is left zero for the next launch
            if (claimed == num_tiles - 1) *p.tile_counter = 0;
            return int(gridDim.x) + claimed;
          }
          ++r;
          return r < rounds ? round_tile(r) : num_tiles;
        }
      };
      int stage = 0, phase = 0, q_round = 0;
      for (int t = round_tile(0); t < num_tiles; t = next_tile()) {
        const Tile tile = tile_at(t);
        enter(tile.batch);
        const int row0 = tile.m_block * kBlockM;
        const KeyRange keys = key_range(row0);
        const int q_slot_now = q_round % kQSlots;
        const int q_parity = (q_round / kQSlots) & 1;
        if (keys.first == keys.end) {
          // rows that see no key (causal with seqlen_q > seqlen_k, or outside a window): the
          // message alone (no load; the consumers write zeros and lse -inf); packed rows past
          // their sequence's end: nothing to write, no message
          if (Traits::kPersistent && row0 < seqlen_q) {
            q_empty[q_slot_now].wait(q_parity ^ 1);
            send_tile(q_slot_now, t);
            q_full[q_slot_now].arrive();
            ++q_round;
          }
          continue;
        }
        const int kv_head = tile.head / p.group;
        const int view = varlen ? 0 : tile.batch;
        Tensor gQ = local_tile(domain_offset(make_coord(q_first, _0{}), mQ(_, _, tile.head, view)),
                               tile_q, make_coord(tile.m_block, _0{}));
        Tensor sQ = q_slot(q_slot_now);
        Tensor gK = local_tile(domain_offset(make_coord(k_first, _0{}), mK(_, _, kv_head, view)),
                               tile_kv, make_coord(_, _0{}));  // (BN,D,n)
        Tensor gV = local_tile(domain_offset(make_coord(k_first, _0{}), mV(_, _, kv_head, view)),
                               tile_kv, make_coord(_, _0{}));
        auto [tQgQ, tQsQ] = tma_partition(args.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                          group_modes<0, 2>(gQ));
        auto [tKgK, tKsK] = tma_partition(args.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                          group_modes<0, 2>(gK));
        auto [tVgV, tVsV] = tma_partition(args.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                          group_modes<0, 2>(gV));
        // the first K block goes out before Q waits for its slot (persistent: released by the
        // epilogue of the tile before the previous one), so that both loads overlap the end of
        // the previous tile
        const int n_last = keys.end - 1;
        k_empty[stage].wait(phase ^ 1);
        k_full[stage].arrive_and_expect_tx(Traits::kTmaBytesKV);
        cute::copy(args.tma_k.with(reinterpret_cast<uint64_t&>(k_full[stage])), tKgK(_, n_last),
                   tKsK(_, stage));
        q_empty[q_slot_now].wait(q_parity ^ 1);
        if constexpr (Traits::kPersistent) send_tile(q_slot_now, t);
        q_full[q_slot_now].arrive_and_expect_tx(Traits::kTmaBytesQ);
        cute::copy(args.tma_q.with(reinterpret_cast<uint64_t&>(q_full[q_slot_now])), tQgQ, tQsQ);
        ++q_round;
        for (int n = n_last; n >= keys.first; --n) {
          if (n != n_last) {
            k_empty[stage].wait(phase ^ 1);
            k_full[stage].arrive_and_expect_tx(Traits::kTmaBytesKV);
            cute::copy(args.tma_k.with(reinterpret_cast<uint64_t&>(k_full[stage])), tKgK(_, n),
                       tKsK(_, stage));
          }
          v_empty[stage].wait(phase ^ 1);
          v_full[stage].arrive_and_expect_tx(Traits::kTmaBytesKV);
          cute::copy(args.tma_v.with(reinterpret_cast<uint64_t&>(v_full[stage])), tVgV(_, n),
                     tVsV(_, stage));
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
      if constexpr (Traits::kPersistent) {  // the end of the walk: a message without a load
        const int q_slot_now = q_round % kQSlots;
        q_empty[q_slot_now].wait(((q_round / kQSlots) & 1) ^ 1);
        send_tile(q_slot_now, num_tiles);
        q_full[q_slot_now].arrive();
      }
    }
    return;
  }

  // ================================ consumers ================================
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int ctid = threadIdx.x - 128;  // 0 .. consumer threads - 1
  const int cwg = ctid / 128;          // this warpgroup's 64 rows: cwg * 64 ..

  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(ctid);
  auto thr_o = mma_o.get_thread_slice(ctid);
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  // coordinates (row, col) in the tile of every S element this thread holds
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor c_rc = make_tensor(tScS.data(), sm90::rowcol_view(tScS.layout()));

  using AccS = decltype(partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  constexpr int kRows = decltype(size<0>(sm90::rowcol_view(typename AccS::layout_type{})))::value;
  float row_max[kRows];
  float row_sum[kRows];
  // the exponent's multiplier of a score (base 2): scale log2 e, or softcap log2 e for the
  // soft-capped scores (modify_s below)
  const float scale_log2 = p.softcap > 0.f ? p.softcap_log2 : p.scale_log2;
  // The running maximum a row's exponentials are taken against: the row's new maximum `mx`
  // only where it exceeds the old one `prev` by more than kMaxSlack in the exponent's units
  // (base 2), else `prev` again, so that the unnormalised probabilities stay below 2^kMaxSlack
  // (exact in fp32 and in the 16-bit P) and the factor O and the row sum take is exactly 1.
  // A warp whose rows all keep their maximum skips O's rescaling (a warp vote): after a
  // tile's first blocks the maximum rarely grows that much, and the multiplications of O
  // stood between a block's P V product and the next block's products. A row with no
  // visible key yet (-inf) takes the new one (-inf - -inf is NaN: not kept).
  // Only in the plain order and with ping-pong: the overlapped order without ping-pong
  // (ov1_pp0) measured 2-4% slower with it (most likely the branch around O's rescaling; not
  // profiled), the others up to 3% faster (BENCHMARKS.md "The running maximum with slack").
  constexpr bool kMaxSkip = !Traits::kOverlap || Traits::kPingpong;
  constexpr float kMaxSlack = 8.f;
  auto running_max = [&](const float prev, const float mx) {
    if constexpr (kMaxSkip) return (mx - prev) * scale_log2 <= kMaxSlack ? prev : mx;
    else return mx;
  };
  // One key block's online softmax (base 2; a row is spread over the four lanes of a quad):
  // S becomes the unnormalised probabilities, the row statistics move on, alpha[r] gets the
  // factor O's row r is to be multiplied by. Returns whether O needs it: whether some row of
  // the warp took a new maximum (a warp vote) where kMaxSkip, else always.
  auto online_softmax = [&](auto& acc_s, float* alpha) -> bool {
    Tensor s_rc = make_tensor(acc_s.data(), sm90::rowcol_view(acc_s.layout()));
    bool moved = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float mx =
          running_max(row_max[r], allreduce_xor<2>(row_max_of(s_rc, r, row_max[r]), MaxOp{}));
      moved |= mx != row_max[r];
      const float base = softmax_row_step(row_max[r], mx, scale_log2, alpha[r]);
      const float sum = exp2_row(s_rc, r, scale_log2, base);
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
    if constexpr (kMaxSkip) return __any_sync(0xffffffffu, moved);
    else return true;
  };
  // O's rows times the factors of online_softmax
  auto rescale_o = [&](float const* alpha) {
    Tensor o_rc = make_tensor(acc_o.data(), sm90::rowcol_view(acc_o.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= alpha[r];
    }
  };
  int stage = 0, phase = 0, q_round = 0;

  // one tile, or (persistent) the tiles of the producer's messages until the end message
  for (int i = 0; Traits::kPersistent || i == 0; ++i) {
    const int q_slot_now = q_round % kQSlots;  // this tile's Q slot
    int t = 0;
    if constexpr (Traits::kPersistent) {
      q_full[q_slot_now].wait((q_round / kQSlots) & 1);  // the message, with Q when loaded
      // lane 0 reads the word and passes it on, so that the thread that releases the slot
      // (lane 0's arrive on its empty barrier) is the only reader the producer's next store
      // to the word has to follow
      t = __shfl_sync(0xffffffffu, lane == 0 ? receive_tile(q_slot_now) : 0, 0);
      if (t >= num_tiles) break;
    }
    const Tile tile = tile_at(t);
    enter(tile.batch);
    const int head = tile.head;
    const int batch = tile.batch;
    const int row0 = tile.m_block * kBlockM;
    const KeyRange keys = key_range(row0);
    const int n_blocks = keys.end - keys.first;
    clear(acc_o);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = kNegInf;
      row_sum[r] = 0.f;
    }
    // this tile's Q (a tile with no key block loads none), once it has landed (persistent: it
    // has, the message came with it)
    Tensor sQ = q_slot(q_slot_now);
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K): descriptors
    auto wait_q = [&]() {
      if constexpr (!Traits::kPersistent) q_full[q_slot_now].wait((q_round / kQSlots) & 1);
    };

    // The element mask: row `row` sees the columns [row + diag - left, row + diag + right] of
    // [0, seqlen_k). Only the blocks that a row's band does not cover whole take it: from
    // mask_hi up (the key tail, or a column past the first row's band) and below mask_lo (a
    // column before the band of the last row stored); the blocks between are seen whole.
    const int left = band_left();
    const int right = band_right();
    const int right_end = row0 + diag + right + 1;                   // past the first row's band
    const int left_start = min(row0 + kBlockM, seqlen_q) - 1 + diag - left;  // the last row's
    const int mask_hi = min(seqlen_k / kBlockN, right_end > 0 ? right_end / kBlockN : 0);
    const int mask_lo = left_start > 0 ? ceil_div(left_start, kBlockN) : 0;
    auto needs_mask = [&](const int n) { return n >= mask_hi || n < mask_lo; };
    auto mask_s = [&](auto& acc_s, const int n) {
      Tensor s_rc = make_tensor(acc_s.data(), sm90::rowcol_view(acc_s.layout()));
      // each row's visible columns [lo, end) relative to the thread's first column, so that
      // every element compares its own offset from that column (a constant) with them (an
      // element's own column index in a register each would cost registers the overlapped
      // three-warpgroup kernels do not have)
      const int col_base = get<1>(c_rc(0, 0));
      const int col0 = n * kBlockN + col_base;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s_rc); ++r) {
        const int row = row0 + get<0>(c_rc(r, 0));
        const int lo = row + diag - left - col0;
        const int end = min(seqlen_k, row + diag + right + 1) - col0;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(s_rc); ++c) {
          const int k = get<1>(c_rc(r, c)) - col_base;
          if (k < lo || k >= end) s_rc(r, c) = kNegInf;
        }
      }
    };
    // Soft-capping and ALiBi (docs/FEATURES.md: in that order, before the mask) on the whole
    // block, in the scores' units: the exponent is score * scale_log2 - max, where a score is
    // q.k (scale_log2 = scale log2 e) or, soft-capped, tanh(q.k scale / softcap)
    // (scale_log2 = softcap log2 e); ALiBi's slope is divided by scale, or by softcap, to match.
    const bool softcap_on = p.softcap > 0.f;
    const bool alibi_on = p.alibi_slopes != nullptr;
    const float alibi_coef =
        alibi_on ? p.alibi_slopes[int64_t(batch) * p.alibi_batch_stride + head] /
                       (softcap_on ? p.softcap : p.scale)
                 : 0.f;
    auto modify_s = [&](auto& acc_s, const int n) {
      Tensor s_rc = make_tensor(acc_s.data(), sm90::rowcol_view(acc_s.layout()));
      if (softcap_on) sm90::softcap_tanh(acc_s, p.softcap_in);
      if (alibi_on) {
        // |row + diag - col| as a float: the thread's distance at its first column, less each
        // element's column offset from it (a constant); exact below 2^24
        const int col_base = get<1>(c_rc(0, 0));
        CUTE_UNROLL
        for (int r = 0; r < size<0>(s_rc); ++r) {
          const float dist0 = float(row0 + get<0>(c_rc(r, 0)) + diag - n * kBlockN - col_base);
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s_rc); ++c) {
            const float dc = float(get<1>(c_rc(r, c)) - col_base);
            s_rc(r, c) = fmaf(-alibi_coef, fabsf(dist0 - dc), s_rc(r, c));
          }
        }
      }
    };

    auto step = [&](const int n, auto mask_tag) {
      constexpr bool kMask = decltype(mask_tag)::value;
      // S = Q K^T
      Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      k_full[stage].wait(phase);
      sm90::wgmma_gemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
      warpgroup_wait<0>();
      if (lane == 0) k_empty[stage].arrive();

      if (softcap_on || alibi_on) modify_s(acc_s, n);
      if constexpr (kMask) mask_s(acc_s, n);  // the band's edges and the key tail

      float alpha[kRows];
      if (online_softmax(acc_s, alpha)) rescale_o(alpha);

      // O += P V with P from registers
      Tensor rP = convert_fragment<T>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), sm90::acc_as_operand_a(rP.layout()));
      v_full[stage].wait(phase);
      sm90::wgmma_gemm<false, true>(mma_o, tOrP, tOrV(_, _, _, stage), acc_o);
      warpgroup_wait<0>();
      if (lane == 0) v_empty[stage].arrive();
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    };

    // The key blocks from the last to the first: the masked ones at the top, the whole ones,
    // then those masked at the band's left edge (the inner loops' two call sites serve all
    // three runs; the last run ends the walk)
    if constexpr (!Traits::kOverlap) {
      if (n_blocks > 0) wait_q();
      int n = keys.end - 1;
      for (;;) {
        for (; n >= keys.first && needs_mask(n); --n) step(n, cute::true_type{});
        if (n < keys.first) break;
        for (; n >= mask_lo; --n) step(n, cute::false_type{});
      }
    } else if (n_blocks > 0) {
      // ---- the overlapped order (ov1): S_j's softmax runs under P_{j-1} V_{j-1} ----
      // A GEMM burst: S_j and P_{j-1} V_{j-1} issued back to back. With ping-pong (pp1) the two
      // warpgroups take turns: warpgroup c waits at barrier kSchedBarrier + c before its burst
      // and opens the other's after it. Each warpgroup has n_blocks + 1 bursts; warpgroup 1
      // opens warpgroup 0's first one and skips the opening after its last, so every barrier
      // sees as many arrivals as waits.
      constexpr int kSchedBarrier = 4;  // user ids 1..3 belong to the epilogue
      auto burst_begin = [&]() {
        if constexpr (Traits::kPingpong) cutlass::arch::NamedBarrier::sync(256, kSchedBarrier + cwg);
      };
      auto burst_end = [&](const bool last) {
        if constexpr (Traits::kPingpong) {
          if (!(last && cwg == 1)) cutlass::arch::NamedBarrier::arrive(256, kSchedBarrier + (cwg ^ 1));
        }
      };
      if constexpr (Traits::kPingpong) {
        if (cwg == 1) cutlass::arch::NamedBarrier::arrive(256, kSchedBarrier + 0);
      }

      // the factors of O's rows from a block's softmax, applied once the pending P V product
      // has landed in O; `moved`: whether they are needed (online_softmax, voted ahead of the
      // P V wait)
      float alpha[kRows];
      bool moved = false;
      // P of the previous block, kept in registers until its P V product is done
      Tensor rP = make_tensor<T>(typename AccS::layout_type{});
      Tensor tOrP = make_tensor(rP.data(), sm90::acc_as_operand_a(rP.layout()));
      int pstage = 0, pphase = 0;  // the slot of the block whose V is still to be multiplied
      auto advance = [&]() {
        pstage = stage;
        pphase = phase;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      };

      wait_q();
      int n = keys.end - 1;
      {  // the first block: S only (O is still zero, nothing to rescale)
        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        k_full[stage].wait(phase);
        burst_begin();
        sm90::wgmma_gemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
        burst_end(false);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        if (lane == 0) k_empty[stage].arrive();
        if (softcap_on || alibi_on) modify_s(acc_s, n);
        if (needs_mask(n)) mask_s(acc_s, n);
        moved = online_softmax(acc_s, alpha);
        sm90::convert_into(acc_s, rP);
        advance();
      }
      auto step_ov = [&](const int n, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
        k_full[stage].wait(phase);
        v_full[pstage].wait(pphase);
        burst_begin();
        sm90::wgmma_gemm<true, false>(mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
        sm90::wgmma_gemm<false, true>(mma_o, tOrP, tOrV(_, _, _, pstage), acc_o);
        burst_end(false);
        warpgroup_wait<1>();  // S_j is done, P_{j-1} V_{j-1} may still run
        warpgroup_fence_operand(acc_s);
        if (lane == 0) k_empty[stage].arrive();
        if (softcap_on || alibi_on) modify_s(acc_s, n);
        if constexpr (kMask) mask_s(acc_s, n);
        moved = online_softmax(acc_s, alpha);
        warpgroup_wait<0>();  // O and P_{j-1} are free again
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(rP);
        if (lane == 0) v_empty[pstage].arrive();
        if (moved) rescale_o(alpha);
        sm90::convert_into(acc_s, rP);
        advance();
      };
      for (--n;;) {
        for (; n >= keys.first && needs_mask(n); --n) step_ov(n, cute::true_type{});
        if (n < keys.first) break;
        for (; n >= mask_lo; --n) step_ov(n, cute::false_type{});
      }
      // the last block's P V
      v_full[pstage].wait(pphase);
      burst_begin();
      sm90::wgmma_gemm<false, true>(mma_o, tOrP, tOrV(_, _, _, pstage), acc_o);
      burst_end(true);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      if (lane == 0) v_empty[pstage].arrive();
    }

    // ---- epilogue: O /= rowsum, log-sum-exp, O through shared memory to global ----
    float* lse_ptr = varlen ? p.lse + int64_t(head) * p.total_q + q_first
                            : p.lse + (int64_t(batch) * p.heads_q + head) * p.seqlen_q;
    Tensor o_rc = make_tensor(acc_o.data(), sm90::rowcol_view(acc_o.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = allreduce_xor<2>(row_sum[r], SumOp{});
      const bool empty = !(sum > 0.f);  // no visible key in this row
      const float inv = empty ? 0.f : 1.f / sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); ++c) o_rc(r, c) *= inv;
      if (lane % 4 == 0) {  // the lane holding the row's first columns writes its statistic
        const int row = row0 + get<0>(c_rc(r, 0));
        if (row < seqlen_q) {
          lse_ptr[row] = empty ? kNegInf : (row_max[r] * scale_log2 + log2f(sum)) * sm90::kLn2;
        }
      }
    }

    T* o_ptr = static_cast<T*>(p.o) + (varlen ? int64_t(q_first) * p.o_row_stride : batch * p.o_batch_stride) +
               head * p.o_head_stride;
    const int wg_row0 = row0 + cwg * 64;
    Tensor gO = make_tensor(make_gmem_ptr(o_ptr + int64_t(wg_row0) * p.o_row_stride),
                            make_shape(Int<64>{}, Int<kHeadDim>{}), make_stride(p.o_row_stride, _1{}));
    typename Traits::GmemTiledCopyO copy_o;
    auto thr_copy_o = copy_o.get_thread_slice(ctid % 128);
    Tensor tOgO = thr_copy_o.partition_D(gO);
    Tensor tOcO = thr_copy_o.partition_D(make_identity_tensor(Shape<Int<64>, Int<kHeadDim>>{}));
    if (Traits::kPersistent && n_blocks == 0) {
      // no key block: its slot carried the message only (no Q to stage O in): zeros straight
      // to global memory, then the slot is released (nothing of it was written)
      CUTE_UNROLL
      for (int m = 0; m < size<1>(tOgO); ++m) {
        if (wg_row0 + get<0>(tOcO(0, m, 0)) < seqlen_q) clear(tOgO(_, m, _));
      }
      __syncwarp();
      if (lane == 0) q_empty[q_slot_now].arrive();
      ++q_round;
      continue;
    }

    // O's staging rows: this warpgroup's rows of the tile's Q slot (free: its last S product
    // has completed; the other warpgroups read only their own rows)
    // (written with stmatrix and read back through a view whose swizzle applies to offsets, not
    // to the address as an integer: shared-memory instructions, not generic ones)
    Tensor rO = convert_fragment<T>(acc_o);
    auto copy_o_s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, T>{}, mma_o);
    auto thr_copy_o_s = copy_o_s.get_thread_slice(ctid);
    cute::copy(copy_o_s, thr_copy_o_s.retile_S(rO), thr_copy_o_s.partition_D(sQ));
    cutlass::arch::NamedBarrier::sync(128, 1 + cwg);  // the warpgroup's rows are in shared memory

    Tensor sOw = local_tile(as_position_independent_swizzle_tensor(sQ),
                            Shape<Int<64>, Int<kHeadDim>>{}, make_coord(cwg, _0{}));
    Tensor tOsO = thr_copy_o.partition_S(sOw);
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tOsO); ++m) {
      if (wg_row0 + get<0>(tOcO(0, m, 0)) < seqlen_q) {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tOsO); ++k) cute::copy(copy_o, tOsO(_, m, k), tOgO(_, m, k));
      }
    }
    if (n_blocks > 0) {  // every lane has read its rows: the slot may take another tile's Q
      // (the staging stores were generic-proxy writes; the next TMA load into the slot is an
      // async-proxy write)
      cutlass::arch::fence_view_async_shared();
      __syncwarp();
      if (lane == 0) q_empty[q_slot_now].arrive();
      ++q_round;
    }
  }  // tiles
#else
  __trap();  // sm_90a only (wgmma, TMA, setmaxnreg)
#endif
}

}  // namespace sparktune
