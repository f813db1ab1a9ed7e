#include <cstdint>

#include "bindings/registry.h"
#include "common/bandwidth.h"
#include "common/thread_pool.h"

namespace py = pybind11;

namespace offload::bindings {

void register_common(py::module_& m) {
  m.def("num_threads", &offload::num_threads, "Threads used by the native kernels.");
  m.def("set_num_threads", &offload::set_num_threads, py::arg("num_threads"),
        "Set the threads used by the native kernels (workers + caller).");
  // Benchmark yardsticks: tools/bench_adam.py allocates and checks the buffers.
  m.def(
      "stream_triad",
      [](std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, std::size_t numel, float scalar) {
        offload::stream_triad(reinterpret_cast<float*>(a), reinterpret_cast<const float*>(b),
                              reinterpret_cast<const float*>(c), numel, scalar);
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("a"), py::arg("b"), py::arg("c"),
      py::arg("numel"), py::arg("scalar"),
      "STREAM triad a = b + scalar * c over float32 buffers given by address, with streaming "
      "stores to a (12 B/element of memory traffic). Releases the GIL.");
  m.def(
      "adam_traffic",
      [](std::uintptr_t param, std::uintptr_t grad, std::uintptr_t exp_avg,
         std::uintptr_t exp_avg_sq, std::size_t numel) {
        offload::adam_traffic(reinterpret_cast<float*>(param), reinterpret_cast<const float*>(grad),
                              reinterpret_cast<float*>(exp_avg),
                              reinterpret_cast<float*>(exp_avg_sq), numel);
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
      py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("numel"),
      "The memory traffic of an fp32 Adam step without its arithmetic (28 B/element): adds grad "
      "to param, exp_avg and exp_avg_sq in place. Releases the GIL.");
}

}  // namespace offload::bindings
