"""The public op: validation, broadcasting, reductions, autograd and torch.library registration.

``kl_div`` has ``torch.nn.functional.kl_div``'s signature and semantics; ``kl_div_from_probs`` takes
probabilities and takes their log inside the kernel (``F.kl_div(torch.log(p), t, ...)`` in one pass).

Four paths reach the same kernels (``kernels/``), never PyTorch's kl_div or xlogy (only a broadcast
operand's gradient is summed back to its shape with ``sum_to_size``):
- eager, no autograd: the compiled module is called directly (a launch-bound call is mostly host time);
- eager training: ``_EagerKLDiv``, a ``torch.autograd.Function`` with the backward rule below;
- torch.func transforms (``grad``, ``vmap`` and their compositions): ``_FuncKLDiv``, the same Function in
  the form functorch needs (``setup_context``, a ``vmap`` rule; ``_KLDivBackward`` for its gradients);
- under ``torch.compile``, and for meta tensors, FakeTensors and other tensor subclasses: three registered
  custom ops (``torch.ops.kldiv_inline.*``) with fake implementations and the same backward rule, so
  ``fullgraph=True`` has no graph break and ``torch.library.opcheck`` can test them.

Training with a reduced loss: when the input requires grad, the forward pass also writes d loss / d input
(one write beyond the reads; not for float16, whose range cannot hold the unscaled gradient, nor under
torch.compile, whose backward computes it). Backward multiplies it in place by grad_output on the device, a kernel that
returns at once when grad_output is 1 (``loss.backward()``): no extra pass and no host synchronisation.
Second derivatives are not supported: differentiating a gradient of this op raises.

``reduction='none'`` lays its result out as ``F.kl_div`` does (``layout.py``): the operands are permuted so
that the kernel writes memory in order, and the result is permuted back.

As ``F.kl_div``: under autocast (kl_div is on its float32 list) 16-bit operands are computed in float32; the
deprecated reduction='elementwise_mean' means 'mean', and the legacy size_average/reduce arguments override
``reduction`` (warnings included). Forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``,
``jacfwd``) is refused with an error: the kernels have no tangent rule.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import layout
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



@torch.compiler.assume_constant_result
def _warn_mean() -> bool:
    """F.kl_div's 'mean' warning. Under torch.compile Dynamo runs this once, while tracing (it cannot trace
    warnings.warn): the compiled function warns when it is compiled, as torch.nn.KLDivLoss does there."""
    warnings.warn(_MEAN_WARNING, stacklevel=4)  # the caller of kl_div (-> _kl -> _warn_mean)
    return True


# Same text as torch.nn._reduction's deprecation warning for this alias of 'mean'.
_ELEMENTWISE_MEAN_WARNING = "reduction='elementwise_mean' is deprecated. Please use reduction='mean' instead."


@torch.compiler.assume_constant_result
def _warn_elementwise_mean() -> bool:
    """PyTorch's deprecation warning for reduction='elementwise_mean' (traced as ``_warn_mean`` is)."""
    warnings.warn(_ELEMENTWISE_MEAN_WARNING, stacklevel=4)  # the caller of kl_div (-> _kl -> here)
    return True


_transforms_active = torch._C._are_functorch_transforms_active
# One C call, no arguments: whether autocast is on for any device type (the fast path asks it only for 16-bit
# operands, the only ones autocast's float32 policy changes).
_any_autocast = torch._C._is_any_autocast_enabled
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


def _dual_level_active() -> bool:
    """Whether a forward-AD dual level is entered (only then can a tensor carry a tangent). Without the attribute
    (a later PyTorch's) the answer is yes: the tensors are then asked one by one."""
    return getattr(forward_ad, "_current_level", 0) >= 0


def _forward_ad_error(who: str) -> NotImplementedError:
    return NotImplementedError(
        f"kldiv_inline.{who}: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp, jacfwd, hessian) is not "
        "supported: the kernels have no tangent rule, and the tangent would otherwise be dropped. Use reverse mode "
        "(backward, torch.func.grad, jacrev), or torch.nn.functional.kl_div where forward mode is needed.")


def _refuse_tangents(who: str, *tensors) -> None:
    """Raises where an operand carries a forward-AD tangent: the kernels would return a primal without one.
    Also while compiling: Dynamo cannot take a dual tensor and runs such a call eagerly, in a frame that it may
    have traced already (a check skipped while tracing would be missing from it)."""
    for t in tensors:
        if isinstance(t, Tensor) and forward_ad.unpack_dual(t).tangent is not None:
            raise _forward_ad_error(who)


def _autocast_operand(t):
    """autocast's float32 policy for kl_div (on PyTorch's autocast float32 list), as F.kl_div gets it: a 16-bit
    floating operand on a device type whose autocast is on is cast to float32 (float64 stays float64). The cast
    is recorded by autograd, so the gradient comes back in the operand's own dtype, as PyTorch's does. Only the
    kernels' device types are asked: autocast has no state for others (meta), and casts nothing there."""
    if isinstance(t, Tensor) and t.dtype in _HALF_DTYPES:
        device_type = t.device.type
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            return t.float()
    return t


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
                from_probs: bool, want_grad: bool, wide: bool = False) -> tuple[Tensor, Tensor]:
    """``wide``: a reduced loss in float32 for 16-bit operands (float64 for float64), for a caller that divides
    the sum itself (the traced loss: _dispatch)."""
    out, grad = _module(input.device).kl_div_forward(input, target, reduce, divisor, log_target, from_probs,
                                                     want_grad, wide)
    return out, _undefined_to_empty(grad, input)


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@_forward_op.register_fake
def _(input, target, reduce, divisor, log_target, from_probs, want_grad, wide=False):
    shape = torch.broadcast_shapes(input.shape, target.shape)
    out = (input.new_empty((), dtype=_wide_dtype(input.dtype) if wide else input.dtype) if reduce
           else input.new_empty(shape))
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


def _save(ctx, inputs, fused_grad, sources=None):
    """``sources``: the operands as the caller passed them, where the kernels got converted copies (another dtype,
    a resolved negative view): their versions are the ones to check."""
    input, target, reduce, divisor, log_target, from_probs, want_grad = inputs[:7]  # (the op's wide: its dtype)
    ctx.flags = (reduce, divisor, log_target, from_probs)
    ctx.fused = want_grad
    ctx.fused_used = False
    ctx.input_shape, ctx.target_shape, ctx.input_dtype = input.shape, target.shape, input.dtype
    # The input is saved only where a gradient reads its values, as F.kl_div's autograd keeps it: the probability
    # form's (t / p) and the target's (log t - x). The log-probability form's input gradient, -t (or -exp(t)) times
    # grad_output, reads the target alone: there the input is not kept at all (backward gives the kernels a stand-in,
    # _stand_in), so that one changed in place after the forward (logits updated before backward) leaves backward
    # valid, as in PyTorch (saving it raised autograd's in-place error), and its memory is freed as PyTorch frees it
    # (a reference held on ctx kept it for the loss's lifetime, past checkpointing). Saved as ever under
    # torch.func's transforms and when traced (AOTAutograd).
    keep_input = from_probs or ctx.needs_input_grad[1] or _transforms_active() or not _plain(input, target)
    ctx.save_for_backward(input if keep_input else None, target)
    # Kept outside save_for_backward: backward rescales it in place, which would fail the saved-tensor
    # version check of a second backward (retain_graph=True); and handing it over (dropping this reference)
    # lets AccumulateGrad adopt it as .grad instead of cloning it. Detached: no reference cycle via grad_fn.
    ctx.fused_grad = fused_grad.detach() if want_grad else None
    # The operands F.kl_div's autograd would have saved for the input's gradient, with their versions now: a
    # backward that only rescales the fused gradient reads neither, yet refuses one changed in place since, as
    # PyTorch's does (the target, which x * t keeps; and the probability, which torch.log keeps; with log_target
    # PyTorch keeps exp(t) and t - log p, new tensors, so a change to t passes there). Not under saved-tensor hooks
    # that pack copies (save_on_cpu), which PyTorch does not check (checkpointing's, use_reentrant=False, refuse).
    src_input, src_target = sources if sources is not None else (input, target)
    check = want_grad and not _packs_copies()
    ctx.fused_versions = tuple((weakref.ref(t), t._version, what) for t, what in
                               (((src_input, "input (probabilities)") if from_probs else (None, "")),
                                ((src_target, "target") if not log_target else (None, "")))
                               if isinstance(t, Tensor) and not t.is_inference()) if check else ()
    ctx.set_materialize_grads(False)


# The innermost saved-tensor hooks in force (torch.autograd.graph.saved_tensors_hooks, save_on_cpu), or None.
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda ignore_is_tracing: None)


def _packs_copies() -> bool:
    """Whether saved tensors are packed by hooks that PyTorch does not version-check (save_on_cpu, an offloading
    hook of one's own): any innermost hooks but checkpointing's (use_reentrant=False), under which PyTorch refuses
    a changed operand (their pack function's name says whose they are; torch offers no other mark). (Checkpointing
    inside save_on_cpu is checked here where PyTorch runs: the safe side.)"""
    hooks = _top_hooks(False)
    return hooks is not None and not getattr(hooks[0], "__qualname__", "").startswith("_checkpoint_hook.")


def _setup_context(ctx, inputs, output):
    """For the Functions whose second output is the fused gradient (the registered op, _FuncKLDiv)."""
    _save(ctx, inputs, output[1])
    # The second output is not part of the loss: without this, autograd would fill a zero tensor of its size
    # as its incoming gradient on every backward (a full extra pass).
    ctx.mark_non_differentiable(output[1])


def _plain(*tensors: Tensor) -> bool:
    """Tensors the compiled module can take as they are (not meta, fake or another subclass)."""
    return all(type(t) in _PLAIN and t.device.type != "meta" for t in tensors)


def _backward_with(ctx, grad_out):
    """The backward rule of the registered op, ``_EagerKLDiv`` and ``_FuncKLDiv``."""
    if grad_out is None:  # the loss took no part in what was differentiated
        return None, None
    reduce, divisor, log_target, from_probs = ctx.flags
    need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    gx = gt = None
    rounded = None  # (the dtype the gradients are rounded to after their sums, where made in float32)
    grad_out = grad_out.to(ctx.input_dtype).resolve_neg()  # (a negative view: see _kl)
    # The fused gradient is rescaled in place, once: a second backward (retain_graph=True) recomputes.
    # Any tracing (Dynamo, or AOTAutograd alone as in opcheck, which passes tensor subclasses) takes the
    # functional path too: an in-place update of a forward output cannot be partitioned. So does
    # create_graph=True (grad mode on here): the fused gradient has no graph to carry.
    use_fused = (need_x and ctx.fused and not ctx.fused_used and type(grad_out) is Tensor
                 and not torch.compiler.is_compiling() and not torch.is_grad_enabled() and not batched_grad(grad_out))
    if use_fused:
        for ref, version, what in ctx.fused_versions:
            t = ref()
            if t is not None and t._version != version:
                raise RuntimeError(f"{'kl_div_from_probs' if from_probs else 'kl_div'}: one of the variables needed "
                                   f"for gradient computation has been modified by an inplace operation: the "
                                   f"{what} is at version {t._version}, at {version} in the forward (as "
                                   "torch.nn.functional.kl_div's autograd refuses it)")
        ctx.fused_used = True
        gx, ctx.fused_grad = ctx.fused_grad, None
        _module(gx.device).kl_div_scale_grad_(gx, grad_out)
    if (need_x and not use_fused) or need_t:
        # Read only here: rescaling the fused gradient needs neither operand, so one changed in place after the
        # forward is no error there (the gradient was computed from the values the loss was).
        input, target = ctx.saved_tensors
        if input is None:  # (not kept: _save)
            input = _stand_in(ctx, target)
        want_x = need_x and not use_fused
        shape = torch.broadcast_shapes(ctx.input_shape, ctx.target_shape)
        spread = from_probs and want_x and ctx.input_shape != shape
        lanes = _wide_dtype(input.dtype)
        if lanes != input.dtype and ((want_x and ctx.input_shape != shape) or (need_t and ctx.target_shape != shape)):
            # A broadcast operand's gradient sums the per-element ones over the broadcast dimensions: for 16-bit
            # operands they are made in float32 (the kernels' lanes), summed, and rounded once. Rounded each
            # first, a float16 mean's target gradient over 48 rows summed 48 subnormals: 1-2% off (PyTorch's,
            # which rounds each too, 5-10%). The cost: float32 copies of the operands, this path only.
            rounded = input.dtype
            grad_out, input, target = grad_out.to(lanes), input.to(lanes), target.to(lanes)
        bx = bt = None
        if (want_x and not spread) or need_t:  # (a spread input's gradient alone: no call that computes nothing)
            bx, bt = _input_grads(grad_out, input, target, reduce, divisor, log_target, from_probs,
                                  want_x and not spread, need_t)
        if spread:
            # A probability broadcast over the target: the gradient w.r.t. log p, summed over the broadcast
            # dimensions, then divided by p, as autograd's chain through torch.log orders it. Each entry divided
            # by p first gave -0 / 0 = NaN where p = 0 and the targets along the broadcast mix 0 and > 0, whose
            # sum PyTorch makes -inf.
            by, _ = _input_grads(grad_out, input, target, reduce, divisor, log_target, False, True, False)
            bx = by.sum_to_size(ctx.input_shape) / input
        if want_x:
            gx = bx
        if need_t:
            gt = bt
    if gx is not None and gx.shape != ctx.input_shape:
        gx = gx.sum_to_size(ctx.input_shape)
    if gt is not None and gt.shape != ctx.target_shape:
        gt = gt.sum_to_size(ctx.target_shape)
    if rounded is not None:
        gx, gt = (g.to(rounded) if g is not None else None for g in (gx, gt))
    return gx, gt


def _stand_in(ctx, target: Tensor) -> Tensor:
    """What backward gives the kernels for an input it did not keep (the log-probability form's, whose gradient
    -t g or -exp(t) g the kernels compute without reading x): the target where it has the input's shape and dtype
    (the kernels' contiguous layout, where a broadcast zero took the per-element index path: float16's backward
    1.7 x slower on the CPU twin), else a zero broadcast to the input's shape. It carries no graph: under
    create_graph=True that gradient depends on nothing the input does (its derivative w.r.t. x is 0, as PyTorch's
    is), and a grad_output or target that requires grad carries _KLDivBackward's, which refuses a second
    derivative."""
    if target.shape == ctx.input_shape and target.dtype == ctx.input_dtype:
        return target.detach()
    return torch.zeros((), dtype=ctx.input_dtype, device=target.device).expand(ctx.input_shape)


def batched_grad(grad: Tensor) -> bool:
    """A grad_output of torch.autograd's batched backward (is_grads_batched=True, jacobian(vectorize=True)): a
    tensor with no storage of its own, which a registered op takes slice by slice (vmap's fallback) and a kernel
    called directly cannot read; fused gradients are scaled out of place. The distillation ops ask it too."""
    return torch._C._functorch.is_legacy_batchedtensor(grad)


def _input_grads(grad_out, input, target, reduce, divisor, log_target, from_probs, want_x, want_t):
    if torch.compiler.is_compiling() or not _plain(grad_out, input, target) or batched_grad(grad_out):
        return _backward_op(grad_out, input, target, reduce, divisor, log_target, from_probs, want_x, want_t)
    if torch.is_grad_enabled() or _transforms_active():
        return _KLDivBackward.apply(grad_out, input, target, reduce, divisor, log_target, from_probs, want_x,
                                    want_t)
    return _module(input.device).kl_div_backward(grad_out, input, target, reduce, divisor, log_target,
                                                 from_probs, want_x, want_t)


def _backward(ctx, grad_out, _grad_of_fused_grad):
    return (*_backward_with(ctx, grad_out), None, None, None, None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _batch_first(batch: int, in_dims, *tensors: Tensor) -> list[Tensor]:
    """For a vmap rule: each tensor with its mapped dimension first (expanded where it has none) and size-1
    dimensions after it up to a common rank, so that per-sample broadcasting lines up."""
    moved = [v.movedim(d, 0) if d is not None else v.expand(batch, *v.shape)
             for v, d in zip(tensors, in_dims)]
    rank = max(v.dim() for v in moved)
    return [v.reshape((batch,) + (1,) * (rank - v.dim()) + tuple(v.shape[1:])) for v in moved]


def _vmap_forward(forward):
    """A vmap rule for a forward with the registered op's signature (``forward``: ``_FuncKLDiv.apply`` or
    the op): every sample's loss from one elementwise call over the batch, then per-sample sums (in float32
    for 16-bit inputs, as the kernels accumulate). No fused gradient: the backward recomputes."""
    def rule(info, in_dims, input, target, reduce, divisor, log_target, from_probs, want_grad, wide=False):
        x, t = _batch_first(info.batch_size, in_dims[:2], input, target)
        if not reduce:
            out = forward(x, t, False, 1.0, log_target, from_probs, False)[0]
        else:
            acc = _wide_dtype(x.dtype)
            per_element = forward(x.to(acc), t.to(acc), False, 1.0, log_target, from_probs, False)[0]
            if per_element.dim() > 1:
                per_element = per_element.sum(tuple(range(1, per_element.dim())))
            out = (per_element / divisor).to(acc if wide else x.dtype)
        return (out, x.new_empty((0,))), (0, None)
    return rule


def _vmap_backward(backward):
    """A vmap rule for a backward with the registered op's signature: the reduced case becomes the
    elementwise one, with each sample's grad_output (over the divisor) spread over its elements."""
    def rule(info, in_dims, grad_out, input, target, reduce, divisor, log_target, from_probs, want_x, want_t):
        go, x, t = _batch_first(info.batch_size, in_dims[:3], grad_out, input, target)
        if reduce:
            go = go / divisor
        go = go.expand(torch.broadcast_shapes(x.shape, t.shape))
        grads = backward(go, x, t, False, 1.0, log_target, from_probs, want_x, want_t)
        return tuple(grads), (0 if want_x else None, 0 if want_t else None)
    return rule


def _jvp(ctx, *tangents):
    """The Functions' forward-mode rule: a clear error (the operands' own check catches torch.autograd.forward_ad
    before the kernels run; this catches what reaches a Function with tangents, such as jvp of a grad)."""
    raise _forward_ad_error("kl_div_from_probs" if getattr(ctx, "flags", (False,) * 4)[3] else "kl_div")


def _forward_kernels(input, target, reduce, divisor, log_target, from_probs, want_grad):
    out, fused_grad = _module(input.device).kl_div_forward(input, target, reduce, divisor, log_target,
                                                           from_probs, want_grad)
    return out, _undefined_to_empty(fused_grad, input)


class _EagerKLDiv(torch.autograd.Function):
    """Eager training: the same kernels and backward rule as the registered op, without the dispatcher's
    Python round trips (about 100 us per step on an H200, which decided small training steps). Written with
    ctx in forward on purpose: a Function with setup_context binds its arguments through inspect.signature
    on every call (~40 us of host time)."""

    @staticmethod
    def forward(ctx, *inputs):
        # (inputs: the op's seven arguments, then the operands as the caller passed them: _save's sources)
        out, fused_grad = _forward_kernels(*inputs[:7])
        _save(ctx, inputs[:7], fused_grad, inputs[7])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward_with(ctx, grad_out), None, None, None, None, None, None)

    jvp = staticmethod(_jvp)


class _FuncKLDiv(torch.autograd.Function):
    """The same under torch.func transforms, which need setup_context and a vmap rule. Returns (loss, fused
    gradient or an empty tensor), like the registered op."""

    forward = staticmethod(_forward_kernels)
    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, grad_out, _grad_of_fused_grad):
        return (*_backward_with(ctx, grad_out), None, None, None, None, None)

    jvp = staticmethod(_jvp)
    vmap = staticmethod(_vmap_forward(lambda *args: _FuncKLDiv.apply(*args)))


_DOUBLE_BACKWARD = (
    "kldiv_inline: double backward is not supported: a gradient of kl_div / kl_div_from_probs was differentiated "
    "again (create_graph=True for a gradient penalty, a Hessian, torch.func.grad of a grad, jvp of a grad). Use "
    "torch.nn.functional.kl_div where second derivatives are needed.")


class _KLDivBackward(torch.autograd.Function):
    """The gradients as a Function of their own, used when they must carry a graph (create_graph=True,
    torch.func): that graph raises if differentiated (no second derivative: a gradient penalty would
    otherwise silently lose its term), and the vmap rule gives per-sample gradients."""

    @staticmethod
    def forward(grad_out, input, target, reduce, divisor, log_target, from_probs, want_x, want_t):
        gx, gt = _module(input.device).kl_div_backward(grad_out, input, target, reduce, divisor, log_target,
                                                       from_probs, want_x, want_t)
        return _undefined_to_empty(gx, input), _undefined_to_empty(gt, input)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD)

    @staticmethod
    def jvp(ctx, *tangents):  # forward-over-reverse (jvp of a grad, hessian): a second derivative too
        raise RuntimeError(_DOUBLE_BACKWARD)

    vmap = staticmethod(_vmap_backward(lambda *args: _KLDivBackward.apply(*args)))


torch.library.register_vmap("kldiv_inline::kl_div_forward", _vmap_forward(_forward_op))
torch.library.register_vmap("kldiv_inline::kl_div_backward", _vmap_backward(_backward_op))


# ------------------------------------------------------------------------------------------ front end
class _DtypeError(TypeError, RuntimeError):
    """A non-floating operand: a TypeError, and a RuntimeError as F.kl_div's ("Integral inputs not supported"), so
    that code written against PyTorch's op (``except RuntimeError``) catches it too."""


class _OperandsError(ValueError, RuntimeError):
    """Operands that do not go together (shapes that do not broadcast, two devices): a ValueError, and a
    RuntimeError as F.kl_div's."""


def _check_reduction(reduction, where: str = "kl_div") -> None:
    if not isinstance(reduction, str):
        raise TypeError(f"{where}: reduction must be a str, one of {REDUCTIONS}, got {type(reduction).__name__} "
                        f"{reduction!r}")
    if reduction not in REDUCTIONS and reduction != "elementwise_mean":  # PyTorch's deprecated alias of 'mean'
        raise ValueError(f"{where}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check(input, target, reduction: str, log_target) -> tuple[Tensor, Tensor, torch.Size, torch.dtype]:
    """Checks the arguments; returns the operands (a 0-d CPU operand moved to the other's device), the
    broadcast shape and the result dtype (the operands are not converted yet)."""
    for name, t in (("input", input), ("target", target)):
        if not isinstance(t, Tensor):
            raise TypeError(f"kl_div: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_floating_point()):
            raise _DtypeError(f"kl_div: {name} must have a floating-point dtype (float16, bfloat16, float32, "
                              f"float64), got {t.dtype}")
    _check_reduction(reduction)
    if not isinstance(log_target, bool):
        kind = type(log_target)
        raise TypeError(f"kl_div: log_target must be a bool, got "
                        f"{kind.__name__ if kind.__module__ == 'builtins' else kind.__module__ + '.' + kind.__name__}")
    if input.device != target.device:
        # As in PyTorch, a 0-d CPU tensor combines with a tensor on any device (it is a scalar).
        if target.dim() == 0 and target.device.type == "cpu":
            target = target.to(input.device)
        elif input.dim() == 0 and input.device.type == "cpu":
            input = input.to(target.device)
        else:
            raise _OperandsError(f"kl_div: input and target must be on the same device, got {input.device} "
                                 f"and {target.device}")
    if input.device.type not in ("cpu", "cuda", "meta"):
        raise NotImplementedError(f"kl_div: no kernels for {input.device.type} tensors (cpu and cuda only)")
    for name, t in (("input", input), ("target", target)):
        if t.layout != torch.strided:  # (sparse, mkldnn: the kernels read a dense tensor's memory)
            raise NotImplementedError(f"kl_div: {name} is a {t.layout} tensor; the kernels take dense (strided) "
                                      f"tensors: pass {name}.to_dense()")
    try:
        # torch.broadcast_shapes costs ~10 us of Python: a noticeable share of a small training step.
        shape = input.shape if input.shape == target.shape else torch.broadcast_shapes(input.shape, target.shape)
    except RuntimeError:
        raise _OperandsError(f"kl_div: input of shape {tuple(input.shape)} and target of shape "
                             f"{tuple(target.shape)} are not broadcastable") from None
    # torch.result_type for two floating tensors, written so that Dynamo can trace it (torch.result_type
    # is a graph break): a 0-d tensor yields to a dimensioned one of the same category.
    if input.dtype == target.dtype:
        dtype = input.dtype
    elif (input.dim() == 0) == (target.dim() == 0):
        dtype = torch.promote_types(input.dtype, target.dtype)
    else:
        dtype = target.dtype if input.dim() == 0 else input.dtype
    return input, target, shape, dtype


def _divisor(reduction: str, input: Tensor, shape: torch.Size) -> float:
    if reduction == "sum":
        return 1.0
    if reduction == "mean":
        return float(shape.numel())
    return float(input.shape[0]) if input.dim() > 0 else 1.0  # batchmean, as F.kl_div: sum for 0-d input


_FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_PLAIN = (Tensor, torch.nn.Parameter)  # tensor types the compiled module can take as they are


def _kl(input: Tensor, target: Tensor, reduction: str, log_target: bool, from_probs: bool,
        warn_mean: bool = True) -> Tensor:
    # Fast path for the common valid inference call (one shape, one dtype, no autograd, eager, a CPU or CUDA
    # tensor, no autocast of 16-bit operands, no forward-AD dual level): straight to the kernels. A launch-bound
    # call is dominated by host time, and every check here costs microseconds. The kernels re-check devices and
    # dtypes in C++; anything unusual takes the checked path below.
    if (type(input) is Tensor and type(target) is Tensor and input.dtype is target.dtype
            and input.dtype in _FLOAT_DTYPES and input.shape == target.shape and type(log_target) is bool
            and type(reduction) is str and reduction in _REDUCTION_SET
            and not (torch.is_grad_enabled() and (input.requires_grad or target.requires_grad))
            and (input.is_cuda or input.is_cpu) and not torch.compiler.is_compiling()
            and not _transforms_active() and (input.dtype not in _HALF_DTYPES or not _any_autocast())
            and getattr(forward_ad, "_current_level", 0) < 0  # _dual_level_active(), inlined: host time
            and not input.is_neg() and not target.is_neg()):  # (negative views: see below; after is_compiling)
        if reduction == "mean" and warn_mean:
            _warn_mean()
        reduce = reduction != "none"
        divisor = _divisor(reduction, input, input.shape) if reduce else 1.0
        mod = _MODULES.get("cuda" if input.is_cuda else "cpu") or _module(input.device)
        try:
            if reduce or (input.is_contiguous() and target.is_contiguous()):
                return mod.kl_div_forward(input, target, reduce, divisor, log_target, from_probs, False)[0]
        except RuntimeError:
            _check(input, target, reduction, log_target)  # raises the same friendly error as the checked path
            raise

    if _dual_level_active():
        _refuse_tangents("kl_div_from_probs" if from_probs else "kl_div", input, target)
    if type(reduction) is str and reduction == "elementwise_mean":
        # PyTorch's deprecated spelling of 'mean': its own warning, not the 'mean' one (as F.kl_div gives).
        _warn_elementwise_mean()
        reduction, warn_mean = "mean", False
    if _any_autocast():
        # Before the layout is read: F.kl_div's result follows the cast operands' strides.
        input, target = _autocast_operand(input), _autocast_operand(target)
    operands = (input, target)
    input, target, shape, dtype = _check(input, target, reduction, log_target)
    # A negative view (x.conj().imag of a complex x) is a negation PyTorch applies when its ops read it; the
    # kernels read the memory itself, so they take a resolved copy (a no-op for every other tensor).
    input, target = input.resolve_neg(), target.resolve_neg()
    if reduction == "mean" and warn_mean:
        _warn_mean()
    reduce = reduction != "none"
    order = None
    if (not reduce and not (input.is_contiguous() and target.is_contiguous())
            and input.numel() and target.numel()):
        # F.kl_div's layout (transposed, channels_last, ...), decided by the operands as passed.
        strides = layout.kl_div_strides(*operands, tuple(shape), from_probs)
        order = layout.outer_to_inner(tuple(shape), strides)
    # The dtype the kernels run in: the result's, or the wider operand's where the result is narrower than it.
    # That happens only for a 0-d operand beside a dimensioned one (a float64 target of 1e-8 with float16
    # log-probabilities; a 0-d float32 p = 1e-8 with a float16 target): rounded to the result's dtype first it
    # would flush to 0 or overflow (a loss of 0, an inf, a NaN gradient), where F.kl_div keeps it in its own
    # precision inside its ops. So both run in the wider dtype and only the result is rounded (the gradients too:
    # through the casts' autograd, each in its operand's dtype). It costs a wider copy of the dimensioned operand,
    # for this rare mix only.
    work = torch.promote_types(input.dtype, target.dtype)
    if input.dtype != work:
        input = input.to(work)
    if target.dtype != work:
        target = target.to(work)
    if order is not None:  # iterate in the result's memory order: the kernel writes it row-major
        input = input[(None,) * (len(shape) - input.dim())].permute(order)
        target = target[(None,) * (len(shape) - target.dim())].permute(order)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        out = _dispatch(input, target, False, 1.0, log_target, from_probs, operands).permute(inverse)
        return layout.with_strides(out if work == dtype else out.to(dtype), strides)
    divisor = _divisor(reduction, input, shape) if reduce else 1.0
    out = _dispatch(input, target, reduce, divisor, log_target, from_probs, operands)
    return out if work == dtype else out.to(dtype)


def _dispatch(input: Tensor, target: Tensor, reduce: bool, divisor: float, log_target: bool,
              from_probs: bool, sources: tuple) -> Tensor:
    """Checked operands of one dtype -> the path that suits them (see the module docstring). ``sources``: the
    operands as the caller passed them (before a conversion to one dtype: _save checks their versions)."""
    grad_enabled = torch.is_grad_enabled() and (input.requires_grad or target.requires_grad)
    compiling = torch.compiler.is_compiling()
    if compiling or type(input) not in _PLAIN or type(target) not in _PLAIN or input.device.type == "meta":
        # No fused gradient: a traced backward computes the gradient from the inputs (it cannot update a forward
        # output in place), so a gradient written by the forward was a write nobody read. Reading input and
        # target again in backward moves as many bytes as the fused gradient rescaled out of place would.
        if reduce and compiling:
            # Traced, the divisor (batchmean's batch, mean's numel) may be symbolic (dynamic shapes): the op's
            # float argument fixed it in a guard, so every new size recompiled (and fullgraph=True failed at the
            # recompile limit). The sum, divided outside the op, keeps it symbolic. It comes wide (float32 for
            # 16-bit operands) and is rounded once, after the division, as in eager mode: a float16 sum beyond
            # 65504 rounded first made 'mean' inf, where F.kl_div's mean accumulates in float32.
            wide_sum = _forward_op(input, target, True, 1.0, log_target, from_probs, False, True)[0]
            return (wide_sum / divisor).to(input.dtype)
        return _forward_op(input, target, reduce, divisor, log_target, from_probs, False)[0]
    if _transforms_active():  # torch.func.grad / vmap: tensors that only the Function's rules can take
        return _FuncKLDiv.apply(input, target, reduce, divisor, log_target, from_probs, False)[0]
    if not grad_enabled:
        return _module(input.device).kl_div_forward(input, target, reduce, divisor, log_target, from_probs,
                                                    False)[0]
    want_grad = _wants_fused_grad(input, target, reduce, grad_enabled)
    return _EagerKLDiv.apply(input, target, reduce, divisor, log_target, from_probs, want_grad, sources)


def _wants_fused_grad(input: Tensor, target: Tensor, reduce: bool, grad_enabled: bool) -> bool:
    # The forward writes the input's gradient when it can lay it out like the input: same shape as the
    # broadcast, both operands contiguous (otherwise backward computes it). A broadcast target is not dense
    # over the broadcast shape (the CUDA kernel's fused path refuses it), hence target.shape == input.shape.
    # Not float16: the reduced loss's gradient, -t / divisor (~1e-7 an entry over 1024 x 8192), lies among
    # float16's subnormals or below them, and backward's rescaling by a loss scale cannot bring the lost digits
    # back (19% of the entries 0 and the median 18% off at a scale of 4096). Backward computes float16's
    # gradient with grad_output folded in, rounded once at its final size, as PyTorch does.
    return bool(reduce and grad_enabled and input.requires_grad and input.dtype != torch.float16
                and input.shape == target.shape and input.is_contiguous() and target.is_contiguous())


def kl_div(input: Tensor, target: Tensor, size_average=None, reduce=None, reduction: str = "mean",
           log_target: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.kl_div``: ``input`` holds log-probabilities, ``target``
    probabilities (log-probabilities when ``log_target``). Reductions ``none|mean|sum|batchmean``."""
    if size_average is not None or reduce is not None:
        return _legacy(input, target, size_average, reduce, reduction, log_target)
    return _kl(input, target, reduction, log_target, from_probs=False)


def _legacy(input, target, size_average, reduce, reduction, log_target):
    """F.kl_div's handling of the deprecated arguments, quirks included: they choose the reduction (its
    deprecation warning given), ``reduction`` is otherwise ignored (not checked: any value passes), no 'mean'
    warning is given, and reduction='batchmean' still divides the result by input.size(0)."""
    from torch.nn import _reduction

    out = _kl(input, target, _reduction.legacy_get_string(size_average, reduce), log_target, from_probs=False,
              warn_mean=False)
    if isinstance(reduction, str) and reduction == "batchmean" and input.dim() != 0:
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
        _check_reduction(reduction, "KLDivLoss")
        self.reduction, self.log_target = reduction, log_target

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        # torch.nn.KLDivLoss passes only reduction= to F.kl_div (legacy arguments were turned into it)
        return kl_div(input, target, reduction=self.reduction, log_target=self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"
