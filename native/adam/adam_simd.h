// The vector Adam kernel, written once for every instruction set: templates over a small
// per-ISA traits struct (the vector type and the few operations below). Only the per-ISA
// kernel files include it (adam_avx2.cpp, adam_avx512.cpp); the arithmetic is that of
// [Note: Adam numerics] in adam.h, the memory access that of [Note: Adam memory traffic] in
// adam_kernels.h.
//
// [Note: one kernel template, compiled per ISA]
// An ISA file includes its headers (<immintrin.h>, adam_kernels.h) first, then opens its
// `#pragma GCC target(...)` region, includes this header, defines its traits and calls
// simd_step<Traits> from its step_<isa>, all inside the region:
//  * GCC compiles a function for the target options in force where it is defined, not where
//    it is instantiated, so the templates below must be defined inside the region. GCC 12
//    does not define __AVX2__ and the like inside a pragma region in C++, so this header
//    cannot test for it; instead every traits op is always_inline (ADAM_SIMD_OP), and a
//    template compiled outside the region fails to build ("inlining failed ... target
//    specific option mismatch") rather than quietly calling the ops out of line.
//  * Everything here, and each ISA file's traits, has internal linkage (anonymous
//    namespaces). Each ISA file's copy of a function the two share, such as prefetch_inputs
//    (no traits parameter, so otherwise one symbol), stays its own; with external linkage
//    the linker would keep one of the two, possibly the AVX-512 one, and run it on a CPU
//    without AVX-512 (an ODR violation that shows up as SIGILL on some machines only).
//    `nm adam_avx2.o` lists step_avx2 and the elementwise kernels of elementwise_simd.h
//    (sgd_avx2, adagrad_avx2, rmsprop_avx2) as its only global symbols, likewise for AVX-512.
//  * No standard-library template is instantiated here or in the traits: std::min and the
//    like would be emitted as shared (COMDAT) symbols, with the same hazard.
//  * fp-contract=off must be in force so that no multiply and add is fused but the ones
//    written as fmadd (GCC's intrinsics are plain vector operators it may contract); every
//    ISA file sets it first, and it is repeated here so the template cannot go without.
//
// A traits struct V provides kWidth (floats per vector), the types Vec (kWidth floats),
// HalfVec (kWidth 16-bit values) and Lanes (the leading lanes of a partial vector), and
// these ADAM_SIMD_OP functions (lanes independent; each arithmetic op one IEEE-rounded
// instruction):
//   load, store              unaligned, kWidth floats
//   load_half, store_half    unaligned, kWidth 16-bit values
//   stream_half              a streaming store; needs the address kWidth * 2-byte aligned
//   stream                   a streaming store of kWidth floats; needs it kWidth * 4-byte aligned
//   first_lanes(count)       the Lanes of elements [0, count), count < kWidth
//   load_first, store_first, load_half_first, store_half_first
//                            the same on those lanes only: loads give 0 in the other lanes,
//                            stores leave the memory past them alone
//   broadcast                one float in every lane
//   add sub mul div sqrt
//   fmadd(a, b, c)           a * b + c, rounded once
//   widen_bf16, widen_fp16   16-bit values to float, exactly
//   narrow_bf16              round to nearest even with integer arithmetic, NaN to the quiet
//                            NaN 0x7FC0 (c10::BFloat16's; torch's vectorized cast writes 0xFFFF,
//                            also a NaN): torch's rounding (not VCVTNEPS2BF16, which flushes
//                            denormals to zero and so disagrees with torch)
//   narrow_fp16              VCVTPS2PH, round to nearest even
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam/adam_kernels.h"

// Declares a traits op: see [Note: one kernel template, compiled per ISA].
#define ADAM_SIMD_OP [[gnu::always_inline]] static inline

namespace offload::adam::detail {
namespace {

// The tail, and the head before the copy-out's streaming alignment, run as partial vectors
// (kPartial: the lanes in `lanes` only) through the same instructions as full ones, so every
// element sees identical arithmetic whatever its place in the buffer; the lanes past them
// compute harmless values from zeros, which are dropped.
template <class V, bool kPartial>
inline typename V::Vec load(const float* p, typename V::Lanes lanes) {
  if constexpr (kPartial) {
    return V::load_first(p, lanes);
  } else {
    return V::load(p);
  }
}

template <class V, bool kPartial>
inline void store(float* p, typename V::Vec x, typename V::Lanes lanes) {
  if constexpr (kPartial) {
    V::store_first(p, x, lanes);
  } else {
    V::store(p, x);
  }
}

template <class V, DType G, bool kPartial>
inline typename V::Vec load_grad(const void* grad, std::size_t i, typename V::Lanes lanes) {
  if constexpr (G == DType::kFloat32) {
    return load<V, kPartial>(static_cast<const float*>(grad) + i, lanes);
  } else {
    const std::uint16_t* p = static_cast<const std::uint16_t*>(grad) + i;
    const typename V::HalfVec h = kPartial ? V::load_half_first(p, lanes) : V::load_half(p);
    if constexpr (G == DType::kBFloat16) {
      return V::widen_bf16(h);
    } else {
      return V::widen_fp16(h);
    }
  }
}

template <class V, DType C>
inline typename V::HalfVec narrow(typename V::Vec x) {
  if constexpr (C == DType::kBFloat16) {
    return V::narrow_bf16(x);
  } else {
    return V::narrow_fp16(x);
  }
}

// Which fp32 outputs of an out-of-place step a full vector writes with a streaming store
// (Streaming::state; see [Note: Adam memory traffic]).
struct StateStreams {
  bool param = false;
  bool exp_avg = false;
  bool exp_avg_sq = false;
};

template <class V, bool kPartial, bool kStreamState>
inline void store_state(float* p, typename V::Vec x, typename V::Lanes lanes, bool stream) {
  if constexpr (kStreamState && !kPartial) {
    if (stream) return V::stream(p, x);
  }
  store<V, kPartial>(p, x, lanes);
}

// One vector of V::kWidth elements at i, or with kPartial only the lanes in `lanes`.
// kStream: the copy-out is written with a streaming store, which needs copy_out + i aligned
// to V::kWidth * 2 bytes; kStreamState: so are the fp32 outputs `streams` names, aligned to
// V::kWidth * 4 bytes. Partial vectors never stream.
template <class V, DType G, bool kCopyOut, DType C, bool kPartial, bool kStream, bool kStreamState>
inline void update(const Buffers& b, const Coefficients& k, std::size_t i,
                   typename V::Lanes lanes = typename V::Lanes(), StateStreams streams = StateStreams()) {
  static_assert(!(kPartial && kStream), "a partial vector cannot be streamed");
  using Vec = typename V::Vec;
  Vec g = V::mul(load_grad<V, G, kPartial>(b.grad, i, lanes), V::broadcast(k.grad_scale));
  Vec p = load<V, kPartial>(b.param + i, lanes);
  Vec m = load<V, kPartial>(b.exp_avg + i, lanes);
  Vec v = load<V, kPartial>(b.exp_avg_sq + i, lanes);
  if (k.l2) g = V::fmadd(p, V::broadcast(k.l2_decay), g);
  p = V::mul(p, V::broadcast(k.param_decay));
  const Vec diff = V::sub(g, m);
  m = k.lerp_small ? V::fmadd(V::broadcast(k.lerp_weight), diff, m)
                   : V::fmadd(V::broadcast(k.lerp_weight_minus_one), diff, g);
  v = V::mul(v, V::broadcast(k.beta2));
  v = V::fmadd(V::mul(V::broadcast(k.one_minus_beta2), g), g, v);
  const Vec denom = V::add(V::div(V::sqrt(v), V::broadcast(k.bias_correction2_sqrt)),
                           V::broadcast(k.eps));
  p = V::add(p, V::div(V::mul(V::broadcast(k.neg_step_size), m), denom));
  store_state<V, kPartial, kStreamState>(b.param_out + i, p, lanes, streams.param);
  store_state<V, kPartial, kStreamState>(b.exp_avg_out + i, m, lanes, streams.exp_avg);
  store_state<V, kPartial, kStreamState>(b.exp_avg_sq_out + i, v, lanes, streams.exp_avg_sq);
  if constexpr (kCopyOut) {
    std::uint16_t* out = static_cast<std::uint16_t*>(b.copy_out) + i;
    const typename V::HalfVec h = narrow<V, C>(p);
    if constexpr (kPartial) {
      V::store_half_first(out, h, lanes);
    } else if constexpr (kStream) {
      V::stream_half(out, h);
    } else {
      V::store_half(out, h);
    }
  }
}

inline void prefetch_inputs(const Buffers& b, std::size_t i, std::size_t grad_bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(b.grad) + i * grad_bytes, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i), _MM_HINT_T0);
}

// Elements before address p (of elements `bytes` wide) reaches a V::kWidth-element
// boundary: the position of p within its vector, counted in elements.
template <class V>
inline std::size_t phase(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) / bytes % V::kWidth;
}

// See [Note: Adam memory traffic] in adam_kernels.h.
template <class V, DType G, bool kCopyOut, DType C, bool kStream, bool kStreamState>
void run(const Buffers& given_b, const Coefficients& given_k) {
  // Copies, not the caller's structs: a vector store may alias anything the caller can see
  // (the intrinsics store through may_alias types), so through the references GCC reloads
  // every pointer and coefficient and re-tests k.l2 and k.lerp_small after each store.
  const Buffers b = given_b;
  const Coefficients k = given_k;
  constexpr std::size_t kWidth = V::kWidth;
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  // One prefetch per 64-byte line of each fp32 stream, that line's vectors after it.
  constexpr std::size_t kLineNumel = 64 / sizeof(float);
  static_assert(kLineNumel % kWidth == 0, "a line holds whole vectors");
  const std::size_t n = b.numel;
  std::size_t i = 0;
  StateStreams streams;
  if constexpr (kStream || kStreamState) {
    // Streaming stores need their address aligned to the vector: run the few elements
    // before the lead output's boundary as a partial vector (same arithmetic, so the same
    // results). The lead is the copy-out when it streams, else param_out.
    const std::size_t lead = kStream ? phase<V>(b.copy_out, 2) : phase<V>(b.param_out, 4);
    std::size_t head = (kWidth - lead) % kWidth;
    if (head > n) head = n;
    if constexpr (kStreamState) {
      // An output streams only apart from its input, 4-byte aligned, and aligned by this head.
      auto aligned = [&](const float* out, const float* in) {
        return out != in && reinterpret_cast<std::uintptr_t>(out) % 4 == 0 &&
               (phase<V>(out, 4) + head) % kWidth == 0;
      };
      streams.param = aligned(b.param_out, b.param);
      streams.exp_avg = aligned(b.exp_avg_out, b.exp_avg);
      streams.exp_avg_sq = aligned(b.exp_avg_sq_out, b.exp_avg_sq);
    }
    if (head > 0) update<V, G, kCopyOut, C, true, false, false>(b, k, 0, V::first_lanes(head));
    i = head;
  }
  for (; i + kPrefetchNumel + kLineNumel <= n; i += kLineNumel) {
    prefetch_inputs(b, i + kPrefetchNumel, kGradBytes);
    for (std::size_t j = 0; j < kLineNumel; j += kWidth) {
      update<V, G, kCopyOut, C, false, kStream, kStreamState>(b, k, i + j, typename V::Lanes(), streams);
    }
  }
  for (; i + kWidth <= n; i += kWidth) {
    update<V, G, kCopyOut, C, false, kStream, kStreamState>(b, k, i, typename V::Lanes(), streams);
  }
  if (i < n) update<V, G, kCopyOut, C, true, false, false>(b, k, i, V::first_lanes(n - i));
  // Streaming stores are weakly ordered: make them visible before the pool reports done.
  if constexpr (kStream || kStreamState) _mm_sfence();
}

template <class V, DType G, bool kStreamState>
void run_copy_out(const Buffers& b, const Coefficients& k, bool stream_copy_out) {
  if (b.copy_out == nullptr) return run<V, G, false, DType::kFloat32, false, kStreamState>(b, k);
  if (b.copy_out_dtype == DType::kBFloat16) {
    return stream_copy_out ? run<V, G, true, DType::kBFloat16, true, kStreamState>(b, k)
                           : run<V, G, true, DType::kBFloat16, false, kStreamState>(b, k);
  }
  return stream_copy_out ? run<V, G, true, DType::kFloat16, true, kStreamState>(b, k)
                         : run<V, G, true, DType::kFloat16, false, kStreamState>(b, k);
}

template <class V, DType G>
void run_grad(const Buffers& b, const Coefficients& k, const Streaming& streaming) {
  return streaming.state ? run_copy_out<V, G, true>(b, k, streaming.copy_out)
                         : run_copy_out<V, G, false>(b, k, streaming.copy_out);
}

// The body of step_<isa> (adam_kernels.h) for the ISA of V.
template <class V>
void simd_step(const Buffers& b, const Coefficients& k, const Streaming& streaming) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return run_grad<V, DType::kFloat32>(b, k, streaming);
    case DType::kBFloat16: return run_grad<V, DType::kBFloat16>(b, k, streaming);
    case DType::kFloat16: return run_grad<V, DType::kFloat16>(b, k, streaming);
  }
}

}  // namespace
}  // namespace offload::adam::detail
