// Scalar reference kernels: portable C++, always built, the definitions the vector kernels
// must match bit for bit. See [Note: Adam numerics] in adam.h and [Note: elementwise kernel
// numerics] in elementwise.h.
#pragma GCC optimize("fp-contract=off")

#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam/adam_kernels.h"
#include "common/float_bits.h"
#include "adam/elementwise_kernels.h"

namespace offload::adam::detail {
namespace {

using bits::bf16_to_float;
using bits::bits_of;
using bits::float_of;
using bits::float_to_bf16;
using bits::fp16_to_float;

// float to IEEE half, round-to-nearest-even, without hardware support (the FP16 library's
// algorithm, as c10::Half).
inline std::uint16_t float_to_fp16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const std::uint32_t w = bits_of(f);
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000u;
  std::uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t bits = bits_of(base);
  const std::uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const std::uint32_t mantissa_bits = bits & 0x00000FFFu;
  const std::uint32_t nonsign = exp_bits + mantissa_bits;
  // A NaN keeps the top 10 bits of its payload and becomes quiet, as VCVTPS2PH (the vector
  // kernels) and torch's cast do.
  const std::uint32_t nan = 0x7E00u | ((w >> 13) & 0x3FFu);
  return static_cast<std::uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? nan : nonsign));
}

template <DType G>
inline float load_grad(const void* grad, std::size_t i) {
  if constexpr (G == DType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == DType::kBFloat16) {
    return bf16_to_float(static_cast<const std::uint16_t*>(grad)[i]);
  } else {
    return fp16_to_float(static_cast<const std::uint16_t*>(grad)[i]);
  }
}

template <DType G, bool kCopyOut, DType C>
void run(const Buffers& b, const Coefficients& k) {
  // No __restrict: an output is its input when the step is in place ([Note: out-of-place
  // Adam]); each element is read before it is written.
  const float* param = b.param;
  const float* exp_avg = b.exp_avg;
  const float* exp_avg_sq = b.exp_avg_sq;
  float* param_out = b.param_out;
  float* exp_avg_out = b.exp_avg_out;
  float* exp_avg_sq_out = b.exp_avg_sq_out;
  std::uint16_t* copy_out = static_cast<std::uint16_t*>(b.copy_out);
  for (std::size_t i = 0; i < b.numel; ++i) {
    float g = load_grad<G>(b.grad, i) * k.grad_scale;
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    if (k.l2) g = std::fma(p, k.l2_decay, g);
    p = p * k.param_decay;
    const float diff = g - m;
    m = k.lerp_small ? std::fma(k.lerp_weight, diff, m)
                     : std::fma(k.lerp_weight_minus_one, diff, g);
    v = v * k.beta2;
    v = std::fma(k.one_minus_beta2 * g, g, v);
    const float denom = std::sqrt(v) / k.bias_correction2_sqrt + k.eps;
    p = p + (k.neg_step_size * m) / denom;
    param_out[i] = p;
    exp_avg_out[i] = m;
    exp_avg_sq_out[i] = v;
    if constexpr (kCopyOut) {
      copy_out[i] = C == DType::kBFloat16 ? float_to_bf16(p) : float_to_fp16(p);
    }
  }
}

template <DType G>
void run_grad(const Buffers& b, const Coefficients& k) {
  if (b.copy_out == nullptr) return run<G, false, DType::kFloat32>(b, k);
  if (b.copy_out_dtype == DType::kBFloat16) return run<G, true, DType::kBFloat16>(b, k);
  return run<G, true, DType::kFloat16>(b, k);
}

template <DType G>
void sgd_run(const ElementwiseBuffers& b, const SgdCoefficients& k) {
  float* param = b.param;
  float* state = b.state;
  for (std::size_t i = 0; i < b.numel; ++i) {
    float g = load_grad<G>(b.grad, i) * k.grad_scale;
    const float p = param[i];
    if (k.decay) g = std::fma(p, k.weight_decay, g);
    if (k.momentum) {
      float buf = g;
      if (!k.first_step) {
        buf = state[i] * k.momentum_factor;
        buf = std::fma(g, k.one_minus_dampening, buf);
      }
      state[i] = buf;
      g = k.nesterov ? std::fma(buf, k.momentum_factor, g) : buf;
    }
    param[i] = std::fma(g, k.neg_lr, p);
  }
}

template <DType G>
void adagrad_run(const ElementwiseBuffers& b, const AdagradCoefficients& k) {
  float* param = b.param;
  float* state = b.state;
  for (std::size_t i = 0; i < b.numel; ++i) {
    float g = load_grad<G>(b.grad, i) * k.grad_scale;
    const float p = param[i];
    if (k.decay) g = std::fma(p, k.weight_decay, g);
    const float s = std::fma(g, g, state[i]);
    state[i] = s;
    const float std_dev = std::sqrt(s) + k.eps;
    param[i] = p + (k.neg_clr * g) / std_dev;
  }
}

template <DType G>
void rmsprop_run(const ElementwiseBuffers& b, const RmspropCoefficients& k) {
  float* param = b.param;
  for (std::size_t i = 0; i < b.numel; ++i) {
    float g = load_grad<G>(b.grad, i) * k.grad_scale;
    const float p = param[i];
    if (k.decay) g = std::fma(p, k.weight_decay, g);
    float s = b.state[i] * k.alpha;
    s = std::fma(k.one_minus_alpha * g, g, s);
    b.state[i] = s;
    float avg;
    if (k.centered) {
      float ga = b.state2[i];
      const float diff = g - ga;
      ga = k.lerp_small ? std::fma(k.one_minus_alpha, diff, ga) : std::fma(k.lerp_weight_minus_one, diff, g);
      b.state2[i] = ga;
      avg = std::sqrt(std::fma(-1.0f * ga, ga, s));
    } else {
      avg = std::sqrt(s);
    }
    avg = avg + k.eps;
    if (k.momentum) {
      float buf = b.state3[i] * k.momentum_factor;
      buf = buf + (1.0f * g) / avg;
      b.state3[i] = buf;
      param[i] = std::fma(buf, k.neg_lr, p);
    } else {
      param[i] = p + (k.neg_lr * g) / avg;
    }
  }
}

}  // namespace

void step_scalar(const Buffers& b, const Coefficients& k, const Streaming& /*streaming*/) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return run_grad<DType::kFloat32>(b, k);
    case DType::kBFloat16: return run_grad<DType::kBFloat16>(b, k);
    case DType::kFloat16: return run_grad<DType::kFloat16>(b, k);
  }
}

void sgd_scalar(const ElementwiseBuffers& b, const SgdCoefficients& k) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return sgd_run<DType::kFloat32>(b, k);
    case DType::kBFloat16: return sgd_run<DType::kBFloat16>(b, k);
    case DType::kFloat16: return sgd_run<DType::kFloat16>(b, k);
  }
}

void adagrad_scalar(const ElementwiseBuffers& b, const AdagradCoefficients& k) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return adagrad_run<DType::kFloat32>(b, k);
    case DType::kBFloat16: return adagrad_run<DType::kBFloat16>(b, k);
    case DType::kFloat16: return adagrad_run<DType::kFloat16>(b, k);
  }
}

void rmsprop_scalar(const ElementwiseBuffers& b, const RmspropCoefficients& k) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return rmsprop_run<DType::kFloat32>(b, k);
    case DType::kBFloat16: return rmsprop_run<DType::kBFloat16>(b, k);
    case DType::kFloat16: return rmsprop_run<DType::kFloat16>(b, k);
  }
}

}  // namespace offload::adam::detail
