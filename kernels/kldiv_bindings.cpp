// Python bindings of the kit's kernels. Both backends (kldiv.cu for CUDA, kldiv_cpu.cpp for the CPU twin)
// implement these functions with the same semantics; the loader builds this file with one of them.
// Callers are in kldiv_inline/ops.py, which validates arguments and computes divisors first.
#include <torch/extension.h>

#include <vector>

// "cuda" or "cpu": which backend this module was built with.
const char* kl_backend();

// Loss of input (log-probabilities, or probabilities when from_probs) against target (probabilities, or
// log-probabilities when log_target), both of one floating dtype and device, broadcastable.
// reduce=false: returns {loss per element over the broadcast shape, undefined}.
// reduce=true:  returns {0-d sum / divisor, d(sum / divisor)/d input if want_grad else undefined}; the fused
//               gradient needs the input to have the broadcast shape. The 0-d result has the inputs' dtype, or
//               with wide=true float32 for 16-bit inputs (float64 for float64): a float16 sum beyond 65504 that
//               the caller divides itself (torch.compile's traced loss, whose divisor may be symbolic) stays finite.
std::vector<at::Tensor> kl_div_forward(const at::Tensor& input, const at::Tensor& target, bool reduce, double divisor,
                                       bool log_target, bool from_probs, bool want_grad, bool wide);

// Gradients of the loss w.r.t. input and/or target over the broadcast shape (undefined where not wanted).
// grad_out: one value (reduce=true, the loss was sum / divisor) or the broadcast shape (reduce=false).
std::vector<at::Tensor> kl_div_backward(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& target,
                                        bool reduce, double divisor, bool log_target, bool from_probs, bool want_input,
                                        bool want_target);

// grad *= grad_out (one value), skipped on the device when grad_out == 1.
void kl_div_scale_grad_(at::Tensor grad, const at::Tensor& grad_out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kldiv_inline kernels";
  m.def("backend", &kl_backend, "which backend this module holds: 'cuda' or 'cpu'");
  m.def("kl_div_forward", &kl_div_forward, "KL-divergence loss (see kernels/kldiv_bindings.cpp)", py::arg("input"),
        py::arg("target"), py::arg("reduce"), py::arg("divisor"), py::arg("log_target"), py::arg("from_probs"),
        py::arg("want_grad"), py::arg("wide") = false);
  m.def("kl_div_backward", &kl_div_backward, "gradients of the KL-divergence loss", py::arg("grad_out"),
        py::arg("input"), py::arg("target"), py::arg("reduce"), py::arg("divisor"), py::arg("log_target"),
        py::arg("from_probs"), py::arg("want_input"), py::arg("want_target"));
  m.def("kl_div_scale_grad_", &kl_div_scale_grad_, "grad *= grad_out unless grad_out == 1", py::arg("grad"),
        py::arg("grad_out"));
}
