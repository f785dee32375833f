// Read-only mapping of a whole file: POSIX mmap, or a file mapping on Windows.
#include <cerrno>
#include <cstdint>
#include <system_error>

#include "optiml/gguf.h"

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#else
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

MappedFile::MappedFile(const std::string& path) {
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

MappedFile::MappedFile(const std::string& path) {
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
    if (size_ > 0) {
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
    if (data_) munmap((void*)data_, (size_t)size_);
}

#endif

}  // namespace optiml
