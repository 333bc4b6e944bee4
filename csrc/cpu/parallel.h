// A minimal fork-join loop over std::thread. Exceptions thrown by the body are rethrown on the caller.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace syncd {

// Calls body(i) for i in [0, n) on up to `threads` threads (the caller is one of them). Items are handed
// out dynamically, so uneven items balance. The first exception stops new items and is rethrown.
template <class F>
void parallel_for(size_t n, int threads, F&& body) {
  size_t t = std::min<size_t>(n, threads < 1 ? 1 : static_cast<size_t>(threads));
  if (t <= 1) {
    for (size_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    for (;;) {
      size_t i = next.fetch_add(1);
      if (i >= n || failed.load()) return;
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(t - 1);
  for (size_t k = 1; k < t; ++k) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace syncd
