// Asynchronous block I/O backends behind one small interface.
//
// A backend moves single blocks (one pread or pwrite each) with many in flight; it knows
// nothing about requests, splitting, short I/O or errors beyond reporting each block's raw
// result. The Engine (engine.h) owns all of that, so every backend stays a thin shim over
// its kernel interface. A backend is driven by exactly one thread (the engine's driver).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace offload::io {

struct BlockOp {
  int fd;
  bool is_write;
  void* buf;
  std::size_t nbytes;
  off_t offset;
  std::uint64_t tag;  // returned unchanged in the completion
};

struct BlockCompletion {
  std::uint64_t tag;
  long result;  // bytes moved (>= 0) or -errno
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Queues ops for the kernel. A backend may hold them until the next reap(), so the caller
  // always reaps after submitting. The caller never has more than queue_depth ops in flight.
  // Throws std::system_error only when the backend itself is broken; per-op failures are
  // reported as completions.
  virtual void submit(const BlockOp* ops, std::size_t num_ops) = 0;
  // Hands any held ops to the kernel, then writes up to max_completions completions to out;
  // blocks until at least one when wait is true. Returns how many were written.
  virtual std::size_t reap(BlockCompletion* out, std::size_t max_completions, bool wait) = 0;
};

// Names compiled into this build: "io_uring", "libaio", "threads". Whether one works on this
// kernel is found out by constructing it; which one backend="auto" takes is a fixed order of
// preference kept in offload/io/probe.py (BACKENDS), not this list's order.
std::vector<std::string> compiled_backends();

// Throws std::invalid_argument for an unknown name and std::system_error when the kernel
// refuses the backend (io_uring disabled by sysctl, seccomp, old kernel).
std::unique_ptr<Backend> make_backend(const std::string& name, unsigned queue_depth);

std::unique_ptr<Backend> make_io_uring_backend(unsigned queue_depth);
std::unique_ptr<Backend> make_libaio_backend(unsigned queue_depth);
std::unique_ptr<Backend> make_threads_backend(unsigned queue_depth);

}  // namespace offload::io
