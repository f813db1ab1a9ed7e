#include "io/file_cache.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>

namespace offload::io {

OpenFile::~OpenFile() {
  if (fd >= 0) ::close(fd);
}

std::shared_ptr<OpenFile> FileCache::open(const std::string& path, bool for_write, int* err) {
  int flags = (for_write ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC;
  int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
  bool direct = fd >= 0;
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) {
    *err = errno;
    return nullptr;
  }
  num_opens_.fetch_add(1);
  auto file = std::make_shared<OpenFile>();
  file->fd = fd;
  file->writable = for_write;
  if (!inspect(*file, direct, err)) return nullptr;  // ~OpenFile closes fd
  return file;
}

bool FileCache::inspect(OpenFile& file, bool direct, int* err) {
  if (direct) {
    // tmpfs accepts O_DIRECT since Linux 6.6 but serves it from the page cache; treat it as
    // buffered so the caller learns that its data does not bypass RAM.
    struct statfs fs;
    if (fstatfs(file.fd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC)) {
      if (fcntl(file.fd, F_SETFL, fcntl(file.fd, F_GETFL) & ~O_DIRECT) == 0) direct = false;
    }
  }
  file.direct = direct;
  if (!direct) num_buffered_opens_.fetch_add(1);
  struct stat st;
  if (fstat(file.fd, &st) != 0) {
    *err = errno;
    return false;
  }
  file.device = st.st_dev;
  file.inode = st.st_ino;
  return true;
}

bool FileCache::hold(const std::string& path, int fd, int* err) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0) {
    *err = errno;
    return false;
  }
  auto file = std::make_shared<OpenFile>();
  // A duplicate shares the open file description (and so its O_DIRECT flag) with fd.
  file->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (file->fd < 0) {
    *err = errno;
    return false;
  }
  file->writable = (flags & O_ACCMODE) == O_RDWR || (flags & O_ACCMODE) == O_WRONLY;
  if (!inspect(*file, (flags & O_DIRECT) != 0, err)) return false;
  num_opens_.fetch_add(1);
  std::lock_guard<std::mutex> lock(mutex_);
  forget_locked(path);
  held_[path] = std::move(file);
  return true;
}

bool FileCache::release(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_.erase(path) > 0;
}

std::shared_ptr<OpenFile> FileCache::acquire(const std::string& path, bool for_write, int* err) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = held_.find(path);
    if (it != held_.end()) {  // [Note: held files] never resolved by path again
      if (for_write && !it->second->writable) {
        *err = EBADF;
        return nullptr;
      }
      return it->second;
    }
  }
  if (max_files_ == 0) return open(path, for_write, err);
  // Outside the lock: a stat and an open must not serialize other submitting threads.
  struct stat st;
  bool exists = ::stat(path.c_str(), &st) == 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(path);
    if (it != index_.end()) {
      const std::shared_ptr<OpenFile>& file = it->second->second;
      if (exists && file->device == st.st_dev && file->inode == st.st_ino &&
          (file->writable || !for_write)) {
        lru_.splice(lru_.begin(), lru_, it->second);
        return file;
      }
      forget_locked(path);  // replaced, removed, or opened read-only and now written
    }
  }
  std::shared_ptr<OpenFile> file = open(path, for_write, err);
  if (!file) return nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  forget_locked(path);  // another thread may have opened it meanwhile; the newest wins
  lru_.emplace_front(path, file);
  index_[path] = lru_.begin();
  while (lru_.size() > max_files_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return file;
}

void FileCache::forget_locked(const std::string& path) {
  auto it = index_.find(path);
  if (it == index_.end()) return;
  lru_.erase(it->second);
  index_.erase(it);
}

void FileCache::clear(bool with_held) {
  std::lock_guard<std::mutex> lock(mutex_);
  index_.clear();
  lru_.clear();
  if (with_held) held_.clear();
}

std::size_t FileCache::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lru_.size() + held_.size();
}

}  // namespace offload::io
