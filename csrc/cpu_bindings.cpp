// pybind11 module `_cpu_forward`: the quantized CPU forward's edge. Arrays must already have
// the exact dtype, shape and C layout (no silent copies); a wrong one is a ValueError naming
// the argument. Steps run with the GIL released, one at a time per model.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu/kernels.hpp"
#include "cpu/llama_forward.hpp"
#include "cpu/numerics.hpp"
#include "cpu/thread_pool.hpp"
#include "numpy_order.hpp"

namespace py = pybind11;

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// The array itself (no conversion), checked: dtype character, shape (-1 = any; every length
// fits an int, as the forward counts rows and widths in int), C-contiguous. The message is
// built only for a failed check (the dtype's name is a Python call).
template <typename T>
T* checked(py::array& a, const char* name, char dtype, std::vector<py::ssize_t> shape, bool writable = false) {
  auto fail = [name](const std::string& what) { throw std::invalid_argument(std::string(name) + ": " + what); };
  if (a.dtype().char_() != dtype && !(dtype == 'i' && a.dtype().kind() == 'i' && a.itemsize() == 4)) {
    fail(std::string("dtype must be ") +
         (dtype == 'f' ? "float32" : dtype == 'e' ? "float16" : dtype == 'i' ? "int32" : "uint8") + ", got " +
         std::string(py::str(a.dtype())));
  }
  if (a.ndim() != static_cast<py::ssize_t>(shape.size())) {
    fail("must have " + std::to_string(shape.size()) + " dimensions, got " + std::to_string(a.ndim()));
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (a.shape(i) > std::numeric_limits<int>::max())
      fail("dimension " + std::to_string(i) + " has more than 2^31 - 1 entries");
    if (shape[i] >= 0 && a.shape(i) != shape[i]) {
      fail("dimension " + std::to_string(i) + " must be " + std::to_string(shape[i]) + ", got " +
           std::to_string(a.shape(i)));
    }
  }
  if (!native_byte_order(a)) fail("must be in this machine's byte order");
  if ((a.flags() & py::array::c_style) == 0) fail("must be C-contiguous");
  if (writable && !a.writeable()) fail("must be writable");
  return static_cast<T*>(writable ? a.mutable_data() : const_cast<void*>(a.data()));
}

cpu::WeightType weight_type(int type) {
  require(type == static_cast<int>(cpu::WeightType::Q4_1) || type == static_cast<int>(cpu::WeightType::Q8_0),
          "weight type must be 3 (Q4_1) or 8 (Q8_0), got " + std::to_string(type));
  return static_cast<cpu::WeightType>(type);
}

// A GGUF matrix from a uint8 array [n, k / 32 * block bytes].
cpu::GgufMatrix gguf_matrix(py::array& rows, int type, int k, const char* name) {
  const cpu::WeightType t = weight_type(type);
  require(k > 0 && k % cpu::kBlock == 0, std::string(name) + ": k must be a positive multiple of 32");
  const auto row_bytes = static_cast<py::ssize_t>(k / cpu::kBlock * cpu::gguf_block_bytes(t));
  auto* data = checked<uint8_t>(rows, name, 'B', {-1, row_bytes});
  require(rows.shape(0) % cpu::kGroupCols == 0, std::string(name) + ": rows must be a multiple of 8");
  return cpu::GgufMatrix{t, static_cast<int>(rows.shape(0)), k, data};
}

class PyForward {
  // One call into the model at a time, with the GIL released: two Python threads stepping one
  // model at once overwrote each other's pool state and hung, and weights set during another
  // thread's step would free what the step reads.
  std::mutex mutex_;

  template <typename F>  // before its callers: they deduce its return type
  auto locked(F&& call) {
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> one_call(mutex_);
    return call();
  }

 public:
  PyForward(const cpu::ModelDims& dims, int num_threads, const std::string& isa)
      : impl_(dims, num_threads, isa.empty() ? cpu::best_isa() : isa) {}

  void set_layer(int layer, py::array attn_norm, py::array ffn_norm, py::array qkv, int qkv_type, py::array o,
                 int o_type, py::array gate_up, int gate_up_type, py::array down, int down_type,
                 std::optional<py::array> qkv_bias) {
    const auto& d = impl_.dims();
    const float* attn = checked<float>(attn_norm, "attn_norm", 'f', {d.hidden_size});
    const float* ffn = checked<float>(ffn_norm, "ffn_norm", 'f', {d.hidden_size});
    const float* bias = qkv_bias ? checked<float>(*qkv_bias, "qkv_bias", 'f',
                                                  {(d.num_heads + 2 * d.num_kv_heads) * d.head_dim})
                                 : nullptr;
    const cpu::GgufMatrix qkv_m = gguf_matrix(qkv, qkv_type, d.hidden_size, "qkv"),
                          o_m = gguf_matrix(o, o_type, d.num_heads * d.head_dim, "o"),
                          gate_up_m = gguf_matrix(gate_up, gate_up_type, d.hidden_size, "gate_up"),
                          down_m = gguf_matrix(down, down_type, d.intermediate_size, "down");
    locked([&] { impl_.set_layer(layer, attn, ffn, qkv_m, o_m, gate_up_m, down_m, bias); });
  }

  void set_globals(std::optional<py::array> embedding, int embedding_type, std::optional<py::array> head,
                   int head_type, py::array final_norm, py::array rope_cos, py::array rope_sin) {
    const auto& d = impl_.dims();
    cpu::GgufMatrix emb{}, head_matrix{};
    if (embedding) emb = gguf_matrix(*embedding, embedding_type, d.hidden_size, "embedding");
    if (head) head_matrix = gguf_matrix(*head, head_type, d.hidden_size, "head");
    const float* norm = checked<float>(final_norm, "final_norm", 'f', {d.hidden_size});
    const float* cos = checked<float>(rope_cos, "rope_cos", 'f', {d.max_positions, d.head_dim / 2});
    const float* sin = checked<float>(rope_sin, "rope_sin", 'f', {d.max_positions, d.head_dim / 2});
    locked([&] { impl_.set_globals(embedding ? &emb : nullptr, head ? &head_matrix : nullptr, norm, cos, sin); });
  }

  void set_fusion(py::array hidden_norm, py::array embed_norm, py::array proj, int proj_type) {
    const auto& d = impl_.dims();
    const float* hidden = checked<float>(hidden_norm, "hidden_norm", 'f', {d.hidden_size});
    const float* embed = checked<float>(embed_norm, "embed_norm", 'f', {d.hidden_size});
    const cpu::GgufMatrix proj_m = gguf_matrix(proj, proj_type, 2 * d.hidden_size, "proj");
    locked([&] { impl_.set_fusion(hidden, embed, proj_m); });
  }

  void forward(py::array tokens, py::array spans, py::array k_cache, py::array v_cache, py::array block_table,
               py::array hidden) {
    auto* tok = checked<int32_t>(tokens, "tokens", 'i', {-1});
    const int n = static_cast<int>(tokens.shape(0));
    const Step step = checked_step(n, spans, k_cache, v_cache, block_table, hidden);
    locked([&] { impl_.forward(tok, n, step.spans, step.num_spans, step.cache, step.out); });
  }

  void forward_fused(py::array hidden_in, py::array embeds, py::array spans, py::array k_cache, py::array v_cache,
                     py::array block_table, py::array hidden) {
    const int d = impl_.dims().hidden_size;
    auto* h = checked<float>(hidden_in, "hidden_in", 'f', {-1, d});
    const int n = static_cast<int>(hidden_in.shape(0));
    auto* e = checked<float>(embeds, "embeds", 'f', {n, d});
    const Step step = checked_step(n, spans, k_cache, v_cache, block_table, hidden);
    locked([&] { impl_.forward_fused(h, e, n, step.spans, step.num_spans, step.cache, step.out); });
  }

  void logits(py::array hidden, py::array out) {
    const auto& d = impl_.dims();
    auto* h = checked<float>(hidden, "hidden", 'f', {-1, d.hidden_size});
    const int rows = static_cast<int>(hidden.shape(0));
    auto* o = checked<float>(out, "out", 'f', {rows, d.vocab_size}, true);
    locked([&] { impl_.logits(h, rows, o); });
  }

  void embed(py::array tokens, py::array out) {
    auto* tok = checked<int32_t>(tokens, "tokens", 'i', {-1});
    const int n = static_cast<int>(tokens.shape(0));
    float* o = checked<float>(out, "out", 'f', {n, impl_.dims().hidden_size}, true);
    locked([&] { impl_.embed(tok, n, o); });
  }

  void head_rows(py::array ids, py::array out) {
    auto* p = checked<int32_t>(ids, "ids", 'i', {-1});
    const int n = static_cast<int>(ids.shape(0));
    float* o = checked<float>(out, "out", 'f', {n, impl_.dims().hidden_size}, true);
    locked([&] { impl_.head_rows(p, n, o); });
  }

  size_t weight_bytes() {
    return locked([&] { return impl_.weight_bytes(); });
  }

  cpu::LlamaForward impl_;

 private:
  struct Step {
    const cpu::Span* spans;
    int num_spans;
    cpu::KvCache cache;
    float* out;
  };

  Step checked_step(int n, py::array& spans, py::array& k_cache, py::array& v_cache, py::array& block_table,
                    py::array& hidden) {
    const auto& d = impl_.dims();
    auto* sp = checked<int32_t>(spans, "spans", 'i', {-1, 3});
    auto* k = checked<uint16_t>(k_cache, "k_cache", 'e', {d.num_layers, d.num_kv_heads, -1, cpu::kBlock, d.head_dim},
                                true);
    require(k_cache.shape(2) > 0, "k_cache: pages must be > 0");
    auto* v = checked<uint16_t>(v_cache, "v_cache", 'e',
                                {d.num_layers, d.num_kv_heads, k_cache.shape(2), cpu::kBlock, d.head_dim}, true);
    const auto k_at = reinterpret_cast<uintptr_t>(k), v_at = reinterpret_cast<uintptr_t>(v);  // one shape:
    require((k_at < v_at ? v_at - k_at : k_at - v_at) >= static_cast<uintptr_t>(k_cache.nbytes()),  // apart or overlapping
            "k_cache, v_cache: must not share memory");
    auto* table = checked<int32_t>(block_table, "block_table", 'i', {-1, -1});
    require(block_table.shape(0) > 0 && block_table.shape(1) > 0, "block_table: slots and blocks must be > 0");
    auto* out = checked<float>(hidden, "hidden", 'f', {n, d.hidden_size}, true);
    return Step{reinterpret_cast<const cpu::Span*>(sp), static_cast<int>(spans.shape(0)),
                cpu::KvCache{k, v, static_cast<int>(k_cache.shape(2)), table, static_cast<int>(block_table.shape(0)),
                             static_cast<int>(block_table.shape(1))},
                out};
  }
};

// Kernel-level entry points, for tests and the forward benchmark.
const cpu::Kernels* runnable_kernels(const std::string& isa) {
  const cpu::Kernels* kernels = cpu::kernels_by_name(isa);
  require(kernels != nullptr && cpu::cpu_supports(isa), "isa: '" + isa + "' is unknown or not supported here");
  return kernels;
}

py::tuple quantize_rows(py::array x, const std::string& isa) {
  const cpu::Kernels* kernels = runnable_kernels(isa);
  auto* p = checked<float>(x, "x", 'f', {-1, -1});
  const int rows = static_cast<int>(x.shape(0)), k = static_cast<int>(x.shape(1));
  require(k % cpu::kBlock == 0, "x: row length must be a multiple of 32");
  py::array_t<int8_t> q({rows, k});
  py::array_t<float> d({rows, k / cpu::kBlock}), s({rows, k / cpu::kBlock});
  py::array_t<int32_t> sum({rows, k / cpu::kBlock});
  for (int r = 0; r < rows; ++r)
    kernels->quantize_row(p + static_cast<size_t>(r) * k, k, q.mutable_data(r), d.mutable_data(r), s.mutable_data(r),
                          sum.mutable_data(r));
  return py::make_tuple(q, d, s, sum);
}

// x [rows, k] float32 against GGUF rows [n, ...] -> [rows, n], with `num_threads` threads.
py::array_t<float> linear(py::array rows, int type, py::array x, const std::string& isa, int num_threads) {
  auto* xp = checked<float>(x, "x", 'f', {-1, -1});
  const int m = static_cast<int>(x.shape(0)), k = static_cast<int>(x.shape(1));
  const cpu::GgufMatrix g = gguf_matrix(rows, type, k, "weights");
  const cpu::Kernels* kernels = runnable_kernels(isa);
  const cpu::OwnedMatrix w(g);
  std::vector<int8_t> q(static_cast<size_t>(m) * k);
  const size_t nb = k / cpu::kBlock;
  std::vector<float> d(m * nb), s(d.size());
  std::vector<int32_t> sum(d.size());
  for (int r = 0; r < m; ++r)
    kernels->quantize_row(xp + static_cast<size_t>(r) * k, k, &q[static_cast<size_t>(r) * k], &d[r * nb], &s[r * nb],
                      &sum[r * nb]);
  py::array_t<float> out({m, g.n});
  float* o = out.mutable_data();
  const cpu::QuantRows a{q.data(), d.data(), s.data(), sum.data(), k};
  cpu::ThreadPool pool(num_threads);
  py::gil_scoped_release release;
  pool.parallel_for(g.n / cpu::kGroupCols, [&](int g0, int g1, int) {
    kernels->matmul(w.view(), a, m, g0, g1, o, static_cast<size_t>(g.n));
  });
  return out;
}

// q [rows, group, hd] float32 (already scaled); k, v [n_pos, hd] float16 in position order;
// row r attends positions [0, first_n_pos + r). -> [rows, group, hd]. The positions go into
// pages as the forward's cache holds them, the blocks in reverse page order, so that every
// kernel test also reads through the page table.
py::array_t<float> attend(py::array q, py::array k, py::array v, int first_n_pos, const std::string& isa) {
  auto* qp = checked<float>(q, "q", 'f', {-1, -1, -1});
  const int rows = static_cast<int>(q.shape(0)), group = static_cast<int>(q.shape(1)), hd = static_cast<int>(q.shape(2));
  require(rows >= 1 && rows <= cpu::kAttendRows, "q: rows must be in [1, " + std::to_string(cpu::kAttendRows) + "]");
  require(hd > 0 && hd % cpu::kLanes == 0, "q: head_dim must be a multiple of 8");
  auto* kp = checked<uint16_t>(k, "k", 'e', {-1, hd});
  const int n_pos = static_cast<int>(k.shape(0));
  require(first_n_pos >= 1 && int64_t{first_n_pos} + rows - 1 <= n_pos,
          "first_n_pos: rows must attend within the given positions");
  auto* vp = checked<uint16_t>(v, "v", 'e', {n_pos, hd});
  const cpu::Kernels* kernels = runnable_kernels(isa);
  const int blocks = (n_pos + cpu::kBlock - 1) / cpu::kBlock;
  const size_t page = static_cast<size_t>(cpu::kBlock) * hd;
  std::vector<uint16_t> k_pages(blocks * page), v_pages(k_pages.size());
  std::vector<int32_t> pages(blocks);
  for (int b = 0; b < blocks; ++b) pages[b] = blocks - 1 - b;
  for (int p = 0; p < n_pos; ++p)
    for (int d = 0; d < hd; ++d) {
      const size_t base = pages[p / cpu::kBlock] * page, at = static_cast<size_t>(p) * hd + d;
      k_pages[base + static_cast<size_t>(d) * cpu::kBlock + p % cpu::kBlock] = kp[at];
      v_pages[base + static_cast<size_t>(p % cpu::kBlock) * hd + d] = vp[at];
    }
  std::vector<float> scratch(cpu::attend_scratch_floats(group, hd));
  py::array_t<float> out({rows, group, hd});
  cpu::attend(*kernels, qp, static_cast<size_t>(group) * hd, rows, first_n_pos, group, hd,
              cpu::KvPages{k_pages.data(), v_pages.data(), pages.data(), page}, out.mutable_data(),
              static_cast<size_t>(group) * hd, scratch.data());
  return out;
}

py::array_t<float> silu_mul(py::array g, py::array u, const std::string& isa) {
  auto* gp = checked<float>(g, "g", 'f', {-1});
  const int n = static_cast<int>(g.shape(0));
  auto* up = checked<float>(u, "u", 'f', {n});
  const cpu::Kernels* kernels = runnable_kernels(isa);
  py::array_t<float> out(n);
  kernels->silu_mul(gp, up, out.mutable_data(), n);
  return out;
}

py::array_t<uint16_t> to_half(py::array x, const std::string& isa) {
  auto* xp = checked<float>(x, "x", 'f', {-1});
  const int n = static_cast<int>(x.shape(0));
  const cpu::Kernels* kernels = runnable_kernels(isa);
  py::array_t<uint16_t> out(n);
  kernels->to_half(xp, n, out.mutable_data(), 1);
  return out;
}

// For the pool's test: a loop of n items, one chunk each, on a pool of num_threads, whose
// first items wait until every thread holds one, and out of which every item that thread
// `throwing` runs throws. -> (what parallel_for rethrew, "" for nothing; the sum of 0..n-1
// from a clean loop on the same pool after it).
py::tuple pool_check(int num_threads, int n, int throwing) {
  require(n >= num_threads, "n: at least one item per thread");
  cpu::ThreadPool pool(num_threads);
  std::string error;
  std::atomic<int64_t> sum{0};
  {
    py::gil_scoped_release release;
    std::atomic<int> holding{0};
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    try {
      pool.parallel_for(n, [&](int begin, int, int thread) {
        if (begin < num_threads && ++holding < num_threads)
          while (holding < num_threads && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
        if (thread == throwing) throw std::runtime_error("thread " + std::to_string(thread) + " failed");
      }, n);
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
    pool.parallel_for(n, [&](int begin, int end, int) {
      for (int i = begin; i < end; ++i) sum += i;
    });
  }
  return py::make_tuple(error, sum.load());
}

}  // namespace

PYBIND11_MODULE(_cpu_forward, m) {
  m.doc() = "Quantized, row-invariant Llama forward for CPU (GGUF Q4_1 / Q8_0 weights)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  py::class_<cpu::ModelDims>(m, "ModelDims")
      .def(py::init([](int vocab_size, int hidden_size, int intermediate_size, int num_layers, int num_heads,
                       int num_kv_heads, int head_dim, int max_positions, float rms_norm_eps) {
             return cpu::ModelDims{vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
                                   num_kv_heads, head_dim, max_positions, rms_norm_eps};
           }),
           py::kw_only(), py::arg("vocab_size"), py::arg("hidden_size"), py::arg("intermediate_size"),
           py::arg("num_layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("max_positions"), py::arg("rms_norm_eps"));
  py::class_<PyForward>(m, "LlamaForward")
      .def(py::init<const cpu::ModelDims&, int, const std::string&>(), py::arg("dims"), py::arg("num_threads"),
           py::arg("isa") = "", "isa '' picks the best path this CPU runs (SPECSERVE_CPU_ISA overrides)")
      .def("set_layer", &PyForward::set_layer, py::arg("layer"), py::arg("attn_norm"), py::arg("ffn_norm"),
           py::arg("qkv"), py::arg("qkv_type"), py::arg("o"), py::arg("o_type"), py::arg("gate_up"),
           py::arg("gate_up_type"), py::arg("down"), py::arg("down_type"), py::arg("qkv_bias") = py::none(),
           "a layer's norms and GGUF-block matrices; qkv_bias [q + 2 kv] float32 or None")
      .def("set_globals", &PyForward::set_globals)
      .def("set_fusion", &PyForward::set_fusion)
      .def("forward_fused", &PyForward::forward_fused, py::arg("hidden_in"), py::arg("embeds"), py::arg("spans"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("hidden"),
           "an MTP head's step: hidden_in, embeds [N, d] float32 -> hidden [N, d] after its output norm")
      .def("forward", &PyForward::forward, py::arg("tokens"), py::arg("spans"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("block_table"), py::arg("hidden"),
           "tokens [N] int32, spans [S, 3] int32 (slot, start, length); writes hidden [N, d] float32")
      .def("logits", &PyForward::logits, py::arg("hidden"), py::arg("out"))
      .def("embed", &PyForward::embed, py::arg("tokens"), py::arg("out"))
      .def("head_rows", &PyForward::head_rows, py::arg("ids"), py::arg("out"))
      .def_property_readonly("isa", [](const PyForward& f) { return std::string(f.impl_.isa()); })
      .def_property_readonly("num_threads", [](const PyForward& f) { return f.impl_.num_threads(); })
      .def_property_readonly("weight_bytes", &PyForward::weight_bytes);
  m.def("best_isa", &cpu::best_isa);
  m.def("cpu_supports", &cpu::cpu_supports, py::arg("isa"));
  m.def("quantize_rows", &quantize_rows, py::arg("x"), py::arg("isa"));
  m.def("linear", &linear, py::arg("weights"), py::arg("type"), py::arg("x"), py::arg("isa"), py::arg("num_threads") = 1);
  m.def("attend", &attend, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("first_n_pos"), py::arg("isa"));
  m.def("silu_mul", &silu_mul, py::arg("g"), py::arg("u"), py::arg("isa"));
  m.def("pool_check", &pool_check, py::arg("num_threads"), py::arg("n"), py::arg("throwing"));
  m.def("to_half", &to_half, py::arg("x"), py::arg("isa"), "fp16 bits of x, as the KV cache stores them");
}
