// Software prefetch of a streaming loop's data a fixed distance ahead (or behind, for loops that go backwards).
// The format-2 row loops and format 1's checksum-and-diff scan do enough work per cache line that with the
// hardware prefetcher alone their loads wait on memory. A hint only: addresses outside the buffers are
// harmless, and they are computed as integers (a pointer past its buffer would be undefined behaviour).
#pragma once

#include <cstddef>
#include <cstdint>

namespace syncd {

constexpr size_t kPrefetchBytes = 4096;

// Prefetches the cache lines of the `bytes` from address a.
inline void prefetch_at(uintptr_t a, size_t bytes) {
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + b), 0, 3);
}
// ... of the `bytes` that start kPrefetchBytes past p / before p.
inline void prefetch_ahead(const void* p, size_t bytes) { prefetch_at(uintptr_t(p) + kPrefetchBytes, bytes); }
inline void prefetch_behind(const void* p, size_t bytes) { prefetch_at(uintptr_t(p) - kPrefetchBytes, bytes); }

}  // namespace syncd
