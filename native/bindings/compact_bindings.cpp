// Python face of native/compact. Buffers cross as integer addresses (tensor.data_ptr());
// offload/optim/compact.py checks the tensors before calling here.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>

#include "bindings/registry.h"
#include "compact/compact.h"

namespace py = pybind11;

namespace offload::bindings {
namespace {

std::tuple<int, std::size_t, float, std::size_t> compact_adam_step(
    std::uintptr_t grad, int grad_dtype, std::uintptr_t high, std::uintptr_t low, std::uintptr_t exp_avg,
    std::uintptr_t exp_avg_scales, std::uintptr_t exp_avg_sq, std::uintptr_t exp_avg_sq_scales, std::size_t numel,
    bool adamw, float grad_scale, float decay, float beta1, float one_minus_beta1, float beta2,
    float one_minus_beta2, float sqrt_bias_correction2, float eps, float step_size) {
  if (grad_dtype < 0 || grad_dtype > 2) {
    throw std::invalid_argument("grad_dtype: unknown dtype code " + std::to_string(grad_dtype));
  }
  compact::Buffers b;
  b.grad = reinterpret_cast<const void*>(grad);
  b.grad_dtype = static_cast<adam::DType>(grad_dtype);
  b.high = reinterpret_cast<std::uint16_t*>(high);
  b.low = reinterpret_cast<std::int8_t*>(low);
  b.exp_avg = reinterpret_cast<std::int8_t*>(exp_avg);
  b.exp_avg_scales = reinterpret_cast<float*>(exp_avg_scales);
  b.exp_avg_sq = reinterpret_cast<std::uint8_t*>(exp_avg_sq);
  b.exp_avg_sq_scales = reinterpret_cast<float*>(exp_avg_sq_scales);
  b.numel = numel;
  const compact::Constants k{adamw, grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
                             sqrt_bias_correction2, eps, step_size};
  const compact::Failure f = compact::step(b, k);
  return {static_cast<int>(f.problem), f.element, f.value, f.count};
}

}  // namespace

void register_compact(py::module_& m) {
  m.attr("COMPACT_BLOCK_NUMEL") = compact::kBlockNumel;
  m.def("compact_adam_step", &compact_adam_step, py::call_guard<py::gil_scoped_release>(), py::arg("grad"),
        py::arg("grad_dtype"), py::arg("high"), py::arg("low"), py::arg("exp_avg"), py::arg("exp_avg_scales"),
        py::arg("exp_avg_sq"), py::arg("exp_avg_sq_scales"), py::arg("numel"), py::kw_only(), py::arg("adamw"),
        py::arg("grad_scale"), py::arg("decay"), py::arg("beta1"), py::arg("one_minus_beta1"), py::arg("beta2"),
        py::arg("one_minus_beta2"), py::arg("sqrt_bias_correction2"), py::arg("eps"), py::arg("step_size"),
        "One fused Adam/AdamW step over compact states given by address, in place (native/compact/"
        "compact.h), on the Adam kernel's ISA. The constants are fp32 values (compact_constants). "
        "Returns (problem, element, value, count): problem 0 when every state was stored, else the "
        "code of what could not be (1 gradient: nothing written; 2 exp_avg, 3 exp_avg_sq, 4 master, "
        "5 master beyond bf16: some blocks written). Releases the GIL. Use "
        "offload.optim.compact.compact_adam_step, which checks the buffers.");
}

}  // namespace offload::bindings
