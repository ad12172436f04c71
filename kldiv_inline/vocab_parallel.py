"""The distillation divergence when the vocabulary is split across the ranks of a torch.distributed group
(Megatron-LM's column-parallel LM head): ``generalized_jsd(..., group=group)`` lands here.

Each rank holds a contiguous slice of every token's logits (rank r holds the r-th slice; slices may differ in
width), student and teacher sliced alike; labels are global. Every rank returns the same loss, the unsharded
one, and gets the gradients of its own slice. Per call, only a few floats per token cross the group:

    phase 0 (kernel): each rank's normalisers of its slice, (max, log2 sum 2^(x - max)) of student and teacher
    all_gather [n, 4] -> the rows' global normalisers, combined in rank order (combine_norms)
    phase 1 (kernel): each rank's partial (loss, ks, kt) of its slice, and the gradients that need no row sum
                      (the student's for forward KL, the teacher's for reverse KL)
    all_gather [n, 3] -> the rows' losses and K sums, summed in rank order
    phase 2 (kernel, only where needed): the remaining gradients, which need the rows' K sums

All-gathers rather than all-reduces: every rank then adds the same numbers in the same order, so the loss and
the K sums are bit-identical on every rank and from run to run, whatever the backend's reduction order. The
collectives run on the current stream (NCCL on GPUs, gloo on CPUs) and nothing waits for the host: batchmean's
divisor is counted from the labels on the device. As in the one-device op, the forward pass writes the
gradients (of the reduced loss) and backward only rescales them by grad_output, with no communication.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import distill

__all__ = ["generalized_jsd_vocab_parallel", "divergence_rows", "combine_norms", "group_name", "resolve_group"]


# One collective into one tensor: all_gather_single where torch has it (it deprecates all_gather_into_tensor).
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather(x: Tensor, group) -> Tensor:
    """[n, w] on every rank -> [world, n, w], rank r's tensor at index r."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))  # the concatenated form: gloo's only one
    _GATHER_INTO(out, x.contiguous(), group=group)
    return out.view((world,) + tuple(x.shape))


def combine_norms(parts: Tensor) -> Tensor:
    """The rows' normalisers over the whole vocabulary from each slice's, ``parts`` [world, n, 4] of
    (max, log2 sum 2^(x - max)) of student then teacher (base 2, distill_common.h's Norm): the largest max, and
    log2 sum_r 2^(lz_r + mx_r - max). Computed in float64, added in rank order, returned in ``parts``' dtype.
    A row without mass anywhere (masked: every slice's max is -inf) keeps (-inf, -inf); NaN propagates."""
    p = parts.double()
    mx, lz = p[..., 0::2], p[..., 1::2]  # [world, n, 2]: student, teacher
    top = mx.amax(dim=0)
    shift = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # -inf - -inf would be NaN
    total = torch.exp2(lz + mx - shift).sum(dim=0)
    out = torch.stack([top[:, 0], torch.log2(total[:, 0]), top[:, 1], torch.log2(total[:, 1])], dim=1)
    return out.to(parts.dtype)


def _grad_scale(labels: Tensor | None, ignore_index: int, n: int, reduction: int, device) -> Tensor:
    """The reduction's divisor's reciprocal as a 0-d float64 tensor on the device: 1 / unmasked tokens for
    batchmean (0 when none is), else 1. Counted on the device: no host synchronisation."""
    if reduction != distill._REDUCTION_CODE["batchmean"]:
        return torch.ones((), dtype=torch.float64, device=device)
    if labels is None:
        return torch.full((), 1.0 / n if n else 0.0, dtype=torch.float64, device=device)
    count = (labels != ignore_index).sum().double()
    return torch.where(count > 0, count.reciprocal(), torch.zeros_like(count))


def _needs_phase2(beta: float, want_s: bool, want_t: bool) -> bool:
    """Whether some wanted gradient needs the rows' K sums (the student's unless forward KL, the teacher's unless
    reverse KL)."""
    return (want_s and beta != 0.0) or (want_t and beta != 1.0)


def divergence_rows(student: Tensor, teacher: Tensor, labels: Tensor | None, ignore_index: int, beta: float,
                    temperature: float, group, scale: Tensor, want_s: bool, want_t: bool,
                    grad_student_out: Tensor | None = None):
    """The phases and their collectives over rows [n, v_local]: (each row's global loss [n], the student's and the
    teacher's gradients of this slice or None), the gradients of the rows' sum times ``scale`` (0-d float64 on
    the device), the student's written into ``grad_student_out`` when given."""
    mod = distill._module(student.device)
    common = (labels, ignore_index, beta, temperature)
    local_norms = mod.distill_phase(0, student, teacher, *common, None, None, None, False, False)[0]
    norms = combine_norms(_all_gather(local_norms, group))
    terms, gs, gt = mod.distill_phase(1, student, teacher, *common, norms, None, scale, want_s, want_t,
                                      grad_student_out)
    sums = _all_gather(terms, group).sum(dim=0)  # [n, 3]: the rows' loss, ks, kt, added in rank order
    if _needs_phase2(beta, want_s, want_t):
        _, gs2, gt2 = mod.distill_phase(2, student, teacher, *common, norms, sums[:, 1:].contiguous(), scale,
                                        want_s, want_t, grad_student_out)
        gs = gs if gs is not None else gs2
        gt = gt if gt is not None else gt2
    return sums[:, 0], gs, gt


def _run(student: Tensor, teacher: Tensor, labels: Tensor | None, ignore_index: int, beta: float,
         temperature: float, reduction: int, group, want_s: bool, want_t: bool):
    """The reduced loss and the gradients (of the reduced loss; for none, of the rows' sum), or None."""
    scale = _grad_scale(labels, ignore_index, student.shape[0], reduction, student.device)
    rows_loss, gs, gt = divergence_rows(student, teacher, labels, ignore_index, beta, temperature, group, scale,
                                        want_s, want_t)
    if reduction == distill._REDUCTION_CODE["none"]:
        return rows_loss, gs, gt
    # Summed in float64 like the one-device kernels, times the divisor's reciprocal (1 for sum).
    return (rows_loss.sum(dtype=torch.float64) * scale).to(rows_loss.dtype), gs, gt


class _VocabParallelDivergence(torch.autograd.Function):
    """Forward runs the phases with the wanted gradients; backward rescales them by grad_output (in place, the
    first time; a second backward, with retain_graph=True, runs the phases again, on every rank alike)."""

    @staticmethod
    def forward(ctx, student, teacher, labels, ignore_index, beta, temperature, reduction, group, want_s, want_t):
        loss, gs, gt = _run(student, teacher, labels, ignore_index, beta, temperature, reduction, group, want_s,
                            want_t)
        ctx.save_for_backward(student, teacher, labels)
        ctx.args = (ignore_index, beta, temperature, reduction, group)
        ctx.fused = (gs, gt)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return (None,) * 10
        if torch.is_grad_enabled():
            raise RuntimeError("generalized_jsd: double backward (create_graph=True) is not supported: its gradient "
                               "has no graph of its own, so a penalty on it would be silently dropped")
        student, teacher, labels = ctx.saved_tensors
        need_s, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gs, gt = ctx.fused
        if (need_s and gs is None) or (need_t and gt is None):  # a second backward: compute them again
            _, gs, gt = _run(student, teacher, labels, *ctx.args, need_s, need_t)
        ctx.fused = (None, None)  # rescaled in place below: a later backward recomputes
        grad_out = grad_out.to(distill._acc_dtype(student.dtype))
        out_s = distill._scaled(gs, grad_out, True) if need_s else None
        out_t = distill._scaled(gt, grad_out, True) if need_t else None
        return (out_s, out_t) + (None,) * 8


def _check_group(group, who: str = "generalized_jsd") -> None:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}: group must be a torch.distributed ProcessGroup, got {type(group).__name__}")


def group_name(group, who: str) -> str:
    """The name a custom op carries a process group by (as PyTorch's functional collectives do)."""
    _check_group(group, who)
    return group.group_name


def resolve_group(name: str):
    """The process group of ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(name)


def generalized_jsd_vocab_parallel(student_logits: Tensor, teacher_logits: Tensor | None, *, teacher_topk,
                                   beta: float, temperature: float, labels: Tensor | None, ignore_index: int,
                                   reduction: str, group) -> Tensor:
    """``generalized_jsd`` over a vocabulary split across ``group`` (see the module's docstring): the arguments
    are checked as there, the logits being this rank's slice. Every rank must call it with the same rows, labels
    and settings (a collective)."""
    _check_group(group)
    if teacher_topk is not None:
        raise NotImplementedError("generalized_jsd: teacher_topk with a vocabulary split across a group is not "
                                  "implemented yet; gather the student's logits or pass the teacher's logits")
    args, lead = distill._prepare(student_logits, teacher_logits, None, beta, temperature, labels, ignore_index,
                                  reduction)
    student, teacher, _, _, lab, ignore_index, beta, temperature, code = args
    grad_on = torch.is_grad_enabled()
    want_s = bool(grad_on and student.requires_grad)
    want_t = bool(grad_on and teacher.requires_grad)
    if want_s or want_t:
        loss = _VocabParallelDivergence.apply(student, teacher, lab, ignore_index, beta, temperature, code, group,
                                              want_s, want_t)
    else:
        loss = _run(student, teacher, lab, ignore_index, beta, temperature, code, group, False, False)[0]
    return loss.reshape(lead) if code == distill._REDUCTION_CODE["none"] else loss
