// Each area of the native core registers its Python functions from its own file, so the
// areas can change independently. Only native/bindings/ includes pybind11.
#pragma once

#include <pybind11/pybind11.h>

namespace offload::bindings {

void register_common(pybind11::module_& m);
void register_adam(pybind11::module_& m);
void register_io(pybind11::module_& m);
void register_checksum(pybind11::module_& m);
void register_compact(pybind11::module_& m);

}  // namespace offload::bindings
