// Scalar bit-level conversions of the reference kernels (adam_scalar.cpp, compact_scalar.cpp):
// the definitions the vector kernels match bit for bit, written once. Included after each
// file's `#pragma GCC optimize("fp-contract=off")`, so no multiply and add here is fused.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace offload::bits {

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_float(std::uint16_t h) { return float_of(std::uint32_t{h} << 16); }

// Round to nearest even, as c10::BFloat16 does; NaN becomes the canonical quiet NaN.
inline std::uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  std::uint32_t u = bits_of(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// IEEE half to float without hardware support, exactly (the algorithm of the FP16 library
// that c10::Half also uses).
inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t w = std::uint32_t{h} << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;
  const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  const std::uint32_t result =
      sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized));
  return float_of(result);
}

}  // namespace offload::bits
