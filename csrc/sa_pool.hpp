// Slots: many requests' automata behind one batched call, plus the cross-request pool.
//
// Every public method validates all of its input before it mutates anything, so a bad call
// throws (std::invalid_argument, or UnknownRequest for an id that is not live) and leaves
// the pool and every request exactly as they were. A mutex serialises calls: the bindings
// release the GIL during batch work, so two Python threads could otherwise race.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "sa_errors.hpp"
#include "sa_global_pool.hpp"
#include "sa_host_automaton.hpp"
#include "suffix_automaton.hpp"

namespace sa {

// Global drafts come from other requests' text, so they must beat the request's own match
// by a margin before they are trusted (SAM-Decoding's bias rule).
// 0: measured best on code edits, ShareGPT and HumanEval (benchmarks/drafters.py sweep,
// MAT rises monotonically as the bias falls from 8 to 0): a longer global match is worth
// using as soon as it is longer.
inline constexpr int32_t kDefaultGlobalBias = 0;

class SuffixAutomatonPool {
 public:
  SuffixAutomatonPool(int64_t max_slots, int64_t max_seq_len, int64_t global_pool_tokens = 0,
                      int64_t global_bias = kDefaultGlobalBias)
      : global_(validated_budget(max_slots, max_seq_len, global_pool_tokens, global_bias)),
        max_seq_len_(static_cast<int32_t>(max_seq_len)),
        global_bias_(static_cast<int32_t>(global_bias)),
        slots_(static_cast<size_t>(max_slots)),
        in_batch_(static_cast<size_t>(max_slots), 0) {
    for (int64_t s = max_slots - 1; s >= 0; --s) free_slots_.push_back(static_cast<int32_t>(s));
  }

  // Build the request's automaton from its prompt (tokens in [0, 2^31)).
  void add_request(int64_t id, const int32_t* tokens, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    if (by_id_.count(id)) {
      throw std::invalid_argument("request id " + std::to_string(id) + " is already active");
    }
    if (free_slots_.empty()) {
      throw std::invalid_argument("all " + std::to_string(slots_.size()) +
                                  " slots are in use (max_slots)");
    }
    check_length(id, 0, n);
    check_tokens(tokens, n, "tokens");
    const int32_t s = free_slots_.back();
    free_slots_.pop_back();
    Slot& slot = slots_[s];
    if (!slot.automaton) slot.automaton = std::make_unique<HostAutomaton>(max_seq_len_);
    slot.prompt_len = static_cast<int32_t>(n);
    slot.cursor = global_.fresh_cursor();
    feed(slot, tokens, n);
    by_id_.emplace(id, s);
  }

  // Free the request's slot; its response (tokens after the prompt) may feed the pool.
  void remove_request(int64_t id, bool keep_in_global_pool) {
    std::lock_guard<std::mutex> lock(mu_);
    const int32_t s = slot_of(id);
    Slot& slot = slots_[s];
    Automaton& a = slot.automaton->get();
    if (keep_in_global_pool) {
      global_.add_response(a.text + slot.prompt_len, a.length - slot.prompt_len);
    }
    sa::clear(a);
    by_id_.erase(id);
    free_slots_.push_back(s);
  }

  // Feed accepted[b, :accepted_lens[b]] to request ids[b], then write its match length and
  // draft (draft_out is [batch, draft_len], padded with -1).
  void extend(const int64_t* ids, int64_t batch, const int32_t* accepted, int64_t width,
              const int32_t* accepted_lens, int64_t draft_len, int32_t* match_out,
              int32_t* draft_out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (draft_len < 0 || draft_len > kMaxTokensLimit) {
      throw std::invalid_argument("draft_len must be in [0, 2^28], got " +
                                  std::to_string(draft_len));
    }
    batch_slots_.resize(static_cast<size_t>(batch));
    try {
      validate_batch(ids, batch, accepted, width, accepted_lens);
    } catch (...) {
      for (int64_t b = 0; b < batch; ++b) {
        if (batch_slots_[b] >= 0) in_batch_[batch_slots_[b]] = 0;
      }
      throw;
    }
    for (int64_t b = 0; b < batch; ++b) {
      Slot& slot = slots_[batch_slots_[b]];
      in_batch_[batch_slots_[b]] = 0;
      feed(slot, accepted + b * width, accepted_lens[b]);
      match_out[b] = draft(slot, static_cast<int32_t>(draft_len), draft_out + b * draft_len);
    }
  }

  bool has_request(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return by_id_.count(id) != 0;
  }
  int64_t request_length(int64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    return slots_[slot_of(id)].automaton->get().length;
  }
  int64_t num_active() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(by_id_.size());
  }
  int64_t global_pool_tokens_used() const {
    std::lock_guard<std::mutex> lock(mu_);
    return global_.tokens_used();
  }
  int64_t max_slots() const { return static_cast<int64_t>(slots_.size()); }
  int64_t max_seq_len() const { return max_seq_len_; }
  int64_t global_bias() const { return global_bias_; }
  int64_t slot_bytes() const { return automaton_bytes(max_seq_len_); }

 private:
  struct Slot {
    std::unique_ptr<HostAutomaton> automaton;  // made on first use, reused after
    int32_t prompt_len = 0;
    GlobalCursor cursor{};
  };

  static int64_t validated_budget(int64_t max_slots, int64_t max_seq_len, int64_t budget,
                                  int64_t bias) {
    if (max_slots <= 0 || max_slots > (int64_t{1} << 20)) {
      throw std::invalid_argument("max_slots must be in [1, 2^20], got " +
                                  std::to_string(max_slots));
    }
    check_capacity(max_seq_len, "max_seq_len");
    if (bias < 0 || bias > kMaxTokensLimit) {
      throw std::invalid_argument("global_bias must be in [0, 2^28], got " +
                                  std::to_string(bias));
    }
    return budget;
  }

  int32_t slot_of(int64_t id) const {
    auto it = by_id_.find(id);
    if (it == by_id_.end()) throw UnknownRequest(id);
    return it->second;
  }

  void check_length(int64_t id, int64_t have, int64_t more) const {
    if (have + more > max_seq_len_) {
      throw std::invalid_argument("request " + std::to_string(id) + " would hold " +
                                  std::to_string(have + more) +
                                  " tokens, more than max_seq_len=" +
                                  std::to_string(max_seq_len_));
    }
  }

  static void check_tokens(const int32_t* tokens, int64_t n, const std::string& what) {
    for (int64_t i = 0; i < n; ++i) {
      if (tokens[i] < 0) {
        throw std::invalid_argument(what + " must be non-negative token ids, got " +
                                    std::to_string(tokens[i]) + " at index " +
                                    std::to_string(i));
      }
    }
  }

  // Throws on the first problem; batch_slots_[b] holds the slot of row b or -1.
  void validate_batch(const int64_t* ids, int64_t batch, const int32_t* accepted,
                      int64_t width, const int32_t* lens) {
    for (int64_t b = 0; b < batch; ++b) batch_slots_[b] = -1;
    for (int64_t b = 0; b < batch; ++b) {
      const int32_t s = slot_of(ids[b]);
      if (in_batch_[s]) {
        throw std::invalid_argument("request id " + std::to_string(ids[b]) +
                                    " appears twice in one batch");
      }
      in_batch_[s] = 1;
      batch_slots_[b] = s;
      if (lens[b] < 0 || lens[b] > width) {
        throw std::invalid_argument("accepted_lens[" + std::to_string(b) + "]=" +
                                    std::to_string(lens[b]) + " is outside [0, " +
                                    std::to_string(width) + "] (the row width)");
      }
      check_length(ids[b], slots_[s].automaton->get().length, lens[b]);
      check_tokens(accepted + b * width, lens[b], "accepted[" + std::to_string(b) + "]");
    }
  }

  void feed(Slot& slot, const int32_t* tokens, int64_t n) {
    Automaton& a = slot.automaton->get();
    for (int64_t i = 0; i < n; ++i) sa::extend(a, tokens[i]);
    if (global_.enabled()) {
      for (int64_t i = 0; i < n; ++i) global_.advance(slot.cursor, tokens[i]);
    }
  }

  // The request's own longest repeated suffix, unless the pool's match is longer by more
  // than the bias. Returns the match length the draft came from.
  int32_t draft(const Slot& slot, int32_t k, int32_t* out) const {
    const Automaton& a = slot.automaton->get();
    const Match local = longest_repeated_suffix(a);
    if (global_.enabled()) {
      const GlobalMatch g = global_.best(slot.cursor);
      if (g.match.length > local.length + global_bias_) {
        global_.copy_draft(g, k, out);
        return g.match.length;
      }
    }
    sa::copy_draft(a, local, k, out);
    return local.length;
  }

  GlobalPool global_;
  int32_t max_seq_len_;
  int32_t global_bias_;
  std::vector<Slot> slots_;
  std::vector<int32_t> free_slots_;
  std::unordered_map<int64_t, int32_t> by_id_;
  std::vector<int32_t> batch_slots_;  // scratch for extend, kept to avoid reallocating
  std::vector<uint8_t> in_batch_;     // per slot: already seen in the current batch
  mutable std::mutex mu_;
};

}  // namespace sa
