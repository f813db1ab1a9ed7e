// AVX-512 kernel of the fused compact step: 16 lanes. The loop is the shared template of
// compact_simd.h; this file holds only the AVX-512 operations, instantiated under the
// AVX-512 target (see [Note: one kernel template, compiled per ISA] in adam_simd.h).
#pragma GCC optimize("fp-contract=off")
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_* operands); a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "compact/compact_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

#include "compact/compact_simd.h"

namespace offload::compact::detail {
namespace {

struct Avx512 {
  using Vec = __m512;
  using IVec = __m512i;
  using Mask = __mmask16;
  static constexpr std::size_t kWidth = 16;

  COMPACT_SIMD_OP Vec load(const float* p) { return _mm512_loadu_ps(p); }
  COMPACT_SIMD_OP void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
  COMPACT_SIMD_OP Vec load_grad_f32(const float* p) { return _mm512_loadu_ps(p); }
  COMPACT_SIMD_OP Vec load_grad_bf16(const std::uint16_t* p) { return as_float(shl<16>(load_u16(p))); }
  COMPACT_SIMD_OP Vec load_grad_f16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  COMPACT_SIMD_OP IVec load_u16(const std::uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  COMPACT_SIMD_OP IVec load_i8(const std::int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  COMPACT_SIMD_OP IVec load_u8(const std::uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  COMPACT_SIMD_OP void store_u16(std::uint16_t* p, IVec x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  COMPACT_SIMD_OP void store_i8(std::int8_t* p, IVec x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  COMPACT_SIMD_OP void store_u8(std::uint8_t* p, IVec x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }

  COMPACT_SIMD_OP Vec broadcast(float x) { return _mm512_set1_ps(x); }
  COMPACT_SIMD_OP Vec zero() { return _mm512_setzero_ps(); }
  COMPACT_SIMD_OP Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  COMPACT_SIMD_OP Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  COMPACT_SIMD_OP Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  COMPACT_SIMD_OP Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  COMPACT_SIMD_OP Vec sqrt(Vec a) { return _mm512_sqrt_ps(a); }
  COMPACT_SIMD_OP Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  COMPACT_SIMD_OP Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  COMPACT_SIMD_OP Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
  COMPACT_SIMD_OP Vec abs(Vec a) { return as_float(iand(as_int(a), iset(0x7FFFFFFF))); }
  COMPACT_SIMD_OP Vec or_sign(Vec a, Vec b) {
    return as_float(_mm512_or_si512(as_int(a), iand(as_int(b), iset(static_cast<int>(0x80000000u)))));
  }
  COMPACT_SIMD_OP Vec round_even(Vec a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  COMPACT_SIMD_OP Vec to_float(IVec a) { return _mm512_cvtepi32_ps(a); }
  COMPACT_SIMD_OP IVec to_int(Vec a) { return _mm512_cvtps_epi32(a); }
  COMPACT_SIMD_OP Vec as_float(IVec a) { return _mm512_castsi512_ps(a); }
  COMPACT_SIMD_OP IVec as_int(Vec a) { return _mm512_castps_si512(a); }

  COMPACT_SIMD_OP IVec iset(int x) { return _mm512_set1_epi32(x); }
  COMPACT_SIMD_OP IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
  COMPACT_SIMD_OP IVec isub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
  COMPACT_SIMD_OP IVec iand(IVec a, IVec b) { return _mm512_and_si512(a, b); }
  COMPACT_SIMD_OP IVec imax(IVec a, IVec b) { return _mm512_max_epi32(a, b); }
  template <int kBits>
  COMPACT_SIMD_OP IVec shl(IVec a) { return _mm512_slli_epi32(a, kBits); }
  template <int kBits>
  COMPACT_SIMD_OP IVec shr(IVec a) { return _mm512_srli_epi32(a, kBits); }
  template <int kBits>
  COMPACT_SIMD_OP IVec sar(IVec a) { return _mm512_srai_epi32(a, kBits); }
  COMPACT_SIMD_OP IVec shlv(IVec a, IVec count) { return _mm512_sllv_epi32(a, count); }
  COMPACT_SIMD_OP Mask igt(IVec a, IVec b) { return _mm512_cmpgt_epi32_mask(a, b); }
  COMPACT_SIMD_OP IVec iselect(Mask m, IVec if_true, IVec if_false) {
    return _mm512_mask_blend_epi32(m, if_false, if_true);
  }

  COMPACT_SIMD_OP Mask lt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  COMPACT_SIMD_OP Mask gt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  COMPACT_SIMD_OP Mask all_lanes() { return static_cast<Mask>(0xFFFF); }
  COMPACT_SIMD_OP Mask first_lanes(std::size_t count) {
    return static_cast<Mask>((1u << count) - 1u);
  }
  COMPACT_SIMD_OP Mask mask_and(Mask a, Mask b) { return static_cast<Mask>(a & b); }
  COMPACT_SIMD_OP bool all(Mask m) { return m == 0xFFFF; }
  COMPACT_SIMD_OP bool any(Mask m) { return m != 0; }
  COMPACT_SIMD_OP Vec fselect(Mask m, Vec if_true, Vec if_false) {
    return _mm512_mask_blend_ps(m, if_false, if_true);
  }
};

}  // namespace

Failure step_avx512(const Buffers& b, const Constants& k, std::size_t first_element) {
  return simd_step<Avx512>(b, k, first_element);
}

Failure check_gradient_avx512(const Buffers& b, const Constants& k, std::size_t first_element) {
  return simd_check<Avx512>(b, k, first_element);
}

}  // namespace offload::compact::detail

#pragma GCC pop_options
