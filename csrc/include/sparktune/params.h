// One parameter block for every forward kernel: pointers, strides, sizes, scale, flags.
// Strides are in elements; only the last (head) dimension must be contiguous.
#pragma once

#include <cstdint>

namespace sparktune {

struct FwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // (batch, heads_q, seqlen_q), contiguous, natural log

  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;

  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int group = 1;  // heads_q / heads_kv: query heads per key/value head
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;

  float scale = 1.f;       // softmax scale applied to q.k
  float scale_log2 = 1.f;  // scale * log2(e): the kernels work in base 2
  bool causal = false;     // bottom-right aligned: row i sees col j iff j <= i + seqlen_k - seqlen_q
};

}  // namespace sparktune
