// Word and element arithmetic shared by the CPU and CUDA codecs (spec: syncd/ops/reference/). Torch-free,
// header-only, usable on the host and, under nvcc, on the device.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define SYNCD_HD __host__ __device__ __forceinline__
#else
#define SYNCD_HD inline
#endif

namespace syncd {
namespace core {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kLengthMul = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kWordMul = 0xD6E8FEB86659FD93ull;

// MurmurHash3's 64-bit finaliser (the checksum's final step).
SYNCD_HD uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}

// The per-word mix: a bijection, one multiply between two xor-shifts (the first folds the high half down so
// every input bit reaches the multiply's carries).
SYNCD_HD uint64_t word_mix(uint64_t x) {
  x = (x ^ (x >> 32)) * kWordMul;
  return x ^ (x >> 32);
}

// Checksum term of word index `i` holding the little-endian value `w`.
SYNCD_HD uint64_t checksum_term(uint64_t w, uint64_t i) { return word_mix(w ^ ((i + 1) * kGolden)); }

template <class T>
SYNCD_HD T sign_bit() {
  return T(T(1) << (sizeof(T) * 8 - 1));
}

// Largest coded value v for a W-bit element (u = v + 1 <= 2^W - 1).
SYNCD_HD uint64_t max_value(int bits) { return bits == 64 ? ~uint64_t(0) - 1 : (uint64_t(1) << bits) - 2; }

// Order-preserving key of a float's bits (negative: flip all; positive: set the sign); ints keep their bits.
template <class T>
SYNCD_HD T to_key(T b, bool is_float) {
  if (!is_float) return b;
  return (b & sign_bit<T>()) ? T(~b) : T(b | sign_bit<T>());
}

template <class T>
SYNCD_HD T from_key(T k, bool is_float) {
  if (!is_float) return k;
  return (k & sign_bit<T>()) ? T(k ^ sign_bit<T>()) : T(~k);
}

// v = zigzag(key(new) - key(old)) - 1, the difference taken as a signed W-bit integer.
template <class T>
SYNCD_HD uint64_t code_value(T ob, T nb, bool is_float) {
  using S = typename std::make_signed<T>::type;
  T d = T(to_key(nb, is_float) - to_key(ob, is_float));
  T u = T(T(d << 1) ^ T(S(d) >> (sizeof(T) * 8 - 1)));
  return uint64_t(u) - 1;
}

// The key delta coded by v, as a W-bit integer.
template <class T>
SYNCD_HD T value_delta(uint64_t v) {
  uint64_t u = v + 1;
  return T((u >> 1) ^ (uint64_t(0) - (u & 1)));
}

template <class T>
SYNCD_HD T apply_value(T ob, uint64_t v, bool is_float) {
  return from_key(T(to_key(ob, is_float) + value_delta<T>(v)), is_float);
}

template <class T>
SYNCD_HD T unapply_value(T nb, uint64_t v, bool is_float) {
  return from_key(T(to_key(nb, is_float) - value_delta<T>(v)), is_float);
}

}  // namespace core
}  // namespace syncd
