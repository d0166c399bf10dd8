// Thread-level parallelism: OpenMP parallel-for over index ranges. BLAS calls use OpenBLAS's
// own threads; set_num_threads sets both.
#pragma once

#include <cstdint>
#include <functional>

namespace k3 {

void set_num_threads(int n);  // n <= 0: all cores
int num_threads();

// Runs fn(begin, end) over disjoint sub-ranges of [0, n) on the thread pool. `grain` is the
// smallest range worth a thread; below it everything runs on the calling thread.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace k3
