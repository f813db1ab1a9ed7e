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

// Number of threads parallel_for uses (workers + the caller). At least 1.
int num_threads();
void set_num_threads(int num_threads);

}  // namespace offload
