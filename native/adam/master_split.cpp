// [Note: split master] An fp32 master weight stored as two 16-bit halves: the high half is
// the bf16 compute copy, the low half the master's low 16 bits. The high half is the
// master rounded half away from zero (add 0x8000 to the bits, keep the top 16): every bf16
// value then stands for exactly 65536 fp32 bit patterns, so (high, low) gives the master
// back bit for bit. Rounding to nearest even cannot: at an exact tie it maps 65537
// patterns to one even value. The two roundings differ only at exact ties (a master whose
// low half is 0x8000), by one bf16 ulp. A NaN master gets a quiet-NaN high half and comes
// back as a NaN (its payload may differ).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "adam/adam.h"

namespace offload::adam {

void split_master(const float* master, std::uint16_t* high, std::uint16_t* low, std::size_t numel) {
  for (std::size_t i = 0; i < numel; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &master[i], sizeof bits);
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    const std::uint16_t rounded = static_cast<std::uint16_t>((bits + 0x8000u) >> 16);
    high[i] = nan ? static_cast<std::uint16_t>((bits >> 16) | 0x0040u) : rounded;
    low[i] = static_cast<std::uint16_t>(bits);
  }
}

void join_master(const std::uint16_t* high, const std::uint16_t* low, float* master, std::size_t numel) {
  for (std::size_t i = 0; i < numel; ++i) {
    const std::uint32_t l = low[i];
    // a low half >= 0x8000 was rounded up into the high half: take that carry back
    const std::uint32_t bits = (std::uint32_t{high[i]} << 16) + l - ((l & 0x8000u) << 1);
    std::memcpy(&master[i], &bits, sizeof bits);
  }
}

}  // namespace offload::adam
