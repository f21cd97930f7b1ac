// Device-resident slots for the GPU path (implemented in sa_kernels.cu).
//
// No CUDA types appear here, so bindings.cpp compiles with the host compiler alone: device
// pointers and streams cross this interface as integers (`tensor.data_ptr()`,
// `torch.cuda.current_stream().cuda_stream`), and the module never links libtorch.
//
// The host builds a prompt's automaton (the same header-only code) and copies the POD and
// its arrays into a free slot; `extend` then runs one GPU thread per batch row on the
// caller's stream, with no allocation and no host synchronisation (CUDA-graph safe). The
// device side cannot throw, so bad rows degrade instead: a slot id out of range yields
// match_len -1 and an all -1 draft; a row stops being fed at its first negative token or
// when the slot is full. Slot ids within one batch must be distinct.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

namespace sa {

class DevicePool {
 public:
  DevicePool(int64_t max_slots, int64_t max_seq_len, int device);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // Builds on the host, copies to a free slot on `stream`, waits for the copy; returns the slot.
  int32_t add_request(int64_t id, const int32_t* tokens, int64_t n, uintptr_t stream);
  void remove_request(int64_t id);
  int32_t slot_of(int64_t id) const;
  int64_t num_active() const { return static_cast<int64_t>(by_id_.size()); }
  int64_t max_slots() const { return max_slots_; }
  int64_t max_seq_len() const { return max_seq_len_; }

  // All pointers are device pointers: slot_ids int32 [batch], accepted int32 [batch, width],
  // accepted_lens int32 [batch], match_len int32 [batch], draft int32 [batch, draft_len].
  void extend(uintptr_t slot_ids, uintptr_t accepted, int64_t width, uintptr_t accepted_lens,
              int64_t batch, int64_t draft_len, uintptr_t match_len, uintptr_t draft,
              uintptr_t stream) const;

  // The same from host memory, in one call: `host_in` (pinned, int32) holds
  // [slot ids: batch | lengths: batch | tokens: batch x width]; the results land in
  // `host_out` (pinned, int32) as [match lengths: batch | drafts: batch x draft_len]. Two
  // async copies around the kernel on `stream`, no synchronisation: the caller waits on the
  // stream (an event) before reading `host_out` or reusing `host_in`.
  void extend_staged(uintptr_t host_in, int64_t batch, int64_t width, int64_t draft_len, uintptr_t host_out,
                     uintptr_t stream);

  // Visible devices; 0 when there is no driver or no GPU (never throws).
  static int device_count();

 private:
  struct Device;  // device buffers and the host scratch automaton
  int64_t max_slots_;
  int32_t max_seq_len_;
  int device_;
  std::unique_ptr<Device> dev_;
  std::vector<int32_t> free_slots_;
  std::unordered_map<int64_t, int32_t> by_id_;
};

}  // namespace sa
