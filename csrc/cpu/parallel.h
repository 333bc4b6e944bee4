// Fork-join loops on a persistent worker pool. Exceptions thrown by the body are rethrown on the caller.
//
// The pool is created on first use with hardware_concurrency() - 1 workers and lives for the process (its
// threads are detached, so interpreter exit never waits on them). Several callers may run loops at once.
// The caller always works on its own loop and, once it runs out of items, withdraws the tickets no worker
// has picked up, so a loop finishes even if every worker is busy elsewhere (or, after fork(), gone).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace syncd {

namespace detail {

struct Job {
  std::atomic<size_t> next{0};
  size_t n = 0;
  std::function<void(size_t)> body;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  int active = 0;  // workers inside run(); guarded by the pool mutex

  void run() {
    for (;;) {
      size_t i = next.fetch_add(1);
      if (i >= n || failed.load(std::memory_order_relaxed)) return;
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
      }
    }
  }
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: detached workers may outlive static destructors
    return *pool;
  }

  void run(size_t n, size_t helpers, std::function<void(size_t)> body) {
    Job job;
    job.n = n;
    job.body = std::move(body);
    helpers = std::min(helpers, workers_);
    {
      std::lock_guard<std::mutex> lock(m_);
      for (size_t k = 0; k < helpers; ++k) q_.push_back(&job);
    }
    if (helpers == 1) cv_.notify_one();
    else if (helpers > 1) cv_.notify_all();
    job.run();
    std::unique_lock<std::mutex> lock(m_);
    q_.erase(std::remove(q_.begin(), q_.end(), &job), q_.end());
    done_.wait(lock, [&] { return job.active == 0; });
    lock.unlock();
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  Pool() {
    unsigned hw = std::thread::hardware_concurrency();
    workers_ = hw > 1 ? hw - 1 : 1;
    for (size_t k = 0; k < workers_; ++k) std::thread([this] { loop(); }).detach();
  }

  void loop() {
    for (;;) {
      Job* job;
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return !q_.empty(); });
        job = q_.front();
        q_.pop_front();
        job->active++;
      }
      job->run();
      {
        std::lock_guard<std::mutex> lock(m_);
        job->active--;
      }
      done_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_, done_;
  std::deque<Job*> q_;
  size_t workers_ = 1;
};

}  // namespace detail

// Calls body(i) for i in [0, n) on up to `threads` threads (the caller is one of them). Items are handed
// out dynamically, so uneven items balance. The first exception stops new items and is rethrown.
template <class F>
void parallel_for(size_t n, int threads, F&& body) {
  size_t t = std::min<size_t>(n, threads < 1 ? 1 : static_cast<size_t>(threads));
  if (t <= 1) {
    for (size_t i = 0; i < n; ++i) body(i);
    return;
  }
  detail::Pool::get().run(n, t - 1, [&body](size_t i) { body(i); });
}

}  // namespace syncd
