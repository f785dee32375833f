// aarch64 NEON kernels for the column-sparse down projection: sparse_axpy_simd.h on 4-lane vectors, and
// the grouped rows' kernels (sparse_axpy_grouped_neon.cpp).
#include "optiml/sparse.h"
#include "simd_neon.h"
#include "sparse_axpy_simd.h"

namespace optiml {

void fill_sparse_neon(KernelTable& t) {
    fill_axpy<F32x4>(t);
    fill_sparse_grouped_neon(t);
}

}  // namespace optiml
