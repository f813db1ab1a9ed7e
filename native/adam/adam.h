// CPU Adam/AdamW step over flat fp32 buffers: one pass over (param, grad, exp_avg,
// exp_avg_sq) per element, optionally writing a 16-bit copy of the new param in the same
// pass. Kernels exist per instruction set (scalar reference, AVX2+FMA, AVX-512); the
// fastest one this CPU runs is chosen once at load time, OFFLOAD_FORCE_ISA overrides it.
//
// [Note: Adam numerics] The arithmetic reproduces torch.optim.Adam/AdamW with
// foreach=False on CPU bit for bit (fp32): the scalar coefficients are computed in double
// exactly as torch computes them on Python floats, then rounded to float; the elementwise
// part uses the same operations, in the same order, with FMA exactly where ATen's
// vectorized kernels use one (lerp, add with alpha, addcmul) and nowhere else:
//   g  = grad * grad_scale
//   g  = fma(param, wd, g)                         (Adam, L2 decay: grad.add(param, alpha=wd))
//   p  = p * (1 - lr * wd)                         (AdamW, decoupled decay)
//   m  = fma(w, g - m, m)         if |w| < 0.5     (exp_avg.lerp_(grad, w), w = 1 - beta1)
//      = fma(w - 1, g - m, g)     otherwise
//   v  = fma((1 - beta2) * g, g, v * beta2)        (exp_avg_sq.mul_(beta2).addcmul_(g, g))
//   d  = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p  = p + (-lr / (1 - beta1^step) * m) / d      (param.addcdiv_(m, d, value=-step_size))
// The kernel files are compiled with fp-contract=off so the compiler cannot fuse any
// other multiply-add.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace offload::adam {

// Element types of the gradient and of the optional 16-bit copy of the param. The
// numeric values are the codes that cross the Python boundary.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct Hyperparameters {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  double step;        // 1-based count of this step (after the increment), for bias correction
  bool adamw;         // decoupled weight decay (AdamW) rather than L2 added to the grad (Adam)
  double grad_scale;  // the grad is multiplied by this first (loss-scale unscaling, clipping)
};

// Flat views of one tensor's state; every pointer covers numel elements of its type.
// copy_out may be null; otherwise it receives the updated param rounded to nearest even.
//
// [Note: out-of-place Adam] param, exp_avg and exp_avg_sq are read; the new values are
// written to param_out, exp_avg_out and exp_avg_sq_out. Left null, an output is its input
// (the step is in place). Set, it must not overlap any other buffer: a speculative or
// delayed update writes the unit's spare homes from its homes in the one pass, leaving the
// homes as they were, instead of copying the homes into the spares first and updating
// those in place (28 B more per element through memory: on the 2-core reference machine,
// 100M elements took 0.16 s that way against 0.07 s out of place and 0.05 s in place).
// The arithmetic is the same either way, so are the results, bit for bit.
struct Buffers {
  const float* param;
  const void* grad;
  DType grad_dtype;
  const float* exp_avg;
  const float* exp_avg_sq;
  void* copy_out;
  DType copy_out_dtype;  // kBFloat16 or kFloat16 when copy_out is set
  std::size_t numel;
  float* param_out = nullptr;
  float* exp_avg_out = nullptr;
  float* exp_avg_sq_out = nullptr;
};

// Runs one step on the ISA chosen at load time (or set by set_isa). Uses the native thread
// pool for tensors large enough to pay for it. Throws std::invalid_argument on bad input and
// std::runtime_error when OFFLOAD_FORCE_ISA named an ISA this CPU cannot run.
void step(const Buffers& buffers, const Hyperparameters& hyper);

// Steps over at least this many elements write the copy-out with streaming stores (see
// [Note: Adam memory traffic] in adam_kernels.h). By default the element count whose
// working set (30 B/element) is half the last-level cache, beyond which the copy-out would
// leave the cache before the device copy reads it. Results never depend on it.
std::size_t stream_copy_out_min_numel();
void set_stream_copy_out_min_numel(std::size_t numel);  // for tests and benchmarks

// [Note: split master] (master_split.cpp): fp32 <-> (bf16 high half, 16-bit low half),
// lossless both ways; single-threaded loops the compiler vectorizes.
void split_master(const float* master, std::uint16_t* high, std::uint16_t* low, std::size_t numel);
void join_master(const std::uint16_t* high, const std::uint16_t* low, float* master, std::size_t numel);

Isa selected_isa();
void set_isa(Isa isa);                // throws std::runtime_error if this CPU lacks it
std::vector<Isa> available_isas();    // slowest first; always contains kScalar
const char* isa_name(Isa isa);
Isa parse_isa(const std::string& name);  // throws std::invalid_argument naming the choices

}  // namespace offload::adam
