// Internal to native/adam: the per-ISA kernels and the float coefficients they share.
#pragma once

#include <cstddef>

#include "adam/adam.h"

namespace offload::adam::detail {

// Per-step scalars, already rounded to float the way ATen rounds Python-float scalars.
struct Coefficients {
  float grad_scale;
  bool l2;               // Adam with weight decay: g = fma(param, l2_decay, g)
  float l2_decay;
  float param_decay;     // 1 - lr * wd for AdamW, exactly 1 otherwise (p * 1 == p)
  bool lerp_small;       // |1 - beta1| < 0.5 picks ATen's lerp formula
  float lerp_weight;     // 1 - beta1
  float lerp_weight_minus_one;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;   // -lr / (1 - beta1^step)
};

// [Note: Adam memory traffic]
// A step moves 28 B per element (30 with a 16-bit copy-out) and its arithmetic is bound by
// the divider (two divisions and a sqrt, which bit-exactness with torch forbids replacing by
// reciprocals): on the 2-core reference machine a core computes 1.3-1.8 Gelem/s from cache,
// while DRAM feeds one core ~0.75 Gelem/s. Steps larger than the cache are memory-bound,
// and the vector kernels are written for the memory system:
//  * Software prefetch kPrefetchNumel elements ahead on the four input streams. The L2
//    hardware streamer stops at every 4 KiB page boundary and our buffers (pinned host
//    memory, torch's allocator) are 4 KiB pages; prefetching across the boundary made the
//    DRAM-bound step ~10% faster on the 2-core reference machine (tools/bench_adam.py).
//  * The copy-out is written with streaming (non-temporal) stores when the caller asks
//    (stream_copy_out; adam.cpp decides from the step's size): its lines are only written,
//    so a normal store first reads each line from DRAM (+2 B/element) and then pushes the
//    states out of cache; for a step that fits in the last-level cache normal stores are
//    faster, and the device copy that follows finds the data in cache.
//  * In place, param, exp_avg and exp_avg_sq are never streamed: their lines were just read,
//    so there is no read-for-ownership to save (streaming them measured 15-20% slower).
//    Out of place ([Note: out-of-place Adam] in adam.h) their outputs are lines only written,
//    like the copy-out, and a large step streams them (Streaming::state): normal stores read
//    each line first (+12 B/element), which made an out-of-place step ~2x an in-place one
//    on the 2-core reference machine. Streaming needs each output's address aligned to the
//    vector: the head peeled for alignment is chosen by one output (the copy-out if it is
//    streamed, else param_out), and each other output streams only if that head aligns it
//    too (torch's allocations and the engine's slices are all equally aligned in practice);
//    the rest are stored normally.
//  * Each thread runs contiguous ranges, long ones first (offload::parallel_ranges, guided);
//    no cache blocking, since nothing is reused within a step.
constexpr std::size_t kPrefetchNumel = 512;

// Which outputs a step may write with streaming stores (see [Note: Adam memory traffic]);
// it changes no result, and the scalar reference ignores it.
struct Streaming {
  bool copy_out = false;  // buffers.copy_out
  bool state = false;     // the fp32 outputs of an out-of-place step that are apart from their inputs
};

// Each kernel processes buffers.numel elements single-threaded; adam.cpp splits the work.
// Every output pointer is set (an in-place step's are its inputs).
void step_scalar(const Buffers& buffers, const Coefficients& k, const Streaming& streaming);
void step_avx2(const Buffers& buffers, const Coefficients& k, const Streaming& streaming);
void step_avx512(const Buffers& buffers, const Coefficients& k, const Streaming& streaming);

}  // namespace offload::adam::detail
