// The GPU path: a batched extend kernel (one thread per batch row) over device-resident
// slots, and the host code that fills those slots. The automaton algorithm is the same
// header as the CPU path; only memory placement differs.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "sa_device_pool.hpp"
#include "sa_errors.hpp"
#include "sa_host_automaton.hpp"
#include "suffix_automaton.hpp"

namespace sa {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

// A row that cannot be served (bad slot id) still gets a well-formed answer.
__device__ void no_match(int32_t* match_out, int32_t* draft_out, int32_t draft_len) {
  *match_out = -1;
  for (int32_t i = 0; i < draft_len; ++i) draft_out[i] = -1;
}

__global__ void extend_kernel(Automaton* slots, int32_t num_slots, const int32_t* slot_ids,
                              const int32_t* accepted, int64_t width,
                              const int32_t* accepted_lens, int64_t batch, int32_t draft_len,
                              int32_t* match_out, int32_t* draft_out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  int32_t* draft = draft_out + b * draft_len;
  const int32_t s = slot_ids[b];
  if (s < 0 || s >= num_slots) {
    no_match(match_out + b, draft, draft_len);
    return;
  }
  // Work on a register copy of the POD; the arrays it points at are updated in place.
  Automaton a = slots[s];
  int64_t n = accepted_lens[b];
  if (n > width) n = width;
  const int32_t* row = accepted + b * width;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] < 0 || !extend(a, row[i])) break;
  }
  slots[s] = a;
  const Match m = longest_repeated_suffix(a);
  match_out[b] = m.length;
  copy_draft(a, m, draft_len, draft);
}

}  // namespace

struct DevicePool::Device {
  Automaton* slots = nullptr;  // [max_slots] PODs pointing into the arrays below
  State* states = nullptr;     // [max_slots * max_states]
  Edge* table = nullptr;       // [max_slots * table_entries]
  int32_t* text = nullptr;     // [max_slots * max_seq_len]
  int64_t states_per_slot = 0, table_per_slot = 0;
  std::unique_ptr<HostAutomaton> scratch;  // where prompts are built before the copy
  int32_t* staging = nullptr;              // extend_staged's inputs and outputs, grown on demand
  int64_t staging_len = 0;

  ~Device() {
    cudaFree(staging);
    cudaFree(slots);
    cudaFree(states);
    cudaFree(table);
    cudaFree(text);
  }
};

int DevicePool::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

DevicePool::DevicePool(int64_t max_slots, int64_t max_seq_len, int device)
    : max_slots_(max_slots), max_seq_len_(0), device_(device) {
  if (max_slots <= 0 || max_slots > (int64_t{1} << 20)) {
    throw std::invalid_argument("max_slots must be in [1, 2^20], got " +
                                std::to_string(max_slots));
  }
  check_capacity(max_seq_len, "max_seq_len");
  max_seq_len_ = static_cast<int32_t>(max_seq_len);
  if (device < 0 || device >= device_count()) {
    throw std::invalid_argument("no CUDA device " + std::to_string(device) + " (" +
                                std::to_string(device_count()) + " visible)");
  }
  check(cudaSetDevice(device_), "cudaSetDevice");
  dev_ = std::make_unique<Device>();
  dev_->states_per_slot = max_states(max_seq_len_);
  dev_->table_per_slot = table_entries(max_seq_len_);
  check(cudaMalloc(&dev_->slots, sizeof(Automaton) * max_slots), "cudaMalloc(slots)");
  check(cudaMalloc(&dev_->states, sizeof(State) * dev_->states_per_slot * max_slots),
        "cudaMalloc(states)");
  check(cudaMalloc(&dev_->table, sizeof(Edge) * dev_->table_per_slot * max_slots),
        "cudaMalloc(table)");
  check(cudaMalloc(&dev_->text, sizeof(int32_t) * int64_t{max_seq_len_} * max_slots),
        "cudaMalloc(text)");
  dev_->scratch = std::make_unique<HostAutomaton>(max_seq_len_);
  for (int64_t s = max_slots - 1; s >= 0; --s) free_slots_.push_back(static_cast<int32_t>(s));
}

DevicePool::~DevicePool() = default;

int32_t DevicePool::slot_of(int64_t id) const {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) throw UnknownRequest(id);
  return it->second;
}

int32_t DevicePool::add_request(int64_t id, const int32_t* tokens, int64_t n,
                                uintptr_t stream_handle) {
  if (by_id_.count(id)) {
    throw std::invalid_argument("request id " + std::to_string(id) + " is already active");
  }
  if (free_slots_.empty()) {
    throw std::invalid_argument("all " + std::to_string(max_slots_) +
                                " slots are in use (max_slots)");
  }
  if (n > max_seq_len_) {
    throw std::invalid_argument("prompt of " + std::to_string(n) +
                                " tokens is longer than max_seq_len=" +
                                std::to_string(max_seq_len_));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0) throw std::invalid_argument("tokens must be non-negative token ids");
  }
  check(cudaSetDevice(device_), "cudaSetDevice");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int32_t s = free_slots_.back();
  Automaton& host = dev_->scratch->get();
  sa::clear(host);
  for (int64_t i = 0; i < n; ++i) sa::extend(host, tokens[i]);

  // The device copy of the POD: same counters, device arrays of this slot.
  Automaton on_device = host;
  on_device.states = dev_->states + s * dev_->states_per_slot;
  on_device.table = dev_->table + s * dev_->table_per_slot;
  on_device.text = dev_->text + int64_t{s} * max_seq_len_;
  // The whole table is copied: entries sit at hashed positions, and this also wipes the
  // slot's previous occupant. States and text only need their used prefix.
  check(cudaMemcpyAsync(on_device.table, host.table, sizeof(Edge) * dev_->table_per_slot,
                        cudaMemcpyHostToDevice, stream), "copy table");
  check(cudaMemcpyAsync(on_device.states, host.states, sizeof(State) * host.num_states,
                        cudaMemcpyHostToDevice, stream), "copy states");
  if (n > 0) {
    check(cudaMemcpyAsync(on_device.text, host.text, sizeof(int32_t) * n,
                          cudaMemcpyHostToDevice, stream), "copy text");
  }
  check(cudaMemcpyAsync(dev_->slots + s, &on_device, sizeof(Automaton),
                        cudaMemcpyHostToDevice, stream), "copy automaton");
  // The scratch (and on_device) are reused/destroyed on return: wait for the copies.
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  free_slots_.pop_back();
  by_id_.emplace(id, s);
  return s;
}

void DevicePool::remove_request(int64_t id) {
  const int32_t s = slot_of(id);
  by_id_.erase(id);
  free_slots_.push_back(s);
}

void DevicePool::extend(uintptr_t slot_ids, uintptr_t accepted, int64_t width,
                        uintptr_t accepted_lens, int64_t batch, int64_t draft_len,
                        uintptr_t match_len, uintptr_t draft, uintptr_t stream) const {
  if (batch < 0 || width < 0 || draft_len < 0 || draft_len > kMaxTokensLimit) {
    throw std::invalid_argument("batch and width must be >= 0, draft_len in [0, 2^28]");
  }
  if (batch == 0) return;
  if (!slot_ids || !accepted_lens || !match_len || (draft_len > 0 && !draft) ||
      (width > 0 && !accepted)) {
    throw std::invalid_argument("null device pointer");
  }
  check(cudaSetDevice(device_), "cudaSetDevice");
  constexpr int kThreads = 64;
  const auto blocks = static_cast<unsigned>((batch + kThreads - 1) / kThreads);
  extend_kernel<<<blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      dev_->slots, static_cast<int32_t>(max_slots_), reinterpret_cast<const int32_t*>(slot_ids),
      reinterpret_cast<const int32_t*>(accepted), width,
      reinterpret_cast<const int32_t*>(accepted_lens), batch, static_cast<int32_t>(draft_len),
      reinterpret_cast<int32_t*>(match_len), reinterpret_cast<int32_t*>(draft));
  check(cudaGetLastError(), "extend_kernel launch");
}

void DevicePool::extend_staged(uintptr_t host_in, int64_t batch, int64_t width, int64_t draft_len,
                               uintptr_t host_out, uintptr_t stream_handle) {
  if (batch < 0 || batch > max_slots_ || width < 0 || width > kMaxTokensLimit || draft_len < 0 ||
      draft_len > kMaxTokensLimit) {
    throw std::invalid_argument("batch must be in [0, max_slots], width and draft_len in [0, 2^28]");
  }
  if (batch == 0) return;
  if (!host_in || !host_out) throw std::invalid_argument("null host pointer");
  check(cudaSetDevice(device_), "cudaSetDevice");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int64_t in_len = batch * (2 + width), out_len = batch * (1 + draft_len);
  if (in_len + out_len > dev_->staging_len) {
    // Growing frees the old buffer: let whatever still reads it finish first.
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    cudaFree(dev_->staging);
    dev_->staging = nullptr;
    dev_->staging_len = 0;
    check(cudaMalloc(&dev_->staging, sizeof(int32_t) * (in_len + out_len)), "cudaMalloc(staging)");
    dev_->staging_len = in_len + out_len;
  }
  int32_t* in = dev_->staging;
  int32_t* out = dev_->staging + in_len;
  check(cudaMemcpyAsync(in, reinterpret_cast<const void*>(host_in), sizeof(int32_t) * in_len,
                        cudaMemcpyHostToDevice, stream), "copy staged input");
  extend(reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(in + 2 * batch), width,
         reinterpret_cast<uintptr_t>(in + batch), batch, draft_len, reinterpret_cast<uintptr_t>(out),
         reinterpret_cast<uintptr_t>(out + batch), stream_handle);
  check(cudaMemcpyAsync(reinterpret_cast<void*>(host_out), out, sizeof(int32_t) * out_len,
                        cudaMemcpyDeviceToHost, stream), "copy staged output");
}

}  // namespace sa
