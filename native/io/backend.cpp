#include "io/backend.h"

#include <stdexcept>

namespace offload::io {

std::vector<std::string> compiled_backends() { return {"io_uring", "libaio", "threads"}; }

std::unique_ptr<Backend> make_backend(const std::string& name, unsigned queue_depth) {
  if (name == "io_uring") return make_io_uring_backend(queue_depth);
  if (name == "libaio") return make_libaio_backend(queue_depth);
  if (name == "threads") return make_threads_backend(queue_depth);
  throw std::invalid_argument("unknown I/O backend '" + name +
                              "'; expected one of io_uring, libaio, threads");
}

}  // namespace offload::io
