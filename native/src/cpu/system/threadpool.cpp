#include "optiml/threadpool.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <new>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "optiml/common.h"

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define OPTIML_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define OPTIML_PAUSE() __asm__ __volatile__("yield")
#else
#define OPTIML_PAUSE() ((void)0)
#endif

namespace optiml {

namespace {
// Spins this many times waiting for work before sleeping: long enough to cover the gap between two
// kernels of one token, short enough not to burn a core while the interpreter is idle.
constexpr int kSpinBeforeSleep = 1 << 16;
// Waits inside a job spin this many times before yielding the core, so a pool larger than the
// free cores (oversubscription, a busy machine) still makes progress instead of starving.
constexpr int kSpinBeforeYield = 1 << 10;

// Spins until done() holds, yielding the core now and then.
template <typename Done>
inline void spin_until(Done done) {
    for (int spin = 0; !done(); spin++) {
        if (spin < kSpinBeforeYield) {
            OPTIML_PAUSE();
        } else {
            std::this_thread::yield();
            spin = 0;
        }
    }
}
thread_local bool tls_in_job = false;     // this thread is running a share of a job

// How many times this process is a fork's child (see ThreadPool::stale).
std::atomic<uint64_t> g_fork_epoch{0};
}  // namespace

ThreadPool::ThreadPool(int n_threads)
    : n_threads_(n_threads < 1 ? 1 : n_threads), fork_epoch_(g_fork_epoch.load()) {
    workers_.reserve(n_threads_ - 1);
    for (int i = 1; i < n_threads_; i++) workers_.emplace_back([this] { worker_main(); });
}

bool ThreadPool::stale() const { return fork_epoch_ != g_fork_epoch.load(std::memory_order_relaxed); }

ThreadPool::~ThreadPool() {
    if (stale()) {
        // The parent's workers: joining them here would fail. Their handles are dropped unjoined.
        (void)new std::vector<std::thread>(std::move(workers_));
        return;
    }
    stop_.store(true);
    {
        std::lock_guard<std::mutex> lk(sleep_mutex_);
        generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
}

void ThreadPool::execute(int ith) {
    tls_in_job = true;
    try {
        (*job_)(ith, n_threads_);
    } catch (...) {
        std::lock_guard<std::mutex> lk(error_mutex_);
        if (!error_) error_ = std::current_exception();
    }
    tls_in_job = false;
}

// Claims and runs shares of the current job until none is left. A claim is a ticket from
// next_share_: run() resets it to 1 (share 0 is the caller's) only after publishing the job, and
// does not return before every claimed share has finished, so a ticket below nth always belongs to
// the job in flight (a straggler from the previous job that draws one simply helps with this one).
void ThreadPool::run_claimed_shares() {
    for (int s = next_share_.fetch_add(1, std::memory_order_acq_rel); s < n_threads_;
         s = next_share_.fetch_add(1, std::memory_order_acq_rel)) {
        execute(s);
        done_shares_.fetch_add(1, std::memory_order_acq_rel);
    }
}

void ThreadPool::worker_main() {
    uint64_t seen = 0;
    for (;;) {
        uint64_t gen = generation_.load(std::memory_order_acquire);
        for (int spin = 0; gen == seen && spin < kSpinBeforeSleep; spin++) {
            if (spin % kSpinBeforeYield == kSpinBeforeYield - 1) std::this_thread::yield();
            else OPTIML_PAUSE();
            gen = generation_.load(std::memory_order_acquire);
        }
        if (gen == seen) {
            std::unique_lock<std::mutex> lk(sleep_mutex_);
            sleepers_.fetch_add(1);
            wake_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
            sleepers_.fetch_sub(1);
            gen = generation_.load(std::memory_order_acquire);
        }
        seen = gen;
        if (stop_.load()) return;
        run_claimed_shares();
    }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
    if (tls_in_job || n_threads_ == 1 || stale()) {
        // Nested call from inside a job, nothing to share, or no workers (a fork's child): run inline
        // as a single thread.
        fn(0, 1);
        return;
    }
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    job_ = &fn;
    error_ = nullptr;
    done_shares_.store(0, std::memory_order_relaxed);
    next_share_.store(1, std::memory_order_release);  // publishes the job to claimers
    generation_.fetch_add(1, std::memory_order_acq_rel);
    if (sleepers_.load() > 0) {
        std::lock_guard<std::mutex> lk(sleep_mutex_);
        wake_.notify_all();
    }
    execute(0);
    // Shares no worker has claimed yet are the caller's: waiting for a worker to wake up (or to be
    // scheduled again) would leave this core idle.
    run_claimed_shares();
    spin_until([&] { return done_shares_.load(std::memory_order_acquire) == n_threads_ - 1; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

int physical_core_count() {
    // Count distinct (package, core) pairs from sysfs; fall back to logical CPUs.
    std::set<std::pair<std::string, std::string>> cores;
    for (int cpu = 0; cpu < 4096; cpu++) {
        const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
        std::ifstream core(base + "core_id"), pkg(base + "physical_package_id");
        if (!core) break;
        std::string c, p;
        core >> c;
        pkg >> p;
        cores.emplace(p, c);
    }
    int n = (int)cores.size();
    if (n <= 0) n = (int)std::thread::hardware_concurrency();
    return n > 0 ? n : 1;
}

namespace {
std::mutex g_pool_mutex;
std::shared_ptr<ThreadPool> g_pool;

int threads_from_env() {
    if (const char* env = std::getenv("OPTIML_NUM_THREADS")) {
        const long n = std::strtol(env, nullptr, 10);  // (saturates where atoi's overflow is undefined)
        if (n > 0) return (int)std::min<long>(n, kMaxThreads);
    }
    return physical_core_count();
}

// In a fork's child: pools made before are stale, and the pool's lock may have been held by a parent
// thread that does not exist here (only async-signal-safe work in this handler).
void after_fork_in_child() {
    g_fork_epoch.fetch_add(1);
    new (&g_pool_mutex) std::mutex();
}

#if defined(__unix__) || defined(__APPLE__)
const int g_atfork_registered = pthread_atfork(nullptr, nullptr, after_fork_in_child);
#endif
}  // namespace

std::shared_ptr<ThreadPool> default_pool() {
    std::lock_guard<std::mutex> lk(g_pool_mutex);
    if (!g_pool || g_pool->stale()) g_pool = std::make_shared<ThreadPool>(threads_from_env());
    return g_pool;
}

void set_default_threads(int n_threads) {
    if (n_threads > kMaxThreads)
        throw ArgumentError(format("number of threads must be at most %d, got %d", kMaxThreads, n_threads));
    std::lock_guard<std::mutex> lk(g_pool_mutex);
    g_pool = std::make_shared<ThreadPool>(n_threads > 0 ? n_threads : threads_from_env());
}

}  // namespace optiml
