#include "bindings/registry.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "offload native core: CPU Adam kernels (exact and compact states), asynchronous I/O engine, CRC32C";
  offload::bindings::register_common(m);
  offload::bindings::register_adam(m);
  offload::bindings::register_io(m);
  offload::bindings::register_checksum(m);
  offload::bindings::register_compact(m);
}
