"""KernelBench level 1 problem 98 (KLDivLoss), in the benchmark's own terms: ``Model`` is the reference,
``ModelNew`` runs the kit's fused kernel, ``get_inputs`` / ``get_init_inputs`` make the problem's inputs.

Facts (KernelBench/level1/98_KLDivLoss.py): batch 16384, input shape (16384,), predictions are
``(rand * scale).softmax(-1)`` with ``scale = rand(())``, targets ``rand.softmax(-1)``; the reference is
``F.kl_div(torch.log(predictions), targets, reduction="batchmean")``, a 0-d tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import kl_div_from_probs

batch_size = 16384
input_shape = (16384,)
dim = 1


class Model(torch.nn.Module):
    """The problem's reference: KL divergence of probability rows, batchmean."""

    def forward(self, predictions, targets):
        return F.kl_div(torch.log(predictions), targets, reduction="batchmean")


class ModelNew(torch.nn.Module):
    """The same loss from the kit's fused kernel: one pass, log taken inside, 0-d result."""

    def forward(self, predictions, targets):
        return kl_div_from_probs(predictions, targets, reduction="batchmean")


def get_inputs(batch: int = batch_size, shape: tuple[int, ...] = input_shape, device: str | None = None):
    scale = torch.rand(())
    preds = (torch.rand(batch, *shape) * scale).softmax(dim=-1)
    targets = torch.rand(batch, *shape).softmax(dim=-1)
    if device is not None:
        preds, targets = preds.to(device), targets.to(device)
    return [preds, targets]


def get_init_inputs():
    return []
