#include "bindings/registry.h"

namespace py = pybind11;

namespace offload::bindings {

// Placeholder until the Adam kernels land (issue 2).
void register_adam(py::module_& m) {
  m.def("adam_selected_isa", [] { return std::string("none"); });
  m.def("adam_available_isas", [] { return py::list(); });
}

}  // namespace offload::bindings
