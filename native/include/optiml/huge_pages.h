// Memory backed by 2 MiB pages where the OS allows it (Linux transparent huge pages in "madvise" or
// "always" mode), for large buffers read at random rows or streamed whole.
//
// A decoding step reads a few hundred scattered rows of each layer's neuron-major down copy, 1.5 GB in
// all at 7B. With 4 KiB pages nearly every row misses the TLB and walks page tables that no longer fit
// in the cache: the column-sparse down product ran at half the speed it reaches on a 256 MiB working
// set. Streamed whole, a model file read into memory runs its matrix-vector products about 25% faster
// than over a file mapping's 4 KiB pages (MappedFile).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace optiml {

// Zeroed memory of at least `bytes`. On Linux a region of at least a huge page is its own anonymous
// mapping, aligned to and advised to use 2 MiB pages, which the OS zero-fills on first touch as it does
// calloc's large blocks. Smaller regions, and every one elsewhere, come from calloc. nullptr when the
// memory cannot be had. huge_page_free takes the same `bytes`.
void* huge_page_calloc(size_t bytes);
void huge_page_free(void* p, size_t bytes);

// Zeroed memory that starts on a page and owns whole pages (the CPU backend's blocks). A device page-locks
// host blocks it copies through (Backend::pin_host), and CUDA locks a page once: two blocks that shared a
// page could not both be locked, and the second one's copies would wait for the device and stay out of
// recorded steps. Committed on first touch. nullptr when the memory cannot be had; page_free takes the same
// `bytes`.
void* page_calloc(size_t bytes);
void page_free(void* p, size_t bytes);

// An allocator for std::vector over huge_page_calloc.
template <typename T>
struct HugePageAllocator {
    typedef T value_type;

    HugePageAllocator() = default;
    template <typename U>
    HugePageAllocator(const HugePageAllocator<U>&) {}

    T* allocate(size_t n) {
        if (void* p = huge_page_calloc(n * sizeof(T))) return (T*)p;
        throw std::bad_alloc();
    }
    void deallocate(T* p, size_t n) { huge_page_free(p, n * sizeof(T)); }

    template <typename U>
    bool operator==(const HugePageAllocator<U>&) const { return true; }
    template <typename U>
    bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

template <typename T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace optiml
