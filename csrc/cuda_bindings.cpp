// pybind11 module `_cuda_forward`: the CUDA torch forward's native kernels (built only with
// nvcc). Device pointers and the stream arrive as integers; a bad shape or a null pointer
// is a ValueError naming it. Kernels are launched on the given stream and never waited for.
#include <pybind11/pybind11.h>

#include "cuda/attention.hpp"

namespace py = pybind11;

namespace {

cuda_forward::CacheRows cache_rows(uintptr_t k_cache, uintptr_t v_cache, uintptr_t row_slot, uintptr_t row_pos,
                                   int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t slots,
                                   int64_t max_seq_len, uintptr_t stream) {
  return {k_cache, v_cache, row_slot, row_pos, rows, kv_heads, head_dim, slots, max_seq_len, stream};
}

}  // namespace

PYBIND11_MODULE(_cuda_forward, m) {
  m.doc() = "Row-invariant CUDA kernels for the torch forward on a GPU.";
  m.def(
      "attention",
      [](uintptr_t q, int64_t q_row_stride, uintptr_t k_cache, uintptr_t v_cache, uintptr_t out,
         uintptr_t row_slot, uintptr_t row_pos, int64_t rows, int64_t heads, int64_t kv_heads,
         int64_t head_dim, int64_t slots, int64_t max_seq_len, float scale, uintptr_t stream) {
        cuda_forward::attention_rows(
            {cache_rows(k_cache, v_cache, row_slot, row_pos, rows, kv_heads, head_dim, slots, max_seq_len, stream), q,
             q_row_stride, out, heads, scale});
      },
      py::arg("q"), py::arg("q_row_stride"), py::arg("k_cache"), py::arg("v_cache"), py::arg("out"),
      py::arg("row_slot"), py::arg("row_pos"), py::arg("rows"), py::arg("heads"), py::arg("kv_heads"),
      py::arg("head_dim"), py::arg("slots"), py::arg("max_seq_len"), py::arg("scale"), py::arg("stream"),
      R"doc(
Causal attention of each query row over its own cache slot, positions [0, row_pos[r]].

q: float32 [rows, heads, head_dim] (row stride q_row_stride elements); k_cache, v_cache:
float32 [slots, kv_heads, max_seq_len, head_dim] contiguous (one layer); out: float32
[rows, heads * head_dim]; row_slot, row_pos: int32 [rows], row_pos < 0 for a padding row
(zeros out). All pointers are device pointers. One kernel on `stream`, no synchronisation.)doc");
  m.def(
      "write_kv",
      [](uintptr_t k, int64_t k_row_stride, uintptr_t v, int64_t v_row_stride, uintptr_t k_cache, uintptr_t v_cache,
         uintptr_t row_slot, uintptr_t row_pos, int64_t rows, int64_t kv_heads, int64_t head_dim, int64_t slots,
         int64_t max_seq_len, uintptr_t stream) {
        cuda_forward::write_kv(
            {cache_rows(k_cache, v_cache, row_slot, row_pos, rows, kv_heads, head_dim, slots, max_seq_len, stream), k,
             v, k_row_stride, v_row_stride});
      },
      py::arg("k"), py::arg("k_row_stride"), py::arg("v"), py::arg("v_row_stride"), py::arg("k_cache"),
      py::arg("v_cache"), py::arg("row_slot"), py::arg("row_pos"), py::arg("rows"), py::arg("kv_heads"),
      py::arg("head_dim"), py::arg("slots"), py::arg("max_seq_len"), py::arg("stream"), R"doc(
Row r's k and v (float32 [kv_heads * head_dim], row strides in elements) into one layer's
cache at (row_slot[r], :, row_pos[r], :); rows with row_pos < 0 are skipped. Device
pointers; one kernel on `stream`, no synchronisation.)doc");
}
