// The AdamW/Adam step on compact optimizer states ([Note: compact optimizer states] in
// offload/memory/compact_codec.py), fused: per block of kBlockNumel elements it decodes the
// two 8-bit moments and the master (bf16 high + int8 low), updates them and encodes them
// again, in one pass over memory. Kernels per instruction set (scalar reference, AVX2,
// AVX-512) on the ISA the Adam kernel uses (adam::selected_isa, OFFLOAD_FORCE_ISA).
//
// [Note: compact step numerics] Every ISA computes the bits of the torch-ops rule
// (offload/optim/compact.py, compact_adam_step_reference), element by element:
//   g = grad * grad_scale;  x = high + (low * ulp(high)) / 254
//   m = sign(c_m) * (((|c_m| / 127) * (|c_m| / 127)) * s_m)
//   v = (((c_v / 255) * (c_v / 255)) * ((c_v / 255) * (c_v / 255))) * s_v
//   AdamW: x = x * decay               Adam: g = g + x * decay
//   m = m * beta1 + g * (1 - beta1);   v = v * beta2 + (g * g) * (1 - beta2)
//   x = x - (m / (sqrt(v) / sqrt(1 - beta2^t) + eps)) * (lr / (1 - beta1^t))
// then per block s_m = max |m|, s_v = max v (1 in place of 0 as a divisor), and
//   c_m = sign(m) * round(sqrt(|m| / s_m) * 127)
//   c_v = round(sqrt(sqrt(v / s_v)) * 255), at least 1 where v > 0
//   high = bf16(x) (nearest even, by integer arithmetic as c10::BFloat16, denormals kept)
//   low = round(((x - high) / ulp(high)) * 254)
// Each operation is one IEEE fp32 rounding: no fused multiply-add (the files compile with
// fp-contract=off), divisions as divisions, sqrt the correctly rounded instruction, round
// half to even (ROUNDPS / VRNDSCALEPS / nearbyint), the maxima exact. The constants are
// the rule's fp32 values, worked out by the caller (compact_constants in compact.py).
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam/adam.h"

namespace offload::compact {

// Must equal offload/memory/compact_codec.py's BLOCK_NUMEL.
constexpr std::size_t kBlockNumel = 256;

// The step's scalars, already rounded to fp32 (compact_constants).
struct Constants {
  bool adamw;  // decoupled decay (x * decay) rather than L2 (g + x * decay)
  float grad_scale;
  float decay;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float sqrt_bias_correction2;
  float eps;
  float step_size;
};

// Flat views of one range of compact states, updated in place: numel elements of each code
// array and of the grad, (numel + kBlockNumel - 1) / kBlockNumel scales of each kind. The
// range starts on a block boundary; its last block may be shorter.
struct Buffers {
  const void* grad;
  adam::DType grad_dtype;
  std::uint16_t* high;  // bf16 bits
  std::int8_t* low;
  std::int8_t* exp_avg;
  float* exp_avg_scales;
  std::uint8_t* exp_avg_sq;
  float* exp_avg_sq_scales;
  std::size_t numel;
};

// What the step could not store (compact states hold finite values only).
enum class Problem : int {
  kNone = 0,
  kGradient = 1,    // grad * grad_scale is not finite: nothing was written
  kExpAvg = 2,      // a new exp_avg is not finite
  kExpAvgSq = 3,    // a new exp_avg_sq is not finite
  kMaster = 4,      // a new master is not finite
  kMasterHigh = 5,  // a new master rounds beyond bf16's largest value
};

// kGradient: count non-finite gradient values, the first at `element`. The others: the
// block holding `element` (the lowest such element) and every later block of its thread
// range keep their states as they were, the other blocks are updated: the states are a mix
// of two steps, and the step is not to be retried (count is 0: not counted).
struct Failure {
  Problem problem = Problem::kNone;
  std::size_t element = 0;
  float value = 0.0f;
  std::size_t count = 0;
};

// Checks the gradient first (reading it only), then runs the fused step on the native
// thread pool. Throws std::invalid_argument for a null buffer with numel > 0.
Failure step(const Buffers& buffers, const Constants& constants);

}  // namespace offload::compact
