// Memory for large buffers read at random rows (the sparse FFN's neuron-major copies): backed by 2 MiB
// pages where the OS allows it (Linux transparent huge pages in "madvise" or "always" mode).
//
// A decoding step reads a few hundred scattered rows of each layer's copy, 1.5 GB in all at 7B. With
// 4 KiB pages nearly every row misses the TLB and walks page tables that no longer fit in the cache:
// the column-sparse down product ran at half the speed it reaches on a 256 MiB working set.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace optiml {

// Zeroed memory of at least `bytes` for buffers streamed whole (a model file read into memory: see
// MappedFile). On Linux a region of at least a huge page is its own anonymous mapping, aligned to and
// advised to use 2 MiB pages, which the OS zero-fills on first touch as it does calloc's large blocks.
// Smaller regions, and every one elsewhere, come from calloc. nullptr when the memory cannot be had.
// huge_page_free takes the same `bytes`.
void* huge_page_calloc(size_t bytes);
void huge_page_free(void* p, size_t bytes);

// On Linux, allocations of at least a huge page are aligned to one and advised to use huge pages before
// any byte is touched (so the first touch faults in whole 2 MiB pages); smaller ones, and every one
// elsewhere, are plain.
template <typename T>
struct HugePageAllocator {
    typedef T value_type;
    static constexpr size_t kHugePage = size_t(2) << 20;

    HugePageAllocator() = default;
    template <typename U>
    HugePageAllocator(const HugePageAllocator<U>&) {}

    T* allocate(size_t n) {
        const size_t bytes = n * sizeof(T);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
        if (bytes >= kHugePage) {
            const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
            void* p = std::aligned_alloc(kHugePage, rounded);
            if (!p) throw std::bad_alloc();
            madvise(p, rounded, MADV_HUGEPAGE);  // advice only: without huge pages it stays 4 KiB pages
            return (T*)p;
        }
#endif
        if (void* p = std::malloc(bytes ? bytes : 1)) return (T*)p;
        throw std::bad_alloc();
    }
    void deallocate(T* p, size_t) { std::free(p); }

    template <typename U>
    bool operator==(const HugePageAllocator<U>&) const { return true; }
    template <typename U>
    bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

template <typename T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace optiml
