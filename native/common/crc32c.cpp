// CRC32C kernels and their load-time choice; see crc32c.h.
#include "common/crc32c.h"

#include <nmmintrin.h>
#include <xmmintrin.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace offload::crc32c {
namespace {

constexpr std::uint32_t kPolynomial = 0x82F63B78u;  // reflected Castagnoli

// [Note: three-stream CRC32C]
// The crc32 instruction has a latency of 3 cycles and a throughput of one per cycle, so one
// dependent chain runs at a third of what the unit can do. A block of 3 * L bytes is split
// into three lanes whose CRCs are computed at once (lanes 1 and 2 from a zero register), then
// joined: the raw CRC register is linear, so crc(A || B) = shift_L(crc(A)) ^ crc(B) where
// shift_L advances a register over L zero bytes, itself linear in the register's 32 bits and
// so four 256-entry table lookups. kLongLane fills a 4 KiB page (3 * 1360 = 4080), the unit
// swap pages are checked in; kShortLane takes the tail of shorter buffers.
constexpr std::size_t kLongLane = 1360;
constexpr std::size_t kShortLane = 128;
// Blocks ahead that three_lanes prefetches (a prefetch past the buffer's end does not fault).
constexpr std::size_t kPrefetchBlocks = 1;

struct Tables {
  std::uint32_t slice[8][256];     // slicing-by-8: slice[k][b] = CRC of byte b then k zeros
  std::uint32_t long_shift[4][256];
  std::uint32_t short_shift[4][256];

  Tables() {
    for (std::uint32_t b = 0; b < 256; ++b) {
      std::uint32_t crc = b;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (kPolynomial & (0u - (crc & 1u)));
      slice[0][b] = crc;
    }
    for (int k = 1; k < 8; ++k) {
      for (int b = 0; b < 256; ++b) {
        slice[k][b] = (slice[k - 1][b] >> 8) ^ slice[0][slice[k - 1][b] & 0xff];
      }
    }
    fill_shift(long_shift, kLongLane);
    fill_shift(short_shift, kShortLane);
  }

  // table[k][b] = the register (b << 8k) advanced over num_zeros zero bytes.
  void fill_shift(std::uint32_t (&table)[4][256], std::size_t num_zeros) const {
    std::uint32_t bit_image[32];
    for (int bit = 0; bit < 32; ++bit) {
      std::uint32_t crc = 1u << bit;
      for (std::size_t i = 0; i < num_zeros; ++i) crc = (crc >> 8) ^ slice[0][crc & 0xff];
      bit_image[bit] = crc;
    }
    for (int k = 0; k < 4; ++k) {
      for (int b = 0; b < 256; ++b) {
        std::uint32_t image = 0;
        for (int bit = 0; bit < 8; ++bit) {
          if (b & (1 << bit)) image ^= bit_image[8 * k + bit];
        }
        table[k][b] = image;
      }
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

inline std::uint32_t shift(const std::uint32_t (&table)[4][256], std::uint32_t crc) {
  return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
         table[3][crc >> 24];
}

inline std::uint64_t load64(const unsigned char* p) {
  std::uint64_t word;
  std::memcpy(&word, p, sizeof(word));  // little-endian: x86 only reaches the sse42 kernel
  return word;
}

// The reference kernel: raw register in, raw register out (no inversions).
std::uint32_t raw_scalar(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  const Tables& t = tables();
  while (n && (reinterpret_cast<std::uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
    --n;
  }
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w = load64(p) ^ crc;
    crc = t.slice[7][w & 0xff] ^ t.slice[6][(w >> 8) & 0xff] ^ t.slice[5][(w >> 16) & 0xff] ^
          t.slice[4][(w >> 24) & 0xff] ^ t.slice[3][(w >> 32) & 0xff] ^
          t.slice[2][(w >> 40) & 0xff] ^ t.slice[1][(w >> 48) & 0xff] ^ t.slice[0][w >> 56];
  }
  while (n--) crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
  return crc;
}

// Three lanes of lane bytes from p (lane a multiple of 8); returns the joined register.
__attribute__((target("sse4.2"))) inline std::uint32_t three_lanes(
    std::uint32_t crc, const unsigned char* p, std::size_t lane,
    const std::uint32_t (&table)[4][256]) {
  std::uint64_t c0 = crc, c1 = 0, c2 = 0;
  const unsigned char* end = p + lane;
  for (; p + 64 <= end; p += 64) {
    // The next block's same line in each lane: a page checked after a DMA read comes from
    // DRAM, and the hardware prefetcher stops at every 4 KiB page.
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBlocks * 3 * lane), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBlocks * 3 * lane + lane), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBlocks * 3 * lane + 2 * lane), _MM_HINT_T0);
    for (int i = 0; i < 64; i += 8) {
      c0 = _mm_crc32_u64(c0, load64(p + i));
      c1 = _mm_crc32_u64(c1, load64(p + i + lane));
      c2 = _mm_crc32_u64(c2, load64(p + i + 2 * lane));
    }
  }
  for (; p < end; p += 8) {
    c0 = _mm_crc32_u64(c0, load64(p));
    c1 = _mm_crc32_u64(c1, load64(p + lane));
    c2 = _mm_crc32_u64(c2, load64(p + 2 * lane));
  }
  std::uint32_t joined = shift(table, static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1);
  return shift(table, joined) ^ static_cast<std::uint32_t>(c2);
}

__attribute__((target("sse4.2"))) std::uint32_t raw_sse42(std::uint32_t crc, const unsigned char* p,
                                                         std::size_t n) {
  const Tables& t = tables();
  while (n && (reinterpret_cast<std::uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  for (; n >= 3 * kLongLane; n -= 3 * kLongLane, p += 3 * kLongLane) {
    crc = three_lanes(crc, p, kLongLane, t.long_shift);
  }
  for (; n >= 3 * kShortLane; n -= 3 * kShortLane, p += 3 * kShortLane) {
    crc = three_lanes(crc, p, kShortLane, t.short_shift);
  }
  std::uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) c = _mm_crc32_u64(c, load64(p));
  crc = static_cast<std::uint32_t>(c);
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

// [Note: page CRCs from DRAM]
// A swap page is checked right after a DMA read put it in DRAM, so the page kernel is bound
// by how many cache misses it keeps in flight, not by the crc32 unit: one page at a time
// (three lanes inside it) ran at 3-7 GB/s from DRAM on the 2-core reference machine, where
// it runs at 20+ GB/s from cache and a plain read streams ~19 GB/s. Three whole pages at a
// time, each its own CRC (nothing to join), with the lines kPrefetchPages pages ahead in
// each stream prefetched, ran 1.5-2x faster in alternated runs on the busy machine and at
// 16 GB/s, 0.86x the plain read, in tools/bench_checksum.py (23 GB/s from cache).
constexpr std::size_t kPrefetchPages = 6;

__attribute__((target("sse4.2"))) void pages_sse42(const unsigned char* p, std::size_t n,
                                                   std::size_t page_bytes, std::uint32_t* out) {
  std::size_t done = 0;
  if (page_bytes % 64 == 0) {
    for (; n - done >= 3 * page_bytes; done += 3 * page_bytes, out += 3) {
      const unsigned char* a = p + done;
      const unsigned char* b = a + page_bytes;
      const unsigned char* c = b + page_bytes;
      std::uint64_t c0 = ~0u, c1 = ~0u, c2 = ~0u;
      for (std::size_t o = 0; o < page_bytes; o += 64) {
        const char* ahead = reinterpret_cast<const char*>(a + o + kPrefetchPages * page_bytes);
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + page_bytes, _MM_HINT_T0);
        _mm_prefetch(ahead + 2 * page_bytes, _MM_HINT_T0);
        for (std::size_t k = o; k < o + 64; k += 8) {
          c0 = _mm_crc32_u64(c0, load64(a + k));
          c1 = _mm_crc32_u64(c1, load64(b + k));
          c2 = _mm_crc32_u64(c2, load64(c + k));
        }
      }
      out[0] = ~static_cast<std::uint32_t>(c0);
      out[1] = ~static_cast<std::uint32_t>(c1);
      out[2] = ~static_cast<std::uint32_t>(c2);
    }
  }
  for (; done < n; done += page_bytes) {
    const std::size_t len = n - done < page_bytes ? n - done : page_bytes;
    *out++ = ~raw_sse42(~0u, p + done, len);
  }
}

void pages_scalar(const unsigned char* p, std::size_t n, std::size_t page_bytes, std::uint32_t* out) {
  for (std::size_t done = 0; done < n; done += page_bytes) {
    const std::size_t len = n - done < page_bytes ? n - done : page_bytes;
    *out++ = ~raw_scalar(~0u, p + done, len);
  }
}

using RawKernel = std::uint32_t (*)(std::uint32_t, const unsigned char*, std::size_t);
using PagesKernel = void (*)(const unsigned char*, std::size_t, std::size_t, std::uint32_t*);

enum class Isa : int { kScalar = 0, kSse42 = 1 };

const char* isa_name(Isa isa) { return isa == Isa::kSse42 ? "sse42" : "scalar"; }

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "sse42") return Isa::kSse42;
  throw std::invalid_argument("unknown CRC32C kernel '" + name + "'; the kernels are 'scalar', 'sse42'");
}

bool cpu_has(Isa isa) { return isa == Isa::kScalar || __builtin_cpu_supports("sse4.2"); }

// The load-time choice. An invalid OFFLOAD_CRC32C_ISA is remembered, not thrown here (a
// static initializer must not throw); selected_isa() reports it.
struct Selection {
  std::atomic<int> isa{static_cast<int>(Isa::kScalar)};
  std::string error;

  Selection() {
    tables();  // built now, not inside the first (timed) call
    if (cpu_has(Isa::kSse42)) isa = static_cast<int>(Isa::kSse42);
    const char* forced = std::getenv("OFFLOAD_CRC32C_ISA");
    if (forced == nullptr || *forced == '\0') return;
    try {
      const Isa wanted = parse_isa(forced);
      if (cpu_has(wanted)) {
        isa = static_cast<int>(wanted);
      } else {
        error = std::string("OFFLOAD_CRC32C_ISA=") + forced + ": this CPU cannot run it";
      }
    } catch (const std::invalid_argument& e) {
      error = std::string("OFFLOAD_CRC32C_ISA: ") + e.what();
    }
  }
};

Selection& selection() {
  static Selection s;
  return s;
}

bool use_sse42() {
  Selection& s = selection();
  if (!s.error.empty()) throw std::runtime_error(s.error);
  return static_cast<Isa>(s.isa.load(std::memory_order_relaxed)) == Isa::kSse42;
}

RawKernel kernel() { return use_sse42() ? raw_sse42 : raw_scalar; }
PagesKernel pages_kernel() { return use_sse42() ? pages_sse42 : pages_scalar; }

}  // namespace

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n) {
  return ~kernel()(~crc, static_cast<const unsigned char*>(data), n);
}

void crc32c_pages(const void* data, std::size_t n, std::size_t page_bytes, std::uint32_t* out) {
  if (page_bytes == 0) throw std::invalid_argument("page_bytes must be > 0");
  pages_kernel()(static_cast<const unsigned char*>(data), n, page_bytes, out);
}

long long crc32c_check_pages(const void* data, std::size_t n, std::size_t page_bytes,
                             const std::uint32_t* expected, const std::uint8_t* known) {
  if (page_bytes == 0) throw std::invalid_argument("page_bytes must be > 0");
  const PagesKernel k = pages_kernel();
  const auto* p = static_cast<const unsigned char*>(data);
  constexpr std::size_t kBatchPages = 48;  // a multiple of 3: the kernel's pages at a time
  std::uint32_t crcs[kBatchPages];
  const std::size_t num_pages = (n + page_bytes - 1) / page_bytes;
  for (std::size_t first = 0; first < num_pages; first += kBatchPages) {
    const std::size_t count = num_pages - first < kBatchPages ? num_pages - first : kBatchPages;
    const std::size_t offset = first * page_bytes;
    const std::size_t len = n - offset < count * page_bytes ? n - offset : count * page_bytes;
    k(p + offset, len, page_bytes, crcs);
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t page = first + i;
      if ((known == nullptr || known[page]) && crcs[i] != expected[page]) return static_cast<long long>(page);
    }
  }
  return -1;
}

std::string selected_isa() {
  Selection& s = selection();
  if (!s.error.empty()) throw std::runtime_error(s.error);
  return isa_name(static_cast<Isa>(s.isa.load()));
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (Isa isa : {Isa::kScalar, Isa::kSse42}) {
    if (cpu_has(isa)) names.emplace_back(isa_name(isa));
  }
  return names;
}

void set_isa(const std::string& name) {
  const Isa isa = parse_isa(name);
  if (!cpu_has(isa)) throw std::runtime_error("this CPU cannot run the '" + name + "' CRC32C kernel");
  Selection& s = selection();
  s.isa = static_cast<int>(isa);
  s.error.clear();
}

}  // namespace offload::crc32c
