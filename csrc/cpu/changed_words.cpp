#include "changed_words.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "checksum.h"
#include "delta_format.h"
#include "parallel.h"

namespace syncd {
namespace {

template <class T>
uint64_t walk(bool is_float, const uint64_t* words, const uint64_t* old_words, size_t nw, const uint64_t* pos,
              const uint64_t* v, size_t n, T* old_el, T* new_el) {
  constexpr unsigned W = sizeof(T) * 8, E = 64 / W;
  const uint64_t mask = W == 64 ? ~uint64_t(0) : (uint64_t(1) << W) - 1, vmax = core::max_value(W);
  uint64_t adj = 0, now = 0;
  size_t row = 0;
  for (size_t i = 0; i < n; ++i) {
    if (i && pos[i] <= pos[i - 1])
      throw DeltaError("change positions must ascend: " + std::to_string(pos[i]) + " follows " + std::to_string(pos[i - 1]));
    const uint64_t w = pos[i] / E;
    if (i == 0 || w != words[row]) {
      if (i) {
        adj += checksum_term(now, words[row]) - checksum_term(old_words[row], words[row]);
        ++row;
      }
      if (row >= nw || words[row] != w)
        throw DeltaError("change " + std::to_string(i) + " at position " + std::to_string(pos[i]) +
                         " is not in the next listed word (positions must ascend, words list each one's word)");
      now = old_words[row];
    }
    if (v[i] > vmax) throw DeltaError("value change " + std::to_string(v[i]) + " too wide for the dtype");
    const unsigned shift = unsigned(pos[i] % E) * W;
    const T ob = T((old_words[row] >> shift) & mask), nb = core::apply_value<T>(ob, v[i], is_float);
    old_el[i] = ob;
    new_el[i] = nb;
    now = (now & ~(mask << shift)) | (uint64_t(nb) << shift);
  }
  if (n) {
    adj += checksum_term(now, words[row]) - checksum_term(old_words[row], words[row]);
    if (row + 1 != nw) throw DeltaError("words listed without a change in them");
  } else if (nw) {
    throw DeltaError("words listed without a change in them");
  }
  return adj;
}

}  // namespace

uint64_t changed_words(int dtype_code, const uint64_t* words, const uint64_t* old_words, size_t nw,
                       const uint64_t* pos, const uint64_t* v, size_t n, uint8_t* old_el, uint8_t* new_el) {
  const DTypeInfo dt = dtype_info(dtype_code);
  switch (dt.bits) {
    case 8: return walk<uint8_t>(dt.is_float, words, old_words, nw, pos, v, n, old_el, new_el);
    case 16:
      return walk<uint16_t>(dt.is_float, words, old_words, nw, pos, v, n, reinterpret_cast<uint16_t*>(old_el),
                            reinterpret_cast<uint16_t*>(new_el));
    case 32:
      return walk<uint32_t>(dt.is_float, words, old_words, nw, pos, v, n, reinterpret_cast<uint32_t*>(old_el),
                            reinterpret_cast<uint32_t*>(new_el));
    default:
      return walk<uint64_t>(dt.is_float, words, old_words, nw, pos, v, n, reinterpret_cast<uint64_t*>(old_el),
                            reinterpret_cast<uint64_t*>(new_el));
  }
}

namespace {

template <class T>
void gather_words_of(const uint8_t* p, size_t numel, size_t stride_bytes, const uint64_t* words, size_t nw,
                     uint64_t* out) {
  constexpr size_t per = 8 / sizeof(T);
  const size_t nwords = (numel + per - 1) / per;
  constexpr size_t kAhead = 32;  // words apart at random-ish offsets: each a cache miss unless fetched early
  for (size_t i = 0; i < nw; ++i) {
    if (i + kAhead < nw && words[i + kAhead] < nwords)
      __builtin_prefetch(p + size_t(words[i + kAhead]) * per * stride_bytes);
    const uint64_t w = words[i];
    if (w >= nwords)
      throw DeltaError("word " + std::to_string(w) + " is past the " + std::to_string(numel) + "-element tensor");
    const size_t e0 = size_t(w) * per, e1 = std::min(numel, e0 + per);
    uint64_t word = 0;
    if (stride_bytes == sizeof(T) && e1 - e0 == per) {
      word = load_le64(p + e0 * sizeof(T));
    } else {
      uint8_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (size_t e = e0; e < e1; ++e) std::memcpy(buf + (e - e0) * sizeof(T), p + e * stride_bytes, sizeof(T));
      word = load_le64(buf);
    }
    out[i] = word;
  }
}

}  // namespace

void gather_words(const uint8_t* p, size_t numel, size_t itemsize, size_t stride_bytes, const uint64_t* words,
                  size_t nw, uint64_t* out, int threads) {
  constexpr size_t kPiece = size_t(1) << 16;
  parallel_for((nw + kPiece - 1) / kPiece, threads, [&](size_t k) {
    const size_t at = k * kPiece, n = std::min(nw - at, kPiece);
    switch (itemsize) {
      case 1: return gather_words_of<uint8_t>(p, numel, stride_bytes, words + at, n, out + at);
      case 2: return gather_words_of<uint16_t>(p, numel, stride_bytes, words + at, n, out + at);
      case 4: return gather_words_of<uint32_t>(p, numel, stride_bytes, words + at, n, out + at);
      default: return gather_words_of<uint64_t>(p, numel, stride_bytes, words + at, n, out + at);
    }
  });
}

}  // namespace syncd
