// Read-only mapping of a whole file: POSIX mmap, or a file mapping on Windows.
#include <cerrno>
#include <cstdint>
#include <system_error>

#include "optiml/gguf.h"
#include "optiml/huge_pages.h"

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#else
#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace optiml {

#ifdef _WIN32

static std::wstring widen(const std::string& s) {
    int n = MultiByteToWideChar(CP_UTF8, 0, s.data(), (int)s.size(), nullptr, 0);
    std::wstring w(n, L'\0');
    MultiByteToWideChar(CP_UTF8, 0, s.data(), (int)s.size(), &w[0], n);
    return w;
}

static std::system_error win_error(const std::string& what) {
    // The common cases map onto errno values so callers see the same errors as on POSIX.
    DWORD e = GetLastError();
    int code = e == ERROR_FILE_NOT_FOUND || e == ERROR_PATH_NOT_FOUND ? ENOENT
             : e == ERROR_ACCESS_DENIED                               ? EACCES
                                                                      : EIO;
    return std::system_error(code, std::generic_category(), what);
}

MappedFile::MappedFile(const std::string& path, bool /*in_memory: mapped here either way*/) {
    HANDLE file = CreateFileW(widen(path).c_str(), GENERIC_READ, FILE_SHARE_READ, nullptr,
                              OPEN_EXISTING, FILE_ATTRIBUTE_NORMAL, nullptr);
    if (file == INVALID_HANDLE_VALUE) throw win_error("cannot open " + path);
    LARGE_INTEGER size;
    if (!GetFileSizeEx(file, &size)) {
        std::system_error err = win_error("cannot get the size of " + path);
        CloseHandle(file);
        throw err;
    }
    size_ = (uint64_t)size.QuadPart;
    if (size_ > 0) {
        HANDLE mapping = CreateFileMappingW(file, nullptr, PAGE_READONLY, 0, 0, nullptr);
        void* p = mapping ? MapViewOfFile(mapping, FILE_MAP_READ, 0, 0, 0) : nullptr;
        if (!p) {
            std::system_error err = win_error("cannot map " + path);
            if (mapping) CloseHandle(mapping);
            CloseHandle(file);
            throw err;
        }
        CloseHandle(mapping);  // the view keeps the mapping object alive
        data_ = (const uint8_t*)p;
    }
    CloseHandle(file);
}

MappedFile::~MappedFile() {
    if (data_) UnmapViewOfFile(data_);
}

#else

namespace {

// Reads size bytes of fd into dst with several threads (each first touch of a page also zeroes it, and
// that work is shared out too). Returns 0 or the errno of the first failure; EIO for a short file.
int read_parallel(int fd, uint8_t* dst, size_t size) {
    constexpr size_t kPiece = size_t(16) << 20;
    const size_t n_pieces = (size + kPiece - 1) / kPiece;
    std::atomic<size_t> next{0};
    std::atomic<int> error{0};
    auto work = [&] {
        for (size_t i = next++; i < n_pieces && !error.load(); i = next++) {
            size_t off = i * kPiece;
            const size_t end = std::min(size, off + kPiece);
            while (off < end) {
                const ssize_t k = pread(fd, dst + off, end - off, (off_t)off);
                if (k < 0 && errno == EINTR) continue;
                if (k <= 0) {
                    int expected = 0;
                    error.compare_exchange_strong(expected, k < 0 ? errno : EIO);
                    return;
                }
                off += (size_t)k;
            }
        }
    };
    const unsigned hw = std::thread::hardware_concurrency();
    const size_t n_threads = std::min<size_t>({hw ? hw : 1, 8, n_pieces});
    std::vector<std::thread> threads;
    try {
        for (size_t t = 1; t < n_threads; t++) threads.emplace_back(work);
    } catch (const std::system_error&) {
        // No more threads to be had: the ones started (and this one) share out all the pieces anyway.
    }
    work();
    for (std::thread& t : threads) t.join();
    return error.load();
}

}  // namespace

MappedFile::MappedFile(const std::string& path, bool in_memory) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; it is rejected below.
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "cannot open " + path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        ::close(fd);
        throw std::system_error(e, std::generic_category(), "cannot stat " + path);
    }
    if (S_ISDIR(st.st_mode)) {
        ::close(fd);
        throw std::system_error(EISDIR, std::generic_category(), "cannot open " + path);
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        throw GGUFError(path + ": not a regular file");
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        ::close(fd);
        throw GGUFError(path + ": file too large to map on this system");
    }
    size_ = (uint64_t)st.st_size;
    if (size_ > 0 && in_memory) {
        errno = 0;
        uint8_t* p = (uint8_t*)huge_page_calloc((size_t)size_);
        if (!p) {
            const int e = errno ? errno : ENOMEM;
            ::close(fd);
            throw std::system_error(e, std::generic_category(), "cannot allocate memory to read " + path + " into");
        }
        if (int e = read_parallel(fd, p, (size_t)size_)) {
            huge_page_free(p, (size_t)size_);
            ::close(fd);
            throw std::system_error(e, std::generic_category(), "cannot read " + path);
        }
        data_ = p;
        in_memory_ = true;
    } else if (size_ > 0) {
        void* p = mmap(nullptr, (size_t)size_, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            ::close(fd);
            throw std::system_error(e, std::generic_category(), "cannot map " + path);
        }
        data_ = (const uint8_t*)p;
    }
    ::close(fd);
}

MappedFile::~MappedFile() {
    if (!data_) return;
    if (in_memory_)
        huge_page_free((void*)data_, (size_t)size_);
    else
        munmap((void*)data_, (size_t)size_);
}

#endif

}  // namespace optiml
