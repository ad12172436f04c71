"""The peers of the kit's distillation ops, written as their users write them in PyTorch: what the kit is timed
against (eager and under torch.compile) in the benchmarks.

``trl_generalized_jsd`` follows TRL's GKD trainer (``generalized_jsd_loss``): log_softmax of both logits / T in
float32, then ``kl_div(log_target=True)`` for beta 0 and 1, or the mixture through ``logsumexp`` for the
generalized JSD; per-token sums, mean over the unmasked tokens.

``megatron_style_generalized_jsd`` is the same loss over a vocabulary split across a torch.distributed group, the
way Megatron-LM's tensor-parallel ``LogitsKLLoss`` forms the softmaxes (all-reduces of each row's max and sum of
exponentials, float32 copies): the peer of ``generalized_jsd(..., group=...)``;
``megatron_style_fused_linear_generalized_jsd`` puts Megatron's column-parallel LM head in front of it: the peer
of ``fused_linear_generalized_jsd(..., group=...)``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def trl_generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor | None = None,
                        beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100) -> Tensor:
    """TRL's generalized JSD loss (batchmean over unmasked tokens), PyTorch ops only."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return _batchmean(_divergence_entries(s, t, beta).sum(-1), labels, ignore_index)


def _divergence_entries(s: Tensor, t: Tensor, beta: float) -> Tensor:
    """TRL's per-entry terms from log-probabilities: kl_div(log_target=True) for beta 0 and 1, else the mixture
    through logsumexp."""
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    return (beta * F.kl_div(m, t, reduction="none", log_target=True)
            + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True))


def _batchmean(per_token: Tensor, labels: Tensor | None, ignore_index: int) -> Tensor:
    """Mean over the unmasked tokens (over all of them without labels)."""
    if labels is None:
        return per_token.mean()
    keep = labels != ignore_index
    # Selected, not multiplied by the mask: a masked token's row may be no distribution (NaN, inf), and NaN * 0 is
    # NaN. TRL selects (jsd[mask]); a where keeps the shape (no host synchronisation for the selection's size).
    return torch.where(keep, per_token, 0.0).sum() / keep.sum().clamp_min(1)


def liger_generalized_jsd():
    """Liger-Kernel's JSD (beta=0 is its forward KL) on log-probabilities that PyTorch's log_softmax makes
    first, as its users call it; None when liger-kernel is not installed."""
    try:
        from liger_kernel.transformers.jsd import LigerJSD
    except Exception:  # not installed, or no triton here
        return None

    def run(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0, ignore_index=-100):
        v = student_logits.shape[-1]
        s = F.log_softmax(student_logits.float() / temperature, dim=-1).reshape(-1, v)
        t = F.log_softmax(teacher_logits.float() / temperature, dim=-1).reshape(-1, v)
        jsd = LigerJSD(beta=beta, ignore_index=ignore_index)
        return jsd(s, t, labels.reshape(-1) if labels is not None else None)

    return run


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group. ``grad_summed``: the backward sums the gradient over the group too (the sum feeds
    rank-specific terms, as a normaliser does); else the gradient passes through (the sum is the one replicated
    objective, as the loss is)."""

    @staticmethod
    def forward(ctx, x, group, grad_summed):
        ctx.group, ctx.grad_summed = group, grad_summed
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_summed:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


def megatron_style_generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor | None = None,
                                   beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                                   group=None) -> Tensor:
    """The generalized JSD of a vocabulary split across ``group`` (each rank a contiguous slice of both logits)
    as Megatron-LM's tensor-parallel ``LogitsKLLoss`` computes a KL: float32 copies of the logits / T, each row's
    max all-reduced (MAX, no gradient) and its sum of exponentials all-reduced (SUM, gradients summed back), the
    log-probabilities of the local slice, their per-token divergence all-reduced; batchmean over the unmasked
    tokens, as ``trl_generalized_jsd``. Between beta 0 and 1 the mixture is formed entry by entry as TRL does."""
    def log_probs(x: Tensor) -> Tensor:
        x = x.float() / temperature
        mx = x.detach().amax(dim=-1, keepdim=True)
        dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
        shifted = x - mx
        denom = _AllReduceSum.apply(shifted.exp().sum(dim=-1, keepdim=True), group, True)
        return shifted - denom.log()

    s, t = log_probs(student_logits), log_probs(teacher_logits)
    per_token = _AllReduceSum.apply(_divergence_entries(s, t, beta).sum(-1), group, False)
    return _batchmean(per_token, labels, ignore_index)


class _CopyToGroup(torch.autograd.Function):
    """Megatron's copy to the tensor-parallel region: the identity forward, the gradient summed over the group
    backward (the input is replicated, each rank's use of it a part of the whole)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def megatron_style_fused_linear_generalized_jsd(student_hidden: Tensor, student_weight: Tensor,
                                                teacher_hidden: Tensor, teacher_weight: Tensor,
                                                labels: Tensor | None = None, beta: float = 0.5,
                                                temperature: float = 1.0, ignore_index: int = -100,
                                                group=None) -> Tensor:
    """Column-parallel LM heads (each rank its slice of the weights' rows; the hidden states replicated, their
    gradient summed over the group) and ``megatron_style_generalized_jsd`` of the logits, whole at once, as a
    Megatron-LM distillation step makes them. The teacher is a constant."""
    logits = _CopyToGroup.apply(student_hidden, group) @ student_weight.t()
    with torch.no_grad():
        teacher_logits = teacher_hidden @ teacher_weight.t()
    return megatron_style_generalized_jsd(logits, teacher_logits, labels, beta=beta, temperature=temperature,
                                          ignore_index=ignore_index, group=group)
