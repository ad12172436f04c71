"""Tests of the public op (kldiv_inline.ops) against PyTorch's kl_div evaluated in float64.

Every test draws fresh random inputs (conftest reseeds torch from os.urandom; the seed is printed, so it
shows in a failure's captured output for replay). Forward results are compared element by element
(reduction='none') and as reduced scalars, with the per-dtype relative tolerances of harness.TOLERANCE;
gradients with torch.testing.assert_close against float64 autograd of F.kl_div.

Tests parametrised over `device` run on cpu always and on cuda where a GPU is present (marked `gpu`);
tests that only make sense on a GPU carry `@pytest.mark.gpu` themselves.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import kldiv_inline as K
from kldiv_inline import kernelbench
from kldiv_inline.harness import TOLERANCE, poison_allocator
from kldiv_inline.reference import kl_div_reference, relative_error

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
REDUCTIONS = ["none", "sum", "mean", "batchmean"]
FORMS = ["logprobs", "probs"]

# Gradient tolerances (rtol; atol is rtol times the largest reference magnitude): a couple of roundings of
# the dtype (the fused gradient is rounded once when written and once when rescaled by grad_output).
GRAD_RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


@pytest.fixture(autouse=True)
def _print_seed(_fresh_seed):
    print(f"torch.manual_seed({_fresh_seed})")


# ------------------------------------------------------------------------------------------ helpers
def probs(shape, dtype=torch.float64) -> torch.Tensor:
    """Random probability rows along the last dimension, in float64 (CPU), with a random softmax
    temperature; strictly positive and normal in `dtype` (clamped to its smallest normal)."""
    shape = tuple(shape)
    if shape == ():
        p = torch.rand((), dtype=torch.float64) * 0.9 + 0.05
    else:
        scale = float(torch.rand(())) * 3 + 0.25
        p = (torch.randn(shape, dtype=torch.float64) * scale).softmax(-1)
    return p.clamp_min(torch.finfo(dtype).tiny)


def make_pair(shape_x, shape_t, dtype, device, form, log_target):
    """(input, target) in `dtype` on `device`: input holds probabilities (form 'probs') or their logs,
    target probabilities or (log_target) their logs."""
    p, q = probs(shape_x, dtype), probs(shape_t, dtype)
    while p.dim() == 0 and q.dim() == 0 and abs(float(p.log() - q.log())) < 0.05:
        # One element with t close to p: the loss t*log(t/p) is a cancellation near 0 whose relative error
        # in float32 is unbounded for PyTorch too (1e-5 fails about once in 100 draws). Keep it away from 0.
        q = probs(shape_t, dtype)
    x = p if form == "probs" else p.log()
    t = q.log() if log_target else q
    return x.to(device=device, dtype=dtype), t.to(device=device, dtype=dtype)


def op(form):
    return K.kl_div_from_probs if form == "probs" else K.kl_div


def call(form, x, t, reduction, log_target=False):
    """The kit's op, with the 'mean' warning silenced and (on CUDA) the allocator poisoned with NaN."""
    poison_allocator(x.device.type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return op(form)(x, t, reduction=reduction, log_target=log_target)


def torch_native(form, x, t, reduction, log_target=False):
    """PyTorch's own result in the inputs' dtypes (for the result dtype and shape)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        xx = torch.log(x) if form == "probs" else x
        return F.kl_div(xx, t, reduction=reduction, log_target=log_target)


def reference(form, x, t, reduction, log_target=False):
    return kl_div_reference(x, t, reduction, log_target, from_probs=form == "probs")


def assert_forward_matches(out, form, x, t, reduction, log_target, *, tol=None, nondegenerate=True):
    native = torch_native(form, x, t, reduction, log_target)
    # Mixed dtypes: float64 of the operands as given, rounded to the result dtype. A widening conversion is exact;
    # a narrowing one (a 0-d operand wider than the result) is not made: the kernels run in the wider dtype (a
    # float64 0-d operand rounded to float16 first could flush to 0 or overflow).
    def ref_of(red):
        return reference(form, x.double(), t.double(), red, log_target).to(native.dtype)

    ref = ref_of(reduction)
    assert out.shape == native.shape == ref.shape, (out.shape, native.shape)
    assert out.dtype == native.dtype, (out.dtype, native.dtype)
    assert out.device == x.device
    if reduction != "none":
        assert out.dim() == 0
    if nondegenerate and ref.numel():
        # The test data must say something: finite, not all zero.
        assert torch.isfinite(ref).all() and ref.abs().max() > 0
    tol = TOLERANCE[out.dtype] if tol is None else tol
    err = relative_error(out, ref)
    if reduction != "none" and err > tol and ref.numel():
        # A reduced loss whose terms cancel: held to the magnitude of its terms (the same reduction of |terms|),
        # not to its own size, which would ask for more digits than the terms hold.
        terms = ref_of("none").double().abs()
        mag = {"sum": terms.sum(), "mean": terms.mean(),
               "batchmean": terms.sum() / (terms.shape[0] if terms.dim() else 1)}[reduction]
        err = float((out.double() - ref.double()).abs() / max(float(mag), float(ref.double().abs())))
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e} ({form}, {reduction}, log_target={log_target})"


def ref_grads(form, x, t, reduction, log_target, grad_out, wrt):
    """float64 autograd of F.kl_div (of torch.log(p) for the probs form)."""
    x64 = x.detach().double().requires_grad_(wrt in ("input", "both"))
    t64 = t.detach().double().requires_grad_(wrt in ("target", "both"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = F.kl_div(torch.log(x64) if form == "probs" else x64, t64, reduction=reduction,
                        log_target=log_target)
    wanted = [v for v in (x64, t64) if v.requires_grad]
    grads = torch.autograd.grad(loss, wanted, grad_out.double())
    out = {}
    if x64.requires_grad:
        out["input"] = grads[0]
    if t64.requires_grad:
        out["target"] = grads[-1]
    return out


def assert_grad_close(got, ref, like: torch.Tensor, rtol=None, scale=None):
    """Per element within rtol, or rtol x ``scale`` absolute: by default the largest |ref|; a gradient summed
    back over broadcast dims passes the magnitude of what was summed (its terms cancel: the sum's own size would
    ask for more digits than the terms hold)."""
    assert got is not None, "no gradient"
    assert got.shape == like.shape and got.dtype == like.dtype and got.device == like.device
    rtol = GRAD_RTOL[like.dtype] if rtol is None else rtol
    finite = ref[torch.isfinite(ref)]
    if scale is None:
        scale = float(finite.abs().max()) if finite.numel() else 1.0
    torch.testing.assert_close(got.double(), ref.to(got.device), rtol=rtol, atol=rtol * scale, equal_nan=True)


def random_grad_out(like: torch.Tensor) -> torch.Tensor:
    """A non-unit grad_output of `like`'s shape: magnitudes in [0.5, 2.5], random signs."""
    g = torch.rand(like.shape, dtype=torch.float64) * 2 + 0.5
    g = g * torch.where(torch.rand(like.shape) < 0.5, -1.0, 1.0).double()
    return g.to(device=like.device, dtype=like.dtype)


# ------------------------------------------------------------------------------- 1. forward grid
def _layout(name, dtype, device, form, lt):
    mk = lambda sx, st=None: make_pair(sx, st if st is not None else sx, dtype, device, form, lt)  # noqa: E731
    if name == "0d":
        return mk(())
    if name == "1d":
        return mk((1023,))
    if name == "2d":
        return mk((64, 300))
    if name == "3d":
        return mk((4, 8, 100))
    if name == "2d-multichunk":  # > 2 chunks of the CPU twin, with a ragged tail
        return mk((40, 1031))
    if name == "transposed":
        x, t = mk((96, 130))
        return x.t(), t.t()
    if name == "sliced":
        x, t = mk((64, 257))
        return x[3:, 1:], t[:61, :-1]  # storage offsets, strided rows
    if name == "offset-contiguous":  # contiguous but not 16-byte aligned (CUDA's scalar fallback)
        x, t = mk((4100,))
        return x[1:4097], t[3:4099]
    if name == "bcast-target-row":
        return mk((48, 333), (1, 333))
    if name == "bcast-input":
        return mk((1, 7, 65), (5, 7, 65))
    if name == "bcast-rank":
        return mk((33,), (6, 33))
    raise AssertionError(name)


LAYOUTS = ["0d", "1d", "2d", "3d", "2d-multichunk", "transposed", "sliced", "offset-contiguous",
           "bcast-target-row", "bcast-input", "bcast-rank"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_forward_matches_float64(device, layout, dtype, form, log_target, reduction):
    x, t = _layout(layout, dtype, device, form, log_target)
    if layout in ("transposed", "sliced"):
        assert not x.is_contiguous() and not t.is_contiguous()
    out = call(form, x, t, reduction, log_target)
    assert_forward_matches(out, form, x, t, reduction, log_target)


MIXED = [
    # (input dtype, input shape, target dtype, target shape)
    (torch.float32, (8, 50), torch.float64, (8, 50)),     # -> float64
    (torch.float64, (8, 50), torch.float32, (8, 50)),     # -> float64
    (torch.float16, (8, 50), torch.bfloat16, (8, 50)),    # -> float32
    (torch.bfloat16, (8, 50), torch.float32, (1, 50)),    # -> float32, broadcast
    (torch.float32, (8, 50), torch.float64, ()),          # 0-d target does not promote -> float32
    (torch.float64, (), torch.float16, (50,)),            # 0-d input does not promote -> float16
]


@pytest.mark.parametrize("mixed", MIXED, ids=lambda m: f"{_dtype_id(m[0])}{list(m[1])}-{_dtype_id(m[2])}{list(m[3])}")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_forward_mixed_dtypes(device, mixed, form, log_target, reduction):
    xdt, xs, tdt, ts = mixed
    x, _ = make_pair(xs, xs, xdt, device, form, log_target)
    _, t = make_pair(ts, ts, tdt, device, form, log_target)
    out = call(form, x, t, reduction, log_target)
    assert out.dtype == torch.result_type(x, t)
    assert_forward_matches(out, form, x, t, reduction, log_target)


def test_mixed_dtype_result_is_float64_like_pytorch(device):
    x, t = make_pair((4, 9), (4, 9), torch.float32, device, "logprobs", False)
    out = K.kl_div(x, t.double(), reduction="batchmean")
    assert out.dtype == torch.float64 == F.kl_div(x, t.double(), reduction="batchmean").dtype


# ------------------------------------------------------------------------------- 2. edge cases
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
def test_empty(device, form, log_target):
    x, t = make_pair((0, 5), (0, 5), torch.float32, device, form, log_target)
    expected = {"sum": 0.0, "mean": math.nan, "batchmean": math.nan}
    for reduction, value in expected.items():
        out = call(form, x, t, reduction, log_target)
        assert out.shape == () and out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), torch.tensor(value), equal_nan=True)
        torch.testing.assert_close(out.double(), reference(form, x, t, reduction, log_target), equal_nan=True)
    out = call(form, x, t, "none", log_target)
    assert out.shape == (0, 5) and out.dtype == torch.float32

    x, t = make_pair((3, 0), (3, 0), torch.float32, device, form, log_target)
    for reduction, value in {"sum": 0.0, "mean": math.nan, "batchmean": 0.0}.items():
        out = call(form, x, t, reduction, log_target)
        torch.testing.assert_close(out.cpu(), torch.tensor(value), equal_nan=True)
        torch.testing.assert_close(out.double(), reference(form, x, t, reduction, log_target), equal_nan=True)
    assert call(form, x, t, "none", log_target).shape == (3, 0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_backward(device, form, reduction):
    x, t = make_pair((0, 5), (0, 5), torch.float32, device, form, False)
    x.requires_grad_()
    t.requires_grad_()
    loss = call(form, x, t, reduction)
    gx, gt = torch.autograd.grad(loss.sum(), (x, t))
    assert gx.shape == x.shape and gt.shape == t.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("where", ["scattered", "first-rows"])
def test_target_zeros(device, dtype, form, where):
    # (8, 6000): three chunks of the CPU twin; 'first-rows' puts every zero in the first chunk, so the
    # other chunks take the vectorised float32 path and the first one its exact fallback.
    x, t = make_pair((8, 6000), (8, 6000), dtype, device, form, False)
    if where == "scattered":
        mask = torch.rand(t.shape, device=device) < 0.3
    else:
        mask = torch.zeros(t.shape, dtype=torch.bool, device=device)
        mask[:2] = torch.rand(2, t.shape[1], device=device) < 0.5
    t = t.masked_fill(mask, 0.0)
    assert mask.any() and (~mask).any()
    out = call(form, x, t, "none")
    assert torch.isfinite(out).all()
    assert (out[mask] == 0).all()  # xlogy(0, 0) - 0 * logp == 0
    assert_forward_matches(out, form, x, t, "none", False)
    for reduction in ("sum", "mean", "batchmean"):
        out = call(form, x, t, reduction)
        assert torch.isfinite(out)
        assert_forward_matches(out, form, x, t, reduction, False)


SPECIALS = [("x", math.inf), ("x", -math.inf), ("x", math.nan), ("x", 0.0), ("x", -0.25),
            ("t", math.inf), ("t", -math.inf), ("t", math.nan), ("t", -0.25), ("all", None)]


def _inject(x, t, which, value):
    """Writes `value` into ~3% of the positions of x or t (or a mix of every special into both)."""
    x, t = x.clone(), t.clone()
    if which == "all":
        for i, (w, v) in enumerate(s for s in SPECIALS if s[0] != "all"):
            target = x if w == "x" else t
            target.view(-1)[i * 7 + 3] = v
        return x, t
    target = x if which == "x" else t
    mask = torch.rand(target.shape, device=target.device) < 0.03
    mask.view(-1)[0] = True
    target.masked_fill_(mask, value)
    return x, t


@pytest.mark.parametrize("special", SPECIALS, ids=lambda s: f"{s[0]}={s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
def test_special_values_propagate_like_pytorch(device, special, dtype, form, log_target):
    x, t = make_pair((32, 64), (32, 64), dtype, device, form, log_target)
    x, t = _inject(x, t, *special)
    tol = TOLERANCE[dtype]
    ref_none = reference(form, x, t, "none", log_target)
    finite = ref_none[torch.isfinite(ref_none)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0

    out = call(form, x, t, "none", log_target)
    assert out.dtype == dtype and out.shape == ref_none.shape
    assert torch.equal(torch.isnan(out), torch.isnan(ref_none))
    torch.testing.assert_close(out.double(), ref_none, rtol=tol, atol=tol * scale, equal_nan=True)

    for reduction in ("sum", "batchmean"):
        out = call(form, x, t, reduction, log_target)
        ref = reference(form, x, t, reduction, log_target)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * float(finite.abs().sum()) + 1e-30,
                                   equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_negative_probabilities_give_nan(device, dtype):
    # from_probs with p < 0: log(p) is NaN, as in F.kl_div(torch.log(p), t).
    p, t = make_pair((4, 50), (4, 50), dtype, device, "probs", False)
    p[:, ::5] = -p[:, ::5]
    out = call("probs", p, t, "none")
    assert torch.isnan(out[:, ::5]).all() and not torch.isnan(out[:, 1::5]).any()
    assert torch.isnan(reference("probs", p, t, "none")[:, ::5]).all()
    assert torch.isnan(call("probs", p, t, "sum")) and torch.isnan(call("probs", p, t, "batchmean"))
    # A negative target probability: xlogy(t, t) is NaN.
    x, t = make_pair((4, 50), (4, 50), dtype, device, "logprobs", False)
    t[:, 2] = -0.125
    out = call("logprobs", x, t, "none")
    assert torch.isnan(out[:, 2]).all() and torch.isnan(reference("logprobs", x, t, "none")[:, 2]).all()
    assert torch.isnan(call("logprobs", x, t, "sum"))


SUBNORMAL = {torch.float32: 1e-40, torch.float64: 1e-310, torch.float16: 1e-6, torch.bfloat16: 1e-40}


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("operand", ["target", "input"])
def test_subnormal_probabilities(device, dtype, form, operand):
    if operand == "input" and form == "logprobs":
        pytest.skip("a log-probability input is never subnormal for a subnormal probability")
    tiny = SUBNORMAL[dtype]
    assert 0 < torch.tensor(tiny, dtype=dtype).item() < torch.finfo(dtype).tiny  # really subnormal
    x, t = make_pair((16, 300), (16, 300), dtype, device, form, False)
    mask = torch.rand(t.shape, device=device) < 0.2
    if operand == "target":
        t = t.masked_fill(mask, tiny)
    else:
        x = x.masked_fill(mask, tiny)
    out = call(form, x, t, "none")
    ref = reference(form, x, t, "none")
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    assert_forward_matches(out, form, x, t, "none", False)
    # Per element where the subnormal sits (its terms are too small to show in the norm): within the
    # dtype's tolerance, or the absolute resolution of subnormals when the result is itself subnormal.
    torch.testing.assert_close(out[mask].double(), ref[mask], rtol=TOLERANCE[dtype],
                               atol=2 * torch.finfo(dtype).tiny * torch.finfo(dtype).eps)  # 2 subnormal ulps
    for reduction in ("sum", "batchmean"):
        out = call(form, x, t, reduction)
        assert torch.isfinite(out)
        assert_forward_matches(out, form, x, t, reduction, False)


# ------------------------------------------------------------------------------- 3. 'mean' warning
@pytest.mark.parametrize("form", FORMS)
def test_mean_warns_like_pytorch(device, form):
    x, t = make_pair((4, 10), (4, 10), torch.float32, device, form, False)
    with pytest.warns(UserWarning, match="'batchmean' divides only by the batch size") as rec:
        op(form)(x, t, reduction="mean")
    ours = [w for w in rec if "batchmean" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__  # stacklevel points at the caller, as F.kl_div's does
    with pytest.warns(UserWarning) as rec_torch:
        F.kl_div(x if form == "logprobs" else x.log(), t, reduction="mean")
    assert str(ours[0].message) == str(rec_torch[0].message)
    with pytest.warns(UserWarning, match="batchmean"):
        K.KLDivLoss(reduction="mean")(x if form == "logprobs" else x.log(), t)


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
def test_other_reductions_do_not_warn(device, reduction):
    x, t = make_pair((4, 10), (4, 10), torch.float32, device, "logprobs", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K.kl_div(x, t, reduction=reduction)
        K.kl_div_from_probs(x.exp(), t, reduction=reduction)
        K.KLDivLoss(reduction=reduction)(x, t)


# ------------------------------------------------------------------------------- 4. bad input
@pytest.mark.parametrize("form", FORMS)
def test_errors(device, form):
    f = op(form)
    x, t = make_pair((3, 4), (3, 4), torch.float32, device, form, False)
    with pytest.raises(ValueError, match="broadcastable"):
        f(x, t[:, :3], reduction="sum")
    with pytest.raises(ValueError, match="broadcastable"):
        f(x.reshape(2, 6), t, reduction="none")
    with pytest.raises(TypeError):
        f((x * 100).long(), t, reduction="sum")
    with pytest.raises(TypeError):
        f(x, (t * 100).int(), reduction="sum")
    with pytest.raises(TypeError):
        f(x.to(torch.complex64), t, reduction="sum")
    with pytest.raises(TypeError):
        f(x, t.to(torch.complex128), reduction="sum")
    with pytest.raises(TypeError):
        f(x, t.bool(), reduction="sum")
    with pytest.raises(ValueError, match="reduction"):
        f(x, t, reduction="avg")
    with pytest.raises(TypeError):
        f(x.tolist(), t, reduction="sum")
    with pytest.raises(TypeError):
        f(x, 0.5, reduction="sum")
    with pytest.raises(TypeError):
        f(x, t, reduction="sum", log_target="yes")
    with pytest.raises(ValueError, match="reduction"):
        K.KLDivLoss(reduction="avg")


@pytest.mark.gpu
def test_different_devices_raise():
    # The same ValueError from the checked path and from the eager inference fast path.
    x, t = make_pair((3, 4), (3, 4), torch.float32, "cpu", "logprobs", False)
    cases = [(x, t.cuda()), (x.cuda(), t), (x.clone().requires_grad_(), t.cuda()), (x[:1].cuda(), t)]
    for a, b in cases:
        for f in (K.kl_div, K.kl_div_from_probs):
            with pytest.raises(ValueError, match="device"):
                f(a, b, reduction="sum")


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cpu_scalar_target_with_cuda_input_like_pytorch(reduction):
    # PyTorch treats a 0-d CPU tensor as a scalar that combines with tensors on any device.
    x, _ = make_pair((5, 7), (5, 7), torch.float32, "cuda", "logprobs", False)
    t = torch.rand(()) * 0.5 + 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = K.kl_div(x, t, reduction=reduction)
        expected = F.kl_div(x.double(), t.double().cuda(), reduction=reduction)
    assert out.device == x.device and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-7)


def test_cuda_module_rejects_cpu_tensors():
    try:
        mod = K.load("cuda")
    except (ImportError, OSError, K.ToolchainError) as e:
        if torch.cuda.is_available():
            raise
        pytest.skip(f"the CUDA module cannot be built or imported on this machine without a GPU: {e!r}")
    assert mod.backend() == "cuda"
    x, t = make_pair((3, 4), (3, 4), torch.float32, "cpu", "logprobs", False)
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        mod.kl_div_forward(x, t, True, 1.0, False, False, False)
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        mod.kl_div_forward(x, t, False, 1.0, False, True, False)


@pytest.mark.gpu
def test_cpu_module_rejects_cuda_tensors():
    mod = K.load("cpu")
    x, t = make_pair((3, 4), (3, 4), torch.float32, "cuda", "logprobs", False)
    with pytest.raises(RuntimeError, match="(?i)cpu"):
        mod.kl_div_forward(x, t, True, 1.0, False, False, False)


# ------------------------------------------------------------------------------- 5. backward
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("wrt", ["input", "target", "both"])
@pytest.mark.parametrize("grad_out", ["ones", "random"])
def test_backward_matches_float64_autograd(device, dtype, form, log_target, reduction, wrt, grad_out):
    x, t = make_pair((16, 37), (16, 37), dtype, device, form, log_target)
    x.requires_grad_(wrt in ("input", "both"))
    t.requires_grad_(wrt in ("target", "both"))
    loss = call(form, x, t, reduction, log_target)
    assert loss.requires_grad
    assert_forward_matches(loss.detach(), form, x.detach(), t.detach(), reduction, log_target)
    if grad_out == "ones":
        # loss.backward(): grad_output 1 (the fused gradient is used as it is); for 'none' an expanded one.
        (loss.sum() if reduction == "none" else loss).backward()
        go = torch.ones_like(loss)
    else:
        go = random_grad_out(loss)
        loss.backward(go)
    ref = ref_grads(form, x, t, reduction, log_target, go, wrt)
    if wrt in ("input", "both"):
        assert_grad_close(x.grad, ref["input"], x)
    else:
        assert x.grad is None
    if wrt in ("target", "both"):
        assert_grad_close(t.grad, ref["target"], t)
    else:
        assert t.grad is None


BCAST = [((1, 33), (8, 33)), ((8, 33), (1, 33)), ((33,), (4, 5, 33)), ((4, 1, 33), (1, 5, 33)),
         ((), (6,)), ((6,), ())]


@pytest.mark.parametrize("shapes", BCAST, ids=lambda s: f"{list(s[0])}-{list(s[1])}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_broadcast(device, shapes, dtype, form, log_target, reduction):
    x, t = make_pair(*shapes, dtype, device, form, log_target)
    x.requires_grad_()
    t.requires_grad_()
    loss = call(form, x, t, reduction, log_target)
    assert_forward_matches(loss.detach(), form, x.detach(), t.detach(), reduction, log_target)
    go = random_grad_out(loss)
    loss.backward(go)
    ref = ref_grads(form, x, t, reduction, log_target, go, "both")
    # Summed back to each input's shape: the bound is the sum of the terms' magnitudes (per-element gradients of
    # the inputs expanded to the broadcast shape), not the sum's own size, which cancellation can make tiny.
    shape = torch.broadcast_shapes(x.shape, t.shape)
    terms = ref_grads(form, x.detach().expand(shape), t.detach().expand(shape), reduction, log_target, go, "both")

    def bound(g, like):
        b = g.abs().sum_to_size(like.shape)
        finite = b[torch.isfinite(b)]
        return float(finite.max()) if finite.numel() else 1.0

    assert_grad_close(x.grad, ref["input"], x, scale=bound(terms["input"], x))
    assert_grad_close(t.grad, ref["target"], t, scale=bound(terms["target"], t))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "offset-contiguous"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_non_contiguous(device, layout, form, reduction):
    x, t = _layout(layout, torch.float32, device, form, False)
    x.requires_grad_()
    t.requires_grad_()
    loss = call(form, x, t, reduction)
    go = random_grad_out(loss)
    loss.backward(go)
    ref = ref_grads(form, x, t, reduction, False, go, "both")
    assert_grad_close(x.grad, ref["input"], x)
    assert_grad_close(t.grad, ref["target"], t)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_mixed_dtypes(device, form, reduction):
    x, _ = make_pair((6, 20), (6, 20), torch.float32, device, form, False)
    _, t = make_pair((6, 20), (6, 20), torch.float64, device, form, False)
    x.requires_grad_()
    t.requires_grad_()
    loss = call(form, x, t, reduction)
    assert loss.dtype == torch.float64
    go = random_grad_out(loss)
    loss.backward(go)
    ref = ref_grads(form, x, t, reduction, False, go, "both")
    assert_grad_close(x.grad, ref["input"], x)  # float32, like the input
    assert_grad_close(t.grad, ref["target"], t)  # float64


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(device, form, log_target, reduction):
    # Small float64 inputs, probabilities bounded away from 0 (finite differences stay in the domain);
    # strictly positive targets, so the target gradient is defined.
    p = (torch.randn(3, 4, dtype=torch.float64) * 0.5).softmax(-1)
    q = (torch.randn(3, 4, dtype=torch.float64) * 0.5).softmax(-1)
    x = (p if form == "probs" else p.log()).to(device).requires_grad_()
    t = (q.log() if log_target else q).to(device).requires_grad_()

    def f(a, b):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return op(form)(a, b, reduction=reduction, log_target=log_target)

    assert torch.autograd.gradcheck(f, (x, t))
    # And each alone (the fused input gradient is used only when the input is the one requiring grad).
    assert torch.autograd.gradcheck(lambda a: f(a, t.detach()), (x,))
    assert torch.autograd.gradcheck(lambda b: f(x.detach(), b), (t,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_dtype_id)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("first", ["ones", "random"])
def test_retain_graph_second_backward_recomputes(device, dtype, form, reduction, first):
    x, t = make_pair((12, 40), (12, 40), dtype, device, form, False)
    x.requires_grad_()
    loss = call(form, x, t, reduction)
    go1 = torch.ones_like(loss) if first == "ones" else random_grad_out(loss)
    go2, go3 = random_grad_out(loss), random_grad_out(loss)
    ref = lambda go: ref_grads(form, x, t, reduction, False, go, "input")["input"]  # noqa: E731

    (g1,) = torch.autograd.grad(loss, x, go1, retain_graph=True)
    g1_copy = g1.clone()
    assert_grad_close(g1, ref(go1), x)
    loss.backward(go2, retain_graph=True)
    assert_grad_close(x.grad, ref(go2), x)
    loss.backward(go3, retain_graph=True)  # accumulates into x.grad
    # Against the size of what was added: go2 and go3 of opposite signs and nearly equal size leave a sum ~1e-3 of
    # each term, below the terms' own float32 rounding (seed 263446835: go -1.9906 and 1.9927, a sum 1e-3 of each).
    r2, r3 = ref(go2), ref(go3)
    assert_grad_close(x.grad, r2 + r3, x, scale=float(r2.abs().max() + r3.abs().max()))
    (g4,) = torch.autograd.grad(loss, x, go1)
    assert_grad_close(g4, ref(go1), x)
    assert torch.equal(g1, g1_copy)  # a gradient handed out earlier is never rescaled behind our back


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_target_gradient_nan_at_zero_like_pytorch(device, form, reduction):
    x, t = make_pair((6, 30), (6, 30), torch.float64, device, form, False)
    mask = torch.rand(t.shape, device=device) < 0.25
    mask[0, 0] = True
    t = t.masked_fill(mask, 0.0).requires_grad_()
    x.requires_grad_()
    loss = call(form, x, t, reduction)
    go = random_grad_out(loss)
    loss.backward(go)
    ref = ref_grads(form, x, t, reduction, False, go, "both")
    assert torch.isnan(ref["target"][mask]).all()  # PyTorch: d xlogy(t, t)/dt at 0 is NaN (pytorch#89558)
    assert torch.isnan(t.grad[mask]).all()
    assert not torch.isnan(t.grad[~mask]).any()
    assert_grad_close(t.grad, ref["target"], t)
    assert_grad_close(x.grad, ref["input"], x)


# ------------------------------------------------------------------------------- 6. opcheck
def _fwd_args(device, reduction, form, log_target, want_grad, requires_grad):
    x, t = make_pair((8, 16), (8, 16), torch.float32, device, form, log_target)
    divisor = {"none": 1.0, "sum": 1.0, "batchmean": 8.0, "mean": 128.0}[reduction]
    return (x.requires_grad_(requires_grad), t.requires_grad_(requires_grad), reduction != "none", divisor,
            log_target, form == "probs", want_grad)


FWD_SAMPLES = [("none", False), ("sum", False), ("batchmean", False), ("mean", True), ("batchmean", True)]


@pytest.mark.parametrize("sample", FWD_SAMPLES, ids=lambda s: f"{s[0]}-want_grad={s[1]}")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
def test_opcheck_forward(device, sample, form, log_target):
    reduction, want_grad = sample
    args = _fwd_args(device, reduction, form, log_target, want_grad, requires_grad=False)
    torch.library.opcheck(torch.ops.kldiv_inline.kl_div_forward.default, args)


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
@pytest.mark.parametrize("form", FORMS)
def test_opcheck_forward_requires_grad(device, reduction, form):
    # want_grad=False: the backward recomputes with kl_div_backward.
    args = _fwd_args(device, reduction, form, False, False, requires_grad=True)
    torch.library.opcheck(torch.ops.kldiv_inline.kl_div_forward.default, args)


@pytest.mark.parametrize("form", FORMS)
def test_opcheck_forward_fused_gradient(device, form):
    args = _fwd_args(device, "batchmean", form, False, True, requires_grad=True)
    torch.library.opcheck(torch.ops.kldiv_inline.kl_div_forward.default, args)


@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
@pytest.mark.parametrize("want", [(True, True), (True, False), (False, True)], ids=["x+t", "x", "t"])
def test_opcheck_backward(device, reduction, form, log_target, want):
    x, t = make_pair((8, 16), (8, 16), torch.float32, device, form, log_target)
    go = random_grad_out(x if reduction == "none" else x.new_empty(()))
    divisor = 8.0 if reduction == "batchmean" else 1.0
    args = (go, x, t, reduction != "none", divisor, log_target, form == "probs", *want)
    torch.library.opcheck(torch.ops.kldiv_inline.kl_div_backward.default, args)


def test_opcheck_scale_grad(device):
    grad = torch.randn(5, 7, device=device)
    torch.library.opcheck(torch.ops.kldiv_inline.kl_div_scale_grad_.default, (grad, torch.tensor(2.5, device=device)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_scale_grad_in_place_at_any_length_and_alignment(device, dtype):
    # kl_div_scale_grad_, the backward's pass over the fused gradient when grad_output is not 1: each entry times
    # the factor, rounded once to the dtype, at lengths and starts that leave the CUDA kernel an unaligned head,
    # whole 16-byte vectors and a tail; nothing beside the span written; a factor of 1 leaves it as it is.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for n in (1, 7, 33, 2053, 70001):
        for off in (0, 1, 3):
            base = (torch.randn(off + n + 8, device=device) * 3).to(dtype)
            g = base[off:off + n]
            go = (torch.randn((), device=device) * 2).to(dtype)
            expect = base.clone()
            expect[off:off + n] = (expect[off:off + n].to(acc) * go.to(acc)).to(dtype)
            torch.ops.kldiv_inline.kl_div_scale_grad_(g, go)
            assert torch.equal(base, expect), (n, off)
            same = base.clone()
            torch.ops.kldiv_inline.kl_div_scale_grad_(g, torch.ones((), dtype=dtype, device=device))
            assert torch.equal(base, same), (n, off, "factor 1")


# ------------------------------------------------------------------------------- 7. torch.compile
@pytest.mark.parametrize("case", ["kl_div-batchmean", "from_probs-sum-both", "kl_div-none-mixed"])
def test_torch_compile_fullgraph(device, case):
    """fullgraph=True raises on any graph break; inductor (the default backend) on cpu and cuda."""
    torch._dynamo.reset()
    if case == "kl_div-batchmean":
        form, reduction, wrt = "logprobs", "batchmean", "input"
        x, t = make_pair((16, 50), (16, 50), torch.float32, device, form, False)
    elif case == "from_probs-sum-both":
        form, reduction, wrt = "probs", "sum", "both"
        x, t = make_pair((16, 50), (1, 50), torch.float32, device, form, False)
    else:
        form, reduction, wrt = "logprobs", "none", "both"
        x, _ = make_pair((16, 50), (16, 50), torch.float32, device, form, True)
        _, t = make_pair((16, 50), (16, 50), torch.float64, device, form, True)

    def fn(a, b):
        return op(form)(a, b, reduction=reduction, log_target=case.endswith("mixed"))

    compiled = torch.compile(fn, fullgraph=True)
    lt = case.endswith("mixed")
    xe, te = x.clone().requires_grad_(wrt in ("input", "both")), t.clone().requires_grad_(wrt == "both")
    xc, tc = x.clone().requires_grad_(wrt in ("input", "both")), t.clone().requires_grad_(wrt == "both")
    eager, out = fn(xe, te), compiled(xc, tc)
    assert out.dtype == eager.dtype and out.shape == eager.shape
    assert torch.equal(out.detach(), eager.detach())  # the same kernel on the same inputs
    assert_forward_matches(out.detach(), form, x, t, reduction, lt)
    go = random_grad_out(out)
    eager.backward(go)
    out.backward(go)
    ref = ref_grads(form, x, t, reduction, lt, go, wrt)
    assert_grad_close(xc.grad, ref["input"], x)
    assert_grad_close(xc.grad, xe.grad.double(), x)
    if wrt == "both":
        assert_grad_close(tc.grad, ref["target"], t)
        assert_grad_close(tc.grad, te.grad.double(), t)
    if case == "kl_div-batchmean":
        with torch.no_grad():  # inference under compile goes through the op too (the plain forward kernel)
            assert torch.equal(compiled(x, t), fn(x, t))


def test_torch_compile_no_graph_break(device):
    torch._dynamo.reset()
    x, t = make_pair((8, 20), (8, 20), torch.float32, device, "probs", False)

    def fn(p, q):
        return K.kl_div_from_probs(p, q) + K.kl_div(torch.log(p), q, reduction="sum")

    explanation = torch._dynamo.explain(fn)(x, t)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


# ------------------------------------------------------------------------------- 8. determinism
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("reduction", ["sum", "batchmean"])
def test_deterministic(device, form, reduction):
    x, t = make_pair((1024, 1024), (1024, 1024), torch.float32, device, form, False)
    first = call(form, x, t, reduction)
    for _ in range(3):
        assert torch.equal(call(form, x, t, reduction), first)
    # The training path (forward with the fused gradient, another kernel instantiation whose grid may differ)
    # is deterministic too, and agrees with the inference path to float32 rounding.
    xg = x.clone().requires_grad_()
    trained = call(form, xg, t, reduction).detach()
    for _ in range(2):
        assert torch.equal(call(form, xg, t, reduction).detach(), trained)
    torch.testing.assert_close(trained, first, rtol=TOLERANCE[torch.float32], atol=0)
    assert relative_error(first, reference(form, x, t, reduction)) <= TOLERANCE[torch.float32]
    if device == "cpu":  # chunk sums are added in a fixed order: the thread count does not matter
        n = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(call(form, x, t, reduction), first)
        finally:
            torch.set_num_threads(n)


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_cuda_graph_capture(form):
    x, t = make_pair((256, 1000), (256, 1000), torch.float32, "cuda", form, False)
    f = op(form)
    eager = f(x, t, reduction="batchmean")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            f(x, t, reduction="batchmean")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = f(x, t, reduction="batchmean")
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    x2, t2 = make_pair((256, 1000), (256, 1000), torch.float32, "cuda", form, False)
    x.copy_(x2)
    t.copy_(t2)
    graph.replay()
    torch.cuda.synchronize()
    expected = f(x, t, reduction="batchmean")
    assert torch.equal(captured, expected)
    assert not torch.equal(captured, eager)
    assert relative_error(captured, reference(form, x, t, "batchmean")) <= TOLERANCE[torch.float32]


# ------------------------------------------------------------------------------- 9. KernelBench
def test_kernelbench_model_new_matches_model(device):
    model, model_new = kernelbench.Model(), kernelbench.ModelNew()
    assert kernelbench.get_init_inputs() == []
    for _ in range(5):
        inputs = [v.to(device) for v in kernelbench.get_inputs(batch=64, shape=(1000,))]
        ref = model(*inputs)
        out = model_new(*inputs)
        assert out.shape == ref.shape == ()
        assert out.dtype == ref.dtype and out.device == ref.device
        assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out, ref)  # KernelBench's check
        assert relative_error(out, kl_div_reference(*inputs, "batchmean", from_probs=True)) <= 1e-5


# ------------------------------------------------------------------------------- 10. KLDivLoss
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("log_target", [False, True], ids=["t", "logt"])
def test_kldivloss_module(device, reduction, log_target):
    x, t = make_pair((10, 30), (10, 30), torch.float32, device, "logprobs", log_target)
    ours = K.KLDivLoss(reduction=reduction, log_target=log_target)
    theirs = torch.nn.KLDivLoss(reduction=reduction, log_target=log_target)
    assert ours.reduction == theirs.reduction and ours.log_target == theirs.log_target
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, expected = ours(x, t), theirs(x, t)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert_forward_matches(out, "logprobs", x, t, reduction, log_target)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # PyTorch's float32 result itself
    # Gradients flow through the module like through the function.
    xg = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = ours(xg, t)
    go = random_grad_out(loss)
    loss.backward(go)
    assert_grad_close(xg.grad, ref_grads("logprobs", x, t, reduction, log_target, go, "input")["input"], x)


LEGACY = [(None, False), (True, False), (False, False), (True, True), (False, True), (True, None), (False, None),
          (None, True)]


@pytest.mark.parametrize("legacy", LEGACY, ids=lambda a: f"size_average={a[0]}-reduce={a[1]}")
def test_legacy_size_average_reduce(device, legacy):
    size_average, reduce = legacy
    x, t = make_pair((10, 30), (10, 30), torch.float32, device, "logprobs", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = K.KLDivLoss(size_average=size_average, reduce=reduce)
        theirs = torch.nn.KLDivLoss(size_average=size_average, reduce=reduce)
        assert ours.reduction == theirs.reduction
        out_m, exp_m = ours(x, t), theirs(x, t)
        out_f = K.kl_div(x, t, size_average=size_average, reduce=reduce)
        exp_f = F.kl_div(x, t, size_average=size_average, reduce=reduce)
    for out, expected in ((out_m, exp_m), (out_f, exp_f)):
        assert out.shape == expected.shape and out.dtype == expected.dtype
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # PyTorch's float32 result itself
        assert_forward_matches(out, "logprobs", x, t, theirs.reduction, False)


def test_legacy_arguments_keep_pytorchs_quirks(device):
    # F.kl_div: legacy arguments choose the reduction and give no 'mean' warning, but reduction='batchmean'
    # still divides the result by input.size(0).
    x, t = make_pair((6, 20), (6, 20), torch.float32, device, "logprobs", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = K.kl_div(x, t, size_average=False, reduction="batchmean")
        expected = F.kl_div(x, t, size_average=False, reduction="batchmean")
        K.kl_div(x, t, size_average=True)
    assert not [w for w in caught if "batchmean" in str(w.message) and "divides" in str(w.message)]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------- 11. large (GPU)
def _chunked_reference_sum(x, t, form, log_target=False, chunk=1 << 27) -> torch.Tensor:
    """float64 F.kl_div(..., 'sum') over a flat view, chunk by chunk (on the inputs' device)."""
    xf, tf = x.reshape(-1), t.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, xf.numel(), chunk):
        total += kl_div_reference(xf[i:i + chunk], tf[i:i + chunk], "sum", log_target, form == "probs")
    return total


def check_large_none(device, form, shape):
    x, t = make_pair(shape, shape, torch.float32, device, form, False)
    out = call(form, x, t, "none")
    ref = reference(form, x, t, "none")
    assert out.shape == shape and torch.isfinite(out).all()
    assert relative_error(out, ref) <= 1e-6
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


def check_kernelbench_size(device, n):
    scale = torch.rand((), device=device)
    preds = (torch.rand(n, n, device=device) * scale).softmax(-1)  # KernelBench's inputs, made in place
    targets = torch.rand(n, n, device=device).softmax(-1)
    out = K.kl_div_from_probs(preds, targets, reduction="batchmean")
    assert out.shape == () and out.dtype == torch.float32
    ref = _chunked_reference_sum(preds, targets, "probs") / n
    assert relative_error(out, ref) <= 1e-6, (out.item(), ref.item())


def check_huge_bf16_sum(device, n, chunk=1 << 27):
    p = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_(1e-4, 1e-3)
    t = torch.empty_like(p).uniform_(1e-4, 1e-3)
    # The last 64 elements (for n = 2**31 + 8: 56 below index 2**31, 8 above) weigh most of the
    # sum (the last 8 about 10%, the bulk about 13%): a kernel that skips or misindexes elements past 2**31
    # misses by far more than the tolerance.
    k = 64
    p[-k:] = torch.empty(k, device=device).uniform_(1e-4, 2e-4).bfloat16()
    t[-k:] = torch.empty(k, device=device).uniform_(1000, 3000).bfloat16()
    out = K.kl_div_from_probs(p, t, reduction="sum")
    assert out.shape == () and out.dtype == torch.bfloat16
    ref = _chunked_reference_sum(p, t, "probs", chunk=chunk)
    tail = kl_div_reference(p[-8:], t[-8:], "sum", from_probs=True)
    bulk = ref - kl_div_reference(p[-k:], t[-k:], "sum", from_probs=True)
    assert float(tail / ref) > 5 * TOLERANCE[torch.bfloat16]  # the test can see the last 8 elements
    if n > 2**31:
        assert float(bulk / ref) > 5 * TOLERANCE[torch.bfloat16]  # and the bulk
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16], (out.item(), ref.item())


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_large_none_per_element(form):
    check_large_none("cuda", form, (4096, 8192))


@pytest.mark.gpu
def test_large_reduced_16384_squared():
    check_kernelbench_size("cuda", 16384)


@pytest.mark.gpu
def test_more_than_2_31_elements_bfloat16():
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs 40 GB of free GPU memory, {free / 2**30:.1f} GB free")
    try:
        check_huge_bf16_sum("cuda", 2**31 + 8)
    finally:
        torch.cuda.empty_cache()


def test_large_checks_small_on_cpu():
    """The GPU-only large checks above, at sizes the CPU runs in a moment (their logic stays tested)."""
    check_large_none("cpu", "probs", (64, 1000))
    check_kernelbench_size("cpu", 512)
    check_huge_bf16_sum("cpu", 3 * 2**16 + 8, chunk=1 << 16)


# ------------------------------------------------------------------------------- 12. fused gradient (GPU)
@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_fused_gradient_without_host_sync(form):
    x, t = make_pair((512, 1000), (512, 1000), torch.float32, "cuda", form, False)
    ref = ref_grads(form, x, t, "batchmean", False, torch.ones((), device="cuda"), "input")["input"]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    f = op(form)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
    try:
        f(x1, t, reduction="batchmean").backward()
        (f(x2, t, reduction="batchmean") * 2.5).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_grad_close(x1.grad, ref, x)
    assert_grad_close(x2.grad, ref * 2.5, x)
