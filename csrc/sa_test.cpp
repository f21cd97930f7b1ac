// C++ tests for the suffix automaton core and pool: golden vectors, random texts against a
// brute-force scan, and the pool's refuse-and-leave-unchanged behaviour. Plain asserts
// (kept on in Release by CMake); exit code 0 means pass.
#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "sa_host_automaton.hpp"
#include "sa_pool.hpp"
#include "suffix_automaton.hpp"

namespace {

std::vector<int32_t> tokens_of(const std::string& s) {
  return std::vector<int32_t>(s.begin(), s.end());
}

sa::Match match_of(const std::vector<int32_t>& text) {
  sa::HostAutomaton host(static_cast<int32_t>(text.size() + 1));
  for (int32_t t : text) assert(sa::extend(host.get(), t));
  return sa::longest_repeated_suffix(host.get());
}

// Longest suffix that also ends earlier; next_pos after its earliest earlier end.
sa::Match brute_force(const std::vector<int32_t>& text) {
  const int64_t n = static_cast<int64_t>(text.size());
  sa::Match best{0, -1};
  for (int64_t end = 0; end + 1 < n; ++end) {
    int32_t len = 0;
    while (len <= end && text[end - len] == text[n - 1 - len]) ++len;
    if (len > best.length) best = sa::Match{len, static_cast<int32_t>(end + 1)};
  }
  return best;
}

void test_golden() {
  struct Case {
    const char* text;
    int32_t next_pos, length;
  };
  const Case cases[] = {{"aaa", 2, 2},     {"ababa", 3, 3},  {"abcab", 2, 2},
                        {"abcdabc", 3, 3}, {"racecar", 1, 1}, {"abcab123456abc12", 7, 2},
                        {"abcdef", -1, 0}};
  for (const Case& c : cases) {
    sa::Match m = match_of(tokens_of(c.text));
    assert(m.length == c.length && m.next_pos == c.next_pos);
  }
  sa::Match m = match_of(std::vector<int32_t>(100000, 7));
  assert(m.length == 99999 && m.next_pos == 99999);
}

void test_random_against_brute_force() {
  std::mt19937 rng(12345);
  for (int alphabet : {2, 3, 5, 50, 200000}) {
    for (int trial = 0; trial < 40; ++trial) {
      const int n = 1 + static_cast<int>(rng() % 300);
      sa::HostAutomaton host(n);
      std::vector<int32_t> text;
      for (int i = 0; i < n; ++i) {
        text.push_back(static_cast<int32_t>(rng() % alphabet));
        assert(sa::extend(host.get(), text.back()));
        sa::Match got = sa::longest_repeated_suffix(host.get());
        sa::Match want = brute_force(text);
        assert(got.length == want.length && got.next_pos == want.next_pos);
      }
      assert(!sa::extend(host.get(), 1));  // full: refused, unchanged
      assert(host.get().length == n);
      assert(host.get().num_states <= sa::max_states(n));
      sa::clear(host.get());
      assert(sa::longest_repeated_suffix(host.get()).length == 0);
    }
  }
}

void test_cursor_matches_substring_scan() {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<int32_t> base, walked;
    for (int i = 0; i < 200; ++i) base.push_back(static_cast<int32_t>(rng() % 3));
    sa::HostAutomaton host(200);
    for (int32_t t : base) sa::extend(host.get(), t);
    sa::Cursor c{0, 0};
    for (int i = 0; i < 100; ++i) {
      walked.push_back(static_cast<int32_t>(rng() % 3));
      sa::advance(host.get(), c, walked.back());
      // The longest suffix of `walked` that is a substring of `base`.
      int32_t want = 0;
      for (size_t len = 1; len <= walked.size(); ++len) {
        bool found = false;
        for (size_t s = 0; s + len <= base.size() && !found; ++s) {
          found = std::equal(walked.end() - len, walked.end(), base.begin() + s);
        }
        if (!found) break;
        want = static_cast<int32_t>(len);
      }
      assert(c.length == want);
    }
  }
}

template <typename F>
void expect_throws(F f) {
  bool threw = false;
  try {
    f();
  } catch (const std::invalid_argument&) {
    threw = true;
  } catch (const std::out_of_range&) {
    threw = true;
  }
  assert(threw);
}

void test_pool_refuses_bad_input() {
  expect_throws([] { sa::SuffixAutomatonPool(0, 10); });
  expect_throws([] { sa::SuffixAutomatonPool(1, 0); });
  expect_throws([] { sa::SuffixAutomatonPool(1, 10, 3); });
  sa::SuffixAutomatonPool pool(2, 8);
  const std::vector<int32_t> prompt = {1, 2, 1};
  pool.add_request(5, prompt.data(), 3);
  expect_throws([&] { pool.add_request(5, prompt.data(), 3); });
  const std::vector<int32_t> negative = {1, -2};
  expect_throws([&] { pool.add_request(6, negative.data(), 2); });
  const std::vector<int32_t> long_text(9, 1);
  expect_throws([&] { pool.add_request(6, long_text.data(), 9); });
  pool.add_request(6, prompt.data(), 3);
  expect_throws([&] { pool.add_request(7, prompt.data(), 3); });  // slots full

  int32_t match[2], draft[4];
  const int64_t ids[2] = {5, 6};
  const int32_t accepted[4] = {2, 1, 2, 1};
  const int32_t too_long[2] = {2, 6};  // request 6 would hold 9 > 8 tokens
  expect_throws([&] { pool.extend(ids, 2, accepted, 2, too_long, 2, match, draft); });
  const int32_t over_width[2] = {3, 0};
  expect_throws([&] { pool.extend(ids, 2, accepted, 2, over_width, 2, match, draft); });
  const int64_t dup[2] = {5, 5};
  const int32_t ok[2] = {1, 1};
  expect_throws([&] { pool.extend(dup, 2, accepted, 2, ok, 2, match, draft); });
  const int64_t unknown[2] = {5, 9};
  expect_throws([&] { pool.extend(unknown, 2, accepted, 2, ok, 2, match, draft); });
  assert(pool.request_length(5) == 3 && pool.request_length(6) == 3);

  pool.extend(ids, 2, accepted, 2, ok, 2, match, draft);  // 1 2 1 2
  assert(match[0] == 2 && draft[0] == 1 && draft[1] == 2);
  pool.remove_request(5, true);
  assert(pool.num_active() == 1 && !pool.has_request(5));
  expect_throws([&] { pool.remove_request(5, true); });
}

}  // namespace

int main() {
  test_golden();
  test_random_against_brute_force();
  test_cursor_matches_substring_scan();
  test_pool_refuses_bad_input();
  std::puts("sa_test: all passed");
  return 0;
}
