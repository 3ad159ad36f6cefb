// Op registration for the ulysses_kernels CUDA extension.
//
// The library namespace is defined here once (TORCH_LIBRARY); every other file adds its
// ops with TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL so each kernel stays in its own
// file. Fake (meta) implementations live in Python (ulysses_kernels/fused/ops.py), which
// keeps shape logic next to the reference path it must agree with.
// Only <torch/library.h> and <Python.h>: <torch/extension.h> (pybind11 and all of ATen)
// is the slowest header to compile, and nothing here needs it.
#include <Python.h>
#include <torch/library.h>

#include <cuda.h>
#include <nccl.h>

#include <string>

namespace ulysses_kernels {

// Versions this binary was compiled against: doctor compares them with the runtime ones.
std::string build_info() {
  std::string info = "cuda=" + std::to_string(CUDA_VERSION / 1000) + "." +
                     std::to_string((CUDA_VERSION % 1000) / 10);
  info += " nccl=" + std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
          std::to_string(NCCL_PATCH);
  return info;
}

}  // namespace ulysses_kernels

TORCH_LIBRARY(ulysses_kernels, m) {
  m.def("build_info() -> str", &ulysses_kernels::build_info);
}

// An empty Python module so `import ulysses_kernels._C` loads the library and runs the
// registrations above; all functionality is reached through torch.ops.ulysses_kernels.
// The init function is named after TORCH_EXTENSION_NAME (setup.py: ulysses_kernels._C).
#define UK_CONCAT_(a, b) a##b
#define UK_CONCAT(a, b) UK_CONCAT_(a, b)
#define UK_STRING_(a) #a
#define UK_STRING(a) UK_STRING_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, UK_STRING(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};

PyMODINIT_FUNC UK_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&module_def); }
