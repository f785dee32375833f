// Measures this machine's memory read bandwidth, so kernel throughput can be reported as a fraction
// of what the memory system delivers.
#pragma once

#include <cstddef>

#include "optiml/threadpool.h"

namespace optiml {

// Reads a buffer of `bytes` (well beyond the caches) `repeats` times with every thread of `pool`
// and returns the best observed bytes per second.
double measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats);

}  // namespace optiml
