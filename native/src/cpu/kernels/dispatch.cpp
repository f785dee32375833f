// Chooses kernels by SIMD level at run time. Each level's table starts from the scalar table and
// overlays the entries that level implements, so a missing SIMD kernel falls back, never crashes.
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "optiml/common.h"
#include "optiml/cpu_features.h"
#include "optiml/kernels.h"

namespace optiml {

const char* simd_level_name(SimdLevel level) {
    switch (level) {
        case SIMD_SCALAR: return "scalar";
        case SIMD_AVX2: return "avx2";
        case SIMD_AVX512: return "avx512";
        case SIMD_NEON: return "neon";
        default: return "unknown";
    }
}

bool simd_level_available(SimdLevel level) {
    const CpuFeatures& f = cpu_features();
    switch (level) {
        case SIMD_SCALAR: return true;
#if defined(OPTIML_X86)
        case SIMD_AVX2: return f.avx2 && f.fma && f.f16c && f.bmi2;
        // VNNI and BF16 are not required: their kernels are added one by one (kernel_table).
        case SIMD_AVX512:
            return f.avx2 && f.fma && f.f16c && f.bmi2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
#endif
#if defined(OPTIML_ARM)
        case SIMD_NEON: return f.neon;
#endif
        default: return false;
    }
}

SimdLevel best_simd_level() {
    static const SimdLevel best = [] {
        SimdLevel b = SIMD_SCALAR;
        for (SimdLevel l : {SIMD_AVX2, SIMD_AVX512, SIMD_NEON})
            if (simd_level_available(l)) b = l;
        // OPTIML_SIMD lets a user (or a test) cap the level, e.g. to compare against the reference.
        if (const char* env = std::getenv("OPTIML_SIMD")) {
            for (int l = 0; l < SIMD_LEVEL_COUNT; l++) {
                if (std::strcmp(env, simd_level_name((SimdLevel)l)) == 0 &&
                    simd_level_available((SimdLevel)l))
                    b = (SimdLevel)l;
            }
        }
        return b;
    }();
    return best;
}

const KernelTable& kernel_table(SimdLevel level) {
    if (level < 0 || level >= SIMD_LEVEL_COUNT || !simd_level_available(level))
        throw ArgumentError(format("SIMD level '%s' is not available on this CPU or in this build",
                                   simd_level_name(level)));
    static KernelTable tables[SIMD_LEVEL_COUNT];
    static std::once_flag once;
    std::call_once(once, [] {
        for (int l = 0; l < SIMD_LEVEL_COUNT; l++) {
            KernelTable& t = tables[l];
            std::memset(&t, 0, sizeof(t));
            t.level = (SimdLevel)l;
            fill_kernels_scalar(t);
            fill_ops_scalar(t);
            fill_sparse_scalar(t);
            fill_attn_quant_scalar(t);
        }
#if defined(OPTIML_X86)
        // Each feature's kernels are overlaid only when the CPU has that feature (a table is built
        // for every level, but only available levels are ever handed out).
        const CpuFeatures& f = cpu_features();
        KernelTable& avx2 = tables[SIMD_AVX2];
        fill_kernels_avx2(avx2);
        if (f.avxvnni) fill_kernels_avxvnni(avx2);
        fill_ops_avx2(avx2);
        fill_sparse_avx2(avx2);
        fill_attn_quant_avx2(avx2);
        KernelTable& avx512 = tables[SIMD_AVX512];  // AVX-512 overlays AVX2 where it has nothing better
        fill_kernels_avx2(avx512);
        if (f.avxvnni) fill_kernels_avxvnni(avx512);
        fill_ops_avx2(avx512);
        fill_kernels_avx512(avx512);
        if (f.avx512vnni) fill_kernels_avx512vnni(avx512);
        if (f.avx512bf16) fill_kernels_avx512bf16(avx512);
        fill_ops_avx512(avx512);
        fill_sparse_avx2(avx512);  // grouped rows: the AVX2 kernels
        fill_attn_quant_avx2(avx512);
        fill_sparse_avx512(avx512);
        if (f.avx512vnni) fill_sparse_grouped_avx512vnni(avx512);
#endif
#if defined(OPTIML_ARM)
        fill_kernels_neon(tables[SIMD_NEON]);
        fill_ops_neon(tables[SIMD_NEON]);
        fill_sparse_neon(tables[SIMD_NEON]);
#endif
    });
    return tables[level];
}

}  // namespace optiml
