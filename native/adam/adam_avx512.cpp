// AVX-512 kernel: 16 floats per vector, masked loads/stores for the head and tail so every
// element goes through the same instructions. Conversions: bf16 widening is a shift; bf16
// narrowing is done with integer round-to-nearest-even rather than VCVTNEPS2BF16, which
// flushes denormals to zero and would disagree with torch; fp16 uses VCVTPS2PH/VCVTPH2PS.
//
// Only intrinsics and this file's own functions are compiled for the AVX-512 target: no
// standard-library templates are instantiated here, so the linker can never pick an
// AVX-512 copy of a shared inline function for code that runs on other CPUs.
#pragma GCC optimize("fp-contract=off")
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_* operands); a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstdint>

#include "adam/adam_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace offload::adam::detail {
namespace {

template <DType G, bool kTail>
inline __m512 load_grad(const void* grad, std::size_t i, __mmask16 mask) {
  if constexpr (G == DType::kFloat32) {
    const float* p = static_cast<const float*>(grad) + i;
    return kTail ? _mm512_maskz_loadu_ps(mask, p) : _mm512_loadu_ps(p);
  } else {
    const std::uint16_t* p = static_cast<const std::uint16_t*>(grad) + i;
    const __m256i h = kTail ? _mm256_maskz_loadu_epi16(mask, p)
                            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (G == DType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <DType C>
inline __m256i narrow(__m512 x) {
  if constexpr (C == DType::kBFloat16) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    rounded = _mm512_srli_epi32(rounded, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(rounded);
  } else {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

inline __m512 load(const float* p, __mmask16 mask, bool tail) {
  return tail ? _mm512_maskz_loadu_ps(mask, p) : _mm512_loadu_ps(p);
}

inline void store(float* p, __m512 x, __mmask16 mask, bool tail) {
  if (tail) {
    _mm512_mask_storeu_ps(p, mask, x);
  } else {
    _mm512_storeu_ps(p, x);
  }
}

inline void prefetch_inputs(const Buffers& b, std::size_t i, std::size_t grad_bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.grad) + i * grad_bytes, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i), _MM_HINT_T0);
}

// One vector of 16 elements at i (kTail: only the lanes in mask). kStream: the copy-out is
// written with a streaming store, which needs copy_out + i 32-byte aligned.
template <DType G, bool kCopyOut, DType C, bool kTail, bool kStream>
inline void update(const Buffers& b, const Coefficients& k, std::size_t i, __mmask16 mask) {
  __m512 g = _mm512_mul_ps(load_grad<G, kTail>(b.grad, i, mask), _mm512_set1_ps(k.grad_scale));
  __m512 p = load(b.param + i, mask, kTail);
  __m512 m = load(b.exp_avg + i, mask, kTail);
  __m512 v = load(b.exp_avg_sq + i, mask, kTail);
  if (k.l2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(k.l2_decay), g);
  p = _mm512_mul_ps(p, _mm512_set1_ps(k.param_decay));
  const __m512 diff = _mm512_sub_ps(g, m);
  m = k.lerp_small ? _mm512_fmadd_ps(_mm512_set1_ps(k.lerp_weight), diff, m)
                   : _mm512_fmadd_ps(_mm512_set1_ps(k.lerp_weight_minus_one), diff, g);
  v = _mm512_mul_ps(v, _mm512_set1_ps(k.beta2));
  v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(k.one_minus_beta2), g), g, v);
  const __m512 denom =
      _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(k.bias_correction2_sqrt)),
                    _mm512_set1_ps(k.eps));
  p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(k.neg_step_size), m), denom));
  store(b.param + i, p, mask, kTail);
  store(b.exp_avg + i, m, mask, kTail);
  store(b.exp_avg_sq + i, v, mask, kTail);
  if constexpr (kCopyOut) {
    auto* out = static_cast<std::uint16_t*>(b.copy_out) + i;
    const __m256i h = narrow<C>(p);
    if constexpr (kTail) {
      _mm256_mask_storeu_epi16(out, mask, h);
    } else if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
    }
  }
}

inline __mmask16 first_lanes(std::size_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);
}

// See [Note: Adam memory traffic] in adam_kernels.h.
template <DType G, bool kCopyOut, DType C, bool kStream>
void run(const Buffers& b, const Coefficients& k) {
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  const std::size_t n = b.numel;
  std::size_t i = 0;
  if constexpr (kStream) {
    // Streaming stores need copy_out + i 32-byte aligned: run the few elements before that
    // boundary through the masked path (same arithmetic, so the same results).
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(b.copy_out) % 32 / 2;
    std::size_t head = (16 - misaligned) % 16;
    if (head > n) head = n;
    if (head > 0) update<G, kCopyOut, C, true, false>(b, k, 0, first_lanes(head));
    i = head;
  }
  for (; i + kPrefetchNumel + 16 <= n; i += 16) {
    prefetch_inputs(b, i + kPrefetchNumel, kGradBytes);
    update<G, kCopyOut, C, false, kStream>(b, k, i, 0xFFFF);
  }
  for (; i + 16 <= n; i += 16) update<G, kCopyOut, C, false, kStream>(b, k, i, 0xFFFF);
  if (i < n) update<G, kCopyOut, C, true, false>(b, k, i, first_lanes(n - i));
  // Streaming stores are weakly ordered: make them visible before the pool reports done.
  if constexpr (kStream) _mm_sfence();
}

template <DType G>
void run_grad(const Buffers& b, const Coefficients& k, bool stream_copy_out) {
  if (b.copy_out == nullptr) return run<G, false, DType::kFloat32, false>(b, k);
  if (b.copy_out_dtype == DType::kBFloat16) {
    return stream_copy_out ? run<G, true, DType::kBFloat16, true>(b, k)
                           : run<G, true, DType::kBFloat16, false>(b, k);
  }
  return stream_copy_out ? run<G, true, DType::kFloat16, true>(b, k)
                         : run<G, true, DType::kFloat16, false>(b, k);
}

}  // namespace

void step_avx512(const Buffers& b, const Coefficients& k, bool stream_copy_out) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return run_grad<DType::kFloat32>(b, k, stream_copy_out);
    case DType::kBFloat16: return run_grad<DType::kBFloat16>(b, k, stream_copy_out);
    case DType::kFloat16: return run_grad<DType::kFloat16>(b, k, stream_copy_out);
  }
}

}  // namespace offload::adam::detail

#pragma GCC pop_options
