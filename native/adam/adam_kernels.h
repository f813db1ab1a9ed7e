// Internal to native/adam: the per-ISA kernels and the float coefficients they share.
#pragma once

#include "adam/adam.h"

namespace offload::adam::detail {

// Per-step scalars, already rounded to float the way ATen rounds Python-float scalars.
struct Coefficients {
  float grad_scale;
  bool l2;               // Adam with weight decay: g = fma(param, l2_decay, g)
  float l2_decay;
  float param_decay;     // 1 - lr * wd for AdamW, exactly 1 otherwise (p * 1 == p)
  bool lerp_small;       // |1 - beta1| < 0.5 picks ATen's lerp formula
  float lerp_weight;     // 1 - beta1
  float lerp_weight_minus_one;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;   // -lr / (1 - beta1^step)
};

// Each kernel processes buffers.numel elements single-threaded; adam.cpp splits the work.
void step_scalar(const Buffers& buffers, const Coefficients& k);
void step_avx2(const Buffers& buffers, const Coefficients& k);
void step_avx512(const Buffers& buffers, const Coefficients& k);

}  // namespace offload::adam::detail
