"""The KL op's correctness suite: the kit's op against PyTorch in float64, over a grid of cases.

Every case draws fresh random inputs (random softmax temperatures, never zeros unless the case is about
zeros), poisons new memory with NaN first (``harness.poisoned``) so that an element the kernel fails to
write shows up, and compares per element (reduction='none', each element against the size of its own terms)
as well as the reduced scalars, and both operands' gradients element by element, with the harness's
comparison (``harness.compare``) and per-dtype tolerances (``harness.TOLERANCE``).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import torch

from .harness import TOLERANCE, compare, poisoned
from .ops import kl_div, kl_div_from_probs
from .reference import kl_div_reference, probability_rows

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[[torch.dtype, str, bool, bool], tuple[torch.Tensor, torch.Tensor]]


def _pair(shape_x, shape_t, dtype, device, from_probs, log_target):
    """input (probabilities or log-probabilities) and target (probabilities or their logs)."""
    def rows(shape):
        if not shape:  # one probability-like value in (0.05, 0.95): a softmax of one element is always 1
            return torch.rand((), dtype=torch.float64) * 0.9 + 0.05
        flat = probability_rows(math.prod(shape[:-1]) if len(shape) > 1 else 1, shape[-1])
        return flat.reshape(shape)
    p, t = rows(shape_x).double(), rows(shape_t).double()
    while not shape_x and not shape_t and abs(float(p.log() - t.log())) < 0.05:
        # t close to p makes the single loss value a cancellation near 0 (ill-conditioned in any float32
        # code, PyTorch's included): keep the check meaningful.
        t = rows(shape_t).double()
    # Probabilities no smaller than the dtype's smallest normal: a sharp softmax row cast to float16 had ~20% of its
    # entries at 0, its log -inf, and a reduced loss of +inf on both sides, a check that cannot fail (inf passes
    # where the reference is inf). Zeros are target-zeros' own case.
    tiny = torch.finfo(dtype).smallest_normal
    p, t = p.clamp_min(tiny), t.clamp_min(tiny)
    x = p if from_probs else p.log()
    tt = t.log() if log_target else t
    return x.to(device=device, dtype=dtype), tt.to(device=device, dtype=dtype)


def _shaped(shape_x, shape_t=None):
    return lambda dtype, device, fp, lt: _pair(shape_x, shape_t or shape_x, dtype, device, fp, lt)


def _transposed(dtype, device, fp, lt):
    x, t = _pair((96, 130), (96, 130), dtype, device, fp, lt)
    return x.t(), t.t()  # both (130, 96), non-contiguous


def _sliced(dtype, device, fp, lt):
    x, t = _pair((64, 257), (64, 257), dtype, device, fp, lt)
    return x[3:, 1:], t[:61, :-1]  # unaligned starts, strided rows


def _target_zeros(dtype, device, fp, lt):
    x, t = _pair((32, 500), (32, 500), dtype, device, fp, lt)
    mask = torch.rand(t.shape, device=device) < 0.3
    t = t.masked_fill(mask, float("-inf") if lt else 0.0)
    return x, t


CASES = [
    Case("scalar-0d", _shaped(())),
    Case("vector-1023", _shaped((1023,))),
    Case("rows-64x1000", _shaped((64, 1000))),
    Case("3d-4x8x100", _shaped((4, 8, 100))),
    Case("transposed-130x96", _transposed),
    Case("sliced-61x256", _sliced),
    Case("broadcast-target-row", _shaped((48, 333), (1, 333))),
    Case("broadcast-input-3d", _shaped((1, 7, 65), (5, 7, 65))),
    Case("target-zeros", _target_zeros),
    Case("empty-0x5", _shaped((0, 5))),
]


def _error(out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """The worse of compare's norm-wise relative error and the largest element's error over the largest finite
    |reference| value (inf where a NaN or inf is out of place); _element_error measures each element on its own."""
    res = compare(out, ref, tol, per_element=True)
    if not res["ok"] and res["rel_err"] == math.inf:  # a failure beyond the numbers (NaN or inf misplaced)
        return math.inf
    r = ref.detach().double()
    finite = r.isfinite()
    if not finite.any():
        return 0.0 if res["ok"] else math.inf
    diff = torch.where(finite, (out.detach().double() - r).abs(), 0.0)
    scale = float(r.abs()[finite].max())
    element = float(diff.max()) / scale if scale > 0 else (0.0 if float(diff.max()) == 0 else math.inf)
    return max(res["rel_err"], element)


def _conditioning(x, t, log_target: bool, from_probs: bool) -> torch.Tensor:
    """Each element's loss t (log t - x) measured by the size of its terms, |t| (|log t| + |x|) (e^t (|t| + |x|)
    for log_target), in float64: the error a float32 computation of that element may have is eps times this,
    however near 0 the difference of the terms. For probabilities (x = log p) one |t| more: the kernels take
    t log(t / p), whose quotient's rounding is eps of t (p and t near 1: terms near 0, a loss of eps t)."""
    x, t = x.double(), t.double()
    if from_probs:
        x = x.log()
    x = x.abs()
    if log_target:
        size = t.exp() * (t.abs() + x)
    else:
        size = t.abs() * (torch.where(t > 0, t, 1.0).log().abs() + x)
    return size + t.abs() if from_probs and not log_target else size


def _element_error(out: torch.Tensor, ref: torch.Tensor, size: torch.Tensor, ulps: int = 0) -> float:
    """The largest |out - ref| over the element's own ``size`` (the dtype's smallest subnormal at least, so that
    a value rounded there counts as exact), where the reference is finite; ``ulps``: each error first less that
    many units in the last place of the output's dtype at the reference's value."""
    r = ref.double()
    finite = r.isfinite() & size.isfinite()
    if not finite.any():
        return 0.0
    diff = torch.where(finite, (out.double() - r).abs(), 0.0)
    info = torch.finfo(out.dtype)
    if ulps:
        diff = (diff - ulps * info.eps * torch.where(finite, r.abs(), 0.0).clamp_min(info.smallest_normal))
        diff = diff.clamp_min(0.0)
    bound = torch.where(finite, size, 1.0).clamp_min(info.smallest_normal * info.eps)
    return float((diff / bound).max())


def _gradient_sizes(x, t, reduction: str, log_target: bool, from_probs: bool, g) -> tuple:
    """Each gradient element measured by the size of its terms, as _conditioning measures the loss's: the
    derivatives of t (log t - x) (e^t (t - x) for log_target; x = log p for probabilities) with every term by
    its magnitude, times |grad_output| over the reduction's divisor, summed over the broadcast dimensions as the
    gradient is. A gradient element whose terms cancel (t - x near -1) is judged on its terms, one that does
    not on its own value: one element of a thousand 1.5 x too large passed the norm and the largest element's
    scale."""
    x, t, g = x.double(), t.double(), g.double()
    shape = torch.broadcast_shapes(x.shape, t.shape)
    logp = x.log().abs() if from_probs else x.abs()
    if log_target:
        weight = t.exp()
        dx = weight / x.abs() if from_probs else weight
        dt = weight * (t.abs() + logp + 1)
    else:
        dx = t.abs() / x.abs() if from_probs else t.abs()
        dt = torch.where(t > 0, t, 1.0).log().abs() + logp + 1
    divisor = {"none": 1, "sum": 1, "mean": max(math.prod(shape), 1),
               "batchmean": x.shape[0] if x.dim() else 1}[reduction]  # (F.kl_div's: the input's first size)
    scale = g.abs() / divisor
    return ((dx.expand(shape) * scale).sum_to_size(x.shape), (dt.expand(shape) * scale).sum_to_size(t.shape))


def check_one(x, t, reduction: str, log_target: bool, from_probs: bool) -> float:
    """The op's output against float64: the relative error (inf where the dtype or a NaN's place is wrong). For
    reduction='none' each element is also measured against its own terms' size (``_conditioning``): one element
    wrong among a thousand small ones hides in a norm, and in the largest element's scale."""
    f = kl_div_from_probs if from_probs else kl_div
    with poisoned(x.device.type), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 'mean' warns, as PyTorch's does
        out = f(x, t, reduction=reduction, log_target=log_target)
    return _loss_error(out, kl_div_reference(x, t, reduction, log_target, from_probs), x, t, reduction, log_target,
                       from_probs)


def _loss_error(out, ref, x, t, reduction: str, log_target: bool, from_probs: bool) -> float:
    """check_one's measure of a loss ``out`` the op gave for (x, t), against its float64 reference ``ref``."""
    if out.dtype != torch.result_type(x, t):
        return math.inf
    ref = ref.detach()
    err = _error(out.detach(), ref, TOLERANCE[out.dtype])
    if reduction == "none" and err != math.inf and out.numel():
        size = _conditioning(x.detach(), t.detach(), log_target, from_probs).expand(ref.shape)
        err = max(err, _element_error(out.detach(), ref, size))
    return err


def check_grads(x, t, reduction: str, log_target: bool, from_probs: bool) -> dict[str, float]:
    """The gradients of both operands against float64 autograd of the reference, for a random grad_output (1 for
    'sum': the forward's fused gradient handed back as is, rescaled otherwise): {"grad input": err, "grad
    target": err, "loss": err}, each gradient element against its own terms' size (_gradient_sizes), allowed one
    unit in the last place of its dtype (a float16 mean's gradients lie in the subnormals, where one rounding is
    several per cent); "loss" is the training forward's loss as check_one measures it (the kernels that write the
    gradient in the same pass compute it too). Gradients are made in poisoned memory, as outputs are."""
    f = kl_div_from_probs if from_probs else kl_div
    xs, ts = x.detach().requires_grad_(), t.detach().requires_grad_()
    xr, tr = x.detach().double().requires_grad_(), t.detach().double().requires_grad_()
    with poisoned(x.device.type), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = f(xs, ts, reduction=reduction, log_target=log_target)
        ref = kl_div_reference(xr, tr, reduction, log_target, from_probs)
        g = torch.ones_like(ref) if reduction == "sum" else torch.rand_like(ref) * 1.5 + 0.5
        grads = torch.autograd.grad(out, (xs, ts), g.to(out.dtype))
    want = torch.autograd.grad(ref, (xr, tr), g)
    sizes = _gradient_sizes(x, t, reduction, log_target, from_probs, g)
    errors = {"loss": _loss_error(out, ref, x, t, reduction, log_target, from_probs)}
    for name, got, ref_grad, operand, size in zip(("grad input", "grad target"), grads, want, (x, t), sizes):
        bad = got.dtype != operand.dtype or got.shape != operand.shape
        # (each element on its terms: a norm relative to values that cancel to near 0, the target's gradient of
        # one probability at t / p near 1 / e, is no measure of the kernel; NaN or inf out of place is inf)
        misplaced = not bad and compare(got, ref_grad, TOLERANCE[operand.dtype])["rel_err"] == math.inf
        errors[name] = math.inf if bad or misplaced else _element_error(got, ref_grad, size, ulps=1)
    return errors


def run_checks(device: str, dtypes=DTYPES, cases=CASES) -> Iterator[dict]:
    """One row per case, dtype, form, log_target, reduction and output checked: "loss" (the op's value), "grad
    input" and "grad target" (both operands' gradients), each within the dtype's tolerance."""
    for case, dtype, from_probs, log_target, reduction in itertools.product(
            cases, dtypes, (True, False), (False, True), ("none", "sum", "mean", "batchmean")):
        if case.name == "target-zeros" and log_target and reduction != "none":
            # exp(-inf) * (-inf - x) is NaN (PyTorch's rule), so every reduced value is NaN on both sides: a
            # check that cannot fail. reduction='none' checks where the NaNs lie.
            continue
        x, t = case.make(dtype, device, from_probs, log_target)
        errors = check_grads(x, t, reduction, log_target, from_probs)
        # (the loss row: the worse of the plain forward's and the training forward's, which also writes the gradient)
        errors["loss"] = max(check_one(x, t, reduction, log_target, from_probs), errors["loss"])
        errors = {k: errors[k] for k in ("loss", "grad input", "grad target")}
        tol = TOLERANCE[dtype]
        for output, err in errors.items():
            yield {
                "device": device, "case": case.name, "dtype": str(dtype).removeprefix("torch."),
                "form": "probs" if from_probs else "logprobs", "log_target": log_target, "reduction": reduction,
                "output": output, "shape": "x".join(map(str, x.shape)) or "()", "rel_err": err, "tol": tol,
                "ok": err <= tol,
            }


def write_csv(rows: list[dict], path: Path) -> Path:
    from .envinfo import write_atomic

    return write_atomic(path, pd.DataFrame(rows).to_csv(index=False))


def summary_table(rows: list[dict]) -> str:
    """One line per (dtype, form): cases run, failures, worst relative error against its tolerance."""
    lines = [f"{'dtype':<10}{'form':<10}{'checks':>7}{'failed':>7}{'worst rel err':>15}{'tol':>10}"]
    keys = sorted({(r["dtype"], r["form"]) for r in rows})
    for dtype, form in keys:
        sel = [r for r in rows if r["dtype"] == dtype and r["form"] == form]
        worst = max(r["rel_err"] for r in sel)
        lines.append(f"{dtype:<10}{form:<10}{len(sel):>7}{sum(not r['ok'] for r in sel):>7}{worst:>15.3e}"
                     f"{sel[0]['tol']:>10.1e}")
    return "\n".join(lines)
