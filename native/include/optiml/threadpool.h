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

    // Runs fn(ith, nth) on every thread (ith = 0..nth-1) and returns when all have finished.
    // The first exception thrown by any share is rethrown here. Calls from several host threads
    // are serialized; a call from inside a job runs inline on the calling thread (nth = 1).
    void run(const std::function<void(int ith, int nth)>& fn);

    // Inside run(): waits until every thread of the job has reached this point.
    void barrier();

private:
    void worker_main(int ith);
    void execute(int ith);

    int n_threads_;
    std::vector<std::thread> workers_;
    std::mutex run_mutex_;  // one job at a time

    const std::function<void(int, int)>* job_ = nullptr;
    alignas(64) std::atomic<uint64_t> generation_{0};
    alignas(64) std::atomic<int> pending_{0};
    alignas(64) std::atomic<int> barrier_count_{0};
    alignas(64) std::atomic<int> barrier_phase_{0};
    std::atomic<bool> stop_{false};

    std::mutex sleep_mutex_;
    std::condition_variable wake_;
    std::atomic<int> sleepers_{0};

    std::mutex error_mutex_;
    std::exception_ptr error_;
};

// Physical cores of this machine (logical CPUs when the topology cannot be read).
int physical_core_count();

// The process-wide pool, created on first use with physical_core_count() threads
// (OPTIML_NUM_THREADS overrides). set_default_threads() replaces it; holders of the old pool keep
// it alive until they finish.
std::shared_ptr<ThreadPool> default_pool();
void set_default_threads(int n_threads);

// Splits [0, n) into nth nearly equal contiguous parts; returns part ith as [*begin, *end).
inline void split_range(int64_t n, int ith, int nth, int64_t* begin, int64_t* end) {
    const int64_t per = n / nth, extra = n % nth;
    *begin = ith * per + (ith < extra ? ith : extra);
    *end = *begin + per + (ith < extra ? 1 : 0);
}

}  // namespace optiml
