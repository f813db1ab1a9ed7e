// Internal to native/adam: the per-ISA SGD and Adagrad kernels and their float coefficients
// ([Note: SGD and Adagrad numerics] in elementwise.h).
#pragma once

#include <cstddef>

#include "adam/elementwise.h"

namespace offload::adam::detail {

struct SgdCoefficients {
  float grad_scale;
  bool decay;                // weight_decay != 0
  float weight_decay;
  bool momentum;             // momentum != 0: the state is the momentum buffer
  bool first_step;
  float momentum_factor;
  float one_minus_dampening;
  bool nesterov;
  float neg_lr;
};

struct AdagradCoefficients {
  float grad_scale;
  bool decay;
  float weight_decay;
  float eps;
  float neg_clr;             // -lr / (1 + (step - 1) * lr_decay)
};

// Each kernel processes buffers.numel elements single-threaded; elementwise.cpp splits the
// work. The vector ones prefetch as Adam's do ([Note: Adam memory traffic] in adam_kernels.h).
void sgd_scalar(const ElementwiseBuffers& buffers, const SgdCoefficients& k);
void sgd_avx2(const ElementwiseBuffers& buffers, const SgdCoefficients& k);
void sgd_avx512(const ElementwiseBuffers& buffers, const SgdCoefficients& k);
void adagrad_scalar(const ElementwiseBuffers& buffers, const AdagradCoefficients& k);
void adagrad_avx2(const ElementwiseBuffers& buffers, const AdagradCoefficients& k);
void adagrad_avx512(const ElementwiseBuffers& buffers, const AdagradCoefficients& k);

}  // namespace offload::adam::detail
