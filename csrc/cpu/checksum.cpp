#include "checksum.h"

#include <algorithm>
#include <vector>

#include "multiversion.h"
#include "parallel.h"
#include "simd_scan.h"

namespace syncd {

SYNCD_CLONES
uint64_t checksum_words(const uint8_t* p, size_t nwords, uint64_t first_word) {
  // Eight independent accumulators let the compiler keep a vector of sums.
  uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= nwords; i += 8) {
    for (int l = 0; l < 8; ++l) {
      acc[l] += checksum_term(load_le64(p + 8 * (i + l)), first_word + i + l);
    }
  }
  uint64_t s = 0;
  for (; i < nwords; ++i) s += checksum_term(load_le64(p + 8 * i), first_word + i);
  for (int l = 0; l < 8; ++l) s += acc[l];
  return s;
}

uint64_t checksum_raw_range(const uint8_t* base, size_t begin, size_t end) {
  size_t whole = (end - begin) / 8;
  uint64_t s = whole >= 64 ? checksum_words_fast(base + begin, whole, begin / 8) : checksum_words(base + begin, whole, begin / 8);
  size_t tail = (end - begin) % 8;
  if (tail) {
    uint8_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, base + begin + whole * 8, tail);
    s += checksum_term(load_le64(buf), begin / 8 + whole);
  }
  return s;
}

namespace {

constexpr size_t kChunk = size_t(1) << 19;  // 512 KiB per work item: both cores on mid-sized tensors too

// The raw sums of every buffer, its 512 KiB pieces spread over one pool.
std::vector<uint64_t> checksum_raw_many(const std::vector<std::pair<const uint8_t*, size_t>>& bufs, int threads) {
  std::vector<std::pair<size_t, size_t>> items;  // (buffer, byte offset)
  for (size_t i = 0; i < bufs.size(); ++i)
    for (size_t off = 0; off < bufs[i].second; off += kChunk) items.emplace_back(i, off);
  std::vector<uint64_t> part(items.size(), 0);
  parallel_for(items.size(), threads, [&](size_t k) {
    const auto& [i, off] = items[k];
    part[k] = checksum_raw_range(bufs[i].first, off, std::min(bufs[i].second, off + kChunk));
  });
  std::vector<uint64_t> raw(bufs.size(), 0);
  for (size_t k = 0; k < items.size(); ++k) raw[items[k].first] += part[k];
  return raw;
}

}  // namespace

std::vector<uint64_t> checksum_many(const std::vector<std::pair<const uint8_t*, size_t>>& bufs, int threads) {
  std::vector<uint64_t> out = checksum_raw_many(bufs, threads);
  for (size_t i = 0; i < bufs.size(); ++i) out[i] = checksum_finalize(out[i], bufs[i].second);
  return out;
}

uint64_t checksum_raw_parallel(const uint8_t* p, size_t nbytes, int threads) {
  if (nbytes <= kChunk || threads <= 1) return checksum_raw_range(p, 0, nbytes);
  return checksum_raw_many({{p, nbytes}}, threads)[0];
}

}  // namespace syncd
