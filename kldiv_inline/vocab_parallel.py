"""The distillation divergence when the vocabulary is split across the ranks of a torch.distributed group
(Megatron-LM's column-parallel LM head): ``generalized_jsd(..., group=group)`` lands here.

Each rank holds a contiguous slice of every token's logits (rank r holds the r-th slice; slices may differ in
width), student and teacher sliced alike; labels are global. Every rank returns the same loss, the unsharded
one, and gets the gradients of its own slice. Per call, only a few floats per token cross the group:

    phase 0 (kernel): each rank's normalisers of its slice, (max, log2 sum 2^(x - max)) of student and teacher
    all_gather [n, 4] -> the rows' global normalisers, combined in rank order (the module's distill_combine)
    phase 1 (kernel): each rank's partial (loss, ks, kt) of its slice, and the gradients that need no row sum
                      (the student's for forward KL, the teacher's for reverse KL)
    all_gather [n, 3] -> the rows' losses and K sums, summed in rank order (distill_combine), and the loss
    phase 2 (kernel, only where needed): the remaining gradients, which need the rows' K sums

All-gathers rather than all-reduces: every rank then adds the same numbers in the same order, so the loss and
the K sums are bit-identical on every rank and from run to run, whatever the backend's reduction order. The
collectives run on the current stream (NCCL on GPUs, gloo on CPUs) and nothing waits for the host: batchmean's
divisor is counted from the labels on the device. As in the one-device op, the forward pass writes the
gradients (of the reduced loss) and backward only rescales them by grad_output, with no communication.

On the GPUs of one machine that can map each other's memory, the rows' statistics (the normalisers, then the
terms) go through peer memory instead of the all-gathers (the module's distill_peer_terms; kernels/distill_peer.cuh
has the protocol), so the step makes no collective call at all: forward KL without a teacher's gradient, and the JSD's
training rows without one, then run one kernel that keeps each row's slice on chip while the ranks' statistics
meet, so each rank reads its logits once, where the phases read them two or three times; other calls (and a
rank whose slices the fast kernel does not take) run phase 0, the exchange alone, phase 1 (and 2). The
buffers are set up on a call's first use (one all-gather of their handles, which the host waits for) and grow
with the rows; KLDIV_DISTILL_PEER=0 (the same on every rank) keeps the all-gathers, to compare, or where the
ranks cannot queue their calls in the same order relative to their other communication (a kernel that waits for
another rank's GPU occupies its own; see kernels/distill_peer.cuh for the timeout).

A top-k teacher (global indices) takes another route (topk_rows): the student's normalisers (phase 0), one
all-gather of each token's k + 1 bucket values, and the one-device kernel over the buckets on every rank; its
indices are checked against the whole vocabulary, whose layout (the ranks' slice widths, one small all-gather a
call) the host waits for on the first call only; the checks' verdicts are read back once the kernels are queued.
So this route reads from the device on every call and cannot be captured in a CUDA graph; the logits route makes
no host synchronisation and can (tests/test_vocab_parallel.py captures it on two GPUs).
fused_linear_generalized_jsd(..., group=group) runs each chunk of tokens through divergence_rows (topk_rows
for a top-k teacher).
"""
from __future__ import annotations

import math
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import distill

__all__ = ["replicated", "generalized_jsd_vocab_parallel", "divergence_rows", "topk_rows", "placed", "slice_widths",
           "learnt_widths", "check_same_call", "topk_also", "cpu_ranks", "same_call_due", "dtype_code", "group_name",
           "resolve_group"]


_LN2 = math.log(2)

# One collective into one tensor: all_gather_single where torch has it (it deprecates all_gather_into_tensor).
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Replicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if torch.is_grad_enabled():  # create_graph=True: the all_reduce would be left out of the gradient's graph
            raise RuntimeError("replicated: a second derivative (create_graph=True) is not supported: the sum over "
                               "the group in backward carries no graph")
        # (a copy: autograd may hand the same gradient tensor to several places, and all_reduce works in place)
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def replicated(x: Tensor, group) -> Tensor:
    """``x`` (the same on every rank of ``group``) as the input of a column-parallel computation whose outputs are
    sliced by rank: the identity forward; backward sums x's gradient over the group (Megatron-LM's
    copy_to_tensor_model_parallel_region). For the logits route of the split: with ``logits = replicated(hidden,
    group) @ weight_slice.T``, generalized_jsd(logits, ..., group=group) gives each rank its slice of the logits'
    gradient, and the hidden states' gradient comes back whole on every rank (each rank's share alone without it:
    every parameter before the head would train on a wrong gradient). fused_linear_generalized_jsd does this sum
    itself. The result is a view of x (not to be changed in place); backward with create_graph=True raises."""
    _check_group(group, "replicated")
    return _Replicated.apply(x, group)


def _all_gather(x: Tensor, group) -> Tensor:
    """[n, w] on every rank -> [world, n, w], rank r's tensor at index r."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))  # the concatenated form: gloo's only one
    _GATHER_INTO(out, x.contiguous(), group=group)
    return out.view((world,) + tuple(x.shape))


def _sum_in_rank_order(parts: Tensor) -> Tensor:
    """parts[0] + parts[1] + ... in that order (a reduction kernel may pair them otherwise)."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


# ------------------------------------------------------------------------------------------- peer memory
_MAX_PEERS = 8  # ranks one exchange serves (kernels/distill_peer.cuh's kMaxPeers)
_PEER_ROWS_MIN = 4096  # rows a first buffer holds (it grows to the next power of two above a call's rows)


@dataclass
class _Peers:
    slots: Tensor  # int64 [world] on the device: every rank's buffer as this process maps it
    epoch: Tensor  # int32 [1] on the device: this rank's count of exchanging calls
    rank: int
    cap: int  # rows each buffer holds


# By (group, device): the peer buffers, or False where some rank's GPU cannot map another's (all-gathers then).
_PEERS: dict[tuple, _Peers | bool] = {}


def _peer_route(student: Tensor, group) -> _Peers | None:
    """The peer buffers for this call, set up or grown now if needed, or None for the all-gathers. Every rank of
    the group decides alike: each input to the decision (device type, dtype, the variable, the group's size, the
    rows, the buffers' state, a capture in progress) is the same on every rank of a collective call."""
    if student.device.type != "cuda" or student.dtype == torch.float64:  # float64's records do not fit a word
        return None
    if os.environ.get("KLDIV_DISTILL_PEER", "1") == "0":
        return None
    world = dist.get_world_size(group)
    if world > _MAX_PEERS:
        return None
    # (the group object too: a group made again under the same name, by other processes, maps other buffers)
    key = (group_name(group, "generalized_jsd"), id(group), str(student.device))
    known = _PEERS.get(key)
    if known is False:
        return None
    n = student.shape[0]
    if known is not None and known.cap >= n:
        return known
    if torch.cuda.is_current_stream_capturing():  # setting up waits for the host: not inside a capture
        return None
    return _setup_peers(key, student.device, group, n)


def _setup_peers(key: tuple, device: torch.device, group, n: int) -> _Peers | None:
    """Every rank's buffer for ``n`` rows or more, mapped into every rank (collective: two small all-gathers, which
    the host waits for). A rank that cannot map another's buffer makes every rank fall back, for good."""
    mod = distill._module(device)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cap = max(_PEER_ROWS_MIN, 1 << max(0, n - 1).bit_length())
    handle, address = mod.distill_peer_alloc(world, cap, device.index)  # (the module knows the records' layout)
    handles = _all_gather(handle.to(device).view(1, -1), group).cpu()  # [world, 1, 64]
    addresses = [int(address) if j == rank else mod.distill_peer_map(handles[j].flatten().contiguous(), device.index)
                 for j in range(world)]
    mapped = torch.full((1, 1), int(all(a != 0 for a in addresses)), dtype=torch.int64, device=device)
    if not bool(_all_gather(mapped, group).min()):
        _PEERS[key] = False
        return None
    peers = _Peers(slots=torch.tensor(addresses, dtype=torch.int64, device=device),
                   epoch=torch.zeros(1, dtype=torch.int32, device=device), rank=rank, cap=cap)
    _PEERS[key] = peers
    return peers


def _needs_phase2(beta: float, want_s: bool, want_t: bool) -> bool:
    """Whether some wanted gradient needs the rows' K sums (the student's unless forward KL, the teacher's unless
    reverse KL)."""
    return (want_s and beta != 0.0) or (want_t and beta != 1.0)


def divergence_rows(student: Tensor, teacher: Tensor, labels: Tensor | None, ignore_index: int, beta: float,
                    temperature: float, group, scale: Tensor | None, reduction: int, want_s: bool, want_t: bool,
                    grad_student_out: Tensor | None = None, loss_scale: float = 1.0):
    """The phases and their collectives over rows [n, v_local]: (the loss: the rows' [n] for reduction none, else
    their sum times ``scale``; the student's and the teacher's gradients of this slice or None), the gradients
    of the rows' sum times ``scale`` (0-d float64 on the device; None: the reduction's own, batchmean's divisor
    counted from the labels, times ``loss_scale``), the student's written into ``grad_student_out`` when given. The
    module combines the gathered statistics (distill_combine): with the combination in PyTorch operations (~60
    small calls a step) the step waited on the host, 1.5 ms of host time against 0.8 ms of kernels on two H200s."""
    mod = distill._module(student.device)
    common = (labels, ignore_index, beta, temperature)
    peers = _peer_route(student, group)
    if peers is not None:  # the rows' statistics through peer memory (and forward KL's logits read once)
        if scale is None:
            scale = mod.distill_reduction_scale(student, labels, ignore_index, reduction, loss_scale)
        loss, ksums, norms, gs, gt = mod.distill_peer_terms(student, teacher, *common, reduction, scale, want_s,
                                                            want_t, grad_student_out, peers.slots, peers.epoch,
                                                            peers.rank, peers.cap)
    else:
        local_norms = mod.distill_phase(0, student, teacher, *common, None, None, None, False, False)[0]
        if scale is None:  # after phase 0's launch: the host's time before the first kernel is the step's latency
            scale = mod.distill_reduction_scale(student, labels, ignore_index, reduction, loss_scale)
        norms = mod.distill_combine(_all_gather(local_norms, group), 0)[0]
        terms, gs, gt = mod.distill_phase(1, student, teacher, *common, norms, None, scale, want_s, want_t,
                                          grad_student_out)
        ksums, loss = mod.distill_combine(_all_gather(terms, group), reduction, scale)
        # (The CPU twin's terms are float64, its rows' own sums, so that the K sums are rounded once, as one
        # process rounds its double sums: rounded per rank, they put K a float32 ulp off where a peaked row's
        # gradient cancels, p (u - K). Its loss is rounded once too, here.)
        loss = loss.to(distill._acc_dtype(student.dtype))
    if norms is not None and _needs_phase2(beta, want_s, want_t):  # (the one-read kernels wrote every gradient)
        _, gs2, gt2 = mod.distill_phase(2, student, teacher, *common, norms, ksums, scale, want_s, want_t,
                                        grad_student_out)
        gs = gs if gs is not None else gs2
        gt = gt if gt is not None else gt2
    return loss, gs, gt


def topk_rows(student: Tensor, idx: Tensor, lp: Tensor, labels: Tensor | None, ignore_index: int, beta: float,
              temperature: float, reduction: int, group, offset: int, vocab: int, want_s: bool,
              scale: Tensor | None = None, loss_scale: float = 1.0):
    """A top-k teacher (global indices; this rank's slice starts at ``offset`` of ``vocab``; ``lp`` its prepared
    rows [n, k + 1], _validate_topk's, whose column k is the teacher's tail mass): (the reduced loss,
    the student's gradient of this slice or None; that gradient times ``scale``, a device scalar, when given:
    the fused head's batchmean divisor, applied before the gradient is rounded to the logits' dtype). Loss and
    gradient times ``loss_scale``.

    The divergence runs over k + 1 buckets (the k tokens, the tail) whose student probabilities need the whole
    row: each rank gives the log-probabilities of the members it holds and its part of the tail's mass (the
    module's distill_topk_slice; one all-gather), then every rank runs the one-device kernel on the same k + 1
    "logits" per token (T times the buckets' log-probabilities, the members at 0..k-1): the same loss, and the
    gradients of the buckets. A member's gradient is its bucket's; a tail entry's is its share of the tail's
    (p_v / p_tail), as in the kernel (distill_topk_slice_grad)."""
    mod = distill._module(student.device)
    n = student.shape[0]
    k = idx.shape[1]
    acc = distill._acc_dtype(student.dtype)
    common = (labels, ignore_index, beta, temperature)
    # The student's normaliser over the whole row (phase 0 gives the teacher's too: the student stands in).
    local_norms = mod.distill_phase(0, student, student, *common, None, None, None, False, False)[0]
    norms = mod.distill_combine(_all_gather(local_norms, group), 0)[0]
    part = mod.distill_topk_slice(student, norms, idx, offset, temperature)
    whole = _sum_in_rank_order(_all_gather(part, group))  # each member held by one rank; the tails summed
    buckets = whole[:, :k] * _LN2
    if k < vocab:  # a tail bucket only where some of the vocabulary is outside the top-k
        buckets = torch.cat([buckets, whole[:, k:].log()], dim=1)
    arange = torch.arange(k, device=student.device).expand(n, k).contiguous()
    # The buckets' divergence in float64 whatever the logits' dtype (k + 1 values a row: nothing to the step's
    # time): rounded to float32, each bucket's log-probability carried an error of ~6e-8 of its size, and where
    # one bucket holds nearly all the mass the gradient's factor (u - K) cancels down to it (reverse KL, k = 1:
    # 3.7e-5 relative to float64, where the one-device kernel, which forms the members' log-probabilities from
    # the logits, kept 2.4e-6).
    loss, g_buckets, _ = mod.distill_forward(buckets * temperature, None, arange, lp.double(), labels, ignore_index,
                                             beta, temperature, reduction, want_s, False, None, None, loss_scale)
    loss = loss.to(acc)
    if not want_s:
        return loss, None
    return loss, mod.distill_topk_slice_grad(student, norms, idx, offset, temperature, g_buckets.to(acc), whole,
                                             k < vocab, labels, ignore_index, scale)


def _run_folded(student: Tensor, teacher: Tensor | None, idx: Tensor | None, lp: Tensor | None,
                labels: Tensor | None, settings: tuple, want_s: bool, want_t: bool, grad_out: Tensor):
    """float16's gradients (distill._fuses) in backward, grad_out folded into the kernels' scale before the
    rounding (distill.folded_scale; per-row factors multiplied in after), the phases and their collectives run
    again on every rank alike."""
    ignore_index, _, _, reduction, _, _, _, loss_scale = settings
    scale, factor = distill.folded_scale(student, labels, ignore_index, reduction, loss_scale, grad_out)
    _, gs, gt = _run(student, teacher, idx, lp, labels, settings, want_s, want_t, scale)
    return distill.scale_rows(gs, factor), distill.scale_rows(gt, factor)


def _run(student: Tensor, teacher: Tensor | None, idx: Tensor | None, lp: Tensor | None, labels: Tensor | None,
         settings: tuple, want_s: bool, want_t: bool, scale: Tensor | None = None):
    """The reduced loss and the gradients (of the reduced loss; for none, of the rows' sum), or None, each times
    loss_scale. ``settings``: (ignore_index, beta, temperature, reduction code, group, top-k offset, top-k
    vocabulary, loss_scale). ``scale`` (a 0-d float64 on the device, _run_folded's): the gradients are the rows'
    sum's times it instead, in place of the reduction's divisor and loss_scale (the loss is then not wanted)."""
    ignore_index, beta, temperature, reduction, group, offset, vocab, loss_scale = settings
    if scale is not None:
        reduction, loss_scale = distill._REDUCTION_CODE["sum"], 1.0
    if idx is not None:
        loss, gs = topk_rows(student, idx, lp, labels, ignore_index, beta, temperature, reduction, group, offset,
                             vocab, want_s, scale=scale, loss_scale=loss_scale)
        return loss, gs, None
    loss, gs, gt = divergence_rows(student, teacher, labels, ignore_index, beta, temperature, group, scale, reduction,
                                   want_s, want_t, loss_scale=loss_scale)
    if reduction == distill._REDUCTION_CODE["none"] and loss_scale != 1.0:
        loss = loss * loss_scale  # (the rows' losses; the gradients took it with the scale)
    return loss, gs, gt


class _VocabParallelDivergence(torch.autograd.Function):
    """Forward runs the phases with the wanted gradients; backward rescales them by grad_output (in place, the
    first time; a second backward, with retain_graph=True, runs the phases again, on every rank alike). float16
    (distill._fuses): forward runs them for the loss alone, backward with grad_output folded in (_run_folded)."""

    @staticmethod
    def forward(ctx, student, teacher, idx, lp, labels, settings, want_s, want_t):
        fuse = distill._fuses(student.dtype)
        loss, gs, gt = _run(student, teacher, idx, lp, labels, settings, want_s and fuse, want_t and fuse)
        distill.save_inputs(ctx, student, teacher, idx, lp, labels)
        ctx.student_dtype = student.dtype  # (backward reads the inputs only to compute again: saved_inputs)
        ctx.settings = settings
        ctx.masked = distill.masked_rows(labels, settings[0], settings[3])
        ctx.fused = (gs, gt)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    @distill.releases_held
    def backward(ctx, grad_out):
        if grad_out is None:
            return (None,) * 8
        distill._refuse_double_backward("generalized_jsd")
        grad_out = grad_out.resolve_neg()  # (a negative view: the kernels read the memory, not its negation)
        grad_out = distill.masked_grad_out(grad_out, ctx.masked)  # (a masked row's gradient is 0 whatever it is)
        need_s, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # A batched backward's grad_out (is_grads_batched=True) has no storage a kernel could read: the fused
        # gradients are scaled out of place (and kept); float16's folded run cannot take it.
        batched = distill.batched_grad(grad_out)
        if not distill._fuses(ctx.student_dtype):
            if batched:
                raise NotImplementedError("generalized_jsd with group=: a batched backward (is_grads_batched=True, "
                                          "jacobian(vectorize=True)) of float16 logits is not supported; "
                                          "differentiate one grad_output at a time")
            return _run_folded(*distill.saved_inputs(ctx), ctx.settings, need_s, need_t, grad_out) + \
                (None,) * 6
        gs, gt = ctx.fused
        if (need_s and gs is None) or (need_t and gt is None):  # a second backward: compute them again
            _, gs, gt = _run(*distill.saved_inputs(ctx), ctx.settings, need_s, need_t)
        if not batched or not distill.keep_graph():
            ctx.fused = (None, None)  # rescaled in place below (or let go with the graph): a later one recomputes
        grad_out = grad_out.to(distill._acc_dtype(ctx.student_dtype))
        out_s = distill._scaled(gs, grad_out, not batched) if need_s else None
        out_t = distill._scaled(gt, grad_out, not batched) if need_t else None
        return (out_s, out_t) + (None,) * 6


def _gathered_widths(width: int, device, group) -> Tensor:
    """Every rank's slice width, [world] int64 on the device (one small all-gather; made by a fill, not copied
    from the host: a copy from pageable memory waits for the stream)."""
    return _all_gather(torch.full((1, 1), width, dtype=torch.int64, device=device), group).flatten()


def placed(widths: list[int], group) -> tuple[int, int]:
    """This rank's offset in the vocabulary and the vocabulary's size, from every rank's slice width."""
    rank = dist.get_rank(group)
    return sum(widths[:rank]), sum(widths)


def slice_widths(width: int, device, group) -> list[int]:
    """Every rank's slice width, in rank order (one small all-gather and one host synchronisation)."""
    return _gathered_widths(width, device, group).tolist()


# The ranks' slice widths (a list, and on the device) by (group, device), as learnt_vocab_slice last saw them.
_LAYOUTS: dict[tuple, tuple[list[int], Tensor]] = {}


def learnt_widths(width: int, device, group, least: int = 0) -> tuple[list[int], Callable[[], bool]]:
    """Every rank's slice width without waiting for them once they have been seen: the layout learnt from an
    earlier call (the host waits on the first call only), and ``settled()``, True when the widths gathered now are
    that layout. False means the layout changed: it is learnt now, and the caller must run its step again (call
    ``settled()`` once the step's kernels are queued: it waits for the gather only). Every rank gathers the same
    widths and has learnt the same layout (the calls are collective), so every rank sees the same answer and runs
    again alike, and a step cut by the learnt layout (stale or not) is cut alike on every rank. ``least``: a learnt
    vocabulary smaller than this is not used (the host waits for the widths instead): a top-k teacher's k, which
    its eager checks compare with the vocabulary before any kernel runs. It must be the same on every rank (k is),
    so that every rank decides alike."""
    widths = _gathered_widths(width, device, group)
    key = (group_name(group, "generalized_jsd"), str(widths.device))
    known = _LAYOUTS.get(key)
    if known is None or known[1].shape != widths.shape or sum(known[0]) < least:
        listed = widths.tolist()
        _LAYOUTS[key] = (listed, widths)
        return listed, lambda: True
    listed, learnt = known
    read = distill.read_back_later((widths != learnt).any())

    def settled() -> bool:
        if not read():
            return True
        _LAYOUTS[key] = (widths.tolist(), widths)
        return False

    return listed, settled


def learnt_vocab_slice(width: int, device, group, least: int = 0) -> tuple[int, int, Callable[[], bool]]:
    """placed() of learnt_widths' layout: this rank's offset, the vocabulary's size, and ``settled()``."""
    listed, settled = learnt_widths(width, device, group, least)
    return (*placed(listed, group), settled)


_NONE_WORD = -(2**62)  # check_same_call's word for a setting given as None


_CHECKSUM_CHUNK = 1 << 20  # entries a step of _checksum


def _as_signed(word: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return word - (1 << 64) if word >= 1 << 63 else word


_MIX = (_as_signed(0x9E3779B97F4A7C15), _as_signed(0xBF58476D1CE4E5B9), _as_signed(0x94D049BB133111EB))


def _position_weights(lo: int, n: int, device) -> Tensor:
    """Pseudo-random int64 weights of positions lo .. lo + n - 1 (splitmix64's mixer; int64 products wrap and
    shifts are arithmetic alike on every device). Weights 1, 2, 3, ... made the checksum blind to permutations that
    keep sum (x_i - x_j) (i - j) at 0: a top-k teacher's rows flipped on one rank, with the sums of their first and
    last indices equal, passed as the same teacher (1.8% of the refusal tests' draws of six rows of three)."""
    z = torch.arange(lo + 1, lo + n + 1, dtype=torch.int64, device=device) * _MIX[0]
    z = (z ^ (z >> 30)) * _MIX[1]
    z = (z ^ (z >> 27)) * _MIX[2]
    return z ^ (z >> 31)


def _checksum(t) -> int:
    """A word that differs between tensors of different shapes or values (in order; but for a chance of ~2^-61),
    the same on every rank for the same tensor (int64 arithmetic wraps alike); -1 for None, -2 for anything else."""
    if t is None:
        return -1
    if not isinstance(t, Tensor):
        return -2
    flat = t.detach().resolve_neg().reshape(-1)  # (a negative view's values: view(int64) refuses its bit)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for lo in range(0, flat.numel(), _CHECKSUM_CHUNK):  # in chunks: a few MiB of temporaries, whatever the size
        part = flat[lo:lo + _CHECKSUM_CHUNK]
        # (+ 0.0: -0.0 and 0.0 one value, as torch.equal has them; their bits differ)
        part = (part.to(torch.float64) + 0.0).view(torch.int64) if part.is_floating_point() else part.to(torch.int64)
        part = part ^ (part >> 32)  # the high bits (a float's sign) into the low ones, which the product spreads up
        total += ((part + 3) * _position_weights(lo, part.numel(), part.device)).sum()
    # A float's sign is its top bit, which a product modulo 2^64 never carries down, and the word was the sum's low
    # 62 bits: a sign flipped anywhere went unseen (a teacher negated on one rank passed as the same teacher). So
    # each word's high half is folded into its low half first, and the sum is reduced modulo a prime, which every
    # bit of it moves. (crc32, not hash(): str hashes differ between processes.)
    return (int(total) + zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode())) % (2**61 - 1)


def _refused(every_status: list) -> list[int]:
    """The ranks whose status word (0: this rank refused its inputs) says so, from a gathered column."""
    return [r for r, ok in enumerate(every_status) if not ok]


def _refused_error(who: str, ranks: list[int]) -> ValueError:
    return ValueError(f"{who}: rank {', '.join(map(str, ranks))} of the group refused its inputs (its own error "
                      "says why), so the call is refused on every rank")


def _differ_error(who: str, what: str, told: str) -> ValueError:
    return ValueError(f"{who}: the ranks of the group were called with different {what}: {told}; every rank must "
                      "pass the same rows, labels and settings (only the vocabulary is split)")


def check_same_call(group, who: str, fields: dict, labels: Tensor | None, refused: bool = False,
                    also: tuple = (), device=None) -> None:
    """Every rank of the group passed the same settings (``fields``: name -> int, float or None, the same names in
    the same order on every rank), labels and ``also``'s tensors ((name, tensor or None) pairs), else a ValueError
    on every rank saying what differs (one small all-gather of a record a rank, on ``device``: None for gloo's
    CPU, a CUDA device for NCCL; the host waits for it). Without it a rank called with another temperature, beta
    or labels than the others would combine its statistics with theirs into a wrong loss, silently. ``refused``:
    this rank's own inputs were refused (it raises its own error after this, and the other ranks raise one that
    names it, where they would have waited for it in their next collective); it must come before any collective a
    refusing rank would skip, and a refusing rank passes the same names (``also``'s included) with any values.
    Callers run it where same_call_due says (every call on CPU ranks; now and then on GPU ranks)."""
    words = [0 if refused else 1]
    # (+ 0.0: -0.0 and 0.0 are one setting, whose bits differ)
    words += [_NONE_WORD if v is None else struct.unpack("<q", struct.pack("<d", float(v) + 0.0))[0]
              if isinstance(v, float) else int(v) for v in fields.values()]
    words.append(_checksum(labels))
    words += [_checksum(t) for _, t in also]
    mine = torch.tensor([words], dtype=torch.int64, device=device)
    every = _all_gather(mine, group).view(-1, len(words)).cpu()
    refusing = _refused(every[:, 0].tolist())
    if refusing:
        if refused:
            return  # (the caller raises this rank's own error)
        raise _refused_error(who, refusing)
    names = list(fields) + ["labels"] + [name for name, _ in also]
    # Labels given on some ranks and not on others are reported first: they are what differs, not ignore_index,
    # which a call without labels passes as 0. (Otherwise in order: labels of another shape follow from the rows.)
    labels_column = every[:, len(fields) + 1].tolist()  # (-1: no labels; a checksum is never -1)
    labels_first = -1 in labels_column and any(v != -1 for v in labels_column)
    for j, name in sorted(enumerate(names, start=1), key=lambda jn: not (labels_first and jn[1] == "labels")):
        column = every[:, j].tolist()
        if any(v != column[0] for v in column):
            if j > len(fields):
                told = f"the ranks' {name} differ"
            else:
                as_float = isinstance(list(fields.values())[j - 1], float)
                shown = [None if v == _NONE_WORD else struct.unpack("<d", struct.pack("<q", v))[0] if as_float
                         else v for v in column]
                told = ", ".join(f"{v} on rank {r}" for r, v in enumerate(shown))
            raise _differ_error(who, name, told)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_code(dtype) -> int:
    """A dtype as check_same_call compares it: its place in (float16, bfloat16, float32, float64), else -1 (ranks
    whose logits differ in dtype exchange statistics of different sizes, which gloo aborts on)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _call_fields(beta: float, temperature: float, ignore_index: int, code: int, rows: int, k: int,
                 dtype: int = -1, wanted: int = 0, loss_scale: float = 1.0) -> dict:
    """generalized_jsd's settings as check_same_call compares them (the same names, in order, on every rank);
    ``dtype``: dtype_code of the logits; ``wanted``: the gradients the call makes (they decide its exchanges)."""
    return {"beta": beta, "temperature": temperature, "ignore_index": ignore_index,
            "reduction (0 none, 1 sum, 2 batchmean)": code,
            "rows": rows, "teacher_topk k": k, "dtype (0 float16, 1 bfloat16, 2 float32, 3 float64)": dtype,
            "gradients (1 the student's, 2 the teacher's, 3 both)": wanted, "loss_scale": loss_scale}


def topk_also(pair) -> tuple:
    """check_same_call's `also` for a top-k teacher as given (the same on every rank: its indices are global):
    its two tensors, or None where it is not a pair."""
    given = pair if isinstance(pair, (tuple, list)) and len(pair) == 2 else (pair, None)
    return (("teacher_topk", given[0]), ("teacher_topk", given[1]))


def lead_also(lead, code: int) -> tuple:
    """check_same_call's `also` for the logits' leading dimensions where they shape the loss (reduction none, code
    0): ranks whose rows agreed but whose leading dimensions did not ([6, V] on one, [2, 3, V] on another) returned
    per-token losses of different shapes; None (not compared) for the reduced losses and a refusing rank."""
    none = code == distill._REDUCTION_CODE["none"]
    shape = torch.tensor(list(lead), dtype=torch.int64) if none and lead is not None else None
    return (("leading dimensions of the logits (reduction none: the loss's shape)", shape),)


def _check_group(group, who: str = "generalized_jsd") -> None:
    if type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER:  # (new_group's on a rank left out)
        raise ValueError(f"{who}: this rank is not a member of the group (torch.distributed.new_group returns "
                         "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out): call it on the group's ranks only")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{who}: group must be a torch.distributed ProcessGroup, got {type(group).__name__}")


def group_name(group, who: str) -> str:
    """The name a custom op carries a process group by (as PyTorch's functional collectives do)."""
    _check_group(group, who)
    return group.group_name


def resolve_group(name: str):
    """The process group of ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(name)


def cpu_ranks(student, group) -> bool:
    """Whether this call takes the CPU ranks' checks (check_same_call): its logits (or hidden states) are on the
    CPU, or, where they are no tensor at all, the group is gloo's (the other ranks' tensors are then on the CPU:
    this rank must take part in their checks to refuse its inputs without leaving them waiting)."""
    if isinstance(student, Tensor):
        return student.device.type == "cpu"
    return dist.get_backend(group) == dist.Backend.GLOO


# GPU ranks check that every rank made the same call (check_same_call) on a group's first call and every this many
# after: the check waits for the device, which every call cannot afford, while a rank set up with other settings
# than the others (the usual way ranks differ) is caught at its first call.
GPU_CHECK_EVERY = 1000
_CALLS: dict[tuple, int] = {}  # calls made on each group by this process, by (name, group object)


def same_call_due(student, group) -> tuple[bool, torch.device | None]:
    """Whether this call runs check_same_call, and on which device (None: the CPU): every call on CPU ranks; on GPU
    ranks the group's first and every GPU_CHECK_EVERY-th call, not while capturing a CUDA graph (a capture cannot
    wait). Every rank counts the same calls, so every rank decides alike."""
    if cpu_ranks(student, group):
        return True, None
    key = (group_name(group, "generalized_jsd"), id(group))
    made = _CALLS.get(key, 0)
    _CALLS[key] = made + 1
    if made % GPU_CHECK_EVERY or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False, None
    return True, student.device if isinstance(student, Tensor) else torch.device("cuda", torch.cuda.current_device())


def _cpu_call_header(student_logits, teacher_topk, group) -> tuple[int, int]:
    """CPU ranks, before anything else is communicated: every rank's slice width and whether it was given a top-k
    teacher, in one small all-gather (the host waits for gloo's anyway). Returns this rank's offset and the
    vocabulary's size. Every rank raises alike where the forms differ or a rank's logits are no [..., V] tensor
    (that rank with its own error): otherwise a top-k call's gather of the widths would meet another rank's
    check_same_call and pair unrelated collectives."""
    ok = isinstance(student_logits, Tensor) and student_logits.dim() >= 1
    mine = torch.tensor([[int(ok), int(teacher_topk is not None), student_logits.shape[-1] if ok else 0]],
                        dtype=torch.int64)
    every = _all_gather(mine, group).view(-1, 3)
    bad = _refused(every[:, 0].tolist())
    if bad:
        if not ok:  # this rank's own error, as generalized_jsd gives it on one device
            distill._prepare(student_logits, None, None, 0.0, 1.0, None, -100, "batchmean")
            raise TypeError("generalized_jsd: student_logits must be a [..., V] tensor")
        raise _refused_error("generalized_jsd", bad)
    forms = every[:, 1].tolist()
    if any(f != forms[0] for f in forms):
        told = ", ".join(f"{'top-k' if f else 'logits'} on rank {r}" for r, f in enumerate(forms))
        raise _differ_error("generalized_jsd", "teachers", told)
    return placed(every[:, 2].tolist(), group)


def generalized_jsd_vocab_parallel(student_logits: Tensor, teacher_logits: Tensor | None, *, teacher_topk,
                                   beta: float, temperature: float, labels: Tensor | None, ignore_index: int,
                                   reduction: str, group, loss_scale: float = 1.0) -> Tensor:
    """``generalized_jsd`` over a vocabulary split across ``group`` (see the module's docstring): the arguments
    are checked as there, the logits being this rank's slice. Every rank must call it with the same rows, labels
    and settings (a collective)."""
    _check_group(group)
    offset, vocab, settled = 0, None, None
    on_cpu = cpu_ranks(student_logits, group)
    if on_cpu:  # the ranks' widths and teacher forms first, so that every rank takes the same collectives after
        offset, vocab = _cpu_call_header(student_logits, teacher_topk, group)
        if teacher_topk is None:
            offset, vocab = 0, None  # (only a top-k teacher's global indices need them)
    elif teacher_topk is not None and isinstance(student_logits, Tensor) and student_logits.dim() >= 1:
        k = teacher_topk[0].shape[-1] if distill.is_topk_pair(teacher_topk) and teacher_topk[0].dim() else 0
        offset, vocab, settled = learnt_vocab_slice(student_logits.shape[-1], student_logits.device, group, least=k)
    # The top-k teacher's checks are read back once the step's kernels are queued (as on one device), and after
    # every collective: a rank that raised before one would leave the others waiting in it.
    due, on = same_call_due(student_logits, group)
    try:
        loss_scale = distill.check_loss_scale(loss_scale)
        args, lead, check = distill._prepare(student_logits, teacher_logits, teacher_topk, beta, temperature,
                                             labels, ignore_index, reduction, topk_vocab=vocab, defer_check=True)
    except Exception:
        if due:  # the other ranks learn it in the check below instead of waiting for this rank
            check_same_call(group, "generalized_jsd", _call_fields(0.0, 0.0, 0, 0, 0, 0), None, refused=True,
                            also=topk_also(None) + lead_also(None, distill._REDUCTION_CODE["none"]), device=on)
        raise
    student, teacher, idx, lp, lab, ignore_index, beta, temperature, code = args
    grad_on = torch.is_grad_enabled()
    want_s = bool(grad_on and student.requires_grad)
    want_t = bool(grad_on and teacher is not None and teacher.requires_grad)
    if due:
        k = idx.shape[-1] if idx is not None else -1
        check_same_call(group, "generalized_jsd",  # (ignore_index compared only where labels use it)
                        _call_fields(beta, temperature, ignore_index if lab is not None else 0, code,
                                     student.shape[0], k, dtype_code(student.dtype), want_s + 2 * want_t,
                                     loss_scale), lab,
                        also=topk_also((idx, lp)) + lead_also(lead, code), device=on)
    settings = (ignore_index, beta, temperature, code, group, offset, vocab, loss_scale)
    if want_s or want_t:
        loss = _VocabParallelDivergence.apply(student, teacher, idx, lp, lab, settings, want_s, want_t)
    else:
        loss = _run(student, teacher, idx, lp, lab, settings, False, False)[0]
    if settled is not None and not settled():  # the slices' widths changed: again, with the new layout (all ranks)
        return generalized_jsd_vocab_parallel(student_logits, teacher_logits, teacher_topk=teacher_topk, beta=beta,
                                              temperature=temperature, labels=labels, ignore_index=ignore_index,
                                              reduction=reduction, group=group, loss_scale=loss_scale)
    check()
    return loss.reshape(lead) if code == distill._REDUCTION_CODE["none"] else loss
