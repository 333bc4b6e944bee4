#include "binary_rans_simd.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace syncd {

namespace {

inline uint32_t lane_bits(const uint64_t* bm, uint64_t t) { return uint32_t(bm[t >> 2] >> (16 * (t & 3))) & 0xFFFF; }

void scalar_encode_rows(const uint8_t* cls, uint64_t span, const uint32_t* p1, const uint64_t* bm,
                        BinGroupEncoder* enc, int gp) {
  const uint64_t vectors = (span + kLanes - 1) / kLanes;
  for (uint64_t t = vectors; t-- > 0;) {
    const uint64_t lo = t * kLanes;
    const int live = int(std::min<uint64_t>(kLanes, span - lo));
    uint32_t pl[kLanes], coded = 0;
    for (int l = 0; l < kLanes; ++l) {
      pl[l] = p1[cls[lo + l]];
      coded |= uint32_t(l < live && pl[l] != 0) << l;
    }
    if (coded) enc[t % gp].put_row(coded, pl, lane_bits(bm, t) & coded);
  }
}

size_t scalar_decode_rows(const ClassSource& cs, const DTypeInfo& dt, int e_top, uint64_t span, const uint32_t* p1,
                          BinGroupDecoder* dec, int gp, uint32_t* pos, uint8_t* cls_ch, size_t n_max,
                          const std::string& what) {
  const uint64_t vectors = (span + kLanes - 1) / kLanes;
  size_t k = 0;
  uint8_t cls[kLanes];
  for (uint64_t t = 0; t < vectors; ++t) {
    const uint64_t lo = t * kLanes;
    const int live = int(std::min<uint64_t>(kLanes, span - lo));
    block_classes(cs, dt, e_top, lo, size_t(live), cls);
    uint32_t pl[kLanes], coded = 0;
    for (int l = 0; l < live; ++l) {
      pl[l] = p1[cls[l]];
      coded |= uint32_t(pl[l] != 0) << l;
    }
    if (!coded) continue;
    uint32_t bits = dec[t % gp].row(coded, pl);
    if (size_t(__builtin_popcount(bits)) > n_max - k)
      throw DeltaError(what + ": more changes than the block table says");
    for (; bits; bits &= bits - 1) {
      const int l = __builtin_ctz(bits);
      pos[k] = uint32_t(lo + l);
      cls_ch[k++] = cls[l];
    }
  }
  return k;
}

}  // namespace

void encode_position_rows(const uint8_t* cls, uint64_t span, const uint32_t* p1, const uint64_t* bm,
                          BinGroupEncoder* enc, int gp) {
  scalar_encode_rows(cls, span, p1, bm, enc, gp);
}

size_t decode_position_rows(const ClassSource& cs, const DTypeInfo& dt, int e_top, uint64_t span, const uint32_t* p1,
                            BinGroupDecoder* dec, int gp, uint32_t* pos, uint8_t* cls_ch, size_t n_max,
                            const std::string& what) {
  return scalar_decode_rows(cs, dt, e_top, span, p1, dec, gp, pos, cls_ch, n_max, what);
}

const char* binary_rans_simd_level() { return "scalar"; }

}  // namespace syncd
