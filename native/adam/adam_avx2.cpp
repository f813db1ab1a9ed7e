// AVX2+FMA kernel (F16C for fp16): 8 floats per vector. The loop is the shared template of
// adam_simd.h; this file holds only the AVX2 operations it runs on, and instantiates it
// under the AVX2 target (see [Note: one kernel template, compiled per ISA] there). Partial
// vectors (head and tail) use masked fp32 loads and stores and zero-padded stack buffers for
// 16-bit values, so every element sees identical instructions. bf16 narrowing uses integer
// round-to-nearest-even (torch's rounding).
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam/adam_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "adam/adam_simd.h"
#include "adam/elementwise_simd.h"

namespace offload::adam::detail {
namespace {

struct Avx2 {
  using Vec = __m256;
  using HalfVec = __m128i;
  static constexpr std::size_t kWidth = 8;

  ADAM_SIMD_OP Vec load(const float* p) { return _mm256_loadu_ps(p); }
  ADAM_SIMD_OP void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
  ADAM_SIMD_OP Vec broadcast(float x) { return _mm256_set1_ps(x); }
  ADAM_SIMD_OP Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  ADAM_SIMD_OP Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  ADAM_SIMD_OP Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  ADAM_SIMD_OP Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  ADAM_SIMD_OP Vec sqrt(Vec a) { return _mm256_sqrt_ps(a); }
  ADAM_SIMD_OP Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }

  ADAM_SIMD_OP HalfVec load_half(const std::uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  ADAM_SIMD_OP void store_half(std::uint16_t* p, HalfVec h) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  ADAM_SIMD_OP void stream_half(std::uint16_t* p, HalfVec h) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
  }
  ADAM_SIMD_OP void stream(float* p, Vec x) { _mm256_stream_ps(p, x); }

  // A partial vector: VMASKMOVPS for the fp32 streams (the other lanes load as 0 and are
  // not stored). AVX2 has no masked loads or stores of 16-bit values, so the 16-bit grad
  // and copy-out go through a zero-padded stack buffer, copied in and out one by one.
  struct Lanes {
    __m256i mask;  // all ones in the lanes [0, count)
    std::size_t count;
  };
  ADAM_SIMD_OP Lanes first_lanes(std::size_t count) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), index), count};
  }
  ADAM_SIMD_OP Vec load_first(const float* p, Lanes lanes) {
    return _mm256_maskload_ps(p, lanes.mask);
  }
  ADAM_SIMD_OP void store_first(float* p, Vec x, Lanes lanes) {
    _mm256_maskstore_ps(p, lanes.mask, x);
  }
  ADAM_SIMD_OP HalfVec load_half_first(const std::uint16_t* p, Lanes lanes) {
    alignas(16) std::uint16_t padded[kWidth] = {};
    for (std::size_t j = 0; j < lanes.count; ++j) padded[j] = p[j];
    return load_half(padded);
  }
  ADAM_SIMD_OP void store_half_first(std::uint16_t* p, HalfVec h, Lanes lanes) {
    alignas(16) std::uint16_t padded[kWidth];
    store_half(padded, h);
    for (std::size_t j = 0; j < lanes.count; ++j) p[j] = padded[j];
  }

  ADAM_SIMD_OP Vec widen_bf16(HalfVec h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  ADAM_SIMD_OP Vec widen_fp16(HalfVec h) { return _mm256_cvtph_ps(h); }

  ADAM_SIMD_OP HalfVec narrow_bf16(Vec x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    rounded = _mm256_srli_epi32(rounded, 16);
    // NaN lanes become c10::BFloat16's quiet NaN 0x7FC0 (as the scalar kernel): rounding
    // their bits could give inf or -0.
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // Every lane is <= 0xFFFF, so the unsigned-saturating pack is exact.
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                            _mm256_extracti128_si256(rounded, 1));
  }
  ADAM_SIMD_OP HalfVec narrow_fp16(Vec x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

}  // namespace

void step_avx2(const Buffers& b, const Coefficients& k, const Streaming& streaming) {
  simd_step<Avx2>(b, k, streaming);
}

void sgd_avx2(const ElementwiseBuffers& b, const SgdCoefficients& k) { elementwise_simd<Avx2>(b, k); }

void adagrad_avx2(const ElementwiseBuffers& b, const AdagradCoefficients& k) {
  elementwise_simd<Avx2>(b, k);
}

void rmsprop_avx2(const ElementwiseBuffers& b, const RmspropCoefficients& k) {
  elementwise_simd<Avx2>(b, k);
}

}  // namespace offload::adam::detail

#pragma GCC pop_options
