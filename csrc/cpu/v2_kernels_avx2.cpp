// AVX2 versions of the 16-bit format-2 kernels (see v2_kernels.h). Placeholder: the scalar code.
#include "v2_kernels.h"

namespace syncd {
namespace avx2_16 {

size_t decode_positions(const Classes16& c, BinGroupDecoder* dec, int gp, uint16_t* bitmap, uint8_t* cls_ch,
                        size_t n_max, const std::string& what, uint64_t first_word, uint64_t* old_sum) {
  *old_sum = scalar16::checksum(c.old, c.span, first_word, 0);
  return scalar16::decode_positions(c, dec, gp, bitmap, cls_ch, n_max, what);
}
void encode_positions(const Classes16& c, const uint16_t* bitmap, BinGroupEncoder* enc, int gp) {
  scalar16::encode_positions(c, bitmap, enc, gp);
}
uint64_t scan(const Classes16& c, const uint16_t* nw, uint64_t first_word, bool is_float, uint16_t* bitmap,
              uint16_t* v16, uint8_t* cls_ch, uint64_t* sum_old, uint64_t* adj) {
  *sum_old = *adj = 0;
  return scalar16::scan(c, nw, first_word, is_float, bitmap, v16, cls_ch, sum_old, adj, 0, 0);
}
uint64_t apply(uint16_t* target, uint64_t span, uint64_t first_word, const uint16_t* bitmap, const uint16_t* v16,
               bool is_float, bool forward, const uint64_t*) {
  return scalar16::apply(target, span, first_word, bitmap, v16, is_float, forward, 0, 0);
}

}  // namespace avx2_16
}  // namespace syncd
