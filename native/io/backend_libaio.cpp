// Linux native AIO through raw system calls (no libaio.so at build or run time). Truly
// asynchronous only with O_DIRECT; on buffered files io_submit blocks, which is still correct.
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <system_error>

#include "io/backend.h"

namespace offload::io {
namespace {

class LibaioBackend final : public Backend {
 public:
  explicit LibaioBackend(unsigned queue_depth) : iocbs_(queue_depth), free_(queue_depth) {
    if (syscall(__NR_io_setup, queue_depth, &ctx_) < 0)
      throw std::system_error(errno, std::generic_category(), "io_setup");
    for (unsigned i = 0; i < queue_depth; ++i) free_[i] = i;
  }
  ~LibaioBackend() override { syscall(__NR_io_destroy, ctx_); }
  const char* name() const override { return "libaio"; }

  void submit(const BlockOp* ops, std::size_t num_ops) override {
    std::vector<iocb*> batch;
    for (std::size_t i = 0; i < num_ops; ++i) {
      unsigned slot = free_.back();
      free_.pop_back();
      iocb& cb = iocbs_[slot];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_data = ops[i].tag;
      cb.aio_lio_opcode = ops[i].is_write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<std::uint32_t>(ops[i].fd);
      cb.aio_buf = reinterpret_cast<std::uint64_t>(ops[i].buf);
      cb.aio_nbytes = ops[i].nbytes;
      cb.aio_offset = ops[i].offset;
      batch.push_back(&cb);
    }
    std::size_t sent = 0;
    while (sent < batch.size()) {
      long r = syscall(__NR_io_submit, ctx_, batch.size() - sent, batch.data() + sent);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        // The kernel refused the first iocb outright: report it as that op's completion.
        iocb* cb = batch[sent];
        immediate_.push_back({cb->aio_data, -static_cast<long>(errno)});
        release(cb);
        ++sent;
        continue;
      }
      sent += static_cast<std::size_t>(r);
    }
  }

  std::size_t reap(BlockCompletion* out, std::size_t max_completions, bool wait) override {
    std::size_t n = 0;
    while (n < max_completions && !immediate_.empty()) {
      out[n++] = immediate_.back();
      immediate_.pop_back();
    }
    if (n == max_completions) return n;
    io_event events[64];
    long want = static_cast<long>(std::min<std::size_t>(max_completions - n, 64));
    long min_nr = (wait && n == 0) ? 1 : 0;
    long r;
    do {
      r = syscall(__NR_io_getevents, ctx_, min_nr, want, events, nullptr);
    } while (r < 0 && errno == EINTR);
    if (r < 0) throw std::system_error(errno, std::generic_category(), "io_getevents");
    for (long i = 0; i < r; ++i) {
      out[n++] = {events[i].data, static_cast<long>(events[i].res)};
      release(reinterpret_cast<iocb*>(events[i].obj));
    }
    return n;
  }

 private:
  void release(iocb* cb) { free_.push_back(static_cast<unsigned>(cb - iocbs_.data())); }

  aio_context_t ctx_ = 0;
  std::vector<iocb> iocbs_;
  std::vector<unsigned> free_;
  std::vector<BlockCompletion> immediate_;
};

}  // namespace

std::unique_ptr<Backend> make_libaio_backend(unsigned queue_depth) {
  return std::make_unique<LibaioBackend>(queue_depth);
}

}  // namespace offload::io
