"""The truth the kernels are checked against: PyTorch's own kl_div evaluated in float64."""
from __future__ import annotations

import math

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


# Elements a float64 pass of relative_error takes at a time (128 MiB a side).
_ERROR_CHUNK = 1 << 24


def error_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype errors are measured in: float64, or complex128 where a tensor is complex (.double() would keep a
    complex tensor's real part alone: a conjugate would pass)."""
    return torch.complex128 if any(t.is_complex() for t in tensors) else torch.float64


def relative_error(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when the reference is 0 and out is not; NaN never passes).

    Computed on ref's device, a chunk at a time, with one read-back at the end: copied whole to the host in
    float64, a [4096, 128256] gradient is 4 GB a side, and the two-GPU bench spent ~20 s a row on that."""
    o_all, r_all = out.detach().flatten(), ref.detach().flatten()
    if o_all.numel() != r_all.numel():
        raise ValueError(f"relative_error: {o_all.numel()} elements against {r_all.numel()}")
    o_all = o_all.to(r_all.device)
    wide = error_dtype(o_all, r_all)
    zero = torch.zeros((), dtype=torch.float64, device=r_all.device)
    nan_o, nan_r, bad = zero.bool(), zero.bool(), zero.bool()
    num, den = zero, zero
    for i in range(0, r_all.numel(), _ERROR_CHUNK):
        o, r = o_all[i:i + _ERROR_CHUNK].to(wide), r_all[i:i + _ERROR_CHUNK].to(wide)
        nan_o = nan_o | o.isnan().any()
        nan_r = nan_r | r.isnan().any()
        finite = r.isfinite()
        # the same entries non-finite on both sides, with the same values there (NaN as NaN, inf as inf)
        bad = bad | (o.isfinite() != finite).any() | ((o.nan_to_num() != r.nan_to_num()) & ~finite).any()
        num = torch.hypot(num, torch.linalg.vector_norm(torch.where(finite, o - r, 0.0)))
        den = torch.hypot(den, torch.linalg.vector_norm(torch.where(finite, r, 0.0)))
    nan_o, nan_r, bad, num, den = torch.stack([nan_o.double(), nan_r.double(), bad.double(), num, den]).tolist()
    if nan_o != nan_r or bad:
        return float("inf")
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def _kl_rows(lp: Tensor, lq: Tensor) -> Tensor:
    """sum_v p (log p - log q) over the last dim, with 0 where p == 0 (so -inf - -inf never reaches the sum)."""
    p = lp.exp()
    return (p * torch.where(p > 0, lp - lq, torch.zeros((), dtype=lp.dtype, device=lp.device))).sum(-1)


def _divergence(ls: Tensor, lt: Tensor, beta: float) -> Tensor:
    if beta == 0:
        return _kl_rows(lt, ls)
    if beta == 1:
        return _kl_rows(ls, lt)
    # log m; where both are -inf (no mass) logsumexp's gradient would be NaN (exp(-inf - -inf)), and autograd
    # multiplies it by the 0 that _kl_rows' select passes back: so the logsumexp sees 0s there, and m is -inf.
    none = torch.isneginf(ls) & torch.isneginf(lt)
    zero = torch.zeros((), dtype=ls.dtype, device=ls.device)
    pair = torch.stack([torch.where(none, zero, ls) + math.log1p(-beta), torch.where(none, zero, lt) + math.log(beta)])
    lm = torch.where(none, ls, torch.logsumexp(pair, dim=0))
    return beta * _kl_rows(lt, lm) + (1 - beta) * _kl_rows(ls, lm)


def generalized_jsd_reference(student_logits: Tensor, teacher_logits: Tensor | None = None, *, teacher_topk=None,
                              beta: float = 0.0, temperature: float = 1.0, labels: Tensor | None = None,
                              ignore_index: int = -100, reduction: str = "batchmean",
                              dtype: torch.dtype = torch.float64) -> Tensor:
    """The distillation divergence of ``kldiv_inline.generalized_jsd`` written plainly in float64 PyTorch
    (TRL's generalized_jsd_loss convention, label masks, the top-k teacher's k + 1 buckets); differentiable, so
    autograd of it is the reference gradient. ``dtype=torch.float32`` computes the same formula in float32: what
    PyTorch's own float32 autograd makes of it, the yardstick of a float32 kernel's rounding."""
    # (labels in int64 first, as the kit takes them: torch compares an int32 tensor with 2**40 wrongly)
    keep = labels.long() != ignore_index if labels is not None else None

    def plain_if_masked(rows: Tensor, fill: float) -> Tensor:
        # A masked token's row replaced by a plain one before the softmax: its logits may be no distribution (all
        # -inf, a NaN), and the 0 its gradient gets back times their NaN partial derivatives would be NaN, where
        # the kit's gradient is 0 (its documented rule).
        return rows if keep is None else torch.where(keep[..., None], rows, fill)

    ls = torch.log_softmax(plain_if_masked(student_logits.to(dtype), 0.0) / temperature, dim=-1)
    if teacher_topk is None:
        lt = torch.log_softmax(plain_if_masked(teacher_logits.to(dtype), 0.0) / temperature, dim=-1)
        per_token = _divergence(ls, lt, beta)
    else:
        idx, lp = teacher_topk
        idx, lp = idx.long(), plain_if_masked(lp.to(dtype), -math.log(ls.shape[-1]))
        # As the kit: mass above 1 (rounding) divided out; with k = V the buckets are the whole distribution.
        lse = lp.logsumexp(-1, keepdim=True)
        shift = lse if idx.shape[-1] == ls.shape[-1] else lse.clamp_min(0)
        lp = lp - torch.where(torch.isneginf(shift), 0.0, shift)
        member = torch.zeros_like(ls, dtype=torch.bool).scatter(-1, idx, True)
        p_tail = (ls.exp() * ~member).sum(-1, keepdim=True)
        q_tail = (1 - lp.exp().sum(-1, keepdim=True)).clamp_min(0)
        ls_b, lt_b = ls.gather(-1, idx), lp
        if idx.shape[-1] < ls.shape[-1]:  # a tail bucket only where some of the vocabulary is outside the top-k
            ls_b = torch.cat([ls_b, p_tail.log()], dim=-1)
            lt_b = torch.cat([lt_b, q_tail.log()], dim=-1)
        per_token = _divergence(ls_b, lt_b, beta)
    if keep is not None:
        per_token = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
        count = keep.sum()
    else:
        count = torch.tensor(per_token.numel(), device=per_token.device)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    return torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))
