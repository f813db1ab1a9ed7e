#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace offload {
namespace {

int default_num_threads() {
  if (const char* env = std::getenv("OFFLOAD_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

class Pool {
 public:
  Pool() { resize(default_num_threads()); }
  ~Pool() { stop_workers(); }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int num_threads) {
    std::lock_guard<std::mutex> call_guard(call_mutex_);
    stop_workers();
    stopping_ = false;
    for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  void run(std::size_t num_tasks, const std::function<void(std::size_t)>& fn) {
    if (num_tasks == 0) return;
    std::lock_guard<std::mutex> call_guard(call_mutex_);
    if (workers_.empty() || num_tasks == 1) {
      for (std::size_t t = 0; t < num_tasks; ++t) fn(t);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      num_tasks_ = num_tasks;
      next_task_.store(0);
      pending_workers_ = workers_.size();
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_workers_ == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void drain() {
    for (;;) {
      std::size_t t = next_task_.fetch_add(1);
      if (t >= num_tasks_) return;
      try {
        (*fn_)(t);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void worker_loop() {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_workers_ == 0) done_.notify_one();
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  std::mutex call_mutex_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(std::size_t)>* fn_ = nullptr;
  std::size_t num_tasks_ = 0;
  std::atomic<std::size_t> next_task_{0};
  std::size_t pending_workers_ = 0;
  std::size_t generation_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

Pool& pool() {
  static Pool* p = new Pool();  // leaked on purpose: no join during static destruction
  return *p;
}

}  // namespace

void parallel_for(std::size_t num_tasks, const std::function<void(std::size_t)>& fn) {
  pool().run(num_tasks, fn);
}

void parallel_ranges(std::size_t numel, std::size_t grain,
                     const std::function<void(std::size_t, std::size_t)>& fn) {
  if (numel == 0) return;
  if (grain == 0) throw std::invalid_argument("parallel_ranges: grain must be > 0");
  const std::size_t threads = static_cast<std::size_t>(num_threads());
  if (numel < 2 * grain || threads == 1) {
    fn(0, numel);
    return;
  }
  std::atomic<std::size_t> claimed{0};  // ranges below it are taken
  parallel_for(threads, [&](std::size_t) {
    std::size_t begin = claimed.load(std::memory_order_relaxed);
    for (;;) {
      if (begin >= numel) return;
      const std::size_t share = (numel - begin) / (2 * threads);
      const std::size_t range_numel = std::max(grain, (share + grain - 1) / grain * grain);
      const std::size_t end = std::min(numel, begin + range_numel);
      if (!claimed.compare_exchange_weak(begin, end, std::memory_order_relaxed)) continue;
      fn(begin, end);
      begin = claimed.load(std::memory_order_relaxed);
    }
  });
}

int num_threads() { return pool().size(); }

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1");
  if (n != pool().size()) pool().resize(n);
}

}  // namespace offload
