#include "delta_format.h"

#include "checksum.h"

namespace syncd {

namespace {

uint64_t rd64(const uint8_t* p) { return load_le64(p); }
uint32_t rd32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
void wr64(std::vector<uint8_t>& o, uint64_t v) {
  for (int i = 0; i < 8; ++i) o.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void wr32(std::vector<uint8_t>& o, uint32_t v) {
  for (int i = 0; i < 4; ++i) o.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
[[noreturn]] void bad(const std::string& m) { throw DeltaError(m); }
std::string shape_str(const std::vector<uint64_t>& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += std::to_string(s[i]) + (s.size() == 1 ? "," : (i + 1 < s.size() ? ", " : ""));
  return r + ")";
}

}  // namespace

DTypeInfo dtype_info(int code) {
  switch (code) {
    case 1: return {1, 16, true, 7, 8};     // bfloat16
    case 2: return {2, 16, true, 10, 5};    // float16
    case 3: return {3, 32, true, 23, 8};    // float32
    case 4: return {4, 8, true, 3, 4};      // float8_e4m3fn
    case 5: return {5, 8, true, 2, 5};      // float8_e5m2
    case 6: return {6, 8, false, 0, 0};     // uint8
    case 7: return {7, 8, false, 0, 0};     // int8
    case 8: return {8, 16, false, 0, 0};    // int16
    case 9: return {9, 32, false, 0, 0};    // int32
    case 10: return {10, 64, true, 52, 11};  // float64
    case 11: return {11, 64, false, 0, 0};  // int64
    case 12: return {12, 8, false, 0, 0};   // bool
    default: bad("corrupt header: unknown dtype code " + std::to_string(code));
  }
}

size_t header_size(size_t ndim, size_t n_blocks) { return kHeaderFixed + 8 * ndim + kBlockEntry * n_blocks + 8; }

uint64_t blocks_for(uint64_t numel, int block_log2) { return (numel + (uint64_t(1) << block_log2) - 1) >> block_log2; }

Header parse_header(const uint8_t* b, size_t n) {
  if (n < kHeaderFixed)
    bad("blob truncated: " + std::to_string(n) + " bytes, shorter than the 48-byte header");
  if (std::memcmp(b, "SYDL", 4) != 0) bad("not a syncd delta blob: bad magic");
  uint16_t version = uint16_t(b[4] | b[5] << 8);
  if (version < kMinFormat || version > kMaxFormat)
    bad("unsupported delta format version " + std::to_string(version) + " (this build reads 1, 2)");
  Header h;
  h.version = version;
  h.dtype = dtype_info(b[6]);
  size_t ndim = b[7];
  if (ndim > kMaxNdim) bad("corrupt header: rank " + std::to_string(ndim) + " exceeds 8");
  h.numel = rd64(b + 8);
  h.block_log2 = b[16];
  if (h.block_log2 < kMinBlockLog2 || h.block_log2 > kMaxBlockLog2)
    bad("corrupt header: block size 2**" + std::to_string(h.block_log2) + " outside 2**8..2**26");
  if (h.numel > kMaxNumel) bad("corrupt header: " + std::to_string(h.numel) + " elements exceeds the limit");
  uint64_t n_blocks = rd32(b + 20);
  uint64_t expect = blocks_for(h.numel, h.block_log2);
  if (n_blocks != expect)
    bad("corrupt header: " + std::to_string(n_blocks) + " blocks, expected " + std::to_string(expect));
  h.n_changed = rd64(b + 24);
  h.base_checksum = rd64(b + 32);
  h.new_checksum = rd64(b + 40);
  size_t hsize = header_size(ndim, n_blocks);
  if (n < hsize) bad("blob truncated: " + std::to_string(n) + " bytes, shorter than its " + std::to_string(hsize) + "-byte header and block table");
  uint64_t stored = rd64(b + hsize - 8);
  if (checksum_finalize(checksum_raw_range(b, 0, hsize - 8), hsize - 8) != stored) bad("corrupt header: header checksum mismatch");
  unsigned __int128 prod = 1;
  for (size_t i = 0; i < ndim; ++i) {
    uint64_t d = rd64(b + kHeaderFixed + 8 * i);
    h.shape.push_back(d);
    prod *= d;
    if (prod > kMaxNumel) prod = kMaxNumel + 1;  // saturate; compared below
  }
  if (prod != h.numel) bad("corrupt header: shape " + shape_str(h.shape) + " does not hold " + std::to_string(h.numel) + " elements");
  size_t off = kHeaderFixed + 8 * ndim;
  uint64_t total = hsize, count = 0;
  h.blocks.resize(n_blocks);
  h.payload_offset.resize(n_blocks);
  for (size_t i = 0; i < n_blocks; ++i) {
    const uint8_t* e = b + off + kBlockEntry * i;
    BlockEntry be{rd32(e), rd32(e + 4), rd64(e + 8)};
    if (be.n_changed > h.block_span(i))
      bad("corrupt header: block " + std::to_string(i) + " claims " + std::to_string(be.n_changed) + " changes in " + std::to_string(h.block_span(i)) + " elements");
    if ((be.n_changed == 0) != (be.payload_bytes == 0))
      bad("corrupt header: block " + std::to_string(i) + " has " + std::to_string(be.n_changed) + " changes but a " + std::to_string(be.payload_bytes) + "-byte payload");
    h.blocks[i] = be;
    h.payload_offset[i] = total;
    total += be.payload_bytes;
    count += be.n_changed;
  }
  if (count != h.n_changed) bad("corrupt header: blocks hold " + std::to_string(count) + " changes, header says " + std::to_string(h.n_changed));
  if (total != n) bad(std::string("blob ") + (total > n ? "truncated" : "has trailing bytes") + ": " + std::to_string(n) + " bytes, header and payloads need " + std::to_string(total));
  h.header_bytes = hsize;
  return h;
}

void check_target(const Header& h, int dtype_code, const std::vector<uint64_t>& shape) {
  if (h.dtype.code != dtype_code)
    bad("blob is for dtype code " + std::to_string(h.dtype.code) + ", target has dtype code " + std::to_string(dtype_code));
  if (h.shape != shape) bad("blob is for shape " + shape_str(h.shape) + ", target has shape " + shape_str(shape));
}

std::vector<uint8_t> pack_header(const DTypeInfo& dt, const std::vector<uint64_t>& shape, int block_log2,
                                 const std::vector<BlockEntry>& blocks, uint64_t base_checksum, uint64_t new_checksum,
                                 int version) {
  uint64_t numel = 1, nchg = 0;
  for (uint64_t d : shape) numel *= d;
  for (const auto& e : blocks) nchg += e.n_changed;
  std::vector<uint8_t> o;
  o.reserve(header_size(shape.size(), blocks.size()));
  o.insert(o.end(), {'S', 'Y', 'D', 'L'});
  o.push_back(static_cast<uint8_t>(version & 0xFF));
  o.push_back(static_cast<uint8_t>(version >> 8));
  o.push_back(static_cast<uint8_t>(dt.code));
  o.push_back(static_cast<uint8_t>(shape.size()));
  wr64(o, numel);
  o.push_back(static_cast<uint8_t>(block_log2));
  o.insert(o.end(), {0, 0, 0});
  wr32(o, static_cast<uint32_t>(blocks.size()));
  wr64(o, nchg);
  wr64(o, base_checksum);
  wr64(o, new_checksum);
  for (uint64_t d : shape) wr64(o, d);
  for (const auto& e : blocks) {
    wr32(o, e.payload_bytes);
    wr32(o, e.n_changed);
    wr64(o, e.payload_checksum);
  }
  uint64_t ck = checksum_finalize(checksum_raw_range(o.data(), 0, o.size()), o.size());
  wr64(o, ck);
  return o;
}

}  // namespace syncd
