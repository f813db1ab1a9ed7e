// The vector SGD, Adagrad and RMSprop kernels, written once for every instruction set over the traits
// structs of the Adam kernels: each ISA file includes this right after adam_simd.h, inside
// its target region, and calls elementwise_simd<Traits> from its sgd_<isa>, adagrad_<isa>
// and rmsprop_<isa> ([Note: one kernel template, compiled per ISA] in adam_simd.h,
// whose load/store/load_grad helpers these use). Arithmetic: [Note: elementwise kernel numerics]
// in elementwise.h; the tail runs as a partial vector through the same instructions.
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam/adam_simd.h"
#include "adam/elementwise_kernels.h"

namespace offload::adam::detail {
namespace {

template <class V, DType G, bool kPartial>
inline void elementwise_update(const ElementwiseBuffers& b, const SgdCoefficients& k, std::size_t i,
                               typename V::Lanes lanes) {
  using Vec = typename V::Vec;
  Vec g = V::mul(load_grad<V, G, kPartial>(b.grad, i, lanes), V::broadcast(k.grad_scale));
  const Vec p = load<V, kPartial>(b.param + i, lanes);
  if (k.decay) g = V::fmadd(p, V::broadcast(k.weight_decay), g);
  if (k.momentum) {
    Vec buf = g;
    if (!k.first_step) {
      buf = V::mul(load<V, kPartial>(b.state + i, lanes), V::broadcast(k.momentum_factor));
      buf = V::fmadd(g, V::broadcast(k.one_minus_dampening), buf);
    }
    store<V, kPartial>(b.state + i, buf, lanes);
    g = k.nesterov ? V::fmadd(buf, V::broadcast(k.momentum_factor), g) : buf;
  }
  store<V, kPartial>(b.param + i, V::fmadd(g, V::broadcast(k.neg_lr), p), lanes);
}

template <class V, DType G, bool kPartial>
inline void elementwise_update(const ElementwiseBuffers& b, const AdagradCoefficients& k, std::size_t i,
                               typename V::Lanes lanes) {
  using Vec = typename V::Vec;
  Vec g = V::mul(load_grad<V, G, kPartial>(b.grad, i, lanes), V::broadcast(k.grad_scale));
  const Vec p = load<V, kPartial>(b.param + i, lanes);
  if (k.decay) g = V::fmadd(p, V::broadcast(k.weight_decay), g);
  const Vec s = V::fmadd(g, g, load<V, kPartial>(b.state + i, lanes));
  store<V, kPartial>(b.state + i, s, lanes);
  const Vec std_dev = V::add(V::sqrt(s), V::broadcast(k.eps));
  store<V, kPartial>(b.param + i, V::add(p, V::div(V::mul(V::broadcast(k.neg_clr), g), std_dev)), lanes);
}

template <class V, DType G, bool kPartial>
inline void elementwise_update(const ElementwiseBuffers& b, const RmspropCoefficients& k, std::size_t i,
                               typename V::Lanes lanes) {
  using Vec = typename V::Vec;
  Vec g = V::mul(load_grad<V, G, kPartial>(b.grad, i, lanes), V::broadcast(k.grad_scale));
  const Vec p = load<V, kPartial>(b.param + i, lanes);
  if (k.decay) g = V::fmadd(p, V::broadcast(k.weight_decay), g);
  Vec s = V::mul(load<V, kPartial>(b.state + i, lanes), V::broadcast(k.alpha));
  s = V::fmadd(V::mul(V::broadcast(k.one_minus_alpha), g), g, s);
  store<V, kPartial>(b.state + i, s, lanes);
  Vec avg;
  if (k.centered) {
    Vec ga = load<V, kPartial>(b.state2 + i, lanes);
    const Vec diff = V::sub(g, ga);
    ga = k.lerp_small ? V::fmadd(V::broadcast(k.one_minus_alpha), diff, ga)
                      : V::fmadd(V::broadcast(k.lerp_weight_minus_one), diff, g);
    store<V, kPartial>(b.state2 + i, ga, lanes);
    avg = V::sqrt(V::fmadd(V::mul(V::broadcast(-1.0f), ga), ga, s));
  } else {
    avg = V::sqrt(s);
  }
  avg = V::add(avg, V::broadcast(k.eps));
  if (k.momentum) {
    Vec buf = V::mul(load<V, kPartial>(b.state3 + i, lanes), V::broadcast(k.momentum_factor));
    buf = V::add(buf, V::div(V::mul(V::broadcast(1.0f), g), avg));
    store<V, kPartial>(b.state3 + i, buf, lanes);
    store<V, kPartial>(b.param + i, V::fmadd(buf, V::broadcast(k.neg_lr), p), lanes);
  } else {
    store<V, kPartial>(b.param + i, V::add(p, V::div(V::mul(V::broadcast(k.neg_lr), g), avg)), lanes);
  }
}

// The loop of Adam's kernel without its streaming stores: software prefetch one line of each
// stream kPrefetchNumel elements ahead, full vectors, then the tail as a partial vector.
template <class V, DType G, class K>
void elementwise_run(const ElementwiseBuffers& given_b, const K& given_k) {
  // Copies, for the reason adam_simd.h's run gives (stores may alias the callers' structs).
  const ElementwiseBuffers b = given_b;
  const K k = given_k;
  constexpr std::size_t kWidth = V::kWidth;
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  constexpr std::size_t kLineNumel = 64 / sizeof(float);
  static_assert(kLineNumel % kWidth == 0, "a line holds whole vectors");
  const std::size_t n = b.numel;
  std::size_t i = 0;
  for (; i + kPrefetchNumel + kLineNumel <= n; i += kLineNumel) {
    const std::size_t ahead = i + kPrefetchNumel;
    _mm_prefetch(reinterpret_cast<const char*>(b.param + ahead), _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(b.grad) + ahead * kGradBytes, _MM_HINT_T0);
    if (b.state != nullptr) _mm_prefetch(reinterpret_cast<const char*>(b.state + ahead), _MM_HINT_T0);
    if (b.state2 != nullptr) _mm_prefetch(reinterpret_cast<const char*>(b.state2 + ahead), _MM_HINT_T0);
    if (b.state3 != nullptr) _mm_prefetch(reinterpret_cast<const char*>(b.state3 + ahead), _MM_HINT_T0);
    for (std::size_t j = 0; j < kLineNumel; j += kWidth) {
      elementwise_update<V, G, false>(b, k, i + j, typename V::Lanes());
    }
  }
  for (; i + kWidth <= n; i += kWidth) elementwise_update<V, G, false>(b, k, i, typename V::Lanes());
  if (i < n) elementwise_update<V, G, true>(b, k, i, V::first_lanes(n - i));
}

template <class V, class K>
void elementwise_simd(const ElementwiseBuffers& b, const K& k) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return elementwise_run<V, DType::kFloat32>(b, k);
    case DType::kBFloat16: return elementwise_run<V, DType::kBFloat16>(b, k);
    case DType::kFloat16: return elementwise_run<V, DType::kFloat16>(b, k);
  }
}

}  // namespace
}  // namespace offload::adam::detail
