#include "changes_pool.h"

#include <mutex>
#include <vector>

namespace syncd {
namespace {

size_t capacity_bytes(const BlockChanges& c) {
  return c.bitmap.capacity() * sizeof(uint16_t) + c.cls.capacity() + c.v16.capacity() * sizeof(uint16_t) +
         c.v64.capacity() * sizeof(uint64_t) + c.rows.capacity() * sizeof(uint32_t) +
         c.row_words.capacity() * sizeof(uint16_t);
}

struct Pool {
  std::mutex m;
  std::vector<BlockChanges*> free;  // owned
  size_t bytes = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: buffers may be given back during static destruction
  return *p;
}

}  // namespace

void GiveBackChanges::operator()(BlockChanges* c) const {
  if (!c) return;
  const size_t b = capacity_bytes(*c);
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.m);
    if (p.bytes + b <= kChangesPoolKeepBytes) {
      try {
        p.free.push_back(c);
        p.bytes += b;
        return;
      } catch (...) {  // out of memory for the list: free the buffer instead
      }
    }
  }
  delete c;
}

PooledChanges take_changes(size_t want_bytes) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.m);
    if (!p.free.empty()) {  // the smallest that holds want_bytes, else the largest (it grows on reset)
      size_t best = 0, best_bytes = capacity_bytes(*p.free[0]);
      for (size_t i = 1; i < p.free.size(); ++i) {
        const size_t b = capacity_bytes(*p.free[i]);
        if (best_bytes >= want_bytes ? (b >= want_bytes && b < best_bytes) : b > best_bytes) best = i, best_bytes = b;
      }
      BlockChanges* c = p.free[best];
      p.free[best] = p.free.back();
      p.free.pop_back();
      p.bytes -= best_bytes;
      return PooledChanges(c);
    }
  }
  return PooledChanges(new BlockChanges);
}

size_t changes_pool_bytes() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.m);
  return p.bytes;
}

}  // namespace syncd
