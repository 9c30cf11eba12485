// The Hopper backward's block order for causal and windowed launches (sm90_bwd_launch.h): how
// many (kv head, batch) pairs one section of the grid takes. Within a section the key blocks of
// all its pairs come heaviest first; sections run one after another. Host arithmetic only (no
// CUDA), so that tests/test_sm90_bwd_order.py compiles it with the host compiler.
#pragma once

#include <cstdint>

namespace sparktune {

// pairs: kv heads x batch; key_blocks: per pair; pair_bytes: a pair's Q, dO and fp32 dQ
// workspace; sms: the GPU's SMs (one backward block each); budget_mb: the value of
// SPARKTUNE_SM90_BWD_L2_MB, or -1 where it is unset.
//
// A section's pairs fit an L2 budget together (8 MB by default; BENCHMARKS.md, "Sectioned block
// order in the backward"). Unset, the whole grid is one section where it is at most two waves,
// or at most four with each pair's key blocks at most half a wave: with few pairs, one pair
// after another starts the heaviest blocks of the last pairs late (BENCHMARKS.md, "Few pairs:
// the whole grid as one section"). Set, its budget is taken as it is (a measurement switch;
// 0 gives one pair after another).
inline int64_t sm90_bwd_section_pairs(int64_t pairs, int64_t key_blocks, int64_t pair_bytes,
                                      int64_t sms, int64_t budget_mb) {
  const bool env_set = budget_mb >= 0;
  const int64_t mb_max = int64_t(1) << 30;  // (no overflow below)
  const int64_t budget = (env_set ? (budget_mb < mb_max ? budget_mb : mb_max) : 8) << 20;
  int64_t per = pair_bytes > 0 ? budget / pair_bytes : 1;
  per = per < 1 ? 1 : (per > pairs ? pairs : per);
  if (!env_set && per < pairs) {
    const int64_t blocks = pairs * key_blocks;
    if (blocks <= 2 * sms || (blocks <= 4 * sms && 2 * key_blocks <= sms)) per = pairs;
  }
  return per;
}

}  // namespace sparktune
