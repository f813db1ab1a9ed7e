// Dispatch of the fused compact step: the kernel of the ISA the Adam kernel runs on, the
// gradient check before anything is written, and the split across the native thread pool.
#include <mutex>
#include <stdexcept>

#include "adam/adam.h"
#include "common/thread_pool.h"
#include "compact/compact.h"
#include "compact/compact_kernels.h"

namespace offload::compact {
namespace {

// Threads take whole blocks, 256 of them (64 Ki elements, as the Adam kernel's grain).
constexpr std::size_t kGrainBlocks = 256;

using Kernel = Failure (*)(const Buffers&, const Constants&, std::size_t);

struct Kernels {
  Kernel check;
  Kernel step;
};

Kernels kernels_for(adam::Isa isa) {
  switch (isa) {
    case adam::Isa::kScalar: return {&detail::check_gradient_scalar, &detail::step_scalar};
    case adam::Isa::kAvx2: return {&detail::check_gradient_avx2, &detail::step_avx2};
    case adam::Isa::kAvx512: return {&detail::check_gradient_avx512, &detail::step_avx512};
  }
  throw std::logic_error("unknown Isa");
}

std::size_t grad_bytes(adam::DType dtype) { return dtype == adam::DType::kFloat32 ? 4 : 2; }

// Runs `kernel` over the blocks of `b` on the pool; the Failure of the lowest element, with
// the counts of every range added up.
Failure run_parallel(Kernel kernel, const Buffers& b, const Constants& k) {
  const std::size_t num_blocks = (b.numel + kBlockNumel - 1) / kBlockNumel;
  std::mutex mutex;
  Failure first;
  std::size_t count = 0;
  offload::parallel_ranges(num_blocks, kGrainBlocks, [&](std::size_t begin, std::size_t end) {
    const std::size_t lo = begin * kBlockNumel;
    const std::size_t hi = end * kBlockNumel < b.numel ? end * kBlockNumel : b.numel;
    Buffers part = b;
    part.numel = hi - lo;
    part.grad = static_cast<const char*>(b.grad) + lo * grad_bytes(b.grad_dtype);
    part.high += lo, part.low += lo, part.exp_avg += lo, part.exp_avg_sq += lo;
    part.exp_avg_scales += begin, part.exp_avg_sq_scales += begin;
    const Failure failure = kernel(part, k, lo);
    if (failure.problem == Problem::kNone) return;
    std::lock_guard<std::mutex> lock(mutex);
    count += failure.count;
    if (first.problem == Problem::kNone || failure.element < first.element) first = failure;
  });
  first.count = count;
  return first;
}

}  // namespace

Failure step(const Buffers& b, const Constants& k) {
  if (b.numel > 0 && (b.grad == nullptr || b.high == nullptr || b.low == nullptr || b.exp_avg == nullptr ||
                      b.exp_avg_scales == nullptr || b.exp_avg_sq == nullptr || b.exp_avg_sq_scales == nullptr)) {
    throw std::invalid_argument("compact step: null buffer pointer");
  }
  if (b.grad_dtype != adam::DType::kFloat32 && b.grad_dtype != adam::DType::kBFloat16 &&
      b.grad_dtype != adam::DType::kFloat16) {
    throw std::invalid_argument("compact step: unknown grad dtype code");
  }
  const Kernels kernels = kernels_for(adam::selected_isa());
  // A non-finite gradient (the usual cause) is found before anything is written, so the
  // states stay as they were; other causes (an overflow) are found block by block.
  const Failure gradient = run_parallel(kernels.check, b, k);
  if (gradient.problem != Problem::kNone) return gradient;
  return run_parallel(kernels.step, b, k);
}

}  // namespace offload::compact
