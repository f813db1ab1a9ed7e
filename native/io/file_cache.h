// Open files kept between requests, keyed by path.
//
// [Note: file cache]
// Swap I/O issues many requests on a few large files; opening each request's file costs an
// open, an fstatfs and a close, and a path walk each time. The cache keeps up to max_files
// descriptors open, the least recently used closed first. Every lookup still stats the path
// (one system call) and opens it again when the path now names another file (replaced) or
// nothing (removed: the open then fails with ENOENT exactly as an uncached open would), so a
// request never moves bytes of a file that is no longer at its path. Permissions, like for any
// open descriptor, are checked when the file is opened, not at every request.
// A descriptor lives as long as the longest of the cache entry and the requests using it
// (shared_ptr): eviction and clear() never close a file under blocks in flight. A removed file
// whose descriptor is still cached keeps its disk space until it is evicted, clear()ed or the
// engine closes; callers that delete files they moved bytes with call Engine::close_files().
//
// [Note: held files]
// A caller that has opened a file itself, safely (O_NOFOLLOW, through directory descriptors,
// owner and mode checked: the swap space), hands the descriptor over with hold(): from then on
// requests naming that path use a duplicate of it and never resolve the path again, so a path
// swapped for a symlink or another file afterwards is not followed. Held files are not
// evicted, not stat()ed per request and not dropped by clear_cached(); release() or clear()
// lets go of them.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace offload::io {

struct OpenFile {
  OpenFile() = default;
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  ~OpenFile();

  int fd = -1;
  bool writable = false;
  bool direct = false;  // opened with O_DIRECT and the filesystem honors it
  dev_t device = 0;
  ino_t inode = 0;
};

class FileCache {
 public:
  // max_files == 0 disables caching: every acquire opens the file anew.
  explicit FileCache(std::size_t max_files) : max_files_(max_files) {}

  // The open file at path, writable when for_write (created with mode 0600 if missing).
  // Returns nullptr and sets *err to the errno of the failed open.
  std::shared_ptr<OpenFile> acquire(const std::string& path, bool for_write, int* err);
  // Requests naming path use a duplicate of fd from now on ([Note: held files]). Returns false
  // and sets *err when fd cannot be duplicated or inspected.
  bool hold(const std::string& path, int fd, int* err);
  // Lets go of a held path; false if it was not held.
  bool release(const std::string& path);
  // Drops every cached descriptor, held ones too when with_held; files still used by requests
  // close when those finish.
  void clear(bool with_held = true);
  std::size_t size() const;
  std::uint64_t num_opens() const { return num_opens_.load(); }
  std::uint64_t num_buffered_opens() const { return num_buffered_opens_.load(); }

 private:
  std::shared_ptr<OpenFile> open(const std::string& path, bool for_write, int* err);
  // Fills in direct (honored O_DIRECT), device and inode of file->fd; false and *err on error.
  bool inspect(OpenFile& file, bool direct, int* err);
  void forget_locked(const std::string& path);

  const std::size_t max_files_;
  std::atomic<std::uint64_t> num_opens_{0};
  std::atomic<std::uint64_t> num_buffered_opens_{0};
  mutable std::mutex mutex_;
  // Most recently used first; index_ points into it.
  std::list<std::pair<std::string, std::shared_ptr<OpenFile>>> lru_;
  std::unordered_map<std::string, decltype(lru_)::iterator> index_;
  std::unordered_map<std::string, std::shared_ptr<OpenFile>> held_;
};

}  // namespace offload::io
