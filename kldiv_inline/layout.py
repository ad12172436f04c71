"""The memory layout PyTorch gives an elementwise result, so that ``reduction='none'`` keeps the inputs'.

ATen's TensorIterator lays an elementwise op's output out in its operands' order of strides: contiguous
operands give a contiguous result, channels_last ones a channels_last result, transposed views a transposed
one. ``F.kl_div`` computes ``xlogy(t, t) - t * input`` (``exp(t) * (t - input)`` with ``log_target``), three
such ops, so its result follows the target first and the input where the target cannot decide (a broadcast
dimension). This module replays those rules on sizes and strides alone: no tensor is made, so it costs a few
microseconds, and Dynamo traces it (strides become guards).
"""
from __future__ import annotations

from torch import Tensor, promote_types

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # (sizes, strides)


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(sizes):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def _is_contiguous(sizes, strides) -> bool:  # Tensor.is_contiguous()
    if 0 in sizes:
        return True
    expected = 1
    for s, st in zip(reversed(sizes), reversed(strides)):
        if s != 1:
            if st != expected:
                return False
            expected *= s
    return True


def _is_channels_last(sizes, strides) -> bool:  # Tensor.is_contiguous(memory_format=torch.channels_last)
    if len(sizes) != 4:
        return False
    expected = 1
    for d in (1, 3, 2, 0):
        if sizes[d] != 1:
            if strides[d] != expected:
                return False
            expected *= sizes[d]
    return True


def _channels_last_strides(sizes) -> tuple[int, ...]:
    c_, h_, w_ = sizes[1], sizes[2], sizes[3]
    return (c_ * h_ * w_, 1, c_ * w_, c_)


def _sort(items: list[int], less) -> list[int]:
    """``items`` sorted (stably) by the comparison ``less(a, b)``. Not ``sorted(key=...)``: under torch.compile
    with dynamic shapes sizes and strides are symbolic, and Dynamo can neither sort by symbolic keys nor order
    tuples holding symbolic booleans; each comparison here is a plain ``if`` (a guard where its outcome is not
    already known). An insertion sort: a handful of dimensions."""
    out: list[int] = []
    for item in items:
        i = len(out)
        while i > 0 and less(item, out[i - 1]):
            i -= 1
        out.insert(i, item)
    return out


def _is_non_overlapping_and_dense(sizes, strides) -> bool:
    if len(sizes) == 1:
        return bool(sizes[0] < 2) or bool(strides[0] == 1)
    # Size-0/1 dimensions address nothing: the others, innermost first, must tile memory exactly.
    required = 1
    for d in _sort([d for d in range(len(sizes)) if sizes[d] >= 2], lambda a, b: strides[a] < strides[b]):
        if strides[d] != required:
            return False
        required *= sizes[d]
    return True


def _broadcast_strides(shape: tuple[int, ...], op: Layout) -> list[int]:
    """An operand's strides over the broadcast shape: 0 on dimensions it is broadcast along."""
    sizes, strides = op
    offset = len(shape) - len(sizes)
    out = [0] * len(shape)
    for i, (s, st) in enumerate(zip(sizes, strides)):
        out[offset + i] = 0 if (s == 1 and shape[offset + i] != 1) else st
    return out


def elementwise(shape: tuple[int, ...], operands: list[Layout]) -> Layout:
    """The (sizes, strides) TensorIterator gives the result of an elementwise op on ``operands``, in order."""
    if all(sizes == shape for sizes, _ in operands):  # TensorIterator's "fast setup"
        if all(_is_contiguous(*op) for op in operands):
            return shape, _contiguous_strides(shape)
        if all(_is_channels_last(*op) for op in operands):
            return shape, _channels_last_strides(shape)
        if (all(_is_non_overlapping_and_dense(*op) for op in operands)
                and all(strides == operands[0][1] for _, strides in operands)):
            return shape, operands[-1][1]
    nd = len(shape)
    strides = [_broadcast_strides(shape, op) for op in operands]

    def should_swap(d0: int, d1: int) -> int:
        # > 0: d0 (now the faster of the two) belongs outside d1. The first operand that can tell decides;
        # one broadcast along either dimension cannot.
        for st in strides:
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(range(nd - 1, -1, -1))  # innermost first; an insertion sort that stops at ambiguity
    for i in range(1, nd):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    if perm == list(range(nd - 1, -1, -1)):
        return shape, _contiguous_strides(shape)
    out, step = [0] * nd, 1
    for d in perm:
        out[d] = step
        step *= shape[d]
    return shape, tuple(out)


def _cast_first(op: Layout, dtype, common, device_type: str) -> Layout:
    """An operand as TensorIterator sees it in an op of ``common`` dtype: on the CPU one of another dtype is cast
    first (``Tensor.to``, which keeps a dense layout and lays any other, a sliced or expanded view, out densely in
    its order of strides, as an elementwise op of it alone would); CUDA casts inside the kernel, so there the
    operand's own strides count."""
    if device_type != "cpu" or dtype == common or _is_non_overlapping_and_dense(*op):
        return op
    return elementwise(op[0], [op])


def kl_div_strides(input: Tensor, target: Tensor, shape: tuple[int, ...],
                   from_probs: bool) -> tuple[int, ...]:
    """The strides of ``F.kl_div(input, target, reduction='none')`` (of ``torch.log(input)`` for the
    probability form): xlogy(t, t) - t * x, or exp(t) * (t - x); both have the same operand order."""
    x: Layout = (tuple(input.shape), tuple(input.stride()))
    t: Layout = (tuple(target.shape), tuple(target.stride()))
    if from_probs:
        x = elementwise(x[0], [x])
    common, where = promote_types(input.dtype, target.dtype), input.device.type
    pair = [_cast_first(t, target.dtype, common, where), _cast_first(x, input.dtype, common, where)]
    return elementwise(shape, [elementwise(t[0], [t]), elementwise(shape, pair)])[1]


def outer_to_inner(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[int] | None:
    """The dimensions of a dense layout from outermost to innermost (None for row-major): iterating the
    shape permuted by it visits memory in order. Among equal strides (size-1 dimensions) the larger size
    goes outside, which reproduces the strides exactly."""
    def outer(a: int, b: int) -> bool:
        if strides[a] != strides[b]:
            return bool(strides[a] > strides[b])
        return bool(shape[a] > shape[b])  # stable: equal sizes keep their order

    order = _sort(list(range(len(shape))), outer)
    return None if order == list(range(len(shape))) else order


def with_strides(out: Tensor, strides: tuple[int, ...]) -> Tensor:
    """``out`` viewed with ``strides`` where the two differ only along size-1 dimensions (whose strides address
    nothing): PyTorch copies such a stride from operands that share one dense layout (a size-1 dimension of
    stride 16 in a tensor of 8 elements, say), which no order of a dense buffer reproduces. Anything else is
    returned as it is."""
    have = tuple(out.stride())
    if have == tuple(strides) or any(n != 1 and a != b for n, a, b in zip(out.shape, have, strides)):
        return out
    return out.as_strided(out.shape, strides, out.storage_offset())
