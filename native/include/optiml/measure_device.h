// What a device costs the hybrid executor, measured through the backend interface (optiml hw): the
// numbers `optiml solve --hardware` weighs a split layer's CPU and device shares with.
#pragma once

#include <cstddef>

#include "optiml/backend.h"

namespace optiml {

struct DeviceMeasurements {
    double sync_s = 0;             // record an event on an idle stream and wait for it on the host
    double transfer_latency_s = 0; // copy one small vector (n_embd floats) to the device and wait for it
    double h2d_bytes_per_s = 0;    // large copies from (pageable) host memory, as the executor makes them
    double d2h_bytes_per_s = 0;
    double device_bytes_per_s = 0; // device memory traffic of a large device-to-device copy (read + write)
    double op_s = 0;               // one tiny op queued among many: the per-op (launch) overhead
};

// Runs each measurement several times on `be` and keeps the median (latencies) or best (bandwidths).
// bytes: the size of the large copies (device memory for two such buffers must be free).
DeviceMeasurements measure_device(Backend& be, size_t bytes, size_t small_bytes);

}  // namespace optiml
