// AVX2+FMA kernel (F16C for fp16): 8 floats per vector. The head (when the copy-out is
// streamed) and the tail are copied into padded stack buffers and run through the same
// vector code, so every element sees identical instructions. bf16 narrowing uses integer
// round-to-nearest-even (torch's rounding).
//
// Only intrinsics and this file's own functions are compiled for the AVX2 target (see the
// matching note in adam_avx512.cpp).
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstdint>

#include "adam/adam_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace offload::adam::detail {
namespace {

template <DType G>
inline __m256 load_grad(const void* grad, std::size_t i) {
  if constexpr (G == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(grad) + i));
    if constexpr (G == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <DType C>
inline __m128i narrow(__m256 x) {
  if constexpr (C == DType::kBFloat16) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    rounded = _mm256_srli_epi32(rounded, 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    // Every lane is <= 0xFFFF, so the unsigned-saturating pack is exact.
    return _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                            _mm256_extracti128_si256(rounded, 1));
  } else {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// One vector of 8 elements at i. kStream: the copy-out is written with a streaming store,
// which needs copy_out + i 16-byte aligned.
template <DType G, bool kCopyOut, DType C, bool kStream>
inline void update(const Buffers& b, const Coefficients& k, std::size_t i) {
  __m256 g = _mm256_mul_ps(load_grad<G>(b.grad, i), _mm256_set1_ps(k.grad_scale));
  __m256 p = _mm256_loadu_ps(b.param + i);
  __m256 m = _mm256_loadu_ps(b.exp_avg + i);
  __m256 v = _mm256_loadu_ps(b.exp_avg_sq + i);
  if (k.l2) g = _mm256_fmadd_ps(p, _mm256_set1_ps(k.l2_decay), g);
  p = _mm256_mul_ps(p, _mm256_set1_ps(k.param_decay));
  const __m256 diff = _mm256_sub_ps(g, m);
  m = k.lerp_small ? _mm256_fmadd_ps(_mm256_set1_ps(k.lerp_weight), diff, m)
                   : _mm256_fmadd_ps(_mm256_set1_ps(k.lerp_weight_minus_one), diff, g);
  v = _mm256_mul_ps(v, _mm256_set1_ps(k.beta2));
  v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k.one_minus_beta2), g), g, v);
  const __m256 denom =
      _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(k.bias_correction2_sqrt)),
                    _mm256_set1_ps(k.eps));
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(k.neg_step_size), m), denom));
  _mm256_storeu_ps(b.param + i, p);
  _mm256_storeu_ps(b.exp_avg + i, m);
  _mm256_storeu_ps(b.exp_avg_sq + i, v);
  if constexpr (kCopyOut) {
    auto* out = reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(b.copy_out) + i);
    if constexpr (kStream) {
      _mm_stream_si128(out, narrow<C>(p));
    } else {
      _mm_storeu_si128(out, narrow<C>(p));
    }
  }
}

inline void prefetch_inputs(const Buffers& b, std::size_t i, std::size_t grad_bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.grad) + i * grad_bytes, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i), _MM_HINT_T0);
}

// Elements [i, i + count), count < 8, run through the same vector code on zero-padded
// copies; the padding lanes compute harmless values that are dropped.
template <DType G, bool kCopyOut, DType C>
void update_partial(const Buffers& b, const Coefficients& k, std::size_t i, std::size_t count) {
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  alignas(32) float param[8] = {}, exp_avg[8] = {}, exp_avg_sq[8] = {};
  alignas(32) unsigned char grad[8 * kGradBytes] = {};
  alignas(32) std::uint16_t copy_out[8] = {};
  for (std::size_t j = 0; j < count; ++j) {
    param[j] = b.param[i + j];
    exp_avg[j] = b.exp_avg[i + j];
    exp_avg_sq[j] = b.exp_avg_sq[i + j];
  }
  const auto* grad_src = static_cast<const unsigned char*>(b.grad) + i * kGradBytes;
  for (std::size_t j = 0; j < count * kGradBytes; ++j) grad[j] = grad_src[j];
  Buffers padded = b;
  padded.param = param;
  padded.grad = grad;
  padded.exp_avg = exp_avg;
  padded.exp_avg_sq = exp_avg_sq;
  padded.copy_out = copy_out;
  padded.numel = 8;
  update<G, kCopyOut, C, false>(padded, k, 0);
  for (std::size_t j = 0; j < count; ++j) {
    b.param[i + j] = param[j];
    b.exp_avg[i + j] = exp_avg[j];
    b.exp_avg_sq[i + j] = exp_avg_sq[j];
    if constexpr (kCopyOut) static_cast<std::uint16_t*>(b.copy_out)[i + j] = copy_out[j];
  }
}

// See [Note: Adam memory traffic] in adam_kernels.h.
template <DType G, bool kCopyOut, DType C, bool kStream>
void run(const Buffers& b, const Coefficients& k) {
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  const std::size_t n = b.numel;
  std::size_t i = 0;
  if constexpr (kStream) {
    // Streaming stores need copy_out + i 16-byte aligned: run the few elements before that
    // boundary through the padded path (same arithmetic, so the same results).
    const std::size_t misaligned = reinterpret_cast<std::uintptr_t>(b.copy_out) % 16 / 2;
    std::size_t head = (8 - misaligned) % 8;
    if (head > n) head = n;
    if (head > 0) update_partial<G, kCopyOut, C>(b, k, 0, head);
    i = head;
  }
  // Two vectors (one 64-byte line of each fp32 stream) per prefetch.
  for (; i + kPrefetchNumel + 16 <= n; i += 16) {
    prefetch_inputs(b, i + kPrefetchNumel, kGradBytes);
    update<G, kCopyOut, C, kStream>(b, k, i);
    update<G, kCopyOut, C, kStream>(b, k, i + 8);
  }
  for (; i + 8 <= n; i += 8) update<G, kCopyOut, C, kStream>(b, k, i);
  if (i < n) update_partial<G, kCopyOut, C>(b, k, i, n - i);
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

void step_avx2(const Buffers& b, const Coefficients& k, bool stream_copy_out) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return run_grad<DType::kFloat32>(b, k, stream_copy_out);
    case DType::kBFloat16: return run_grad<DType::kBFloat16>(b, k, stream_copy_out);
    case DType::kFloat16: return run_grad<DType::kFloat16>(b, k, stream_copy_out);
  }
}

}  // namespace offload::adam::detail

#pragma GCC pop_options
