// Zeroed regions backed by 2 MiB pages where the OS allows it (see huge_pages.h).
#include "optiml/huge_pages.h"

#include <cstdint>
#include <cstdlib>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace optiml {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;

bool own_mapping(size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    return bytes >= kHugePage && bytes <= SIZE_MAX - 2 * kHugePage;  // larger: calloc refuses it
#else
    (void)bytes;
    return false;
#endif
}

size_t rounded(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }
}  // namespace

void* huge_page_calloc(size_t bytes) {
    if (!own_mapping(bytes)) return std::calloc(bytes ? bytes : 1, 1);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // One huge page more than asked, then the unaligned ends given back: mmap aligns to 4 KiB only.
    const size_t size = rounded(bytes);
    const size_t len = size + kHugePage;
    void* raw = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    uint8_t* start = (uint8_t*)raw;
    uint8_t* aligned = (uint8_t*)(((uintptr_t)start + kHugePage - 1) & ~(uintptr_t)(kHugePage - 1));
    if (aligned > start) munmap(start, (size_t)(aligned - start));
    if (start + len > aligned + size) munmap(aligned + size, (size_t)(start + len - (aligned + size)));
    madvise(aligned, size, MADV_HUGEPAGE);  // advice only: without huge pages it stays 4 KiB pages
    return aligned;
#else
    return nullptr;
#endif
}

void huge_page_free(void* p, size_t bytes) {
    if (!p) return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (own_mapping(bytes)) {
        munmap(p, rounded(bytes));
        return;
    }
#endif
    std::free(p);
}

}  // namespace optiml
