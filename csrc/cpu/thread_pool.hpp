// A fixed pool of worker threads for the forward's parallel loops.
//
// A forward runs ~10 parallel loops per layer, so a loop must start in about a microsecond:
// workers spin briefly on the loop counter, then sleep on a condition variable. A loop is cut
// into chunks and every participant claims chunks until none are left, so a worker the OS has
// descheduled (a busy machine) before it claimed its chunk delays nothing: another takes it.
// The kernels give every item (a column group, a row, a tile x KV head or one of its chunks)
// the same arithmetic whichever thread runs it, so the split never changes a result.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cpu {

class ThreadPool {
 public:
  using Fn = std::function<void(int begin, int end, int thread)>;

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }

  // fn(begin, end, thread) over chunks of [0, n); returns when all are done. `thread` is the
  // participant's index in [0, size()) (for per-thread scratch). `chunks` (0: one per thread)
  // is how many pieces [0, n) is cut into: n, for a few large items, keeps any two threads'
  // shares within one item of each other. An exception out of fn ends its chunk; the others
  // run, then the first one thrown is rethrown here (in a worker it had ended the process).
  // Not reentrant.
  void parallel_for(int n, const Fn& fn, int chunks = 0);

  // No loop is coming soon (a step ended): workers sleep now instead of spinning, leaving
  // the cores to whatever runs between steps (the MTP head's torch ops, the event loop).
  void park() { park_.store(true, std::memory_order_relaxed); }

 private:
  void worker(int index);
  void run_chunks(uint32_t generation, int thread);

  int num_threads_;
  std::vector<std::thread> workers_;
  // Generation, chunk count and next chunk in one word: a claim is a CAS on all three, so a
  // worker that slept through a whole loop can never claim a chunk of the next one.
  // What the workers spin on, what they report to, and the rest: each on its own cache line,
  // so that a loop's hand-over moves few lines between cores (2 threads, a loop over 8 rows of
  // trivial work: 1.85 -> 1.1 us, with one chunk per thread and no lock while none sleeps).
  alignas(64) std::atomic<uint64_t> state_{0};
  std::atomic<const Fn*> job_{nullptr};
  std::atomic<int> items_{0};
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<bool> stop_{false}, park_{false};
  std::atomic<int> sleepers_{0};  // workers waiting on wake_: a loop takes the lock only for them
  std::atomic<bool> failed_{false};  // a chunk of this loop threw: error_ holds the first exception
  std::exception_ptr error_;
  alignas(64) std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace cpu
