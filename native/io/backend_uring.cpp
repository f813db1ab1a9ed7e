// io_uring through raw system calls and mmap of the rings: no liburing at build or run
// time. One submission queue entry per block; the driver thread is the only user. submit()
// only fills entries; reap() hands them over and waits in the same io_uring_enter, so a
// driver loop costs one system call, not two.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

#include "io/backend.h"

namespace offload::io {
namespace {

template <typename T>
T* at(void* base, unsigned offset) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + offset);
}

unsigned load_acquire(const unsigned* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(unsigned* p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

class IoUringBackend final : public Backend {
 public:
  explicit IoUringBackend(unsigned queue_depth) {
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    // CQ twice the SQ so completions never overflow while the driver refills.
    params.flags = IORING_SETUP_CQSIZE;
    params.cq_entries = 2 * queue_depth;
    ring_fd_ = static_cast<int>(syscall(__NR_io_uring_setup, queue_depth, &params));
    if (ring_fd_ < 0) throw std::system_error(errno, std::generic_category(), "io_uring_setup");
    sq_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    single_mmap_ = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap_) sq_bytes_ = cq_bytes_ = std::max(sq_bytes_, cq_bytes_);
    sq_ring_ = map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_ring_ = single_mmap_ ? sq_ring_ : map(cq_bytes_, IORING_OFF_CQ_RING);
    sqes_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));

    sq_head_ = at<unsigned>(sq_ring_, params.sq_off.head);
    sq_tail_ = at<unsigned>(sq_ring_, params.sq_off.tail);
    sq_mask_ = *at<unsigned>(sq_ring_, params.sq_off.ring_mask);
    sq_array_ = at<unsigned>(sq_ring_, params.sq_off.array);
    cq_head_ = at<unsigned>(cq_ring_, params.cq_off.head);
    cq_tail_ = at<unsigned>(cq_ring_, params.cq_off.tail);
    cq_mask_ = *at<unsigned>(cq_ring_, params.cq_off.ring_mask);
    cqes_ = at<io_uring_cqe>(cq_ring_, params.cq_off.cqes);
    sq_entries_ = params.sq_entries;
  }

  ~IoUringBackend() override { release(); }

  const char* name() const override { return "io_uring"; }

  void submit(const BlockOp* ops, std::size_t num_ops) override {
    unsigned tail = *sq_tail_;
    for (std::size_t i = 0; i < num_ops; ++i) {
      unsigned index = tail & sq_mask_;
      io_uring_sqe* sqe = &sqes_[index];
      std::memset(sqe, 0, sizeof(*sqe));
      sqe->opcode = ops[i].is_write ? IORING_OP_WRITE : IORING_OP_READ;
      sqe->fd = ops[i].fd;
      sqe->addr = reinterpret_cast<std::uint64_t>(ops[i].buf);
      sqe->len = static_cast<unsigned>(ops[i].nbytes);
      sqe->off = static_cast<std::uint64_t>(ops[i].offset);
      sqe->user_data = ops[i].tag;
      sq_array_[index] = index;
      ++tail;
    }
    store_release(sq_tail_, tail);
  }

  std::size_t reap(BlockCompletion* out, std::size_t max_completions, bool wait) override {
    std::size_t n = drain(out, max_completions);
    enter(n == 0 && wait ? 1 : 0);
    if (n == 0) n = drain(out, max_completions);
    return n;
  }

 private:
  void* map(std::size_t bytes, off_t what) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd_,
                   what);
    if (p == MAP_FAILED) {
      int err = errno;
      release();
      throw std::system_error(err, std::generic_category(), "mmap of io_uring ring");
    }
    return p;
  }

  void release() {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (cq_ring_ && !single_mmap_) munmap(cq_ring_, cq_bytes_);
    if (sq_ring_) munmap(sq_ring_, sq_bytes_);
    if (ring_fd_ >= 0) close(ring_fd_);
    sqes_ = nullptr;
    sq_ring_ = cq_ring_ = nullptr;
    ring_fd_ = -1;
  }

  // Hands every queued SQE to the kernel; with min_complete, also waits for a CQE.
  void enter(unsigned min_complete) {
    for (;;) {
      unsigned to_submit = *sq_tail_ - load_acquire(sq_head_);
      if (to_submit == 0 && min_complete == 0) return;
      unsigned flags = min_complete ? IORING_ENTER_GETEVENTS : 0;
      long r = syscall(__NR_io_uring_enter, ring_fd_, to_submit, min_complete, flags, nullptr, 0);
      if (r < 0) {
        if (errno == EINTR) continue;
        // EAGAIN/EBUSY: the kernel wants completions reaped first; the driver will, and
        // the SQEs still queued go in with the next enter.
        if (errno == EAGAIN || errno == EBUSY) return;
        throw std::system_error(errno, std::generic_category(), "io_uring_enter");
      }
      if (min_complete) {
        if (load_acquire(cq_tail_) != *cq_head_) return;
        continue;
      }
      if (*sq_tail_ == load_acquire(sq_head_)) return;
    }
  }

  std::size_t drain(BlockCompletion* out, std::size_t max_completions) {
    unsigned head = *cq_head_;
    unsigned tail = load_acquire(cq_tail_);
    std::size_t n = 0;
    while (head != tail && n < max_completions) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      out[n++] = {cqe.user_data, static_cast<long>(cqe.res)};
      ++head;
    }
    store_release(cq_head_, head);
    return n;
  }

  int ring_fd_ = -1;
  bool single_mmap_ = false;
  std::size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  unsigned *sq_head_, *sq_tail_, *sq_array_, *cq_head_, *cq_tail_;
  unsigned sq_mask_, cq_mask_, sq_entries_;
  io_uring_cqe* cqes_;
};

}  // namespace

std::unique_ptr<Backend> make_io_uring_backend(unsigned queue_depth) {
  return std::make_unique<IoUringBackend>(queue_depth);
}

}  // namespace offload::io
