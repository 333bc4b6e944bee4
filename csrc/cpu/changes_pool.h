// Decoded-change buffers (BlockChanges) reused across apply calls.
//
// An apply of format 2 keeps every context block's decoded changes until the whole call has run (undo needs
// them once the old words are overwritten). Fresh buffers cost a page fault per 4 KiB on first touch: on a
// dense delta (30% changed words) that was a third of apply's CPU time, spent clearing pages in the kernel.
// Buffers given back are kept (up to a byte cap) and handed out again, so repeated applies touch warm pages.
#pragma once

#include <cstddef>
#include <memory>

#include "block_v2.h"

namespace syncd {

// Returns a buffer to the pool when its owner drops it.
struct GiveBackChanges {
  void operator()(BlockChanges* c) const;
};
using PooledChanges = std::unique_ptr<BlockChanges, GiveBackChanges>;

// A buffer from the pool (its capacity kept from its last use; reset() it before use), or a new one: the
// smallest holding want_bytes (a hint: the caller's block needs about that many), else the largest (which
// grows when reset). Thread-safe; O(buffers in the pool). Throws std::bad_alloc.
PooledChanges take_changes(size_t want_bytes);

// Bytes the pool keeps between calls at most (buffers beyond it are freed when given back).
constexpr size_t kChangesPoolKeepBytes = size_t(1) << 30;

// Bytes held by buffers now in the pool (for tests).
size_t changes_pool_bytes();

}  // namespace syncd
