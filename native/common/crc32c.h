// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of swap pages
// (offload/io/checksum.py, [Note: swap checksums] there).
//
// Two kernels compute the same function: a scalar slicing-by-8 table kernel, always built,
// and one on SSE4.2's crc32 instruction, three independent streams interleaved so that its
// 3-cycle latency is hidden, their CRCs joined with precomputed shift tables. The kernel is
// chosen once at load time from CPUID; OFFLOAD_CRC32C_ISA=scalar|sse42 forces one (tests
// compare the two on the same buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace offload::crc32c {

// The CRC32C of n bytes at data, continuing from crc (0 for a new message): crc32c of
// "123456789" from 0 is 0xE3069283.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t n);

// out[i] = crc32c(0, page i) for each page_bytes-sized page of data (the last one may be
// shorter): ceil(n / page_bytes) values.
void crc32c_pages(const void* data, std::size_t n, std::size_t page_bytes, std::uint32_t* out);

// The first page i of data (paged as crc32c_pages does) with known[i] != 0 (known may be
// null: every page) whose CRC32C differs from expected[i], or -1 when none does.
long long crc32c_check_pages(const void* data, std::size_t n, std::size_t page_bytes,
                             const std::uint32_t* expected, const std::uint8_t* known);

// The kernel in use ("sse42" or "scalar"), those this CPU can run, and a switch for tests
// and benchmarks. selected_isa() throws std::runtime_error for an invalid OFFLOAD_CRC32C_ISA;
// set_isa() std::invalid_argument for an unknown name, std::runtime_error for one this CPU
// cannot run.
std::string selected_isa();
std::vector<std::string> available_isas();
void set_isa(const std::string& name);

}  // namespace offload::crc32c
