// Scalar reference kernel of the fused compact step: portable C++, always built, the
// definition the vector kernels match bit for bit. See [Note: compact step numerics] in
// compact.h; every line below is one fp32 operation of that rule, in its order.
#pragma GCC optimize("fp-contract=off")

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/float_bits.h"
#include "compact/compact_kernels.h"

namespace offload::compact::detail {
namespace {

using adam::DType;

using bits::bf16_to_float;
using bits::bits_of;
using bits::float_of;
using bits::float_to_bf16;  // only finite values reach it here
using bits::fp16_to_float;

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

// The spacing of bf16 values at high's exponent: 2^(e - 7), 2^-133 for zero and subnormals
// (ulp_of_bf16 in compact_codec.py).
inline float ulp_of_bf16(std::uint16_t high) {
  const std::uint32_t biased = (high >> 7) & 0xFFu;
  if (biased >= 8) return float_of((biased - 7) << 23);
  return float_of(1u << ((biased < 1 ? 1 : biased) + 15));
}

// Round half to even (torch.round) in the default rounding mode.
inline float round_even(float x) { return std::nearbyint(x); }

// Values at or beyond this magnitude round to bf16 infinity.
const float kBf16Overflow = float_of(0x7F7F8000u);
const float kInf = float_of(0x7F800000u);

template <DType G>
Failure run(const Buffers& b, const Constants& k, std::size_t first_element) {
  float m[kBlockNumel], v[kBlockNumel], x[kBlockNumel];
  for (std::size_t start = 0; start < b.numel; start += kBlockNumel) {
    const std::size_t n = b.numel - start < kBlockNumel ? b.numel - start : kBlockNumel;
    const std::size_t block = start / kBlockNumel;
    const float s_m = b.exp_avg_scales[block];
    const float s_v = b.exp_avg_sq_scales[block];
    float max_m = 0.0f, max_v = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t e = start + i;
      float g = load_grad<G>(b.grad, e) * k.grad_scale;
      const std::uint16_t h = b.high[e];
      float xe = bf16_to_float(h) + (static_cast<float>(b.low[e]) * ulp_of_bf16(h)) / 254.0f;
      const float c_m = static_cast<float>(b.exp_avg[e]);
      const float u_m = std::fabs(c_m) / 127.0f;
      float me = (u_m * u_m) * s_m;
      if (c_m < 0.0f) me = -me;  // sign(c) * y: -1 * y
      const float u_v = static_cast<float>(b.exp_avg_sq[e]) / 255.0f;
      const float sq = u_v * u_v;
      float ve = (sq * sq) * s_v;
      if (k.adamw) {
        xe = xe * k.decay;
      } else {
        g = g + xe * k.decay;
      }
      me = me * k.beta1 + g * k.one_minus_beta1;
      ve = ve * k.beta2 + (g * g) * k.one_minus_beta2;
      const float denom = std::sqrt(ve) / k.sqrt_bias_correction2 + k.eps;
      xe = xe - (me / denom) * k.step_size;
      m[i] = me, v[i] = ve, x[i] = xe;
      max_m = std::fmax(max_m, std::fabs(me));
      max_v = std::fmax(max_v, ve);
    }
    // Nothing of a block with a value compact states cannot hold is stored.
    for (std::size_t i = 0; i < n; ++i) {
      Problem problem = Problem::kNone;
      float value = 0.0f;
      if (!(std::fabs(m[i]) < kInf)) {
        problem = Problem::kExpAvg, value = m[i];
      } else if (!(v[i] < kInf)) {
        problem = Problem::kExpAvgSq, value = v[i];
      } else if (!(std::fabs(x[i]) < kInf)) {
        problem = Problem::kMaster, value = x[i];
      } else if (!(std::fabs(x[i]) < kBf16Overflow)) {
        problem = Problem::kMasterHigh, value = x[i];
      }
      if (problem != Problem::kNone) return Failure{problem, first_element + start + i, value, 0};
    }
    const float safe_m = max_m == 0.0f ? 1.0f : max_m;
    const float safe_v = max_v == 0.0f ? 1.0f : max_v;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t e = start + i;
      const float r_m = round_even(std::sqrt(std::fabs(m[i]) / safe_m) * 127.0f);
      b.exp_avg[e] = static_cast<std::int8_t>(std::signbit(m[i]) ? -r_m : r_m);
      float r_v = round_even(std::sqrt(std::sqrt(v[i] / safe_v)) * 255.0f);
      if (v[i] > 0.0f && r_v < 1.0f) r_v = 1.0f;
      b.exp_avg_sq[e] = static_cast<std::uint8_t>(r_v);
      const std::uint16_t h = float_to_bf16(x[i]);
      const float rest = x[i] - bf16_to_float(h);
      b.low[e] = static_cast<std::int8_t>(round_even((rest / ulp_of_bf16(h)) * 254.0f));
      b.high[e] = h;
    }
    b.exp_avg_scales[block] = max_m;
    b.exp_avg_sq_scales[block] = max_v;
  }
  return Failure{};
}

template <DType G>
Failure check(const Buffers& b, const Constants& k, std::size_t first_element) {
  Failure failure;
  for (std::size_t e = 0; e < b.numel; ++e) {
    const float g = load_grad<G>(b.grad, e) * k.grad_scale;
    if (std::fabs(g) < kInf) continue;
    if (failure.count++ == 0) failure = Failure{Problem::kGradient, first_element + e, g, 1};
  }
  return failure;
}

}  // namespace

Failure check_gradient_scalar(const Buffers& b, const Constants& k, std::size_t first_element) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return check<DType::kFloat32>(b, k, first_element);
    case DType::kBFloat16: return check<DType::kBFloat16>(b, k, first_element);
    case DType::kFloat16: return check<DType::kFloat16>(b, k, first_element);
  }
  return Failure{};
}

Failure step_scalar(const Buffers& b, const Constants& k, std::size_t first_element) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return run<DType::kFloat32>(b, k, first_element);
    case DType::kBFloat16: return run<DType::kBFloat16>(b, k, first_element);
    case DType::kFloat16: return run<DType::kFloat16>(b, k, first_element);
  }
  return Failure{};
}

}  // namespace offload::compact::detail
