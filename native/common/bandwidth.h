// Memory-bandwidth yardsticks that tools/bench_adam.py measures in the same run as the Adam
// step. Both run on the native thread pool with the Adam kernel's split into ranges, so the
// only difference from a step is what they leave out.
#pragma once

#include <cstddef>

namespace offload {

// STREAM triad a = b + scalar * c. The stores to a are streaming (non-temporal), so a's lines
// are not read first: the memory traffic is exactly 12 B/element, the figure it is counted at.
void stream_triad(float* a, const float* b, const float* c, std::size_t numel, float scalar);

// The memory traffic of an Adam step without its arithmetic: reads param, grad, exp_avg and
// exp_avg_sq, writes param += grad, exp_avg += grad, exp_avg_sq += grad in place (28 B/element),
// with the same software prefetch as the Adam kernels. The limit for the step's access pattern.
void adam_traffic(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                  std::size_t numel);

}  // namespace offload
