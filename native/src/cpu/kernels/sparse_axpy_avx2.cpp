// AVX2 kernels for the column-sparse down projection: sparse_axpy_simd.h on 8-lane vectors, and the
// grouped rows' kernels (sparse_axpy_grouped_avx2.cpp).
#include "optiml/sparse.h"
#include "simd_x86.h"
#include "sparse_axpy_simd.h"

namespace optiml {

void fill_sparse_avx2(KernelTable& t) {
    fill_axpy<F32x8>(t);
    fill_sparse_grouped_avx2(t);
}

}  // namespace optiml
