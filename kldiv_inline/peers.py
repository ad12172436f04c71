"""The peers of the kit's distillation ops, written as their users write them in PyTorch: what the kit is timed
against (eager and under torch.compile) in the benchmarks.

``trl_generalized_jsd`` follows TRL's GKD trainer (``generalized_jsd_loss``): log_softmax of both logits / T in
float32, then ``kl_div(log_target=True)`` for beta 0 and 1, or the mixture through ``logsumexp`` for the
generalized JSD; per-token sums, mean over the unmasked tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def trl_generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor | None = None,
                        beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100) -> Tensor:
    """TRL's generalized JSD loss (batchmean over unmasked tokens), PyTorch ops only."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0:
        per_entry = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        per_entry = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
        per_entry = (beta * F.kl_div(m, t, reduction="none", log_target=True)
                     + (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True))
    per_token = per_entry.sum(-1)
    if labels is None:
        return per_token.mean()
    keep = labels != ignore_index
    return (per_token * keep).sum() / keep.sum().clamp_min(1)


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
