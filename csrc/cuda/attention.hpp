// Row-invariant attention over the KV cache for the CUDA torch forward (attention.cu).
//
// One warp per (query row, head). A row at cache position p attends over positions [0, p]
// of its slot in blocks of 32 keys, block after block, with an online softmax: the
// arithmetic depends only on the row's own query, position and cache contents, never on
// how many rows the step holds, which other sequences share it, or how long their spans
// are. A K-row verify therefore computes each row exactly as K one-row decodes would,
// which stock SDPA does not (its backend and split-KV choice follow the shapes).
//
// No CUDA or torch types appear here: device pointers and the stream cross as integers
// (`tensor.data_ptr()`, `torch.cuda.current_stream().cuda_stream`), as in sa_device_pool.hpp.
#pragma once

#include <cstdint>

namespace cuda_forward {

// A step's rows and one layer's cache, as both kernels take them.
struct CacheRows {
  uintptr_t k_cache = 0;      // float32 [slots, kv_heads, max_seq_len, head_dim], contiguous
  uintptr_t v_cache = 0;      // same shape as k_cache
  uintptr_t row_slot = 0;     // int32 [rows]: the row's cache slot
  uintptr_t row_pos = 0;      // int32 [rows]: the row's position; < 0 marks a padding row
  int64_t rows = 0, kv_heads = 0, head_dim = 0, slots = 0, max_seq_len = 0;
  uintptr_t stream = 0;       // cudaStream_t
};

struct AttentionArgs {
  CacheRows cache;
  uintptr_t q = 0;            // float32 [rows, heads, head_dim] with row stride q_row_stride
  int64_t q_row_stride = 0;   // elements between rows (>= heads * head_dim)
  uintptr_t out = 0;          // float32 [rows, heads * head_dim], contiguous
  int64_t heads = 0;
  float scale = 1.0f;         // multiplies q.k (1/sqrt(head_dim) for Llama)
};

// Launches one kernel on `a.cache.stream`, never synchronises; std::invalid_argument on a bad
// shape or a null pointer. Rows whose slot or position is out of range (or negative) get
// zeros: the device cannot throw, and the caller validates spans before the step.
void attention_rows(const AttentionArgs& a);

// The step's new K and V rows into the cache, before any row attends: row r's
// k[r, kv_heads, head_dim] and v[r, ...] go to (row_slot[r], :, row_pos[r], :) of one layer.
// One kernel instead of two indexed assignments; rows out of range (padding) are skipped.
struct KvWriteArgs {
  CacheRows cache;
  uintptr_t k = 0, v = 0;                    // float32 [rows, kv_heads * head_dim], row strides below
  int64_t k_row_stride = 0, v_row_stride = 0;
};

void write_kv(const KvWriteArgs& a);

}  // namespace cuda_forward
