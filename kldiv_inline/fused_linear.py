"""The LM head fused with the distillation divergence: ``generalized_jsd`` of ``hidden @ weight.T + bias``
computed chunk by chunk of tokens, so the logits are never whole.

    loss = fused_linear_generalized_jsd(student_hidden, student_head.weight, teacher_hidden, teacher_head.weight,
                                        beta=0.5, temperature=2.0, labels=labels)
    loss.backward()        # gradients of student_hidden, student_head.weight (and a student bias)

Per chunk of ``chunk_size`` tokens (cuBLAS through torch, into buffers reused from chunk to chunk):
  1. the student's logits ``h @ W.T + b`` into a [chunk, V] buffer of the hidden's dtype, the teacher's likewise
     into a second one (or a slice of the given teacher logits, or of the top-k pair);
  2. one call of the divergence kernel (kernels/distill*), which reads both rows and writes d loss / d logits over
     the student's logits in the same buffer;
  3. grad hidden for the chunk ``dlogits @ W``, grad weight accumulated ``+= dlogits.T @ h``, grad bias
     ``+= dlogits.sum(0)``.
So the step costs the four matrix products (student logits, grad hidden, grad weight, teacher logits) and one
read of the logits by the kernel, and the memory beyond the inputs and the parameter gradients is the buffers.

The gradients are computed in the forward pass (when the student's tensors require grad). batchmean's divisor
(the unmasked tokens of the whole batch, counted on the device: no host synchronisation) goes to the kernel,
which scales d logits as it writes them, so the products carry it (float16 excepted: its range would flush the
scaled d logits to zero, so there each chunk's grad-weight product is scaled in float32 as it is added, grad bias
and the loss once at the end, and grad hidden in backward with grad_output: _hidden_scale). Backward only
rescales them in place by grad_output, skipped on the device when it is 1.
The teacher is a constant: no gradient flows to it, whether or not its tensors require grad.
"""
from __future__ import annotations

import contextlib
import numbers
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .distill import (
    _FLOAT_DTYPES,
    _REDUCTION_CODE,
    _acc_dtype,
    _check_labels,
    _check_settings,
    _check_teacher_logits,
    _empty_if_none,
    _is_tracing,
    _module,
    _refuse_double_backward,
    _rows,
    _scaled,
    _validate_topk,
    batched_grad,
    check_loss_scale,
    is_topk_pair,
    keep_graph,
    refuse_transforms,
    releases_held,
    save_inputs,
    saved_inputs,
)
from .vocab_parallel import (
    check_same_call,
    divergence_rows,
    dtype_code,
    group_name,
    learnt_widths,
    placed,
    resolve_group,
    same_call_due,
    slice_widths,
    topk_also,
    topk_rows,
)

__all__ = ["fused_linear_generalized_jsd", "FusedLinearGeneralizedJSDLoss", "default_chunk_size"]

# chunk_size=None: the logit buffers of one chunk (the student's, and the teacher's when it comes as hidden +
# weight) take at most this many bytes. 512 MiB: 1024 tokens of a 128256 vocabulary in bfloat16 with both buffers,
# well below 1 GiB of extra memory, and chunks large enough for the matrix products to run at full rate.
BUFFER_BYTES = 512 << 20
# Chunk sizes are rounded down to a multiple of this (when at least this large): tensor-core friendly products.
CHUNK_MULTIPLE = 128


def default_chunk_size(tokens: int, vocab: int, itemsize: int, buffers: int) -> int:
    """The tokens per chunk when chunk_size is None: as many as fit ``buffers`` logit buffers of [chunk, vocab]
    (``itemsize`` bytes an entry) in BUFFER_BYTES, rounded down to a multiple of CHUNK_MULTIPLE (or of 64, 32, ...
    for very long rows), at least 1, at most ``tokens``."""
    rows = max(1, BUFFER_BYTES // (vocab * itemsize * buffers))
    multiple = CHUNK_MULTIPLE
    while multiple > rows:
        multiple //= 2
    return max(1, min(rows - rows % multiple, max(tokens, 1)))


# ------------------------------------------------------------------------------------------ the chunks
def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor) -> Tensor:
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _accumulate(acc: Tensor, a: Tensor, b: Tensor, first: bool, scale: Tensor | None = None) -> None:
    """acc = a @ b (first) or acc += a @ b, times ``scale`` (a device scalar) when given. For an accumulator wider
    than a and b (float32 for 16-bit inputs), or with a scale, each product is formed in float32 (and scaled)
    before it is added: on CUDA in slices of acc's rows (a 64 MiB temporary), on the CPU (the twin, any speed) from
    float32 copies of the 16-bit values (exact conversions)."""
    if acc.dtype == a.dtype and scale is None:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    wide = torch.promote_types(acc.dtype, torch.float32)
    if a.is_cuda:
        step = max(1, (64 << 20) // (4 * max(1, acc.shape[1])))
        tmp = acc.new_empty((min(step, acc.shape[0]), acc.shape[1]), dtype=wide)
        slices = [(r0, min(acc.shape[0], r0 + step)) for r0 in range(0, acc.shape[0], step)]
        products = ((r0, r1, torch.mm(a[r0:r1], b, out_dtype=wide, out=tmp[: r1 - r0])) for r0, r1 in slices)
    else:
        products = iter([(0, acc.shape[0], torch.mm(a.to(wide), b.to(wide)))])
    for r0, r1, prod in products:
        if scale is not None:
            prod.mul_(scale.to(wide))
        if first:
            acc[r0:r1].copy_(prod)
        else:
            acc[r0:r1].add_(prod)


def _unmasked_first(labels: Tensor, ignore_index: int):
    """For skip_masked: (order, labels in that order, count). ``order`` lists the tokens with the unmasked ones
    first (each group in its own order), made on the device; ``count()`` returns the number of unmasked tokens on
    the host: the call's one synchronisation. Its copy to the host is queued here, ahead of the first chunk's
    products, so count() called after queuing them waits for the copy alone and the GPU computes those products
    meanwhile (waiting on the whole stream, as nonzero() does, left the GPU idle ~1 ms a step on an H200)."""
    masked = labels == ignore_index
    order = torch.argsort(masked.to(torch.int32), stable=True)
    kept = masked.numel() - masked.sum()
    if not labels.is_cuda:
        return order, labels.index_select(0, order), lambda: int(kept)
    host = torch.empty((), dtype=kept.dtype, pin_memory=True)
    host.copy_(kept, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def count() -> int:
        copied.synchronize()
        return int(host)
    return order, labels.index_select(0, order), count


def _fused(hidden: Tensor, *args):
    """_fused_chunks with autocast off: its products run in the inputs' dtypes, as the kernels do (under autocast
    a bare torch.mm came out in bfloat16 beside float32 buffers, and skip_masked's index_copy_ of it failed)."""
    device = hidden.device.type
    off = torch.autocast(device, enabled=False) if device in ("cpu", "cuda") else contextlib.nullcontext()
    with off:
        return _fused_chunks(hidden, *args)


def _fused_chunks(hidden: Tensor, weight: Tensor, bias: Tensor | None, t_hidden: Tensor | None,
                  t_weight: Tensor | None, t_bias: Tensor | None, t_logits: Tensor | None,
                  topk_idx: Tensor | None, topk_lp: Tensor | None, labels: Tensor | None, ignore_index: int,
                  beta: float, temperature: float, batchmean: bool, loss_scale: float, chunk_size: int,
                  accum_dtype: torch.dtype | None, group_name: str | None, skip_masked: bool, offset: int,
                  whole: int, want_hidden: bool, want_weight: bool, want_bias: bool):
    """The loss (batchmean or sum, times loss_scale) and its gradients w.r.t. hidden [n, H], weight and bias (each only
    if wanted, else an empty tensor); for float16, grad hidden without that scale (backward applies it with
    grad_output: _hidden_scale), the others with it.
    With ``group_name``, the vocabulary (weight's rows, bias, teacher logits) is this rank's slice: each chunk's
    divergence runs in kldiv_inline.vocab_parallel's phases, and grad hidden is summed over the group at the end;
    with a top-k teacher too, ``offset`` is where this rank's rows start in the vocabulary of ``whole`` entries (the
    front end gathered every rank's width to check the global indices: no second gather here), else both are -1.
    ``skip_masked`` (with labels): the chunks run over the tokens in _unmasked_first's order and stop after the
    unmasked ones; the first chunk's products are queued before their count is known, so where fewer tokens than a
    chunk are unmasked, that chunk holds masked ones too (their labels mask them)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc_t = _acc_dtype(hidden.dtype)
    mod = _module(hidden.device)
    want = want_hidden or want_weight or want_bias
    order = lab_order = count = None
    if skip_masked and labels is not None:
        order, lab_order, count = _unmasked_first(labels, ignore_index)
    m = n  # the tokens the chunks cover: with skip_masked, the unmasked ones once count() says how many
    g_weight = weight.new_empty(weight.shape) if want_weight else None
    w_acc = g_weight if g_weight is None or accum_dtype in (None, weight.dtype) else \
        weight.new_empty(weight.shape, dtype=accum_dtype)
    rows = min(chunk_size, n)
    s_buf = hidden.new_empty((rows, vocab))
    # The teacher's logits of a chunk: made from hidden states, or gathered from the given logits' unmasked rows.
    gather_logits = order is not None and t_logits is not None
    t_buf = hidden.new_empty((rows, vocab)) if t_hidden is not None or gather_logits else None

    def tokens(x: Tensor, r0: int, r1: int) -> Tensor:
        """Rows r0:r1 of the chunks' tokens: x's own rows, or (skipping masked tokens) its unmasked rows'."""
        return x[r0:r1] if order is None else x.index_select(0, order[r0:r1])

    def products(r0: int):
        """Queues a chunk's logits (student, and teacher from hidden states) and returns the chunk's operands."""
        r1 = min(m, r0 + chunk_size)
        h, logits = tokens(hidden, r0, r1), s_buf[: r1 - r0]
        _linear(h, weight, bias, logits)
        teacher = idx = lp = None
        if t_hidden is not None:
            teacher = _linear(tokens(t_hidden, r0, r1), t_weight, t_bias, t_buf[: r1 - r0])
        elif gather_logits:
            teacher = torch.index_select(t_logits, 0, order[r0:r1], out=t_buf[: r1 - r0])
        elif t_logits is not None:
            teacher = t_logits[r0:r1]
        else:
            idx, lp = tokens(topk_idx, r0, r1), tokens(topk_lp, r0, r1)
        return r1, h, logits, teacher, idx, lp

    # The first chunk's products go first: the small operations below each cost a launch's host time (tens of
    # microseconds), and queued ahead of the products on an idle GPU they delayed the step's first large kernel
    # by ~1 ms (a host + device trace of a step on an H100, tools/profile_fused_head.py); behind them they are free.
    first = products(0) if n > 0 else None
    if count is not None:
        m = count()  # (the GPU computes the first chunk's products meanwhile)
    # A skipped token's gradient is 0: its rows of grad hidden stay zeros, the others are written chunk by chunk.
    g_hidden = (hidden.new_empty if order is None else hidden.new_zeros)(hidden.shape) if want_hidden else None
    # The chunks' kernels reduce by sum; batchmean's divisor, the unmasked tokens of the whole batch, is counted
    # on the device (no synchronisation). The kernel applies it to d logits as it writes them (so the products
    # carry it and no pass over grad weight rescales it: that pass took 8% of a step on an H100), except for
    # float16, whose range would flush the scaled d logits to zero: there it is applied to each chunk's product
    # for grad weight in float32 (grad weight sums every token's contribution, so its unscaled sum can pass
    # float16's 65504 where the gradient itself does not), and at the end to the loss and grad bias; grad hidden
    # (one token's row each: no sum over tokens to overflow) is left unscaled, and backward applies the scale
    # with grad_output folded in, each entry rounded once (_hidden_scale): scaled here, its entries fell among
    # float16's subnormals (1 / tokens of a batch), which a GradScaler's factor in backward could not bring back.
    # loss_scale is folded into that scale (for sum it is the scale).
    code = _REDUCTION_CODE["batchmean" if batchmean else "sum"]
    scale = mod.distill_reduction_scale(hidden, labels, ignore_index, code, loss_scale) \
        if batchmean or loss_scale != 1.0 else None
    in_kernel = scale is not None and hidden.dtype != torch.float16
    k_scale = scale if in_kernel else None  # the kernels' scale (None: their sum)
    late = scale.to(acc_t) if scale is not None and not in_kernel else None  # applied at the end
    total = torch.zeros((), dtype=acc_t, device=hidden.device)
    b_acc = torch.zeros(vocab, dtype=acc_t, device=hidden.device) if want_bias else None
    group = resolve_group(group_name) if group_name is not None else None
    # d logits go over the logits where the kernel allows it (rows that sit on chip), else to their own buffer.
    in_place = mod.distill_in_place_ok(vocab, hidden.element_size(), t_hidden is None and t_logits is None)
    g_buf = None if in_place else torch.empty_like(s_buf)
    if group is not None:
        # Split over ranks, a teacher's logits' d logits go to their own buffer: whether a slice fits on chip may
        # differ between ranks, and a retry after a refusal would desynchronise the collectives. A top-k teacher's
        # split kernel makes its own (one was allocated here beside it and never written).
        g_buf = torch.empty_like(s_buf) if want and topk_idx is None else None
    ones = torch.ones((), dtype=torch.float64, device=hidden.device) if group is not None else None
    sum_code = _REDUCTION_CODE["sum"]
    if group is not None and topk_idx is not None and not 0 <= offset <= offset + vocab <= whole:
        raise RuntimeError(_err(f"a top-k teacher with a group needs this rank's place in the vocabulary: offset "
                                f"{offset} and {vocab} rows in {whole}"))
    for r0 in range(0, m, chunk_size):
        r1, h, logits, teacher, idx, lp = first if r0 == 0 else products(r0)
        # Unmasked tokens need no labels (batchmean's divisor above counted the whole batch's), but a first chunk
        # queued before m was known may hold masked ones.
        lab = labels[r0:r1] if order is None and labels is not None else lab_order[r0:r1] if r1 > m else None
        if group is not None and idx is not None:
            part, dlogits = topk_rows(logits, idx, lp, lab, ignore_index, beta, temperature, sum_code, group, offset,
                                      whole, want, k_scale)
            total += (part if k_scale is None else part * k_scale).to(acc_t)
            if not want:
                continue
        elif group is not None:
            part, dlogits, _ = divergence_rows(logits, teacher, lab, ignore_index, beta, temperature, group,
                                               ones if k_scale is None else k_scale, sum_code, want, False,
                                               g_buf[: r1 - r0] if want else None)
            total += part.to(acc_t)  # the rows' sum times k_scale
            if not want:
                continue
        else:
            args = (teacher, idx, lp, lab, ignore_index, beta, temperature, sum_code)
            if not want:
                total += mod.distill_forward(logits, *args, False, False, None, k_scale)[0]
                continue
            out = logits if g_buf is None else g_buf[: r1 - r0]
            part, dlogits, _ = mod.distill_forward(logits, *args, True, False, out, k_scale)
            total += part
        if want_hidden and order is None:
            torch.mm(dlogits, weight, out=g_hidden[r0:r1])
        elif want_hidden:
            g_hidden.index_copy_(0, order[r0:r1], torch.mm(dlogits, weight))
        if want_weight:
            _accumulate(w_acc, dlogits.t(), h, first=r0 == 0, scale=late)
        if want_bias:
            b_acc += dlogits.sum(0, dtype=acc_t)
    if want_hidden and group is not None:
        dist.all_reduce(g_hidden, group=group)  # the hidden states are replicated: their gradient sums the slices'
    if want_hidden and late is not None and hidden.dtype != torch.float16:
        g_hidden.mul_(late)  # (float16's: backward, _hidden_scale)
    if want_weight:
        if m == 0:
            g_weight.zero_()
        elif w_acc is not g_weight:
            g_weight.copy_(w_acc)  # rounding a float32 accumulator once
    g_bias = (b_acc if late is None else b_acc * late).to(bias.dtype) if want_bias else None
    loss = total if late is None else total * late
    return loss, _empty_if_none(g_hidden, hidden), _empty_if_none(g_weight, hidden), _empty_if_none(g_bias, hidden)


# ----------------------------------------------------------------------------------------- custom op
@torch.library.custom_op("kldiv_inline::fused_linear_distill", mutates_args=())
def _fused_op(hidden: Tensor, weight: Tensor, bias: Tensor | None, t_hidden: Tensor | None,
              t_weight: Tensor | None, t_bias: Tensor | None, t_logits: Tensor | None,
              topk_idx: Tensor | None, topk_lp: Tensor | None, labels: Tensor | None, ignore_index: int,
              beta: float, temperature: float, batchmean: bool, loss_scale: float, chunk_size: int,
              accum_dtype: torch.dtype | None, group_name: str | None, skip_masked: bool, offset: int, whole: int,
              want_hidden: bool, want_weight: bool, want_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _fused(hidden, weight, bias, t_hidden, t_weight, t_bias, t_logits, topk_idx, topk_lp, labels,
                  ignore_index, beta, temperature, batchmean, loss_scale, chunk_size, accum_dtype, group_name,
                  skip_masked, offset, whole, want_hidden, want_weight, want_bias)


@_fused_op.register_fake
def _(hidden, weight, bias, t_hidden, t_weight, t_bias, t_logits, topk_idx, topk_lp, labels, ignore_index, beta,
      temperature, batchmean, loss_scale, chunk_size, accum_dtype, group_name, skip_masked, offset, whole,
      want_hidden, want_weight, want_bias):
    acc_t = _acc_dtype(hidden.dtype)
    empty = hidden.new_empty((0,))
    return (hidden.new_empty((), dtype=acc_t), hidden.new_empty(hidden.shape) if want_hidden else empty,
            weight.new_empty(weight.shape) if want_weight else empty.clone(),
            bias.new_empty(bias.shape) if want_bias else empty.clone())


_N_INPUTS = 24


@torch.library.custom_op("kldiv_inline::fused_linear_scale", mutates_args=())
def _traced_scale(grad: Tensor, factor: Tensor, anchors: list[Tensor]) -> Tensor:
    """``grad * factor`` out of place, for torch.compile's traced backward. ``anchors``: the inputs whose gradient
    ``grad`` is, not read. The gradients were written by the forward and have no graph of their own; scaled by a
    plain multiplication, the compiled backward read nothing but them and grad_loss, so AOTAutograd ran a double
    backward (create_graph=True) through it and a penalty on the gradient lost its terms in the inputs without a
    word. Taking the inputs ties the compiled backward to them, and this op has no autograd: a double backward
    now meets AOTAutograd's refusal, as the eager path's _refuse_double_backward, wherever the compiled
    backward's inputs require grad when it runs. (Not where the hidden states are made inside the compiled
    region from inputs that do not and the weight is frozen: then AOTAutograd drops the term, as it does for
    PyTorch's own operations.)"""
    return _scaled(grad, factor, False)


@_traced_scale.register_fake
def _(grad, factor, anchors):
    return grad.new_empty(grad.shape)


def _hidden_scale(hidden: Tensor, labels: Tensor | None, ignore_index: int, batchmean: bool,
                  loss_scale: float) -> Tensor | None:
    """The scale float16's grad hidden leaves to backward (_fused_chunks: batchmean's 1 / unmasked tokens times
    loss_scale, or loss_scale), as a float32 0-d tensor on the hidden states' device, or None where there is none
    (1). The value of distill_reduction_scale, in torch's operations: torch.compile traces it too."""
    if not batchmean:
        return None if loss_scale == 1.0 else torch.full((), loss_scale, dtype=torch.float32, device=hidden.device)
    if labels is None:
        n = hidden.shape[0]
        return torch.full((), loss_scale / n if n else 0.0, dtype=torch.float32, device=hidden.device)
    count = (labels != ignore_index).sum().to(torch.float64)
    return torch.where(count > 0, loss_scale / count.clamp_min(1), 0.0).to(torch.float32)


def _setup_context(ctx, inputs, output):
    save_inputs(ctx, *inputs[:10])
    ctx.hidden_dtype = inputs[0].dtype  # (backward reads the inputs only to compute again or to trace: saved_inputs)
    # The student's hidden states and weight (weak references) with their versions now: a backward that only
    # rescales still refuses one changed in place since (an optimizer step before this loss's backward) where
    # PyTorch's product would have saved it: the weight for the hidden states' gradient, the hidden states for the
    # weight's. The teacher's inputs, a constant, may be refilled (they are read only to compute again). (Under
    # saved-tensor hooks that pack copies the hidden states' view dies after the forward and goes unchecked, as
    # PyTorch's own products check nothing there.)
    ctx.student_versions = tuple((weakref.ref(t), t._version) if type(t) in (Tensor, torch.nn.Parameter)
                                 and not t.is_inference() else None for t in inputs[:2])
    ctx.args = inputs[10:21]  # (ignore_index ... whole)
    ctx.wanted = inputs[21:24]
    # float16's grad hidden comes unscaled (see _fused_chunks); taken now, from the labels of this forward
    ctx.hidden_scale = _hidden_scale(inputs[0], inputs[9], inputs[10], inputs[13], inputs[14]) \
        if inputs[0].dtype == torch.float16 and inputs[21] else None
    _, g_hidden, g_weight, g_bias = output
    # Held outside save_for_backward: backward rescales them in place and hands them over as the gradients.
    ctx.fused = tuple(g.detach() for g in (g_hidden, g_weight, g_bias))
    ctx.mark_non_differentiable(g_hidden, g_weight, g_bias)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_grads_of_gradients):
    if grad_loss is None:
        return (None,) * _N_INPUTS
    _refuse_double_backward("fused_linear_generalized_jsd")
    grad_loss = grad_loss.resolve_neg()  # (a negative view: the kernels read the memory, not the view's negation)
    need = [ctx.needs_input_grad[i] and ctx.wanted[i] for i in range(3)]
    # (a batched backward's grad_loss, is_grads_batched=True, has no storage: scaled out of place too)
    tracing = torch.compiler.is_compiling() or type(grad_loss) is not Tensor or batched_grad(grad_loss)
    fused = ctx.fused
    if fused is None:
        # A second backward (retain_graph=True): compute the gradients again, out of place.
        fused = _fused_op(*saved_inputs(ctx), *ctx.args, *need)[1:]
        in_place = False
    elif tracing:
        in_place = False  # torch.compile: the forward's outputs, scaled out of place in the graph
        if not keep_graph():
            ctx.fused = None  # (a batched backward's: let go with the graph)
    else:
        ctx.fused = None  # rescaled in place once; a second backward recomputes
        in_place = True
        # (the weight checked where the hidden states' gradient is made, the hidden states where the weight's is)
        for kept, wanted, what in zip(ctx.student_versions or (None, None), (need[1], need[0]), ("hidden states",
                                                                                               "weight")):
            t = kept[0]() if kept is not None and wanted else None
            if t is not None and t._version != kept[1]:
                raise RuntimeError("fused_linear_generalized_jsd: one of the variables needed for gradient "
                                   f"computation has been modified by an inplace operation: the student's {what} "
                                   f"are at version {t._version}, at {kept[1]} in the forward (an optimizer step "
                                   "before this backward?)")
    factor = grad_loss.to(_acc_dtype(ctx.hidden_dtype))
    # As 2-d rows for _scaled (sizes, not -1: a hidden size of 0 leaves -1 ambiguous); the bias's as one row.
    # (traced: under Dynamo, or by AOTAutograd, which torch 2.11 does with is_compiling() False but a grad_loss
    # of its own tensor types; an eager batched backward's takes the plain form, which vmap can take; a batched
    # backward through a compiled head is refused: the op has no batching rule)
    traced = tracing and not batched_grad(grad_loss)
    anchors = [t for t, ok in zip(saved_inputs(ctx)[:3], need) if ok] if traced else []

    def scaled(g: Tensor, factor: Tensor) -> Tensor:
        rows = g.view(g.shape[0] if g.dim() > 1 else 1, g.shape[-1])
        return (_traced_scale(rows, factor, anchors) if traced else _scaled(rows, factor, in_place)).view(g.shape)

    # (float16's grad hidden: its scale and grad_output at once, each entry rounded once)
    factors = [factor if i or ctx.hidden_scale is None else factor * ctx.hidden_scale for i in range(3)]
    out = [scaled(g, f) if ok else None for g, f, ok in zip(fused, factors, need)]
    return (*out,) + (None,) * (_N_INPUTS - 3)


_fused_op.register_autograd(releases_held(_backward), setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ front end
def _err(message: str) -> str:
    return f"fused_linear_generalized_jsd: {message}"


def _check_linear(who: str, hidden, weight, bias, dtype: torch.dtype | None, device: torch.device | None,
                  vocab: int | None) -> None:
    """hidden [..., H], weight [V, H], bias [V] or None: tensors of one floating dtype on one device (those given
    for the student when checking the teacher)."""
    for name, t in ((f"{who}_hidden", hidden), (f"{who}_weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(_err(f"{name} must be a tensor, got {type(t).__name__}"))
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(_err(f"{who}_bias must be a tensor or None, got {type(bias).__name__}"))
    dtype = dtype or hidden.dtype
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(_err(f"{who}_hidden must be float16, bfloat16, float32 or float64, got {hidden.dtype}"))
    for name, t in ((f"{who}_hidden", hidden), (f"{who}_weight", weight), (f"{who}_bias", bias)):
        if t is not None and t.dtype != dtype:
            why = ("the student's hidden states, weight and bias make its logits in one dtype" if who == "student"
                   else "the logits of student and teacher are made in one dtype")
            raise TypeError(_err(f"{name} is {t.dtype}, the student's hidden states are {dtype}: {why}; convert "
                                 "it"))
    device = device or hidden.device
    if device.type not in ("cpu", "cuda", "meta"):
        raise NotImplementedError(_err(f"no kernels for {device.type} tensors (cpu and cuda only)"))
    for name, t in ((f"{who}_hidden", hidden), (f"{who}_weight", weight), (f"{who}_bias", bias)):
        if t is not None and t.device != device:
            raise ValueError(_err(f"{name} is on {t.device}, the student's hidden states on {device}: put them "
                                  "on one device"))
    if hidden.dim() < 1:
        raise ValueError(_err(f"{who}_hidden must be [..., H], got a 0-d tensor"))
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] < 1:
        raise ValueError(_err(f"{who}_weight must be [V, H] (nn.Linear's layout) with V >= 1 and H = "
                              f"{who}_hidden's last dim {hidden.shape[-1]}, got {tuple(weight.shape)}"))
    if vocab is not None and weight.shape[0] != vocab:
        raise ValueError(_err(f"{who}_weight has a vocabulary of {weight.shape[0]}, the student's {vocab}: "
                              "they must be the same"))
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(_err(f"{who}_bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}"))


_INT64_MAX = 2**63 - 1


def _check_chunk_size(chunk_size) -> None:
    if chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(_err(f"chunk_size must be an int or None, got {type(chunk_size).__name__}"))
    if not 1 <= chunk_size <= _INT64_MAX:  # (the custom op's schema takes an int64)
        raise ValueError(_err(f"chunk_size must be >= 1 and at most 2**63 - 1, got {chunk_size}"))


def _check_accum_dtype(accum_dtype, weight_dtype: torch.dtype) -> torch.dtype | None:
    """None or the weight's dtype (accumulate in it), or float32 for 16-bit weights."""
    allowed = (None, weight_dtype) + ((torch.float32,) if weight_dtype in (torch.float16, torch.bfloat16) else ())
    if accum_dtype not in allowed:
        raise ValueError(_err(f"accum_dtype must be None, the weight's dtype ({weight_dtype}) or torch.float32 for "
                              f"16-bit weights, got {accum_dtype!r}"))
    return None if accum_dtype == weight_dtype else accum_dtype


def _check_skip_masked(skip_masked, labels: Tensor | None) -> bool:
    """skip_masked as the op takes it: True only with labels (without them no token is masked)."""
    if not isinstance(skip_masked, bool):
        raise TypeError(_err(f"skip_masked must be True or False, got {skip_masked!r}"))
    if skip_masked and labels is not None and labels.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(_err("skip_masked=True reads the number of unmasked tokens back to the host, which a "
                                "CUDA graph capture cannot do: capture with skip_masked=False"))
    return skip_masked and labels is not None


_WHO = "fused_linear_generalized_jsd"


@dataclass
class _Checked:
    """fused_linear_generalized_jsd's arguments as its local checks leave them (nothing communicated yet)."""
    device: torch.device
    lead: torch.Size
    beta: float
    temperature: float
    form: int  # the teacher: 0 hidden states and weight, 1 logits, 2 top-k
    lab: Tensor | None
    t_hidden: Tensor | None
    t_weight: Tensor | None
    t_bias: Tensor | None
    t_logits: Tensor | None
    pair: object  # the top-k teacher as given (checked once the whole vocabulary is known: it may be global)
    accum_dtype: torch.dtype | None
    skip_masked: bool
    name: str | None

    @property
    def n(self) -> int:
        """The tokens (the leading dims' product)."""
        return self.lead.numel()


def _checked_locally(student_hidden, student_weight, teacher_hidden, teacher_weight, teacher_logits, teacher_topk,
                     student_bias, teacher_bias, beta, temperature, labels, ignore_index, reduction, chunk_size,
                     accum_dtype, group, skip_masked) -> _Checked:
    """Every check of the arguments that needs no other rank (a top-k teacher's indices are checked later)."""
    _check_linear("student", student_hidden, student_weight, student_bias, None, None, None)
    pair = teacher_topk if isinstance(teacher_topk, (tuple, list)) else ()
    refuse_transforms(_WHO, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight,
                      teacher_bias, teacher_logits, labels, *pair)
    name = group_name(group, _WHO) if group is not None else None
    dtype, device = student_hidden.dtype, student_hidden.device
    vocab = student_weight.shape[0]
    lead = student_hidden.shape[:-1]
    beta, temperature = _check_settings(beta, temperature, ignore_index, reduction, who=_WHO, dtype=dtype)
    if reduction == "none":
        raise ValueError(_err("reduction='none' is not supported: the gradients are summed over the tokens as "
                              "they are made; use 'batchmean' or 'sum', or generalized_jsd on logits for per-token "
                              "losses"))
    forms = [teacher_hidden is not None or teacher_weight is not None, teacher_logits is not None,
             teacher_topk is not None]
    if sum(forms) != 1:
        raise ValueError(_err("give exactly one teacher: teacher_hidden with teacher_weight, teacher_logits, or "
                              "teacher_topk"))
    if teacher_bias is not None and not forms[0]:
        raise ValueError(_err("teacher_bias needs teacher_hidden and teacher_weight"))
    lab = _check_labels(labels, lead, device, who=_WHO)
    t_hidden = t_weight = t_bias = t_logits = None
    pair = teacher_topk
    if forms[0]:
        if teacher_hidden is None or teacher_weight is None:
            raise ValueError(_err("a teacher given as hidden states needs both teacher_hidden and teacher_weight"))
        _check_linear("teacher", teacher_hidden, teacher_weight, teacher_bias, dtype, device, vocab)
        if teacher_hidden.shape[:-1] != lead:
            raise ValueError(_err(f"teacher_hidden {tuple(teacher_hidden.shape)} must have the student's leading "
                                  f"dims {tuple(lead)}"))
        t_hidden = teacher_hidden.detach().reshape(lead.numel(), teacher_hidden.shape[-1])  # (numel: H_t may be 0)
        t_weight = teacher_weight.detach()
        t_bias = teacher_bias.detach() if teacher_bias is not None else None
    elif forms[1]:
        _check_teacher_logits(teacher_logits, lead + (vocab,), dtype, device, who=_WHO)
        t_logits = _rows(teacher_logits.detach(), vocab)
    elif is_topk_pair(pair):
        pair = (pair[0], pair[1].detach())
    else:  # (its form here; its values once the vocabulary is known)
        _validate_topk(pair, student_hidden, lead, vocab, lab, ignore_index, who=_WHO)
    _check_chunk_size(chunk_size)
    accum_dtype = _check_accum_dtype(accum_dtype, dtype)
    skip_masked = _check_skip_masked(skip_masked, lab)
    return _Checked(device, lead, beta, temperature, forms.index(True), lab, t_hidden, t_weight,
                    t_bias, t_logits, pair, accum_dtype, skip_masked, name)


def _same_call_fields(beta=0.0, temperature=0.0, ignore_index=0, reduction="", rows=0, chunk_size=None, form=0,
                      dtype=-1, skip_masked=False, hidden_grad=False, loss_scale=1.0) -> dict:
    """The settings every rank of a group must pass alike, as check_same_call compares them (the same names in the
    same order on every rank; a refusing rank's are the defaults). chunk_size as given: None cuts the chunks from
    the ranks' widths and dtype, so ranks that give None and ranks that give a number would communicate apart.
    hidden_grad: whether the call makes grad hidden, summed over the group (a collective only those ranks make)."""
    return {"beta": beta, "temperature": temperature, "ignore_index": int(ignore_index),
            "reduction (0 sum, 1 batchmean)": int(reduction == "batchmean"), "rows": rows,
            "chunk_size": None if chunk_size is None else int(chunk_size), "teacher form": form,
            "dtype (0 float16, 1 bfloat16, 2 float32, 3 float64)": dtype, "skip_masked": int(skip_masked),
            "student_hidden's gradient": int(hidden_grad), "loss_scale": float(loss_scale)}


def _replicated(hidden, t_hidden, pair) -> tuple:
    """check_same_call's `also` for the fused head: what every rank holds whole (the hidden states, a top-k
    teacher's global pairs). Hidden states that differ between the ranks (sequence-parallel activations not
    gathered before the head, say) would give each rank's slice other tokens: a wrong loss, silently."""
    return (("student_hidden", hidden), ("teacher_hidden", t_hidden)) + topk_also(pair)


def fused_linear_generalized_jsd(student_hidden: Tensor, student_weight: Tensor,
                                 teacher_hidden: Tensor | None = None, teacher_weight: Tensor | None = None, *,
                                 teacher_logits: Tensor | None = None,
                                 teacher_topk: tuple[Tensor, Tensor] | None = None,
                                 student_bias: Tensor | None = None, teacher_bias: Tensor | None = None,
                                 beta: float = 0.0, temperature: float = 1.0, labels: Tensor | None = None,
                                 ignore_index: int = -100, reduction: str = "batchmean",
                                 chunk_size: int | None = None,
                                 accum_dtype: torch.dtype | None = None, group=None,
                                 skip_masked: bool = False, loss_scale: float = 1.0) -> Tensor:
    """``generalized_jsd(student_hidden @ student_weight.T + student_bias, <teacher logits>, ...)`` without the
    logits ever being whole: the same loss (beta, temperature, labels/ignore_index, reductions "batchmean" and
    "sum"), computed chunk by chunk of tokens.

    ``student_hidden`` ``[..., H]``, ``student_weight`` ``[V, H]`` (``nn.Linear``'s layout), ``student_bias``
    ``[V]`` or None; float16/bfloat16/float32/float64, one dtype. The teacher, exactly one of:
    ``teacher_hidden`` ``[..., H_t]`` (the student's leading dims, any H_t) with ``teacher_weight`` ``[V, H_t]``
    (and ``teacher_bias``), its logits made one chunk at a time; ``teacher_logits`` ``[..., V]``; or
    ``teacher_topk = (indices, logprobs)`` ``[..., k]`` (see ``generalized_jsd``). The teacher is a constant: no
    gradient flows to it, even where its tensors require grad. ``labels``: the leading shape.

    Gradients flow to ``student_hidden``, ``student_weight`` and ``student_bias`` (those that require grad); they
    are computed in this call, beside the loss, and backward only scales them. ``reduction="none"`` is not
    supported (the gradients are summed over the tokens as they are made): use ``generalized_jsd`` on logits.

    ``chunk_size``: tokens per chunk; None picks one from the shapes (``default_chunk_size``: the chunk's logit buffers
    within 512 MiB, e.g. 1024 tokens of a 128256 vocabulary in bfloat16 with a teacher given as hidden + weight (or as
    logits with skip_masked, whose rows are gathered), 2048 with teacher logits or top-k). The memory beyond the inputs
    and the parameter gradients is those buffers (and one more where the CUDA kernel cannot write d logits over the
    logits: rows longer than its clusters hold on chip: beyond 409600 entries in float32 with the teacher's logits,
    819200 in bfloat16; and with ``group`` whenever a gradient is wanted, as whether a slice fits may differ between
    ranks).
    ``accum_dtype``: the grad weight's accumulator over the chunks; None accumulates in the weight's dtype,
    ``torch.float32`` (for 16-bit weights) in a float32 copy (2x the weight's size more memory) rounded once at the
    end. The loss is float32 (float64 for float64 inputs). Double backward is not supported (a clear error).

    ``loss_scale`` (a finite Python number): the loss and its gradients are multiplied by it, in the kernels' own
    scale: gradient accumulation over n micro-batches passes ``1 / n`` and backward has nothing to rescale (dividing
    the loss instead costs a pass over each gradient there, the weight's among them); see ``generalized_jsd``.

    ``group`` (a ``torch.distributed`` process group): the vocabulary is split across its ranks (Megatron's
    column-parallel head): each rank passes its contiguous slice of the weights' rows (and biases, or teacher
    logits), in rank order, and the same hidden states and labels; every rank returns the global loss and gets
    its slice's weight and bias gradients and the full gradient of the hidden states (summed over the group).
    Each chunk's divergence then runs as ``generalized_jsd(..., group=group)`` does; ``teacher_topk``'s indices
    are then global vocabulary ids (each rank finds those in its rows). Every rank cuts the tokens into the same
    chunks (each chunk's divergence is collective): ``chunk_size`` None picks it from the widest rank's slice, from
    the ranks' widths learnt on the group's first call (the host waits for them then; later calls check them
    without waiting on the step, and run again, every rank alike, if they changed; a top-k teacher's calls gather
    them anyway, for its indices); to capture such a call in a CUDA graph, pass ``chunk_size`` (the same on every
    rank).

    ``skip_masked=True`` (with ``labels``): the chunks hold the tokens whose label is not ``ignore_index``, so no
    matrix product is spent on masked tokens (their loss and gradient are 0 anyway): a step with 10% of its tokens
    masked does ~10% fewer FLOP, one with half its tokens (a prompt) masked about half. The same loss and
    gradients (masked tokens' rows of grad hidden are zeros). The cost: the number of unmasked tokens sizes the
    chunks, so it is read back to the host, one synchronisation per call (the host waits for the work queued
    before the call; the GPU meanwhile computes the first chunk's products, which are queued first, over a whole
    chunk of tokens, unmasked first: so the products cover at least one chunk's tokens, masked or not), and such a
    call cannot be captured in a CUDA graph (an error). The default, False, never synchronises.
    """
    # With a group every rank learns whether the others' inputs were refused before the call's first collective
    # (check_same_call, where same_call_due says: every call on CPU ranks, now and then on GPU ranks), so the local
    # checks come first and a refusing rank says so there: where it raised alone, the others waited for it in that
    # collective or paired it with a later one.
    due, on = same_call_due(student_hidden, group) if isinstance(group, dist.ProcessGroup) else (False, None)
    try:
        loss_scale = check_loss_scale(loss_scale, _WHO)
        c = _checked_locally(student_hidden, student_weight, teacher_hidden, teacher_weight, teacher_logits,
                             teacher_topk, student_bias, teacher_bias, beta, temperature, labels, ignore_index,
                             reduction, chunk_size, accum_dtype, group, skip_masked)
    except Exception:
        if due:
            check_same_call(group, _WHO, _same_call_fields(), None, refused=True, also=_replicated(None, None, None),
                            device=on)
        raise
    grad_on = torch.is_grad_enabled()  # the gradients this call makes: hidden (summed over a group), weight, bias
    wants = [bool(grad_on and t is not None and t.requires_grad)
             for t in (student_hidden, student_weight, student_bias)]
    if due:
        # (ignore_index compared only where labels use it)
        check_same_call(group, _WHO, _same_call_fields(c.beta, c.temperature, ignore_index if c.lab is not None
                                                       else 0, reduction, c.n,
                                                       chunk_size, c.form, dtype_code(student_hidden.dtype),
                                                       c.skip_masked, wants[0], loss_scale),
                        c.lab, also=_replicated(student_hidden, c.t_hidden, c.pair), device=on)
    vocab, device, n = student_weight.shape[0], c.device, c.n
    idx = lp = None
    widths = None  # with a group: every rank's slice width, where this call has gathered them (a top-k teacher)
    if c.form == 2:
        # With a group the indices are global: checked against the whole vocabulary (every rank's rows).
        if group is not None:
            widths = slice_widths(vocab, device, group)
        whole = vocab if widths is None else sum(widths)
        idx, lp = _validate_topk(c.pair, student_hidden, c.lead, whole, c.lab, ignore_index, who=_WHO)
    settled = None  # with a group and the default chunk: whether the ranks' widths were the layout learnt
    if chunk_size is None:
        # Two logit buffers where the teacher's logits are made (hidden states) or gathered (skip_masked) per chunk.
        two = c.t_hidden is not None or (c.skip_masked and c.t_logits is not None)
        widest = vocab
        if group is not None:
            # Each chunk's divergence is collective, so every rank must cut the tokens alike: the chunk from the
            # widest slice (each rank's own width gave ranks with uneven slices different chunks, and their
            # collectives did not match). The ranks' widths as learnt on the group's first call (the host waits
            # then only); if they changed since, every rank runs the call again with the new ones (below).
            if widths is None:  # (a top-k teacher's call has them exactly: gathered above for its indices)
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(_err("with a group, pass chunk_size when capturing in a CUDA graph: the "
                                            "default is cut from every rank's slice width, which the host reads "
                                            "back"))
                widths, settled = learnt_widths(vocab, device, group)
            widest = max(widths)
        chunk_size = default_chunk_size(n, widest, student_hidden.element_size(), 2 if two else 1)

    hidden = student_hidden.reshape(n, student_hidden.shape[-1])  # n, not -1: a hidden size of 0 is legal
    args = (hidden, student_weight, student_bias, c.t_hidden, c.t_weight, c.t_bias, c.t_logits, idx, lp, c.lab,
            int(ignore_index), c.beta, c.temperature, reduction == "batchmean", loss_scale, int(chunk_size),
            c.accum_dtype,
            c.name, c.skip_masked, *(placed(widths, group) if c.form == 2 and widths is not None else (-1, -1)))
    if not any(wants) and not _is_tracing(hidden):
        loss = _fused(*args, False, False, False)[0]
    else:
        loss = _fused_op(*args, *wants)[0]
    if settled is not None and not settled():  # the slices' widths changed: again, with the new layout (all ranks)
        return fused_linear_generalized_jsd(
            student_hidden, student_weight, teacher_hidden, teacher_weight, teacher_logits=teacher_logits,
            teacher_topk=teacher_topk, student_bias=student_bias, teacher_bias=teacher_bias, beta=beta,
            temperature=temperature, labels=labels, ignore_index=ignore_index, reduction=reduction, chunk_size=None,
            accum_dtype=accum_dtype, group=group, skip_masked=skip_masked, loss_scale=loss_scale)
    return loss


class FusedLinearGeneralizedJSDLoss(torch.nn.Module):
    """``fused_linear_generalized_jsd`` as a module: ``FusedLinearGeneralizedJSDLoss(beta, temperature)(
    student_hidden, student_weight, teacher_hidden, teacher_weight, labels=labels)``; the keyword arguments of the
    function (teacher_logits, teacher_topk, biases, labels, accum_dtype, group) pass through ``forward``."""

    def __init__(self, beta: float = 0.0, temperature: float = 1.0, ignore_index: int = -100,
                 reduction: str = "batchmean", chunk_size: int | None = None, skip_masked: bool = False,
                 loss_scale: float = 1.0):
        super().__init__()
        # Checked now, so a wrong setting fails where it is made.
        _check_settings(beta, temperature, ignore_index, reduction, who=_WHO)
        if reduction == "none":
            raise ValueError("FusedLinearGeneralizedJSDLoss: reduction='none' is not supported; use 'batchmean' or "
                             "'sum'")
        _check_chunk_size(chunk_size)
        _check_skip_masked(skip_masked, None)
        check_loss_scale(loss_scale, "FusedLinearGeneralizedJSDLoss")
        self.beta, self.temperature, self.ignore_index = beta, temperature, ignore_index
        self.reduction, self.chunk_size, self.skip_masked = reduction, chunk_size, skip_masked
        self.loss_scale = loss_scale

    def forward(self, student_hidden: Tensor, student_weight: Tensor, teacher_hidden: Tensor | None = None,
                teacher_weight: Tensor | None = None, labels: Tensor | None = None, **kwargs) -> Tensor:
        """``labels`` may come fifth, as GeneralizedJSDLoss takes them third after the two logits; every other
        argument of fused_linear_generalized_jsd by keyword."""
        return fused_linear_generalized_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                            labels=labels, beta=self.beta, temperature=self.temperature,
                                            ignore_index=self.ignore_index, reduction=self.reduction,
                                            chunk_size=self.chunk_size, skip_masked=self.skip_masked,
                                            loss_scale=self.loss_scale, **kwargs)

    def extra_repr(self) -> str:
        scale = f", loss_scale={self.loss_scale}" if self.loss_scale != 1.0 else ""
        return (f"beta={self.beta}, temperature={self.temperature}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}, chunk_size={self.chunk_size}, skip_masked={self.skip_masked}{scale}")
