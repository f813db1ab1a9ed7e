#include "bindings/registry.h"
#include "common/thread_pool.h"

namespace py = pybind11;

namespace offload::bindings {

void register_common(py::module_& m) {
  m.def("num_threads", &offload::num_threads, "Threads used by the native kernels.");
  m.def("set_num_threads", &offload::set_num_threads, py::arg("num_threads"),
        "Set the threads used by the native kernels (workers + caller).");
}

}  // namespace offload::bindings
