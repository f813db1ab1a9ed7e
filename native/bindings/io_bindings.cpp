#include "bindings/registry.h"

namespace py = pybind11;

namespace offload::bindings {

// Placeholder until the I/O engine lands (issue 3).
void register_io(py::module_& m) {
  m.def("io_available_backends", [] { return py::list(); });
}

}  // namespace offload::bindings
