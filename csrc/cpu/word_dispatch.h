// Calls a generic lambda with the unsigned integer type of a word width, so one template serves every dtype.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace syncd {

// f(T{}) with T the unsigned integer of `bytes` bytes (1, 2, 4 or 8); std::invalid_argument otherwise.
template <class F>
auto by_word_bytes(int bytes, F&& f) {
  switch (bytes) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
    default: throw std::invalid_argument("word width must be 1, 2, 4 or 8 bytes, not " + std::to_string(bytes));
  }
}

}  // namespace syncd
