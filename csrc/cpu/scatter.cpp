#include "scatter.h"

#include <atomic>
#include <cstring>
#include <stdexcept>

#include "parallel.h"
#include "word_dispatch.h"

namespace syncd {

namespace {

template <class T>
T load(const uint8_t* p, uint64_t j) {
  T v;
  std::memcpy(&v, p + j * sizeof(T), sizeof(T));
  return v;
}

template <class T>
struct Target {  // word p of a strided target
  uint8_t* base;
  uint64_t stride;
  T get(uint64_t p) const { return load<T>(base + p * stride, 0); }
  void set(uint64_t p, T v) const { std::memcpy(base + p * stride, &v, sizeof(T)); }
  const uint8_t* addr(uint64_t p) const { return base + p * stride; }
};

// Writes words [0, n) of run r, verifying each first; returns n when all were written, else the index of
// the first bad word (nothing of this run is left written then) and sets *bad.
template <class T>
uint64_t write_run(const ScatterRun& r, bool verify, int64_t* bad) {
  const Target<T> t{r.target, r.stride};
  constexpr uint64_t kAhead = 16;  // positions are sparse: fetch the lines a few words ahead
  uint64_t j = 0;
  for (; j < r.n; ++j) {
    if (j + kAhead < r.n) {
      const uint64_t q = uint64_t(r.idx[j + kAhead]);
      if (q < r.numel) __builtin_prefetch(t.addr(q), 1);
    }
    const uint64_t p = uint64_t(r.idx[j]);
    if (p >= r.numel) {
      *bad = -1;
      break;
    }
    if (verify && t.get(p) != load<T>(r.before, j)) {
      int64_t count = 0;
      for (uint64_t k = j; k < r.n; ++k) {
        const uint64_t q = uint64_t(r.idx[k]);
        count += q < r.numel && t.get(q) != load<T>(r.before, k);
      }
      *bad = count;
      break;
    }
    t.set(p, load<T>(r.after, j));
  }
  if (j == r.n) return j;
  for (uint64_t k = 0; k < j; ++k) t.set(uint64_t(r.idx[k]), load<T>(r.before, k));  // undo this run
  return j;
}

template <class T>
void unwrite_run(const ScatterRun& r) {
  const Target<T> t{r.target, r.stride};
  for (uint64_t k = 0; k < r.n; ++k) t.set(uint64_t(r.idx[k]), load<T>(r.before, k));
}

}  // namespace

ScatterResult scatter_runs(const std::vector<ScatterRun>& runs, bool verify, int threads) {
  for (const ScatterRun& r : runs) {  // reject bad runs up front
    by_word_bytes(r.width, [](auto) { return 0; });
    if (r.stride < uint64_t(r.width)) throw std::invalid_argument("scatter: stride shorter than a word");
  }
  std::vector<uint8_t> done(runs.size(), 0);
  std::atomic<int64_t> failed_run{-1};  // the first run that failed; later runs are not started
  std::vector<int64_t> bad(runs.size(), 0);
  parallel_for(runs.size(), threads, [&](size_t i) {
    if (failed_run.load(std::memory_order_relaxed) >= 0) return;
    const ScatterRun& r = runs[i];
    uint64_t written = by_word_bytes(r.width, [&](auto tag) { return write_run<decltype(tag)>(r, verify, &bad[i]); });
    if (written == r.n) {
      done[i] = 1;
    } else {
      int64_t none = -1;
      failed_run.compare_exchange_strong(none, int64_t(i));
    }
  });
  ScatterResult res;
  if (failed_run.load() < 0) return res;
  parallel_for(runs.size(), threads, [&](size_t i) {
    if (done[i]) by_word_bytes(runs[i].width, [&](auto tag) { unwrite_run<decltype(tag)>(runs[i]); return 0; });
  });
  res.failed_run = failed_run.load();
  res.mismatches = bad[size_t(res.failed_run)];
  return res;
}

}  // namespace syncd
