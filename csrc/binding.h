// How a kernel's .cpp adds its functions to the pybind11 module `sparsecomm._C`.
//
// Each kernel file ends with its own binder:
//
//   SPARSECOMM_BIND(gather) {
//     m.def("gather_rows", [](uintptr_t table, ...) {
//       py::gil_scoped_release release;  // communication threads keep going while the kernel runs
//       gather_rows(ptr(table), ...);
//     }, py::arg("table"), ...);
//   }
//
// The macro defines a function of `pybind11::module_& m` and registers it, during static initialisation,
// in a list that bindings.cpp's PYBIND11_MODULE walks: a new kernel file binds itself, with no edit of a
// central file. Arguments are raw addresses (torch's data_ptr(), as uintptr_t) and dtype codes, so the
// module never links libtorch; Python validates the buffers and the kernels bounds-check ids again.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // in every binding file alike: the std::vector casters must not differ between them

#include <cstdint>
#include <vector>

namespace sparsecomm {

namespace py = pybind11;

// A binder adds one kernel file's functions and classes to the module.
using Binder = void (*)(py::module_& m);

struct NamedBinder {
  const char* name;  // the SPARSECOMM_BIND name: binders run in name order, each name once
  Binder bind;
};

// Every binder registered so far. A function-local static, so that it exists before the first registration
// whatever order the translation units are initialised in.
inline std::vector<NamedBinder>& binders() {
  static std::vector<NamedBinder> list;
  return list;
}

struct BinderRegistration {
  BinderRegistration(const char* name, Binder bind) { binders().push_back({name, bind}); }
};

// A kernel argument that Python passes as an address.
template <typename T = void>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace sparsecomm

#define SPARSECOMM_BIND(name)                                                                           \
  static void sparsecomm_bind_##name(::sparsecomm::py::module_& m);                                     \
  static const ::sparsecomm::BinderRegistration sparsecomm_binder_##name(#name, &sparsecomm_bind_##name); \
  static void sparsecomm_bind_##name(::sparsecomm::py::module_& m)
