// AVX2 kernel of the fused compact step (F16C for fp16 gradients): 8 lanes. The loop is the
// shared template of compact_simd.h; this file holds only the AVX2 operations, instantiated
// under the AVX2 target (see [Note: one kernel template, compiled per ISA] in adam_simd.h).
// AVX2 has no int32 -> int8 narrowing store: codes are packed with saturating packs (every
// value is in range, so they are exact).
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "compact/compact_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "compact/compact_simd.h"

namespace offload::compact::detail {
namespace {

struct Avx2 {
  using Vec = __m256;
  using IVec = __m256i;
  using Mask = __m256;  // all ones in the lanes where true
  static constexpr std::size_t kWidth = 8;

  COMPACT_SIMD_OP Vec load(const float* p) { return _mm256_loadu_ps(p); }
  COMPACT_SIMD_OP void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
  COMPACT_SIMD_OP Vec load_grad_f32(const float* p) { return _mm256_loadu_ps(p); }
  COMPACT_SIMD_OP Vec load_grad_bf16(const std::uint16_t* p) { return as_float(shl<16>(load_u16(p))); }
  COMPACT_SIMD_OP Vec load_grad_f16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  COMPACT_SIMD_OP IVec load_u16(const std::uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  COMPACT_SIMD_OP IVec load_i8(const std::int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  COMPACT_SIMD_OP IVec load_u8(const std::uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // The 8 lanes as 8 16-bit values: signed saturation for codes (-127..127, 0..255), unsigned
  // for bf16 bits (0..65535).
  COMPACT_SIMD_OP __m128i pack16(IVec x) {
    return _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  }
  COMPACT_SIMD_OP void store_u16(std::uint16_t* p, IVec x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  }
  COMPACT_SIMD_OP void store_i8(std::int8_t* p, IVec x) {
    const __m128i h = pack16(x);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(h, h));
  }
  COMPACT_SIMD_OP void store_u8(std::uint8_t* p, IVec x) {
    const __m128i h = pack16(x);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(h, h));
  }

  COMPACT_SIMD_OP Vec broadcast(float x) { return _mm256_set1_ps(x); }
  COMPACT_SIMD_OP Vec zero() { return _mm256_setzero_ps(); }
  COMPACT_SIMD_OP Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  COMPACT_SIMD_OP Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  COMPACT_SIMD_OP Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  COMPACT_SIMD_OP Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  COMPACT_SIMD_OP Vec sqrt(Vec a) { return _mm256_sqrt_ps(a); }
  COMPACT_SIMD_OP Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  COMPACT_SIMD_OP Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  COMPACT_SIMD_OP Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
  COMPACT_SIMD_OP Vec abs(Vec a) { return as_float(iand(as_int(a), iset(0x7FFFFFFF))); }
  COMPACT_SIMD_OP Vec or_sign(Vec a, Vec b) {
    return as_float(_mm256_or_si256(as_int(a), iand(as_int(b), iset(static_cast<int>(0x80000000u)))));
  }
  COMPACT_SIMD_OP Vec round_even(Vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  COMPACT_SIMD_OP Vec to_float(IVec a) { return _mm256_cvtepi32_ps(a); }
  COMPACT_SIMD_OP IVec to_int(Vec a) { return _mm256_cvtps_epi32(a); }
  COMPACT_SIMD_OP Vec as_float(IVec a) { return _mm256_castsi256_ps(a); }
  COMPACT_SIMD_OP IVec as_int(Vec a) { return _mm256_castps_si256(a); }

  COMPACT_SIMD_OP IVec iset(int x) { return _mm256_set1_epi32(x); }
  COMPACT_SIMD_OP IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
  COMPACT_SIMD_OP IVec isub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
  COMPACT_SIMD_OP IVec iand(IVec a, IVec b) { return _mm256_and_si256(a, b); }
  COMPACT_SIMD_OP IVec imax(IVec a, IVec b) { return _mm256_max_epi32(a, b); }
  template <int kBits>
  COMPACT_SIMD_OP IVec shl(IVec a) { return _mm256_slli_epi32(a, kBits); }
  template <int kBits>
  COMPACT_SIMD_OP IVec shr(IVec a) { return _mm256_srli_epi32(a, kBits); }
  template <int kBits>
  COMPACT_SIMD_OP IVec sar(IVec a) { return _mm256_srai_epi32(a, kBits); }
  COMPACT_SIMD_OP IVec shlv(IVec a, IVec count) { return _mm256_sllv_epi32(a, count); }
  COMPACT_SIMD_OP Mask igt(IVec a, IVec b) { return as_float(_mm256_cmpgt_epi32(a, b)); }
  COMPACT_SIMD_OP IVec iselect(Mask m, IVec if_true, IVec if_false) {
    return as_int(_mm256_blendv_ps(as_float(if_false), as_float(if_true), m));
  }

  COMPACT_SIMD_OP Mask lt(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  COMPACT_SIMD_OP Mask gt(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  COMPACT_SIMD_OP Mask all_lanes() { return as_float(iset(-1)); }
  COMPACT_SIMD_OP Mask first_lanes(std::size_t count) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return as_float(_mm256_cmpgt_epi32(iset(static_cast<int>(count)), index));
  }
  COMPACT_SIMD_OP Mask mask_and(Mask a, Mask b) { return _mm256_and_ps(a, b); }
  COMPACT_SIMD_OP bool all(Mask m) { return _mm256_movemask_ps(m) == 0xFF; }
  COMPACT_SIMD_OP bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
  COMPACT_SIMD_OP Vec fselect(Mask m, Vec if_true, Vec if_false) {
    return _mm256_blendv_ps(if_false, if_true, m);
  }
};

}  // namespace

Failure step_avx2(const Buffers& b, const Constants& k, std::size_t first_element) {
  return simd_step<Avx2>(b, k, first_element);
}

Failure check_gradient_avx2(const Buffers& b, const Constants& k, std::size_t first_element) {
  return simd_check<Avx2>(b, k, first_element);
}

}  // namespace offload::compact::detail

#pragma GCC pop_options
