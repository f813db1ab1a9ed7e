// Dispatch for the SGD, Adagrad and RMSprop kernels: per-step coefficients, the ISA the Adam kernels
// run on, and splitting a step across the native thread pool.
#include <cmath>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>

#include "adam/elementwise.h"
#include "adam/elementwise_kernels.h"
#include "common/thread_pool.h"

namespace offload::adam {
namespace {

// As adam.cpp's: ranges of a multiple of every vector width, large enough that the pool's
// hand-off is noise.
constexpr std::size_t kGrainNumel = std::size_t{1} << 16;

void check(const ElementwiseBuffers& b, bool needs_state, const char* what) {
  if (b.grad_dtype != DType::kFloat32 && b.grad_dtype != DType::kBFloat16 &&
      b.grad_dtype != DType::kFloat16) {
    throw std::invalid_argument(std::string(what) + ": unknown grad dtype code");
  }
  if (b.numel == 0) return;
  if (b.param == nullptr || b.grad == nullptr || (needs_state && b.state == nullptr)) {
    throw std::invalid_argument(std::string(what) + ": null buffer pointer");
  }
  struct Span {
    std::uintptr_t begin;
    std::size_t bytes;
  };
  const auto span = [&](const void* p, std::size_t element_bytes) {
    return Span{reinterpret_cast<std::uintptr_t>(p), p == nullptr ? 0 : b.numel * element_bytes};
  };
  const Span spans[] = {span(b.param, 4), span(b.grad, b.grad_dtype == DType::kFloat32 ? 4 : 2),
                        span(b.state, 4), span(b.state2, 4), span(b.state3, 4)};
  for (std::size_t x = 0; x < std::size(spans); ++x) {
    for (std::size_t y = x + 1; y < std::size(spans); ++y) {
      if (spans[x].bytes > 0 && spans[y].bytes > 0 && spans[x].begin < spans[y].begin + spans[y].bytes &&
          spans[y].begin < spans[x].begin + spans[x].bytes) {
        throw std::invalid_argument(std::string(what) + ": param, grad and states must not overlap");
      }
    }
  }
}

template <class K>
using Kernel = void (*)(const ElementwiseBuffers&, const K&);

template <class K>
void run_threaded(const ElementwiseBuffers& buffers, const K& k, Kernel<K> kernel) {
  const std::size_t grad_bytes = buffers.grad_dtype == DType::kFloat32 ? 4 : 2;
  offload::parallel_ranges(buffers.numel, kGrainNumel, [&](std::size_t begin, std::size_t end) {
    ElementwiseBuffers part = buffers;
    part.numel = end - begin;
    part.param += begin;
    part.grad = static_cast<const char*>(buffers.grad) + begin * grad_bytes;
    if (part.state != nullptr) part.state += begin;
    if (part.state2 != nullptr) part.state2 += begin;
    if (part.state3 != nullptr) part.state3 += begin;
    kernel(part, k);
  });
}

}  // namespace

void sgd_step(const ElementwiseBuffers& buffers, const SgdHyperparameters& h) {
  const bool momentum = h.momentum != 0.0;
  check(buffers, momentum, "sgd");
  detail::SgdCoefficients k;
  k.grad_scale = static_cast<float>(h.grad_scale);
  k.decay = h.weight_decay != 0.0;
  k.weight_decay = static_cast<float>(h.weight_decay);
  k.momentum = momentum;
  k.first_step = h.first_step;
  k.momentum_factor = static_cast<float>(h.momentum);
  k.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
  k.nesterov = h.nesterov;
  k.neg_lr = static_cast<float>(-h.lr);
  Kernel<detail::SgdCoefficients> kernel = &detail::sgd_scalar;
  switch (selected_isa()) {
    case Isa::kScalar: break;
    case Isa::kAvx2: kernel = &detail::sgd_avx2; break;
    case Isa::kAvx512: kernel = &detail::sgd_avx512; break;
  }
  ElementwiseBuffers b = buffers;
  if (!momentum) b.state = nullptr;  // untouched without momentum
  run_threaded(b, k, kernel);
}

void adagrad_step(const ElementwiseBuffers& buffers, const AdagradHyperparameters& h) {
  check(buffers, true, "adagrad");
  detail::AdagradCoefficients k;
  k.grad_scale = static_cast<float>(h.grad_scale);
  k.decay = h.weight_decay != 0.0;
  k.weight_decay = static_cast<float>(h.weight_decay);
  k.eps = static_cast<float>(h.eps);
  // Double arithmetic as torch's on Python floats: clr = lr / (1 + (step - 1) * lr_decay),
  // then value=-clr rounded to float.
  const double clr = h.lr / (1.0 + (h.step - 1.0) * h.lr_decay);
  k.neg_clr = static_cast<float>(-clr);
  Kernel<detail::AdagradCoefficients> kernel = &detail::adagrad_scalar;
  switch (selected_isa()) {
    case Isa::kScalar: break;
    case Isa::kAvx2: kernel = &detail::adagrad_avx2; break;
    case Isa::kAvx512: kernel = &detail::adagrad_avx512; break;
  }
  run_threaded(buffers, k, kernel);
}

void rmsprop_step(const ElementwiseBuffers& buffers, const RmspropHyperparameters& h) {
  ElementwiseBuffers b = buffers;
  if (!h.centered) b.state2 = nullptr;       // untouched unless centered
  if (h.momentum <= 0.0) b.state3 = nullptr;  // untouched without momentum (torch: momentum > 0)
  check(b, true, "rmsprop");
  if (b.numel > 0 && ((h.centered && b.state2 == nullptr) || (h.momentum > 0.0 && b.state3 == nullptr))) {
    throw std::invalid_argument("rmsprop: null buffer pointer");
  }
  detail::RmspropCoefficients k;
  k.grad_scale = static_cast<float>(h.grad_scale);
  k.decay = h.weight_decay != 0.0;
  k.weight_decay = static_cast<float>(h.weight_decay);
  k.alpha = static_cast<float>(h.alpha);
  k.one_minus_alpha = static_cast<float>(1.0 - h.alpha);
  k.centered = h.centered;
  k.lerp_small = std::fabs(k.one_minus_alpha) < 0.5f;
  k.lerp_weight_minus_one = k.one_minus_alpha - 1.0f;
  k.eps = static_cast<float>(h.eps);
  k.momentum = h.momentum > 0.0;
  k.momentum_factor = static_cast<float>(h.momentum);
  k.neg_lr = static_cast<float>(-h.lr);
  Kernel<detail::RmspropCoefficients> kernel = &detail::rmsprop_scalar;
  switch (selected_isa()) {
    case Isa::kScalar: break;
    case Isa::kAvx2: kernel = &detail::rmsprop_avx2; break;
    case Isa::kAvx512: kernel = &detail::rmsprop_avx512; break;
  }
  run_threaded(b, k, kernel);
}

}  // namespace offload::adam
