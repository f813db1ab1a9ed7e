#include "io/engine.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <ctime>

namespace offload::io {

namespace {
double monotonic_seconds() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
}  // namespace

namespace {

bool is_aligned(std::uint64_t v) { return v % kAlignBytes == 0; }
std::uint64_t align_down(std::uint64_t v) { return v - v % kAlignBytes; }
std::uint64_t align_up(std::uint64_t v) { return align_down(v + kAlignBytes - 1); }

std::string describe(const Request& r, bool is_write, std::size_t nbytes, std::uint64_t offset,
                     std::size_t request_nbytes, std::uint64_t request_offset) {
  std::string s = std::string(is_write ? "write" : "read") + " of " + std::to_string(nbytes) +
                  " bytes at offset " + std::to_string(offset);
  if (nbytes != request_nbytes || offset != request_offset)
    s += " (request: " + std::to_string(request_nbytes) + " bytes at offset " +
         std::to_string(request_offset) + ")";
  return s + " of '" + r.path() + "'";
}

// pread/pwrite until done, EOF (reads) or an error. Returns bytes moved or -errno.
long long full_transfer(int fd, bool is_write, char* buf, std::size_t nbytes, off_t offset) {
  std::size_t done = 0;
  while (done < nbytes) {
    ssize_t r = is_write ? ::pwrite(fd, buf + done, nbytes - done, offset + done)
                         : ::pread(fd, buf + done, nbytes - done, offset + done);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -static_cast<long long>(errno);
    }
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return static_cast<long long>(done);
}

struct AlignedBuffer {
  explicit AlignedBuffer(std::size_t nbytes) {
    if (posix_memalign(&ptr, kAlignBytes, nbytes ? nbytes : kAlignBytes) != 0) ptr = nullptr;
  }
  ~AlignedBuffer() { std::free(ptr); }
  char* data() { return static_cast<char*>(ptr); }
  void* ptr = nullptr;
};

}  // namespace

long long Request::wait() {
  if (!done()) {
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [this] { return done(); });
  }
  return error_code_ ? -1 : static_cast<long long>(nbytes_);
}

void Request::fail(int err, const std::string& what) {
  if (failed_) return;  // the first error is the one reported
  failed_ = true;
  error_code_ = err ? err : EIO;
  error_message_ = what + " failed: " + std::strerror(error_code_) + " (errno " +
                   std::to_string(error_code_) + ")";
}

Engine::Engine(const std::string& backend, std::size_t block_bytes, unsigned queue_depth,
               std::size_t max_open_files)
    : backend_name_(backend),
      block_bytes_(block_bytes),
      queue_depth_(queue_depth),
      files_(max_open_files) {
  if (block_bytes == 0 || !is_aligned(block_bytes) || block_bytes > (1u << 30))
    throw std::invalid_argument("block_bytes must be a positive multiple of 4096 up to 1 GiB, got " +
                                std::to_string(block_bytes));
  if (queue_depth == 0 || queue_depth > 4096)
    throw std::invalid_argument("queue_depth must be in [1, 4096], got " +
                                std::to_string(queue_depth));
  backend_ = make_backend(backend, queue_depth);
  blocks_.resize(queue_depth);
  for (unsigned i = queue_depth; i-- > 0;) free_slots_.push_back(i);
  driver_ = std::thread([this] { drive(); });
}

Engine::~Engine() { close(); }

void Engine::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    stopping_ = true;
  }
  work_ready_.notify_all();
  if (driver_.joinable()) driver_.join();
  backend_.reset();
  files_.clear();
}

std::shared_ptr<Request> Engine::submit(bool is_write, void* buf, std::size_t nbytes,
                                        const std::string& path, std::uint64_t offset) {
  auto r = std::make_shared<Request>();
  r->path_ = path;
  r->is_write_ = is_write;
  r->buf_ = static_cast<char*>(buf);
  r->nbytes_ = nbytes;
  r->offset_ = offset;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) throw std::logic_error("I/O engine is closed");
  }
  int err = 0;
  r->file_ = files_.acquire(path, is_write, &err);
  if (!r->file_)
    r->fail(err, std::string("open of '") + path + "' for " + (is_write ? "write" : "read"));
  else if (r->file_->direct)
    r->bounced_ = !is_aligned(reinterpret_cast<std::uintptr_t>(buf)) || !is_aligned(offset) ||
                  !is_aligned(nbytes);
  if (r->failed_ || nbytes == 0) {
    r->file_.reset();
    r->started_ = r->finished_at_ = monotonic_seconds();
    r->done_.store(true, std::memory_order_release);
    return r;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back(r);
    ++num_unfinished_;
  }
  work_ready_.notify_one();
  return r;
}

void Engine::hold_file(const std::string& path, int fd) {
  int err = 0;
  if (!files_.hold(path, fd, &err))
    throw std::system_error(err, std::generic_category(), "hold of '" + path + "' (fd " +
                                                              std::to_string(fd) + ")");
}

void Engine::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return num_unfinished_ == 0; });
}

BlockOp Engine::op_for(std::uint64_t slot) const {
  const Block& b = blocks_[slot];
  const Request& r = *b.request;
  std::size_t start = b.request_offset + b.done_bytes;
  return BlockOp{r.file_->fd, r.is_write_, r.buf_ + start, b.nbytes - b.done_bytes,
                 static_cast<off_t>(r.offset_ + start), slot};
}

bool Engine::on_completion(Block& b, long result) {
  Request& r = *b.request;
  std::size_t remaining = b.nbytes - b.done_bytes;
  std::uint64_t file_offset = r.offset_ + b.request_offset + b.done_bytes;
  auto what = [&] {
    return describe(r, r.is_write_, remaining, file_offset, r.nbytes_, r.offset_);
  };
  if (result < 0) {
    r.fail(static_cast<int>(-result), what());
    return true;
  }
  std::size_t moved = static_cast<std::size_t>(result);
  if (moved > remaining) moved = remaining;
  b.done_bytes += moved;
  if (b.done_bytes == b.nbytes) return true;
  // Short transfer. Zero progress, or an O_DIRECT remainder that cannot be aligned, means
  // the end of the file (reads) or of the space (writes), not a transient condition.
  if (moved == 0 || (r.file_->direct && !is_aligned(moved))) {
    if (r.is_write_) r.fail(ENOSPC, what() + " (short write)");
    else r.fail(ENODATA, what() + " (end of file reached)");
    return true;
  }
  return false;
}

void Engine::finish(const std::shared_ptr<Request>& rp) {
  Request& r = *rp;
  if (!r.failed_ && r.is_write_ && !r.file_->direct && ::fdatasync(r.file_->fd) != 0)
    r.fail(errno, "fdatasync after " + describe(r, true, r.nbytes_, r.offset_, r.nbytes_, r.offset_));
  r.file_.reset();  // closes the file if the cache has let go of it
  r.finished_at_ = monotonic_seconds();
  if (r.started_ == 0.0) r.started_ = r.finished_at_;  // failed before a block was issued
  {
    std::lock_guard<std::mutex> lock(r.mutex_);
    r.done_.store(true, std::memory_order_release);
  }
  r.finished_.notify_all();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --num_unfinished_;
  }
  idle_.notify_all();
}

void Engine::run_bounced(Request& r) {
  r.started_ = monotonic_seconds();
  std::uint64_t start = align_down(r.offset_);
  std::uint64_t end = align_up(r.offset_ + r.nbytes_);
  std::size_t span = static_cast<std::size_t>(end - start);
  std::size_t lead = static_cast<std::size_t>(r.offset_ - start);
  const int fd = r.file_->fd;
  auto what = [&] { return describe(r, r.is_write_, r.nbytes_, r.offset_, r.nbytes_, r.offset_); };
  AlignedBuffer bounce(span);
  if (!bounce.data()) return r.fail(ENOMEM, what() + " (bounce buffer)");
  if (!r.is_write_) {
    long long got = full_transfer(fd, false, bounce.data(), span, start);
    if (got < 0) return r.fail(static_cast<int>(-got), what());
    if (static_cast<std::uint64_t>(got) < lead + r.nbytes_)
      return r.fail(ENODATA, what() + " (end of file reached)");
    std::memcpy(r.buf_, bounce.data() + lead, r.nbytes_);
    return;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return r.fail(errno, what() + " (fstat)");
  // Read-modify-write of the partial first and last blocks; past EOF they read as zeros.
  std::memset(bounce.data(), 0, span);
  bool partial_head = lead != 0;
  bool partial_tail = end != r.offset_ + r.nbytes_;
  if (partial_head) {
    long long got = full_transfer(fd, false, bounce.data(), kAlignBytes, start);
    if (got < 0) return r.fail(static_cast<int>(-got), what() + " (read-modify-write)");
  }
  if (partial_tail && (span > kAlignBytes || !partial_head)) {
    long long got = full_transfer(fd, false, bounce.data() + span - kAlignBytes, kAlignBytes,
                                  end - kAlignBytes);
    if (got < 0) return r.fail(static_cast<int>(-got), what() + " (read-modify-write)");
  }
  std::memcpy(bounce.data() + lead, r.buf_, r.nbytes_);
  long long put = full_transfer(fd, true, bounce.data(), span, start);
  if (put < 0) return r.fail(static_cast<int>(-put), what());
  if (static_cast<std::size_t>(put) < span) return r.fail(ENOSPC, what() + " (short write)");
  // The padded write may have grown the file past the request's end; give it back the size
  // a plain pwrite would have left.
  std::uint64_t want_size = std::max<std::uint64_t>(st.st_size, r.offset_ + r.nbytes_);
  if (end > want_size && ::ftruncate(fd, static_cast<off_t>(want_size)) != 0)
    return r.fail(errno, what() + " (ftruncate to " + std::to_string(want_size) + ")");
}

void Engine::drive() {
  std::vector<BlockOp> batch;
  std::vector<BlockCompletion> completions(queue_depth_);
  batch.reserve(queue_depth_);
  for (;;) {
    std::shared_ptr<Request> barrier;
    std::vector<std::shared_ptr<Request>> failed_early;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty() || in_flight_ > 0; });
      if (stopping_ && queue_.empty() && in_flight_ == 0) return;
      while (!free_slots_.empty() && !queue_.empty()) {
        std::shared_ptr<Request> r = queue_.front();
        if (r->bounced_ || broken_errno_) {
          if (in_flight_ > 0) break;
          queue_.pop_front();
          barrier = r;
          break;
        }
        if (r->failed_ && r->blocks_in_flight_ == 0) {  // failed between refills
          queue_.pop_front();
          failed_early.push_back(r);
          continue;
        }
        if (r->failed_) break;  // its in-flight blocks finish it
        std::uint64_t slot = free_slots_.back();
        free_slots_.pop_back();
        std::size_t n = std::min(block_bytes_, r->nbytes_ - r->issued_bytes_);
        if (r->issued_bytes_ == 0) r->started_ = monotonic_seconds();
        blocks_[slot] = Block{r, r->issued_bytes_, n, 0};
        r->issued_bytes_ += n;
        ++r->blocks_in_flight_;
        ++in_flight_;
        batch.push_back(op_for(slot));
        if (r->issued_bytes_ == r->nbytes_) queue_.pop_front();
      }
    }
    for (auto& r : failed_early) finish(r);
    if (barrier) {
      if (broken_errno_)
        barrier->fail(broken_errno_, describe(*barrier, barrier->is_write_, barrier->nbytes_,
                                              barrier->offset_, barrier->nbytes_, barrier->offset_) +
                                         " (I/O backend " + backend_name_ + " broken)");
      else
        run_bounced(*barrier);
      finish(barrier);
      continue;
    }
    std::size_t num_done = 0;
    try {
      if (!batch.empty()) backend_->submit(batch.data(), batch.size());
      batch.clear();
      if (in_flight_ > 0) num_done = backend_->reap(completions.data(), completions.size(), true);
    } catch (const std::system_error& e) {
      // The backend itself broke: fail everything in flight and every later request. The
      // kernel cannot be asked about lost blocks, so they are reported, not waited for.
      broken_errno_ = e.code().value() ? e.code().value() : EIO;
      batch.clear();
      for (std::uint64_t slot = 0; slot < blocks_.size(); ++slot) {
        Block& b = blocks_[slot];
        if (!b.request) continue;
        completions[num_done++] = {slot, -static_cast<long>(broken_errno_)};
      }
    }
    for (std::size_t i = 0; i < num_done; ++i) {
      std::uint64_t slot = completions[i].tag;
      Block& b = blocks_[slot];
      if (!on_completion(b, completions[i].result)) {
        batch.push_back(op_for(slot));  // continue the short transfer, same slot
        continue;
      }
      std::shared_ptr<Request> r = std::move(b.request);
      b = Block{};
      --in_flight_;
      --r->blocks_in_flight_;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        free_slots_.push_back(slot);
        if (r->failed_ && !queue_.empty() && queue_.front() == r) queue_.pop_front();
      }
      if (r->blocks_in_flight_ == 0 && (r->failed_ || r->issued_bytes_ == r->nbytes_)) finish(r);
    }
  }
}

}  // namespace offload::io
