// Work split into passes that torch's thread team takes one at a time.
//
// Why not at::parallel_for's equal shares: behind a server another process (the ingress, Ray, the client) takes a
// core now and then, and the engine's threads are bound one to a core (conveyor/serving/openmp_runtime.py), so a
// preempted thread cannot move. With equal shares its partner then waits at the barrier for the preempted thread's
// whole remaining share; handed out one at a time, the partner computes the rest and waits for one pass at most.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace conveyor_cpu {

// Calls pass(p) once for every p in [0, num_passes), on torch's threads, each taking the next pass when it is free.
template <typename Pass>
void parallel_passes(int64_t num_passes, const Pass& pass) {
  std::atomic<int64_t> next_pass{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t p; (p = next_pass.fetch_add(1, std::memory_order_relaxed)) < num_passes;) pass(p);
  });
}

}  // namespace conveyor_cpu
