// Zeroed regions backed by 2 MiB pages where the OS allows it (see huge_pages.h).
#include "optiml/huge_pages.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(_WIN32)
#include <windows.h>
#else
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

#if defined(__SANITIZE_ADDRESS__)
#define OPTIML_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define OPTIML_ASAN 1
#endif
#endif

void* page_calloc(size_t bytes) {
    if (bytes == 0) bytes = 1;
#if defined(OPTIML_ASAN)
    // AddressSanitizer's allocator, with the exact size, so that a read past the block is still reported (its
    // last page may be shared: no device locks pages in a sanitized CPU build).
    void* p = nullptr;
    if (posix_memalign(&p, 4096, bytes) != 0) return nullptr;
    return std::memset(p, 0, bytes);
#elif defined(_WIN32)
    return VirtualAlloc(nullptr, bytes, MEM_COMMIT | MEM_RESERVE, PAGE_READWRITE);
#else
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
#endif
}

void page_free(void* p, size_t bytes) {
    if (!p) return;
#if defined(OPTIML_ASAN)
    (void)bytes;
    std::free(p);
#elif defined(_WIN32)
    (void)bytes;
    VirtualFree(p, 0, MEM_RELEASE);
#else
    munmap(p, bytes ? bytes : 1);
#endif
}

}  // namespace optiml
