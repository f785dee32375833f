// A CUDA emulator on the CPU, for testing the CUDA backend where there is no GPU (OPTIML_CUDA=EMU).
//
// The CUDA sources (native/src/cuda/*.cu) are compiled as C++ with this header in place of the real
// cuda_runtime.h. Each thread of a block is a fiber on the calling thread; __syncthreads() and warp
// shuffles suspend a fiber until every live thread of its block (or warp) has arrived, so kernels run
// with CUDA's semantics for everything they synchronize on. Blocks run one after another and launches one at
// a time, which makes __shared__ (a static here) each block's own. Memory is host memory, every stream
// call completes before it returns, and there is one device ("OptiML CUDA emulator"). Slow (a fiber
// switch per thread per barrier), correct for tests; never a way to run models.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Launches run one at a time in the process (emu.cpp's launch holds a lock), so a kernel's indices and its
// __shared__ arrays are plain globals: kernels read them in every loop, and thread-locals in a module Python
// loads cost a call each (__tls_get_addr, or a TLS descriptor), a seventh of the emulator's time.
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace optiml_emu {
// Runs body() once per thread of every block of the grid, as the threads of a kernel.
void launch(dim3 grid, dim3 block, const std::function<void()>& body);
void syncthreads();
// Suspends until the other live threads of this warp arrive here too.
void warp_barrier();
// This thread's index in the block.
int lane_index();
// The 8-byte slot where this thread leaves its value for its next shuffle, and the slot where thread `src` left
// its value for the shuffle this thread is in (nullptr: src has exited before it, or the block has no such
// thread). Each thread has two slots, used in turn.
uint64_t* shuffle_put(int me);
const uint64_t* shuffle_get(int me, int src);
// Aborts: a shuffle read lane `src`, which has exited or does not exist (a GPU returns an undefined value).
[[noreturn]] void shuffle_from_gone_lane(int me, int src);
// The warp's mma.sync.m16n8k32.row.col.s32.s8.s8.s32: c[0..3] += this lane's elements of A B, with A's, B's
// and C's fragments in the layouts of the PTX ISA (every lane of the warp takes part, as on a GPU).
void mma_m16n8k32_s8(int c[4], const uint32_t a[4], const uint32_t b[2]);
// The same for mma.sync.m16n8k16 with 8-bit operands (A: 2 registers, B: 1).
void mma_m16n8k16_s8(int c[4], const uint32_t a[2], uint32_t b);
// mma.sync.m16n8k16.row.col.f32 with F16 (bf16 false) or BF16 operands, two a register: c[0..3] += this lane's
// elements of A B.
void mma_m16n8k16_f16(float c[4], const uint32_t a[4], const uint32_t b[2], bool bf16);

// The value v of lane source(my lane) of this thread's warp: every shuffle. The source must be a live thread
// of the block, as on a GPU, where reading an exited or missing lane gives an undefined value.
template <typename T, typename Source>
T shuffle(T v, Source source) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    const int me = lane_index();
    std::memcpy(shuffle_put(me), &v, sizeof(T));
    warp_barrier();
    const int src = (me & ~31) | (source(me & 31) & 31);
    const uint64_t* slot = shuffle_get(me, src);
    if (!slot) shuffle_from_gone_lane(me, src);
    T r;
    std::memcpy(&r, slot, sizeof(T));
    // No second barrier: a thread writes this slot again two shuffles later, past the next shuffle's barrier,
    // which opens only when every thread of the warp has read this one's values. (A barrier is a fiber switch
    // for each thread: shuffles were most of the emulator's switches.)
    return r;
}
template <typename T>
T shfl_xor(T v, int mask) {
    return shuffle(v, [mask](int lane) { return lane ^ mask; });
}
template <typename T>
T shfl(T v, int src_lane) {  // __shfl_sync
    return shuffle(v, [src_lane](int) { return src_lane; });
}
}  // namespace optiml_emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __syncthreads() ::optiml_emu::syncthreads()
#define __syncwarp(...) ::optiml_emu::warp_barrier()
#define __shfl_xor_sync(mask, v, off) ::optiml_emu::shfl_xor((v), (off))
#define __shfl_sync(mask, v, lane) ::optiml_emu::shfl((v), (lane))
// Four signed bytes of a times those of b, plus c.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
// A product rounded on its own, never fused into a following add (volatile: the compiler may not contract
// through it, on a machine with FMA either).
inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
// (The arguments are captured by value: a stream being recorded into a graph keeps the launch for later.)
#define OPTIML_LAUNCH(kernel, grid, block, stream, ...) \
    ::optiml_emu::launch(dim3(grid), dim3(block), [=] { kernel(__VA_ARGS__); })

// ---- the runtime API the backend uses --------------------------------------------------------------
enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
};
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
};
typedef struct optiml_emu_stream* cudaStream_t;
typedef struct optiml_emu_event* cudaEvent_t;
constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDisableTiming = 2;

struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    int major, minor;
    int multiProcessorCount;
};

cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t err);
const char* cudaGetErrorName(cudaError_t err);
cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s);
constexpr unsigned cudaHostRegisterDefault = 0;
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void* p);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);

// Graphs: while a stream is captured, launches, device-to-device copies and copies to or from host memory
// registered with cudaHostRegister are kept instead of run; any other call that would touch the stream
// or allocate breaks the capture (as CUDA's thread-local mode refuses them). Launching the graph runs
// what was kept, in order.
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal = 0, cudaStreamCaptureModeThreadLocal = 1,
                             cudaStreamCaptureModeRelaxed = 2 };
typedef struct optiml_emu_graph* cudaGraph_t;
typedef struct optiml_emu_graph* cudaGraphExec_t;
struct cudaGraphExecUpdateResultInfo {
    int result;
};
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags);
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
