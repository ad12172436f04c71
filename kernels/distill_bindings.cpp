// Python bindings of the distillation kernels (distill_api.h declares and describes the functions). The loader
// builds this file with one backend (distill.cu for CUDA, distill_cpu.cpp for the CPU twin).
#include <torch/extension.h>

#include "distill_api.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kldiv_inline distillation kernels";
  m.def("backend", &distill_backend, "which backend this module holds: 'cuda' or 'cpu'");
  m.def("distill_forward", &distill_forward, "divergence of student and teacher logits (see distill_api.h)",
        py::arg("student"), py::arg("teacher"), py::arg("topk_idx"), py::arg("topk_lp"), py::arg("labels"),
        py::arg("ignore_index"), py::arg("beta"), py::arg("temperature"), py::arg("reduction"), py::arg("want_student"),
        py::arg("want_teacher"), py::arg("grad_student_out") = py::none(), py::arg("scale") = py::none(),
        py::arg("loss_scale") = 1.0);
  m.def("distill_phase", &distill_phase, "one phase of a vocabulary-parallel divergence", py::arg("phase"),
        py::arg("student"), py::arg("teacher"), py::arg("labels"), py::arg("ignore_index"), py::arg("beta"),
        py::arg("temperature"), py::arg("norms"), py::arg("ksums"), py::arg("scale"), py::arg("want_student"),
        py::arg("want_teacher"), py::arg("grad_student_out") = py::none());
  m.def("distill_combine", &distill_combine, "the ranks' gathered per-row statistics combined in rank order",
        py::arg("parts"), py::arg("reduction"), py::arg("scale") = py::none());
  m.def("distill_peer_alloc", &distill_peer_alloc, "a zeroed peer buffer: its IPC handle and address", py::arg("world"),
        py::arg("cap"), py::arg("device"));
  m.def("distill_peer_map", &distill_peer_map, "another process's peer buffer mapped here (0: cannot)",
        py::arg("handle"), py::arg("device"));
  m.def("distill_peer_terms", &distill_peer_terms,
        "a split's phases 0 and 1 and its rows' statistics, exchanged in peer memory", py::arg("student"),
        py::arg("teacher"), py::arg("labels"), py::arg("ignore_index"), py::arg("beta"), py::arg("temperature"),
        py::arg("reduction"), py::arg("scale"), py::arg("want_student"), py::arg("want_teacher"),
        py::arg("grad_student_out"), py::arg("peers"), py::arg("epoch"), py::arg("rank"), py::arg("cap"));
  m.def("distill_reduction_scale", &distill_reduction_scale, "a reduction's divisor's reciprocal, on the device",
        py::arg("rows"), py::arg("labels"), py::arg("ignore_index"), py::arg("reduction"), py::arg("factor") = 1.0);
  m.def("distill_in_place_ok", &distill_in_place_ok, "whether d logits may be written over the logits",
        py::arg("vocab"), py::arg("element_size"), py::arg("topk"));
  m.def("distill_topk_prepare", &distill_topk_prepare, "a top-k teacher normalised, with its checks' flags",
        py::arg("idx"), py::arg("lp"), py::arg("vocab"), py::arg("labels"), py::arg("ignore_index"),
        py::arg("slack_log"), py::arg("flags_out") = py::none());
  m.def("distill_topk_slice", &distill_topk_slice, "a split top-k teacher: this slice's members and tail mass",
        py::arg("student"), py::arg("norms"), py::arg("idx"), py::arg("offset"), py::arg("temperature"));
  m.def("distill_topk_slice_grad", &distill_topk_slice_grad, "a split top-k teacher: this slice's gradient",
        py::arg("student"), py::arg("norms"), py::arg("idx"), py::arg("offset"), py::arg("temperature"),
        py::arg("g_buckets"), py::arg("whole"), py::arg("has_tail"), py::arg("labels"), py::arg("ignore_index"),
        py::arg("scale"));
  m.def("distill_scale_grad_", &distill_scale_grad_, "grad *= grad_out per row, skipping factors of 1", py::arg("grad"),
        py::arg("grad_out"));
}
