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

namespace {

// `raw` over `len` bytes at p whose first word has index `first_word`; a partial last word is zero-padded.
uint64_t checksum_raw_bytes(const uint8_t* p, size_t len, uint64_t first_word) {
  const size_t whole = len / 8, tail = len % 8;
  uint64_t s = whole >= 64 ? checksum_words_fast(p, whole, first_word) : checksum_words(p, whole, first_word);
  if (tail) {
    uint8_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(buf, p + whole * 8, tail);
    s += checksum_term(load_le64(buf), first_word + whole);
  }
  return s;
}

}  // namespace

uint64_t checksum_raw_range(const uint8_t* base, size_t begin, size_t end) {
  return checksum_raw_bytes(base + begin, end - begin, begin / 8);
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

// Elements [e0, e0 + n) of a strided view, packed into `out` (n * sizeof(T) bytes).
template <class T>
SYNCD_CLONES void gather_strided(const uint8_t* p, size_t stride_bytes, size_t e0, size_t n, uint8_t* out) {
  const uint8_t* src = p + e0 * stride_bytes;
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * stride_bytes, sizeof(T));
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
}

// The same for stride 2 * sizeof(T) (the bf16 halves of fp32 weights): element i is the low half of the
// little-endian word of twice its width at p + i * stride, which vectorises as a narrowing move. The last
// element is copied alone, so no load passes the view's last byte.
template <class T, class T2>
SYNCD_CLONES void gather_halves(const uint8_t* p, size_t e0, size_t n, uint8_t* out) {
  if (n == 0) return;
  const uint8_t* src = p + e0 * sizeof(T2);
  for (size_t i = 0; i + 1 < n; ++i) {
    T2 w;
    std::memcpy(&w, src + i * sizeof(T2), sizeof(T2));
    const T v = static_cast<T>(w);
    std::memcpy(out + i * sizeof(T), &v, sizeof(T));
  }
  std::memcpy(out + (n - 1) * sizeof(T), src + (n - 1) * sizeof(T2), sizeof(T));
}

void gather_any(const uint8_t* p, size_t itemsize, size_t stride_bytes, size_t e0, size_t n, uint8_t* out) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  if (stride_bytes == 2 * itemsize) {
    switch (itemsize) {
      case 1: return gather_halves<uint8_t, uint16_t>(p, e0, n, out);
      case 2: return gather_halves<uint16_t, uint32_t>(p, e0, n, out);
      case 4: return gather_halves<uint32_t, uint64_t>(p, e0, n, out);
      default: break;
    }
  }
#endif
  switch (itemsize) {
    case 1: return gather_strided<uint8_t>(p, stride_bytes, e0, n, out);
    case 2: return gather_strided<uint16_t>(p, stride_bytes, e0, n, out);
    case 4: return gather_strided<uint32_t>(p, stride_bytes, e0, n, out);
    default: return gather_strided<uint64_t>(p, stride_bytes, e0, n, out);
  }
}

}  // namespace

uint64_t checksum_strided(const uint8_t* p, size_t numel, size_t itemsize, size_t stride_bytes, int threads) {
  const size_t nbytes = numel * itemsize;
  const size_t per_item = kChunk / itemsize;  // elements per work item: a whole number of words
  const size_t items = (numel + per_item - 1) / per_item;
  std::vector<uint64_t> part(items, 0);
  parallel_for(items, threads, [&](size_t k) {
    thread_local std::vector<uint8_t> buf;
    buf.resize(kChunk);
    const size_t e0 = k * per_item, n = std::min(numel - e0, per_item);
    gather_any(p, itemsize, stride_bytes, e0, n, buf.data());
    part[k] = checksum_raw_bytes(buf.data(), n * itemsize, e0 * itemsize / 8);
  });
  uint64_t raw = 0;
  for (uint64_t s : part) raw += s;
  return checksum_finalize(raw, nbytes);
}

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
