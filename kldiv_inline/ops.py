"""The public op: validation, broadcasting, reductions, autograd and torch.library registration.

``kl_div`` has ``torch.nn.functional.kl_div``'s signature and semantics; ``kl_div_from_probs`` takes
probabilities and takes their log inside the kernel (``F.kl_div(torch.log(p), t, ...)`` in one pass).

Three paths reach the same kernels (``kernels/``), never PyTorch's kl_div or xlogy (only a broadcast
operand's gradient is summed back to its shape with ``sum_to_size``):
- eager, no autograd: the compiled module is called directly (a launch-bound call is mostly host time);
- eager training: ``_EagerKLDiv``, a ``torch.autograd.Function`` with the backward rule below;
- under ``torch.compile``: three registered custom ops (``torch.ops.kldiv_inline.*``) with fake
  implementations and the same backward rule, so ``fullgraph=True`` has no graph break and
  ``torch.library.opcheck`` can test them.

Training with a reduced loss: when the input requires grad, the forward pass also writes d loss / d input
(one write beyond the reads). Backward multiplies it in place by grad_output on the device, a kernel that
returns at once when grad_output is 1 (``loss.backward()``): no extra pass and no host synchronisation.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .loader import load

__all__ = ["kl_div", "kl_div_from_probs", "KLDivLoss", "REDUCTIONS"]

REDUCTIONS = ("none", "mean", "sum", "batchmean")
_REDUCTION_SET = frozenset(REDUCTIONS)

# Same text as torch.nn.functional.kl_div's warning, so filters written for PyTorch apply to us too.
_MEAN_WARNING = (
    "reduction: 'mean' divides the total loss by both the batch size and the support size."
    "'batchmean' divides only by the batch size, and aligns with the KL div math definition."
    "'mean' will be changed to behave the same as 'batchmean' in the next major release."
)


_MODULES: dict[str, object] = {}


def _module(device: torch.device):
    """The compiled module for a device type, looked up once: ``load`` re-hashes the kernel files on every
    call (that is how an edit is noticed), which costs more than a small launch. After editing a kernel,
    call ``kldiv_inline.ops.reload()`` (or ``load`` directly) to pick the new build up."""
    mod = _MODULES.get(device.type)
    if mod is None:
        if device.type not in ("cuda", "cpu"):
            raise NotImplementedError(f"kldiv_inline: no kernels for device type {device.type!r} (cpu and cuda only)")
        mod = _MODULES[device.type] = load(device.type)
    return mod


def reload() -> None:
    """Rebuild (if the kernel files changed) and use the current kernels for the next calls."""
    for backend in list(_MODULES):
        _MODULES[backend] = load(backend)


def _undefined_to_empty(t: Tensor | None, like: Tensor) -> Tensor:
    # Custom ops cannot return None; an empty tensor stands for "not computed".
    return t if t is not None else like.new_empty((0,))


# ----------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("kldiv_inline::kl_div_forward", mutates_args=())
def _forward_op(input: Tensor, target: Tensor, reduce: bool, divisor: float, log_target: bool,
                from_probs: bool, want_grad: bool) -> tuple[Tensor, Tensor]:
    out, grad = _module(input.device).kl_div_forward(input, target, reduce, divisor, log_target, from_probs,
                                                     want_grad)
    return out, _undefined_to_empty(grad, input)


@_forward_op.register_fake
def _(input, target, reduce, divisor, log_target, from_probs, want_grad):
    shape = torch.broadcast_shapes(input.shape, target.shape)
    out = input.new_empty(()) if reduce else input.new_empty(shape)
    grad = input.new_empty(shape) if (reduce and want_grad) else input.new_empty((0,))
    return out, grad


@torch.library.custom_op("kldiv_inline::kl_div_backward", mutates_args=())
def _backward_op(grad_out: Tensor, input: Tensor, target: Tensor, reduce: bool, divisor: float,
                 log_target: bool, from_probs: bool, want_input: bool, want_target: bool) -> tuple[Tensor, Tensor]:
    gx, gt = _module(input.device).kl_div_backward(grad_out, input, target, reduce, divisor, log_target,
                                                   from_probs, want_input, want_target)
    return _undefined_to_empty(gx, input), _undefined_to_empty(gt, input)


@_backward_op.register_fake
def _(grad_out, input, target, reduce, divisor, log_target, from_probs, want_input, want_target):
    shape = torch.broadcast_shapes(input.shape, target.shape)
    gx = input.new_empty(shape) if want_input else input.new_empty((0,))
    gt = input.new_empty(shape) if want_target else input.new_empty((0,))
    return gx, gt


@torch.library.custom_op("kldiv_inline::kl_div_scale_grad_", mutates_args=("grad",))
def _scale_grad_op(grad: Tensor, grad_out: Tensor) -> None:
    _module(grad.device).kl_div_scale_grad_(grad, grad_out)


@_scale_grad_op.register_fake
def _(grad, grad_out):
    return None


def _setup_context(ctx, inputs, output):
    input, target, reduce, divisor, log_target, from_probs, want_grad = inputs
    _, fused_grad = output
    _save(ctx, input, target, reduce, divisor, log_target, from_probs, want_grad, fused_grad)
    # The second output (the fused gradient) is not part of the loss: without this, autograd would fill a
    # zero tensor of its size as its incoming gradient on every backward (a full extra pass).
    ctx.mark_non_differentiable(fused_grad)


def _save(ctx, input, target, reduce, divisor, log_target, from_probs, want_grad, fused_grad):
    ctx.flags = (reduce, divisor, log_target, from_probs)
    ctx.fused = want_grad
    ctx.fused_used = False
    ctx.input_shape, ctx.target_shape = input.shape, target.shape
    ctx.save_for_backward(input, target)
    # Kept outside save_for_backward: backward rescales it in place, which would fail the saved-tensor
    # version check of a second backward (retain_graph=True); and handing it over (dropping this reference)
    # lets AccumulateGrad adopt it as .grad instead of cloning it. Detached: no reference cycle via grad_fn.
    ctx.fused_grad = fused_grad.detach() if want_grad else None
    ctx.set_materialize_grads(False)


def _backward_with(ctx, grad_out, scale_grad_, backward):
    input, target = ctx.saved_tensors
    if grad_out is None:  # the loss took no part in what was differentiated
        return None, None
    reduce, divisor, log_target, from_probs = ctx.flags
    need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gx = gt = None
    grad_out = grad_out.to(input.dtype)
    # The fused gradient is rescaled in place, once: a second backward (retain_graph=True) recomputes.
    # Any tracing (Dynamo, or AOTAutograd alone as in opcheck, which passes tensor subclasses) takes the
    # functional path too: an in-place update of a forward output cannot be partitioned.
    use_fused = (need_x and ctx.fused and not ctx.fused_used and type(grad_out) is Tensor
                 and not torch.compiler.is_compiling())
    if use_fused:
        ctx.fused_used = True
        gx, ctx.fused_grad = ctx.fused_grad, None
        scale_grad_(gx, grad_out)
    if (need_x and not use_fused) or need_t:
        bx, bt = backward(grad_out, input, target, reduce, divisor, log_target, from_probs,
                          need_x and not use_fused, need_t)
        if need_x and not use_fused:
            gx = bx
        if need_t:
            gt = bt
    if gx is not None and gx.shape != ctx.input_shape:
        gx = gx.sum_to_size(ctx.input_shape)
    if gt is not None and gt.shape != ctx.target_shape:
        gt = gt.sum_to_size(ctx.target_shape)
    return gx, gt


def _backward(ctx, grad_out, _grad_of_fused_grad):
    return (*_backward_with(ctx, grad_out, _scale_grad_op, _backward_op), None, None, None, None, None)


class _EagerKLDiv(torch.autograd.Function):
    """Eager training: the same kernels and backward rule as the registered op, without the dispatcher's
    Python round trips (about 100 us per step on an H200, which decided small training steps)."""

    @staticmethod
    def forward(ctx, input, target, reduce, divisor, log_target, from_probs, want_grad):
        mod = _module(input.device)
        out, fused_grad = mod.kl_div_forward(input, target, reduce, divisor, log_target, from_probs, want_grad)
        _save(ctx, input, target, reduce, divisor, log_target, from_probs, want_grad, fused_grad)
        ctx.module = mod
        return out

    @staticmethod
    def backward(ctx, grad_out):
        mod = ctx.module
        return (*_backward_with(ctx, grad_out, mod.kl_div_scale_grad_, mod.kl_div_backward),
                None, None, None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ front end
def _check(input, target, reduction: str, log_target) -> tuple[Tensor, Tensor, torch.Size]:
    for name, t in (("input", input), ("target", target)):
        if not isinstance(t, Tensor):
            raise TypeError(f"kl_div: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_floating_point()):
            raise TypeError(f"kl_div: {name} must have a floating-point dtype (float16, bfloat16, float32, "
                            f"float64), got {t.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"kl_div: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(log_target, bool):
        raise TypeError(f"kl_div: log_target must be a bool, got {type(log_target).__name__}")
    if input.device != target.device:
        # As in PyTorch, a 0-d CPU tensor combines with a tensor on any device (it is a scalar).
        if target.dim() == 0 and target.device.type == "cpu":
            target = target.to(input.device)
        elif input.dim() == 0 and input.device.type == "cpu":
            input = input.to(target.device)
        else:
            raise ValueError(f"kl_div: input and target must be on the same device, got {input.device} and "
                             f"{target.device}")
    if input.device.type not in ("cpu", "cuda"):
        raise NotImplementedError(f"kl_div: no kernels for {input.device.type} tensors (cpu and cuda only)")
    try:
        # torch.broadcast_shapes costs ~10 us of Python: a noticeable share of a small training step.
        shape = input.shape if input.shape == target.shape else torch.broadcast_shapes(input.shape, target.shape)
    except RuntimeError:
        raise ValueError(f"kl_div: input of shape {tuple(input.shape)} and target of shape "
                         f"{tuple(target.shape)} are not broadcastable") from None
    # torch.result_type for two floating tensors, written so that Dynamo can trace it (torch.result_type
    # is a graph break): a 0-d tensor yields to a dimensioned one of the same category.
    if input.dtype == target.dtype:
        dtype = input.dtype
    elif (input.dim() == 0) == (target.dim() == 0):
        dtype = torch.promote_types(input.dtype, target.dtype)
    else:
        dtype = target.dtype if input.dim() == 0 else input.dtype
    if input.dtype != dtype:
        input = input.to(dtype)
    if target.dtype != dtype:
        target = target.to(dtype)
    return input, target, shape


def _divisor(reduction: str, input: Tensor, shape: torch.Size) -> float:
    if reduction == "sum":
        return 1.0
    if reduction == "mean":
        return float(shape.numel())
    return float(input.shape[0]) if input.dim() > 0 else 1.0  # batchmean, as F.kl_div: sum for 0-d input


_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _kl(input: Tensor, target: Tensor, reduction: str, log_target: bool, from_probs: bool,
        warn_mean: bool = True) -> Tensor:
    # Fast path for the common valid inference call (one shape, one dtype, no autograd, eager): straight to
    # the kernels. A launch-bound call is dominated by host time, and every check here costs microseconds.
    # The kernels re-check devices and dtypes in C++; anything unusual takes the checked path below.
    if (type(input) is Tensor and type(target) is Tensor and input.dtype is target.dtype
            and input.dtype in _FLOAT_DTYPES and input.shape == target.shape and type(log_target) is bool
            and reduction in _REDUCTION_SET
            and not (torch.is_grad_enabled() and (input.requires_grad or target.requires_grad))
            and not torch.compiler.is_compiling()):
        if reduction == "mean" and warn_mean:
            warnings.warn(_MEAN_WARNING, stacklevel=3)
        reduce = reduction != "none"
        divisor = _divisor(reduction, input, input.shape) if reduce else 1.0
        mod = _MODULES.get("cuda" if input.is_cuda else "cpu") or _module(input.device)
        try:
            return mod.kl_div_forward(input, target, reduce, divisor, log_target, from_probs, False)[0]
        except RuntimeError:
            _check(input, target, reduction, log_target)  # raises the same friendly error as the checked path
            raise

    input, target, shape = _check(input, target, reduction, log_target)
    if reduction == "mean" and warn_mean:
        warnings.warn(_MEAN_WARNING, stacklevel=3)
    reduce = reduction != "none"
    divisor = _divisor(reduction, input, shape) if reduce else 1.0
    grad_enabled = torch.is_grad_enabled() and (input.requires_grad or target.requires_grad)
    if not grad_enabled and not torch.compiler.is_compiling():
        out, _ = _module(input.device).kl_div_forward(input, target, reduce, divisor, log_target, from_probs,
                                                      False)
        return out
    # The forward writes the input's gradient when it can lay it out like the input: same shape as the
    # broadcast, both operands contiguous (otherwise backward computes it). A broadcast target is not dense
    # over the broadcast shape (the CUDA kernel's fused path refuses it), hence target.shape == shape too.
    want_grad = bool(reduce and grad_enabled and input.requires_grad and input.shape == shape
                     and target.shape == shape and input.is_contiguous() and target.is_contiguous())
    if torch.compiler.is_compiling():
        out, _ = _forward_op(input, target, reduce, divisor, log_target, from_probs, want_grad)
        return out
    return _EagerKLDiv.apply(input, target, reduce, divisor, log_target, from_probs, want_grad)


def kl_div(input: Tensor, target: Tensor, size_average=None, reduce=None, reduction: str = "mean",
           log_target: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.kl_div``: ``input`` holds log-probabilities, ``target``
    probabilities (log-probabilities when ``log_target``). Reductions ``none|mean|sum|batchmean``."""
    if size_average is not None or reduce is not None:
        return _legacy(input, target, size_average, reduce, reduction, log_target)
    return _kl(input, target, reduction, log_target, from_probs=False)


def _legacy(input, target, size_average, reduce, reduction, log_target):
    """F.kl_div's handling of the deprecated arguments, quirks included: they choose the reduction, no
    'mean' warning is given, and reduction='batchmean' still divides the result by input.size(0)."""
    from torch.nn import _reduction

    out = _kl(input, target, _reduction.legacy_get_string(size_average, reduce), log_target, from_probs=False,
              warn_mean=False)
    if reduction == "batchmean" and input.dim() != 0:
        out = out / input.size(0)
    return out


def kl_div_from_probs(predictions: Tensor, targets: Tensor, reduction: str = "batchmean",
                      log_target: bool = False) -> Tensor:
    """``F.kl_div(torch.log(predictions), targets, reduction=...)`` in one pass: the log is taken in the
    kernel. Same semantics as that expression, gradients included (w.r.t. the probabilities)."""
    return _kl(predictions, targets, reduction, log_target, from_probs=True)


class KLDivLoss(torch.nn.Module):
    """Like ``torch.nn.KLDivLoss``, computed by the kit's kernels."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False):
        super().__init__()
        if size_average is not None or reduce is not None:
            from torch.nn import _reduction

            reduction = _reduction.legacy_get_string(size_average, reduce)
        if reduction not in REDUCTIONS:
            raise ValueError(f"KLDivLoss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.reduction, self.log_target = reduction, log_target

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        # torch.nn.KLDivLoss passes only reduction= to F.kl_div (legacy arguments were turned into it)
        return kl_div(input, target, reduction=self.reduction, log_target=self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"
