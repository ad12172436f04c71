"""The truth the kernels are checked against: PyTorch's own kl_div evaluated in float64."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def kl_div_reference(input: Tensor, target: Tensor, reduction: str = "mean", log_target: bool = False,
                     from_probs: bool = False) -> Tensor:
    """``F.kl_div`` (of ``torch.log(input)`` when ``from_probs``) computed in float64 on the inputs' device."""
    x, t = input.double(), target.double()
    if from_probs:
        x = torch.log(x)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'mean' warns; the reference need not
        return F.kl_div(x, t, reduction=reduction, log_target=log_target)


def probability_rows(batch: int, features: int, *, dtype=torch.float32, device="cpu", generator=None,
                     scale: float | None = None) -> Tensor:
    """Softmax rows with a random temperature (fresh for every call unless ``scale`` is given)."""
    if scale is None:
        scale = float(torch.rand((), generator=generator)) * 4 + 0.25
    logits = torch.randn(batch, features, generator=generator, dtype=torch.float64) * scale
    return logits.softmax(-1).to(device=device, dtype=dtype)


def relative_error(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when the reference is 0 and out is not; NaN never passes)."""
    o, r = out.double().flatten().cpu(), ref.double().flatten().cpu()
    if torch.isnan(o).any() != torch.isnan(r).any():
        return float("inf")
    finite = torch.isfinite(r)
    if not torch.equal(torch.isfinite(o), finite) or not torch.equal(o[~finite].nan_to_num(), r[~finite].nan_to_num()):
        return float("inf")
    o, r = o[finite], r[finite]
    denom = torch.linalg.vector_norm(r)
    num = torch.linalg.vector_norm(o - r)
    if denom == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / denom)
