// Internal to native/compact: the per-ISA kernels of the fused compact step.
#pragma once

#include <cstddef>

#include "compact/compact.h"

namespace offload::compact::detail {

// Each kernel steps buffers.numel elements single-threaded, block by block (the range
// starts on a block boundary); `first_element` is the range's index in the caller's
// buffers, for the Failure it returns (that of its lowest failing block, else kNone).
Failure step_scalar(const Buffers& buffers, const Constants& k, std::size_t first_element);
Failure step_avx2(const Buffers& buffers, const Constants& k, std::size_t first_element);
Failure step_avx512(const Buffers& buffers, const Constants& k, std::size_t first_element);

// Count the elements whose grad * grad_scale is not finite, reading the grad only: a
// Failure of kGradient (count, the first element and its value), or kNone.
Failure check_gradient_scalar(const Buffers& buffers, const Constants& k, std::size_t first_element);
Failure check_gradient_avx2(const Buffers& buffers, const Constants& k, std::size_t first_element);
Failure check_gradient_avx512(const Buffers& buffers, const Constants& k, std::size_t first_element);

}  // namespace offload::compact::detail
