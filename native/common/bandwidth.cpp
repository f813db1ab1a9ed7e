// SSE2 only (the x86-64 baseline): the loops are memory-bound at the sizes they are measured
// at, so wider vectors would change nothing and would need per-ISA dispatch.
#include "common/bandwidth.h"

#include <immintrin.h>

#include <cstdint>

#include "common/thread_pool.h"

namespace offload {
namespace {

// As in native/adam: ranges of a multiple of 64 Ki elements, prefetch 512 elements ahead.
constexpr std::size_t kGrainNumel = std::size_t{1} << 16;
constexpr std::size_t kPrefetchNumel = 512;

void triad_range(float* a, const float* b, const float* c, std::size_t n, float scalar) {
  std::size_t i = 0;
  // Streaming stores need 16-byte alignment; a float array reaches it within 3 elements.
  for (; i < n && reinterpret_cast<std::uintptr_t>(a + i) % 16 != 0; ++i) {
    a[i] = b[i] + scalar * c[i];
  }
  const __m128 s = _mm_set1_ps(scalar);
  for (; i + 4 <= n; i += 4) {
    _mm_stream_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(s, _mm_loadu_ps(c + i))));
  }
  for (; i < n; ++i) a[i] = b[i] + scalar * c[i];
  _mm_sfence();
}

void traffic_range(float* p, const float* g, float* m, float* v, std::size_t n) {
  std::size_t i = 0;
  for (; i + kPrefetchNumel + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i + kPrefetchNumel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(g + i + kPrefetchNumel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + i + kPrefetchNumel), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + i + kPrefetchNumel), _MM_HINT_T0);
    for (std::size_t j = i; j < i + 16; j += 4) {
      const __m128 x = _mm_loadu_ps(g + j);
      _mm_storeu_ps(p + j, _mm_add_ps(_mm_loadu_ps(p + j), x));
      _mm_storeu_ps(m + j, _mm_add_ps(_mm_loadu_ps(m + j), x));
      _mm_storeu_ps(v + j, _mm_add_ps(_mm_loadu_ps(v + j), x));
    }
  }
  for (; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i];
  }
}

}  // namespace

void stream_triad(float* a, const float* b, const float* c, std::size_t numel, float scalar) {
  parallel_ranges(numel, kGrainNumel, [&](std::size_t begin, std::size_t end) {
    triad_range(a + begin, b + begin, c + begin, end - begin, scalar);
  });
}

void adam_traffic(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                  std::size_t numel) {
  parallel_ranges(numel, kGrainNumel, [&](std::size_t begin, std::size_t end) {
    traffic_range(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin);
  });
}

}  // namespace offload
