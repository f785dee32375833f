// A main() for the libFuzzer harnesses where libFuzzer is not available (the GCC sanitizer build of
// .ci/run): runs every file given (or every file in a folder given), then -runs=N inputs made from them
// by random mutations (byte flips, interesting integers at random offsets, truncation, chunk copies),
// reproducible with -seed=S. Not coverage-guided -- tools/checks/fuzz.py runs the real campaigns -- but it puts
// the seeds, the regression inputs and a fixed number of malformed variants through the sanitizers on
// every CI run.
#include <dirent.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

std::vector<uint8_t> read_file(const std::string& path) {
    std::vector<uint8_t> out;
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) {
        std::fprintf(stderr, "cannot read %s\n", path.c_str());
        std::exit(2);
    }
    uint8_t buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
    std::fclose(f);
    return out;
}

void add_inputs(const std::string& path, std::vector<std::string>& files) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
        std::fprintf(stderr, "no such file or folder: %s\n", path.c_str());
        std::exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        files.push_back(path);
        return;
    }
    DIR* d = opendir(path.c_str());
    while (dirent* e = readdir(d))
        if (e->d_name[0] != '.') add_inputs(path + "/" + e->d_name, files);
    closedir(d);
}

void mutate(std::vector<uint8_t>& b, std::mt19937_64& rng) {
    static const uint64_t interesting[] = {0, 1, 2, 3, 4, 7, 8, 16, 32, 255, 256, 0x7fff, 0xffff, 0x7fffffff,
                                           0x80000000u, 0xffffffffu, 0x7fffffffffffffffull, 0x8000000000000000ull,
                                           0xffffffffffffffffull};
    int n = 1 + (int)(rng() % 8);
    for (int k = 0; k < n && !b.empty(); k++) {
        size_t at = rng() % b.size();
        switch (rng() % 6) {
            case 0: b[at] ^= (uint8_t)(1u << (rng() % 8)); break;
            case 1: b[at] = (uint8_t)rng(); break;
            case 2: {
                uint64_t v = interesting[rng() % (sizeof interesting / sizeof *interesting)];
                size_t w = (rng() % 2) ? 4 : 8;
                for (size_t i = 0; i < w && at + i < b.size(); i++) b[at + i] = (uint8_t)(v >> (8 * i));
                break;
            }
            case 3: b.resize(at); break;
            case 4: {  // copy a chunk over another place
                size_t from = rng() % b.size(), len = 1 + rng() % 64;
                for (size_t i = 0; i < len && from + i < b.size() && at + i < b.size(); i++) b[at + i] = b[from + i];
                break;
            }
            default: b.erase(b.begin() + at, b.begin() + std::min(b.size(), at + 1 + rng() % 16)); break;
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
    long runs = 0;
    uint64_t seed = 1;
    std::vector<std::string> files;
    for (int i = 1; i < argc; i++) {
        if (std::strncmp(argv[i], "-runs=", 6) == 0) runs = std::atol(argv[i] + 6);
        else if (std::strncmp(argv[i], "-seed=", 6) == 0) seed = std::strtoull(argv[i] + 6, nullptr, 10);
        else add_inputs(argv[i], files);
    }
    if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
    std::vector<std::vector<uint8_t>> inputs;
    for (const std::string& f : files) {
        inputs.push_back(read_file(f));
        LLVMFuzzerTestOneInput(inputs.back().data(), inputs.back().size());
    }
    std::mt19937_64 rng(seed);
    for (long r = 0; r < runs && !inputs.empty(); r++) {
        std::vector<uint8_t> b = inputs[rng() % inputs.size()];
        mutate(b, rng);
        LLVMFuzzerTestOneInput(b.data(), b.size());
    }
    std::printf("%s: %zu inputs and %ld mutations, no failure\n", argv[0], inputs.size(), runs);
    return 0;
}
