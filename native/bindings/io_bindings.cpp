// Python face of the native I/O engine. offload/io/engine.py wraps these with argument checks
// and tensor handling; everything here takes raw addresses and releases the GIL while blocking.
#include <pybind11/stl.h>

#include <cstdint>
#include <system_error>

#include "bindings/registry.h"
#include "io/engine.h"

namespace py = pybind11;

namespace offload::bindings {
namespace {

[[noreturn]] void raise_os_error(int err, const std::string& message, const std::string& path) {
  // OSError(errno, strerror, filename) picks the subclass (FileNotFoundError, ...) itself.
  py::tuple args = py::make_tuple(err, message, path);
  PyErr_SetObject(PyExc_OSError, args.ptr());
  throw py::error_already_set();
}

}  // namespace

void register_io(py::module_& m) {
  using offload::io::Engine;
  using offload::io::Request;

  m.def("io_available_backends", &offload::io::compiled_backends,
        "I/O backends compiled into this build; which work is found by probing.");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      raise_os_error(e.code().value(), e.what(), "");
    }
  });

  py::class_<Request, std::shared_ptr<Request>>(m, "IORequest")
      .def("done", &Request::done)
      .def_property_readonly("started", &Request::started,
                             "time.perf_counter() seconds when the first block was issued (once done)")
      .def_property_readonly("finished", &Request::finished,
                             "time.perf_counter() seconds when the request finished (once done)")
      .def("wait", [](Request& r) {
        long long n;
        {
          py::gil_scoped_release release;
          n = r.wait();
        }
        if (n < 0) raise_os_error(r.error_code(), r.error_message(), r.path());
        return n;
      });

  py::class_<Engine>(m, "IOEngineCore")
      .def(py::init<const std::string&, std::size_t, unsigned, std::size_t>(),
           py::arg("backend"), py::arg("block_bytes"), py::arg("queue_depth"),
           py::arg("max_open_files"), py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          [](Engine& e, bool is_write, std::uintptr_t address, std::size_t nbytes,
             const std::string& path, std::uint64_t offset) {
            return e.submit(is_write, reinterpret_cast<void*>(address), nbytes, path, offset);
          },
          py::arg("is_write"), py::arg("address"), py::arg("nbytes"), py::arg("path"),
          py::arg("offset"), py::call_guard<py::gil_scoped_release>())
      .def("wait_all", &Engine::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("close_files", &Engine::close_files, py::call_guard<py::gil_scoped_release>())
      .def("hold_file", &Engine::hold_file, py::arg("path"), py::arg("fd"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_file", &Engine::release_file, py::arg("path"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_open_files", &Engine::num_open_files)
      .def_property_readonly("num_opens", &Engine::num_opens)
      .def_property_readonly("backend", &Engine::backend_name)
      .def_property_readonly("num_buffered_opens", &Engine::num_buffered_opens);
}

}  // namespace offload::bindings
