// pybind11 module `_sa_native`: the edge where Python input is checked and typed.
//
// Arrays must already have the exact dtype and layout (no silent conversion copies on the
// hot path); outputs are fresh int32 numpy arrays. Batch work runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "numpy_order.hpp"
#include "sa_errors.hpp"
#include "sa_host_automaton.hpp"
#include "sa_pool.hpp"
#include "suffix_automaton.hpp"

#ifdef SA_WITH_CUDA
#include "sa_device_pool.hpp"
#endif

namespace py = pybind11;

namespace {

// Token ids from any 1-D integer sequence or array, range-checked into int32.
std::vector<int32_t> to_tokens(py::handle obj) {
  py::array arr = py::array::ensure(obj);
  if (!arr) throw std::invalid_argument("tokens must be a 1-D sequence of integers");
  if (arr.ndim() != 1) {
    throw std::invalid_argument("tokens must be 1-D, got " + std::to_string(arr.ndim()) +
                                " dimensions");
  }
  std::vector<int32_t> out(static_cast<size_t>(arr.size()));
  if (arr.size() == 0) return out;
  const char kind = arr.dtype().kind();
  if (kind == 'i') {
    auto v = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    const int64_t* p = v.data();
    for (py::ssize_t i = 0; i < v.size(); ++i) {
      if (p[i] < 0 || p[i] > std::numeric_limits<int32_t>::max()) {
        throw std::invalid_argument("token " + std::to_string(p[i]) + " at index " +
                                    std::to_string(i) + " is outside [0, 2^31)");
      }
      out[i] = static_cast<int32_t>(p[i]);
    }
  } else if (kind == 'u') {
    auto v = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    const uint64_t* p = v.data();
    for (py::ssize_t i = 0; i < v.size(); ++i) {
      if (p[i] > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
        throw std::invalid_argument("token " + std::to_string(p[i]) + " at index " +
                                    std::to_string(i) + " is outside [0, 2^31)");
      }
      out[i] = static_cast<int32_t>(p[i]);
    }
  } else {
    throw std::invalid_argument("tokens must be integers, got numpy dtype kind '" +
                                std::string(1, kind) + "'");
  }
  return out;
}

// The array itself if it is `ndim`-D, C-contiguous and exactly of dtype T.
template <typename T>
py::array_t<T> exact_array(py::handle obj, int ndim, const char* name) {
  auto want = [] { return py::str(py::dtype::of<T>()).cast<std::string>(); };
  if (!py::isinstance<py::array>(obj)) {
    throw std::invalid_argument(std::string(name) + " must be a numpy " + want() + " array");
  }
  auto arr = py::reinterpret_borrow<py::array>(obj);
  // By type number, not identity: numpy's longlong is an int64 other than its long.
  if (arr.dtype().normalized_num() != py::dtype::of<T>().normalized_num() || !native_byte_order(arr)) {
    throw std::invalid_argument(std::string(name) + " must have dtype " + want() + ", got " +
                                py::str(arr.dtype()).cast<std::string>());
  }
  if (arr.ndim() != ndim) {
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) +
                                "-D, got " + std::to_string(arr.ndim()) + "-D");
  }
  if (!(arr.flags() & py::array::c_style)) {
    throw std::invalid_argument(std::string(name) + " must be C-contiguous");
  }
  return py::reinterpret_borrow<py::array_t<T>>(arr);
}

py::tuple pool_extend(sa::SuffixAutomatonPool& pool, py::handle ids_obj, py::handle acc_obj,
                      py::handle lens_obj, int64_t draft_len) {
  auto ids = exact_array<int64_t>(ids_obj, 1, "request_ids");
  auto accepted = exact_array<int32_t>(acc_obj, 2, "accepted");
  auto lens = exact_array<int32_t>(lens_obj, 1, "accepted_lens");
  const int64_t batch = ids.shape(0);
  if (accepted.shape(0) != batch || lens.shape(0) != batch) {
    throw std::invalid_argument(
        "batch sizes differ: request_ids has " + std::to_string(batch) + " rows, accepted " +
        std::to_string(accepted.shape(0)) + ", accepted_lens " + std::to_string(lens.shape(0)));
  }
  if (draft_len < 0 || draft_len > sa::kMaxTokensLimit) {  // the pool's check, before the draft array is made
    throw std::invalid_argument("draft_len must be in [0, 2^28], got " + std::to_string(draft_len));
  }
  const int64_t width = accepted.shape(1);
  py::array_t<int32_t> match_len(batch);
  py::array_t<int32_t> draft({batch, draft_len});
  const int64_t* ids_p = ids.data();
  const int32_t* acc_p = accepted.data();
  const int32_t* lens_p = lens.data();
  int32_t* match_p = match_len.mutable_data();
  int32_t* draft_p = draft.mutable_data();
  {
    py::gil_scoped_release unlocked;
    pool.extend(ids_p, batch, acc_p, width, lens_p, draft_len, match_p, draft_p);
  }
  return py::make_tuple(match_len, draft);
}

// One text's longest repeated suffix: (match length, position after its first occurrence).
py::tuple longest_repeated_suffix(py::handle tokens_obj) {
  std::vector<int32_t> tokens = to_tokens(tokens_obj);
  if (tokens.empty()) return py::make_tuple(0, -1);
  sa::HostAutomaton host(static_cast<int32_t>(tokens.size()));
  for (int32_t t : tokens) sa::extend(host.get(), t);
  const sa::Match m = sa::longest_repeated_suffix(host.get());
  return py::make_tuple(m.length, m.next_pos);
}

#ifdef SA_WITH_CUDA
void bind_device_pool(py::module_& m) {
  py::class_<sa::DevicePool>(m, "DeviceSuffixAutomatonPool", R"doc(
Device-resident slots for the GPU path; pointers and streams are passed as integers.

DeviceSuffixAutomatonPool(max_slots, max_seq_len, device=0)
  add_request(request_id, tokens, stream=0) -> slot   (built on the host, copied, synced)
  extend(slot_ids, accepted, width, accepted_lens, batch, draft_len, match_len, draft, stream)
    every array argument is a device pointer (int32); launches one kernel, never syncs.
  extend_staged(host_in, batch, width, draft_len, host_out, stream)
    the same from pinned host buffers [slots | lens | tokens] -> [match_len | drafts]:
    copy up, kernel, copy down, all async on `stream`.
)doc")
      .def(py::init<int64_t, int64_t, int>(), py::arg("max_slots"), py::arg("max_seq_len"),
           py::arg("device") = 0)
      .def(
          "add_request",
          [](sa::DevicePool& pool, int64_t id, py::handle tokens, uintptr_t stream) {
            std::vector<int32_t> t = to_tokens(tokens);
            py::gil_scoped_release unlocked;
            return pool.add_request(id, t.data(), static_cast<int64_t>(t.size()), stream);
          },
          py::arg("request_id"), py::arg("tokens"), py::arg("stream") = 0)
      .def("remove_request", &sa::DevicePool::remove_request, py::arg("request_id"))
      .def("slot_of", &sa::DevicePool::slot_of, py::arg("request_id"))
      .def("extend", &sa::DevicePool::extend, py::arg("slot_ids"), py::arg("accepted"),
           py::arg("width"), py::arg("accepted_lens"), py::arg("batch"), py::arg("draft_len"),
           py::arg("match_len"), py::arg("draft"), py::arg("stream"))
      .def("extend_staged", &sa::DevicePool::extend_staged, py::arg("host_in"), py::arg("batch"),
           py::arg("width"), py::arg("draft_len"), py::arg("host_out"), py::arg("stream"))
      .def_property_readonly("num_active", &sa::DevicePool::num_active)
      .def_property_readonly("max_slots", &sa::DevicePool::max_slots)
      .def_property_readonly("max_seq_len", &sa::DevicePool::max_seq_len);
}
#endif

}  // namespace

PYBIND11_MODULE(_sa_native, m) {
  m.doc() = "Suffix automaton drafter: batched pool of per-request automata (native core).";
  py::register_exception<sa::UnknownRequest>(m, "UnknownRequestError", PyExc_KeyError);

  py::class_<sa::SuffixAutomatonPool>(m, "SuffixAutomatonPool", R"doc(
Per-request suffix automata in fixed-capacity slots, plus an optional cross-request pool.

SuffixAutomatonPool(max_slots, max_seq_len, global_pool_tokens=0, global_bias=0)
  max_seq_len: tokens (prompt + generated) one request may hold.
  global_pool_tokens: bound on the shared pool of finished responses (0: off).
  global_bias: a global match is used only when longer than the local one + this.
)doc")
      .def(py::init<int64_t, int64_t, int64_t, int64_t>(), py::arg("max_slots"),
           py::arg("max_seq_len"), py::arg("global_pool_tokens") = 0,
           py::arg("global_bias") = sa::kDefaultGlobalBias)
      .def(
          "add_request",
          [](sa::SuffixAutomatonPool& pool, int64_t id, py::handle tokens) {
            std::vector<int32_t> t = to_tokens(tokens);
            py::gil_scoped_release unlocked;
            pool.add_request(id, t.data(), static_cast<int64_t>(t.size()));
          },
          py::arg("request_id"), py::arg("tokens"),
          "Build the request's automaton from its prompt tokens.")
      .def(
          "remove_request",
          [](sa::SuffixAutomatonPool& pool, int64_t id, bool keep) {
            py::gil_scoped_release unlocked;
            pool.remove_request(id, keep);
          },
          py::arg("request_id"), py::arg("keep_in_global_pool") = true,
          "Free the request's slot; optionally keep its response in the global pool.")
      .def("extend", &pool_extend, py::arg("request_ids"), py::arg("accepted"),
           py::arg("accepted_lens"), py::arg("draft_len"), R"doc(
Feed accepted[b, :accepted_lens[b]] to request_ids[b]; return (match_len [B] int32,
draft [B, draft_len] int32 padded with -1). request_ids int64 [B], accepted int32 [B, W]
C-contiguous, accepted_lens int32 [B].)doc")
      .def("has_request", &sa::SuffixAutomatonPool::has_request, py::arg("request_id"))
      .def("request_length", &sa::SuffixAutomatonPool::request_length, py::arg("request_id"),
           "Tokens the request's automaton holds (prompt + fed).")
      .def_property_readonly("num_active", &sa::SuffixAutomatonPool::num_active)
      .def_property_readonly("global_pool_tokens_used",
                             &sa::SuffixAutomatonPool::global_pool_tokens_used)
      .def_property_readonly("max_slots", &sa::SuffixAutomatonPool::max_slots)
      .def_property_readonly("max_seq_len", &sa::SuffixAutomatonPool::max_seq_len)
      .def_property_readonly("slot_bytes", &sa::SuffixAutomatonPool::slot_bytes,
                             "Bytes of automaton state one slot holds at max_seq_len.");

  m.def(
      "cuda_device_count",
      [] {
#ifdef SA_WITH_CUDA
        return sa::DevicePool::device_count();
#else
        return 0;
#endif
      },
      "Visible CUDA devices (0 without a driver, a GPU, or a CUDA build).");
  m.def("longest_repeated_suffix", &longest_repeated_suffix, py::arg("tokens"),
        "(match length, position after the first earlier occurrence) of one text; (0, -1) "
        "when no suffix repeats.");

#ifdef SA_WITH_CUDA
  m.attr("cuda_compiled") = true;
  bind_device_pool(m);
#else
  m.attr("cuda_compiled") = false;
#endif
}
