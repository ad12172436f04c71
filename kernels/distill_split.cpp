// A vocabulary split's step (distill_split, declared in distill_api.h) for both backends: the phases of
// distill_phase, the combinations of distill_combine and PyTorch's functional all-gathers, one after another
// without returning to Python. The same sequence from Python cost more host time than the GPU's kernels took
// (two H200s: 0.75 ms of host time a step against 0.60 ms of kernels, each module call and each
// torch.distributed collective ~15-80 us of Python around it; kernels/NOTES.md, version 15), so the step waited
// on its host.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "distill_api.h"

namespace distill_split_step {

enum : int64_t { kNorms = 0, kTerms = 1, kGrad = 2 };  // distill_phase's phases

// x [n, w] from every rank of the group -> [world, n, w], rank r's at index r: PyTorch's functional
// all_gather_into_tensor (the group's backend: NCCL on the current stream, gloo on the CPU), then its wait_tensor
// (for NCCL, the current stream waits; the host does not). Called through the dispatcher by name, which is what
// torch.distributed's Python functions reach too.
at::Tensor all_gather_rows(const at::Tensor& x, int64_t world, const std::string& group_name) {
  static const c10::OperatorHandle gather =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_gather_into_tensor", "");
  static const c10::OperatorHandle wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  torch::jit::Stack stack{c10::IValue(x.contiguous()), c10::IValue(world), c10::IValue(group_name)};
  gather.callBoxed(&stack);
  at::Tensor out = stack.at(0).toTensor();
  stack.assign({c10::IValue(out)});
  wait.callBoxed(&stack);
  return out.view({world, x.size(0), x.size(1)});
}

}  // namespace distill_split_step

std::vector<at::Tensor> distill_split(const at::Tensor& student, const at::Tensor& teacher,
                                      const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                      double temperature, const c10::optional<at::Tensor>& scale, int64_t reduction,
                                      bool want_student, bool want_teacher,
                                      const c10::optional<at::Tensor>& grad_student_out, int64_t world,
                                      const std::string& group_name) {
  namespace step = distill_split_step;
  TORCH_CHECK(world >= 1, "distill_split: the group must have at least one rank, got ", world);
  TORCH_CHECK(student.dim() == 2, "distill_split: expected rows [n, v_local] of logits");
  const at::Tensor sc = scale.has_value() ? *scale : distill_reduction_scale(student, labels, ignore_index, reduction);
  // phase 0: this slice's normalisers; gathered, the rows' global ones (the same bits on every rank).
  const at::Tensor local = distill_phase(step::kNorms, student, teacher, labels, ignore_index, beta, temperature,
                                         c10::nullopt, c10::nullopt, c10::nullopt, false, false, c10::nullopt)[0];
  const at::Tensor norms = distill_combine(step::all_gather_rows(local, world, group_name), 0, c10::nullopt)[0];
  // phase 1: this slice's (loss, ks, kt) and the gradients that need no row sums; gathered, the rows' sums and the
  // loss.
  std::vector<at::Tensor> ph1 = distill_phase(step::kTerms, student, teacher, labels, ignore_index, beta, temperature,
                                              norms, c10::nullopt, sc, want_student, want_teacher, grad_student_out);
  const std::vector<at::Tensor> combined =
      distill_combine(step::all_gather_rows(ph1[0], world, group_name), reduction, sc);
  at::Tensor gs = ph1[1], gt = ph1[2];
  // phase 2, where a wanted gradient needs the rows' K sums: the student's unless forward KL, the teacher's
  // unless reverse KL.
  if ((want_student && beta != 0.0) || (want_teacher && beta != 1.0)) {
    const std::vector<at::Tensor> ph2 =
        distill_phase(step::kGrad, student, teacher, labels, ignore_index, beta, temperature, norms, combined[0], sc,
                      want_student, want_teacher, grad_student_out);
    if (!gs.defined()) gs = ph2[1];
    if (!gt.defined()) gt = ph2[2];
  }
  return {combined[1], gs, gt};
}
