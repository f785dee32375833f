// A persistent CPU thread pool in the style of ggml's: workers are created once and spin briefly
// between jobs (then sleep), so handing a kernel to all threads costs about a cache-line round trip.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace optiml {

class ThreadPool {
public:
    // n_threads includes the calling thread, which does share 0 of every job.
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return n_threads_; }

    // Made before this process was forked: its workers are the parent's and do not exist here, and its
    // locks may be held by a parent thread that is gone. run() then runs every job inline on the
    // caller (one thread, nothing locked) and the destructor leaves the workers alone; default_pool()
    // makes a new pool in its place.
    bool stale() const;

    // Runs fn(ith, nth) once for every share ith = 0..nth-1 (nth = size()) and returns when all have
    // finished. Shares are claimed by whichever threads come first: the caller runs share 0 and then
    // any share no worker has picked up yet, so a worker the OS has descheduled (another process, the
    // server's event loop) does not stall the job. Two shares may therefore run one after the other
    // on one thread: a share must never wait for another (no barriers inside a job; split the work
    // into two run() calls instead). The first exception thrown by any share is rethrown here. Calls
    // from several host threads are serialized; a call from inside a job runs inline on the calling
    // thread (nth = 1).
    void run(const std::function<void(int ith, int nth)>& fn);

private:
    void worker_main();
    void execute(int ith);
    void run_claimed_shares();

    int n_threads_;
    uint64_t fork_epoch_;  // forks of this process seen when the pool was made
    std::vector<std::thread> workers_;
    std::mutex run_mutex_;  // one job at a time

    const std::function<void(int, int)>* job_ = nullptr;
    alignas(64) std::atomic<uint64_t> generation_{0};
    alignas(64) std::atomic<int> next_share_{0};  // the next share to claim (>= nth: none left)
    alignas(64) std::atomic<int> done_shares_{0};  // shares 1..nth-1 finished
    std::atomic<bool> stop_{false};

    std::mutex sleep_mutex_;
    std::condition_variable wake_;
    std::atomic<int> sleepers_{0};

    std::mutex error_mutex_;
    std::exception_ptr error_;
};

// Physical cores of this machine (logical CPUs when the topology cannot be read).
int physical_core_count();

// The most threads a pool takes: more than any machine's cores, and few enough that a mistyped count
// (10**6) is refused instead of starting threads until the process runs out of them.
constexpr int kMaxThreads = 512;

// The process-wide pool, created on first use with physical_core_count() threads
// (OPTIML_NUM_THREADS overrides, at most kMaxThreads). set_default_threads() replaces it (ArgumentError
// past kMaxThreads); holders of the old pool keep it alive until they finish.
std::shared_ptr<ThreadPool> default_pool();
void set_default_threads(int n_threads);

// Splits [0, n) into nth nearly equal contiguous parts; returns part ith as [*begin, *end).
inline void split_range(int64_t n, int ith, int nth, int64_t* begin, int64_t* end) {
    const int64_t per = n / nth, extra = n % nth;
    *begin = ith * per + (ith < extra ? ith : extra);
    *end = *begin + per + (ith < extra ? 1 : 0);
}

}  // namespace optiml
