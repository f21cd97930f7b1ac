// A Llama decoder forward on quantized weights, one native call per step.
//
// The step is a packed batch of spans (a request's new tokens at consecutive positions of its
// KV slot): a 1-token decode, a K-row verify, a prefill chunk, or several of them. Every row's
// arithmetic is the same whatever else is in the step (see kernels.hpp), so a K-row verify
// computes what K 1-row decodes would, bit for bit, and so does any thread count.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "thread_pool.hpp"

namespace cpu {

constexpr int kMaxLayers = 4096;  // 30 times the deepest open model's (a larger count is a typo)

struct ModelDims {
  int vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim;
  int max_positions;
  float rms_norm_eps;
};

// Weights as GGUF stores them: n rows of k / 32 blocks each, row-major.
struct GgufMatrix {
  WeightType type;
  int n, k;
  const uint8_t* rows;
};

struct Span {
  int32_t slot, start, length;
};

// The fp16 KV cache in pages of 32 positions, owned by the caller: k and v are
// [layers][kv_heads][num_pages][32 * head_dim]; a (KV head, page) holds K transposed
// ([head_dim][32]), which the attention kernel reads, and V as [32][head_dim]. Slot s's
// positions [32b, 32b + 32) are in page block_table[s * blocks_per_slot + b]; a step's spans
// may only reach blocks whose entry names a page, and no two spans may write one page.
struct KvCache {
  uint16_t* k;
  uint16_t* v;
  int num_pages;
  const int32_t* block_table;
  int num_slots, blocks_per_slot;
};

// A matrix regrouped into column groups (kernels.hpp), owning its bytes.
class OwnedMatrix {
 public:
  OwnedMatrix() = default;
  explicit OwnedMatrix(const GgufMatrix& m);
  const PackedMatrix& view() const { return view_; }
  bool empty() const { return bytes_.empty(); }
  // Row r (an output column) dequantised into out [k].
  void dequantize_row(int r, float* out) const;
  size_t num_bytes() const { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
  PackedMatrix view_{};
};

class LlamaForward {
 public:
  LlamaForward(const ModelDims& dims, int num_threads, const std::string& isa);

  // qkv_bias [q + 2 kv] may be null (a Llama's); Qwen2's is added to each row's q|k|v before RoPE.
  void set_layer(int layer, const float* attn_norm, const float* ffn_norm, const GgufMatrix& qkv,
                 const GgufMatrix& o, const GgufMatrix& gate_up, const GgufMatrix& down,
                 const float* qkv_bias = nullptr);
  // Either may be null: no head means the (tied) embedding is the head; no embedding is a
  // model that only runs forward_fused (an MTP head). rope: [max_positions, head_dim / 2].
  void set_globals(const GgufMatrix* embedding, const GgufMatrix* head, const float* final_norm,
                   const float* rope_cos, const float* rope_sin);
  // The MTP head's input: x = proj([rms_norm(hidden) * hidden_norm ; rms_norm(embeds) * embed_norm]).
  void set_fusion(const float* hidden_norm, const float* embed_norm, const GgufMatrix& proj);

  // hidden [n, hidden_size] after the final norm, for tokens packed in span order.
  void forward(const int32_t* tokens, int n, const Span* spans, int num_spans, const KvCache& cache,
               float* hidden);
  // The same, from the fused (hidden state, embedding) rows of an MTP head.
  void forward_fused(const float* hidden_in, const float* embeds, int n, const Span* spans, int num_spans,
                     const KvCache& cache, float* hidden);
  void logits(const float* hidden, int rows, float* out);  // out [rows, vocab]
  void embed(const int32_t* tokens, int n, float* out);     // dequantised embedding rows
  void head_rows(const int32_t* ids, int n, float* out);    // dequantised output-head rows

  const ModelDims& dims() const { return dims_; }
  const char* isa() const { return kernels_->name; }
  int num_threads() const { return pool_.size(); }
  size_t weight_bytes() const;
  void check_ready() const;

 private:
  struct Layer {
    std::vector<float> attn_norm, ffn_norm, qkv_bias;  // qkv_bias empty: none
    OwnedMatrix qkv, o, gate_up, down;
  };
  struct Scratch;

  void matmul(const OwnedMatrix& w, const QuantRows& a, int rows, float* out);
  // The decoder layers and final norm over n rows whose input `input(x)` writes into x [n, d].
  void run_decoder(int n, const Span* spans, int num_spans, const KvCache& cache, float* hidden,
                   const std::function<void(float*)>& input);
  void check_matrix(const GgufMatrix& m, int n, int k, const char* name) const;

  ModelDims dims_;
  const Kernels* kernels_;
  ThreadPool pool_;
  std::vector<Layer> layers_;
  OwnedMatrix embedding_, head_, fusion_;
  std::vector<float> final_norm_, rope_cos_, rope_sin_, fusion_hidden_norm_, fusion_embed_norm_;
};

}  // namespace cpu
