// The cross-request pool: responses of finished requests, shared by every live request.
//
// Bounded by two generations of budget/2 tokens each. New responses go into the newest
// generation; when it is full the older one is cleared and becomes the newest. So memory
// never passes the bound, eviction is O(evicted) with no rebuild, and the pool always holds
// the most recent budget/2 .. budget tokens. Responses are separated by a -1 token, which no
// request text contains, so a match never spans two responses and drafts stop at the end of
// the response they came from.
//
// Each live request carries a GlobalCursor: its matching statistics against each
// generation, advanced with every token it is fed (amortised O(1)). A generation's epoch
// changes when it is cleared, which invalidates cursors into it lazily. A cursor is not
// rewound when a response is added under it, so a request picks up matches in new material
// from its next tokens on (one token more per step), not retroactively.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "sa_host_automaton.hpp"
#include "suffix_automaton.hpp"

namespace sa {

struct GlobalCursor {
  Cursor at[2];
  uint32_t epoch[2];
};

struct GlobalMatch {
  Match match;
  int32_t generation;  // -1: none
};

class GlobalPool {
 public:
  static constexpr int32_t kSeparator = -1;

  // budget_tokens == 0 disables the pool.
  explicit GlobalPool(int64_t budget_tokens) {
    if (budget_tokens == 0) return;
    if (budget_tokens < 4 || budget_tokens / 2 > kMaxTokensLimit) {
      throw std::invalid_argument("global_pool_tokens must be 0 (off) or in [4, " +
                                  std::to_string(2 * kMaxTokensLimit) + "], got " +
                                  std::to_string(budget_tokens));
    }
    generation_tokens_ = static_cast<int32_t>(budget_tokens / 2);
    generations_.emplace_back(generation_tokens_);
    generations_.emplace_back(generation_tokens_);
  }

  bool enabled() const { return !generations_.empty(); }

  int64_t tokens_used() const {
    int64_t used = 0;
    for (const auto& g : generations_) used += g.get().length;
    return used;
  }

  GlobalCursor fresh_cursor() const {
    return GlobalCursor{{Cursor{0, 0}, Cursor{0, 0}}, {epoch_[0], epoch_[1]}};
  }

  // Keep one finished request's response (tokens already validated non-negative). A
  // response longer than a generation keeps its tail: the most recent tokens.
  void add_response(const int32_t* tokens, int64_t n) {
    if (!enabled() || n <= 0) return;
    const int64_t room = generation_tokens_ - 1;  // one token for the separator
    if (n > room) {
      tokens += n - room;
      n = room;
    }
    Automaton* g = &generations_[newest_].get();
    if (g->length + n + 1 > generation_tokens_) {
      newest_ ^= 1;
      g = &generations_[newest_].get();
      clear(*g);
      epoch_[newest_] += 1;
    }
    for (int64_t i = 0; i < n; ++i) extend(*g, tokens[i]);
    extend(*g, kSeparator);
  }

  void advance(GlobalCursor& c, int32_t token) const {
    for (int g = 0; g < 2; ++g) {
      if (c.epoch[g] != epoch_[g]) {
        c.at[g] = Cursor{0, 0};
        c.epoch[g] = epoch_[g];
      }
      sa::advance(generations_[g].get(), c.at[g], token);
    }
  }

  // The longer of the two generations' matches; ties go to the newer one.
  GlobalMatch best(const GlobalCursor& c) const {
    GlobalMatch out{Match{0, -1}, -1};
    const int order[2] = {newest_, newest_ ^ 1};
    for (int g : order) {
      if (c.epoch[g] != epoch_[g]) continue;
      Match m = cursor_match(generations_[g].get(), c.at[g]);
      if (m.length > out.match.length) out = GlobalMatch{m, g};
    }
    return out;
  }

  int32_t copy_draft(const GlobalMatch& m, int32_t k, int32_t* out) const {
    return sa::copy_draft(generations_[m.generation].get(), m.match, k, out);
  }

  int64_t bytes() const {
    return enabled() ? 2 * automaton_bytes(generation_tokens_) : 0;
  }

 private:
  int32_t generation_tokens_ = 0;
  std::vector<HostAutomaton> generations_;
  uint32_t epoch_[2] = {0, 0};
  int newest_ = 0;
};

}  // namespace sa
