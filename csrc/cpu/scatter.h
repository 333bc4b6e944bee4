// In-place scatter of staged words, all or nothing: the CPU side of an engine's weight apply and rollback
// (engine/updater.py). Torch-free: callers pass pointers to memory they own and keep alive for the call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace syncd {

// One run of staged words for one target: after[j] goes to target word idx[j] (idx ascending is fastest,
// not required), each word `width` bytes (1, 2, 4 or 8), n words; the target holds numel words, `stride`
// bytes apart (a strided view, e.g. the bf16 halves of fp32 weights, has stride > width).
struct ScatterRun {
  uint8_t* target;
  uint64_t numel;
  uint64_t stride;
  const int64_t* idx;
  const uint8_t* before;
  const uint8_t* after;
  uint64_t n;
  int width;
};

struct ScatterResult {
  int64_t failed_run = -1;  // -1: every word written
  int64_t mismatches = 0;   // in the failed run: words that did not hold `before`; -1: a position out of range
};

// Writes every run on up to `threads` threads. With verify, each position must hold its `before` word just
// before it is written (the cache line is then hot). On a mismatch or an out-of-range position, every word
// written by any run is put back before this returns, so the targets are exactly as before. Runs must not
// share target words. Thread-safe for disjoint targets.
ScatterResult scatter_runs(const std::vector<ScatterRun>& runs, bool verify, int threads);

}  // namespace syncd
