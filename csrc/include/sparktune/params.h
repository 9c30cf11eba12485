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

  // Attention features (docs/FEATURES.md; the family 90 forward only, the other kernels never
  // read them and `fwd` refuses them for those). With diag = seqlen_k - seqlen_q (per sequence
  // when packed), row i sees col j iff i + diag - window_left <= j <= i + diag + window_right,
  // -1 meaning unlimited on that side; causal is window_right = 0 whatever window_right says.
  int window_left = -1;
  int window_right = -1;
  // softcap > 0: the scaled score s becomes softcap * tanh(s / softcap); the kernel computes
  // tanh(q.k * softcap_in) with softcap_in = scale / softcap and takes softcap_log2 =
  // softcap * log2(e) as the exponent's multiplier (both set with softcap)
  float softcap = 0.f;
  float softcap_in = 0.f;
  float softcap_log2 = 0.f;
  // ALiBi (after the softcap): s -= slope * |i + diag - j| with the fp32 slope
  // alibi_slopes[b * alibi_batch_stride + h] of sequence b and query head h (batch stride 0:
  // one slope per head); null: off
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;

  // Packed sequences (the family 90 forward and backward only; null elsewhere): sequence b is
  // rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q, o (and dout, dq) and cu_seqlens_k[b] .. of
  // k, v (and dk, dv), each a (total, heads, head_dim) tensor (batch strides unused); batch is
  // the number of sequences, seqlen_q/seqlen_k their maximum lengths, and lse is
  // (heads_q, total_q).
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int total_q = 0;
  int total_k = 0;

  // The family 90 forward's tile order (set by its launch): > 0, the (head, batch) pairs in
  // sections of this many (the query heads of whole kv heads, whose K and V stay in L2
  // together), each section's row blocks heaviest first; 0, the grid's order. The family 90
  // backward's launch sets it too (BwdParams): > 0, the (kv head, batch) pairs in sections of
  // this many, grid (pair within the section, key block, section); 0, grid (key block, kv
  // head, batch).
  int tile_section = 0;

  // The family 90 persistent forward (`_ps1`) only; the other kernels never read it. Null: each
  // block takes its tiles of that order in static rounds. Else a zeroed int32 in device memory
  // (the caller's, e.g. a fresh torch.zeros(1, dtype=int32) per launch): a block takes its next
  // tile from it with an atomic add whenever it is free, and the kernel leaves it zero again.
  // Packed launches keep the static rounds (sm90_fwd_launch.h says why).
  int* tile_counter = nullptr;
};

// The backward kernels read the forward's inputs, output and log-sum-exp (the FwdParams part)
// plus the output gradient, and write dq/dk/dv. dq is summed over key blocks in an fp32
// workspace with atomics, then converted; dk/dv (batch, heads_kv, seqlen_k, head_dim) are
// written once per key block. Packed sequences (cu_seqlens_q set, family 90 only): dout, dq like
// q and dk, dv like k, (total, heads, head_dim) each, and the workspaces below packed too.
struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  // (batch, heads_q, seqlen_q, head_dim) fp32, contiguous; packed: (total_q, heads_q, head_dim)
  float* dq_accum = nullptr;
  // (batch, heads_q, seqlen_q) fp32: D = rowsum(dout * o); packed: (heads_q, total_q), as lse
  float* dsum = nullptr;
  // Deterministic dQ (family 90 only; the other families never get one): when set, a zeroed
  // int32 (batch, heads_q, ceil(seqlen_q / block_m)) counter per query row block makes the key
  // blocks add their dQ parts in ascending order, so the sum is the same on every run (packed:
  // batch sequences, seqlen_q the longest).
  int* dq_semaphore = nullptr;
  // The group split (family 90 only, dense, group_split dividing group): each kv head's group
  // of query heads walked by group_split blocks of group / group_split heads each, for grids too
  // small to fill the GPU. Their dK and dV sums go to dkv_part, fp32 (2, batch, heads_kv *
  // group_split, seqlen_k, head_dim), contiguous (dK's parts, then dV's; part s of kv head h at
  // h * group_split + s), which a last kernel adds in part order (so deterministic mode stays
  // bitwise reproducible) into dk and dv.
  int group_split = 1;
  float* dkv_part = nullptr;
  // group / group_split, the query heads of one block (set by the launch)
  int part_heads = 0;

  int64_t do_batch_stride = 0, do_head_stride = 0, do_row_stride = 0;
  int64_t dq_batch_stride = 0, dq_head_stride = 0, dq_row_stride = 0;
  int64_t dk_batch_stride = 0, dk_head_stride = 0, dk_row_stride = 0;
  int64_t dv_batch_stride = 0, dv_head_stride = 0, dv_row_stride = 0;
};

}  // namespace sparktune
