#include "optiml/cpu_features.h"

#if defined(OPTIML_X86)
#include <cpuid.h>
#include <cstdint>
#elif defined(OPTIML_ARM) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace optiml {

namespace {

#if defined(OPTIML_X86)
// XCR0 says which register states the OS saves; AVX needs bits 1-2, AVX-512 also 5-7.
uint64_t read_xcr0() {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}
#endif

CpuFeatures detect() {
    CpuFeatures f;
#if defined(OPTIML_X86)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const bool osxsave = c & (1u << 27);
    const bool fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
    if (!osxsave || !avx) return f;
    const uint64_t xcr0 = read_xcr0();
    const bool os_avx = (xcr0 & 0x6) == 0x6;
    const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;
    if (!os_avx) return f;
    f.fma = fma;
    f.f16c = f16c;
    if (__get_cpuid_max(0, nullptr) < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.bmi2 = b & (1u << 8);
    // Subleaf 1 (AVX-VNNI, AVX512_BF16) exists when subleaf 0 reports a maximum subleaf >= 1.
    unsigned a1 = 0, b1, c1, d1;
    if (a >= 1) __cpuid_count(7, 1, a1, b1, c1, d1);
    f.avxvnni = a1 & (1u << 4);
    if (os_avx512) {
        f.avx512f = b & (1u << 16);
        f.avx512dq = b & (1u << 17);
        f.avx512bw = b & (1u << 30);
        f.avx512vl = b & (1u << 31);
        f.avx512vnni = c & (1u << 11);
        f.avx512bf16 = a1 & (1u << 5);
    }
#elif defined(OPTIML_ARM)
    f.neon = true;  // baseline on aarch64
#if defined(__linux__) && defined(HWCAP_ASIMDDP)
    f.neon_dotprod = getauxval(AT_HWCAP) & HWCAP_ASIMDDP;
#elif defined(__APPLE__)
    f.neon_dotprod = true;
#endif
#endif
    return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = detect();
    return f;
}

}  // namespace optiml
