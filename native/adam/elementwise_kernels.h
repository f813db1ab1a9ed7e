// Internal to native/adam: the per-ISA SGD, Adagrad and RMSprop kernels and their float coefficients
// ([Note: elementwise kernel numerics] in elementwise.h).
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

struct RmspropCoefficients {
  float grad_scale;
  bool decay;
  float weight_decay;
  float alpha;
  float one_minus_alpha;     // addcmul's value and lerp's weight
  bool centered;
  bool lerp_small;           // |1 - alpha| < 0.5 picks ATen's lerp formula
  float lerp_weight_minus_one;
  float eps;
  bool momentum;
  float momentum_factor;
  float neg_lr;
};

// Each kernel processes buffers.numel elements single-threaded; elementwise.cpp splits the
// work. The vector ones prefetch as Adam's do ([Note: Adam memory traffic] in adam_kernels.h).
void sgd_scalar(const ElementwiseBuffers& buffers, const SgdCoefficients& k);
void sgd_avx2(const ElementwiseBuffers& buffers, const SgdCoefficients& k);
void sgd_avx512(const ElementwiseBuffers& buffers, const SgdCoefficients& k);
void adagrad_scalar(const ElementwiseBuffers& buffers, const AdagradCoefficients& k);
void adagrad_avx2(const ElementwiseBuffers& buffers, const AdagradCoefficients& k);
void adagrad_avx512(const ElementwiseBuffers& buffers, const AdagradCoefficients& k);
void rmsprop_scalar(const ElementwiseBuffers& buffers, const RmspropCoefficients& k);
void rmsprop_avx2(const ElementwiseBuffers& buffers, const RmspropCoefficients& k);
void rmsprop_avx512(const ElementwiseBuffers& buffers, const RmspropCoefficients& k);

}  // namespace offload::adam::detail
