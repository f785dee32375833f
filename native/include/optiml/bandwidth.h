// Measures this machine's memory read bandwidth, so kernel throughput can be reported as a fraction
// of what the memory system delivers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optiml/threadpool.h"

namespace optiml {

// Reads a buffer of `bytes` (well beyond the caches) `repeats` times with every thread of `pool`
// and returns the best observed bytes per second.
double measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats);

// The read bandwidth of a sparse FFN's weight pattern, without its arithmetic: a random `fraction` of
// the `row_bytes`-byte rows of a buffer of `bytes` (huge pages where possible, as the engine's
// weights), in ascending order, chunks of the list handed to the threads in turn, eight rows at a time
// in step with the next eight fetched alongside (the row-sparse kernels' order). Bytes of the chosen
// rows per second, best of `repeats` passes, each pass a new choice (from `seed`). Many machines read
// scattered rows of a few KiB well below their sequential rate; this says how far.
double measure_scattered_read_bandwidth(ThreadPool& pool, size_t bytes, size_t row_bytes, double fraction,
                                        int repeats, uint64_t seed = 1);

}  // namespace optiml
