// The hot loops of format 2's context blocks: the position rows of a block (one yes/no decision per element,
// with its class's probability), encoded backwards and decoded forwards. Portable scalar code, with AVX2 and
// AVX-512 versions for 16-bit dtypes chosen at run time (SYNCD_SIMD=scalar|avx2|avx512 caps the choice);
// every version writes and reads the same bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "binary_rans.h"
#include "block_v2.h"

namespace syncd {

// Encodes the rows of a block of `span` elements in reverse decode order into enc[0..gp): vector t
// (elements 16t..16t+15) goes to group t % gp. cls holds the class of every element (16 bytes of slack past
// span), p1 the probability per class (0: not coded), bm the change bitmap.
void encode_position_rows(const uint8_t* cls, uint64_t span, const uint32_t* p1, const uint64_t* bm,
                          BinGroupEncoder* enc, int gp);

// Decodes the rows of a block: the classes come from `cs` (old elements or nibbles) with `e_top`. Writes the
// block-relative position and the class of every change (ascending) and returns how many there were;
// throws DeltaError when there are more than n_max or a stream is short.
size_t decode_position_rows(const ClassSource& cs, const DTypeInfo& dt, int e_top, uint64_t span, const uint32_t* p1,
                            BinGroupDecoder* dec, int gp, uint32_t* pos, uint8_t* cls_ch, size_t n_max,
                            const std::string& what);

// The SIMD level in use: "avx512", "avx2" or "scalar".
const char* binary_rans_simd_level();

}  // namespace syncd
