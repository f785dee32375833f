// The CUDA emulator's fibers and runtime calls (see cuda_runtime.h beside this file).
//
// A block's threads are fibers on the calling thread, switched by a few instructions of assembly on
// x86-64 (swapcontext elsewhere: correct, much slower, since it saves the signal mask with a system
// call). The scheduler runs every runnable fiber in turn; a fiber that reaches a barrier stops there
// until all live fibers of its block (or warp) have reached it, and a barrier that can never open (a
// kernel that diverges around __syncthreads) aborts with a message rather than hang.
#include <array>
#include <chrono>
#include <cuda_runtime.h>
#include "optiml/ggml_types.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <map>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace optiml_emu {

namespace {

constexpr size_t kStackBytes = 64 << 10;

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save and continues
// on the stack `load` (the state another emu_switch saved there, or a new fiber's first frame).
extern "C" void optiml_emu_switch(void** save, void* load);
asm(R"(
    .text
    .globl optiml_emu_switch
    .type optiml_emu_switch, @function
optiml_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size optiml_emu_switch, .-optiml_emu_switch
)");
#endif

enum State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
    std::unique_ptr<char[]> stack;
    dim3 tid;
    State state = kDone;
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t ctx;
#endif
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<uint64_t> slots;         // two per thread (shuffle_put)
    std::vector<uint32_t> slot_shuffle;  // which shuffle of its thread (counted from 1) wrote each slot
    std::vector<uint32_t> shuffles;      // each thread's shuffles so far
    std::vector<std::array<uint32_t, 6>> fragments;  // each thread's A and B fragments (mma_m16n8k32_s8)
    std::vector<int> warp_live, warp_arrived;
    int live = 0, block_arrived = 0, current = -1;
    const std::function<void()>* body = nullptr;
#if defined(__x86_64__)
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler;
#endif
};

Block* g_block = nullptr;  // the block being run (launches hold g_launch_lock)

void to_scheduler() {
    Block& b = *g_block;
#if defined(__x86_64__)
    optiml_emu_switch(&b.fibers[b.current].sp, b.scheduler_sp);
#else
    swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
#endif
}

void fiber_main() {
    Block& b = *g_block;
    (*b.body)();
    b.fibers[b.current].state = kDone;
    to_scheduler();
    std::abort();  // a finished fiber is never resumed
}

void start_fiber(Block& b, int i) {
    Fiber& f = b.fibers[i];
    if (!f.stack) f.stack.reset(new char[kStackBytes]);
    f.state = kRunnable;
#if defined(__x86_64__)
    // The first switch pops six registers and returns into fiber_main with the stack as after a call.
    uintptr_t top = ((uintptr_t)f.stack.get() + kStackBytes) & ~(uintptr_t)15;
    void** sp = (void**)(top - 64);
    for (int r = 0; r < 6; r++) sp[r] = nullptr;
    sp[6] = (void*)&fiber_main;
    sp[7] = nullptr;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
#endif
}

void resume(Block& b, int i) {
    b.current = i;
    threadIdx = b.fibers[i].tid;
#if defined(__x86_64__)
    optiml_emu_switch(&b.scheduler_sp, b.fibers[i].sp);
#else
    swapcontext(&b.scheduler, &b.fibers[i].ctx);
#endif
}

void run_block(Block& b) {
    const int n = (int)b.fibers.size();
    for (int i = 0; i < n; i++) start_fiber(b, i);
    b.slot_shuffle.assign(2 * n, 0);
    b.shuffles.assign(n, 0);
    b.live = n;
    b.block_arrived = 0;
    const int n_warps = (n + 31) / 32;
    b.warp_live.assign(n_warps, 0);
    b.warp_arrived.assign(n_warps, 0);
    for (int i = 0; i < n; i++) b.warp_live[i / 32]++;
    while (b.live > 0) {
        bool ran = false;
        for (int i = 0; i < n; i++) {
            if (b.fibers[i].state != kRunnable) continue;
            resume(b, i);
            ran = true;
            if (b.fibers[i].state == kDone) {
                b.live--;
                b.warp_live[i / 32]--;
            }
        }
        bool opened = false;
        for (int w = 0; w < n_warps; w++)
            if (b.warp_arrived[w] > 0 && b.warp_arrived[w] == b.warp_live[w]) {
                for (int i = w * 32; i < n && i < w * 32 + 32; i++)
                    if (b.fibers[i].state == kAtWarpBarrier) b.fibers[i].state = kRunnable;
                b.warp_arrived[w] = 0;
                opened = true;
            }
        if (b.block_arrived > 0 && b.block_arrived == b.live) {
            for (Fiber& f : b.fibers)
                if (f.state == kAtBlockBarrier) f.state = kRunnable;
            b.block_arrived = 0;
            opened = true;
        }
        if (!ran && !opened && b.live > 0) {
            std::fprintf(stderr, "optiml CUDA emulator: block (%u,%u,%u) deadlocked: %d threads wait at a barrier "
                         "that the others never reach\n", blockIdx.x, blockIdx.y, blockIdx.z, b.live);
            std::abort();
        }
    }
}

}  // namespace

// The graph being captured (nullptr: none), and whether a call refused during the capture broke it.
thread_local std::vector<std::function<void()>>* g_capture = nullptr;
thread_local bool g_capture_broken = false;

// A launch that a GPU refuses (cudaErrorInvalidConfiguration: CUDA's limits for every compute capability
// since 3.0) aborts here too, rather than running on the emulator and failing only on a GPU.
void check_launch(dim3 grid, dim3 block) {
    const uint64_t threads = (uint64_t)block.x * block.y * block.z;
    const bool ok = grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x <= 2147483647u && grid.y <= 65535 &&
                    grid.z <= 65535 && threads >= 1 && threads <= 1024 && block.x <= 1024 && block.y <= 1024 &&
                    block.z <= 64;
    if (ok) return;
    std::fprintf(stderr, "optiml CUDA emulator: a launch no GPU accepts: grid (%u,%u,%u), block (%u,%u,%u)\n", grid.x,
                 grid.y, grid.z, block.x, block.y, block.z);
    std::abort();
}

void launch(dim3 grid, dim3 block, const std::function<void()>& body) {
    check_launch(grid, block);
    if (g_capture) {
        g_capture->push_back([grid, block, body] { launch(grid, block, body); });
        return;
    }
    // OPTIML_EMU_COUNT_ONLY=1: kernels are not run at all (their results are whatever memory held), for
    // counting what a big model's step launches (optiml bench --launches) without emulating every thread.
    static const bool count_only = [] {
        const char* e = std::getenv("OPTIML_EMU_COUNT_ONLY");
        return e && *e && std::strcmp(e, "0") != 0;
    }();
    if (count_only) return;
    // One launch at a time in the process, whichever thread makes it (as a GPU's single stream would run
    // them): the kernels' indices and __shared__ arrays are plain globals (cuda_runtime.h).
    thread_local bool in_launch = false;
    if (in_launch) {  // (the lock below would wait for itself; the block's fibers would be overwritten anyway)
        std::fprintf(stderr, "optiml CUDA emulator: a launch from inside a kernel, which the emulator does not run\n");
        std::abort();
    }
    static std::mutex g_launch_lock;
    std::lock_guard<std::mutex> lock(g_launch_lock);
    in_launch = true;
    // Fibers and their stacks are kept for the next launch, and never freed: a thread still in a launch while
    // the process exits must not run on stacks that static destructors freed.
    static Block& b = *new Block;
    g_block = &b;
    const int n = (int)(block.x * block.y * block.z);
    b.fibers.resize(n);
    b.slots.assign(2 * n, 0);
    b.fragments.assign(n, {});
    b.body = &body;
    for (int i = 0; i < n; i++)
        b.fibers[i].tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    blockDim = block;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = dim3(x, y, z);
                run_block(b);
            }
    g_block = nullptr;
    in_launch = false;
}

void syncthreads() {
    Block& b = *g_block;
    b.fibers[b.current].state = kAtBlockBarrier;
    b.block_arrived++;
    to_scheduler();
}

void warp_barrier() {
    Block& b = *g_block;
    b.fibers[b.current].state = kAtWarpBarrier;
    b.warp_arrived[b.current / 32]++;
    to_scheduler();
}

int lane_index() { return g_block->current; }
uint64_t* shuffle_put(int me) {
    Block& b = *g_block;
    const uint32_t k = ++b.shuffles[me];
    const int slot = 2 * me + (int)(k & 1);
    b.slot_shuffle[slot] = k;
    return &b.slots[slot];
}
const uint64_t* shuffle_get(int me, int src) {
    Block& b = *g_block;
    const uint32_t k = b.shuffles[me];
    if (src >= (int)b.fibers.size()) return nullptr;
    const int slot = 2 * src + (int)(k & 1);
    return b.slot_shuffle[slot] == k ? &b.slots[slot] : nullptr;  // (an older count: src exited before this one)
}

void shuffle_from_gone_lane(int me, int src) {
    std::fprintf(stderr, "optiml CUDA emulator: block (%u,%u,%u) thread %d shuffles from thread %d, which %s\n", blockIdx.x,
                 blockIdx.y, blockIdx.z, me, src, src < (int)g_block->fibers.size() ? "has exited" : "the block lacks");
    std::abort();
}

void mma_m16n8k32_s8(int c[4], const uint32_t a[4], const uint32_t b[2]) {
    Block& blk = *g_block;
    const int me = blk.current, base = me & ~31, lane = me & 31;
    blk.fragments[me] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    warp_barrier();
    // A's element (row, k) is byte k % 4 of register (row >= 8) + 2 (k >= 16) of lane 4 (row % 8) + (k % 16) / 4;
    // B's (k, col) is byte k % 4 of register k >= 16 of lane 4 col + (k % 16) / 4.
    auto byte = [](uint32_t w, int k) { return (int)(int8_t)(w >> (8 * (k % 4))); };
    for (int e = 0; e < 4; e++) {
        const int row = lane / 4 + 8 * (e / 2), col = 2 * (lane % 4) + e % 2;
        int sum = 0;
        for (int k = 0; k < 32; k++) {
            const auto& fa = blk.fragments[base + 4 * (row % 8) + (k % 16) / 4];
            const auto& fb = blk.fragments[base + 4 * col + (k % 16) / 4];
            sum += byte(fa[(row >= 8) + 2 * (k >= 16)], k) * byte(fb[4 + (k >= 16)], k);
        }
        c[e] += sum;
    }
    warp_barrier();  // nobody overwrites a fragment before the warp has read it
}

void mma_m16n8k16_s8(int c[4], const uint32_t a[2], uint32_t b) {
    Block& blk = *g_block;
    const int me = blk.current, base = me & ~31, lane = me & 31;
    blk.fragments[me] = {a[0], a[1], 0, 0, b, 0};
    warp_barrier();
    // A's (row, k) is byte k % 4 of register row >= 8 of lane 4 (row % 8) + k / 4; B's (k, col) byte k % 4 of lane
    // 4 col + k / 4.
    auto byte = [](uint32_t w, int k) { return (int)(int8_t)(w >> (8 * (k % 4))); };
    for (int e = 0; e < 4; e++) {
        const int row = lane / 4 + 8 * (e / 2), col = 2 * (lane % 4) + e % 2;
        int sum = 0;
        for (int k = 0; k < 16; k++)
            sum += byte(blk.fragments[base + 4 * (row % 8) + k / 4][row >= 8], k) * byte(blk.fragments[base + 4 * col + k / 4][4], k);
        c[e] += sum;
    }
    warp_barrier();
}

void mma_m16n8k16_f16(float c[4], const uint32_t a[4], const uint32_t b[2], bool bf16) {
    Block& blk = *g_block;
    const int me = blk.current, base = me & ~31, lane = me & 31;
    blk.fragments[me] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    warp_barrier();
    // A's (row, k) is half k % 2 of register (row >= 8) + 2 (k >= 8) of lane 4 (row % 8) + (k % 8) / 2; B's (k,
    // col) half k % 2 of register k >= 8 of lane 4 col + (k % 8) / 2. The products are exact in float; the sum
    // is formed in k's order here, in the hardware's own order (and rounding) there: results agree to a few ulps.
    auto value = [bf16](uint32_t w, int k) {
        const uint16_t h = (uint16_t)(w >> (16 * (k % 2)));
        if (!bf16) return optiml::fp16_to_fp32(h);
        const uint32_t u = (uint32_t)h << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    };
    for (int e = 0; e < 4; e++) {
        const int row = lane / 4 + 8 * (e / 2), col = 2 * (lane % 4) + e % 2;
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) {
            const auto& fa = blk.fragments[base + 4 * (row % 8) + (k % 8) / 2];
            const auto& fb = blk.fragments[base + 4 * col + (k % 8) / 2];
            sum += value(fa[(row >= 8) + 2 * (k >= 8)], k) * value(fb[4 + (k >= 8)], k);
        }
        c[e] += sum;
    }
    warp_barrier();
}

}  // namespace optiml_emu

// ---- runtime API: host memory, everything done before returning --------------------------------------
namespace {
const char* error_name(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorNoDevice: return "cudaErrorNoDevice";
        case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
        case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
        case cudaErrorHostMemoryAlreadyRegistered: return "cudaErrorHostMemoryAlreadyRegistered";
        default: return "cudaErrorInvalidDevice";
    }
}
constexpr size_t kEmulatedMemory = size_t(8) << 30;

// A call that a capture does not allow: it breaks the capture and fails.
bool refused_in_capture() {
    if (!optiml_emu::g_capture) return false;
    optiml_emu::g_capture_broken = true;
    return true;
}
}  // namespace

struct optiml_emu_graph {
    std::vector<std::function<void()>> ops;
};
cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode) {
    if (optiml_emu::g_capture) return cudaErrorStreamCaptureUnsupported;
    optiml_emu::g_capture = new std::vector<std::function<void()>>;
    optiml_emu::g_capture_broken = false;
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* graph) {
    std::vector<std::function<void()>>* ops = optiml_emu::g_capture;
    *graph = nullptr;
    if (!ops) return cudaErrorInvalidValue;
    optiml_emu::g_capture = nullptr;
    if (optiml_emu::g_capture_broken) {
        delete ops;
        return cudaErrorStreamCaptureInvalidated;
    }
    *graph = new optiml_emu_graph{std::move(*ops)};
    delete ops;
    return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
    *exec = new optiml_emu_graph{graph->ops};
    return cudaSuccess;
}
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph, cudaGraphExecUpdateResultInfo* info) {
    exec->ops = graph->ops;
    if (info) info->result = 0;
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    for (const auto& op : exec->ops) op();
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    std::memset(prop, 0, sizeof(*prop));
    std::snprintf(prop->name, sizeof(prop->name), "OptiML CUDA emulator (CPU)");
    prop->totalGlobalMem = kEmulatedMemory;
    prop->major = 9;
    prop->multiProcessorCount = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaGetDevice(int* device) {
    *device = 0;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    *free_bytes = *total_bytes = kEmulatedMemory;
    return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) { return error_name(e); }
const char* cudaGetErrorName(cudaError_t e) { return error_name(e); }
cudaError_t cudaMalloc(void** p, size_t bytes) {
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    *p = std::calloc(bytes ? bytes : 1, 1);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* p) {
    std::free(p);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;  // (no graph here records a memset)
    std::memset(p, value, bytes);
    return cudaSuccess;
}
// Host ranges registered with cudaHostRegister (page-locked on a GPU).
static std::mutex g_registered_mutex;
static std::map<const uint8_t*, size_t> g_registered;

static bool registered(const void* p, size_t bytes) {
    const auto* b = (const uint8_t*)p;
    std::lock_guard<std::mutex> lock(g_registered_mutex);
    auto it = g_registered.upper_bound(b);
    if (it == g_registered.begin()) return false;
    --it;
    return b + bytes <= it->first + it->second;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
    if (optiml_emu::g_capture) {
        // A graph keeps device-to-device copies, and copies to or from page-locked host memory; pageable
        // memory is refused here (a GPU copies it through a staging buffer at the call, not at each launch).
        const void* host = kind == cudaMemcpyHostToDevice ? src : kind == cudaMemcpyDeviceToHost ? dst : nullptr;
        if (kind != cudaMemcpyDeviceToDevice && !(host && registered(host, bytes)) && refused_in_capture())
            return cudaErrorStreamCaptureUnsupported;
        optiml_emu::g_capture->push_back([=] { std::memmove(dst, src, bytes); });
        return cudaSuccess;
    }
    std::memmove(dst, src, bytes);
    return cudaSuccess;
}
// Page-locking changes nothing for a copy here; it is recorded so that captures may keep copies of such
// memory (cudaMemcpyAsync), and memory of which any page is registered already is refused, as CUDA does.
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned) {
    constexpr uintptr_t kPage = 4096;
    const uintptr_t first = (uintptr_t)p & ~(kPage - 1), end = ((uintptr_t)p + bytes + kPage - 1) & ~(kPage - 1);
    std::lock_guard<std::mutex> lock(g_registered_mutex);
    for (const auto& [q, n] : g_registered) {
        const uintptr_t qf = (uintptr_t)q & ~(kPage - 1), qe = ((uintptr_t)q + n + kPage - 1) & ~(kPage - 1);
        if (first < qe && qf < end) return cudaErrorHostMemoryAlreadyRegistered;
    }
    g_registered[(const uint8_t*)p] = bytes;
    return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
    std::lock_guard<std::mutex> lock(g_registered_mutex);
    return g_registered.erase((const uint8_t*)p) ? cudaSuccess : cudaErrorInvalidValue;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
    *s = nullptr;
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) {
    return refused_in_capture() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}
// Launches and copies run to completion when they are made, so an event completes when it is recorded:
// its time is the host's clock then.
struct optiml_emu_event {
    double t = 0;
};
cudaError_t cudaEventCreate(cudaEvent_t* e) {
    *e = new optiml_emu_event;
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    if (refused_in_capture()) return cudaErrorStreamCaptureUnsupported;
    e->t = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    *ms = (float)((end->t - start->t) * 1e3);
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
    return refused_in_capture() ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}
