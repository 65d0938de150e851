#include "common/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

#include "common/check.h"

namespace trainfast {

void Interrupt::check() {
  if (stop_requested()) throw Interrupted();
  if (!poll_ || std::this_thread::get_id() != owner_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_poll_ < interval_) return;
  last_poll_ = now;
  if (poll_()) {
    request_stop();
    throw Interrupted();
  }
}

namespace {

// The worker threads still running, which the calling thread waits for.
class RunningWorkers {
 public:
  void started() {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++num_running_;
  }

  void finished() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      --num_running_;
    }
    done_.notify_all();  // the waiter joins this thread before the object goes away
  }

  // Returns once no worker runs; polls `interrupt` (if any) meanwhile and lets what it throws
  // through (its stop flag then set): wait again without it.
  void wait(Interrupt* interrupt) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (num_running_ > 0) {
      if (interrupt != nullptr) {
        lock.unlock();
        interrupt->check();
        lock.lock();
      }
      done_.wait_for(lock, std::chrono::milliseconds(20), [this] { return num_running_ == 0; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  int num_running_ = 0;
};

}  // namespace

void run_on_threads(int num_workers, const std::function<void(int)>& worker, Interrupt* interrupt,
                    const std::function<void(std::exception_ptr)>& on_error) {
  std::vector<std::thread> threads;
  RunningWorkers running;
  try {
    threads.reserve(static_cast<size_t>(std::max(0, num_workers - 1)));
    for (int w = 1; w < num_workers; ++w) {
      running.started();
      try {
        threads.emplace_back([&worker, &running, &on_error](int index) {
          // An exception leaving a thread's function would call std::terminate.
          try {
            worker(index);
          } catch (...) {
            on_error(std::current_exception());
          }
          running.finished();
        }, w);
      } catch (...) {
        running.finished();
        throw;
      }
    }
  } catch (...) {
    on_error(std::current_exception());  // thread creation failed: stop and report
  }
  try {
    worker(0);
  } catch (...) {
    on_error(std::current_exception());
  }
  try {
    running.wait(interrupt);
  } catch (...) {
    on_error(std::current_exception());
    running.wait(nullptr);
  }
  for (auto& thread : threads) thread.join();
}

void parallel_for_each(int64_t num_items, int num_threads, const std::function<void(int64_t, int)>& fn,
                       Interrupt* interrupt) {
  TF_CHECK_ARG(num_threads >= 1, "num_threads", num_threads, "must be >= 1");
  if (num_items <= 0) return;
  const int num_workers = static_cast<int>(std::min<int64_t>(num_threads, num_items));

  std::atomic<int64_t> next_item{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  int64_t first_error_item = std::numeric_limits<int64_t>::max();
  std::mutex error_mutex;
  // Keeps the error of the lowest failing item, so the message does not depend on the thread
  // count: items are claimed in order and a claimed item always runs to its end, so every item
  // below one that failed has run. Errors of no item (thread start, Ctrl-C) come first.
  auto record_item_error = [&](std::exception_ptr error, int64_t item) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!first_error || item < first_error_item) {
      first_error = error;
      first_error_item = item;
    }
    failed.store(true);
  };
  auto record_error = [&](std::exception_ptr error) { record_item_error(error, -1); };
  auto should_stop = [&] {
    return failed.load(std::memory_order_relaxed) || (interrupt && interrupt->stop_requested());
  };
  auto run_items = [&](int worker) {
    int64_t item = -1;
    try {
      while (!should_stop()) {
        item = -1;
        if (worker == 0 && interrupt) interrupt->check();
        item = next_item.fetch_add(1);
        if (item >= num_items) break;
        fn(item, worker);
      }
    } catch (...) {
      record_item_error(std::current_exception(), item);
    }
  };

  run_on_threads(num_workers, run_items, interrupt, record_error);
  if (first_error) std::rethrow_exception(first_error);
  if (interrupt && interrupt->stop_requested()) throw Interrupted();
}

void parallel_for(int64_t num_items, int64_t block_size, int num_threads,
                  const std::function<void(int64_t, int64_t)>& body, Interrupt* interrupt) {
  TF_CHECK_ARG(block_size >= 1, "block_size", block_size, "must be >= 1");
  const int64_t num_blocks = num_items <= 0 ? 0 : (num_items - 1) / block_size + 1;
  parallel_for_each(num_blocks, num_threads, [&](int64_t block, int) {
    const int64_t begin = block * block_size;
    body(begin, std::min(num_items, begin + block_size));
  }, interrupt);
}

}  // namespace trainfast
