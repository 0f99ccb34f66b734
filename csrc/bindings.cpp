// pybind11 module `sparsecomm._C`: every kernel file's binder, plus what belongs to no kernel.
//
// Each csrc/<op>.cpp binds its own functions with SPARSECOMM_BIND (binding.h): a new kernel needs no edit
// here. The binders run in name order, so the module's contents do not depend on the link order.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "binding.h"
#include "common.h"

using namespace sparsecomm;

PYBIND11_MODULE(_C, m) {
  m.doc() = "sparsecomm CPU row kernels (C++/OpenMP)";

  std::vector<NamedBinder> list = binders();
  std::sort(list.begin(), list.end(),
            [](const NamedBinder& a, const NamedBinder& b) { return std::strcmp(a.name, b.name) < 0; });
  for (size_t i = 0; i < list.size(); ++i) {
    if (i > 0 && std::strcmp(list[i - 1].name, list[i].name) == 0)
      throw std::logic_error(std::string("sparsecomm: two binders named ") + list[i].name);
    list[i].bind(m);
  }

  m.def("advise_huge_pages", [](uintptr_t data, int64_t bytes) { advise_huge_pages(ptr(data), static_cast<size_t>(bytes)); },
        py::arg("data"), py::arg("bytes"),
        "Ask for transparent huge pages over the 2 MiB-aligned interior of [data, data + bytes) (>= 4 MiB; Linux).");

  m.def("openmp_enabled", [] {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
}
