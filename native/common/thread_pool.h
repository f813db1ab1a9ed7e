// A small persistent thread pool shared by the native kernels.
//
// Why our own pool and not OpenMP: torch ships its own libgomp; a second OpenMP runtime in
// the same process oversubscribes the cores and its spin-waits fight torch's. This pool
// parks its workers on a condition variable between calls.
#pragma once

#include <cstddef>
#include <functional>

namespace offload {

// Runs fn(task) for task in [0, num_tasks) on the pool's workers and the calling thread;
// returns when every task has finished. Calls from several threads are serialized.
void parallel_for(std::size_t num_tasks, const std::function<void(std::size_t)>& fn);

// Runs fn(begin, end) over [0, numel) cut into contiguous ranges, which the threads claim
// as they go (guided: each claim takes 1 / (2 * threads) of what is left). Long ranges first,
// so each thread's streams stay sequential for the hardware prefetcher; short ones at the
// end, so a thread slowed or started late by another process costs about one grain at the
// end, not a whole range. Such a thread is common: torch's OpenMP workers spin for some
// milliseconds after each of torch's parallel regions, on the cores our workers wake on.
// Every range but the last is a multiple of grain elements (pass a multiple of the vector
// width, so a range starts as aligned as the buffer does) and at least grain long. Runs
// fn(0, numel) on the calling thread when numel < 2 * grain or there is one thread: waking
// the pool would cost more than it saves.
void parallel_ranges(std::size_t numel, std::size_t grain,
                     const std::function<void(std::size_t, std::size_t)>& fn);

// Number of threads parallel_for uses (workers + the caller). At least 1.
int num_threads();
void set_num_threads(int num_threads);

}  // namespace offload
