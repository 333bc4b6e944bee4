// Kept-set log-probabilities (see replay.h). Rows are independent: blocks of rows run on the worker pool.
#include "replay.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "nvfp4.h"  // bf16 / f16 <-> float32 conversions
#include "parallel.h"

namespace syncd {
namespace replay {

namespace {

constexpr int64_t kRowsPerTask = 64;

inline float load(const void* base, int dtype_code, int64_t i) {
  if (dtype_code == nvfp4::kF32) return static_cast<const float*>(base)[i];
  uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dtype_code == nvfp4::kBF16 ? nvfp4::bf16_value(h) : nvfp4::f16_value(h);
}

inline void store(void* base, int dtype_code, int64_t i, float v) {
  if (dtype_code == nvfp4::kF32) {
    static_cast<float*>(base)[i] = v;
    return;
  }
  static_cast<uint16_t*>(base)[i] = dtype_code == nvfp4::kBF16 ? nvfp4::bf16_bits(v) : nvfp4::f16_bits(v);
}

size_t elem_size(int dtype_code) { return dtype_code == nvfp4::kF32 ? 4 : 2; }

template <class F>
void for_row_blocks(int64_t rows, int threads, F&& body) {
  size_t tasks = static_cast<size_t>((rows + kRowsPerTask - 1) / kRowsPerTask);
  parallel_for(tasks, threads, [&](size_t task) {
    int64_t lo = static_cast<int64_t>(task) * kRowsPerTask;
    int64_t hi = std::min(rows, lo + kRowsPerTask);
    for (int64_t t = lo; t < hi; ++t) body(t);
  });
}

}  // namespace

int64_t kept_forward(const void* logits, int dtype_code, int64_t rows, int64_t row_stride, const int64_t* ids,
                     const int64_t* offsets, const int64_t* targets, float temperature, float* logprob, float* lse,
                     float* zk, int threads) {
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  for_row_blocks(rows, threads, [&](int64_t t) {
    const int64_t base = t * row_stride;
    const int64_t lo = offsets[t], hi = offsets[t + 1];
    float m = -std::numeric_limits<float>::infinity();
    bool found = false;
    for (int64_t j = lo; j < hi; ++j) {
      zk[j] = load(logits, dtype_code, base + ids[j]) / temperature;
      m = std::max(m, zk[j]);
      found |= ids[j] == targets[t];
    }
    float s = 0.0f;
    for (int64_t j = lo; j < hi; ++j) s += std::exp(zk[j] - m);
    const float l = m + std::log(s);
    lse[t] = l;
    logprob[t] = load(logits, dtype_code, base + targets[t]) / temperature - l;
    if (!found) {
      int64_t cur = bad.load();
      while (t < cur && !bad.compare_exchange_weak(cur, t)) {
      }
    }
  });
  int64_t b = bad.load();
  return b == std::numeric_limits<int64_t>::max() ? -1 : b;
}

void kept_backward(const float* grad, const float* zk, int64_t rows, int64_t vocab, const int64_t* ids,
                   const int64_t* offsets, const int64_t* targets, const float* lse, float temperature,
                   void* grad_logits, int dtype_code, int threads) {
  const size_t es = elem_size(dtype_code);
  for_row_blocks(rows, threads, [&](int64_t t) {
    // zero the row and write its kept entries while it is in cache (one pass over the gradient's memory)
    std::memset(static_cast<char*>(grad_logits) + static_cast<size_t>(t) * vocab * es, 0, vocab * es);
    const float g = grad[t];
    for (int64_t j = offsets[t]; j < offsets[t + 1]; ++j) {
      const float p = std::exp(zk[j] - lse[t]);
      const float hit = ids[j] == targets[t] ? 1.0f : 0.0f;
      store(grad_logits, dtype_code, t * vocab + ids[j], g * (hit - p) / temperature);
    }
  });
}

}  // namespace replay
}  // namespace syncd
