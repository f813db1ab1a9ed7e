// Python face of native/adam. Buffers cross as integer addresses (tensor.data_ptr()) with
// element counts and dtype codes; offload/optim.py checks the tensors before calling here.
#include <cstdint>
#include <stdexcept>
#include <string>

#include <pybind11/stl.h>

#include "adam/adam.h"
#include "adam/elementwise.h"
#include "bindings/registry.h"

namespace py = pybind11;

namespace offload::bindings {
namespace {

adam::DType dtype_from_code(int code, const char* what) {
  if (code < 0 || code > 2) {
    throw std::invalid_argument(std::string(what) + ": unknown dtype code " +
                                std::to_string(code));
  }
  return static_cast<adam::DType>(code);
}

void adam_step(std::uintptr_t param, std::uintptr_t grad, int grad_dtype,
               std::uintptr_t exp_avg, std::uintptr_t exp_avg_sq, std::size_t numel,
               double step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw, double grad_scale, std::uintptr_t copy_out,
               int copy_out_dtype, std::uintptr_t param_out, std::uintptr_t exp_avg_out,
               std::uintptr_t exp_avg_sq_out) {
  adam::Buffers buffers;
  buffers.param = reinterpret_cast<const float*>(param);
  buffers.grad = reinterpret_cast<const void*>(grad);
  buffers.grad_dtype = dtype_from_code(grad_dtype, "grad_dtype");
  buffers.exp_avg = reinterpret_cast<const float*>(exp_avg);
  buffers.exp_avg_sq = reinterpret_cast<const float*>(exp_avg_sq);
  buffers.param_out = reinterpret_cast<float*>(param_out);
  buffers.exp_avg_out = reinterpret_cast<float*>(exp_avg_out);
  buffers.exp_avg_sq_out = reinterpret_cast<float*>(exp_avg_sq_out);
  buffers.copy_out = reinterpret_cast<void*>(copy_out);
  buffers.copy_out_dtype = dtype_from_code(copy_out_dtype, "copy_out_dtype");
  buffers.numel = numel;
  adam::Hyperparameters hyper{lr, beta1, beta2, eps, weight_decay, step, adamw, grad_scale};
  adam::step(buffers, hyper);
}

adam::ElementwiseBuffers elementwise_buffers(std::uintptr_t param, std::uintptr_t grad, int grad_dtype,
                                             std::uintptr_t state, std::size_t numel) {
  adam::ElementwiseBuffers buffers;
  buffers.param = reinterpret_cast<float*>(param);
  buffers.grad = reinterpret_cast<const void*>(grad);
  buffers.grad_dtype = dtype_from_code(grad_dtype, "grad_dtype");
  buffers.state = reinterpret_cast<float*>(state);
  buffers.numel = numel;
  return buffers;
}

}  // namespace

void register_adam(py::module_& m) {
  m.def(
      "sgd_step",
      [](std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t momentum_buffer,
         std::size_t numel, double lr, double momentum, double dampening, double weight_decay,
         bool nesterov, bool first_step, double grad_scale) {
        adam::sgd_step(elementwise_buffers(param, grad, grad_dtype, momentum_buffer, numel),
                       {lr, momentum, dampening, weight_decay, nesterov, first_step, grad_scale});
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
      py::arg("grad_dtype"), py::arg("momentum_buffer"), py::arg("numel"), py::kw_only(),
      py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
      py::arg("nesterov"), py::arg("first_step"), py::arg("grad_scale"),
      "One torch.optim.SGD step over flat buffers given by address, in place (momentum_buffer "
      "may be 0 when momentum is 0). Releases the GIL. Use "
      "offload.optim.native_kernels.sgd_step_flat, which checks the buffers.");
  m.def(
      "rmsprop_step",
      [](std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t square_avg,
         std::uintptr_t grad_avg, std::uintptr_t momentum_buffer, std::size_t numel, double lr,
         double alpha, double eps, double weight_decay, double momentum, bool centered,
         double grad_scale) {
        adam::ElementwiseBuffers buffers = elementwise_buffers(param, grad, grad_dtype, square_avg, numel);
        buffers.state2 = reinterpret_cast<float*>(grad_avg);
        buffers.state3 = reinterpret_cast<float*>(momentum_buffer);
        adam::rmsprop_step(buffers, {lr, alpha, eps, weight_decay, momentum, centered, grad_scale});
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
      py::arg("grad_dtype"), py::arg("square_avg"), py::arg("grad_avg"), py::arg("momentum_buffer"),
      py::arg("numel"), py::kw_only(), py::arg("lr"), py::arg("alpha"), py::arg("eps"),
      py::arg("weight_decay"), py::arg("momentum"), py::arg("centered"), py::arg("grad_scale"),
      "One torch.optim.RMSprop step over flat buffers given by address, in place (grad_avg may "
      "be 0 unless centered, momentum_buffer unless momentum > 0). Releases the GIL. Use "
      "offload.optim.native_kernels.rmsprop_step_flat, which checks the buffers.");
  m.def(
      "adagrad_step",
      [](std::uintptr_t param, std::uintptr_t grad, int grad_dtype, std::uintptr_t state_sum,
         std::size_t numel, double lr, double lr_decay, double weight_decay, double eps, double step,
         double grad_scale) {
        adam::adagrad_step(elementwise_buffers(param, grad, grad_dtype, state_sum, numel),
                           {lr, lr_decay, weight_decay, eps, step, grad_scale});
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("param"), py::arg("grad"),
      py::arg("grad_dtype"), py::arg("state_sum"), py::arg("numel"), py::kw_only(), py::arg("lr"),
      py::arg("lr_decay"), py::arg("weight_decay"), py::arg("eps"), py::arg("step"),
      py::arg("grad_scale"),
      "One torch.optim.Adagrad step over flat buffers given by address, in place. Releases the "
      "GIL. Use offload.optim.native_kernels.adagrad_step_flat, which checks the buffers.");
  m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>(), py::arg("param"),
        py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("numel"), py::kw_only(), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
        py::arg("grad_scale"), py::arg("copy_out") = 0, py::arg("copy_out_dtype") = 0,
        py::arg("param_out") = 0, py::arg("exp_avg_out") = 0, py::arg("exp_avg_sq_out") = 0,
        "One Adam/AdamW step over flat buffers given by address (dtype codes: 0 float32, "
        "1 bfloat16, 2 float16). param, exp_avg and exp_avg_sq are updated in place, or, where "
        "their *_out address is given, left as they are and the new values written there. "
        "Releases the GIL. Callers must pass valid buffers of numel elements: use "
        "offload.optim.adam_step_flat, which checks them.");
  m.def(
      "split_master",
      [](std::uintptr_t master, std::uintptr_t high, std::uintptr_t low, std::size_t numel) {
        adam::split_master(reinterpret_cast<const float*>(master),
                           reinterpret_cast<std::uint16_t*>(high),
                           reinterpret_cast<std::uint16_t*>(low), numel);
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("master"), py::arg("high"),
      py::arg("low"), py::arg("numel"),
      "fp32 master -> bf16 high half (rounded half away from zero) and 16-bit low half, by "
      "address; use offload.optim.split_master, which checks the buffers.");
  m.def(
      "join_master",
      [](std::uintptr_t high, std::uintptr_t low, std::uintptr_t master, std::size_t numel) {
        adam::join_master(reinterpret_cast<const std::uint16_t*>(high),
                          reinterpret_cast<const std::uint16_t*>(low),
                          reinterpret_cast<float*>(master), numel);
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("high"), py::arg("low"),
      py::arg("master"), py::arg("numel"),
      "The fp32 master back from its halves (see split_master), by address; use "
      "offload.optim.join_master, which checks the buffers.");
  m.def("adam_stream_copy_out_min_numel", &adam::stream_copy_out_min_numel,
        "Steps over at least this many elements write the copy-out with streaming stores "
        "(chosen at load time from the last-level cache size).");
  m.def("adam_set_stream_copy_out_min_numel", &adam::set_stream_copy_out_min_numel,
        py::arg("numel"),
        "Change the streaming-store threshold for later steps (for tests and benchmarks); "
        "results do not depend on it.");
  m.def("adam_selected_isa", [] { return std::string(adam::isa_name(adam::selected_isa())); },
        "Instruction set the Adam kernel runs on; raises if OFFLOAD_FORCE_ISA was invalid.");
  m.def("adam_available_isas",
        [] {
          py::list names;
          for (adam::Isa isa : adam::available_isas()) names.append(adam::isa_name(isa));
          return names;
        },
        "Instruction sets this CPU can run the Adam kernel on, slowest first.");
  m.def("adam_set_isa", [](const std::string& name) { adam::set_isa(adam::parse_isa(name)); },
        py::arg("name"),
        "Run later Adam steps on this instruction set (for tests and benchmarks); raises "
        "ValueError for an unknown name, RuntimeError if this CPU lacks it.");
}

}  // namespace offload::bindings
