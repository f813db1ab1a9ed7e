// The asynchronous I/O engine: requests of any size, split into blocks kept in flight on a
// Backend by one driver thread.
//
// [Note: request lifecycle]
// submit() takes the file from the FileCache in the calling thread (opened O_DIRECT unless the
// filesystem cannot honor it; see [Note: file cache] in file_cache.h) and queues a Request; the
// Request holds the file open until it is finished. An open failure completes the request at
// once with that error,
// so every error, whatever its stage, is observed through Request::wait(). The driver thread
// takes blocks of at most block_bytes from the queue head while fewer than queue_depth are in
// flight, hands them to the backend, reaps completions, continues short transfers, and
// finishes a request when its last block is back: on an error it stops issuing that request's
// blocks but still reaps the ones in flight, so no buffer is ever written after its request
// is reported done. A request whose buffer, offset or length is not 4 KiB aligned (O_DIRECT
// files only) is a barrier: the driver waits for everything in flight, moves it synchronously
// through an aligned bounce buffer (read-modify-write for partial blocks of writes), and only
// then continues, so its read-modify-write never races with this engine's other requests.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/backend.h"
#include "io/file_cache.h"

namespace offload::io {

constexpr std::size_t kAlignBytes = 4096;

class Request {
 public:
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Blocks until the request is finished. Returns the bytes moved, or -1 after an error
  // (then error_code() and error_message() say what happened).
  long long wait();
  int error_code() const { return error_code_; }
  const std::string& error_message() const { return error_message_; }
  const std::string& path() const { return path_; }
  // CLOCK_MONOTONIC seconds (Python's time.perf_counter on Linux) at which the first block
  // went to the backend and at which the request finished; valid once done(). A request
  // that failed before any block was issued has started() == finished().
  double started() const { return started_; }
  double finished() const { return finished_at_; }

 private:
  friend class Engine;
  void fail(int err, const std::string& what);

  // Set once in submit().
  std::string path_;
  bool is_write_ = false;
  char* buf_ = nullptr;
  std::size_t nbytes_ = 0;
  std::uint64_t offset_ = 0;
  std::shared_ptr<OpenFile> file_;  // released by Engine::finish
  bool bounced_ = false;
  // Progress, touched only by the driver thread.
  std::size_t issued_bytes_ = 0;
  double started_ = 0.0;
  unsigned blocks_in_flight_ = 0;
  bool failed_ = false;
  // Result, published by done_.
  double finished_at_ = 0.0;
  int error_code_ = 0;
  std::string error_message_;
  std::atomic<bool> done_{false};
  std::mutex mutex_;
  std::condition_variable finished_;
};

class Engine {
 public:
  // max_open_files: descriptors kept open between requests (0: open and close per request).
  // Throws std::invalid_argument for bad arguments and std::system_error when the backend
  // cannot be created on this kernel.
  Engine(const std::string& backend, std::size_t block_bytes, unsigned queue_depth,
         std::size_t max_open_files);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // buf must stay valid until the returned request is done.
  std::shared_ptr<Request> submit(bool is_write, void* buf, std::size_t nbytes,
                                  const std::string& path, std::uint64_t offset);
  // Blocks until every submitted request is finished (errors stay in the requests).
  void wait_all();
  // Waits for everything and stops the driver; idempotent. Later submits throw.
  void close();

  const std::string& backend_name() const { return backend_name_; }
  // Closes the cached descriptors (requests in flight keep theirs until they finish), so
  // files removed after moving bytes with this engine give their space back now. Held files
  // ([Note: held files] in file_cache.h) stay until release_file() or close().
  void close_files() { files_.clear(false); }
  // Requests naming path use a duplicate of fd from now on, never resolving path again.
  // Throws std::system_error when fd cannot be duplicated or inspected.
  void hold_file(const std::string& path, int fd);
  bool release_file(const std::string& path) { return files_.release(path); }
  std::size_t num_open_files() const { return files_.size(); }
  // Opens so far, and those of them without O_DIRECT because the filesystem cannot honor it.
  std::uint64_t num_opens() const { return files_.num_opens(); }
  std::uint64_t num_buffered_opens() const { return files_.num_buffered_opens(); }

 private:
  struct Block {
    std::shared_ptr<Request> request;
    std::size_t request_offset = 0;  // where the block starts inside the request
    std::size_t nbytes = 0;
    std::size_t done_bytes = 0;
  };

  void drive();
  BlockOp op_for(std::uint64_t slot) const;
  // Returns true when the block is finished (fully moved or failed), false to resubmit.
  bool on_completion(Block& block, long result);
  void finish(const std::shared_ptr<Request>& request);
  void run_bounced(Request& request);

  std::string backend_name_;
  std::size_t block_bytes_;
  unsigned queue_depth_;
  std::unique_ptr<Backend> backend_;
  FileCache files_;

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable idle_;
  std::deque<std::shared_ptr<Request>> queue_;
  std::size_t num_unfinished_ = 0;
  bool stopping_ = false;
  bool closed_ = false;

  // Driver-thread state.
  std::vector<Block> blocks_;
  std::vector<std::uint64_t> free_slots_;
  unsigned in_flight_ = 0;
  int broken_errno_ = 0;  // the backend itself failed; every later request fails with it

  std::thread driver_;
};

}  // namespace offload::io
