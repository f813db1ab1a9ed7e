// Portable backend: a private pool of threads each doing one blocking pread/pwrite.
// Not offload::parallel_for: that pool is for compute and would serialize with Adam.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "io/backend.h"

namespace offload::io {
namespace {

class ThreadsBackend final : public Backend {
 public:
  explicit ThreadsBackend(unsigned queue_depth) {
    unsigned num_workers = queue_depth < 64 ? queue_depth : 64;
    for (unsigned i = 0; i < num_workers; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadsBackend() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    op_ready_.notify_all();
    for (auto& t : workers_) t.join();
  }
  const char* name() const override { return "threads"; }

  void submit(const BlockOp* ops, std::size_t num_ops) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ops_.insert(ops_.end(), ops, ops + num_ops);
    }
    if (num_ops == 1) op_ready_.notify_one(); else op_ready_.notify_all();
  }

  std::size_t reap(BlockCompletion* out, std::size_t max_completions, bool wait) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (wait) done_ready_.wait(lock, [this] { return !done_.empty(); });
    std::size_t n = 0;
    while (n < max_completions && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return n;
  }

 private:
  void work() {
    for (;;) {
      BlockOp op;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        op_ready_.wait(lock, [this] { return stopping_ || !ops_.empty(); });
        if (ops_.empty()) return;
        op = ops_.front();
        ops_.pop_front();
      }
      ssize_t r;
      do {
        r = op.is_write ? ::pwrite(op.fd, op.buf, op.nbytes, op.offset)
                        : ::pread(op.fd, op.buf, op.nbytes, op.offset);
      } while (r < 0 && errno == EINTR);
      long result = r < 0 ? -static_cast<long>(errno) : static_cast<long>(r);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        done_.push_back({op.tag, result});
      }
      done_ready_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable op_ready_, done_ready_;
  std::deque<BlockOp> ops_;
  std::deque<BlockCompletion> done_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_threads_backend(unsigned queue_depth) {
  return std::make_unique<ThreadsBackend>(queue_depth);
}

}  // namespace offload::io
