// The online suffix automaton: one request's text, extended one token at a time.
//
// Header-only and shared verbatim by the host (C++17) and the GPU (CUDA): every function is
// SA_HOST_DEVICE, nothing allocates, and the automaton itself is a trivially copyable POD
// that points at caller-owned storage. That is what lets the host build a prompt's automaton
// and memcpy it into a device slot, and what makes the GPU kernel CUDA-graph safe.
//
// Tokens are int32 (vocabularies reach ~256k), so transitions cannot be dense rows. They
// live in one open-addressing hash table keyed by (state, token); each table entry also
// threads a per-state singly linked list, because cloning a state must enumerate its edges.
// Capacities follow the classic bounds for a text of n tokens: < 2n states, < 3n edges; the
// table has >= 4n entries, so linear probing never runs above 75% load.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define SA_HOST_DEVICE __host__ __device__
#else
#define SA_HOST_DEVICE
#endif

namespace sa {

// One equivalence class of substrings (same set of end positions).
struct State {
  int32_t len;         // longest string in the class, in tokens
  int32_t link;        // suffix link (-1 for the root)
  int32_t first_end;   // index of the last token of the class's FIRST occurrence
  int32_t first_edge;  // head of this state's edge list in the table (-1: none)
};

// A table entry. target == 0 marks an empty entry: the root (state 0) is never the target of
// a transition, so zero-filled memory is an empty table (calloc / cudaMemset suffice).
struct Edge {
  int32_t src;
  int32_t token;
  int32_t target;
  int32_t next_edge;  // next entry of src's edge list (-1: end)
};

// Where a match continues: `length` tokens of the text's suffix also end at `next_pos - 1`.
struct Match {
  int32_t length;    // 0: no match
  int32_t next_pos;  // index of the token that followed the earlier occurrence (-1: none)
};

// A position in some automaton while walking another text along it (matching statistics).
struct Cursor {
  int32_t state;
  int32_t length;  // tokens of the walked text's suffix that occur in the automaton's text
};

struct Automaton {
  State* states;      // [max_states(max_tokens)]
  Edge* table;        // [table_entries(max_tokens)], zero-filled before init
  int32_t* text;      // [max_tokens]
  int32_t max_tokens;
  uint32_t table_mask;  // table_entries - 1 (a power of two minus one)
  int32_t num_states;
  int32_t length;     // tokens in text
  int32_t last;       // state of the whole text
};

static_assert(std::is_trivially_copyable_v<State>);
static_assert(std::is_trivially_copyable_v<Edge>);
static_assert(std::is_trivially_copyable_v<Automaton>);
static_assert(std::is_standard_layout_v<Automaton>);

// Storage sizes for a text of up to max_tokens tokens (max_tokens >= 0).
SA_HOST_DEVICE inline int64_t max_states(int32_t max_tokens) {
  return 2 * static_cast<int64_t>(max_tokens) + 1;
}
SA_HOST_DEVICE inline int64_t table_entries(int32_t max_tokens) {
  int64_t want = 4 * static_cast<int64_t>(max_tokens);
  int64_t size = 8;
  while (size < want) size <<= 1;
  return size;
}

SA_HOST_DEVICE inline uint32_t edge_hash(int32_t state, int32_t token) {
  // A 64-bit mix: tokens cluster at small ids and states are dense, so a plain multiply
  // would leave long probe runs.
  uint64_t x = (static_cast<uint64_t>(static_cast<uint32_t>(state)) << 32) |
               static_cast<uint32_t>(token);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Point `a` at storage sized by max_states/table_entries/max_tokens; `table` must be zeroed.
SA_HOST_DEVICE inline void init(Automaton& a, State* states, Edge* table, int32_t* text,
                                int32_t max_tokens) {
  a.states = states;
  a.table = table;
  a.text = text;
  a.max_tokens = max_tokens;
  a.table_mask = static_cast<uint32_t>(table_entries(max_tokens) - 1);
  a.num_states = 1;
  a.length = 0;
  a.last = 0;
  a.states[0] = State{0, -1, -1, -1};
}

// Empty the automaton in O(states + edges) rather than O(capacity): only the table entries
// reachable from the edge lists were ever written.
SA_HOST_DEVICE inline void clear(Automaton& a) {
  for (int32_t s = 0; s < a.num_states; ++s) {
    int32_t e = a.states[s].first_edge;
    while (e >= 0) {
      int32_t next = a.table[e].next_edge;
      a.table[e] = Edge{0, 0, 0, 0};
      e = next;
    }
  }
  a.num_states = 1;
  a.length = 0;
  a.last = 0;
  a.states[0] = State{0, -1, -1, -1};
}

// Table index of the edge (state, token), or -1.
SA_HOST_DEVICE inline int32_t find_edge(const Automaton& a, int32_t state, int32_t token) {
  uint32_t i = edge_hash(state, token) & a.table_mask;
  while (true) {
    const Edge& e = a.table[i];
    if (e.target == 0) return -1;
    if (e.src == state && e.token == token) return static_cast<int32_t>(i);
    i = (i + 1) & a.table_mask;
  }
}

SA_HOST_DEVICE inline void add_edge(Automaton& a, int32_t state, int32_t token,
                                    int32_t target) {
  uint32_t i = edge_hash(state, token) & a.table_mask;
  while (a.table[i].target != 0) i = (i + 1) & a.table_mask;
  a.table[i] = Edge{state, token, target, a.states[state].first_edge};
  a.states[state].first_edge = static_cast<int32_t>(i);
}

// Append one token. Returns false (and changes nothing) when the text is full; callers
// validate lengths first, so false only guards the device path against bad input.
SA_HOST_DEVICE inline bool extend(Automaton& a, int32_t token) {
  if (a.length >= a.max_tokens) return false;
  a.text[a.length] = token;
  const int32_t cur = a.num_states++;
  a.states[cur] = State{a.states[a.last].len + 1, 0, a.length, -1};
  a.length += 1;

  int32_t p = a.last;
  int32_t e = -1;
  while (p >= 0 && (e = find_edge(a, p, token)) < 0) {
    add_edge(a, p, token, cur);
    p = a.states[p].link;
  }
  if (p >= 0) {
    const int32_t q = a.table[e].target;
    if (a.states[p].len + 1 == a.states[q].len) {
      a.states[cur].link = q;
    } else {
      // q also holds longer strings that are not suffixes of the new text: split off the
      // short ones into a clone that inherits q's edges and first occurrence.
      const int32_t clone = a.num_states++;
      a.states[clone] = State{a.states[p].len + 1, a.states[q].link, a.states[q].first_end, -1};
      for (int32_t qe = a.states[q].first_edge; qe >= 0; qe = a.table[qe].next_edge) {
        add_edge(a, clone, a.table[qe].token, a.table[qe].target);
      }
      while (p >= 0) {
        if (e < 0 || a.table[e].target != q) break;
        a.table[e].target = clone;
        p = a.states[p].link;
        e = p >= 0 ? find_edge(a, p, token) : -1;
      }
      a.states[q].link = clone;
      a.states[cur].link = clone;
    }
  }
  a.last = cur;
  return true;
}

// The longest suffix of the text that occurred before, and where its first occurrence
// continued. That suffix is exactly the class of link(last): `last` holds the strings that
// occur only at the end, its link the longest one with more end positions.
SA_HOST_DEVICE inline Match longest_repeated_suffix(const Automaton& a) {
  const int32_t s = a.states[a.last].link;
  if (s <= 0) return Match{0, -1};
  return Match{a.states[s].len, a.states[s].first_end + 1};
}

// Walk one more token of another text along `a` (amortised O(1)). Edges added to `a` after
// the cursor was placed can leave cursor.length below len(link(state)), so falling back
// clamps instead of overwriting: the reported length never overclaims.
SA_HOST_DEVICE inline void advance(const Automaton& a, Cursor& c, int32_t token) {
  while (true) {
    const int32_t e = find_edge(a, c.state, token);
    if (e >= 0) {
      c.state = a.table[e].target;
      c.length += 1;
      return;
    }
    if (c.state == 0) {
      c.length = 0;
      return;
    }
    c.state = a.states[c.state].link;
    const int32_t shorter = a.states[c.state].len;
    if (c.length > shorter) c.length = shorter;
  }
}

SA_HOST_DEVICE inline Match cursor_match(const Automaton& a, const Cursor& c) {
  if (c.length <= 0 || c.state <= 0) return Match{0, -1};
  return Match{c.length, a.states[c.state].first_end + 1};
}

// Copy up to k tokens starting at next_pos into out[0..k), stopping at the end of the text
// or at a negative separator, padding with -1. Returns the number of real tokens.
SA_HOST_DEVICE inline int32_t copy_draft(const Automaton& a, Match m, int32_t k, int32_t* out) {
  int32_t n = 0;
  if (m.length > 0) {
    for (int32_t pos = m.next_pos; n < k && pos < a.length && a.text[pos] >= 0; ++pos) {
      out[n++] = a.text[pos];
    }
  }
  for (int32_t i = n; i < k; ++i) out[i] = -1;
  return n;
}

}  // namespace sa
