// What this CPU can run, read once from cpuid (x86) or the auxiliary vector (aarch64).
#pragma once

namespace optiml {

struct CpuFeatures {
    bool avx2 = false, fma = false, f16c = false, bmi2 = false;
    bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
    bool avx512vnni = false, avx512bf16 = false;
    bool avxvnni = false;  // the 256-bit VEX form of VNNI (no AVX-512 needed)
    bool neon = false, neon_dotprod = false;
};

const CpuFeatures& cpu_features();

}  // namespace optiml
