// The matrices of one product launch (kernels.cuh's CudaMatrix), for the decode kernels (matmul.cu: a unit is
// a thread block of rows) and the tiles (matmul_tiles.cu: a unit is a tile of rows): passed by value, grid
// unit u belongs to the last matrix whose first unit is at most u.
#pragma once

#include "kernels.cuh"
#include "optiml/common.h"

namespace optiml {

struct LaunchMatrices {
    CudaMatrix m[kCudaMaxMatrices];
    unsigned first[kCudaMaxMatrices];
    int count;
    unsigned units;  // of every matrix together
};

// The matrices, each taking ceil(rows / rows_per_unit) units.
inline LaunchMatrices launch_matrices(const CudaMatrix* m, int count, int rows_per_unit) {
    if (count < 1 || count > kCudaMaxMatrices) throw Error("internal: 1 to 16 matrices per product launch");
    LaunchMatrices ms{};
    for (int k = 0; k < count; k++) {
        ms.m[k] = m[k];
        ms.first[k] = ms.units;
        ms.units += (unsigned)((m[k].rows + rows_per_unit - 1) / rows_per_unit);
    }
    ms.count = count;
    return ms;
}

// Unit u's matrix, and u's index within it (unit_in). Constant indices only (unrolled), so the parameters are
// never copied to local memory.
__device__ __forceinline__ CudaMatrix pick_matrix(const LaunchMatrices& ms, unsigned u, unsigned& unit_in) {
    CudaMatrix m = ms.m[0];
    unsigned first = 0;
#pragma unroll
    for (int k = 1; k < kCudaMaxMatrices; k++)
        if (k < ms.count && u >= ms.first[k]) {
            m = ms.m[k];
            first = ms.first[k];
        }
    unit_in = u - first;
    return m;
}

}  // namespace optiml
