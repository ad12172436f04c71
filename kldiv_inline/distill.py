"""Divergences of logits for distillation: forward KL, reverse KL and the generalized Jensen-Shannon divergence
between them, with a temperature, label masks and top-k teachers; one fused kernel forward and backward.

    loss = generalized_jsd(student_logits, teacher_logits, beta=0.0, temperature=2.0, labels=labels)
    loss = generalized_jsd(student_logits, teacher_topk=(indices, logprobs))   # a served teacher's top-k

The convention is TRL's (GKD trainer) and Liger-Kernel's: with s = log_softmax(student / T) and t =
log_softmax(teacher / T), beta = 0 is KL(teacher || student), beta = 1 is KL(student || teacher), and
0 < beta < 1 is beta KL(teacher || m) + (1 - beta) KL(student || m) with m = (1 - beta) p_s + beta p_t. No T^2
factor is applied (as TRL). The softmaxes are never materialised: the kernels (kernels/distill*.{cu,cpp}) read
each row of logits, form both log-normalisers, the divergence and its gradient in one pass on chip.

Training: when the student's (or the teacher's) logits require grad, the forward pass also writes
d loss / d logits (the reduced loss's), and backward only rescales it in place when grad_output != 1: one write
beyond the forward's reads, no extra pass, no host synchronisation. A constant factor known before the forward
(gradient accumulation's 1 / micro-batches) is ``loss_scale``: folded into the forward, so that backward has
nothing to rescale. float16 logits are the exception (``_fuses``): their gradient is computed in backward, with
grad_output folded in.
"""
from __future__ import annotations

import functools
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .loader import load
from .ops import batched_grad

__all__ = ["generalized_jsd", "GeneralizedJSDLoss", "REDUCTIONS"]

REDUCTIONS = ("batchmean", "sum", "none")
_REDUCTION_CODE = {"none": 0, "sum": 1, "batchmean": 2}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_MODULES: dict[str, object] = {}


def _module(device: torch.device):
    """The compiled distillation module for a device type, looked up once per process (see ops._module)."""
    mod = _MODULES.get(device.type)
    if mod is None:
        if device.type not in ("cuda", "cpu"):
            raise NotImplementedError(f"generalized_jsd: no kernels for {device.type!r} tensors (cpu and cuda only)")
        mod = _MODULES[device.type] = load(device.type, extension="distill")
    return mod


def reload() -> None:
    """Rebuild (if the kernel files changed) and use the current kernels for the next calls."""
    for backend in list(_MODULES):
        _MODULES[backend] = load(backend, extension="distill")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_if_none(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty((0,))


# ----------------------------------------------------------------------------------------- custom ops
def _fuses(dtype: torch.dtype) -> bool:
    """Whether the forward writes the gradient for backward to rescale by grad_output, or leaves it to backward,
    which then computes it with grad_output folded in (``_grad_impl``). float16 leaves it: its range cannot hold
    the unscaled gradient. An entry is ~p / tokens (1e-9 at a 128k vocabulary and 4096 tokens), below float16's
    smallest subnormal (6e-8) or among its few-digit subnormals, and a GradScaler's grad_output (65536, say)
    multiplied in afterwards cannot bring its digits back: at 32 x 50000 the median entry was 3.6% off and 90k of
    1.6M were 0, where one rounding at the final size is 2e-4 off and none 0. bfloat16 and float32 have float32's
    range: rescaling rounds once more, half a spacing. The cost for float16: its logits are read again in
    backward."""
    return dtype != torch.float16


def _forward_impl(student: Tensor, teacher: Tensor | None, topk_idx: Tensor | None, topk_lp: Tensor | None,
                labels: Tensor | None, ignore_index: int, beta: float, temperature: float, reduction: int,
                loss_scale: float, want_student: bool, want_teacher: bool) -> tuple[Tensor, Tensor, Tensor]:
    fuse = _fuses(student.dtype)
    loss, gs, gt = _module(student.device).distill_forward(student, teacher, topk_idx, topk_lp, labels, ignore_index,
                                                           beta, temperature, reduction, want_student and fuse,
                                                           want_teacher and fuse, None, None, loss_scale)
    return loss, _empty_if_none(gs, student), _empty_if_none(gt, student)


_forward_op = torch.library.custom_op("kldiv_inline::distill_forward", mutates_args=())(_forward_impl)


def _grad_like_rows(student: Tensor) -> Tensor:
    """A new gradient for the student's rows [n, v] as distill_forward lays it out (grad_like_rows in
    kernels/distill_plan.h): row stride and storage offset those of the student modulo a 16-byte chunk, so that
    rows sliced out of a padded vocabulary get a gradient whose rows lie on the 16-byte grid as theirs do (and
    contiguous rows a contiguous one)."""
    n, v = student.shape
    vec = 16 // student.element_size()
    stride = v + (student.stride(0) - v) % vec if n > 1 else v
    head = student.storage_offset() % vec
    if n == 0 or (stride == v and head == 0):
        return student.new_empty((n, v))
    return student.new_empty((head + (n - 1) * stride + v,)).as_strided((n, v), (stride, 1), head)


@_forward_op.register_fake
def _(student, teacher, topk_idx, topk_lp, labels, ignore_index, beta, temperature, reduction, loss_scale,
      want_student, want_teacher):
    acc = _acc_dtype(student.dtype)
    loss = student.new_empty((student.shape[0],) if reduction == 0 else (), dtype=acc)
    fuse = _fuses(student.dtype)
    gs = _grad_like_rows(student) if want_student and fuse else student.new_empty((0,))
    gt = student.new_empty(student.shape) if want_teacher and fuse else student.new_empty((0,))
    return loss, gs, gt


def _grad_impl(student: Tensor, teacher: Tensor | None, topk_idx: Tensor | None, topk_lp: Tensor | None,
               labels: Tensor | None, ignore_index: int, beta: float, temperature: float, reduction: int,
               loss_scale: float, grad_out: Tensor, want_student: bool, want_teacher: bool) -> tuple[Tensor, Tensor]:
    """The gradients times grad_out (one value, or one per row for reduction none; float16's backward: see
    _fuses), computed with a scale on the device (no synchronisation). One value goes into the kernel's scale:
    each entry rounded once, at its final size. One per row: the kernel's scale is the smallest nonzero finite
    |grad_out|, but at least 1, and the rows are then multiplied by their factor over it (rounded a second time;
    an entry overflows only where its final value does, or where the unscaled gradient did). Not the largest: a
    row of a small factor whose entries are large came out inf at the largest's scale (grad_out [1e5, 1]), where
    its gradient is finite. Not below 1: rows of factors far above the smallest were computed among float16's
    subnormals and multiplied up (per-token weights from 1e-4 to 1); at 1 they are what the rescaled gradient of
    the other dtypes is, and a GradScaler's factors, all large, each come out at the smallest's size."""
    mod = _module(student.device)
    scale, factor = folded_scale(student, labels, ignore_index, reduction, loss_scale, grad_out)
    _, gs, gt = mod.distill_forward(student, teacher, topk_idx, topk_lp, labels, ignore_index, beta, temperature,
                                    _REDUCTION_CODE["sum"], want_student, want_teacher, None, scale, 1.0)
    return _empty_if_none(scale_rows(gs, factor), student), _empty_if_none(scale_rows(gt, factor), student)


def folded_scale(rows: Tensor, labels: Tensor | None, ignore_index: int, reduction: int, loss_scale: float,
                 grad_out: Tensor) -> tuple[Tensor, Tensor | None]:
    """(the scale for the kernels' gradient of the rows' sum, a 0-d float64 on the device; the rows' factors to
    multiply it by afterwards, or None) for float16's backward (_grad_impl; the vocabulary split's too): the
    reduction's divisor times loss_scale times grad_out, where one value; for one per row the smallest nonzero
    finite |grad_out| but at least 1 (see _grad_impl), the factors each row's over it. ``rows``: [n, ...]."""
    g = grad_out.to(torch.float64)
    scale = _module(rows.device).distill_reduction_scale(rows, labels, ignore_index, reduction, loss_scale)
    if g.dim() == 0:
        return scale * g, None
    if g.numel() == 0:  # (no rows: no factor to take the least of, and none to multiply by)
        return scale, None
    least = torch.where(g.isfinite() & (g != 0), g.abs(), math.inf).amin()
    # (every factor 0 or non-finite: 1, and they carry themselves)
    least = torch.where(least < math.inf, least, 1.0).clamp_min(1.0)
    return scale * least, (g / least).to(_acc_dtype(rows.dtype))


def scale_rows(grad: Tensor | None, factor: Tensor | None) -> Tensor | None:
    """grad [rows, vocab] times factor (one per row) in place, where both are given (folded_scale's)."""
    if grad is not None and factor is not None:
        _module(grad.device).distill_scale_grad_(grad, factor)
    return grad


_grad_op = torch.library.custom_op("kldiv_inline::distill_grad", mutates_args=())(_grad_impl)


@_grad_op.register_fake
def _(student, teacher, topk_idx, topk_lp, labels, ignore_index, beta, temperature, reduction, loss_scale, grad_out,
      want_student, want_teacher):
    gs = _grad_like_rows(student) if want_student else student.new_empty((0,))
    gt = student.new_empty(student.shape) if want_teacher else student.new_empty((0,))
    return gs, gt


def _setup_context(ctx, inputs, output):
    _, gs, gt = output
    _save_context(ctx, inputs, gs, gt)
    ctx.mark_non_differentiable(gs, gt)


def save_inputs(ctx, *tensors) -> None:
    """ctx.save_for_backward(*tensors), except inference tensors (a teacher run under torch.inference_mode, the
    usual distillation recipe, or labels made there), which cannot be saved for backward ("Inference tensors
    cannot be saved") and cannot change outside inference mode either: those are held as they are (saved_inputs
    gives every one back). Unlike saved tensors they have no version counter: one changed in place under
    inference mode before a backward that reads the inputs again (float16's, a second one) goes unnoticed."""
    held = tuple(t if isinstance(t, Tensor) and t.is_inference() else None for t in tensors)
    ctx.held_inputs = held if any(h is not None for h in held) else None
    ctx.save_for_backward(*(None if h is not None else t for t, h in zip(tensors, held)))


def keep_graph() -> bool:
    """Whether the backward running now keeps its graph (retain_graph=True): where it does not, what a ctx holds
    outside save_for_backward is let go once read, as saved tensors are (a teacher held while the loss lived, a
    logged loss kept one per step). True where torch says nothing (a private function of its autograd) and while
    torch.compile traces a backward (the function cannot be traced: nothing is let go there)."""
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if get is None or torch.compiler.is_compiling() else bool(get())


def saved_inputs(ctx) -> tuple:
    """The tensors save_inputs was given, in its order. Read only by a backward that computes again (float16's, a
    second one, a traced one): reading saved tensors checks that none changed in place since the forward, which a
    backward that only rescales the forward's gradients need not ask (a teacher's logits refilled for the next
    micro-batch before this one's backward raised PyTorch's in-place error, where PyTorch's own loss runs)."""
    saved, held = ctx.saved_tensors, ctx.held_inputs
    return saved if held is None else tuple(t if h is None else h for t, h in zip(saved, held))


def releases_held(backward: Callable) -> Callable:
    """A backward that lets go of save_inputs' held tensors once it has succeeded, unless the graph is kept (a
    backward that raises leaves them for a retry, as PyTorch leaves saved tensors)."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        out = backward(ctx, *grads)
        if not keep_graph():
            if getattr(ctx, "held_inputs", None) is not None:
                ctx.held_inputs = None
            if getattr(ctx, "student_versions", None):  # (the fused head's: let go as saved tensors are)
                ctx.student_versions = None
        return out
    return run


def masked_rows(labels: Tensor | None, ignore_index: int, reduction: int) -> Tensor | None:
    """For reduction none with labels: the rows whose label is ignore_index ([rows] bool), taken in forward
    (the labels may be refilled before backward), else None. See masked_grad_out."""
    if labels is None or reduction != _REDUCTION_CODE["none"]:
        return None
    return labels.reshape(-1) == ignore_index


def masked_grad_out(grad_out: Tensor, masked: Tensor | None) -> Tensor:
    """grad_out with the masked rows' entries 0: their gradient is 0 whatever their grad_output, as PyTorch's
    ignore_index losses give. Multiplied, 0 times an inf or NaN weight (1 / the length of a sequence all padding)
    was NaN. One value (sum, batchmean) is left as it is: non-finite, it makes every kept row's gradient so."""
    return grad_out if masked is None or grad_out.dim() == 0 else grad_out.masked_fill(masked, 0)


def _save_context(ctx, inputs, gs: Tensor | None, gt: Tensor | None) -> None:
    """What _backward needs: the inputs (for a recomputation), the settings, and the fused gradients."""
    student, teacher, topk_idx, topk_lp, labels, ignore_index, beta, temperature, reduction, loss_scale, ws, wt = \
        inputs
    save_inputs(ctx, student, teacher, topk_idx, topk_lp, labels)
    ctx.student_dtype = student.dtype  # (backward reads the inputs only to compute again: saved_inputs)
    ctx.args = (ignore_index, beta, temperature, reduction, loss_scale)
    ctx.masked = masked_rows(labels, ignore_index, reduction)
    ctx.wanted = (ws, wt)
    # Held outside save_for_backward: backward rescales them in place, and hands them over as the gradients.
    fuse = _fuses(student.dtype)
    ctx.fused = (gs.detach() if ws and fuse and gs is not None else None,
                 gt.detach() if wt and fuse and gt is not None else None)
    ctx.set_materialize_grads(False)


def _scaled(grad: Tensor, grad_out: Tensor, in_place: bool) -> Tensor:
    """grad (the reduced loss's gradient, [rows, vocab]) times grad_out (one value or one per row)."""
    if in_place and grad.device.type != "meta":  # (meta tensors hold shapes only: PyTorch's product gives them)
        _module(grad.device).distill_scale_grad_(grad, grad_out)
        return grad
    factor = grad_out.reshape(-1, 1) if grad_out.dim() == 1 else grad_out
    return (grad * factor).to(grad.dtype)


def _refuse_double_backward(who: str) -> None:
    """Backward of the fused-gradient ops: their gradients have no graph of their own, so under create_graph=True
    a penalty on them would be silently dropped; say so instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{who}: double backward (create_graph=True) is not supported: its gradient has no graph "
                           "of its own, so a penalty on it would be silently dropped")


def _backward(ctx, grad_out, _g_student, _g_teacher):
    if grad_out is None:
        return (None,) * 12
    _refuse_double_backward("generalized_jsd")
    grad_out = masked_grad_out(grad_out.resolve_neg(), ctx.masked)  # (a negative view: see _rows)
    need_s = ctx.needs_input_grad[0] and ctx.wanted[0]
    need_t = ctx.needs_input_grad[1] and ctx.wanted[1]
    gs, gt = ctx.fused
    # (a batched backward's grad_out, is_grads_batched=True: the registered op takes it slice by slice; meta
    # tensors, shapes only: the registered op's fake implementation, as the forward took)
    tracing = (torch.compiler.is_compiling() or type(grad_out) is not Tensor or batched_grad(grad_out)
               or grad_out.device.type == "meta")
    if not _fuses(ctx.student_dtype) or tracing:
        student, teacher, topk_idx, topk_lp, labels = saved_inputs(ctx)
        # The gradients with grad_out folded in: float16's every time (see _fuses), and a traced backward's, which
        # cannot rescale a fused gradient in place, and whose recomputation of one (it reads no grad_out) the
        # partitioner would move into the forward, beside the forward's own kernel (see _loss_impl).
        grad = _grad_op if tracing else _grad_impl
        out_s, out_t = grad(student, teacher, topk_idx, topk_lp, labels, *ctx.args, grad_out, need_s, need_t)
        if type(grad_out) is Tensor and not keep_graph():
            ctx.fused = (None, None)  # (a batched backward's: the fused gradients unread, let go with the graph)
        return (out_s if need_s else None, out_t if need_t else None) + (None,) * 10
    if gs is None and gt is None or (need_s and gs is None) or (need_t and gt is None):
        # A second backward (retain_graph=True), or none was fused (torch.compile's loss op run by backend="eager"):
        # compute the gradients again.
        _, gs, gt = _forward_op(*saved_inputs(ctx), *ctx.args, need_s, need_t)
    else:
        ctx.fused = (None, None)  # rescaled in place once; a second backward recomputes
    grad_out = grad_out.to(_acc_dtype(ctx.student_dtype))
    out_s = _scaled(gs, grad_out, True) if need_s else None
    out_t = _scaled(gt, grad_out, True) if need_t else None
    return (out_s, out_t) + (None,) * 10


_forward_op.register_autograd(releases_held(_backward), setup_context=_setup_context)


def _loss_impl(student: Tensor, teacher: Tensor | None, topk_idx: Tensor | None, topk_lp: Tensor | None,
               labels: Tensor | None, ignore_index: int, beta: float, temperature: float, reduction: int,
               loss_scale: float, want_student: bool, want_teacher: bool) -> Tensor:
    """The loss alone, the op torch.compile's graphs take. Their backward is traced: it cannot rescale a gradient
    the forward wrote in place, and a recomputation beside it (which does not read grad_out) was moved into the
    forward by the partitioner, so the kernel ran twice there and a written gradient went unread. Here the
    forward reads the logits once and writes nothing more; backward runs _grad_op with grad_out folded in (the
    logits read again, the gradient written once, each entry rounded once: the bytes of a fused gradient rescaled
    out of place). ``want_*``: which gradients backward makes. _grad_op has no autograd of its own, so
    create_graph=True fails in AOTAutograd rather than drop a penalty's term."""
    return _module(student.device).distill_forward(student, teacher, topk_idx, topk_lp, labels, ignore_index, beta,
                                                   temperature, reduction, False, False, None, None, loss_scale)[0]


_loss_op = torch.library.custom_op("kldiv_inline::distill_loss", mutates_args=())(_loss_impl)


@_loss_op.register_fake
def _(student, teacher, topk_idx, topk_lp, labels, ignore_index, beta, temperature, reduction, loss_scale,
      want_student, want_teacher):
    return student.new_empty((student.shape[0],) if reduction == 0 else (), dtype=_acc_dtype(student.dtype))


def _loss_setup_context(ctx, inputs, output):
    _save_context(ctx, inputs, None, None)  # (no fused gradients: _backward computes them)


def _loss_backward(ctx, grad_out):
    return _backward(ctx, grad_out, None, None)


_loss_op.register_autograd(releases_held(_loss_backward), setup_context=_loss_setup_context)


class _EagerForward(torch.autograd.Function):
    """The custom op's eager twin: the same kernel call, context and backward, without the dispatcher's layers
    that torch.library's autograd wrapper adds (filling the schema's defaults, redispatching): ~0.25 ms of host
    time per call on the 2-core development machine, which a training step with a short kernel (a top-k teacher:
    0.63 ms at 4096 x 128256 on an H200) cannot hide. Its one output is the loss: the fused gradients stay in the
    context (no empty stand-ins for the ones not wanted, no outputs for autograd to mark), the host's path shorter
    again. torch.compile and CUDA-graph capture take the custom op."""

    @staticmethod
    def forward(ctx, *inputs):
        *settings, loss_scale, ws, wt = inputs
        fuse = _fuses(inputs[0].dtype)
        loss, gs, gt = _module(inputs[0].device).distill_forward(*settings, ws and fuse, wt and fuse, None, None,
                                                                 loss_scale)
        _save_context(ctx, inputs, gs, gt)
        return loss

    @staticmethod
    @releases_held
    def backward(ctx, grad_out):
        return _backward(ctx, grad_out, None, None)


# ------------------------------------------------------------------------------------------ front end
def _check_number(name: str, value, low: float, high: float, low_open: bool, who: str = "generalized_jsd",
                  high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not (v > low if low_open else v >= low) or not (v < high if high_open else v <= high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{who}: {name} must lie in {interval}, got {value!r}")
    return v


def _rows(x: Tensor, vocab: int) -> Tensor:
    """[..., V] -> [rows, V] with unit stride along the vocabulary (a view where possible). A negative view
    (x.conj().imag of a complex x: a negation PyTorch applies when its ops read it) is resolved first, since the
    kernels read the memory itself (a no-op for every other tensor)."""
    x = x.resolve_neg()  # (unconditionally: Dynamo cannot trace is_neg())
    x2 = x if x.dim() == 2 else x.reshape(-1, vocab)  # (rows already: no reshape call on the step's host path)
    if x2.stride(-1) == 1:
        return x2
    if vocab == 1:  # one entry per row: the stride along it is never used, so say 1 (contiguous() would keep it:
        # PyTorch ignores it), by a view; Dynamo cannot trace storage_offset(), so a compiled call copies the rows
        if torch.compiler.is_compiling():
            return x2.clone(memory_format=torch.contiguous_format)
        return x2.as_strided(x2.shape, (x2.stride(0), 1), x2.storage_offset())
    # (an empty one too: contiguous() keeps an empty tensor's strides, which the kernels' check refused)
    return x2.clone(memory_format=torch.contiguous_format) if x2.numel() == 0 else x2.contiguous()


# Top-k probability mass beyond 1 (or, with k = V, away from 1) accepted as rounding and normalised away: a
# bfloat16 log-probability is rounded by up to |log p| 2^-9 relative, which over a top-100 stays below 1%.
TOPK_MASS_SLACK = 0.02


def _validate_topk(teacher_topk, student: Tensor, lead: torch.Size, vocab: int, labels: Tensor | None = None,
                   ignore_index: int = -100, defer: bool = False, who: str = "generalized_jsd"):
    """The top-k pair as the kernels take it: [rows, k] int64 indices and the prepared rows [rows, k + 1] (in the
    accumulation dtype: the k log-probabilities normalised, then the teacher's tail mass summed in float64; see
    traced_topk_normalisation), checked (in eager mode): indices in range and distinct, the mass of a distribution
    (tokens masked by ``labels``, the checked int64 row of them, are exempt from the mass check: padding may hold
    filler).

    ``defer``: return ``(indices, logprobs, check)`` where ``check()`` raises the error, if any, once the caller
    has queued its kernel: the values checked are read back without waiting for that kernel (see _topk_check)."""
    if not (isinstance(teacher_topk, Sequence) and len(teacher_topk) == 2):
        raise TypeError(f"{who}: teacher_topk must be a pair (indices, logprobs)")
    idx, lp = teacher_topk
    if not isinstance(idx, Tensor) or not isinstance(lp, Tensor):
        raise TypeError(f"{who}: teacher_topk must hold two tensors (indices, logprobs)")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"{who}: top-k indices must have an integer dtype, got {idx.dtype}")
    if not lp.is_floating_point():
        raise TypeError(f"{who}: top-k log-probabilities must be floating point, got {lp.dtype}")
    if idx.shape != lp.shape or idx.dim() < 1 or idx.shape[:-1] != lead:
        raise ValueError(f"{who}: top-k indices {tuple(idx.shape)} and log-probabilities "
                         f"{tuple(lp.shape)} must both be [..., k] with the logits' leading dims {tuple(lead)}")
    k = idx.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"{who}: top-k needs 1 <= k <= vocabulary ({vocab}), got k = {k}")
    if idx.device != student.device or lp.device != student.device:
        raise ValueError(f"{who}: the top-k teacher must be on the logits' device")
    if lp.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{who}: no gradient flows to a top-k teacher's log-probabilities; detach them")
    lp = lp.resolve_neg()  # (a negative view: see _rows)
    acc = _acc_dtype(student.dtype)
    # float64 log-probabilities are prepared in float64 whatever the lanes, then rounded: the tail, 1 - the sum of
    # the k probabilities, is then that of the values given (from their float32 roundings, reverse KL's per-token
    # loss was 1e-4 to 2e-4 off where the tail is 1e-5).
    prep = torch.float64 if lp.dtype == torch.float64 else acc
    # (the usual layouts, [rows, k] int64 and the accumulation dtype, contiguous, as they are: the step's host path)
    usual = idx.dim() == 2 and idx.is_contiguous() and lp.is_contiguous()
    idx2 = idx if usual and idx.dtype == torch.int64 else idx.reshape(-1, k).to(torch.int64).contiguous()
    lp2 = lp if usual and lp.dtype == prep else lp.reshape(-1, k).to(prep)
    # The kernels sum each KL in a form that holds for normalised distributions only. A served teacher's
    # log-probabilities carry rounding (bfloat16 ones can hold a little more than 1 of mass, which would leave a
    # tail of 0 and a reverse KL of inf): mass above 1 is divided out, and with k = V the k buckets are the whole
    # distribution, normalised alike. Beyond TOPK_MASS_SLACK it is no rounding: an error, checked below.
    if not idx2.numel() or _is_tracing(idx2):
        # Traced (torch.compile, CUDA-graph capture): the same normalisation in PyTorch operations, unchecked
        # (the kernels then make a row with a bad index NaN).
        lp2 = traced_topk_normalisation(lp2, k == vocab).to(acc).contiguous()
        return (idx2, lp2, _no_check) if defer else (idx2, lp2)
    # Eager: normalised and checked by one kernel (a wrong index or a teacher that is no distribution must be an
    # error, not a wrong number), whose flags check() reads: on a GPU the kernel writes them into a pinned buffer
    # lent here, read once an event recorded right after the kernel has completed (see _topk_check).
    lp_given = lp2.contiguous()
    mod = _module(idx2.device)
    if idx2.is_cuda:
        host, done, read = _lend_read_back(idx2.device, (3,), torch.int32)
        lp2, _ = mod.distill_topk_prepare(idx2, lp_given, vocab, labels, ignore_index, math.log1p(TOPK_MASS_SLACK),
                                          host)
        done.record(torch.cuda.current_stream(idx2.device))
    else:
        lp2, flags = mod.distill_topk_prepare(idx2, lp_given, vocab, labels, ignore_index, math.log1p(TOPK_MASS_SLACK))
        read = flags.tolist
    check = _topk_check(read, lp_given, vocab, labels, ignore_index, who)
    if not defer:
        check()
    if lp2.dtype != acc:  # (prepared in float64 where given so: a copy, [rows, k + 1]; no call otherwise)
        lp2 = lp2.to(acc)
    return (idx2, lp2, check) if defer else (idx2, lp2)


def traced_topk_normalisation(lp: Tensor, whole: bool) -> Tensor:
    """A top-k teacher's log-probabilities [rows, k] made into the rows the kernels take, [rows, k + 1], in PyTorch
    operations (the traced path; eager mode runs distill_topk_prepare, which must agree): the k log-probabilities
    normalised (mass above 1 divided out, or with k = V (``whole``) the whole distribution normalised; a row
    without mass left as it is; NaN stays NaN), then the teacher's tail mass, 1 - the sum of their probabilities,
    formed in float64 (0 where nothing is left, for a NaN row, and where the row was shifted: mass above 1, or
    k = V): a served teacher's k tokens can hold all but 1e-5 of its mass, and 1 - a float32 sum is then off by
    percents of the tail."""
    # The logsumexp in float64 whatever lp's dtype, as the kernel's: whether the mass is above 1 is decided on the
    # values as given (a float32 logsumexp's rounding, ~6e-8, put rows holding all but 1e-8 of the mass above 1).
    lse = torch.logsumexp(lp.double(), dim=-1, keepdim=True)
    shift = lse if whole else lse.clamp_min(0)
    shift = torch.where(torch.isneginf(shift), 0.0, shift).to(lp.dtype)
    lp = lp - shift
    tail = 1 - lp.double().exp().sum(-1, keepdim=True)
    tail = torch.where((tail > 0) & (shift == 0) & (not whole), tail, 0.0)  # (shifted: mass above 1, or k = V)
    return torch.cat([lp, tail.to(lp.dtype)], dim=-1)


def is_topk_pair(x) -> bool:
    """Whether ``x`` has the top-k teacher's form, (indices, logprobs) as two tensors (_validate_topk says what is
    wrong otherwise)."""
    return isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(t, Tensor) for t in x)


def _no_check() -> None:
    pass


# Pinned host buffers and events of read_back_later and the top-k checks, per thread and (device, shape, dtype):
# each is handed out again once its read() has returned, so a step's read-back allocates nothing (a pinned tensor
# and an event cost ~15-20 us of an eager step's host path on an H200's host).
_READ_BACK = threading.local()


def _lend_read_back(device: torch.device, shape: tuple, dtype: torch.dtype) -> tuple[Tensor, Any, Callable[[], Any]]:
    """A pinned host buffer of ``shape`` and ``dtype`` for values from ``device``, the event to record once they
    are queued for it, and ``read()``: it waits for that event and returns the buffer's values as ``tolist()`` does
    (a list; a number for a 0-d buffer). The first read() hands buffer and event back for later calls; a later one
    returns the values it read. A buffer whose read() never comes is never handed out again."""
    pool = _READ_BACK.__dict__.setdefault("free", {})
    free = pool.setdefault((device, tuple(shape), dtype), [])
    if free:
        host, done = free.pop()
    else:
        host, done = torch.empty(shape, dtype=dtype, pin_memory=True), torch.cuda.Event()
    read_back: list = []  # the values, once read

    def read() -> Any:
        if not read_back:
            done.synchronize()
            read_back.append(host.tolist())
            free.append((host, done))
        return read_back[0]

    return host, done, read


def read_back_later(flags: Tensor) -> Callable[[], Any]:
    """``read()``, which returns the values of ``flags`` (a small tensor) as ``flags.tolist()`` does (a list; a
    number for a 0-d tensor). On a GPU they go to pinned host memory behind an event recorded now on the flags'
    device's current stream, so ``read()`` waits for the kernels queued so far only, not for those its caller
    queues in between."""
    if not flags.is_cuda:
        return flags.tolist
    host, done, read = _lend_read_back(flags.device, flags.shape, flags.dtype)
    host.copy_(flags, non_blocking=True)
    done.record(torch.cuda.current_stream(flags.device))
    return read


def _topk_check(read: Callable[[], Any], lp: Tensor, vocab: int, labels: Tensor | None, ignore_index: int,
                who: str = "generalized_jsd"):
    """``check()``, which raises the error that the flags of distill_topk_prepare (range, repeat, mass), as
    ``read()`` returns them, say, if any. On a GPU they are in pinned host memory behind an event recorded right
    after the preparation kernel: a caller that queues its kernel before calling ``check()`` waits for that small
    kernel only, not for its own (a synchronisation before the launch left the GPU idle for the host's path to the
    next launch: 0.67 ms of a 1.31-ms training step at 4096 x 128256 on an H200). ``lp``: the log-probabilities as
    given, [rows, k], for the error's message."""
    k = lp.shape[1]

    def check() -> None:
        bad_range, dup, bad_mass = read()
        # (masked tokens' indices too, unlike their mass: the kernels index the student's row with them)
        if bad_range:
            raise ValueError(f"{who}: top-k indices must lie in [0, {vocab}), a masked token's too (pad one with "
                             "indices in range, e.g. 0 .. k-1)")
        if dup:
            raise ValueError(f"{who}: top-k indices of a token must be distinct, a masked token's too (pad one with "
                             "distinct indices, e.g. 0 .. k-1)")
        if bad_mass:  # the worst row for the message (an error path: PyTorch operations, synchronised)
            lse = torch.logsumexp(lp, dim=-1)
            excess = lse.abs() if k == vocab else lse
            if labels is not None:
                excess = torch.where(labels != ignore_index, excess, -math.inf)
            worst = float(lse[excess.nan_to_num(nan=-math.inf).argmax()])  # (a NaN row is no offender)
            allowed = "at most 1" if k < vocab else "1 (k = V: the whole vocabulary)"
            raise ValueError(f"{who}: top-k log-probabilities must be those of a distribution: a token's "
                             f"{k} probabilities sum to {math.exp(worst):.4g}, where they must sum to {allowed}, "
                             f"give or take {TOPK_MASS_SLACK:.0%} of rounding; pass "
                             "log_softmax(teacher_logits).topk(k)")

    return check


def _is_tracing(t: Tensor) -> bool:
    """Whether ``t`` holds no values to read now: torch.compile's fake tensors (and any subclass that dispatches
    on its own), meta tensors, CUDA-graph capture. A subclass that keeps Tensor's dispatch (nn.Parameter, a
    plain Python subclass) holds its values and is checked as a Tensor: the top-k checks were once skipped for
    any type but Tensor, so indices held in a Parameter went unchecked (a bad index made NaN rows, no error)."""
    return (torch.compiler.is_compiling() or t.device.type == "meta"
            or (type(t) is not Tensor and type(t).__torch_dispatch__ is not _TENSOR_DISPATCH)
            or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


_TENSOR_DISPATCH = Tensor.__torch_dispatch__


def check_loss_scale(loss_scale, who: str = "generalized_jsd") -> float:
    """loss_scale as a float: a finite real number (a tensor is refused: a device value goes through backward).
    While torch.compile traces with dynamic=True the value is symbolic, and math.isfinite of it cannot be traced:
    there only its type is checked."""
    if torch.compiler.is_compiling() and not isinstance(loss_scale, (Tensor, bool)) and isinstance(
            loss_scale, numbers.Real):
        return loss_scale
    if type(loss_scale) is float and math.isfinite(loss_scale):
        return loss_scale  # the usual case, without the type checks below on the step's host path
    if isinstance(loss_scale, Tensor):
        raise TypeError(f"{who}: loss_scale must be a Python number known before the forward; for a tensor (a "
                        "GradScaler's scale, say) multiply the loss by it instead")
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):
        raise TypeError(f"{who}: loss_scale must be a real number, got {type(loss_scale).__name__}")
    v = float(loss_scale)
    if not math.isfinite(v):
        raise ValueError(f"{who}: loss_scale must be finite, got {loss_scale!r}")
    return v


# From here up, a double rounds to float32's inf (the midpoint of its largest value and 2^128 rounds to even: up).
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103
_LOG2E = 1.0 / math.log(2.0)
# From here up to 1, a double rounds to float32's 1 (the midpoint of 1 - 2^-24 and 1 rounds to even: up). Compared,
# not converted (struct), so that torch.compile traces the check where beta is symbolic (dynamic=True).
_FLOAT32_ONE_FROM = 1.0 - 2.0**-25


def _check_lanes(beta: float, temperature: float, dtype: torch.dtype, who: str) -> None:
    """Settings that float32 lanes (16-bit and float32 logits) cannot hold; float64's lanes are double. A beta
    within 3e-8 of 1 is 1 in float32, where 1 - beta is 0 and the JSD's student side 0 x inf (a NaN loss and
    gradient wherever the student has mass the teacher has not); a temperature below ~4.2e-39 makes log2(e) / T,
    which every logit is scaled by, inf in float32 (a NaN loss where PyTorch's x / T is finite)."""
    if dtype == torch.float64:
        return
    if _FLOAT32_ONE_FROM <= beta < 1.0:
        raise ValueError(f"{who}: beta={beta!r} is 1 in float32, the lanes of {dtype} logits, where the JSD's "
                         "1 - beta would be 0: pass beta=1 (reverse KL), a beta further from 1, or float64 logits")
    if _LOG2E / temperature >= _FLOAT32_OVERFLOW:
        raise ValueError(f"{who}: temperature={temperature!r} is too small for the float32 lanes of {dtype} logits "
                         "(log2(e) / T, by which every logit is scaled, overflows below ~4.2e-39): use float64 "
                         "logits")


def _check_settings(beta, temperature, ignore_index, reduction, who: str = "generalized_jsd",
                    dtype: torch.dtype | None = None) -> tuple[float, float]:
    """Checks the divergence's settings; returns beta and the temperature as floats. ``dtype``: the logits'
    (where known), for what their lanes can hold."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"{who}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    beta = _check_number("beta", beta, 0.0, 1.0, low_open=False, who=who)
    temperature = _check_number("temperature", temperature, 0.0, float("inf"), low_open=True, who=who,
                                high_open=True)  # (NaN and inf get the one message)
    if dtype is not None:
        _check_lanes(beta, temperature, dtype, who)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{who}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -(2**63) <= int(ignore_index) < 2**63:
        raise ValueError(f"{who}: ignore_index must fit in int64 (labels' type), got {ignore_index}")
    return beta, temperature


def refuse_transforms(who: str, *tensors) -> None:
    """A clear error for what the kernels cannot do: torch.func transforms (vmap, grad, jvp: their wrapped tensors
    have no storage a kernel could read), forward-mode AD (its tangent would be dropped without a word) and
    tensors of another layout than strided (sparse, mkldnn: torch's own view and reshape refused them in words
    that named neither the argument nor the remedy)."""
    for t in tensors:
        if isinstance(t, Tensor) and t.layout != torch.strided:
            raise NotImplementedError(f"{who}: a {t.layout} tensor was given (shape {tuple(t.shape)}); the kernels "
                                      "take dense (strided) tensors: pass it .to_dense()")
    if torch.compiler.is_compiling():
        return
    # No dual level entered: no tensor can carry a tangent, so unpack_dual (~1 us a tensor of the eager step's host
    # path) is skipped. (Without the attribute, a later PyTorch's, every tensor is asked.)
    dual = getattr(forward_ad, "_current_level", 0) >= 0
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise NotImplementedError(f"{who}: torch.func transforms (vmap, grad, jacrev, jvp) are not supported: "
                                      "pass the batch itself (every leading dim is a token) and use "
                                      "torch.autograd for gradients")
        if dual and forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(f"{who}: forward-mode AD (torch.autograd.forward_ad) is not supported; use "
                                      "reverse mode (backward)")


def _check_teacher_logits(teacher_logits, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                          who: str = "generalized_jsd") -> None:
    """Teacher logits must match the student's logits (of this shape, dtype and device)."""
    if not isinstance(teacher_logits, Tensor):
        raise TypeError(f"{who}: teacher_logits must be a tensor, got {type(teacher_logits).__name__}")
    if teacher_logits.shape != shape:
        raise ValueError(f"{who}: student logits {tuple(shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    if teacher_logits.dtype != dtype:
        raise TypeError(f"{who}: student ({dtype}) and teacher ({teacher_logits.dtype}) "
                        "logits must have the same dtype; convert one of them")
    if teacher_logits.device != device:
        raise ValueError(f"{who}: student logits on {device}, teacher logits on "
                         f"{teacher_logits.device}: they must be on one device")


def _check_labels(labels, lead: torch.Size, device: torch.device, who: str = "generalized_jsd") -> Tensor | None:
    """Labels of the tokens' leading shape as one int64 row (None stays None)."""
    if labels is None:
        return None
    if (not isinstance(labels, Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex
            or labels.dtype == torch.bool):
        raise TypeError(f"{who}: labels must be an integer tensor, got "
                        f"{labels.dtype if isinstance(labels, Tensor) else type(labels).__name__}")
    if labels.shape != lead:
        raise ValueError(f"{who}: labels must have the logits' leading shape {tuple(lead)}, got "
                         f"{tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"{who}: labels on {labels.device}, logits on {device}")
    if labels.dtype == torch.int64 and labels.dim() == 1 and labels.is_contiguous():
        return labels  # the usual case, without three calls on the step's host path
    return labels.reshape(-1).to(torch.int64).contiguous()


def _prepare(student_logits, teacher_logits, teacher_topk, beta, temperature, labels, ignore_index, reduction,
             topk_vocab: int | None = None, defer_check: bool = False):
    """Checks every argument and lays the logits out as rows; returns the kernel's arguments and the shape of
    the per-token loss. Top-k indices must lie in [0, topk_vocab) (default: the logits' vocabulary).
    ``defer_check``: return a third item, ``check()``, to be called once the kernel is queued: it raises the
    top-k teacher's error, if any (_topk_check), and does nothing otherwise."""
    if not isinstance(student_logits, Tensor):
        raise TypeError(f"generalized_jsd: student_logits must be a tensor, got {type(student_logits).__name__}")
    if student_logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"generalized_jsd: logits must be float16, bfloat16, float32 or float64, got "
                        f"{student_logits.dtype}")
    if student_logits.dim() < 1 or student_logits.shape[-1] < 1:
        raise ValueError(f"generalized_jsd: logits need a vocabulary dimension of size >= 1 (last), got shape "
                         f"{tuple(student_logits.shape)}")
    if student_logits.device.type not in ("cpu", "cuda", "meta"):
        raise NotImplementedError(f"generalized_jsd: no kernels for {student_logits.device.type} tensors")
    beta, temperature = _check_settings(beta, temperature, ignore_index, reduction, dtype=student_logits.dtype)
    pair = teacher_topk if isinstance(teacher_topk, (tuple, list)) else ()
    refuse_transforms("generalized_jsd", student_logits, teacher_logits, labels, *pair)
    vocab, lead = student_logits.shape[-1], student_logits.shape[:-1]
    if (teacher_logits is None) == (teacher_topk is None):
        raise ValueError("generalized_jsd: give exactly one of teacher_logits and teacher_topk")
    lab = _check_labels(labels, lead, student_logits.device)
    teacher = idx = lp = None
    check = _no_check
    if teacher_logits is not None:
        _check_teacher_logits(teacher_logits, student_logits.shape, student_logits.dtype, student_logits.device)
        teacher = _rows(teacher_logits, vocab)
    else:
        idx, lp, check = _validate_topk(teacher_topk, student_logits, lead,
                                        vocab if topk_vocab is None else topk_vocab, lab, ignore_index, defer=True)
    args = (_rows(student_logits, vocab), teacher, idx, lp, lab, int(ignore_index), beta, temperature,
            _REDUCTION_CODE[reduction])
    if defer_check:
        return args, lead, check
    check()
    return args, lead


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor | None = None, *,
                    teacher_topk: tuple[Tensor, Tensor] | None = None, beta: float = 0.0,
                    temperature: float = 1.0, labels: Tensor | None = None, ignore_index: int = -100,
                    reduction: str = "batchmean", loss_scale: float = 1.0, group=None) -> Tensor:
    """Divergence between the student's and the teacher's softmax(logits / temperature), per token.

    ``student_logits``, ``teacher_logits``: ``[..., V]`` (vocabulary last), float16/bfloat16/float32/float64 of
    one dtype, any strides (rows sliced out of a padded vocabulary, ``logits[..., :V]``, get a gradient laid out
    like them: padded rows, of their stride modulo 16 bytes). ``beta = 0``: forward KL(teacher || student);
    ``beta = 1``: reverse KL(student || teacher); in between the generalized JSD
    ``beta KL(t || m) + (1 - beta) KL(s || m)``, ``m = (1 - beta) p_s + beta p_t``. No ``T**2`` factor is applied
    (multiply the loss yourself if you want it).

    ``labels`` (the leading shape, integer): tokens whose label is ``ignore_index`` contribute 0 and get a zero
    gradient. ``reduction``: ``"batchmean"`` (sum over tokens / unmasked tokens; 0 when all are masked),
    ``"sum"``, or ``"none"`` (per token, the leading shape). The loss is float32 (float64 for float64 logits).

    ``teacher_topk = (indices, logprobs)``, each ``[..., k]``: a served teacher's top-k log-probabilities, used as
    given (the temperature applies to the student only). The divergence then runs over k + 1 buckets: the k tokens
    and one tail holding the rest of each distribution's mass (teacher: 1 - sum exp(logprobs); student: its
    probability outside the k tokens). The student's gradient covers its whole vocabulary; none flows to the top-k
    teacher. Rounding of the log-probabilities (a served bfloat16 top-k can hold a little more than 1 of mass) is
    normalised away: mass above 1 is divided out (the tail is then 0, so reverse KL is inf for a token whose student
    has mass outside the k; with k < V, ``lp = logprobs.float(); lp - (lp.logsumexp(-1, keepdim=True) +
    eps).clamp_min(0)``, passed in float32, leaves every row a tail of at least eps), and with k = V the k buckets
    are normalised; mass off by more than 2% (``TOPK_MASS_SLACK``) is an error. Indices must be distinct and in
    range. Both are checked in eager mode by one small kernel whose verdict is read back once the divergence kernel
    is queued (the host waits for the small kernel, not for the divergence); under torch.compile or CUDA-graph
    capture the check is skipped and a row with a bad index has a NaN loss and gradient. The teacher's tail is
    summed in float64 from the given float32 (float64) log-probabilities, so a teacher whose k tokens hold all but
    ~1e-5 of its mass still has its tail to float32 precision.

    Gradients flow to the student's logits, and to the teacher's logits when they require grad. A teacher (and
    labels) made under ``torch.inference_mode()`` is taken as it is in eager mode; under torch.compile AOTAutograd
    saves it for backward itself, which PyTorch refuses: make it under ``torch.no_grad()`` there, or clone it. A padded
    vocabulary is legal whatever the padding holds (-inf, -1e10, the dtype's lowest value): it holds no mass. A
    token whose student or teacher row is no distribution (a NaN or +inf logit, every logit -inf) has a NaN loss
    for every beta, as PyTorch's.
    Double backward is not supported (a clear error); nor are torch.func transforms (vmap, grad, jvp) and
    forward-mode AD (clear errors).

    Limits of float32 lanes (16-bit and float32 logits): a token whose largest scaled logit ``|x / T|`` (student's
    or teacher's) exceeds 2^24 ln 2, about 1.2e7, has a NaN loss and gradient: each logit is scaled before the
    row's maximum is subtracted, which beyond that offset costs more than the softmax can absorb, so such a token
    is NaN rather than wrong (PyTorch, subtracting the maximum first, still gives a number). float64 logits hold
    to 2^53 ln 2, about 6e15. Padding at a large finite value (-1e10, the dtype's lowest) is exact: the limit
    concerns a row's maximum. A scaled logit beyond float32's range (|x / T| above ~2.4e38: the lowest value of
    float32 or bfloat16 at T below ~1.4) counts as -inf, no mass, as padding should; where the other distribution
    has mass there, the loss is inf and the gradients NaN (the true loss is ~1e38). A beta within 3e-8 of 1 (1 in
    float32, where 1 - beta would be 0) and a temperature below ~4.2e-39 (log2(e) / T overflows float32) are refused
    with an error; float64 logits take them. With a top-k teacher, a student whose mass outside the k tokens is
    below what float32 lanes hold (~1e-38; as at temperatures far below 1) gets an infinite loss where float64 gives
    a finite one, and its tail tokens get no share of the tail bucket's gradient (a row's gradient then does not sum
    to 0): the tail's probabilities are summed, not log-summed. The generalized JSD loses digits in float32 lanes as
    beta nears 0 or 1: the mixture's log is formed to an absolute ~1e-7 while the loss is ~min(beta, 1 - beta)
    times a divergence, so its relative error grows as ~0.3 x 1.2e-7 / min(beta, 1 - beta) (measured on the CPU at
    logit spreads 0.5-4, T = 2: up to 4e-5 at beta = 1e-3 or 0.999, 5e-4 at 1e-4, 3.5e-3 at 1e-5; wider logits
    several times more, most near beta = 1): use beta = 0 or 1 for the KLs, or float64,
    whose lanes form the mixture's log from log1p of each side's own small term: the loss within 9.2e-16 of 60-digit
    arithmetic from beta = 1e-30 to 1 - 1e-12 (tools/probe_jsd_beta_ends.py), the gradients within 1e-13 (tests).

    ``loss_scale`` (a finite Python number, 1 by default): the loss (each token's for ``"none"``) is multiplied by
    it, and so are its gradients, which the forward writes already scaled. For gradient accumulation over n
    micro-batches pass ``loss_scale=1 / n`` rather than dividing the loss: ``loss / n`` reaches backward as a
    grad_output of 1 / n, which costs a pass over the whole gradient there (a read and a write of it: ~0.56 ms at
    4096 x 128256 bf16 on an H200, 60% of the training step), while the constant known before the forward costs
    nothing. A scale that changes from step to step on the device (a GradScaler's) goes through backward as usual.
    With ``group``, every rank passes the same.

    float16 logits: the forward writes no gradient; backward computes it with grad_output folded in (a second read
    of the logits): each entry rounded once at its final size for one grad_output value, and for reduction none's
    per-token ones at the smallest nonzero one's size (but at least 1's), then multiplied by each one's share: a row
    weighted far above the smallest (per-token weights of 1 and 1e4) keeps only the digits float16 holds at the
    smallest's size (entries below its subnormals are 0 before they are multiplied up; bfloat16 and float32 logits
    keep them). float16's range cannot hold the unscaled gradient: an entry ~p / tokens lies among its subnormals,
    and a GradScaler's 65536 multiplied in afterwards left the median entry 3.6% off and 90k of 1.6M entries 0 at 32
    x 50000 (now 2e-4, as PyTorch's autograd). With ``group`` (the vocabulary split) alike: backward then runs the
    split's collectives again, so every rank must call it (as every rank calls a distributed step's backward).

    ``group`` (a ``torch.distributed`` process group): the vocabulary is split across its ranks, each holding a
    contiguous slice of both logits in rank order (``kldiv_inline.vocab_parallel``); the loss is the global one
    on every rank, the gradients are each rank's slice's; ``teacher_topk``'s indices are then global.
    """
    if group is not None:  # (loss_scale checked there, where a rank that refuses it tells the others)
        from .vocab_parallel import generalized_jsd_vocab_parallel
        return generalized_jsd_vocab_parallel(student_logits, teacher_logits, teacher_topk=teacher_topk, beta=beta,
                                              temperature=temperature, labels=labels, ignore_index=ignore_index,
                                              reduction=reduction, group=group, loss_scale=loss_scale)
    loss_scale = check_loss_scale(loss_scale)
    args, lead, check = _prepare(student_logits, teacher_logits, teacher_topk, beta, temperature, labels,
                                 ignore_index, reduction, defer_check=True)
    student, teacher = args[0], args[1]
    grad_on = torch.is_grad_enabled()
    want_s = bool(grad_on and student.requires_grad)
    want_t = bool(grad_on and teacher is not None and teacher.requires_grad)
    if torch.compiler.is_compiling():
        loss = _loss_op(*args, loss_scale, want_s, want_t)
    elif _is_tracing(student):  # meta or fake tensors outside torch.compile, CUDA-graph capture
        loss = _forward_op(*args, loss_scale, want_s, want_t)[0]
    elif want_s or want_t:
        loss = _EagerForward.apply(*args, loss_scale, want_s, want_t)
    else:
        loss = _module(student.device).distill_forward(*args, False, False, None, None, loss_scale)[0]
    # The top-k teacher's checks, read back now that the kernel is queued (it makes a bad row NaN, and never
    # reads out of range: raising after it is safe, and its results are dropped with the error).
    check()
    return loss.reshape(lead) if reduction == "none" else loss


class GeneralizedJSDLoss(torch.nn.Module):
    """``generalized_jsd`` as a module: ``GeneralizedJSDLoss(beta, temperature)(student_logits, teacher_logits,
    labels)``, or ``teacher_topk=(indices, logprobs)`` in place of the teacher's logits; ``group=`` splits the
    vocabulary across a process group, as the function's does."""

    def __init__(self, beta: float = 0.0, temperature: float = 1.0, ignore_index: int = -100,
                 reduction: str = "batchmean", loss_scale: float = 1.0):
        super().__init__()
        _check_settings(beta, temperature, ignore_index, reduction)  # checked now: fails where it is made
        check_loss_scale(loss_scale)
        self.beta, self.temperature, self.ignore_index, self.reduction = beta, temperature, ignore_index, reduction
        self.loss_scale = loss_scale

    def forward(self, student_logits: Tensor, teacher_logits: Tensor | None = None,
                labels: Tensor | None = None, teacher_topk: tuple[Tensor, Tensor] | None = None,
                group=None) -> Tensor:
        return generalized_jsd(student_logits, teacher_logits, teacher_topk=teacher_topk, beta=self.beta,
                               temperature=self.temperature, labels=labels, ignore_index=self.ignore_index,
                               reduction=self.reduction, loss_scale=self.loss_scale, group=group)

    def extra_repr(self) -> str:
        scale = f", loss_scale={self.loss_scale}" if self.loss_scale != 1.0 else ""
        return (f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}{scale}")
