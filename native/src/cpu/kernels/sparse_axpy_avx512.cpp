// AVX-512 kernels for the column-sparse down projection: sparse_axpy_simd.h on 16-lane vectors (the
// grouped rows' kernels are sparse_axpy_grouped_avx512vnni.cpp, or the AVX2 ones without VNNI).
#include "simd_x86.h"
#include "sparse_axpy_simd.h"

namespace optiml {

void fill_sparse_avx512(KernelTable& t) { fill_axpy<F32x16>(t); }

}  // namespace optiml
