// CPU SGD, Adagrad and RMSprop steps over flat fp32 buffers, one pass over (param, grad,
// states) per element, on the instruction set the Adam kernels run on (adam.h: chosen once
// at load time, OFFLOAD_FORCE_ISA overrides it) and the native thread pool. The engine routes a parameter
// group of torch.optim.SGD, Adagrad or RMSprop here when its settings are ones these
// kernels implement ([Note: native elementwise kernels] in offload/optim/native_kernels.py).
//
// [Note: elementwise kernel numerics] The arithmetic reproduces torch's _single_tensor_sgd,
// _single_tensor_adagrad and _single_tensor_rmsprop on CPU fp32 tensors bit for bit, as
// [Note: Adam numerics] does Adam's: scalar coefficients computed in double as torch computes them on Python floats,
// then rounded to float; the elementwise operations in torch's order, with FMA exactly where
// ATen's kernels use one (add with alpha, addcmul) and nowhere else (fp-contract=off):
//   g   = grad * grad_scale                        (the engine's unscaling and clipping)
//   g   = fma(param, wd, g)                        (grad.add(param, alpha=wd), wd != 0)
// SGD, momentum != 0:
//   buf = g                                        (first step: grad.clone())
//   buf = fma(g, (float)(1 - dampening), buf * momentum)   (buf.mul_(m).add_(g, alpha=1-d))
//   g   = fma(buf, momentum, g) if nesterov else buf        (grad.add(buf, alpha=m))
//   p   = fma(g, -lr, p)                           (param.add_(grad, alpha=-lr))
// Adagrad (step: the count after this step's increment):
//   s   = fma(g, g, s)                             (state_sum.addcmul_(g, g, value=1))
//   p   = p + (-clr * g) / (sqrt(s) + eps)         (param.addcdiv_(g, std, value=-clr)),
//         clr = lr / (1 + (step - 1) * lr_decay)
// RMSprop (w = 1 - alpha):
//   s   = fma((float)w * g, g, s * alpha)          (square_avg.mul_(alpha).addcmul_(g, g, value=w))
//   ga  = fma(w, g - ga, ga) if |w| < 0.5          (centered: grad_avg.lerp_(g, w))
//       = fma(w - 1, g - ga, g) otherwise
//   avg = sqrt(fma(-ga, ga, s)) + eps if centered   (square_avg.addcmul(ga, ga, value=-1).sqrt_())
//       = sqrt(s) + eps otherwise
//   buf = buf * momentum + g / avg; p = fma(buf, -lr, p)   (momentum > 0: addcdiv_(g, avg))
//   p   = p + (-lr * g) / avg                      (otherwise: param.addcdiv_(g, avg, value=-lr))
// sqrt is IEEE (correctly rounded); torch's CPU sqrt (MKL) is not always, so the two agree to
// the last bit where torch's sqrt is correctly rounded, as for Adam. Like Adam's, the kernels
// follow torch where its CPU kernels run with FMA (ATen's AVX2 and AVX-512 builds, which every
// x86-64 CPU with AVX2 gets); under ATEN_CPU_CAPABILITY=default torch rounds a * b + c twice
// and the two differ in the last bit.
#pragma once

#include <cstddef>

#include "adam/adam.h"

namespace offload::adam {

// One range of one parameter, stepped in place; numel elements each, apart from each other.
// state: SGD's momentum buffer (may be null when momentum is 0), Adagrad's state_sum or
// RMSprop's square_avg; state2: RMSprop's grad_avg (centered only); state3: RMSprop's
// momentum buffer (momentum > 0 only).
struct ElementwiseBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  float* state;
  std::size_t numel;
  float* state2 = nullptr;
  float* state3 = nullptr;
};

struct SgdHyperparameters {
  double lr;
  double momentum;      // 0: no momentum buffer
  double dampening;
  double weight_decay;
  bool nesterov;
  bool first_step;      // no momentum buffer yet: it starts as the (decayed) gradient
  double grad_scale;
};

struct AdagradHyperparameters {
  double lr;
  double lr_decay;
  double weight_decay;
  double eps;
  double step;          // the step count after this step's increment
  double grad_scale;
};

struct RmspropHyperparameters {
  double lr;
  double alpha;
  double eps;
  double weight_decay;
  double momentum;      // 0: no momentum buffer
  bool centered;
  double grad_scale;
};

// Throw std::invalid_argument on bad input, std::runtime_error where OFFLOAD_FORCE_ISA named
// an ISA this CPU cannot run (as adam::step).
void sgd_step(const ElementwiseBuffers& buffers, const SgdHyperparameters& hyper);
void adagrad_step(const ElementwiseBuffers& buffers, const AdagradHyperparameters& hyper);
void rmsprop_step(const ElementwiseBuffers& buffers, const RmspropHyperparameters& hyper);

}  // namespace offload::adam
