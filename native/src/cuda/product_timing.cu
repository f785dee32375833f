// The product kernels timed alone, for tools/bench/gpu_kernels.py: achieved bandwidth at decode, TFLOP/s for a
// prompt, per weight type and shape, beside the device's own copy bandwidth. The weights are random values
// quantized on the host, copied until the copies span more than the GPU's last-level cache, and the
// launches go round the copies, so that every product streams its weights from memory as a model's do.
#include <cuda_runtime.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels.cuh"
#include "optiml/common.h"
#include "optiml/cuda.h"
#include "optiml/quant.h"

namespace optiml {

namespace {

// Device memory and a stream for one timing, freed on every path out.
struct TimingScope {
    std::vector<void*> blocks;
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    explicit TimingScope(int device) {
        cuda_check(cudaSetDevice(device), "selecting the device");
        try {
            cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream");
            cuda_check(cudaEventCreate(&start), "creating an event");
            cuda_check(cudaEventCreate(&stop), "creating an event");
        } catch (...) {
            free_all();
            throw;
        }
    }
    ~TimingScope() { free_all(); }
    void free_all() {
        if (stream) cudaStreamSynchronize(stream);
        for (void* p : blocks) cudaFree(p);
        if (start) cudaEventDestroy(start);
        if (stop) cudaEventDestroy(stop);
        if (stream) cudaStreamDestroy(stream);
        blocks.clear();
        start = stop = nullptr;
        stream = nullptr;
    }
    void* alloc(size_t bytes) {
        void* p = nullptr;
        if (cudaMalloc(&p, bytes) != cudaSuccess) {
            cudaGetLastError();
            throw Error(format("out of GPU memory allocating %zu bytes for a timing; lower span_mib", bytes));
        }
        blocks.push_back(p);
        return p;
    }
    // Seconds per call of enqueue(i) over `reps` calls after one untimed call.
    template <typename F>
    double time(int reps, F enqueue) {
        enqueue(0);
        cuda_check(cudaEventRecord(start, stream), "recording an event");
        for (int i = 0; i < reps; i++) enqueue(i + 1);
        cuda_check(cudaEventRecord(stop, stream), "recording an event");
        cuda_check(cudaEventSynchronize(stop), "waiting for the GPU");
        float ms = 0.0f;
        cuda_check(cudaEventElapsedTime(&ms, start, stop), "reading the timing");
        return ms / 1e3 / reps;
    }
};

}  // namespace

CudaProductTiming cuda_time_product(int device, int32_t type, int64_t rows, int64_t cols, int32_t n,
                                    const std::string& kernel, int reps, int64_t span_bytes) {
    const TypeTraits& tt = type_traits(type);
    if (!tt.name || !cuda_reads_type(type))
        throw ArgumentError(format("the CUDA backend does not read weights of type %d", type));
    if (rows < 1 || cols < 1 || cols % tt.block_size != 0 || n < 1 || reps < 1)
        throw ArgumentError(format("a product of %lld x %lld %s weights with %d tokens: rows and tokens must be "
                                   "positive and cols a multiple of %d", (long long)rows, (long long)cols, tt.name,
                                   n, (int)tt.block_size));
    const size_t row_bytes = row_size(type, cols), matrix_bytes = row_bytes * (size_t)rows;
    if (kernel != "decode" && kernel != "decode-batch" && kernel != "tiles" && kernel != "exact")
        throw ArgumentError(format("kernel '%s': choose decode, decode-batch, tiles or exact", kernel.c_str()));
    const bool tiles = kernel == "tiles", exact = kernel == "exact";
    // decode-batch: the decode kernels built for batches even at one token (as before the one-token ones),
    // for the comparison; the switch is process-wide, so it is put back on every path out.
    struct OneTokenKernels {
        bool was = cuda_one_token_kernels();
        explicit OneTokenKernels(bool on) { cuda_use_one_token_kernels(on); }
        ~OneTokenKernels() { cuda_use_one_token_kernels(was); }
    } one_token(kernel != "decode-batch" && cuda_one_token_kernels());
    if (exact && !cuda_matmul_exact_reads(type, cols))
        throw ArgumentError(format("the exact products (a split's share) read Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K "
                                   "and Q6_K rows of whole blocks, not %lld %s values", (long long)cols, tt.name));
    const bool ftiles = tiles && cuda_matmul_tiles_f_reads(type);  // F16/BF16: the float path's tiles
    if (tiles && !ftiles && !cuda_matmul_tiles_reads(type))
        throw ArgumentError(format("the tiled products read every weight type but F32 and MXFP4, not %s", tt.name));
    if (ftiles && cols % 2 != 0)
        throw ArgumentError(format("the tiled products read %s rows of an even length, not %lld", tt.name, (long long)cols));
    if (tiles) {
        cudaDeviceProp prop{};
        cuda_check(cudaGetDeviceProperties(&prop, device), "reading the device's properties");
        if (prop.major < 8)
            throw ArgumentError(format("the tiled products need compute capability 8.0 (mma.sync); "
                                       "this device has %d.%d", prop.major, prop.minor));
    }

    TimingScope ts(device);
    // 256 rows of random values, quantized once and repeated over the matrix (the bytes' values do not
    // change the time), then the matrix copied until the copies span span_bytes.
    const int64_t pattern = rows < 256 ? rows : 256;
    std::vector<uint8_t> host(row_bytes * (size_t)pattern);
    {
        std::mt19937 rng(1234);
        std::normal_distribution<float> normal(0.0f, 0.05f);
        std::vector<float> v((size_t)cols);
        for (int64_t r = 0; r < pattern; r++) {
            for (float& x : v) x = normal(rng);
            quantize_row(type, v.data(), host.data() + (size_t)r * row_bytes, cols);
        }
    }
    const int copies = (int)std::max<int64_t>(1, (span_bytes + (int64_t)matrix_bytes - 1) / (int64_t)matrix_bytes);
    uint8_t* w = (uint8_t*)ts.alloc(matrix_bytes * (size_t)copies);
    for (int64_t r = 0; r < rows; r += pattern) {
        const int64_t k = rows - r < pattern ? rows - r : pattern;
        cuda_check(cudaMemcpyAsync(w + (size_t)r * row_bytes, host.data(), (size_t)k * row_bytes,
                                   cudaMemcpyHostToDevice, ts.stream), "copying weights");
    }
    for (int c = 1; c < copies; c++)
        cuda_check(cudaMemcpyAsync(w + (size_t)c * matrix_bytes, w, matrix_bytes, cudaMemcpyDeviceToDevice, ts.stream),
                   "copying weights");
    cuda_check(cudaStreamSynchronize(ts.stream), "copying weights");

    float* y = (float*)ts.alloc(sizeof(float) * (size_t)n * (size_t)rows);
    CudaMatrix m{w, rows, row_bytes, y, nullptr, false};
    const bool aligned = cuda_matmul_q8x_reads(type, cols, row_bytes, w);
    CudaProductTiming out;
    out.weight_bytes = (int64_t)matrix_bytes;
    // The activations: random values (zeros would spare the tensor cores some power, and so some time).
    float* x = (float*)ts.alloc(sizeof(float) * (size_t)n * (size_t)cols);
    {
        std::vector<float> xv((size_t)n * (size_t)cols);
        std::mt19937 rng(99);
        std::normal_distribution<float> normal(0.0f, 1.0f);
        for (float& v : xv) v = normal(rng);
        cuda_check(cudaMemcpyAsync(x, xv.data(), sizeof(float) * xv.size(), cudaMemcpyHostToDevice, ts.stream), "copying x");
    }
    if ((tiles && !ftiles) || aligned || exact) {  // the integer path: the activations as 8-bit codes
        int8_t* codes = (int8_t*)ts.alloc((size_t)n * (size_t)cols);
        CudaQ8Meta* meta = (CudaQ8Meta*)ts.alloc(sizeof(CudaQ8Meta) * (size_t)n * (size_t)(cols / 32));
        CudaInputStage st;
        st.x = x;
        st.convert = tiles ? cuda_tile_codes(type) : exact ? cuda_matmul_exact_codes(type) : kCudaCodes;
        st.codes = codes;
        st.meta = meta;
        cuda_input_stage(ts.stream, st, n, cols);
        out.kernel = tiles ? "matmul_tiles" : exact ? "matmul_exact" : "matmul_q8x";
        out.seconds = ts.time(reps, [&](int i) {
            m.w = w + (size_t)(i % copies) * matrix_bytes;
            if (tiles) cuda_matmul_q8x_tiles(ts.stream, type, &m, 1, cols, codes, meta, n);
            else if (exact) cuda_matmul_exact_many(ts.stream, type, &m, 1, cols, codes, meta, n);
            else cuda_matmul_q8x_many(ts.stream, type, &m, 1, cols, codes, meta, n);
        });
    } else {  // the float path (unrounded activations: their rounding does not change the time)
        out.kernel = ftiles ? "matmul_tiles" : "matmul";
        out.seconds = ts.time(reps, [&](int i) {
            m.w = w + (size_t)(i % copies) * matrix_bytes;
            if (ftiles) cuda_matmul_f_tiles(ts.stream, type, &m, 1, cols, x, n);
            else cuda_matmul_many(ts.stream, type, &m, 1, cols, x, n);
        });
    }
    return out;
}

double cuda_copy_bandwidth(int device, int64_t bytes, int reps) {
    if (bytes < 1 || reps < 1) throw ArgumentError("a copy bandwidth needs positive bytes and repetitions");
    TimingScope ts(device);
    void* a = ts.alloc((size_t)bytes);
    void* b = ts.alloc((size_t)bytes);
    const double s = ts.time(reps, [&](int) {
        cuda_check(cudaMemcpyAsync(b, a, (size_t)bytes, cudaMemcpyDeviceToDevice, ts.stream), "copying");
    });
    return 2.0 * (double)bytes / s;  // read and written
}

}  // namespace optiml
