#include "common/parallel.h"

#include <algorithm>
#include <exception>
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

void RunningWorkers::started() {
  const std::lock_guard<std::mutex> lock(mutex_);
  ++num_running_;
}

void RunningWorkers::finished() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    --num_running_;
  }
  done_.notify_all();  // the waiter joins this thread before the object goes away
}

void RunningWorkers::wait(Interrupt* interrupt) {
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

void parallel_for(int64_t num_items, int64_t block_size, int num_threads,
                  const std::function<void(int64_t, int64_t)>& body, Interrupt* interrupt) {
  TF_CHECK_ARG(num_threads >= 1, "num_threads", num_threads, "must be >= 1");
  TF_CHECK_ARG(block_size >= 1, "block_size", block_size, "must be >= 1");
  if (num_items <= 0) return;
  const int64_t num_blocks = (num_items + block_size - 1) / block_size;
  const int num_workers = static_cast<int>(std::min<int64_t>(num_threads, num_blocks));

  std::atomic<int64_t> next_block{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto record_error = [&](std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!first_error) first_error = error;
    failed.store(true);
  };
  auto should_stop = [&] {
    return failed.load(std::memory_order_relaxed) || (interrupt && interrupt->stop_requested());
  };
  auto run_blocks = [&](bool is_caller) {
    try {
      while (!should_stop()) {
        if (is_caller && interrupt) interrupt->check();
        const int64_t block = next_block.fetch_add(1);
        if (block >= num_blocks) break;
        const int64_t begin = block * block_size;
        body(begin, std::min(num_items, begin + block_size));
      }
    } catch (...) {
      record_error(std::current_exception());
    }
  };

  std::vector<std::thread> workers;
  workers.reserve(num_workers - 1);
  RunningWorkers running;
  try {
    for (int i = 1; i < num_workers; ++i) {
      running.started();
      try {
        workers.emplace_back([&] {
          run_blocks(false);
          running.finished();
        });
      } catch (...) {
        running.finished();
        throw;
      }
    }
  } catch (...) {
    record_error(std::current_exception());  // thread creation failed: stop and report
  }
  run_blocks(true);
  try {
    running.wait(interrupt);
  } catch (...) {
    record_error(std::current_exception());
    running.wait(nullptr);
  }
  for (auto& worker : workers) worker.join();
  if (first_error) std::rethrow_exception(first_error);
  if (interrupt && interrupt->stop_requested()) throw Interrupted();
}

}  // namespace trainfast
