// Data-parallel loops and cooperative interruption.
//
// Workers are created per call, so no thread outlives the call (nothing is left running across a
// fork()). Work is claimed in fixed blocks and every block writes only its own outputs, so results
// never depend on the thread count.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <thread>

namespace trainfast {

// Lets the thread that started a computation ask its caller whether to stop (the Python bindings
// poll for Ctrl-C). The thread that created it polls; other threads only read the flag.
class Interrupt {
 public:
  using PollFn = std::function<bool()>;  // true: the caller asked to stop

  Interrupt() = default;
  explicit Interrupt(PollFn poll, std::chrono::milliseconds interval = std::chrono::milliseconds(50))
      : poll_(std::move(poll)), interval_(interval), owner_(std::this_thread::get_id()) {}

  // Throws Interrupted when asked to stop. Safe from any thread: only the creating thread polls
  // the caller (at most once per interval), worker threads just read the flag. Cheap.
  void check();
  bool stop_requested() const { return stop_.load(std::memory_order_relaxed); }
  void request_stop() { stop_.store(true, std::memory_order_relaxed); }

 private:
  PollFn poll_;
  std::chrono::milliseconds interval_{50};
  std::chrono::steady_clock::time_point last_poll_{};
  std::thread::id owner_{};
  std::atomic<bool> stop_{false};
};

// Runs worker(0) on the calling thread and worker(1 .. num_workers - 1) on threads of their own,
// and returns once all have ended. While it waits for the others, the calling thread keeps
// polling `interrupt` (workers only read its stop flag, so a Ctrl-C during another thread's long
// last item would otherwise wait for that item). `on_error` gets what starting a thread, the
// polling or a worker threw (the others are still waited for); it must not throw.
void run_on_threads(int num_workers, const std::function<void(int)>& worker, Interrupt* interrupt,
                    const std::function<void(std::exception_ptr)>& on_error);

// Runs fn(item, worker) for every item in [0, num_items) on up to num_threads workers (worker 0 is
// the calling thread, which also polls `interrupt`). Workers claim items in order, so each worker
// sees its items in increasing order. The exception of the lowest failing item (the same one for
// any thread count) is rethrown after all threads have joined.
void parallel_for_each(int64_t num_items, int num_threads, const std::function<void(int64_t, int)>& fn,
                       Interrupt* interrupt = nullptr);

// Runs body(begin, end) over [0, num_items) in blocks of block_size on up to num_threads threads
// (the calling thread included, which also polls `interrupt`). The exception of the lowest failing
// block is rethrown after all threads have joined.
void parallel_for(int64_t num_items, int64_t block_size, int num_threads,
                  const std::function<void(int64_t, int64_t)>& body, Interrupt* interrupt = nullptr);

}  // namespace trainfast
