// AVX-512 kernel: 16 floats per vector. The loop is the shared template of adam_simd.h; this
// file holds only the AVX-512 operations it runs on, and instantiates it under the AVX-512
// target (see [Note: one kernel template, compiled per ISA] there). Partial vectors (head
// and tail) are masked loads and stores, so every element sees identical instructions.
// Conversions: bf16 widening is a shift; bf16 narrowing is integer round-to-nearest-even
// rather than VCVTNEPS2BF16, which flushes denormals to zero and would disagree with torch;
// fp16 uses VCVTPS2PH/VCVTPH2PS.
#pragma GCC optimize("fp-contract=off")
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_* operands); a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam/adam_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

#include "adam/adam_simd.h"
#include "adam/elementwise_simd.h"

namespace offload::adam::detail {
namespace {

struct Avx512 {
  using Vec = __m512;
  using HalfVec = __m256i;
  static constexpr std::size_t kWidth = 16;

  ADAM_SIMD_OP Vec load(const float* p) { return _mm512_loadu_ps(p); }
  ADAM_SIMD_OP void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
  ADAM_SIMD_OP Vec broadcast(float x) { return _mm512_set1_ps(x); }
  ADAM_SIMD_OP Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  ADAM_SIMD_OP Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  ADAM_SIMD_OP Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  ADAM_SIMD_OP Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  ADAM_SIMD_OP Vec sqrt(Vec a) { return _mm512_sqrt_ps(a); }
  ADAM_SIMD_OP Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }

  ADAM_SIMD_OP HalfVec load_half(const std::uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  ADAM_SIMD_OP void store_half(std::uint16_t* p, HalfVec h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  ADAM_SIMD_OP void stream_half(std::uint16_t* p, HalfVec h) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
  }
  ADAM_SIMD_OP void stream(float* p, Vec x) { _mm512_stream_ps(p, x); }

  using Lanes = __mmask16;
  ADAM_SIMD_OP Lanes first_lanes(std::size_t count) {
    return static_cast<__mmask16>((1u << count) - 1u);
  }
  ADAM_SIMD_OP Vec load_first(const float* p, Lanes lanes) {
    return _mm512_maskz_loadu_ps(lanes, p);
  }
  ADAM_SIMD_OP void store_first(float* p, Vec x, Lanes lanes) {
    _mm512_mask_storeu_ps(p, lanes, x);
  }
  ADAM_SIMD_OP HalfVec load_half_first(const std::uint16_t* p, Lanes lanes) {
    return _mm256_maskz_loadu_epi16(lanes, p);
  }
  ADAM_SIMD_OP void store_half_first(std::uint16_t* p, HalfVec h, Lanes lanes) {
    _mm256_mask_storeu_epi16(p, lanes, h);
  }

  ADAM_SIMD_OP Vec widen_bf16(HalfVec h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  ADAM_SIMD_OP Vec widen_fp16(HalfVec h) { return _mm512_cvtph_ps(h); }

  ADAM_SIMD_OP HalfVec narrow_bf16(Vec x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    rounded = _mm512_srli_epi32(rounded, 16);
    // NaN lanes become c10::BFloat16's quiet NaN 0x7FC0 (as the scalar kernel): rounding
    // their bits could give inf or -0.
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
  }
  ADAM_SIMD_OP HalfVec narrow_fp16(Vec x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

}  // namespace

void step_avx512(const Buffers& b, const Coefficients& k, const Streaming& streaming) {
  simd_step<Avx512>(b, k, streaming);
}

void sgd_avx512(const ElementwiseBuffers& b, const SgdCoefficients& k) { elementwise_simd<Avx512>(b, k); }

void adagrad_avx512(const ElementwiseBuffers& b, const AdagradCoefficients& k) {
  elementwise_simd<Avx512>(b, k);
}

void rmsprop_avx512(const ElementwiseBuffers& b, const RmspropCoefficients& k) {
  elementwise_simd<Avx512>(b, k);
}

}  // namespace offload::adam::detail

#pragma GCC pop_options
