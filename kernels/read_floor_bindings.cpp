// Bindings of the read-bandwidth kernel (read_floor.cu), loaded by kldiv_inline.floors.
#include <torch/extension.h>

at::Tensor read_floor(const at::Tensor& buffer, int64_t unroll);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_floor", &read_floor,
        "read every byte of a contiguous CUDA buffer (16-byte multiple) once; one XOR word per block",
        py::arg("buffer"), py::arg("unroll") = 4);
}
