#include "llama_forward.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "attention_plan.hpp"
#include "numerics.hpp"

namespace cpu {
namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// Llama's rotate-half RoPE on one head: pairs are (i, i + hd/2).
void rope(float* x, int hd, const float* cos, const float* sin) {
  const int half = hd / 2;
  for (int i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i] + a * sin[i];
  }
}

}  // namespace

// ---- weights -------------------------------------------------------------------------------

LlamaForward::LlamaForward(const ModelDims& dims, int num_threads, const std::string& isa)
    : dims_(dims), kernels_(kernels_by_name(isa)), pool_(num_threads) {
  require(kernels_ != nullptr, "isa: unknown kernel path '" + isa + "' (scalar, avx2, avx512)");
  require(cpu_supports(isa), "isa: this CPU cannot run the '" + isa + "' kernels");
  const ModelDims& d = dims;
  require(d.vocab_size > 0 && d.num_layers > 0 && d.num_heads > 0 && d.num_kv_heads > 0 && d.max_positions > 0,
          "dims: sizes must be positive");
  require(d.hidden_size % kBlock == 0 && d.intermediate_size % kBlock == 0 && d.hidden_size > 0 &&
              d.intermediate_size > 0,
          "dims: hidden_size and intermediate_size must be multiples of 32");
  require(d.head_dim > 0 && d.head_dim % kLanes == 0, "dims: head_dim must be a multiple of 8");
  require(d.num_heads % d.num_kv_heads == 0, "dims: num_heads must be a multiple of num_kv_heads");
  require(d.num_layers <= kMaxLayers, "dims: num_layers must be at most " + std::to_string(kMaxLayers));
  // The step indexes its buffers with int: every width it computes must fit one (an int
  // product could wrap to a small width and the step write past its buffers).
  const int64_t q = int64_t{d.num_heads} * d.head_dim, kv = int64_t{d.num_kv_heads} * d.head_dim;
  const std::pair<const char*, int64_t> widths[] = {
      {"(num_heads + 2 * num_kv_heads) * head_dim", q + 2 * kv},
      {"2 * hidden_size", 2 * int64_t{d.hidden_size}},
      {"2 * intermediate_size", 2 * int64_t{d.intermediate_size}},
      {"max_positions * head_dim", int64_t{d.max_positions} * d.head_dim}};
  for (const auto& [name, width] : widths)
    require(width <= std::numeric_limits<int32_t>::max(), std::string("dims: ") + name + " is over 2^31 - 1");
  require(q % kBlock == 0, "dims: num_heads * head_dim must be a multiple of 32");
  require(d.vocab_size % kGroupCols == 0 && d.hidden_size % kGroupCols == 0,
          "dims: vocab_size and hidden_size must be multiples of 8");
  require(d.rms_norm_eps > 0, "dims: rms_norm_eps must be > 0");
  layers_.resize(d.num_layers);
}

void LlamaForward::check_matrix(const GgufMatrix& m, int n, int k, const char* name) const {
  require(m.type == WeightType::Q4_1 || m.type == WeightType::Q8_0,
          std::string(name) + ": weight type must be Q4_1 or Q8_0");
  require(m.n == n && m.k == k, std::string(name) + ": shape [" + std::to_string(m.n) + ", " +
                                    std::to_string(m.k) + "], expected [" + std::to_string(n) + ", " +
                                    std::to_string(k) + "]");
}

void LlamaForward::set_layer(int layer, const float* attn_norm, const float* ffn_norm, const GgufMatrix& qkv,
                             const GgufMatrix& o, const GgufMatrix& gate_up, const GgufMatrix& down,
                             const float* qkv_bias) {
  require(0 <= layer && layer < dims_.num_layers, "layer " + std::to_string(layer) + " out of range");
  const int d = dims_.hidden_size, q = dims_.num_heads * dims_.head_dim, kv = dims_.num_kv_heads * dims_.head_dim;
  check_matrix(qkv, q + 2 * kv, d, "qkv");
  check_matrix(o, d, q, "o");
  check_matrix(gate_up, 2 * dims_.intermediate_size, d, "gate_up");
  check_matrix(down, d, dims_.intermediate_size, "down");
  Layer& l = layers_[layer];
  l.attn_norm.assign(attn_norm, attn_norm + d);
  l.ffn_norm.assign(ffn_norm, ffn_norm + d);
  if (qkv_bias != nullptr) {
    l.qkv_bias.assign(qkv_bias, qkv_bias + q + 2 * kv);
  } else {
    l.qkv_bias.clear();
  }
  l.qkv = OwnedMatrix(qkv);
  l.o = OwnedMatrix(o);
  l.gate_up = OwnedMatrix(gate_up);
  l.down = OwnedMatrix(down);
}

void LlamaForward::set_globals(const GgufMatrix* embedding, const GgufMatrix* head, const float* final_norm,
                               const float* rope_cos, const float* rope_sin) {
  require(embedding != nullptr || head != nullptr, "set_globals: an embedding, a head or both");
  if (embedding != nullptr) check_matrix(*embedding, dims_.vocab_size, dims_.hidden_size, "embedding");
  if (head != nullptr) check_matrix(*head, dims_.vocab_size, dims_.hidden_size, "head");
  embedding_ = embedding != nullptr ? OwnedMatrix(*embedding) : OwnedMatrix();
  head_ = head != nullptr ? OwnedMatrix(*head) : OwnedMatrix();
  final_norm_.assign(final_norm, final_norm + dims_.hidden_size);
  const size_t table = static_cast<size_t>(dims_.max_positions) * (dims_.head_dim / 2);
  rope_cos_.assign(rope_cos, rope_cos + table);
  rope_sin_.assign(rope_sin, rope_sin + table);
}

void LlamaForward::check_ready() const {
  require(!embedding_.empty() || !head_.empty(), "model: set_globals was not called");
  for (int i = 0; i < dims_.num_layers; ++i)
    require(!layers_[i].qkv.empty(), "model: layer " + std::to_string(i) + " was not set");
}

void LlamaForward::set_fusion(const float* hidden_norm, const float* embed_norm, const GgufMatrix& proj) {
  const int d = dims_.hidden_size;
  check_matrix(proj, d, 2 * d, "proj");
  fusion_hidden_norm_.assign(hidden_norm, hidden_norm + d);
  fusion_embed_norm_.assign(embed_norm, embed_norm + d);
  fusion_ = OwnedMatrix(proj);
}

size_t LlamaForward::weight_bytes() const {
  size_t total = embedding_.num_bytes() + head_.num_bytes() + fusion_.num_bytes();
  for (const Layer& l : layers_) total += l.qkv.num_bytes() + l.o.num_bytes() + l.gate_up.num_bytes() + l.down.num_bytes();
  return total;
}

// ---- the step ------------------------------------------------------------------------------

struct LlamaForward::Scratch {
  std::vector<int8_t> q;
  std::vector<float> qd, qs;
  std::vector<int32_t> qsum;
  Scratch(int rows, int k_max)
      : q(static_cast<size_t>(rows) * k_max), qd(static_cast<size_t>(rows) * k_max / kBlock), qs(qd.size()),
        qsum(qd.size()) {}
  // The quantised activations of width k (rows strided by k inside the buffers).
  QuantRows rows(int k) const { return QuantRows{q.data(), qd.data(), qs.data(), qsum.data(), k}; }
  // Values [first, first + count) of row `row` (x: the row's start; first and count whole blocks).
  void quantize(const Kernels& kernels, const float* x, int row, int k, int first = 0, int count = -1) {
    if (count < 0) count = k - first;
    const size_t value = static_cast<size_t>(row) * k + first, block = value / kBlock;
    kernels.quantize_row(x + first, count, q.data() + value, qd.data() + block, qs.data() + block,
                         qsum.data() + block);
  }
};

void LlamaForward::matmul(const OwnedMatrix& w, const QuantRows& a, int rows, float* out) {
  const PackedMatrix& m = w.view();
  const int groups = m.n / kGroupCols;
  // Threads take whole pairs of column groups: the wide kernels read a pair's blocks as one.
  pool_.parallel_for((groups + 1) / 2, [&](int p0, int p1, int) {
    kernels_->matmul(m, a, rows, 2 * p0, std::min(2 * p1, groups), out, static_cast<size_t>(m.n));
  });
}

void LlamaForward::forward(const int32_t* tokens, int n, const Span* spans, int num_spans, const KvCache& cache,
                           float* hidden) {
  require(!embedding_.empty(), "model: no embedding (set_globals)");
  for (int i = 0; i < n; ++i)
    require(0 <= tokens[i] && tokens[i] < dims_.vocab_size, "tokens: id " + std::to_string(tokens[i]) + " out of range");
  run_decoder(n, spans, num_spans, cache, hidden, [&](float* x) {
    pool_.parallel_for(n, [&](int r0, int r1, int) {
      for (int r = r0; r < r1; ++r)
        embedding_.dequantize_row(tokens[r], x + static_cast<size_t>(r) * dims_.hidden_size);
    });
  });
}

void LlamaForward::forward_fused(const float* hidden_in, const float* embeds, int n, const Span* spans, int num_spans,
                                 const KvCache& cache, float* hidden) {
  require(!fusion_.empty(), "model: no input fusion (set_fusion)");
  const int d = dims_.hidden_size;
  run_decoder(n, spans, num_spans, cache, hidden, [&](float* x) {
    Scratch quant(n, 2 * d);
    std::vector<float> both(static_cast<size_t>(n) * 2 * d);
    pool_.parallel_for(n, [&](int r0, int r1, int) {
      for (int r = r0; r < r1; ++r) {
        float* row = both.data() + static_cast<size_t>(r) * 2 * d;
        kernels_->rms_norm(hidden_in + static_cast<size_t>(r) * d, fusion_hidden_norm_.data(), d, dims_.rms_norm_eps, row);
        kernels_->rms_norm(embeds + static_cast<size_t>(r) * d, fusion_embed_norm_.data(), d, dims_.rms_norm_eps, row + d);
        quant.quantize(*kernels_, row, r, 2 * d);
      }
    });
    matmul(fusion_, quant.rows(2 * d), n, x);
  });
}

void LlamaForward::run_decoder(int n, const Span* spans, int num_spans, const KvCache& cache, float* hidden,
                               const std::function<void(float*)>& input) {
  check_ready();
  const CanonicalFloatEnv canonical;
  const ModelDims& dm = dims_;
  const int d = dm.hidden_size, hd = dm.head_dim, heads = dm.num_heads, kvh = dm.num_kv_heads;
  const int group = heads / kvh, q_size = heads * hd, kv_size = kvh * hd, qkv_n = q_size + 2 * kv_size;
  const int inter = dm.intermediate_size, half = hd / 2;
  require(n > 0, "tokens: at least one token");
  require(num_spans > 0, "spans: at least one span");
  const int64_t max_seq_len = int64_t{cache.blocks_per_slot} * kBlock;
  // Row r of the step: its slot and position.
  std::vector<int32_t> row_slot(n), row_pos(n), written;
  int row = 0;
  for (int i = 0; i < num_spans; ++i) {
    const Span& s = spans[i];
    require(0 <= s.slot && s.slot < cache.num_slots, "spans: slot " + std::to_string(s.slot) + " out of range");
    require(s.length > 0 && s.start >= 0, "spans: length must be > 0 and start >= 0");
    const int64_t end = int64_t{s.start} + s.length;  // int64: an int sum could wrap past both checks
    require(end <= max_seq_len && end <= dm.max_positions, "spans: positions past the cache or the model's max positions");
    require(s.length <= n - row, "spans: cover more tokens than given");
    const int32_t* table = cache.block_table + static_cast<size_t>(s.slot) * cache.blocks_per_slot;
    for (int b = 0; b <= (s.start + s.length - 1) / kBlock; ++b) {
      if (table[b] < 0 || table[b] >= cache.num_pages)  // the message only when it fails: up to 128 blocks a span
        require(false, "block_table: slot " + std::to_string(s.slot) + " block " + std::to_string(b) + " names no page");
      if (b >= s.start / kBlock) written.push_back(table[b]);
    }
    for (int t = 0; t < s.length; ++t, ++row) {
      row_slot[row] = s.slot;
      row_pos[row] = s.start + t;
    }
  }
  std::sort(written.begin(), written.end());
  require(std::adjacent_find(written.begin(), written.end()) == written.end(),
          "block_table: two spans of the step write one page");
  require(row == n, "spans: cover fewer tokens than given");
  const AttentionPlan plan = plan_attention(spans, num_spans, n, kvh, group, hd, pool_.size());
  const std::vector<RowTile>& tiles = plan.tiles;
  const int sf = state_floats(hd);
  std::vector<float> chunk_states(plan.chunk_state_floats);

  std::vector<float> x(static_cast<size_t>(n) * d), y(x.size()), h(x.size());
  std::vector<float> qkv(static_cast<size_t>(n) * qkv_n), attn(static_cast<size_t>(n) * q_size);
  std::vector<float> gate_up(static_cast<size_t>(n) * 2 * inter), act(static_cast<size_t>(n) * inter);
  Scratch quant(n, std::max({d, q_size, inter}));
  const size_t attend_floats = attend_scratch_floats(group, hd);
  std::vector<float> attend_scratch(attend_floats * pool_.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // A (KV head, page) holds 32 positions; a head's pages are side by side, so a slot whose
  // pages run in order reads each head's K and V as one stream, as from a contiguous cache.
  const size_t page_stride = static_cast<size_t>(kBlock) * hd, head_stride = page_stride * cache.num_pages;
  const size_t layer_stride = head_stride * kvh;
  auto pages_of = [&](int slot) { return cache.block_table + static_cast<size_t>(slot) * cache.blocks_per_slot; };
  // Where a (slot, position, KV head)'s block starts inside a layer's cache.
  auto block_base = [&](int slot, int pos, int head) {
    return head * head_stride + static_cast<size_t>(pages_of(slot)[pos / kBlock]) * page_stride;
  };
  auto kv_pages = [&](const uint16_t* k_layer, const uint16_t* v_layer, int slot, int head) {
    return KvPages{k_layer + head * head_stride, v_layer + head * head_stride, pages_of(slot), page_stride};
  };

  // Each attention task quantises the output it wrote where a KV head's query heads fill whole
  // blocks of 32 (every model with head_dim a multiple of 32).
  const bool quantize_heads = (group * hd) % kBlock == 0;
  constexpr int kKDims = 16;
  const int k_dim_parts = (hd + kKDims - 1) / kKDims;
  auto add_residual = [&](int r) {  // x += y for row r
    float* xr = x.data() + static_cast<size_t>(r) * d;
    const float* yr = y.data() + static_cast<size_t>(r) * d;
    for (int i = 0; i < d; ++i) xr[i] = xr[i] + yr[i];
  };
  input(x.data());
  for (int li = 0; li < dm.num_layers; ++li) {
    const Layer& layer = layers_[li];
    uint16_t* k_layer = cache.k + li * layer_stride;
    uint16_t* v_layer = cache.v + li * layer_stride;
    pool_.parallel_for(n, [&](int r0, int r1, int) {
      for (int r = r0; r < r1; ++r) {
        if (li > 0) add_residual(r);  // the layer before's MLP output
        float* hr = h.data() + static_cast<size_t>(r) * d;
        kernels_->rms_norm(x.data() + static_cast<size_t>(r) * d, layer.attn_norm.data(), d, dm.rms_norm_eps, hr);
        quant.quantize(*kernels_, hr, r, d);
      }
    });
    matmul(layer.qkv, quant.rows(d), n, qkv.data());
    // Bias (Qwen2's), RoPE, q scaled, then this step's K/V written to the cache before any row attends.
    pool_.parallel_for(n, [&](int r0, int r1, int) {
      for (int r = r0; r < r1; ++r) {
        float* qr = qkv.data() + static_cast<size_t>(r) * qkv_n;
        if (!layer.qkv_bias.empty())
          for (int i = 0; i < qkv_n; ++i) qr[i] += layer.qkv_bias[i];
        const size_t table = static_cast<size_t>(row_pos[r]) * half;
        for (int head = 0; head < heads + kvh; ++head) rope(qr + head * hd, hd, &rope_cos_[table], &rope_sin_[table]);
        for (int i = 0; i < q_size; ++i) qr[i] = qr[i] * scale;
        for (int head = 0; head < kvh; ++head)
          kernels_->to_half(qr + q_size + kv_size + head * hd, hd,
                            v_layer + block_base(row_slot[r], row_pos[r], head) + (row_pos[r] % kBlock) * hd, 1);
      }
    });
    // K^T by (KV head, 16 dims) rather than by row: the rows of a span share each K^T line (one
    // dim of 32 positions), and threads writing one line pass it back and forth (8 rows at
    // 1,024 tokens on a Xeon: the K/V writes 0.8 -> 0.25 ms a step, with the conversion above).
    // One row's few values are written here, without a loop's hand-over to the pool.
    auto write_k = [&](int i0, int i1, int) {
      for (int i = i0; i < i1; ++i) {
        const int head = i / k_dim_parts, d0 = (i % k_dim_parts) * kKDims;
        for (int r = 0; r < n; ++r) {
          const int pos = row_pos[r];
          kernels_->to_half(qkv.data() + static_cast<size_t>(r) * qkv_n + q_size + head * hd + d0,
                            std::min(kKDims, hd - d0),
                            k_layer + block_base(row_slot[r], pos, head) + d0 * kBlock + pos % kBlock,
                            kBlock);
        }
      }
    };
    if (n == 1) {
      write_k(0, kvh * k_dim_parts, 0);
    } else {
      pool_.parallel_for(kvh * k_dim_parts, write_k);
    }
    if (plan.split_chunks) {
      pool_.parallel_for(static_cast<int>(plan.chunk_tasks.size()), [&](int i0, int i1, int thread) {
        float* scratch = attend_scratch.data() + thread * attend_floats;
        for (int i = i0; i < i1; ++i) {
          const ChunkTask& c = plan.chunk_tasks[i];
          const RowTile& t = tiles[c.tile];
          kernels_->attend_chunk(qkv.data() + static_cast<size_t>(t.first_row) * qkv_n + c.head * group * hd, qkv_n,
                                 t.rows, t.first_pos + 1, group, hd, kv_pages(k_layer, v_layer, t.slot, c.head),
                                 c.chunk, chunk_states.data() + c.states, scratch);
        }
      });
      pool_.parallel_for(n, [&](int r0, int r1, int) {  // each row's chunks merged in position order
        std::vector<float*> totals(heads);
        std::vector<const float*> parts(heads);
        for (int r = r0; r < r1; ++r) {
          const int chunks = row_pos[r] / kChunk + 1;
          auto state = [&](int head, int c) { return chunk_states.data() + plan.chunk_state(r, head, c, group, sf); };
          for (int head = 0; head < heads; ++head) totals[head] = state(head, 0);
          for (int c = 1; c < chunks; ++c) {  // every head's chunk c at once
            for (int head = 0; head < heads; ++head) parts[head] = state(head, c);
            kernels_->merge_states(totals.data(), parts.data(), heads, hd);
          }
          float* ar = attn.data() + static_cast<size_t>(r) * q_size;
          for (int head = 0; head < heads; ++head) finish_state(totals[head], hd, ar + head * hd);
          quant.quantize(*kernels_, ar, r, q_size);
        }
      });
    } else {
      const int tasks = static_cast<int>(tiles.size()) * kvh;
      pool_.parallel_for(tasks, [&](int i0, int i1, int thread) {
        float* scratch = attend_scratch.data() + thread * attend_floats;
        for (int i = i0; i < i1; ++i) {
          const RowTile& t = tiles[i / kvh];
          const int head = i % kvh;
          attend(*kernels_, qkv.data() + static_cast<size_t>(t.first_row) * qkv_n + head * group * hd, qkv_n, t.rows,
                 t.first_pos + 1, group, hd, kv_pages(k_layer, v_layer, t.slot, head),
                 attn.data() + static_cast<size_t>(t.first_row) * q_size + head * group * hd, q_size, scratch);
          if (quantize_heads)  // the task's heads of its rows: whole blocks of each row
            for (int r = t.first_row; r < t.first_row + t.rows; ++r)
              quant.quantize(*kernels_, attn.data() + static_cast<size_t>(r) * q_size, r, q_size, head * group * hd,
                             group * hd);
        }
      }, tasks);  // a task at a time: a verify's 6 tasks go 3 and 3 on 2 threads
      if (!quantize_heads)
        pool_.parallel_for(n, [&](int r0, int r1, int) {
          for (int r = r0; r < r1; ++r)
            quant.quantize(*kernels_, attn.data() + static_cast<size_t>(r) * q_size, r, q_size);
        });
    }
    matmul(layer.o, quant.rows(q_size), n, y.data());
    pool_.parallel_for(n, [&](int r0, int r1, int) {
      for (int r = r0; r < r1; ++r) {
        add_residual(r);
        float* hr = h.data() + static_cast<size_t>(r) * d;
        kernels_->rms_norm(x.data() + static_cast<size_t>(r) * d, layer.ffn_norm.data(), d, dm.rms_norm_eps, hr);
        quant.quantize(*kernels_, hr, r, d);
      }
    });
    matmul(layer.gate_up, quant.rows(d), n, gate_up.data());
    pool_.parallel_for(n, [&](int r0, int r1, int) {
      for (int r = r0; r < r1; ++r) {
        const float* gr = gate_up.data() + static_cast<size_t>(r) * 2 * inter;
        float* ar = act.data() + static_cast<size_t>(r) * inter;
        kernels_->silu_mul(gr, gr + inter, ar, inter);
        quant.quantize(*kernels_, ar, r, inter);
      }
    });
    matmul(layer.down, quant.rows(inter), n, y.data());  // added to x by the next loop over rows
  }
  pool_.parallel_for(n, [&](int r0, int r1, int) {
    for (int r = r0; r < r1; ++r) {
      add_residual(r);
      kernels_->rms_norm(x.data() + static_cast<size_t>(r) * d, final_norm_.data(), d, dm.rms_norm_eps,
                         hidden + static_cast<size_t>(r) * d);
    }
  });
  pool_.park();
}

void LlamaForward::logits(const float* hidden, int rows, float* out) {
  check_ready();
  const CanonicalFloatEnv canonical;
  const int d = dims_.hidden_size;
  Scratch quant(rows, d);
  pool_.parallel_for(rows, [&](int r0, int r1, int) {
    for (int r = r0; r < r1; ++r) quant.quantize(*kernels_, hidden + static_cast<size_t>(r) * d, r, d);
  });
  matmul(head_.empty() ? embedding_ : head_, quant.rows(d), rows, out);
  pool_.park();
}

void LlamaForward::embed(const int32_t* tokens, int n, float* out) {
  const CanonicalFloatEnv canonical;
  require(!embedding_.empty(), "model: no embedding (set_globals)");
  for (int i = 0; i < n; ++i) {
    require(0 <= tokens[i] && tokens[i] < dims_.vocab_size, "tokens: id " + std::to_string(tokens[i]) + " out of range");
    embedding_.dequantize_row(tokens[i], out + static_cast<size_t>(i) * dims_.hidden_size);
  }
}

void LlamaForward::head_rows(const int32_t* ids, int n, float* out) {
  const CanonicalFloatEnv canonical;
  check_ready();
  const OwnedMatrix& head = head_.empty() ? embedding_ : head_;
  for (int i = 0; i < n; ++i) {
    require(0 <= ids[i] && ids[i] < dims_.vocab_size, "ids: " + std::to_string(ids[i]) + " out of range");
    head.dequantize_row(ids[i], out + static_cast<size_t>(i) * dims_.hidden_size);
  }
}

}  // namespace cpu
