// The vector kernel of the fused compact step, written once for every instruction set:
// templates over a per-ISA traits struct, compiled inside each ISA file's target region
// exactly as native/adam/adam_simd.h is (see [Note: one kernel template, compiled per ISA]
// there: include after the pragma, internal linkage only, every op always_inline, no
// standard-library template). The arithmetic is [Note: compact step numerics] in compact.h,
// one vector instruction per scalar operation of the reference kernel (compact_scalar.cpp).
//
// A traits struct V provides kWidth (lanes), Vec (kWidth floats), IVec (kWidth int32),
// Mask (a lane predicate), and these COMPACT_SIMD_OP functions:
//   load, store                   kWidth floats (unaligned)
//   load_grad_{f32,bf16,f16}      kWidth grad values widened to float, exactly
//   load_u16, load_i8, load_u8    kWidth codes, zero/sign-extended to int32
//   store_u16, store_i8, store_u8 the low 16/8 bits of each int32 lane (values in range)
//   broadcast, zero, add sub mul div sqrt max (IEEE, max of non-NaN values exact)
//   abs, or_sign(a, b)            clear the sign bit; a with b's sign bit OR-ed in
//   round_even                    to an integral value, half to even
//   to_float, to_int              int32 <-> float (exact on the integral values used)
//   as_float, as_int              bit casts
//   iset, iadd, isub, iand, imax, shl, shr, shlv, igt, iselect
//   fmadd(a, b, c), fnmadd(a, b, c)   a * b + c, -(a * b) + c, rounded once (only in
//                                     divide, which gives a division's bits)
//   iset, iadd, isub, iand, imax, shl, shr, sar (arithmetic), shlv, igt, iselect
//   lt, gt (ordered), all_lanes, first_lanes(count), mask_and, all, any, fselect
//
// [Note: compact kernel divisions] The rule's divisions are IEEE divisions; the divider is
// what bounds this kernel (8 divisions and 4 square roots per element against the exact
// Adam kernel's 2 and 1), so all but m / denom are computed otherwise, with the same bits:
//  * a / b by q = RN(a * y), y = RN(1 / b), then one correction q + fma(-q, b, a) * y (two
//    fused multiply-adds: the remainder is exact). Markstein's theorem: with y within half
//    an ulp of 1/b and q within one ulp of a/b, this is RN(a / b) when nothing underflows.
//    Used where that holds or cannot change a stored bit:
//    - codes over 127, 255 and 254 (|c_m| / 127, c_v / 255, low / 254): checked for every
//      code exhaustively (and by test_optim_compact.py's every-code test, on each ISA);
//    - |m| / s_m and v / s_v for a block scale s in [2^-60, 2^100] (else the block divides):
//      a quotient small enough for the remainder to underflow (below 2^-36) encodes as code 0
//      (exp_avg_sq's then at least 1) whatever its last bits;
//    - sqrt(v) / sqrt(1 - beta2^t) for that constant in [2^-60, 1] (else the step divides):
//      sqrt(v) is 0 or at least 2^-75, so the remainder is normal.
//    Checked besides on 8e8 random pairs over those ranges (no difference).
//  * (low * ulp) / 254 = RN(low / 254) * ulp: scaling by a power of two commutes with
//    rounding while the result is normal, which holds for ulp >= 2^-118 (bf16 exponent
//    field >= 16); a vector with a smaller ulp divides.
//  * (x - high) / ulp = ((x - high) * 2^a) * 2^b with a + b = -log2(ulp): exact, since the
//    remainder is a multiple of x's fp32 ulp, at least ulp * 2^-17, so both products are
//    normal (2^a and 2^b, each at most 2^67, are normal floats themselves).
#pragma once
#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "compact/compact_kernels.h"

// Declares a traits op: see [Note: one kernel template, compiled per ISA] in adam_simd.h.
#define COMPACT_SIMD_OP [[gnu::always_inline]] static inline

namespace offload::compact::detail {
namespace {

using adam::DType;

inline float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One block's pointers (at its first element).
struct Block {
  const void* grad;
  std::uint16_t* high;
  std::int8_t* low;
  std::int8_t* exp_avg;
  std::uint8_t* exp_avg_sq;
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
};

// The new fp32 values of one block, between the update and the encoding.
struct Scratch {
  alignas(64) float m[kBlockNumel];
  alignas(64) float v[kBlockNumel];
  alignas(64) float x[kBlockNumel];
};

template <class V, DType G>
[[gnu::always_inline]] inline typename V::Vec load_grad(const void* grad, std::size_t i) {
  if constexpr (G == DType::kFloat32) {
    return V::load_grad_f32(static_cast<const float*>(grad) + i);
  } else if constexpr (G == DType::kBFloat16) {
    return V::load_grad_bf16(static_cast<const std::uint16_t*>(grad) + i);
  } else {
    return V::load_grad_f16(static_cast<const std::uint16_t*>(grad) + i);
  }
}

// ulp_of_bf16 of bf16 bits in the low half of each lane: 2^(e - 7), 2^-133 for zero and
// subnormals (the scalar kernel's).
template <class V>
[[gnu::always_inline]] inline typename V::Vec ulp_of_bf16(typename V::IVec high) {
  const typename V::IVec biased = V::iand(V::template shr<7>(high), V::iset(0xFF));
  const typename V::IVec normal = V::template shl<23>(V::isub(biased, V::iset(7)));
  const typename V::IVec subnormal =
      V::shlv(V::iset(1), V::iadd(V::imax(biased, V::iset(1)), V::iset(15)));
  return V::as_float(V::iselect(V::igt(biased, V::iset(7)), normal, subnormal));
}

// RN(a / b) given reciprocal = RN(1 / b), where [Note: compact kernel divisions] says so.
template <class V>
[[gnu::always_inline]] inline typename V::Vec divide(typename V::Vec a, typename V::Vec b,
                                                     typename V::Vec reciprocal) {
  const typename V::Vec q = V::mul(a, reciprocal);
  return V::fmadd(V::fnmadd(q, b, a), reciprocal, q);
}

// Whether a / b may go through divide() for a block scale or the bias correction b.
inline bool reciprocal_exact(float b, float largest) { return b >= 0x1p-60f && b <= largest; }

// x / ulp_of_bf16(high) for x = (a master) - (its bf16 high): two exact power-of-two
// products (see [Note: compact kernel divisions]).
template <class V>
[[gnu::always_inline]] inline typename V::Vec over_ulp(typename V::Vec x, typename V::IVec high) {
  const typename V::IVec biased = V::iand(V::template shr<7>(high), V::iset(0xFF));
  const typename V::IVec minus_k = V::isub(V::iset(134), V::imax(biased, V::iset(1)));  // -log2(ulp)
  const typename V::IVec a = V::template sar<1>(minus_k);
  const typename V::IVec b = V::isub(minus_k, a);
  const typename V::Vec two_a = V::as_float(V::template shl<23>(V::iadd(a, V::iset(127))));
  const typename V::Vec two_b = V::as_float(V::template shl<23>(V::iadd(b, V::iset(127))));
  return V::mul(V::mul(x, two_a), two_b);
}

// (low * ulp_of_bf16(high)) / 254, the master's low part decoded.
template <class V>
[[gnu::always_inline]] inline typename V::Vec low_part(typename V::IVec low, typename V::IVec high,
                                                       typename V::Vec c254, typename V::Vec r254) {
  const typename V::Vec ulp = ulp_of_bf16<V>(high);
  const typename V::Vec l = V::to_float(low);
  const typename V::IVec biased = V::iand(V::template shr<7>(high), V::iset(0xFF));
  if (V::any(V::igt(V::iset(16), biased))) return V::div(V::mul(l, ulp), c254);  // a result below normal
  return V::mul(divide<V>(l, c254, r254), ulp);
}

// bf16 bits (in the low half of each lane) of finite x, rounded to nearest even.
template <class V>
[[gnu::always_inline]] inline typename V::IVec narrow_bf16(typename V::Vec x) {
  const typename V::IVec bits = V::as_int(x);
  const typename V::IVec lsb = V::iand(V::template shr<16>(bits), V::iset(1));
  return V::template shr<16>(V::iadd(bits, V::iadd(lsb, V::iset(0x7FFF))));
}

// The first element of a block that compact states cannot hold (the scalar kernel's checks,
// in its order), once the vector checks found one.
inline Failure first_problem(const Scratch& s, std::size_t valid, std::size_t first_element) {
  const float inf = float_from_bits(0x7F800000u);
  const float overflow = float_from_bits(0x7F7F8000u);
  for (std::size_t i = 0; i < valid; ++i) {
    const float am = s.m[i] < 0 ? -s.m[i] : s.m[i];
    const float ax = s.x[i] < 0 ? -s.x[i] : s.x[i];
    if (!(am < inf)) return Failure{Problem::kExpAvg, first_element + i, s.m[i], 0};
    if (!(s.v[i] < inf)) return Failure{Problem::kExpAvgSq, first_element + i, s.v[i], 0};
    if (!(ax < inf)) return Failure{Problem::kMaster, first_element + i, s.x[i], 0};
    if (!(ax < overflow)) return Failure{Problem::kMasterHigh, first_element + i, s.x[i], 0};
  }
  return Failure{Problem::kMaster, first_element, 0.0f, 0};  // unreachable: the vector check found one
}

// Steps one block of n elements (a multiple of kWidth) of which the first `valid` are real
// (the rest staged zeros, dropped): decode and update into `s`, check, then encode and store.
template <class V, DType G>
inline Failure block_step(const Block& p, std::size_t n, std::size_t valid, const Constants& k,
                          Scratch& s, std::size_t first_element) {
  using Vec = typename V::Vec;
  using Mask = typename V::Mask;
  constexpr std::size_t kWidth = V::kWidth;
  const Vec zero = V::zero();
  const Vec inf = V::broadcast(float_from_bits(0x7F800000u));
  const Vec overflow = V::broadcast(float_from_bits(0x7F7F8000u));
  const Vec c127 = V::broadcast(127.0f), c254 = V::broadcast(254.0f), c255 = V::broadcast(255.0f);
  const Vec r127 = V::broadcast(1.0f / 127.0f), r254 = V::broadcast(1.0f / 254.0f);
  const Vec r255 = V::broadcast(1.0f / 255.0f);
  const Vec s_m = V::broadcast(*p.exp_avg_scale), s_v = V::broadcast(*p.exp_avg_sq_scale);
  const Vec grad_scale = V::broadcast(k.grad_scale), decay = V::broadcast(k.decay);
  const Vec beta1 = V::broadcast(k.beta1), one_minus_beta1 = V::broadcast(k.one_minus_beta1);
  const Vec beta2 = V::broadcast(k.beta2), one_minus_beta2 = V::broadcast(k.one_minus_beta2);
  const Vec bc2 = V::broadcast(k.sqrt_bias_correction2), eps = V::broadcast(k.eps);
  const bool bc2_by_reciprocal = reciprocal_exact(k.sqrt_bias_correction2, 1.0f);
  const Vec bc2_reciprocal = V::broadcast(1.0f / k.sqrt_bias_correction2);
  const Vec step_size = V::broadcast(k.step_size);
  Vec max_m = zero, max_v = zero;
  Mask ok = V::all_lanes();
  for (std::size_t i = 0; i < n; i += kWidth) {
    Vec g = V::mul(load_grad<V, G>(p.grad, i), grad_scale);
    const typename V::IVec h = V::load_u16(p.high + i);
    Vec x = V::add(V::as_float(V::template shl<16>(h)), low_part<V>(V::load_i8(p.low + i), h, c254, r254));
    const Vec c_m = V::to_float(V::load_i8(p.exp_avg + i));
    const Vec u_m = divide<V>(V::abs(c_m), c127, r127);
    Vec m = V::or_sign(V::mul(V::mul(u_m, u_m), s_m), c_m);  // sign(c) * y, y >= +0
    const Vec u_v = divide<V>(V::to_float(V::load_u8(p.exp_avg_sq + i)), c255, r255);
    const Vec sq = V::mul(u_v, u_v);
    Vec v = V::mul(V::mul(sq, sq), s_v);
    if (k.adamw) {
      x = V::mul(x, decay);
    } else {
      g = V::add(g, V::mul(x, decay));
    }
    m = V::add(V::mul(m, beta1), V::mul(g, one_minus_beta1));
    v = V::add(V::mul(v, beta2), V::mul(V::mul(g, g), one_minus_beta2));
    const Vec root = V::sqrt(v);
    const Vec denom = V::add(bc2_by_reciprocal ? divide<V>(root, bc2, bc2_reciprocal) : V::div(root, bc2), eps);
    x = V::sub(x, V::mul(V::div(m, denom), step_size));
    if (i + kWidth > valid) {  // staged lanes: zeros, which change no maximum and no check
      const Mask real = V::first_lanes(valid > i ? valid - i : 0);
      m = V::fselect(real, m, zero), v = V::fselect(real, v, zero), x = V::fselect(real, x, zero);
    }
    V::store(s.m + i, m), V::store(s.v + i, v), V::store(s.x + i, x);
    const Vec abs_m = V::abs(m), abs_x = V::abs(x);
    max_m = V::max(max_m, abs_m);
    max_v = V::max(max_v, v);
    ok = V::mask_and(ok, V::mask_and(V::lt(abs_m, inf), V::mask_and(V::lt(v, inf), V::lt(abs_x, overflow))));
  }
  // Nothing of a block with a value compact states cannot hold is stored.
  if (!V::all(ok)) return first_problem(s, valid, first_element);
  alignas(64) float lanes[2][kWidth];
  V::store(lanes[0], max_m), V::store(lanes[1], max_v);
  float block_max_m = 0.0f, block_max_v = 0.0f;
  for (std::size_t j = 0; j < kWidth; ++j) {
    block_max_m = lanes[0][j] > block_max_m ? lanes[0][j] : block_max_m;
    block_max_v = lanes[1][j] > block_max_v ? lanes[1][j] : block_max_v;
  }
  const float safe_max_m = block_max_m == 0.0f ? 1.0f : block_max_m;
  const float safe_max_v = block_max_v == 0.0f ? 1.0f : block_max_v;
  const bool m_by_reciprocal = reciprocal_exact(safe_max_m, 0x1p100f);
  const bool v_by_reciprocal = reciprocal_exact(safe_max_v, 0x1p100f);
  const Vec safe_m = V::broadcast(safe_max_m), safe_v = V::broadcast(safe_max_v);
  const Vec reciprocal_m = V::broadcast(1.0f / safe_max_m), reciprocal_v = V::broadcast(1.0f / safe_max_v);
  const Vec one = V::broadcast(1.0f);
  for (std::size_t i = 0; i < n; i += kWidth) {
    const Vec m = V::load(s.m + i), v = V::load(s.v + i), x = V::load(s.x + i);
    const Vec abs_m = V::abs(m);
    const Vec q_m = m_by_reciprocal ? divide<V>(abs_m, safe_m, reciprocal_m) : V::div(abs_m, safe_m);
    const Vec r_m = V::round_even(V::mul(V::sqrt(q_m), c127));
    V::store_i8(p.exp_avg + i, V::to_int(V::or_sign(r_m, m)));
    const Vec q_v = v_by_reciprocal ? divide<V>(v, safe_v, reciprocal_v) : V::div(v, safe_v);
    Vec r_v = V::round_even(V::mul(V::sqrt(V::sqrt(q_v)), c255));
    r_v = V::fselect(V::gt(v, zero), V::max(r_v, one), r_v);  // never 0 for v > 0
    V::store_u8(p.exp_avg_sq + i, V::to_int(r_v));
    const typename V::IVec h = narrow_bf16<V>(x);
    const Vec rest = V::sub(x, V::as_float(V::template shl<16>(h)));
    V::store_i8(p.low + i, V::to_int(V::round_even(V::mul(over_ulp<V>(rest, h), c254))));
    V::store_u16(p.high + i, h);
  }
  *p.exp_avg_scale = block_max_m;
  *p.exp_avg_sq_scale = block_max_v;
  return Failure{};
}

// The body of step_<isa> (compact_kernels.h) for the ISA of V and grad dtype G.
template <class V, DType G>
Failure run(const Buffers& given_b, const Constants& given_k, std::size_t first_element) {
  const Buffers b = given_b;  // copies: see run() in adam_simd.h
  const Constants k = given_k;
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  Scratch scratch;
  const std::size_t full_blocks = b.numel / kBlockNumel;
  for (std::size_t block = 0; block < full_blocks; ++block) {
    const std::size_t e = block * kBlockNumel;
    const Block p{static_cast<const char*>(b.grad) + e * kGradBytes, b.high + e, b.low + e,
                  b.exp_avg + e, b.exp_avg_sq + e, b.exp_avg_scales + block, b.exp_avg_sq_scales + block};
    const Failure failure = block_step<V, G>(p, kBlockNumel, kBlockNumel, k, scratch, first_element + e);
    if (failure.problem != Problem::kNone) return failure;
  }
  const std::size_t e = full_blocks * kBlockNumel;
  const std::size_t rest = b.numel - e;
  if (rest == 0) return Failure{};
  // The last, shorter block runs through the same vector code on zero-padded copies of its
  // inputs; only its `rest` elements are copied back.
  alignas(64) unsigned char grad[kBlockNumel * 4] = {};
  alignas(64) std::uint16_t high[kBlockNumel] = {};
  alignas(64) std::int8_t low[kBlockNumel] = {}, exp_avg[kBlockNumel] = {};
  alignas(64) std::uint8_t exp_avg_sq[kBlockNumel] = {};
  std::memcpy(grad, static_cast<const char*>(b.grad) + e * kGradBytes, rest * kGradBytes);
  std::memcpy(high, b.high + e, rest * 2);
  std::memcpy(low, b.low + e, rest);
  std::memcpy(exp_avg, b.exp_avg + e, rest);
  std::memcpy(exp_avg_sq, b.exp_avg_sq + e, rest);
  const Block p{grad, high, low, exp_avg, exp_avg_sq, b.exp_avg_scales + full_blocks,
                b.exp_avg_sq_scales + full_blocks};
  const std::size_t n = (rest + V::kWidth - 1) / V::kWidth * V::kWidth;
  const Failure failure = block_step<V, G>(p, n, rest, k, scratch, first_element + e);
  if (failure.problem != Problem::kNone) return failure;
  std::memcpy(b.high + e, high, rest * 2);
  std::memcpy(b.low + e, low, rest);
  std::memcpy(b.exp_avg + e, exp_avg, rest);
  std::memcpy(b.exp_avg_sq + e, exp_avg_sq, rest);
  return Failure{};
}

// check_gradient_<isa> (compact_kernels.h) for V and G: whole vectors checked at once, a
// vector with a non-finite value counted lane by lane.
template <class V, DType G>
Failure check(const Buffers& given_b, const Constants& given_k, std::size_t first_element) {
  const Buffers b = given_b;
  const Constants k = given_k;
  constexpr std::size_t kWidth = V::kWidth;
  constexpr std::size_t kGradBytes = G == DType::kFloat32 ? 4 : 2;
  const typename V::Vec grad_scale = V::broadcast(k.grad_scale);
  const typename V::Vec inf = V::broadcast(float_from_bits(0x7F800000u));
  Failure failure;
  alignas(64) float values[kWidth];
  alignas(64) unsigned char staged[kWidth * 4];
  for (std::size_t i = 0; i < b.numel; i += kWidth) {
    const void* at = static_cast<const char*>(b.grad) + i * kGradBytes;
    const std::size_t count = b.numel - i < kWidth ? b.numel - i : kWidth;
    if (count < kWidth) {  // the tail, zero-padded
      std::memset(staged, 0, sizeof staged);
      std::memcpy(staged, at, count * kGradBytes);
      at = staged;
    }
    const typename V::Vec g = V::mul(load_grad<V, G>(at, 0), grad_scale);
    if (V::all(V::lt(V::abs(g), inf))) continue;
    V::store(values, g);
    for (std::size_t j = 0; j < count; ++j) {
      if (values[j] < float_from_bits(0x7F800000u) && values[j] > -float_from_bits(0x7F800000u)) continue;
      if (failure.count++ == 0) failure = Failure{Problem::kGradient, first_element + i + j, values[j], 1};
    }
  }
  return failure;
}

template <class V>
Failure simd_check(const Buffers& b, const Constants& k, std::size_t first_element) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return check<V, DType::kFloat32>(b, k, first_element);
    case DType::kBFloat16: return check<V, DType::kBFloat16>(b, k, first_element);
    case DType::kFloat16: return check<V, DType::kFloat16>(b, k, first_element);
  }
  return Failure{};
}

template <class V>
Failure simd_step(const Buffers& b, const Constants& k, std::size_t first_element) {
  switch (b.grad_dtype) {
    case DType::kFloat32: return run<V, DType::kFloat32>(b, k, first_element);
    case DType::kBFloat16: return run<V, DType::kBFloat16>(b, k, first_element);
    case DType::kFloat16: return run<V, DType::kFloat16>(b, k, first_element);
  }
  return Failure{};
}

}  // namespace
}  // namespace offload::compact::detail
