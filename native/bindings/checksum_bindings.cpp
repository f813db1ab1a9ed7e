// Python face of the CRC32C kernels (native/common/crc32c.h); offload/io/checksum.py checks
// the buffers and keeps the tables. Raw addresses in, the GIL released while computing.
#include <pybind11/stl.h>

#include <cstdint>

#include "bindings/registry.h"
#include "common/crc32c.h"

namespace py = pybind11;

namespace offload::bindings {

void register_checksum(py::module_& m) {
  namespace crc = offload::crc32c;
  m.def(
      "crc32c",
      [](std::uintptr_t address, std::size_t nbytes, std::uint32_t crc) {
        return crc::crc32c(crc, reinterpret_cast<const void*>(address), nbytes);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "CRC32C of nbytes at address, continuing from crc. Releases the GIL.");
  m.def(
      "crc32c_pages",
      [](std::uintptr_t address, std::size_t nbytes, std::size_t page_bytes, std::uintptr_t out) {
        crc::crc32c_pages(reinterpret_cast<const void*>(address), nbytes, page_bytes,
                          reinterpret_cast<std::uint32_t*>(out));
      },
      py::arg("address"), py::arg("nbytes"), py::arg("page_bytes"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>(),
      "Writes the CRC32C of each page_bytes page of the buffer (ceil(nbytes / page_bytes) "
      "uint32) to out. Releases the GIL.");
  m.def(
      "crc32c_check_pages",
      [](std::uintptr_t address, std::size_t nbytes, std::size_t page_bytes, std::uintptr_t expected,
         std::uintptr_t known) {
        return crc::crc32c_check_pages(reinterpret_cast<const void*>(address), nbytes, page_bytes,
                                       reinterpret_cast<const std::uint32_t*>(expected),
                                       reinterpret_cast<const std::uint8_t*>(known));
      },
      py::arg("address"), py::arg("nbytes"), py::arg("page_bytes"), py::arg("expected"),
      py::arg("known") = 0, py::call_guard<py::gil_scoped_release>(),
      "The first page whose CRC32C differs from expected (uint32 per page), skipping pages "
      "whose known byte is 0 (known: 0 for none), or -1. Releases the GIL.");
  m.def("crc32c_selected_isa", &crc::selected_isa, "The CRC32C kernel in use.");
  m.def("crc32c_available_isas", &crc::available_isas, "CRC32C kernels this CPU can run.");
  m.def("crc32c_set_isa", &crc::set_isa, py::arg("name"), "Use the CRC32C kernel 'name'.");
}

}  // namespace offload::bindings
