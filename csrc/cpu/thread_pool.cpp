#include "thread_pool.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "numerics.hpp"

namespace cpu {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// About 50-100 us of spinning: longer than the gap between two loops of one forward,
// shorter than the Python work between two steps.
constexpr int kSpinIterations = 20000;
// One chunk per thread: a thread that has not claimed its chunk yet (late, descheduled) leaves
// it to the others. Fewer, longer chunks keep each thread's weight stream in one piece (on a
// Xeon, 2 threads, 1,024-token context, caches flushed: 8 rows took 12.3 ms with 4 per thread,
// 11.5 with 2 and 11.3 with 1; 1 row 7.1, 6.8 and 6.9; 8 was slower still) and take fewer
// claims, each a cache line passed between cores (a loop over 8 rows of trivial work on 2
// threads: 1.5 us with 2 per thread, 1.1 with 1).
constexpr int kChunksPerThread = 1;

// state = generation (24 bits) | chunks (20 bits) | next chunk (20 bits).
inline uint32_t generation_of(uint64_t state) { return static_cast<uint32_t>(state >> 40); }
inline int chunks_of(uint64_t state) { return static_cast<int>((state >> 20) & 0xFFFFFu); }
inline int next_of(uint64_t state) { return static_cast<int>(state & 0xFFFFFu); }

}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads) {
  if (num_threads < 1 || num_threads > 256) {
    throw std::invalid_argument("num_threads must be in [1, 256], got " + std::to_string(num_threads));
  }
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back(&ThreadPool::worker, this, i);
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunks(uint32_t generation, int thread) {
  for (;;) {
    uint64_t state = state_.load(std::memory_order_acquire);
    if (generation_of(state) != generation) return;
    const int chunk = next_of(state), chunks = chunks_of(state);
    if (chunk >= chunks) return;
    const Fn* fn = job_.load(std::memory_order_relaxed);
    const int n = items_.load(std::memory_order_relaxed);
    // The claim validates what was read: the loop cannot end while chunk `chunk` is unclaimed.
    if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) continue;
    const int begin = static_cast<int>(static_cast<int64_t>(n) * chunk / chunks);
    const int end = static_cast<int>(static_cast<int64_t>(n) * (chunk + 1) / chunks);
    try {
      (*fn)(begin, end, thread);
    } catch (...) {  // the loop's other chunks still run: the caller's fn outlives none of them
      if (!failed_.exchange(true)) error_ = std::current_exception();
    }
    done_.fetch_add(1, std::memory_order_acq_rel);  // publishes error_ to the caller
  }
}

void ThreadPool::parallel_for(int n, const Fn& fn, int chunks) {
  if (n <= 0) return;
  if (num_threads_ == 1 || n == 1) {
    fn(0, n, 0);
    return;
  }
  chunks = std::min(n, chunks > 0 ? std::min(chunks, 0xFFFFF) : num_threads_ * kChunksPerThread);
  park_.store(false, std::memory_order_relaxed);
  job_.store(&fn, std::memory_order_relaxed);
  items_.store(n, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  const uint32_t generation = (generation_of(state_.load(std::memory_order_relaxed)) + 1) & 0xFFFFFFu;
  state_.store((static_cast<uint64_t>(generation) << 40) | (static_cast<uint64_t>(chunks) << 20));
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mutex_); }  // a worker about to sleep sees the new loop
    wake_.notify_all();
  }
  run_chunks(generation, 0);
  for (int spins = 0; done_.load(std::memory_order_acquire) != chunks; ++spins) {
    if (spins < kSpinIterations) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
  if (failed_.load(std::memory_order_relaxed)) {
    failed_.store(false, std::memory_order_relaxed);
    std::rethrow_exception(std::exchange(error_, nullptr));
  }
}

void ThreadPool::worker(int index) {
  const CanonicalFloatEnv canonical;  // not its creator's: a worker only ever runs chunks
  uint32_t seen = 0;
  for (;;) {
    int spins = 0;
    while (generation_of(state_.load(std::memory_order_acquire)) == seen) {
      if (stop_.load(std::memory_order_relaxed)) return;
      if (++spins < kSpinIterations && !park_.load(std::memory_order_relaxed)) {
        cpu_relax();
        continue;
      }
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] { return stop_.load() || generation_of(state_.load()) != seen; });
      sleepers_.fetch_sub(1);
      if (stop_.load()) return;
    }
    seen = generation_of(state_.load(std::memory_order_acquire));
    run_chunks(seen, index);
  }
}

}  // namespace cpu
