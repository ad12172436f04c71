"""Tests of kldiv_inline.generalized_jsd (kernels/distill*) against a float64 PyTorch reference.

The reference (kldiv_inline.reference.generalized_jsd_reference) is TRL's generalized JSD written plainly in
float64, with the label mask and the top-k teacher's buckets; its autograd is the reference gradient. Inputs are
fresh random logits each run (conftest reseeds; the seed is printed), outputs are compared per token
(reduction='none') as well as reduced, and gradient buffers come from an allocator poisoned with NaN.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import kldiv_inline as K
from kldiv_inline.harness import poison_allocator
from kldiv_inline.reference import generalized_jsd_reference, relative_error

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BETAS = [0.0, 0.3, 0.5, 1.0]
REDUCTIONS = ["batchmean", "sum", "none"]
# Relative error (norm) of the loss and of the gradient against float64, per logits dtype. The loss is computed in
# float32 lanes from the given (rounded) logits, so 16-bit inputs keep float32 accuracy for the loss; their
# gradients are rounded to the 16-bit dtype once. float32 gradients: the GPU's 2^x (ex2.approx, ~2^-22 relative)
# and the factor (u - K) of the reverse-KL and JSD gradients, which cancels where u is near its mean, reach
# 3e-5 (seen on an H200). float16 gradients reached 2.0e-3 for 0.7% of seeds (KLDIV_TEST_SEED=3).
LOSS_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 8e-3, torch.float16: 3e-3}


@pytest.fixture(autouse=True)
def _print_seed(_fresh_seed):
    print(f"torch.manual_seed({_fresh_seed})")


def _id(d):
    return str(d).removeprefix("torch.")


def logits(shape, dtype, device, scale=None):
    """Random logits with a random spread (softmax temperatures from sharp to flat)."""
    scale = float(torch.rand(())) * 4 + 0.5 if scale is None else scale
    return (torch.randn(shape, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def labels_for(lead, device, frac=0.25, ignore_index=-100):
    lab = torch.randint(0, 1000, lead, device=device)
    mask = torch.rand(lead, device=device) < frac
    if lab.numel() > 1:
        mask.view(-1)[0] = True  # at least one masked, one kept
        mask.view(-1)[-1] = False
    return lab.masked_fill(mask, ignore_index)


def run(student, teacher=None, grad_out=None, **kw):
    """The kit's loss and gradients (w.r.t. whichever inputs require grad) for a random grad_output."""
    poison_allocator(student.device.type)
    loss = K.generalized_jsd(student, teacher, **kw)
    wrt = [x for x in (student, teacher) if x is not None and x.requires_grad]
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    grads = torch.autograd.grad(loss, wrt, grad_out) if wrt else []
    return loss, grads


def reference(student, teacher=None, grad_out=None, **kw):
    s = student.detach().double().requires_grad_(student.requires_grad)
    t = teacher.detach().double().requires_grad_(teacher.requires_grad) if teacher is not None else None
    topk = kw.pop("teacher_topk", None)
    if topk is not None:
        topk = (topk[0], topk[1].double())
    loss = generalized_jsd_reference(s, t, teacher_topk=topk, **kw)
    wrt = [x for x in (s, t) if x is not None and x.requires_grad]
    grads = torch.autograd.grad(loss, wrt, grad_out.double() if grad_out is not None else None) if wrt else []
    return loss, grads


def random_grad_out(loss):
    return (torch.rand_like(loss) + 0.5) * torch.where(torch.rand_like(loss) < 0.5, -1.0, 1.0)


def assert_close(out, ref, tol, what):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    err = relative_error(out.detach(), ref.detach())
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_grad_close(g, ref, dtype, what, grad_out=1.0, tol=None):
    """assert_close for gradients of long rows: float16 has subnormals below 6.1e-5, where an entry is rounded to
    a spacing of 6e-8 (2^-24) whatever its size, and most of a 50k-entry row's gradient lies there; that absolute
    rounding is allowed per entry, the rest must meet GRAD_TOL. grad_out: the row's gradient of the output, by
    which the backward multiplies the gradient the kernel wrote (rounded) in the forward, rounding it again: up to
    (1 + |grad_out|) / 2 spacings in all, which is allowed where it exceeds one (test_fast_rows_per_token's
    nearly agreeing float16 rows, whose gradients are all subnormal, went up to 7.7e-3 beyond one spacing).
    tol: the bound in place of GRAD_TOL[dtype]."""
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps * max(1.0, (1 + abs(float(grad_out))) / 2)
    excess = ((g.detach().double() - ref.detach().double()).abs() - tiny).clamp(min=0)
    err = float(excess.norm() / ref.detach().double().norm())
    tol = GRAD_TOL[dtype] if tol is None else tol
    assert err <= tol, f"{what}: relative error {err:.3e} beyond subnormal rounding"


def entry_scale(ps, pt):
    """The scale of a float32 gradient entry's rounding, before its row's factor (d loss / d the row's divergence,
    / T): its probabilities (ps + pt) times (1 + |log ps - log pt|), as the reverse KL's and the JSD's gradients
    multiply the probabilities by log ratios, plus p |log p| of each, the rounding of a probability formed as
    exp(x / T - log Z) from an argument of that size (a tail entry of p ~ 1e-12 is off by ~27 roundings of
    itself). Terms without mass count 0."""
    def plogp(p):
        return torch.where(p > 0, p * p.log().abs(), 0.0)

    log_ratio = torch.where((ps > 0) & (pt > 0), (ps.log() - pt.log()).abs(), 0.0)
    return (ps + pt) * (1 + log_ratio) + plogp(ps) + plogp(pt)


def assert_entries_close(g, ref, scale, what, roundings=16, unit=torch.float32, row_share=0.0):
    """A gradient computed in float32 lanes against float64 entry by entry: beyond its own rounding (2e-5 of itself
    for float32; for a 16-bit gradient two roundings to its dtype, the forward's and the backward's product with
    grad_output, each half a spacing, subnormal spacings included), each entry may be off by `roundings` float32
    roundings of its scale (entry_scale times the row's factor). A norm-relative bound fails where the gradient is
    a small difference of large terms: a sharp teacher (most of its mass on one token) gives that token the factor
    u - K of the reverse KL's and the JSD's gradients, both near the same log ratio, which cancel to ~(1 - p) while
    their float32 roundings (on the GPU lg2.approx's, ~2^-22 of the log) do not. The per-entry bound holds each
    entry to its own scale, so a skipped, swapped or zeroed entry still fails it. ``unit``: the dtype whose
    roundings count (float64 for a float64 gradient, test_matches_float64's fallback). ``row_share``: an absolute
    allowance of that share of the largest scale in the entry's row (the last dim), for kernels whose intermediate
    values of a row share one fixed-point-like scale (fp16 kept with the row's largest value near 2^15)."""
    r = ref.detach().double()
    if g.dtype == torch.float32:
        slack = 2e-5 * r.abs()
    else:
        fi = torch.finfo(g.dtype)
        slack = fi.eps * r.abs() + 2 * fi.smallest_normal * fi.eps
    excess = (g.detach().double() - r).abs() - slack - row_share * scale.amax(-1, keepdim=True)
    # (an entry of scale 0, as a masked row's, must be exact)
    worst = float(torch.where(excess > 0, excess / (torch.finfo(unit).eps * scale), 0.0).max())
    assert worst <= roundings, f"{what}: an entry {worst:.1f} {unit} roundings of its scale away from float64"


# What a padded vocabulary may hold: -inf, a large negative number, the dtype's lowest value. The finite ones
# once made a GPU kernel's row NaN: a part of the row (a warp's or a block's entries) that held only padding had
# its sum of 2^(x k2 - max) taken at its own maximum, whose rounding (~1e30 at the lowest float) overflowed.
PADS = [float("-inf"), -1e10, "lowest"]


def pad_value(pad, dtype):
    return torch.finfo(dtype).min if pad == "lowest" else pad


# --------------------------------------------------------------------------------- 1. values and gradients
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_matches_float64(device, dtype, beta, reduction):
    s = logits((3, 5, 301), dtype, device).requires_grad_()
    t = logits((3, 5, 301), dtype, device).requires_grad_()
    lab = labels_for((3, 5), device)
    kw = dict(beta=beta, temperature=float(torch.rand(())) * 2 + 0.5, labels=lab, reduction=reduction)
    loss = K.generalized_jsd(s, t, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == ((3, 5) if reduction == "none" else ())
    go = random_grad_out(loss.detach())
    out, (gs, gt) = run(s, t, go, **kw)
    ref, (rs, rt) = reference(s, t, go, **kw)
    assert_close(out, ref, LOSS_TOL[dtype], "loss")
    assert gs.dtype == dtype and gs.shape == s.shape and gt.dtype == dtype
    ps, pt = (torch.softmax(x.detach().double() / kw["temperature"], -1) for x in (s, t))
    kept = (lab != -100).double()  # d loss / d a token's divergence, then / T
    row = go.double() * kept / (kept.sum() if reduction == "batchmean" else 1.0)
    scale = entry_scale(ps, pt) * (row.abs() / kw["temperature"]).unsqueeze(-1)
    if dtype != torch.float64:  # entry by entry, at each entry's conditioning (see assert_entries_close)
        # The fast kernels' bfloat16 JSD gradients (on CUDA both, the teacher's as the student gradient of the rows
        # exchanged) keep each entry's u_s and (1 - beta) ps in fp16 between their passes (distill_fast.cuh,
        # kJsdKeepUs, kJsdKeptPs): beyond the gradient's own rounding, up to ~2^-12 of the entry's scale (1/32 of a
        # bfloat16 spacing of it), and the kept ps, scaled so that the row's largest lies near 2^15, is an fp16
        # subnormal below 2^-29 of it, rounded to 2^-39 of the row's largest ps (times |u_s - ks|, < ~55): an
        # entry 2^-31 of the row's scale measured 0.78 bfloat16 spacings of its own scale off (an H200, seed
        # 889728415). Float32 lanes throughout stay within a few float32 roundings of each entry's own scale.
        kept16 = device == "cuda" and dtype == torch.bfloat16 and 0.0 < beta < 1.0
        bound = dict(roundings=1 / 16, unit=torch.bfloat16, row_share=2.0**-32) if kept16 else {}
        assert_entries_close(gs, rs, scale, "student grad", **bound)
        assert_entries_close(gt, rt, scale, "teacher grad", **bound)
    else:  # within GRAD_TOL of the whole gradient or, where its entries cancel beyond that, entry by entry
        # A draw whose rows are sharp (seed 2100074984: the JSD at T = 0.62, top teacher probabilities 0.45-0.9996)
        # leaves the teacher's gradient u - K ~1e-5 of its terms: against an exact (mpmath) gradient the kit's was
        # 2.0e-12 off and PyTorch's float64 reference itself 4.8e-13, so the whole-gradient bound measured the two
        # roundings together; each entry was within 0.6 float64 roundings of its scale. (0 of 1350 other draws
        # needed the fallback; entry by entry alone some draws of reverse KL, whose reference rounds too, need 65.)
        for g, r, name in ((gs, rs, "student grad"), (gt, rt, "teacher grad")):
            if relative_error(g.detach(), r.detach()) > GRAD_TOL[dtype]:
                assert_entries_close(g, r, scale, name, unit=torch.float64)
    if reduction == "none":
        assert (out[lab == -100] == 0).all()
    assert (gs[lab == -100] == 0).all() and (gt[lab == -100] == 0).all()


@pytest.mark.parametrize("vocab", [1, 2, 7, 8, 33, 4099])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_vocab_sizes(device, vocab, beta):
    # V = 1 (every distribution is a point mass: loss 0), V not a multiple of the vector width, and a row that
    # spans several blocks of a cluster on the GPU.
    s = logits((6, vocab), torch.float32, device).requires_grad_()
    t = logits((6, vocab), torch.float32, device)
    out, (gs,) = run(s, t, None, beta=beta, temperature=1.3, reduction="none")
    ref, (rs,) = reference(s, t, torch.ones(6, dtype=torch.float64, device=device), beta=beta, temperature=1.3,
                           reduction="none")
    if vocab == 1:  # zero up to the rounding of the normaliser
        assert out.abs().max() < 1e-6 and gs.abs().max() < 1e-6
        return
    assert_close(out, ref, 2e-6, "loss")
    assert_close(gs, rs, GRAD_TOL[torch.float32], "student grad")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
def test_long_rows_cuda(vocab, dtype):
    # Real vocabularies: clusters of 2-16 blocks with the row in shared memory (and float32 262144, too long for
    # a cluster's shared memory: the device-memory passes).
    s = logits((5, vocab), dtype, "cuda", scale=3.0).requires_grad_()
    t = logits((5, vocab), dtype, "cuda", scale=3.0)
    for beta in (0.0, 0.5, 1.0):
        out, (gs,) = run(s, t, None, beta=beta, temperature=2.0, reduction="none")
        ref, (rs,) = reference(s, t, torch.ones(5, dtype=torch.float64, device="cuda"), beta=beta,
                               temperature=2.0, reduction="none")
        assert_close(out, ref, 2e-6, f"loss beta={beta}")
        assert_close(gs, rs, GRAD_TOL[dtype], f"grad beta={beta}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("vocab", [4096, 50008, 128256, 50001])
def test_fast_kernel_matches_general_kernel_and_float64(monkeypatch, dtype, beta, vocab):
    # Two CUDA kernels compute the same function: fast_rows_kernel (aligned rows, student gradient or none) and
    # rows_kernel (everything; KLDIV_DISTILL_FAST=0 sends every call there). Both against float64, per token, with
    # masked rows, for training and for inference. Vocabulary 50001 sits in rows padded to 50008 (aligned, so
    # inference takes the fast kernel, with a last partial chunk read one by one).
    width = vocab + (-vocab) % 8
    s = logits((7, width), dtype, "cuda", scale=3.0)[:, :vocab].detach().requires_grad_()
    t = logits((7, width), dtype, "cuda", scale=3.0)[:, :vocab]
    lab = labels_for((7,), "cuda")
    kw = dict(beta=beta, temperature=1.7, labels=lab, reduction="none")
    go = random_grad_out(torch.ones(7, device="cuda"))
    ref, (rs,) = reference(s, t, go, **kw)
    for fast, staged in (("1", "1"), ("1", "0"), ("0", "1")):
        monkeypatch.setenv("KLDIV_DISTILL_FAST", fast)
        monkeypatch.setenv("KLDIV_DISTILL_STAGED", staged)  # the fast kernel's copy: staged, or waited for whole
        out, (gs,) = run(s, t, go, **kw)
        what = f"fast={fast} staged={staged}"
        assert_close(out, ref, 2e-6, f"loss {what}")
        assert_grad_close(gs, rs, dtype, f"grad {what}")
        assert (out[lab == -100] == 0).all() and (gs[lab == -100] == 0).all()
        with torch.no_grad():
            assert_close(K.generalized_jsd(s, t, **kw), ref, 2e-6, f"inference loss {what}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("vocab", [4096, 50001, 128256])
def test_fast_rows_per_token(dtype, vocab):
    # fast_rows' launches (the one-barrier ones: forward KL with the student's gradient, every forward alone; the
    # ks ones: reverse KL's and the JSD's training rows) per token against float64 on rows far apart, rows that
    # nearly agree (the direct sums fall back to the series there), equal rows, rows with -inf in both, in the
    # teacher's or in the student's second half, a masked row; gradients within 16-bit rounding; the gradient
    # written over the student's logits as into a buffer of its own.
    width = vocab + (-vocab) % 8  # 50001: rows padded to 16 bytes, the last slice ending in a partial chunk
    n = 12
    t64 = logits((n, width), torch.float64, "cuda", scale=3.0)
    s64 = logits((n, width), torch.float64, "cuda", scale=3.0)
    s64[4:8] = t64[4:8] + 1e-3 * torch.randn_like(t64[4:8])  # nearly agree (one 16-bit rounding or so)
    s64[8] = t64[8]
    s64[9, : width // 3] = t64[9, : width // 3] = float("-inf")
    t64[10, width // 2 :] = float("-inf")
    s64[11, width // 2 :] = float("-inf")
    s = s64.to(dtype)[:, :vocab]
    t = t64.to(dtype)[:, :vocab]
    rows = torch.arange(n, device="cuda")
    lab = rows.masked_fill(rows == 3, -100)

    def per_token(out, ref, which, tol, what):
        o, r = out[which].double(), ref[which]
        inf = torch.isinf(r)
        assert torch.equal(o[inf], r[inf]), what
        err = ((o - r).abs() / r.abs().clamp(min=1e-30))[~inf]
        assert err.numel() == 0 or err.max() <= tol, f"{what}: per-token error {err.max():.2e} > {tol:.0e}"

    far, near = torch.tensor([0, 1, 2, 9, 10, 11], device="cuda"), rows[4:8]
    for beta in (0.0, 0.5, 1.0):
        kw = dict(beta=beta, temperature=1.7, labels=lab, reduction="none")
        ref = generalized_jsd_reference(s.double(), t.double(), **kw)
        with torch.no_grad():
            poison_allocator("cuda")
            out = K.generalized_jsd(s, t, **kw)
        assert (out >= 0).all() and out[3] == 0 and out[8].abs() <= 1e-6, (beta, out)
        per_token(out, ref, far, 2e-6, f"forward alone beta={beta}")
        per_token(out, ref, near, 1e-4, f"forward alone beta={beta}, nearly agreeing")
    go = random_grad_out(torch.ones(n, device="cuda"))
    for beta in (0.0, 0.5, 1.0):  # the training launches: forward KL's one-barrier rows, the others' ks rows
        sw = s.clone().requires_grad_()
        kw = dict(beta=beta, temperature=1.7, labels=lab, reduction="none")
        out, (gs,) = run(sw, t, go, **kw)
        ref, (rs,) = reference(sw, t, go, **kw)
        what = f"training beta={beta}"
        assert (out >= 0).all() and out[3] == 0 and out[8].abs() <= 1e-6, (what, out)
        per_token(out, ref, far, 2e-6, what)
        per_token(out, ref, near, 1e-4, f"{what}, nearly agreeing")
        for row in [0, 1, 2, 4, 5, 6, 7, 9, 10, 11]:
            if torch.isfinite(ref[row]):  # (an infinite loss's gradient is not defined)
                assert_grad_close(gs[row], rs[row], dtype, f"{what} grad row {row}", go[row])
        assert (gs[3] == 0).all() and (gs[8].abs() <= 1e-6).all(), what
    mod = K.load("cuda", extension="distill")
    own = torch.empty_like(s64, dtype=dtype)[:, :vocab]  # rows on 16-byte boundaries, as s's: fast_rows both times
    expect = mod.distill_forward(s, t, None, None, lab, -100, 0.0, 1.7, 0, True, False, own)
    assert expect[1].data_ptr() == own.data_ptr()
    buf = torch.empty_like(s64, dtype=dtype)[:, :vocab]
    buf.copy_(s)
    got = mod.distill_forward(buf, t, None, None, lab, -100, 0.0, 1.7, 0, True, False, buf)
    assert got[1].data_ptr() == buf.data_ptr()
    assert torch.equal(got[0], expect[0]) and torch.equal(buf, expect[1]), "in place"


def cuda_kernels(fn):
    """fn()'s result and the names of the CUDA kernels it launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def general_kernel(names):
    """Whether the general kernel (rows_kernel, which takes every call) is among these."""
    return any(re.search(r"[^\w]rows_kernel<", x) for x in names)


def assert_training_rows(out, gs, ref, rs, lab, go, dtype, what):
    """A training call's per-token losses against float64, masked rows 0 with zero gradients, every other row's
    gradient within its dtype's rounding (go: the rows' gradients of the output)."""
    assert_close(out, ref, 2e-6, what)
    assert (out[lab == -100] == 0).all() and (gs[lab == -100] == 0).all(), what
    for row in range(len(lab)):
        if lab[row] != -100:  # (a masked row's gradient is 0, above)
            assert_grad_close(gs[row], rs[row], dtype, f"{what} grad row {row}", go[row])


def assert_gradient_in_place(s, t, idx, lp, lab, betas, teacher_grad=False):
    """distill_forward's gradient written over the student's logits (as the fused head writes it) is the one it
    writes into a buffer of its own, bit for bit, and so is the loss (a full teacher t, or a top-k one idx, lp);
    teacher_grad: so is the teacher's gradient computed beside it."""
    mod = K.load("cuda", extension="distill")
    lp = prepared_topk(idx, lp, s.shape[-1]) if idx is not None else None
    for beta in betas:
        expect = mod.distill_forward(s, t, idx, lp, lab, -100, beta, 1.7, 0, True, teacher_grad, None)
        buf = s.clone()
        got = mod.distill_forward(buf, t, idx, lp, lab, -100, beta, 1.7, 0, True, teacher_grad, buf)
        assert got[1].data_ptr() == buf.data_ptr()
        assert torch.equal(got[0], expect[0]) and torch.equal(buf, expect[1]), f"in place beta={beta}"
        if teacher_grad:
            assert torch.equal(got[2], expect[2]), f"the teacher's gradient beside an in-place one, beta={beta}"


def assert_fast_rows_betas(s, t, lab, go, dtype, what, topk=None, leaf=None, training="fast_rows", names_ok=None):
    """For betas 0 / 0.5 / 1 on rows s (a full teacher t, or a top-k one): the forward alone (a full teacher) and
    the training step, each into poisoned memory, per token against float64 (masked rows 0 with zero gradients;
    assert_training_rows), the fast kernels launched (`training`: the training step's) and the general one not.
    leaf(s): a leaf of s's values for the step (s.clone() unless given; a sliced student's layout, say);
    names_ok(names, train): a test's own check of the kernels launched."""
    for beta in (0.0, 0.5, 1.0):
        kw = dict(teacher_topk=topk, beta=beta, temperature=1.7, labels=lab, reduction="none")
        sw = (leaf(s) if leaf else s.detach().clone()).requires_grad_()
        ref, (rs,) = reference(sw, t, go, **kw)
        if t is not None:
            with torch.no_grad():
                poison_allocator("cuda")
                out, names = cuda_kernels(lambda kw=kw: K.generalized_jsd(s, t, **kw))
            assert not general_kernel(names) and any("fast_rows" in x or "stream_forward" in x for x in names), names
            assert names_ok is None or names_ok(names, False), names
            assert_close(out, ref, 2e-6, f"{what} forward alone beta={beta}")
            assert (out[lab == -100] == 0).all()
        poison_allocator("cuda")
        (out, (gs,)), names = cuda_kernels(lambda sw=sw, kw=kw: run(sw, t, go, **kw))
        assert not general_kernel(names) and any(training in x for x in names), (what, names)
        assert names_ok is None or names_ok(names, True), names
        assert gs.shape == s.shape
        assert_training_rows(out, gs, ref, rs, lab, go, dtype, f"{what} training beta={beta}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("vocab", [50001, 50257, 3, 13])
def test_fast_kernels_take_contiguous_rows_off_the_grid(dtype, vocab):
    # A vocabulary whose rows are not a whole number of 16-byte chunks (GPT-2's 50257), the logits contiguous: row r
    # starts r * vocab entries from the grid, so the rows take every offset from it. Student, teacher and gradient
    # rows of one index share the offset, and the fast kernels (fast_rows, stream_forward) start each row's slices
    # at its first entry on the grid, its head (up to 7 entries, all of a row of 3) visited one by one; a general
    # kernel took these rows at a third of the speed. Per token against float64 (masked rows, betas 0 / 0.5 / 1,
    # training and forward alone), the gradients (into a poisoned buffer, and over the student's logits), and the
    # fast kernels launched, the general one not.
    n = 19
    s = logits((n, vocab), dtype, "cuda", scale=3.0)
    t = logits((n, vocab), dtype, "cuda", scale=3.0)
    assert len({s[r].data_ptr() % 16 for r in range(n)}) == 16 // s.element_size()  # (every offset there is)
    lab = labels_for((n,), "cuda")
    assert_fast_rows_betas(s, t, lab, random_grad_out(torch.ones(n, device="cuda")), dtype, f"V={vocab}")
    assert_gradient_in_place(s, t, None, None, lab, (0.0, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("vocab, k", [(50257, 100), (13, 1), (13, 13), (3, 3), (3, 2)])
def test_fast_topk_takes_contiguous_rows_off_the_grid(dtype, vocab, k):
    switch = (K.loader.kernels_root() / "distill_fast_topk.cuh").read_text()
    if "constexpr bool kTopkShift = true;" not in switch:  # (off: such rows take the general kernel)
        pytest.skip("kTopkShift is off in distill_fast_topk.cuh")
    # The top-k teacher's kernel (fast_topk_kernel) on contiguous student rows off the 16-byte grid (GPT-2's 50257;
    # rows of 13 and of 3, whose head may be the whole row), as fast_rows takes them: rank 0's head copied one
    # entry a thread below its slice, its members' bits in a word of their own. Half the rows' teachers put their
    # largest log-probabilities on the row's first entries, so members sit in the heads (and with k = V every entry
    # is a member: no tail bucket). Per token against float64 (masked rows, betas 0 / 0.5 / 1), the gradients,
    # the gradient written over the student's logits, and the fast kernel launched, the general one not. (Rows of
    # 3 with k = 2: the teacher's tail mass is often ~1e-2; summed in float32 it was off by ~1e-5 of itself, which
    # reverse KL's loss carried past 2e-6. distill_topk_prepare sums it in double now.)
    n = 19
    s = logits((n, vocab), dtype, "cuda", scale=3.0)
    assert len({s[r].data_ptr() % 16 for r in range(n)}) == min(n, 16 // s.element_size())
    teacher = torch.randn(n, vocab, dtype=torch.float64) * 2.5
    teacher[::2, : min(4, vocab)] += 8.0  # (the first entries: in the head where the row starts off the grid)
    lp, idx = torch.log_softmax(teacher, -1).topk(k, dim=-1)
    perm = torch.argsort(torch.rand(n, k), dim=-1)
    topk = (idx.gather(-1, perm).cuda(), lp.gather(-1, perm).float().cuda())
    lab = labels_for((n,), "cuda")
    assert_fast_rows_betas(s, None, lab, random_grad_out(torch.ones(n, device="cuda")), dtype, f"V={vocab} k={k}",
                           topk=topk, training="fast_topk")
    assert_gradient_in_place(s, None, *topk, lab, (0.0, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, vocab", [(torch.bfloat16, 256000), (torch.float16, 262144), (torch.bfloat16, 200003),
                                          (torch.float32, 100000)],
                         ids=["bf16-256000", "fp16-262144", "bf16-200003", "fp32-100000"])
def test_long_rows_in_clusters_of_16(dtype, vocab):
    # Rows whose student and teacher slices overflow the 40 KB shared-memory target in clusters of 16 (bf16 rows
    # beyond 163840 entries, Gemma's 256000; float32 beyond 81920) take clusters of 16 with larger slices (up to
    # 200 KB), where they took clusters of 8 (one block an SM: 2.2-3.3 x the floor on an H200); their 16-bit
    # training rows on the 16-byte grid in wide blocks (fast_rows_kernel_wide; an odd V's rows lie off the grid
    # and take the narrow blocks). Per token against float64 (masked rows, betas 0 / 0.5 / 1; training and forward
    # alone) and the gradients, the fast kernels.
    n = 5
    s = logits((n, vocab), dtype, "cuda", scale=3.0)
    t = logits((n, vocab), dtype, "cuda", scale=3.0)
    lab = torch.tensor([1, -100, 2, 3, 4], device="cuda")
    wide = dtype != torch.float32 and vocab % 8 == 0  # (16-bit rows on the grid: the wide blocks' training rows)

    def names_ok(names, train):
        return any("fast_rows_kernel_wide" in x for x in names) == (train and wide)

    assert_fast_rows_betas(s, t, lab, random_grad_out(torch.ones(n, device="cuda")), dtype, f"V={vocab}",
                           names_ok=names_ok)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("vocab", [4096, 50257, 13])
def test_teacher_gradient_from_the_fast_kernels(dtype, vocab):
    # Self-distillation (the teacher's logits require grad too) on the fast kernels: the teacher's gradient is the
    # student gradient of the same divergence with the rows exchanged and beta -> 1 - beta, a launch of its own
    # before the student's (rows_kernel's generic instance took these calls, at 2.2-4.5 x the 4-tensor floor on an
    # H200). Per token against float64 (masked rows; betas 0 / 0.3 / 0.5 / 1), both gradients (the teacher's alone
    # where the student needs none), entries at -inf in both rows (a padded vocabulary), the fast kernels launched
    # and the general one not; and the student's gradient written over its logits beside the teacher's (its launch
    # follows the teacher's, which reads those logits) as written into a buffer of its own, bit for bit.
    n = 19
    s = logits((n, vocab), dtype, "cuda", scale=3.0)
    t = logits((n, vocab), dtype, "cuda", scale=3.0)
    if vocab > 13:
        s[:, -7:] = t[:, -7:] = float("-inf")
    lab = labels_for((n,), "cuda")
    go = random_grad_out(torch.ones(n, device="cuda"))
    for beta in (0.0, 0.3, 0.5, 1.0):
        kw = dict(beta=beta, temperature=1.7, labels=lab, reduction="none")
        for student_grad in (True, False):
            sw, tw = s.clone().requires_grad_(student_grad), t.clone().requires_grad_()
            ref, rg = reference(sw, tw, go, **kw)
            (out, grads), names = cuda_kernels(lambda sw=sw, tw=tw, kw=kw: run(sw, tw, go, **kw))
            assert not general_kernel(names) and any("fast_rows" in x for x in names), names
            what = f"beta={beta} student_grad={student_grad}"
            assert len(grads) == len(rg) == (2 if student_grad else 1), what
            if student_grad:
                assert_training_rows(out, grads[0], ref, rg[0], lab, go, dtype, f"{what} student")
            assert_training_rows(out, grads[-1], ref, rg[-1], lab, go, dtype, f"{what} teacher")
    assert_gradient_in_place(s, t, None, None, lab, (0.0, 0.5, 1.0), teacher_grad=True)


# A float32 JSD whose teacher holds its mass where the student has little (d = lt - ls >> 0 there): u_t tends to
# -log beta and the teacher's gradient beta pt (u_t - kt) is a small difference of numbers near it. u_t formed as
# d - log z (two numbers near d, ~30 here) was rounded at d's ulp: the teacher's gradient came out up to 39 x as far
# from float64 as PyTorch's float32 autograd of the formula (2e-2 relative at beta 0.5). u_t from the teacher's
# side (mixture_ut_exact) keeps its digits: ~0.3-0.7 x PyTorch's error on the CPU. On a GPU, the fast path (the
# exchanged launch) and the general kernel (KLDIV_DISTILL_FAST=0); the GPU's lanes form probabilities and logs by
# ex2.approx and lg2.approx (2 ulp) where PyTorch takes the accurate expf and logf: the general kernel measured
# 1.06 x PyTorch's error at beta 0.5 on an H200, so a GPU is held to twice it.
@pytest.mark.parametrize("fast", ["1", "0"])
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_float32_teacher_gradient_where_the_teacher_outweighs_the_student(device, beta, fast, monkeypatch):
    if fast == "0" and device == "cpu":
        pytest.skip("one kernel on the CPU")
    monkeypatch.setenv("KLDIV_DISTILL_FAST", fast)
    n, vocab, temperature = 32, 3001, 0.6
    s, t = logits((n, vocab), torch.float32, device, 6.0), logits((n, vocab), torch.float32, device, 6.0)

    def teacher_grad(fn, s, t):
        s, t = s.clone().requires_grad_(), t.clone().requires_grad_()
        fn(s, t, beta=beta, temperature=temperature).backward()
        return t.grad

    truth = teacher_grad(lambda s, t, **kw: generalized_jsd_reference(s, t, reduction="sum", **kw), s.double(),
                         t.double())
    ours = teacher_grad(lambda s, t, **kw: K.generalized_jsd(s, t, reduction="sum", **kw), s, t)
    # PyTorch's own float32 autograd of the formula: the yardstick of a float32 gradient's rounding
    torch32 = teacher_grad(lambda s, t, **kw: generalized_jsd_reference(s, t, reduction="sum", dtype=torch.float32,
                                                                        **kw), s, t)
    err, yardstick = relative_error(ours, truth), relative_error(torch32, truth)
    bound = yardstick * (2 if device == "cuda" else 1)
    assert err <= bound, f"teacher gradient {err:.2e} from float64, PyTorch's float32 {yardstick:.2e}"


def sliced_rows(n, vocab, dtype, width=None):
    """Logits [n, vocab] sliced out of a padded vocabulary (rows of `width` entries, a multiple of 64, so every row
    starts on the 16-byte grid while a contiguous [n, vocab] tensor's rows do not)."""
    width = width or vocab + (-vocab) % 64
    return logits((n, width), dtype, "cuda", scale=3.0)[:, :vocab]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("vocab", [50257, 13])
@pytest.mark.parametrize("layout", ["both_sliced", "teacher_sliced", "student_sliced", "topk_student_sliced"])
def test_fast_kernels_take_rows_at_different_offsets(dtype, vocab, layout):
    # Student and teacher rows of one index at different offsets from the 16-byte grid: logits sliced out of a
    # padded vocabulary (V = 50257 of rows of 50304) beside a contiguous teacher or student. The general kernel took
    # such calls, ~3-4 x slower; now the rows that do not share the offsets of the one kept (the reference) are
    # copied onto them (copy_rows_kernel) and the fast kernel runs. Both sliced: the gradient's rows lie as the
    # student's (grad_like_rows), no copy. Per token against float64 (masked rows, betas 0 / 0.5 / 1; training and
    # forward alone), the gradients (poisoned memory), the fast kernel launched and the general one not; and a
    # gradient buffer given at a third offset (all three rows apart: an input copied in, the gradient copied out).
    n = 19
    sliced, contiguous = sliced_rows(n, vocab, dtype), logits((n, vocab), dtype, "cuda", scale=3.0)
    s = sliced if layout in ("both_sliced", "student_sliced", "topk_student_sliced") else contiguous
    t = {"both_sliced": sliced_rows(n, vocab, dtype), "teacher_sliced": sliced_rows(n, vocab, dtype),
         "student_sliced": logits((n, vocab), dtype, "cuda", scale=3.0)}.get(layout)
    assert not s.is_contiguous() or not t.is_contiguous()
    topk = None
    if t is None:
        k = min(vocab, 100)
        lp, idx = torch.log_softmax(torch.randn(n, vocab, dtype=torch.float64) * 2.5, -1).topk(k, dim=-1)
        topk = (idx.cuda(), lp.float().cuda())
    lab = labels_for((n,), "cuda")

    def leaf(s):  # a leaf of s's values and layout
        sw = s.detach().clone() if s.is_contiguous() else sliced_rows(n, vocab, dtype, s.stride(0)).copy_(s)
        assert sw.data_ptr() % 16 == s.data_ptr() % 16 and sw.stride() == s.stride()
        return sw

    assert_fast_rows_betas(s, t, lab, random_grad_out(torch.ones(n, device="cuda")), dtype, layout, topk=topk,
                           leaf=leaf, training="fast_topk" if topk else "fast_rows")
    mod = K.load("cuda", extension="distill")
    idx, lp = (topk[0], prepared_topk(*topk, vocab)) if topk else (None, None)
    own = torch.empty(n * vocab + 1, dtype=dtype, device="cuda")[1:].view(n, vocab)  # (a third offset)
    poison_allocator("cuda")
    own.fill_(float("nan"))
    got, names = cuda_kernels(lambda: mod.distill_forward(s, t, idx, lp, lab, -100, 0.5, 1.7, 0, True, False, own))
    assert got[1].data_ptr() == own.data_ptr() and not general_kernel(names), names
    ref, (rs,) = reference(s.detach().clone().requires_grad_(), t, torch.ones(n, device="cuda"), teacher_topk=topk,
                           beta=0.5, temperature=1.7, labels=lab, reduction="none")
    assert_training_rows(got[0], own, ref, rs, lab, torch.ones(n, device="cuda"), dtype, f"{layout} given buffer")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
def test_training_rows_with_offsets_far_from_zero(dtype):
    # Forward and reverse KL's 16-bit training rows form each probability as 2^(x k2 - c) with one offset a
    # distribution, c = max + log2 of the sum rounded once, and take that rounding out of the loss and the gradient:
    # near c = 600 it is up to 2^-15, a loss 2e-5 off were it left in, ten times this test's bound. Rows with scaled
    # logits around 190, 580 and 1100 (beyond 1024 the pair is kept), around -560, the teacher's offset apart from
    # the student's (d then from the shifted logits, not their difference), a teacher with -inf entries, a masked
    # row; per token against float64, and the gradients. (The JSD's bfloat16 gradients of these rows came out 1e-3
    # to 8.2e-3 from float64 on an H200 while its kept u_s had no offset (kJsdKeptUsOffset, distill_fast.cuh), over
    # GRAD_TOL's 8e-3 in one of four draws; with it, such rows measured at bfloat16's own rounding of the exact
    # gradient, 1.9e-3 to 3.0e-3, whose bound is 2^-8 = 3.9e-3: hence 5e-3 for the JSD here. Forward and reverse KL's
    # came out 0.2e-3 to 3.6e-3; kernels/NOTES.md, versions 53-54.)
    vocab, n = 50001, 9
    width = vocab + (-vocab) % 8  # rows on 16-byte boundaries (fast_rows), the last slice in a partial chunk
    t64 = logits((n, width), torch.float64, "cuda", scale=3.0)
    s64 = logits((n, width), torch.float64, "cuda", scale=3.0)
    shift_s = torch.tensor([130.0, 400.0, 760.0, 400.0, -400.0, 130.0, 400.0, 400.0, 400.0], dtype=torch.float64)
    shift_t = torch.tensor([130.0, 400.0, 760.0, 403.0, -400.0, 400.0, 400.0, 400.0, 400.0], dtype=torch.float64)
    s64[3] = t64[3] + 0.5 * torch.randn_like(t64[3])  # (then 3 apart: maxima apart, distributions close)
    t64[6, vocab // 2:] = float("-inf")
    s = (s64 + shift_s[:, None].cuda()).to(dtype)[:, :vocab]
    t = (t64 + shift_t[:, None].cuda()).to(dtype)[:, :vocab]
    lab = torch.arange(n, device="cuda").masked_fill(torch.arange(n, device="cuda") == 8, -100)
    mod = K.load("cuda", extension="distill")
    for beta in (0.0, 1.0, 0.5):
        # (the kernel's own call with a gradient buffer on the 16-byte grid: the fast kernel, as the step of an odd
        # vocabulary is not; reduction none, so each row's gradient is its own divergence's)
        poison_allocator("cuda")
        gs = torch.full((n, width), float("nan"), dtype=dtype, device="cuda")[:, :vocab]
        out, gs = mod.distill_forward(s, t, None, None, lab, -100, beta, 1.0, 0, True, False, gs)[:2]
        ref, (rs,) = reference(s.clone().requires_grad_(), t, torch.ones(n, dtype=torch.float64, device="cuda"),
                               beta=beta, temperature=1.0, labels=lab, reduction="none")
        assert out[8] == 0 and (gs[8] == 0).all(), beta
        o, r = out[:8].double(), ref[:8]
        inf = torch.isinf(r)  # (reverse KL's row 6: the student has mass where the teacher has none)
        assert torch.equal(o[inf], r[inf]) and inf.sum() == (beta == 1.0), beta
        err = ((o - r).abs() / r.abs())[~inf].max()
        assert err <= 2e-6, f"beta={beta}: per-token error {err:.2e}"
        tol = 5e-3 if beta == 0.5 and dtype == torch.bfloat16 else None
        for row in torch.nonzero(~inf).flatten().tolist():
            assert_grad_close(gs[row], rs[row], dtype, f"beta={beta} grad row {row}", tol=tol)


def split_phases(s, t, lab, beta, temp, widths, training):
    """The vocabulary-parallel kernels (distill_phase: normalisers, terms, gradients) in one process over slices
    of each row (``widths``), their statistics combined as the ranks combine them (distill_combine, in slice
    order): (the rows' losses, the rows' (ks, kt), the student's gradient of the rows' sum or None)."""
    mod = K.load(s.device.type, extension="distill")
    common = (lab, -100, beta, temp)
    cuts = torch.tensor((0,) + tuple(widths)).cumsum(0).tolist()
    parts = [(s[:, a:b], t[:, a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    poison_allocator(s.device.type)
    norms = mod.distill_combine(torch.stack([mod.distill_phase(0, a, b, *common, None, None, None, False, False)[0]
                                             for a, b in parts]), 0)[0]
    scale = torch.ones((), dtype=torch.float64, device=s.device)
    outs = [mod.distill_phase(1, a, b, *common, norms, None, scale, training, False) for a, b in parts]
    ksums, rows_loss = mod.distill_combine(torch.stack([o[0] for o in outs]), 0)  # reduction none
    if not training:
        return rows_loss, ksums, None
    grads = [o[1] for o in outs]
    if beta != 0.0:  # the student's gradient needs the rows' ks: the third phase
        grads = [mod.distill_phase(2, a, b, *common, norms, ksums, scale, True, False)[1] for a, b in parts]
    return rows_loss, ksums, torch.cat(grads, dim=1)


def padded_rows(n, width, dtype, device):
    """Random logits [n, width] whose rows start 16 bytes apart (a padded allocation, viewed narrower)."""
    return logits((n, -(-width // 8) * 8), dtype, device, scale=3.0)[:, :width]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("widths", [(20000, 12008), (4097, 3001, 9)], ids=["aligned", "odd"])
def test_phases_over_slices_match_float64(device, dtype, beta, widths):
    # split_phases' loss and student gradient are float64's per token, masked rows 0, for training and for
    # inference. On CUDA the aligned slices take the fast kernels' phases (phase_norms_kernel,
    # phase_stream_kernel), the others rows_kernel; the rows are padded to 16 bytes, so the odd case's first slice
    # (4097 wide) takes the fast kernels with a row that ends short of a chunk.
    n, temp = 7, 1.7
    s, t = padded_rows(n, sum(widths), dtype, device), padded_rows(n, sum(widths), dtype, device)
    lab = labels_for((n,), device)
    ref, (rs,) = reference(s.requires_grad_(), t, torch.ones(n, dtype=torch.float64, device=device), beta=beta,
                           temperature=temp, labels=lab, reduction="none")
    s = s.detach()
    for training in (True, False):
        rows_loss, ksums, g = split_phases(s, t, lab, beta, temp, widths, training)
        what = "training" if training else "inference"
        assert_close(rows_loss, ref, 2e-6, f"loss ({what})")
        assert (rows_loss[lab == -100] == 0).all() and (ksums[lab == -100] == 0).all()
        if training:
            assert_grad_close(g, rs, dtype, "grad")
            assert (g[lab == -100] == 0).all()


@pytest.mark.parametrize("pad", PADS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_phases_with_a_padded_vocabulary(device, dtype, beta, pad):
    # A padded vocabulary split across ranks: the last slice is padding in both (a rank holding only padding: its
    # normalisers have no mass) and so is the end of the one before. The loss and gradient are those of the
    # unpadded rows, the padding's gradient 0.
    n, temp, widths, real = 5, 2.0, (20000, 4000, 800), 23900
    s, t = padded_rows(n, sum(widths), dtype, device), padded_rows(n, sum(widths), dtype, device)
    s[:, real:] = pad_value(pad, dtype)
    t[:, real:] = pad_value(pad, dtype)
    lab = labels_for((n,), device)
    ref, (rs,) = reference(s[:, :real].clone().requires_grad_(), t[:, :real],
                           torch.ones(n, dtype=torch.float64, device=device), beta=beta, temperature=temp,
                           labels=lab, reduction="none")
    rows_loss, _, g = split_phases(s, t, lab, beta, temp, widths, True)
    assert torch.isfinite(rows_loss).all() and torch.isfinite(g).all()
    assert_close(rows_loss, ref, 2e-6, "loss")
    assert_grad_close(g[:, :real], rs, dtype, "grad")
    assert (g[:, real:] == 0).all()


def test_strided_and_3d_inputs(device):
    base_s = logits((7, 2, 130), torch.float32, device)
    base_t = logits((7, 2, 130), torch.float32, device)
    s = base_s.transpose(0, 1)[:, :, 1:]  # non-contiguous leading dims and an offset start
    t = base_t.transpose(0, 1)[:, :, 1:]
    assert not s.is_contiguous()
    out = K.generalized_jsd(s, t, beta=0.5, temperature=2.0, reduction="none")
    ref = generalized_jsd_reference(s, t, beta=0.5, temperature=2.0, reduction="none")
    assert out.shape == (2, 7)
    assert_close(out, ref, 2e-6, "loss")
    # vocabulary not the fastest dimension
    s2 = logits((129, 9), torch.float32, device).t()
    t2 = logits((129, 9), torch.float32, device).t()
    assert_close(K.generalized_jsd(s2, t2, reduction="none"),
                 generalized_jsd_reference(s2, t2, reduction="none"), 2e-6, "loss (vocab strided)")


# ------------------------------------------------------------------------------------------ 2. masks
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_masked_is_zero_not_nan(device, reduction):
    s = logits((4, 50), torch.float32, device).requires_grad_()
    t = logits((4, 50), torch.float32, device).requires_grad_()
    lab = torch.full((4,), -7, device=device)
    loss = K.generalized_jsd(s, t, labels=lab, ignore_index=-7, reduction=reduction, beta=0.5)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(s.grad, torch.zeros_like(s)) and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("teacher", ["logits", "topk"])
def test_masked_tokens_get_zero_gradient_whatever_their_grad_output(device, dtype, teacher):
    # reduction none with a per-token weight that is inf or NaN on masked tokens (1 / the length of a sequence all
    # padding): their gradient is 0, as PyTorch's ignore_index losses give; multiplied in, 0 * inf was NaN there.
    s = logits((2, 3, 37), dtype, device).requires_grad_()
    t = logits((2, 3, 37), dtype, device).requires_grad_(teacher == "logits")
    lab = torch.tensor([[1, -100, 2], [-100, 5, 6]], device=device)
    kw = dict(beta=0.5, labels=lab, reduction="none")
    if teacher == "topk":
        lp, idx = torch.log_softmax(t.detach().double(), -1).topk(5, -1)
        kw["teacher_topk"] = (idx, lp.to(dtype))
    go = random_grad_out(torch.empty(2, 3, dtype=torch.float64, device=device))
    go[0, 1], go[1, 0] = math.inf, math.nan
    out, grads = run(s, t if teacher == "logits" else None, go.to(torch.float32 if dtype != torch.float64 else dtype),
                     **kw)
    finite = go.masked_fill(lab == -100, 0.0)  # what reaches the kept rows; the masked ones must not matter
    ref, refs = reference(s, t if teacher == "logits" else None, finite, **kw)
    for g, r, who in zip(grads, refs, ("student", "teacher")):
        assert torch.equal(g[lab == -100], torch.zeros_like(g[lab == -100])), who
        assert_grad_close(g, r, dtype, who, grad_out=float(finite.abs().max()))


def test_masked_tokens_are_ignored_whatever_they_hold(device):
    s = logits((6, 40), torch.float32, device)
    t = logits((6, 40), torch.float32, device)
    lab = torch.tensor([1, -100, 2, -100, 3, 4], device=device)
    base = K.generalized_jsd(s, t, labels=lab)
    s2, t2 = s.clone(), t.clone()
    s2[1] = float("nan")
    t2[3] = float("inf")
    assert torch.equal(K.generalized_jsd(s2, t2, labels=lab), base)
    # batchmean divides by the 4 unmasked tokens
    none = K.generalized_jsd(s, t, labels=lab, reduction="none")
    torch.testing.assert_close(base, none.sum() / 4)


def test_the_reference_takes_int32_labels_against_an_ignore_index_beyond_int32():
    # torch compares an int32 tensor with 2**40 as False everywhere it should be True: the reference masked
    # label-0 tokens the kit (labels in int64) keeps, so a test of such labels would fail the right kernel.
    s, t = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    ref = generalized_jsd_reference(s, t, labels=labels, ignore_index=2**40, reduction="none")
    assert (ref > 0).all()
    torch.testing.assert_close(K.generalized_jsd(s, t, labels=labels, ignore_index=2**40, reduction="none"), ref)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_reference_gradient_of_masked_tokens_whatever_they_hold_is_zero(beta):
    # Masked rows of all -inf, a +inf or a NaN: the reference's autograd multiplied the 0 its masked rows get back
    # by their NaN partial derivatives, a NaN gradient where the kit's (documented) is 0: the kit failed a check
    # against it. Both sides, logits and top-k teachers.
    lab = torch.tensor([1, -100, 2, -100, -100])
    s = logits((5, 40), torch.float64, "cpu")
    t = logits((5, 40), torch.float64, "cpu")
    s[1], s[3, 3], s[4, 5] = -math.inf, math.inf, math.nan
    t[1, 2], t[3], t[4] = math.nan, -math.inf, math.inf
    idx, lp = topk_teacher((5,), 40, 4, "cpu")
    lp = lp.double()
    lp[1], lp[3] = math.nan, -math.inf
    for teacher, topk in ((t, None), (None, (idx, lp))):
        grads = []
        for fn in (generalized_jsd_reference, K.generalized_jsd):
            x = s.clone().requires_grad_()
            fn(x, teacher, teacher_topk=topk, beta=beta, temperature=2.0, labels=lab).backward()
            grads.append(x.grad)
        ref, ours = grads
        assert not ref.isnan().any() and (ref[lab == -100] == 0).all(), ref
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------ 3. special values
@pytest.mark.parametrize("pad", PADS, ids=str)
@pytest.mark.parametrize("beta", BETAS)
def test_padded_vocabulary(device, beta, pad):
    # A padded vocabulary: the last entries are padding in both: they hold no mass and contribute nothing.
    s = logits((5, 64), torch.float32, device)
    t = logits((5, 64), torch.float32, device)
    s[:, 50:] = pad_value(pad, s.dtype)
    t[:, 50:] = pad_value(pad, t.dtype)
    s.requires_grad_()
    out, (gs,) = run(s, t, None, beta=beta, reduction="none")
    ref = generalized_jsd_reference(s.detach()[:, :50], t[:, :50], beta=beta, reduction="none")
    assert torch.isfinite(out).all() and torch.isfinite(gs).all()
    assert_close(out, ref, 2e-6, "loss")
    assert (gs[:, 50:] == 0).all()


def test_teacher_without_mass_where_student_has_it(device):
    # Forward KL(t || s) is finite when only the teacher has a -inf; reverse KL(s || t) is then +inf.
    s = logits((2, 30), torch.float32, device)
    t = logits((2, 30), torch.float32, device)
    t[:, 3] = float("-inf")
    fwd = K.generalized_jsd(s, t, beta=0.0, reduction="none")
    rev = K.generalized_jsd(s, t, beta=1.0, reduction="none")
    jsd = K.generalized_jsd(s, t, beta=0.5, reduction="none")
    assert torch.isfinite(fwd).all() and torch.isinf(rev).all() and torch.isfinite(jsd).all()
    assert_close(fwd, generalized_jsd_reference(s, t, beta=0.0, reduction="none"), 2e-6, "forward")
    assert_close(jsd, generalized_jsd_reference(s, t, beta=0.5, reduction="none"), 2e-6, "jsd")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_entries_without_mass_in_both(device, beta):
    # Entries at -inf in both rows carry no mass: no loss, a zero gradient for both (the float64 reference's
    # mixture log m of two -inf once had a NaN gradient there, and the JSD's gradients could not be checked).
    s = logits((3, 40), torch.float64, device)
    t = logits((3, 40), torch.float64, device)
    s[:, ::4] = t[:, ::4] = float("-inf")
    s.requires_grad_()
    t.requires_grad_()
    go = random_grad_out(torch.ones(3, dtype=torch.float64, device=device))
    out, (gs, gt) = run(s, t, go, beta=beta, temperature=1.3, reduction="none")
    ref, (rs, rt) = reference(s, t, go, beta=beta, temperature=1.3, reduction="none")
    for g, r, what in ((gs, rs, "student"), (gt, rt, "teacher")):
        assert torch.isfinite(r).all() and (r[:, ::4] == 0).all(), f"reference {what} grad"
        assert (g[:, ::4] == 0).all(), what
        assert_close(g, r, GRAD_TOL[torch.float64], f"{what} grad")
    assert_close(out, ref, LOSS_TOL[torch.float64], "loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=_id)
@pytest.mark.parametrize("rows, vocab", [(4, 100), (4, 104), (1, 100)])
def test_huge_logits(device, dtype, rows, vocab):
    # Logits around +-1e4 (softmax is shift-invariant, so only the spread matters) and entries at -1e4 beside
    # O(1) ones (no mass): no overflow, no NaN, the float64 reference's value. (On CUDA, 4 rows of 100 16-bit
    # entries take the fast kernels' instances for rows off the 16-byte grid, rows of 104 the others, one row of 100
    # the others with a tail of 4 entries past the chunks: the JSD's bfloat16 training rows kept such an entry's u_s,
    # ~-2e4, as fp16's -inf, and its gradient was NaN; and in bf16 the student's rows are uniform on entries 10-99,
    # close to the teacher, so they are summed again, where an exact ks beside the rounded kept u_s left ~4e-8 in a
    # gradient that is 0.)
    s = logits((rows, vocab), torch.float64, device, scale=3.0) + 1e4
    t = logits((rows, vocab), torch.float64, device, scale=3.0) - 1e4
    s[:, :10] = -1e4
    s, t = s.to(dtype).requires_grad_(), t.to(dtype)
    for beta in (0.0, 0.5, 1.0):
        def step(beta=beta):
            return run(s, t, None, beta=beta, temperature=1.0, reduction="none")

        if device == "cuda":
            (out, (gs,)), names = cuda_kernels(step)
            assert dtype == torch.float64 or not general_kernel(names), names  # (the fast kernels took the rows)
        else:
            out, (gs,) = step()
        ref, (rs,) = reference(s, t, torch.ones(rows, dtype=torch.float64, device=device), beta=beta,
                               temperature=1.0, reduction="none")
        assert torch.isfinite(out).all() and torch.isfinite(gs).all()
        assert_close(out, ref, 1e-12 if dtype == torch.float64 else 1e-5, "loss")
        # In bf16 a logit near 1e4 is a multiple of 64: the softmax is one-hot and the float64 gradient is ~0, so
        # the gradient is compared with an absolute floor rather than relative to its own norm.
        tol = {torch.float64: 1e-10}.get(dtype, GRAD_TOL[dtype])
        torch.testing.assert_close(gs.double(), rs, rtol=tol, atol=tol * max(float(rs.abs().max()), 1e-6))


def test_nan_logit_gives_nan_row(device):
    s = logits((3, 20), torch.float32, device)
    t = logits((3, 20), torch.float32, device)
    s[1, 4] = float("nan")
    out = K.generalized_jsd(s, t, reduction="none")
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("vocab", [40, 50000])  # 50000: the fast kernels' rows on CUDA
def test_rows_that_are_no_distribution_on_both_sides_are_nan(device, dtype, vocab):
    # Rows where neither the student nor the teacher is a distribution the lanes can hold: a NaN or +inf logit at
    # the same entry of both, both rows NaN or -inf (no mass at all), both rows' maxima beyond the lanes' range
    # (2^24 log(2) ~ 1.2e7 in float32 lanes). Every probability of such a pair is NaN, and so is its loss for every
    # beta, with and without the gradient (float64 PyTorch's softmax of such rows is NaN too; of the far rows it is
    # finite: the documented limit). The JSD's summand guarded each probability with `p > 0`, so where both were NaN
    # every summand was 0: a loss of 0 (and a NaN gradient) where the KLs gave NaN. The rows beside them keep
    # float64's values.
    nan, inf = float("nan"), float("inf")
    far = 1e17 if dtype == torch.float64 else 1e9
    temp, big = (1e-3, 6e4) if dtype == torch.float16 else (1.0, far)  # (float16 holds no logit beyond 65504)
    s, t = logits((9, vocab), dtype, device), logits((9, vocab), dtype, device)
    s[1, 7], t[1, 7] = nan, nan
    s[2], t[2] = nan, nan
    s[3, 7], t[3, 7] = inf, inf
    s[4], t[4] = -inf, -inf
    s[5], t[5] = -big, -big
    s[6, 3], t[6, vocab - 2] = big, big
    s[7, 5], t[7, 9] = nan, inf
    bad, fine = [1, 2, 3, 4, 5, 6, 7], [0, 8]
    for beta in BETAS:
        for train in (False, True):
            x = s.clone().requires_grad_(train)
            out, grads = run(x, t, beta=beta, temperature=temp, reduction="none")
            what = f"beta={beta} train={train}"
            assert torch.isnan(out[bad]).all(), (what, out)
            ref, _ = reference(s[fine], t[fine], beta=beta, temperature=temp, reduction="none")
            # (the bound of test_logits_beyond_the_lanes_range_give_nan_rows, whose rows beside are alike)
            assert_close(out[fine], ref, 1e-12 if dtype == torch.float64 else 1e-5, what)
            if train:
                (gs,) = grads
                assert torch.isfinite(gs[fine]).all(), what
                # (row 4's student has no mass anywhere: its gradient may be 0 or NaN)
                assert torch.isnan(gs[[r for r in bad if r != 4]]).any(dim=1).all(), what


@pytest.mark.gpu
@pytest.mark.parametrize("pad", PADS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
def test_padded_long_rows_cuda(monkeypatch, dtype, pad):
    # Rows of 32768 of which 3000 are real: whole blocks and warps of every CUDA kernel (the fast kernel's
    # cluster slices, rows_kernel's blocks, the top-k kernel's warps) hold only padding.
    n, vocab, real = 4, 32768, 3000
    s = logits((n, vocab), dtype, "cuda", scale=3.0)
    t = logits((n, vocab), dtype, "cuda", scale=3.0)
    s[:, real:] = pad_value(pad, dtype)
    t[:, real:] = pad_value(pad, dtype)
    s.requires_grad_()
    topk = topk_teacher((n,), real, 20, "cuda")
    one = torch.ones(n, dtype=torch.float64, device="cuda")
    for fast in ("1", "0"):
        monkeypatch.setenv("KLDIV_DISTILL_FAST", fast)
        for beta in (0.0, 0.5, 1.0):
            for teacher, kw in ((t, {}), (None, {"teacher_topk": topk})):
                out, (gs,) = run(s, teacher, None, beta=beta, temperature=2.0, reduction="none", **kw)
                ref, (rs,) = reference(s.detach()[:, :real].clone().requires_grad_(),
                                       None if teacher is None else t[:, :real], one, beta=beta, temperature=2.0,
                                       reduction="none", **kw)
                what = f"fast={fast} beta={beta} {'top-k' if teacher is None else 'logits'}"
                assert torch.isfinite(out).all() and torch.isfinite(gs).all(), what
                assert_close(out, ref, 2e-6, f"loss {what}")
                assert_close(gs[:, :real], rs, GRAD_TOL[dtype], f"grad {what}")
                assert (gs[:, real:] == 0).all(), what


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_logits_beyond_the_lanes_range_give_nan_rows(device, dtype):
    # A row whose largest scaled logit |x / T| lies beyond what its lanes resolve (2^24 log(2) ~ 1.2e7 in float32
    # lanes, 2^53 log(2) ~ 6.2e15 in float64) is NaN, its loss and its gradient, never a wrong finite number (it
    # was: a whole row at -1e12 gave a JSD of log(2) / 2). Rows beside it keep float64's values. float16 cannot
    # hold such logits (its largest is 65504): there the temperature takes them beyond.
    far = 1e17 if dtype == torch.float64 else 1e9
    temp, big = (1e-3, 6e4) if dtype == torch.float16 else (1.0, far)
    n = 6
    s, t = logits((n, 40), dtype, device), logits((n, 40), dtype, device)
    s[1] = -big          # the student's whole row at one far value
    t[2] = -big          # the teacher's
    s[3, 7] = big        # one far entry: the row's maximum
    t[4] = torch.finfo(dtype).min  # the lowest value (float16: x / T overflows)
    s.requires_grad_()
    for beta in (0.0, 0.5, 1.0):
        for teacher, kw in ((t, {}), (None, {"teacher_topk": topk_teacher((n,), 40, 5, device)})):
            rows_far = [1, 2, 3, 4] if teacher is not None else [1, 3]  # a top-k teacher has no logits
            rows_near = [r for r in range(n) if r not in rows_far]
            out, (gs,) = run(s, teacher, None, beta=beta, temperature=temp, reduction="none", **kw)
            # (the gradient is NaN where the row's entries have mass: at T = 1e-3 one entry may hold it all)
            assert torch.isnan(out[rows_far]).all() and torch.isnan(gs[rows_far]).any(dim=1).all(), (beta, out)
            if teacher is None and temp < 1:
                # At T = 1e-3 a top-k teacher's tail bucket can hold less student mass than float32 lanes hold
                # (an infinite loss where float64 has a finite one: a limit of its own, not this test's subject).
                assert not torch.isnan(out[rows_near]).any()
                continue
            near_kw = {name: tuple(x[rows_near] for x in pair) for name, pair in kw.items()}  # the top-k's rows
            ref, (rs,) = reference(s.detach()[rows_near].clone().requires_grad_(),
                                   None if teacher is None else t[rows_near],
                                   torch.ones(len(rows_near), dtype=torch.float64, device=device), beta=beta,
                                   temperature=temp, reduction="none", **near_kw)
            assert_close(out[rows_near], ref, 1e-12 if dtype == torch.float64 else 1e-5, f"loss beta={beta}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
@pytest.mark.parametrize("beta", BETAS)
def test_nearly_agreeing_distributions_never_negative(device, dtype, beta):
    # Student and teacher one bf16 rounding apart: each token's divergence is tiny and must never be negative
    # (a known failure of other kernels); still close to float64 where it is not lost in the rounding.
    t = logits((64, 3000), torch.float64, device, scale=2.0)
    s = t + torch.randn_like(t) * 1e-3
    s, t = s.to(dtype), t.to(dtype)
    out = K.generalized_jsd(s, t, beta=beta, temperature=1.0, reduction="none")
    ref = generalized_jsd_reference(s, t, beta=beta, temperature=1.0, reduction="none")
    assert (out >= 0).all(), out.min()
    assert (ref > 0).all()
    assert_close(out, ref, 1e-4, "per token")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("beta", [0.3, 0.5, 0.9])
def test_jsd_gradient_where_distributions_nearly_agree(device, dtype, beta):
    # The JSD's 16-bit gradient takes u_s in a short form on CUDA (a 4-term series near d = 0, the mixture's log
    # elsewhere): each row's gradient must still be float64's within 16-bit rounding where student and teacher
    # nearly agree (u_s and the row sum ks both small), and exactly 0 where a row agrees exactly.
    t = logits((24, 5000), torch.float64, device, scale=2.0)
    s = t + torch.randn_like(t) * torch.logspace(-4, 0, 24, dtype=t.dtype, device=device)[:, None]
    s, t = s.to(dtype), t.to(dtype)
    s[0] = t[0]
    s.requires_grad_()
    _, (gs,) = run(s, t, beta=beta, temperature=1.0, reduction="sum")
    _, (rs,) = reference(s, t, beta=beta, temperature=1.0, reduction="sum")
    assert (gs[0] == 0).all() and rs[0].abs().max() < 1e-15  # (float64's autograd rounds to ~1e-17)
    for row in range(1, 24):
        assert_grad_close(gs[row], rs[row], dtype, f"row {row}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("beta", [1e-3, 0.999, 1 - 1e-9, 1e-50])
def test_jsd_betas_near_the_ends(device, dtype, beta):
    # The JSD's mode with beta near 0 or 1 (rows of 4096: the fast kernel's training rows on CUDA, whose bfloat16
    # rows take the mixture's weights log2(beta), log2(1 - beta) into the normalisers and divide ks by 1 - beta).
    # Where beta is a float32 number apart from 0 and 1: float64's loss within LOSS_TOL plus 4 eps32 / min(beta,
    # 1 - beta), as the z form's log(1 - beta + beta e^d) is good to an absolute ~1e-7 while the JSD is ~min(beta,
    # 1 - beta) times a divergence (the CPU twin: up to 0.31 eps32 / min(beta, 1 - beta) over logits of spreads
    # 0.5-4 at T = 2; the GPU's lg2.approx is ~3 x coarser near 1); the gradient, whose factor u_s - ks is as
    # small, within GRAD_TOL plus the same (float32 rows on the CPU: up to 0.25 eps32 / min(beta, 1 - beta)).
    # Where float32 rounds beta to 0 (1e-50), those of that end: the true ones differ from them by ~beta times a
    # divergence, so both within 1e-6 absolute (and nothing infinite or NaN from the weights' logs). One that
    # rounds to 1 (1 - 1e-9) is refused: 1 - beta is 0 there, a NaN wherever the student has mass the teacher has
    # not (test_settings_float32_lanes_cannot_hold).
    s = logits((6, 4096), dtype, device).requires_grad_()
    t = logits((6, 4096), dtype, device)
    go = torch.ones(6, device=device)
    if float(torch.tensor(beta, dtype=torch.float32)) == 1.0:
        with pytest.raises(ValueError, match="is 1 in float32"):
            K.generalized_jsd(s, t, beta=beta, temperature=2.0, reduction="none")
        return
    out, (gs,) = run(s, t, go, beta=beta, temperature=2.0, reduction="none")
    ref, (rs,) = reference(s, t, go, beta=beta, temperature=2.0, reduction="none")
    assert torch.isfinite(out).all() and torch.isfinite(gs).all() and (out >= 0).all()
    if float(torch.tensor(beta, dtype=torch.float32)) in (0.0, 1.0):
        assert float((out.double() - ref).abs().max()) <= 1e-6, (out, ref)
        assert float((gs.double() - rs).abs().max()) <= 1e-6
    else:
        end = 4 * torch.finfo(torch.float32).eps / min(beta, 1 - beta)
        assert_close(out, ref, LOSS_TOL[dtype] + end, "loss")
        for row in range(6):
            assert_grad_close(gs[row], rs[row], dtype, f"row {row}", tol=GRAD_TOL[dtype] + end)


def _jsd_truth(s_row, t_row, beta, mpmath):
    """A row's JSD and its gradients w.r.t. the student's and the teacher's logits (T = 1), in mpmath's precision."""
    b = mpmath.mpf(beta)
    xs, xt = [mpmath.mpf(float(v)) for v in s_row], [mpmath.mpf(float(v)) for v in t_row]
    zs, zt = mpmath.fsum(mpmath.exp(v) for v in xs), mpmath.fsum(mpmath.exp(v) for v in xt)
    ps, pt = [mpmath.exp(v) / zs for v in xs], [mpmath.exp(v) / zt for v in xt]
    m = [(1 - b) * a + b * c for a, c in zip(ps, pt)]
    us = [mpmath.log(a / mm) for a, mm in zip(ps, m)]
    ut = [mpmath.log(c / mm) for c, mm in zip(pt, m)]
    ks, kt = mpmath.fsum(a * u for a, u in zip(ps, us)), mpmath.fsum(c * u for c, u in zip(pt, ut))
    loss = b * kt + (1 - b) * ks
    gs = [(1 - b) * a * (u - ks) for a, u in zip(ps, us)]
    gt = [b * c * (u - kt) for c, u in zip(pt, ut)]
    return loss, gs, gt


@pytest.mark.parametrize("beta", [1e-30, 1e-12, 1e-6, 0.3, 1 - 1e-6, 1 - 1e-12])
def test_float64_jsd_keeps_its_digits_at_the_ends_of_beta(device, beta):
    # Float64 logits: the loss and both gradients to ~1e-15 of 60-digit arithmetic whatever beta. Double lanes take
    # u_s and u_t from log1p of their own small arguments and, for beta > 1/2, the series of the exchanged problem
    # (kernels/distill_common.h, exact_ends); with the float lanes' forms the loss's relative error grew as
    # ~1.1e-16 / min(beta, 1 - beta): 1e-5 at beta = 1e-12, 6-15% from 1e-16 on, 3.7e-7 where the rows nearly agree
    # at 1 - 1e-12. Rows: spread 2, and one nearly agreeing (the series' region) with the teacher the student
    # plus 0.01 x noise.
    mpmath = pytest.importorskip("mpmath")  # (torch's sympy brings it)
    mpmath.mp.dps = 50
    s = torch.randn(3, 40, dtype=torch.float64) * 2
    t = torch.randn(3, 40, dtype=torch.float64) * 2
    t[2] = s[2] + 0.01 * torch.randn(40, dtype=torch.float64)
    sl, tl = (x.to(device, copy=True).requires_grad_() for x in (s, t))
    out, (gs, gt) = run(sl, tl, beta=beta, reduction="none")
    out = out.detach()
    for r in range(3):
        loss, rgs, rgt = _jsd_truth(s[r], t[r], beta, mpmath)
        assert abs(float((mpmath.mpf(float(out[r])) - loss) / loss)) <= 1e-14, (r, float(out[r]), float(loss))
        for got, want, who in ((gs[r], rgs, "student"), (gt[r], rgt, "teacher")):
            want_t = torch.tensor([float(w) for w in want], dtype=torch.float64)
            err = float((got.cpu() - want_t).norm() / want_t.norm())
            assert err <= 1e-13, (r, who, err)


# What float32 lanes (16-bit and float32 logits) cannot hold is refused, not computed into a NaN: a beta within
# 3e-8 of 1 rounds to 1 there (1 - beta = 0: the student's side 0 x inf where the teacher has no mass, a NaN loss
# where the truth is ~1e-9), and a temperature below ~4.2e-39 overflows log2(e) / T (NaN where PyTorch's x / T
# is ~1e4). float64 logits take both (their lanes are double); a beta just short of the rounding still works.
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_settings_float32_lanes_cannot_hold(device, dtype):
    s, t = logits((3, 7), dtype, device), logits((3, 7), dtype, device)
    t[:, 2] = -math.inf  # the teacher has no mass there: where 1 - beta = 0 gave NaN
    tiny_t = 1e-39
    if dtype != torch.float64:
        with pytest.raises(ValueError, match="beta=.* is 1 in float32"):
            K.generalized_jsd(s, t, beta=1 - 1e-9)
        with pytest.raises(ValueError, match="temperature=.* too small"):
            K.generalized_jsd(s, t, temperature=tiny_t)
        with pytest.raises(ValueError, match="temperature=.* too small"):
            K.GeneralizedJSDLoss(temperature=tiny_t)(s, t)
        beta = 1 - 2e-7  # 1 - 2.4e-7 in float32: still the JSD
        out, _ = run(s.clone().requires_grad_(), t, beta=beta, reduction="none")
        assert torch.isfinite(out).all()
        return
    for beta, temperature, scale in ((1 - 1e-9, 1.0, 1.0), (0.0, tiny_t, 1e-35)):
        ss, tt = (s * scale).requires_grad_(), (t * scale).requires_grad_()
        out, grads = run(ss, tt, beta=beta, temperature=temperature, reduction="none")
        ref = generalized_jsd_reference(s * scale, t * scale, beta=beta, temperature=temperature, reduction="none")
        assert torch.isfinite(ref).all() and ref.abs().max() > 0  # (a row may be 0: one-hot on one token at T ~ 0)
        # (the float64 reference's logsumexp mixture loses ~1e-16 / (1 - beta) ~ 1e-7 at beta = 1 - 1e-9; the
        # kernels' double lanes hold 1e-14 of 60-digit arithmetic there: test_float64_jsd_keeps_its_digits...)
        assert relative_error(out, ref) <= 1e-6, (beta, temperature, out, ref)
        assert all(torch.isfinite(g).all() for g in grads)


def test_the_lanes_check_traces_with_symbolic_settings():
    # torch.compile(dynamic=True) makes beta and the temperature symbolic: the check converted beta to float32
    # (struct), which Dynamo could not trace (a RecursionError), where it compares now.
    s, t = logits((4, 9), torch.float32, "cpu").requires_grad_(), logits((4, 9), torch.float32, "cpu")
    step = torch.compile(lambda s, t, b, temp: K.generalized_jsd(s, t, beta=b, temperature=temp), fullgraph=True,
                         dynamic=True)
    for beta, temperature in ((0.5, 2.0), (0.3, 1.5)):
        ref = generalized_jsd_reference(s, t, beta=beta, temperature=temperature)
        assert_close(step(s, t, beta, temperature), ref, LOSS_TOL[torch.float32], "loss")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("beta", [0.3, 0.5, 0.9])
def test_jsd_gradient_of_small_logits_that_nearly_agree(device, dtype, beta):
    # Where the logits are small, 16-bit spacing lets d = lt - ls be ~1e-5 (logits of ~1e-3 differ by a few
    # spacings of ~4e-6), so u_s ~ beta d is small against the z form's absolute error (~3.5e-7) and so is ks: these
    # rows' gradients need u_s's relative digits, the series near d = 0. (Logits of magnitude ~1, as in the test
    # above, differ by at least ~1e-3 where they differ at all, and the z form would do there: this is the case
    # that tells whether a kernel keeps the series where it is needed.)
    t = logits((8, 5000), torch.float64, device, scale=1e-3)
    s = t + torch.randn_like(t) * torch.logspace(-5, -4, 8, dtype=t.dtype, device=device)[:, None]
    s, t = s.to(dtype).requires_grad_(), t.to(dtype)
    assert ((s.detach() - t).abs() > 0).float().mean() > 0.5  # (most entries differ at all)
    _, (gs,) = run(s, t, beta=beta, temperature=1.0, reduction="sum")
    _, (rs,) = reference(s, t, beta=beta, temperature=1.0, reduction="sum")
    for row in range(8):
        assert_grad_close(gs[row], rs[row], dtype, f"row {row}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("beta", [0.3, 0.5, 0.9])
def test_jsd_training_rows_per_token(device, dtype, beta):
    # The JSD's 16-bit training rows on CUDA (fast_rows, the student's gradient) sum the summand's direct form, whose
    # error is absolute (up to ~3.5e-7 a row), and sum a row again with the series where its JSD comes out below
    # 1/16: per token, from rows one rounding apart (JSDs ~1e-7) to rows far apart (~0.3), each token's loss must
    # be float64's within 2e-5 relative (the direct form alone gives errors of order 1 on the agreeing rows) and
    # its gradient within 16-bit rounding. 50000 entries a row: several blocks of a cluster take each row.
    t = logits((24, 50000), torch.float64, device, scale=2.0)
    s = t + torch.randn_like(t) * torch.logspace(-3, 0.5, 24, dtype=t.dtype, device=device)[:, None]
    s, t = s.to(dtype).requires_grad_(), t.to(dtype)
    out, (gs,) = run(s, t, beta=beta, temperature=1.0, reduction="none")
    ref, (rs,) = reference(s, t, grad_out=torch.ones(24, device=device), beta=beta, temperature=1.0,
                           reduction="none")
    assert (ref > 0).all() and (out >= 0).all(), out.min()
    per_token = ((out.double() - ref) / ref).abs()
    assert per_token.max() <= 2e-5, (per_token.max(), ref[per_token.argmax()])
    for row in range(24):
        assert_grad_close(gs[row], rs[row], dtype, f"row {row}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_training_rows_with_one_entry_holding_most_mass(device, dtype, beta):
    # Where one entry holds most of the student's mass (ps -> 1) and the teacher gives it little, its gradient
    # ps (u_s - ks) cancels to ~(1 - ps) of u_s: a rounding of u_s that ks does not share (kernels/distill_fast.cuh
    # keeps u_s in fp16 between its passes) is then ~2^-12 / (1 - ps) of that entry's gradient, beyond a 16-bit
    # gradient's rounding at ps ~0.96 (a draw of test_jsd_training_rows_per_token once failed so). Rows of 50000
    # whose top entry holds 0.5 to 0.999 of the student's mass; the teacher's share of it as drawn (~1e-4) in even
    # rows, 0.2 in odd ones.
    n, v = 32, 50000
    t = logits((n, v), torch.float64, device, scale=2.0)
    s = t + torch.randn_like(t) * 0.3
    top = torch.randint(0, v, (n,), device=device)
    rows = torch.arange(n, device=device)

    def give(x, share, which):  # x's entry `top` of rows `which` set to hold `share` of the row's mass
        rest = x[which].clone()
        rest[torch.arange(len(which), device=device), top[which]] = float("-inf")
        x[which, top[which]] = rest.logsumexp(-1) + (share / (1 - share)).log()

    give(s, torch.linspace(0.5, 0.999, n, dtype=t.dtype, device=device), rows)
    give(t, torch.full((n // 2,), 0.2, dtype=t.dtype, device=device), rows[1::2])
    s, t = s.to(dtype).requires_grad_(), t.to(dtype)
    out, (gs,) = run(s, t, beta=beta, temperature=1.0, reduction="none")
    ref, (rs,) = reference(s, t, grad_out=torch.ones(n, device=device), beta=beta, temperature=1.0,
                           reduction="none")
    per_token = ((out.double() - ref) / ref).abs()
    assert per_token.max() <= 2e-5, (per_token.max(), ref[per_token.argmax()])
    for row in range(n):
        assert_grad_close(gs[row], rs[row], dtype, f"row {row}")


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_jsd_training_rows_with_special_entries_scattered(device, beta):
    # The JSD's bfloat16 training rows on CUDA take a chunk of 8 entries whose every |d| is below 64 through a form
    # without the log-space branch and the guards for probabilities of 0 (kernels/distill_fast.cuh,
    # kJsdPlainChunks); a chunk with one entry outside takes the general form. Scattered over rows of 50000 (many
    # chunks, several blocks a row): student logits at -inf (d = +inf) and far below (d ~ +80), teacher logits at
    # -inf (a probability of 0, d = -inf) and far below (d ~ -80), both at -inf; each token's loss against
    # float64 and its gradient within bf16 rounding (taking such a chunk the plain way gives NaN or a wrong row).
    n, v = 12, 50000
    t = logits((n, v), torch.float64, device, scale=2.0)
    s = t + torch.randn_like(t)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for x, value in ((s, float("-inf")), (s, -80.0), (t, float("-inf")), (t, -80.0)):
        cols = torch.randperm(v, generator=gen)[:40].to(device)
        x[:, cols] = value
    both = torch.randperm(v, generator=gen)[:9].to(device)
    s[:, both] = t[:, both] = float("-inf")
    s, t = s.to(torch.bfloat16).requires_grad_(), t.to(torch.bfloat16)
    out, (gs,) = run(s, t, beta=beta, temperature=1.0, reduction="none")
    ref, (rs,) = reference(s, t, grad_out=torch.ones(n, device=device), beta=beta, temperature=1.0,
                           reduction="none")
    assert torch.isfinite(out).all() and torch.isfinite(gs).all()
    per_token = ((out.double() - ref) / ref).abs()
    assert per_token.max() <= 2e-5, (per_token.max(), ref[per_token.argmax()])
    for row in range(n):
        assert_grad_close(gs[row], rs[row], torch.bfloat16, f"row {row}")


@pytest.mark.parametrize("beta", [0.3, 0.5])
def test_jsd_training_rows_with_a_nan_logit(device, beta):
    # The JSD's bfloat16 training rows on CUDA take their gradient from what the terms pass kept (u_s, and (1 - beta)
    # ps: kernels/distill_fast.cuh, kJsdKeptPs), in a loop without guards where the row sum ks is finite and a
    # guarded one where it is not. A NaN logit, the student's or the teacher's, makes its row's loss NaN and its
    # gradient NaN wherever the student has mass (never a finite number), as float64's; where the student has no
    # mass (-inf) the kit's gradient is 0 even in such a row (float64's autograd is NaN there: the unguarded loop's
    # 0 times NaN would be too). A row beside them whose student is -inf on a third of its entries keeps float64's
    # values.
    n, v = 6, 50000
    t = logits((n, v), torch.float64, device, scale=2.0)
    s = t + torch.randn_like(t)
    s[1, v // 3] = float("nan")
    t[2, 2 * v // 3] = float("nan")
    s[2, 0::5] = float("-inf")
    s[3, 1::3] = float("-inf")
    s, t = s.to(torch.bfloat16).requires_grad_(), t.to(torch.bfloat16)
    out, (gs,) = run(s, t, beta=beta, temperature=1.0, reduction="none")
    ref, (rs,) = reference(s, t, grad_out=torch.ones(n, device=device), beta=beta, temperature=1.0,
                           reduction="none")
    assert torch.isnan(out[[1, 2]]).all() and torch.isnan(ref[[1, 2]]).all()
    assert torch.isnan(gs[1]).all()  # (a NaN normaliser: every entry)
    assert (gs[2, 0::5] == 0).all() and torch.isnan(gs[2, 1::5]).all()
    fine = [0, 3, 4, 5]
    assert torch.isfinite(out[fine]).all() and torch.isfinite(gs[fine]).all()
    assert_close(out[fine], ref[fine], 2e-5, "loss")
    assert (gs[3, 1::3] == 0).all()
    for row in fine:
        assert_grad_close(gs[row], rs[row], torch.bfloat16, f"row {row}")


# --------------------------------------------------------------------------- 3b. the forward alone
def accurate_kl(s, t, temperature, beta):
    """Forward (beta 0) or reverse (beta 1) KL of each row of finite logits in float64, summed as p phi(u) with
    phi(u) = u + exp(-u) - 1 >= 0 (a series below |u| = 1e-3) and u = log p - log q from each row's logits shifted
    by its maximum and normalised by log1p of the other entries' sum: where a row's mass sits on a few entries that
    agree, u there is that log1p's small difference, which log(1 + rest) would round away."""
    a, b = s.double() / temperature, t.double() / temperature
    if beta == 1.0:  # KL(p_s || p_t): the same with the roles swapped
        a, b = b, a

    def shifted(x):  # (x - max, log1p of the sum of exp(x - max) over all but one maximal entry)
        i = x.argmax(-1, keepdim=True)
        z = x - x.gather(-1, i)
        return z, torch.log1p(z.exp().scatter(-1, i, 0.0).sum(-1, keepdim=True))

    (zb, lb), (za, la) = shifted(b), shifted(a)
    u = (zb - za) - (lb - la)
    phi = torch.where(u.abs() < 1e-3, u * u * (0.5 - u * (1 / 6 - u * (1 / 24 - u / 120))), torch.expm1(-u) + u)
    return ((zb - lb).exp() * phi).sum(-1)


# Forward and reverse KL without any gradient take the kernels' inference instances (fast_rows without a gradient
# where rows start on 16-byte boundaries, else rows_kernel's inference configuration): the special values and
# offsets of section 3 again, per token against float64 and against the training instances' losses.
def forward_cases(dtype, width, device):
    """(name, student, teacher) pairs of [6, width] logits: ordinary, agreeing, offset, padded, partly -inf."""
    x = logits((6, width), torch.float64, "cpu", scale=3.0)
    y = logits((6, width), torch.float64, "cpu", scale=3.0)
    near = x + 1e-3 * torch.randn_like(x)
    cases = {"random": (x, y), "agreeing": (x, near), "agreeing, offset 7.3": (x, near + 7.3)}
    if width > 1000:  # (a few sharp entries: KLs of 1e-20 and less, below float64's own cancellation)
        cases["sharp"] = (10 * x, 10 * x + torch.randn_like(x))
    if dtype != torch.float16:
        cases["offset +-1e4"] = (x + 1e4, y - 1e4)
    for pad in PADS:
        a, b = x.clone(), y.clone()
        a[:, -37:] = b[:, -37:] = pad_value(pad, dtype)
        cases[f"padded {pad}"] = (a, b)
    holes = y.clone()
    holes[:, 1::3] = float("-inf")
    cases["teacher -inf on a third"] = (x, holes)
    cases["student -inf on a third"] = (holes, x)
    mixed = y.clone()
    mixed[0, width // 2] = float("nan")
    mixed[1, -1] = float("-inf")
    mixed[2] = float("-inf")  # a teacher without any mass: NaN, as PyTorch's
    cases["NaN, -inf rows"] = (x, mixed)
    return [(name, a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for name, (a, b) in cases.items()]


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("width", [1, 7, 4099, 4096])  # on CUDA 4096 (rows on 16-byte boundaries): fast_rows
def test_forward_alone_matches_float64_and_training(device, dtype, width):
    lab = labels_for((6,), device)
    for name, s, t in forward_cases(dtype, width, device):
        for beta, temp in ((0.0, 1.0), (1.0, 2.0), (0.0, 0.7)):
            kw = dict(beta=beta, temperature=temp, labels=lab, reduction="none")
            ref = generalized_jsd_reference(s.double(), t.double(), **kw)
            with torch.no_grad():
                out = K.generalized_jsd(s, t, **kw)
            trained = K.generalized_jsd(s.clone().requires_grad_(), t, **kw).detach()
            what = f"{name} beta={beta} T={temp}"
            # NaN in the same rows as training: where float64 is NaN, and where the logits lie beyond what float
            # lanes resolve (a whole row of padding at -1e10: the kit's NaN, never a guess)
            assert torch.equal(torch.isnan(out), torch.isnan(trained)), what
            assert torch.isnan(out[torch.isnan(ref)]).all(), what
            fin = torch.isfinite(ref) & ~torch.isnan(out)
            inf = torch.isinf(ref) & ~torch.isnan(out)
            assert torch.equal(out[inf].double(), ref[inf]), what
            assert (out[fin] >= 0).all(), what
            tol = 1e-12 if dtype == torch.float64 else 2e-6
            floor = 0.0
            if name.startswith("agreeing") or name == "sharp":
                # The reference's own sum p (log p - log q) cancels to ~1e-16 x 10-30 against KLs down to ~1e-11
                # (agreeing rows, which 16-bit logits make equal but for an entry or two; sharp rows whose few
                # heavy entries agree): off by 1.7e-6 and, once in 1500 seeds, 2.9e-3 in float64, and by up to
                # 1.3e-4 for bf16 inputs. So these rows go against a float64 reference that keeps the digits
                # (accurate_kl): float64 within 1e-9 (the CPU twin: 1.5e-12 over 1500 seeds). In float32 lanes a
                # token's KL of ~1e-11 comes out within ~3e-15 (the CPU twin, 400 seeds: 4.7e-5 of it), below
                # float32's resolution of a squared log ratio, eps^2 = 1.4e-14: that much a token is not counted.
                ref = torch.where(torch.isfinite(ref), accurate_kl(s, t, temp, beta).masked_fill(lab == -100, 0), ref)
                tol = 1e-9 if dtype == torch.float64 else tol
                floor = 0.0 if dtype == torch.float64 else torch.finfo(torch.float32).eps ** 2
            if dtype != torch.float64 and name in ("agreeing, offset 7.3", "sharp"):
                # where the two rows are offset, d comes from each row's shifted logits, rounded at the shift's
                # size (5e-7 at ~7) where d spreads over 1e-3 and each token's KL is ~1e-7: up to ~1e-4 off
                # float64 (float32, 7 entries a row); a few sharp entries holding the mass: up to ~4e-5
                tol = 1e-3 if name == "sharp" else 3e-3
            zero = fin & (ref == 0)  # one-entry rows: float lanes leave the shift's rounding (~1e-8)
            assert (out[zero].abs() <= 1e-6).all(), what
            if (fin & ~zero).any():
                o, r = out[fin & ~zero].double(), ref[fin & ~zero]
                err = float(((o - r).abs() - floor).clamp(min=0).norm() / r.norm())
                assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} (beyond {floor:.1e} a token)"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
@pytest.mark.parametrize("vocab", [128256, 50001, 262144])
def test_forward_alone_long_rows_cuda(dtype, vocab):
    # The inference kernels at LM vocabularies (50001 in rows padded to 16 bytes: a last partial chunk; 262144:
    # longer than a cluster's shared memory holds), masked rows, the reduced losses too.
    width = vocab + (-vocab) % 8
    s = logits((9, width), dtype, "cuda", scale=3.0)[:, :vocab]
    t = logits((9, width), dtype, "cuda", scale=3.0)[:, :vocab]
    lab = labels_for((9,), "cuda")
    for beta in (0.0, 1.0):
        for reduction in REDUCTIONS:
            kw = dict(beta=beta, temperature=2.0, labels=lab, reduction=reduction)
            with torch.no_grad():
                out = K.generalized_jsd(s, t, **kw)
            assert_close(out, generalized_jsd_reference(s.double(), t.double(), **kw), 2e-6, f"{beta} {reduction}")


def near_and_far_rows(temp):
    """[32, 32000] float64 (student, teacher) logits on both sides of the forward alone's trust line: per row the
    student's distance from the teacher (KL ~ sd^2 / (2 T^2) for small sd), and a common offset on rows whose KL
    stays above ~0.03 (where a row nearly agrees up to an offset, the second sum's own error is ~1e-4 of its tiny
    KL: the forward alone's other tests bound it). Fresh each call."""
    n, v = 32, 32000
    t = logits((n, v), torch.float64, "cpu", scale=3.0)
    noise = torch.randn(n, v, dtype=torch.float64)
    sd = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.8, 0.7, 0.6, 0.5, 0.35, 0.25, 0.1, 1e-2, 1e-3, 1e-4, 0.0, 0.0]
                      + [3.0, 2.0, 1.5, 1.0, 0.8, 0.7, 0.6, 0.5] * 2, dtype=torch.float64)
    offset = torch.tensor([0.0] * 16 + [7.3, -250.0, 1e3, 3.0] * 4, dtype=torch.float64)
    return t + sd[:, None] * (temp / 2) * noise + offset[:, None], t  # (the same KLs at either temperature)


def per_token_excess(out, ref, s, t, temp):
    """How far each token's KL ``out`` lies beyond what float32 lanes allow it around float64's ``ref`` (<= 0:
    within). Each logit, taken from a reference within its row's range and times 1 / T, is rounded by up to
    eps range / T, which moves a KL by at most that times E_p|d - E_p d| <= sqrt(2 KL) near agreement (d the log
    ratio; the errors' signs vary, so ~1e-2 of it is typical: 2.7e-14 at a KL of 2.5e-11 on an H200, where eps^2
    alone, the bound before, failed one run in ~4); plus 1e-5 relative, and eps^2 where the KL is 0. The plain
    form in float32 is far outside it on nearly agreeing rows (test_per_token_bound_rejects_the_plain_form), as
    are logits taken from reference 0 on rows offset by 1e3 (~eps 1e3 / T sqrt(2 KL))."""
    eps = torch.finfo(torch.float32).eps
    s64, t64 = s.double(), t.double()
    spread = torch.maximum(s64.amax(-1) - s64.amin(-1), t64.amax(-1) - t64.amin(-1)) / temp
    allowed = 1e-5 * ref + eps * spread * (2 * ref.clamp(min=0)).sqrt() + eps ** 2
    return (out.double() - ref).abs() - allowed


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("temp", [2.0, 0.25])
def test_per_token_bound_rejects_the_plain_form(beta, temp):
    # The bound the forward alone's per-token test holds the kernel to must still tell its second sum from the
    # plain form it replaces on nearly agreeing rows: each side's log-probabilities in float32, then
    # sum p_a (l_a - l_b), which cancels to ~1e-7 absolute where the KL is far smaller. The rounding errors' signs
    # vary, so one row may land inside: over 150 fresh draws of the rows of sd 1e-2, 1e-3, 1e-4 at T = 0.25 the
    # plain form fell outside in 76-81%, 96-98% and 100% of draws, and "2 of 3 in one draw" failed ~1%. Four draws
    # and more than half of their 12 rows outside fails ~4e-5 (six of the eight sd 1e-2 and 1e-3 rows inside).
    # (The rows' median errors are 2-27, 23-320 and 200-2100 x the bound, so it passes a bound 10 x looser too; at
    # T = 0.25 it fails one 100 x looser.)
    outside = []
    for _ in range(4):
        s, t = (x.float() for x in near_and_far_rows(temp))
        a, b = (t, s) if beta == 0.0 else (s, t)
        la, lb = torch.log_softmax(a / temp, -1), torch.log_softmax(b / temp, -1)
        plain = (la.exp() * (la - lb)).sum(-1)
        excess = per_token_excess(plain, accurate_kl(s, t, temp, beta), s, t, temp)
        outside.append(excess[11:14] > 0)  # (rows of sd 1e-2, 1e-3, 1e-4)
    assert int(torch.stack(outside).sum()) >= 7, torch.stack(outside)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_id)
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("temp", [2.0, 0.25])  # (0.25: sharp rows, whose large terms cancel to a small KL)
def test_forward_alone_one_pass_and_its_second_sum_per_token_cuda(dtype, beta, temp):
    # Forward and reverse KL without a gradient on 16-byte-aligned rows sum each row once in the plain form (three
    # sums, good to ~1e-6 absolute) and trust it only well above what it cancels; rows below that (student and
    # teacher nearly agree, up to an offset too) are summed again with the non-negative summands. One batch of
    # LM-width rows on both sides of that line, each token against float64: the one-pass rows within 1e-5 of their
    # value, every row >= 0, the nearly agreeing ones as accurate as float32 lanes allow (per_token_excess).
    s, t = near_and_far_rows(temp)
    n = s.shape[0]
    s, t = s.to(device="cuda", dtype=dtype), t.to(device="cuda", dtype=dtype)
    lab = torch.full((n,), 7, device="cuda")
    lab[5] = -100  # a masked row among them
    poison_allocator("cuda")  # (a row the kernel skips reads NaN)
    with torch.no_grad():
        out = K.generalized_jsd(s, t, beta=beta, temperature=temp, labels=lab, reduction="none")
    ref = accurate_kl(s, t, temp, beta).masked_fill(lab == -100, 0.0)
    assert out.dtype == torch.float32 and (out >= 0).all() and out[5] == 0, out
    excess = per_token_excess(out, ref, s, t, temp)
    worst = int(excess.argmax())
    assert excess[worst] <= 0, (worst, float(out[worst]), float(ref[worst]))
    # Both sides of the line are in the batch (the rows the plain form may take; the test holds for both kinds
    # alike). At T = 0.25 the sharp rows' KLs mostly fall below it (as few as 2 of 32 above in float64 trials, 5
    # on an H200): that temperature checks the line against large terms, T = 2 the one-pass rows (19 or more).
    one_pass = ref >= 1 / 16
    assert one_pass.sum() >= (8 if temp == 2.0 else 1) and (~one_pass).sum() >= 8
    loss = K.generalized_jsd(s, t, beta=beta, temperature=temp, labels=lab)  # batchmean
    assert abs(float(loss) - float(ref.sum() / 31)) <= 1e-5 * float(ref.sum() / 31)


# ------------------------------------------------------------------------------------------ 4. top-k
def topk_teacher(lead, vocab, k, device):
    lp_all = torch.log_softmax(torch.randn(*lead, vocab, dtype=torch.float64) * 2.5, dim=-1)
    lp, idx = lp_all.topk(k, dim=-1)
    perm = torch.argsort(torch.rand(*lead, k), dim=-1)  # any order, as a server may return them
    return idx.gather(-1, perm).to(device), lp.gather(-1, perm).float().to(device)


def prepared_topk(idx, lp, vocab):
    """A top-k teacher's log-probabilities [rows, k] as distill_forward takes them, [rows, k + 1] (normalised, the
    tail's mass last): the traced path's PyTorch form of distill_topk_prepare."""
    return K.distill.traced_topk_normalisation(lp, idx.shape[-1] == vocab).contiguous()


@pytest.mark.parametrize("k", [1, 5, 64])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_topk_matches_float64(device, k, beta, reduction):
    vocab = 64 if k == 64 else 300  # k == V: no tail bucket
    s = logits((2, 3, vocab), torch.float32, device).requires_grad_()
    topk = topk_teacher((2, 3), vocab, k, device)
    lab = labels_for((2, 3), device)
    kw = dict(teacher_topk=topk, beta=beta, temperature=1.7, labels=lab, reduction=reduction)
    loss = K.generalized_jsd(s, **kw)
    go = random_grad_out(loss.detach())
    out, (gs,) = run(s, None, go, **kw)
    ref, (rs,) = reference(s, None, go, **dict(kw))
    assert_close(out, ref, 2e-6, "loss")
    assert_close(gs, rs, GRAD_TOL[torch.float32], "student grad")


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_long_rows_cuda(beta):
    s = logits((4, 128256), torch.bfloat16, "cuda", scale=3.0).requires_grad_()
    topk = topk_teacher((4,), 128256, 100, "cuda")
    lab = torch.tensor([5, 7, -100, 9], device="cuda")  # a masked row among rows that a cluster of blocks shares
    out, (gs,) = run(s, None, None, teacher_topk=topk, beta=beta, temperature=2.0, labels=lab, reduction="none")
    ref, (rs,) = reference(s, None, torch.ones(4, dtype=torch.float64, device="cuda"), teacher_topk=topk, beta=beta,
                           temperature=2.0, labels=lab, reduction="none")
    assert out[2] == 0 and (gs[2] == 0).all()
    assert_close(out, ref, 2e-6, "loss")
    assert_close(gs, rs, GRAD_TOL[torch.bfloat16], "grad")


# More members than the top-k kernel's block has threads (128 for 16-bit training rows, 256 otherwise): each
# thread's first member is held in registers, the rest read in a loop (kTopkMemberRegs), in each of three passes.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_more_members_than_threads(device, dtype, beta):
    vocab, k = 1000, 300
    s = logits((3, vocab), dtype, device, scale=3.0).requires_grad_()
    topk = topk_teacher((3,), vocab, k, device)
    lab = torch.tensor([5, -100, 9], device=device)
    out, (gs,) = run(s, None, None, teacher_topk=topk, beta=beta, temperature=2.0, labels=lab, reduction="none")
    ref, (rs,) = reference(s, None, torch.ones(3, dtype=torch.float64, device=device), teacher_topk=topk, beta=beta,
                           temperature=2.0, labels=lab, reduction="none")
    assert out[1] == 0 and (gs[1] == 0).all()
    assert_close(out, ref, 2e-6, "loss")
    assert_close(gs, rs, GRAD_TOL[dtype], "grad")


# A served teacher's k tokens often hold all but 1e-4 to 1e-6 of its mass. Its tail bucket, 1 - the sum of the k
# probabilities, is then a small difference of numbers near 1: formed from float32 exponentials summed in float32
# (as the kernels once did) it was off by percents of itself, and reverse KL's per-token loss by 7e-5 relative
# (k = 100, a tail of 1e-5, on the CPU twin). distill_topk_prepare forms it in double now (CUDA: its warp kernel
# for k <= 128, its block kernel beyond), and so does the traced path's normalisation.
@pytest.mark.parametrize("k", [100, 200])
@pytest.mark.parametrize("tail", [1e-3, 1e-5])
def test_topk_teacher_with_a_small_tail(device, k, tail):
    vocab, n = 4096, 6
    top, idx = torch.log_softmax(torch.randn(n, vocab, dtype=torch.float64) * 2.5, -1).topk(k, -1)
    lp = (top - top.logsumexp(-1, keepdim=True) + math.log1p(-tail)).float()  # the k tokens hold 1 - tail
    exact = 1 - lp.double().exp().sum(-1)  # the tail of these float32 log-probabilities
    assert ((exact / tail - 1).abs() < 0.1).all(), exact
    idx, lp = idx.to(device), lp.to(device)
    mod = K.load(device, extension="distill")
    prepared = mod.distill_topk_prepare(idx, lp, vocab, None, -100, math.log1p(K.distill.TOPK_MASS_SLACK))[0]
    for got, how in ((prepared, "distill_topk_prepare"), (K.distill.traced_topk_normalisation(lp, False), "traced")):
        assert got.shape == (n, k + 1) and torch.equal(got[:, :k], lp), how  # (mass below 1: nothing shifted)
        err = float((got[:, k].double().cpu() / exact - 1).abs().max())
        assert err <= 2.0**-23, f"{how}: the tail {err:.2e} off, relative"
    for dtype in (torch.bfloat16, torch.float32):
        s = logits((n, vocab), dtype, device, scale=2.0).requires_grad_()
        for beta in (0.0, 0.5, 1.0):
            kw = dict(teacher_topk=(idx, lp), beta=beta, reduction="none")
            go = random_grad_out(torch.ones(n, device=device))
            out, (gs,) = run(s, None, go, **kw)
            ref, (rs,) = reference(s, None, go, **kw)
            err = float(((out.detach().double() - ref.detach()).abs() / ref.detach().abs()).max())
            assert err <= 2e-6, f"{dtype} beta={beta}: a token's loss {err:.2e} off, relative"
            assert_grad_close(gs, rs, dtype, f"{dtype} beta={beta} grad")


# float64 log-probabilities beside float32 lanes (16-bit or float32 logits): the tail is that of the values given,
# prepared in float64 and then rounded. It was that of their float32 roundings: where it is ~1e-5, reverse KL's
# per-token loss was 1e-4 to 2e-4 off, relative.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_id)
def test_float64_topk_teacher_keeps_its_tail_beside_float32_lanes(monkeypatch, device, dtype):
    vocab, n, k, tail = 4096, 6, 100, 1e-5
    top, idx = torch.log_softmax(torch.randn(n, vocab, dtype=torch.float64) * 2.5, -1).topk(k, -1)
    lp = top - top.logsumexp(-1, keepdim=True) + math.log1p(-tail)  # float64: the k tokens hold 1 - tail
    idx, lp = idx.to(device), lp.to(device)
    s = logits((n, vocab), dtype, device, scale=2.0).requires_grad_()
    go = random_grad_out(torch.ones(n, device=device))
    for beta in (0.5, 1.0):
        for how in ("eager", "traced"):
            kw = dict(teacher_topk=(idx, lp), beta=beta, reduction="none")
            if how == "traced":  # the traced path's normalisation (torch.compile, CUDA-graph capture)
                with monkeypatch.context() as m:
                    m.setattr(K.distill, "_is_tracing", lambda t: True)
                    out, (gs,) = run(s, None, go, **kw)
            else:
                out, (gs,) = run(s, None, go, **kw)
            ref, (rs,) = reference(s, None, go, **kw)
            err = float(((out.detach().double() - ref.detach()).abs() / ref.detach().abs()).max())
            assert err <= 2e-6, f"{how} beta={beta}: a token's loss {err:.2e} off, relative"
            assert_grad_close(gs, rs, dtype, f"{how} beta={beta} grad")


def _rows_just_below_one(n, k):
    """n float32 rows of k log-probabilities whose mass, summed exactly from these float32 values, lies in
    (1 - 5e-8, 1 - 1e-9): a confident teacher's k tokens holding all but ~1e-8 of its mass (a tail of 1e-9 at
    least, far above a double sum's rounding, so that a tail of 0 is told from the tail)."""
    rows = []
    while len(rows) < n:
        p = torch.rand(k, dtype=torch.float64) ** 4
        lp = ((p / p.sum()).log() + math.log1p(-2e-8)).float()
        if 1e-9 < 1 - float(lp.double().exp().sum()) < 5e-8:
            rows.append(lp)
    return torch.stack(rows)


@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
def test_topk_rows_without_a_tail_and_the_documented_remedy(device, served):
    # A served top-k whose rounded mass lies above 1 is divided out and keeps no tail (the README says so): reverse
    # KL is inf where the student holds mass outside the k tokens. The README's remedy leaves each row a tail of at
    # least eps: then finite, with a finite gradient, the float64 loss of the remedied teacher, and rows whose
    # tail is already above eps untouched.
    teacher = torch.log_softmax(torch.randn(32, 1000, dtype=torch.float64) * 4, -1)
    lp64, idx = teacher.topk(999, -1)  # tails of ~1e-12: the rounding puts about half the rows above 1
    lp = lp64.to(served)
    above = lp.double().logsumexp(-1) > 0
    assert above.any(), "no row's rounded mass is above 1: the draw tests nothing"
    s = torch.randn(32, 1000, device=device, requires_grad=True)
    args = dict(beta=1.0, reduction="none")
    plain = K.generalized_jsd(s, teacher_topk=(idx.to(device), lp.to(device)), **args).cpu()
    assert torch.isinf(plain[above]).all() and torch.isfinite(plain[~above]).all()
    eps = 1e-6  # in float32, as the README says (bfloat16's rounding, ~2^-9 of each value, would undo it)
    fixed = lp.float() - (lp.float().logsumexp(-1, keepdim=True) + eps).clamp_min(0)
    loss = K.generalized_jsd(s, teacher_topk=(idx.to(device), fixed.to(device)), **args)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(s.grad).all()
    # the loss of the teacher so remedied (its tail ~eps), as float64 lanes give it
    exact = K.generalized_jsd(s.detach().double(), teacher_topk=(idx.to(device), fixed.double().to(device)), **args)
    assert torch.allclose(loss.detach().double(), exact, rtol=1e-5, atol=0)
    lp100, idx100 = teacher.topk(100, -1)  # tails far above eps
    kept = lp100.float()
    assert torch.equal(kept - (kept.logsumexp(-1, keepdim=True) + eps).clamp_min(0), kept)


# Whether a top-k row's mass is above 1 (then divided out, and its tail set to 0) is decided on the values as given,
# from a logsumexp in double. From a float32 one, rounded by ~6e-8, rows holding all but 1e-8 of the mass came out
# above 1: shifted, their tail 0, reverse KL's loss inf and the gradient NaN, where both are finite.
@pytest.mark.parametrize("k", [3, 100, 200])
def test_topk_teacher_whose_mass_is_just_below_one(device, k):
    vocab, n = 512, 48
    lp = _rows_just_below_one(n, k)
    exact = 1 - lp.double().exp().sum(-1)
    idx = torch.rand(n, vocab).argsort(-1)[:, :k].contiguous().to(device)
    lp = lp.to(device)
    mod = K.load(device, extension="distill")
    prepared = mod.distill_topk_prepare(idx, lp, vocab, None, -100, math.log1p(K.distill.TOPK_MASS_SLACK))[0]
    for got, how in ((prepared, "distill_topk_prepare"), (K.distill.traced_topk_normalisation(lp, False), "traced")):
        assert torch.equal(got[:, :k], lp), how  # (mass below 1: nothing shifted)
        # Within 1e-5 of itself, beside the double sums' rounding in any order (k units of 2^-53 of a sum near 1:
        # an H200 summed a tail of 6e-12 to 1.1e-16 of the CPU's sum, 1.8e-5 of itself)
        err = (got[:, k].double().cpu() - exact).abs() - 1e-5 * exact
        assert float(err.max()) <= k * 2.0**-53, \
            f"{how}: the tail {float(err.max()):.2e} beyond its bound (a tail of 0: the row taken as above 1)"
    s = logits((n, vocab), torch.float32, device, scale=2.0).requires_grad_()
    for beta in (0.5, 1.0):
        kw = dict(teacher_topk=(idx, lp), beta=beta, reduction="none")
        go = random_grad_out(torch.ones(n, device=device))
        out, (gs,) = run(s, None, go, **kw)
        ref, (rs,) = reference(s, None, go, **kw)
        assert torch.isfinite(out).all() and torch.isfinite(gs).all(), f"beta={beta}"
        err = float(((out.detach().double() - ref.detach()).abs() / ref.detach().abs()).max())
        assert err <= 2e-6, f"beta={beta}: a token's loss {err:.2e} off, relative"
        assert_grad_close(gs, rs, torch.float32, f"beta={beta} grad")


# k = 300: above the CUDA preparation kernel's pair check (k <= 256), repeats found by sorting; k = 100: a repeat
# 99 entries apart and one 32 apart (one lane's two, were a warp to take a row)
@pytest.mark.parametrize("vocab,k", [(10, 3), (1000, 100), (400, 300)])
@pytest.mark.parametrize("grad", [False, True])
def test_topk_bad_indices_raise(device, vocab, k, grad):
    s = logits((2, vocab), torch.float32, device).requires_grad_(grad)
    idx, lp = topk_teacher((2,), vocab, k, device)
    with pytest.raises(ValueError, match=rf"in \[0, {vocab}\)"):
        K.generalized_jsd(s, teacher_topk=(idx + vocab, lp))
    low = idx.clone()
    low[0, k - 1] = -1
    with pytest.raises(ValueError, match=rf"in \[0, {vocab}\)"):
        K.generalized_jsd(s, teacher_topk=(low, lp))
    dup = idx.clone()
    dup[1, k - 1] = dup[1, 0]
    with pytest.raises(ValueError, match="distinct"):
        K.generalized_jsd(s, teacher_topk=(dup, lp))
    if k > 32:  # entries 0 and 32: one lane's two where a warp takes a row
        dup = idx.clone()
        dup[0, 32] = dup[0, 0]
        with pytest.raises(ValueError, match="distinct"):
            K.generalized_jsd(s, teacher_topk=(dup, lp))
    K.generalized_jsd(s, teacher_topk=(idx, lp))  # and the good pair passes
    with pytest.raises(ValueError, match="1 <= k"):
        K.generalized_jsd(s, teacher_topk=(idx[:, :0], lp[:, :0]))
    with pytest.raises(ValueError, match="no gradient flows"):
        K.generalized_jsd(s, teacher_topk=(idx, lp.clone().requires_grad_()))


class _PlainSubclass(torch.Tensor):
    """A Python subclass that keeps Tensor's dispatch: it holds its values, as nn.Parameter does."""


@pytest.mark.parametrize("held", ["parameter", "subclass"])
def test_topk_checks_run_on_tensor_subclasses(device, held):
    # Only tensors without values to read (torch.compile's fake tensors, CUDA-graph capture) skip the eager checks.
    # They were skipped for any type but Tensor: indices or log-probabilities held in a Parameter (or a plain
    # subclass) gave NaN rows or a silently normalised loss instead of the errors.
    def wrap(t):
        return torch.nn.Parameter(t, requires_grad=False) if held == "parameter" else t.as_subclass(_PlainSubclass)

    s = logits((4, 40), torch.float32, device)
    idx, lp = topk_teacher((4,), 40, 5, device)
    out = idx.clone()
    out[1, 0] = 47
    dup = idx.clone()
    dup[0, 1] = dup[0, 0]
    with pytest.raises(ValueError, match=r"in \[0, 40\)"):
        K.generalized_jsd(s, teacher_topk=(wrap(out), lp), reduction="none")
    with pytest.raises(ValueError, match="distinct"):
        K.generalized_jsd(s, teacher_topk=(wrap(dup), lp), reduction="none")
    with pytest.raises(ValueError, match="those of a distribution"):
        K.generalized_jsd(s, teacher_topk=(wrap(idx), wrap(lp + 1.0)))
    want = K.generalized_jsd(s, teacher_topk=(idx, lp), reduction="none")
    got = K.generalized_jsd(wrap(s), teacher_topk=(wrap(idx), wrap(lp)), reduction="none")
    assert torch.equal(torch.as_tensor(got).as_subclass(torch.Tensor), want)


class _StandInEvent:
    """torch.cuda.Event's part that read_back_later uses, for a machine without a GPU."""

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _SaysCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU: read_back_later's GPU branch with its CUDA calls stood in for."""

    @property
    def is_cuda(self):
        return True


def test_read_back_later_pool_bookkeeping_without_a_gpu(monkeypatch):
    # The GPU branch's bookkeeping runs in CI too (its GPU test below runs on a lent GPU only): pinned memory, the
    # event and the stream stood in for. Buffers are handed back once read and used again, a read() keeps its own
    # values after its buffer went to a later read-back, and a 0-d tensor reads back as a number, as tolist() gives.
    from kldiv_inline import distill
    made = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        t = real_empty(*shape, **kw)
        made.append(t)
        return t

    monkeypatch.setattr(distill, "_READ_BACK", distill.threading.local())
    monkeypatch.setattr(distill.torch, "empty", empty)
    monkeypatch.setattr(distill.torch.cuda, "Event", _StandInEvent)
    monkeypatch.setattr(distill.torch.cuda, "current_stream", lambda device=None: None)
    a = torch.randint(-1000, 1000, (3,), dtype=torch.int32)
    b = torch.randint(-1000, 1000, (3,), dtype=torch.int32)
    want_a, want_b = a.tolist(), b.tolist()
    ra, rb = distill.read_back_later(a.as_subclass(_SaysCuda)), distill.read_back_later(b.as_subclass(_SaysCuda))
    assert len(made) == 2  # two in flight: two buffers
    assert ra() == want_a and rb() == want_b
    rc = distill.read_back_later((a * 2).as_subclass(_SaysCuda))
    assert len(made) == 2  # a buffer handed back is used again
    assert rc() == [2 * x for x in want_a]
    assert ra() == want_a and rb() == want_b  # a read() keeps its values
    # (a buffer handed back twice, or handed out while still in flight, would serve two of these)
    rs = [distill.read_back_later((a + i).as_subclass(_SaysCuda)) for i in range(3)]
    assert [r() for r in rs] == [[x + i for x in want_a] for i in range(3)]
    yes = distill.read_back_later(torch.tensor(True).as_subclass(_SaysCuda))
    no = distill.read_back_later(torch.tensor(False).as_subclass(_SaysCuda))
    assert yes() is True and no() is False and yes() is True


@pytest.mark.gpu
def test_read_back_later_reuses_buffers_without_mixing_values():
    # The top-k checks' flags go to pinned buffers that are handed out again once read: two read-backs in flight
    # hold two buffers, a value written after the read-back was queued is not seen, and a read() after its buffer
    # went to a later read-back returns its own values, not the later ones.
    from kldiv_inline.distill import read_back_later
    a = torch.randint(-1000, 1000, (3,), dtype=torch.int32, device="cuda")
    b = torch.randint(-1000, 1000, (3,), dtype=torch.int32, device="cuda")
    want_a, want_b = a.tolist(), b.tolist()
    ra, rb = read_back_later(a), read_back_later(b)
    a.add_(1)
    assert ra() == want_a and rb() == want_b
    rc = read_back_later(a * 2)
    assert rc() == [2 * (x + 1) for x in want_a]
    assert ra() == want_a and rb() == want_b
    # A 0-d tensor reads back as a number, as tolist() gives it (the split vocabulary's layout check reads a bool).
    yes, no = read_back_later(a.new_ones(()).bool()), read_back_later(a.new_zeros(()).bool())
    assert yes() is True and no() is False and yes() is True


def test_topk_mass_is_checked_and_rounding_normalised(device):
    s = logits((3, 12), torch.float32, device)
    idx, lp = topk_teacher((3,), 12, 4, device)
    # Not a distribution: an error naming the mass (a log-probability above 0; with k = V, mass far from 1).
    with pytest.raises(ValueError, match="must be those of a distribution: a token.s 4 probabilities sum to"):
        K.generalized_jsd(s, teacher_topk=(idx, torch.where(torch.arange(4, device=device) == 0, 0.5, lp)))
    # A masked token's top-k may hold filler (padding): it is exempt. A NaN row is not the one the error names.
    filler = lp.clone()
    filler[2] = 0.0
    labels = torch.tensor([1, 2, -100], device=device)
    assert torch.isfinite(K.generalized_jsd(s, teacher_topk=(idx, filler), labels=labels))
    with pytest.raises(ValueError, match="sum to 4, "):
        K.generalized_jsd(s, teacher_topk=(idx, filler))
    # Its indices are read (the kernels index the student's row with them): -1 or repeated filler is refused,
    # and the message says a masked token's count too.
    for bad, what in ((-1, "must lie in"), (0, "must be distinct")):
        pad = idx.clone()
        pad[2] = bad
        with pytest.raises(ValueError, match=f"{what}.*a masked token.s too"):
            K.generalized_jsd(s, teacher_topk=(pad, filler), labels=labels)
    nan_row = filler.clone()
    nan_row[0] = math.nan
    with pytest.raises(ValueError, match="sum to 4, "):
        K.generalized_jsd(s, teacher_topk=(idx, nan_row))
    full_idx = torch.arange(12, device=device).expand(3, 12)
    half = torch.log_softmax(s.double(), -1).float() + math.log(0.5)
    with pytest.raises(ValueError, match="sum to 0.5"):
        K.generalized_jsd(s, teacher_topk=(full_idx, half))
    # Rounding (a served bfloat16 top-k holding a little more than 1): the mass above 1 is divided out, so the
    # kernels' non-negative sums hold, and the loss and gradients are the normalised teacher's. (Its tail is then
    # 0: a reverse KL is inf wherever the student has mass outside the top-k, as the reference says too.)
    probs = torch.tensor([0.9, 0.0999], device=device)
    lp_b = probs.log().bfloat16().float().expand(3, 2)
    assert float(lp_b[0].exp().sum()) > 1
    idx_b = torch.tensor([2, 5], device=device).expand(3, 2)
    s.requires_grad_()
    other = torch.log_softmax(torch.randn(3, 12, dtype=torch.float64, device=device) * 2, -1).float()
    for k_idx, k_lp in ((idx_b, lp_b), (full_idx, other + 0.01)):
        full = k_idx.shape[-1] == 12
        norm = k_lp - k_lp.double().logsumexp(-1, keepdim=True).clamp_min(-math.inf if full else 0).float()
        for beta in (0.0, 0.5) + ((1.0,) if full else ()):
            out, (gs,) = run(s, None, teacher_topk=(k_idx, k_lp), beta=beta, reduction="none")
            ref, (rs,) = reference(s, None, torch.ones(3, dtype=torch.float64, device=device),
                                   teacher_topk=(k_idx, norm), beta=beta, reduction="none")
            assert torch.isfinite(out).all() and torch.isfinite(gs).all()
            assert_close(out, ref, 2e-5, "loss")
            assert_topk_grad_close(gs, rs, s, k_idx, norm, "grad")


def assert_topk_grad_close(g, ref, student, idx, teacher_lp, what):
    """A float32 gradient of a top-k teacher's rows against float64, entry by entry: beyond 2e-5 of the entry,
    each may be off by 16 float32 roundings of the probabilities it is formed from. A norm-relative bound does not
    hold here: where the JSD saturates, or the rows nearly agree, the gradient is a small difference of
    probabilities near 1 (norm ~1e-3 against probabilities of 0.9), whose float32 rounding alone came to 2e-5 to
    1.2e-3 of that norm on 8 of 5000 seeds (the CPU twin and an H200 alike). An entry's scale: (ps + pt) times
    (1 + |log ps - log pt|) (the reverse KL's and the JSD's gradients multiply the probabilities by log ratios), and
    on the tail (the entries outside the top-k) ps / ps_tail as well: there the gradient depends on the teacher's
    tail mass, 1 - sum(top-k), which float32 holds to a few 1e-8 only (nothing of it is left where the top-k holds
    all the mass, as after the normalisation here), through the ratio of it to the student's tail mass ps_tail.
    Over 5000 seeds (CPU) and 2500 (H200) no entry came beyond 3.7 such roundings. Over 300 seeds (CPU) the bound
    caught every gradient with two entries swapped or with the teacher's 4.8e-4 of excess mass left in (~1800
    roundings), and all but one with a row zeroed (a saturated row whose gradient is itself within the bound)."""
    ps = torch.softmax(student.detach().double(), -1)
    pt = torch.zeros_like(ps).scatter(-1, idx, teacher_lp.double().exp())
    tail = torch.ones_like(ps, dtype=torch.bool).scatter(-1, idx, False)
    ps_tail = (ps * tail).sum(-1, keepdim=True)
    assert_entries_close(g, ref, entry_scale(ps, pt) + torch.where(tail, ps / ps_tail, 0.0), what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_prepare_kernel_matches_the_traced_normalisation(device, dtype):
    # distill_topk_prepare (eager mode's normalisation and checks in one kernel) against the PyTorch operations
    # that the traced path runs: the same log-probabilities, and flags (range, repeat, mass) as the checks say.
    mod = K.load(device, extension="distill")
    slack = math.log1p(K.distill.TOPK_MASS_SLACK)
    vocab, k = 50, 6
    idx, lp = topk_teacher((8,), vocab, k, device)
    lp = lp.to(dtype)
    # (a row's top-6 mass is random, below 1: the rows with an excess are set relative to their own logsumexp)
    lp[1] += 0.005 - lp[1].logsumexp(0)  # a little more than 1 of mass: divided out
    lp[2] = -math.inf  # no mass: left as it is
    lp[3, 0] = math.nan  # NaN stays NaN, and is no mass offender
    lp[4] += 0.5 - lp[4].logsumexp(0)  # mass far above 1: flagged ...
    lp[5] += 0.5 - lp[5].logsumexp(0)  # ... unless the row is masked
    lp[6, 2] = math.inf
    labels = torch.tensor([0, 1, 2, 3, -100, -100, -100, 7], device=device)
    out, flags = mod.distill_topk_prepare(idx, lp, vocab, labels, -100, slack)
    torch.testing.assert_close(out, K.distill.traced_topk_normalisation(lp, False), equal_nan=True, rtol=1e-6,
                               atol=1e-6)
    assert flags.tolist() == [0, 0, 0]  # row 4's excess is masked too
    labels[4] = 4
    out, flags = mod.distill_topk_prepare(idx, lp, vocab, labels, -100, slack)
    assert flags.tolist() == [0, 0, 1]
    bad = idx.clone()
    bad[0, 1] = vocab
    bad[7, 3] = bad[7, 5]
    out, flags = mod.distill_topk_prepare(bad, lp, vocab, None, -100, slack)
    assert flags.tolist() == [1, 1, 1]  # (unmasked, rows 4 and 5 have too much mass)
    # k = V: the whole distribution normalised, and its mass checked both ways
    idx_all, lp_all = topk_teacher((3,), 9, 9, device)
    lp_all = lp_all.to(dtype)
    lp_all[1] -= 0.01
    lp_all[2] -= 0.5
    out, flags = mod.distill_topk_prepare(idx_all, lp_all, 9, None, -100, slack)
    torch.testing.assert_close(out, K.distill.traced_topk_normalisation(lp_all, True), rtol=1e-6, atol=1e-6)
    assert flags.tolist() == [0, 0, 1]
    with pytest.raises(RuntimeError, match="1 <= k <= vocabulary"):
        mod.distill_topk_prepare(idx, lp, 3, None, -100, slack)
    # Rows longer than the CUDA kernel compares pair by pair in shared memory (k > 256): sorted instead.
    idx_long, lp_long = topk_teacher((3,), 309, 300, device)
    lp_long = lp_long.to(dtype)
    assert mod.distill_topk_prepare(idx_long, lp_long, 309, None, -100, slack)[1].tolist() == [0, 0, 0]
    idx_long[2, 299] = idx_long[2, 7]
    assert mod.distill_topk_prepare(idx_long, lp_long, 309, None, -100, slack)[1].tolist() == [0, 1, 0]


def prepare_flags(mod, idx, lp, vocab, labels, slack, into):
    """distill_topk_prepare's normalised log-probabilities and its flags as a list: the flags in a tensor of its own
    (``into="tensor"``) or written into a host buffer handed to it, poisoned first (``"host"``: pinned on a GPU,
    where the kernel writes it through its mapped address, as the eager step has it do)."""
    if into == "tensor":
        out, flags = mod.distill_topk_prepare(idx, lp, vocab, labels, -100, slack)
        return out, flags.tolist()
    host = torch.full((3,), 7, dtype=torch.int32, pin_memory=idx.is_cuda)
    out, flags = mod.distill_topk_prepare(idx, lp, vocab, labels, -100, slack, host)
    assert flags.data_ptr() == host.data_ptr()
    if idx.is_cuda:
        torch.cuda.synchronize()
    return out, host.tolist()


# Row lengths at the edges of distill_topk_prepare's CUDA kernels: one warp a row (k <= 128; 1, 33 and 100 hold a
# partial last lane group), one block a row comparing pairs (129-256), sorted (beyond).
@pytest.mark.parametrize("into", ["tensor", "host"])
@pytest.mark.parametrize("k", [1, 33, 100, 128, 129, 256, 257])
def test_topk_prepare_flags_at_every_row_length(device, k, into):
    mod = K.load(device, extension="distill")
    slack = math.log1p(K.distill.TOPK_MASS_SLACK)
    vocab, n = 2 * k + 7, 9  # (9 rows: the warp kernel's last block holds one row of four)
    idx, lp = topk_teacher((n,), vocab, k, device)
    lp[3] += 0.01 - lp[3].logsumexp(0)  # a little more than 1 of mass: divided out
    labels = torch.randint(0, vocab, (n,), device=device)

    def flags(i, p, lab):
        return prepare_flags(mod, i, p, vocab, lab, slack, into)[1]

    out, got = prepare_flags(mod, idx, lp, vocab, labels, slack, into)
    torch.testing.assert_close(out, K.distill.traced_topk_normalisation(lp, False), rtol=1e-6, atol=1e-6)
    assert got == [0, 0, 0]
    for row in range(n):  # each flag from each row alone, the offending entries at a row's far ends
        bad = idx.clone()
        bad[row, k - 1] = vocab if row % 2 else -1
        assert flags(bad, lp, labels) == [1, 0, 0], row
        if k > 1:
            bad = idx.clone()
            bad[row, k - 1] = bad[row, 0]
            assert flags(bad, lp, labels) == [0, 1, 0], row
        heavy = lp.clone()
        heavy[row] += 0.5 - heavy[row].logsumexp(0)
        assert flags(idx, heavy, labels) == [0, 0, 1], row
        masked = labels.clone()
        masked[row] = -100
        assert flags(idx, heavy, masked) == [0, 0, 0], row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_scale_grad_in_place_at_any_length_and_alignment(device, dtype):
    # distill_scale_grad_, the backward's pass over the fused gradient when grad_output is not 1 (gradient
    # accumulation's loss / steps, a weighted sum of losses): each entry times its row's factor, rounded once to the
    # dtype, for rows of any length starting anywhere (strided rows: the CUDA kernel's unaligned head, its 16-byte
    # vectors, its tail), a row whose factor is 1 left as it is, and nothing beside the rows written.
    mod = K.load(device, extension="distill")
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    shapes = [(3, 1, 0, 1), (5, 7, 1, 9), (4, 33, 3, 40), (6, 2053, 5, 2061), (2, 20000, 0, 20000),
              (300, 300, 1, 303), (3, 70001, 3, 70011)]  # rows, length, the first row's offset, row pitch
    for n, v, off, pitch in shapes:
        for kind in ("one", "rows", "float64"):
            base = (torch.randn(off + n * pitch + 8, device=device) * 3).to(dtype)
            g = base[off:off + n * pitch].view(n, pitch)[:, :v]
            if kind == "rows":
                go = torch.randn(n, dtype=acc, device=device)
                go[::3] = 1.0
            else:
                go = torch.randn((), dtype=torch.float64 if kind == "float64" else acc, device=device)
            expect = base.clone()
            e = expect[off:off + n * pitch].view(n, pitch)[:, :v]
            e.copy_((e.to(acc) * go.to(acc).reshape(-1, 1)).to(dtype))
            mod.distill_scale_grad_(g, go)
            assert torch.equal(base, expect), (n, v, off, pitch, kind)
            one = base.clone()
            mod.distill_scale_grad_(g, torch.ones((), dtype=acc, device=device))
            assert torch.equal(base, one), (n, v, off, pitch, "factor 1")


def test_topk_prepare_flags_buffer_is_checked(device):
    # The buffer for the flags must be int32 [3] in host memory, pinned for a GPU's kernel to write it: anything
    # else is a clear error before a launch, never a write to memory the kernel cannot reach.
    mod = K.load(device, extension="distill")
    idx, lp = topk_teacher((4,), 10, 3, device)
    for wrong in (torch.zeros(3), torch.zeros(4, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)[::2]):
        with pytest.raises(RuntimeError, match="contiguous int32 \\[3\\] in host memory"):
            mod.distill_topk_prepare(idx, lp, 10, None, -100, 0.02, wrong)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="contiguous int32 \\[3\\] in host memory"):
            mod.distill_topk_prepare(idx, lp, 10, None, -100, 0.02, torch.zeros(3, dtype=torch.int32, device=device))
        with pytest.raises(RuntimeError, match="must be pinned host memory"):
            mod.distill_topk_prepare(idx, lp, 10, None, -100, 0.02, torch.zeros(3, dtype=torch.int32))
        # (and the failed query leaves no error behind for the next launch's check)
        out, flags = mod.distill_topk_prepare(idx, lp, 10, None, -100, 0.02)
        assert flags.tolist() == [0, 0, 0]


def test_topk_rows_must_be_prepared(device):
    # distill_forward takes a top-k teacher's prepared rows, [rows, k + 1] (the tail's mass last): the given
    # [rows, k] log-probabilities, or rows of another width, are refused with an error that says what it takes.
    s = logits((4, 37), torch.float32, device)
    idx, lp = topk_teacher((4,), 37, 5, device)
    mod = K.load(device, extension="distill")
    for bad in (lp, torch.cat([lp, lp[:, :2]], dim=1), prepared_topk(idx, lp, 37)[:3]):
        with pytest.raises(RuntimeError, match=r"\[rows, k \+ 1\] as distill_topk_prepare writes them"):
            mod.distill_forward(s, None, idx, bad.contiguous(), None, -100, 0.5, 1.0, 0, True, False)
    out = mod.distill_forward(s, None, idx, prepared_topk(idx, lp, 37), None, -100, 0.5, 1.0, 0, True, False)[0]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("vocab", [12, 20000])  # float32 x 20000: a cluster of blocks on CUDA, a slice each
def test_topk_bad_row_is_nan_in_the_kernel(device, vocab):
    # The kernels' own net under the Python check (which torch.compile and graph capture skip): a row with a
    # repeated token or one outside the vocabulary has a NaN loss and a NaN gradient, the other rows neither.
    s = logits((4, vocab), torch.float32, device)
    idx, lp = topk_teacher((4,), vocab, 4, device)
    idx[1, 3] = idx[1, 0]
    idx[2, 1] = vocab
    lp = prepared_topk(idx, lp, vocab)
    mod = K.load(device, extension="distill")
    for beta in (0.0, 0.5, 1.0):
        out = mod.distill_forward(s, None, idx, lp, None, -100, beta, 1.0, 0, False, False)[0]
        assert torch.isnan(out[1:3]).all() and torch.isfinite(out[[0, 3]]).all(), (beta, out)
        out, gs, _ = mod.distill_forward(s, None, idx, lp, None, -100, beta, 1.0, 0, True, False)
        assert torch.isnan(out[1:3]).all() and torch.isfinite(out[[0, 3]]).all(), (beta, out)
        assert torch.isnan(gs[1:3]).all() and torch.isfinite(gs[[0, 3]]).all(), beta


# --------------------------------------------------------------------------------------- 5. autograd
def test_gradcheck_float64(device):
    for beta in (0.0, 0.4, 1.0):
        s = logits((3, 7), torch.float64, device).requires_grad_()
        t = logits((3, 7), torch.float64, device).requires_grad_()
        lab = torch.tensor([0, -100, 2], device=device)
        torch.autograd.gradcheck(lambda a, b, beta=beta, lab=lab: K.generalized_jsd(
            a, b, beta=beta, temperature=1.5, labels=lab, reduction="none"), (s, t))
    s = logits((3, 9), torch.float64, device).requires_grad_()
    idx, lp = topk_teacher((3,), 9, 4, device)
    for beta in (0.0, 0.4, 1.0):
        torch.autograd.gradcheck(lambda a, beta=beta: K.generalized_jsd(a, teacher_topk=(idx, lp.double()),
                                                                        beta=beta, reduction="sum"), (s,))


# float16's range cannot hold the unscaled gradient: an entry ~p / tokens lies among its subnormals (or below them),
# and a GradScaler's grad_output multiplied in afterwards cannot bring the digits back (at 32 x 50000 the median
# entry was 3.6% off, 90k of 1.6M entries 0). float16's backward computes the gradient with grad_output folded in:
# each entry rounded at its final size (reduction none: at the smallest factor's, then multiplied up), so within a
# spacing or so (subnormal spacings allowed only as float16's own, not grad_output times them, as the bound for
# rescaled gradients allows).
@pytest.mark.parametrize("teacher", ["logits", "topk"])
@pytest.mark.parametrize("reduction", ["batchmean", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_float16_gradient_is_rounded_once_at_its_final_size(device, teacher, reduction, beta):
    n, vocab = 12, 20000
    s = logits((n, vocab), torch.float16, device).requires_grad_()
    t = logits((n, vocab), torch.float16, device).requires_grad_() if teacher == "logits" else None
    kw = dict(beta=beta, temperature=2.0, labels=labels_for((n,), device), reduction=reduction)
    if teacher == "topk":
        kw["teacher_topk"] = topk_teacher((n,), vocab, 50, device)
    loss = K.generalized_jsd(s, t, **kw)
    go = torch.full_like(loss, 65536.0)  # a GradScaler's scale
    if reduction == "none":  # rows of different factors, a negative and a zero among them
        go = go * (torch.rand_like(go) + 0.25)
        go[1], go[2] = -go[1], 0.0
    wrt = [x for x in (s, t) if x is not None]
    grads = torch.autograd.grad(loss, wrt, go)
    _, refs = reference(s, t, go, **kw)
    for g, r, who in zip(grads, refs, ("student", "teacher")):
        assert_grad_close(g, r, torch.float16, f"{who}'s gradient")
    # A second backward (retain_graph) computes the same.
    loss = K.generalized_jsd(s, t, **kw)
    first = torch.autograd.grad(loss, wrt, go, retain_graph=True)
    second = torch.autograd.grad(loss, wrt, go)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))


# reduction none's per-token factors go into the kernel's scale as the smallest nonzero one (but at least 1), the
# rows then multiplied by their share: at the largest's scale a row of a small factor and large entries (nearly
# one-hot rows that disagree) overflowed float16 where its gradient is finite; at a smallest below 1, rows of far
# larger factors were computed among the subnormals and multiplied up. Empty rows and a negative scalar take the
# same path.
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_float16_per_token_factors_far_apart_do_not_overflow(device, beta):
    vocab = 1000
    s = logits((3, vocab), torch.float64, device, scale=0.1)
    t = logits((3, vocab), torch.float64, device, scale=0.1)
    s[1:, 0] = t[1:, 1] = 20.0  # rows 1 and 2: nearly one-hot, on different tokens: entries of ~1
    s, t = s.half().requires_grad_(), t.half()
    go = torch.tensor([1e5, 1.0, 2.0], device=device)  # row 0's entries are small: 1e5 times them fits
    kw = dict(beta=beta, reduction="none")
    (g,) = torch.autograd.grad(K.generalized_jsd(s, t, **kw), s, go)
    _, (r,) = reference(s, t, go, **kw)
    assert r.abs().max() < 60000, "the case needs a finite float16 gradient"
    assert torch.isfinite(g).all(), "a row of a small factor overflowed"
    assert_grad_close(g, r, torch.float16, "gradient")
    wide = logits((3, vocab), torch.float16, device, scale=2.0).requires_grad_()
    go = torch.tensor([1e-4, 1.0, 0.5], device=device)  # per-token weights: row 0 nearly weightless
    (g,) = torch.autograd.grad(K.generalized_jsd(wide, t, **kw), wide, go)
    _, (r,) = reference(wide, t, go, **kw)
    assert_grad_close(g[1:], r[1:], torch.float16, "rows of factors far above the smallest")
    go = torch.tensor(-3.0, device=device)  # one value: into the kernel's scale, a negative one too
    (g,) = torch.autograd.grad(K.generalized_jsd(s, t, beta=beta), s, go)
    _, (r,) = reference(s, t, go, beta=beta)
    assert_grad_close(g, r, torch.float16, "grad_output -3")
    (g,) = torch.autograd.grad(K.generalized_jsd(s, t, beta=beta), s, torch.zeros((), device=device))
    assert (g == 0).all()
    empty = logits((0, vocab), torch.float16, device).requires_grad_()
    for reduction in ("none", "sum"):
        loss = K.generalized_jsd(empty, empty.detach() + 1, beta=beta, reduction=reduction)
        (g,) = torch.autograd.grad(loss, empty, torch.ones_like(loss))
        assert g.shape == (0, vocab)


def test_backward_twice_with_retain_graph(device):
    s = logits((4, 33), torch.float32, device).requires_grad_()
    t = logits((4, 33), torch.float32, device)
    loss = K.generalized_jsd(s, t, beta=0.5)
    (g1,) = torch.autograd.grad(loss, s, retain_graph=True)
    (g2,) = torch.autograd.grad(loss * 3, s)
    torch.testing.assert_close(g2, 3 * g1)


def test_double_backward_raises(device):
    s = logits((4, 33), torch.float32, device).requires_grad_()
    t = logits((4, 33), torch.float32, device)
    loss = K.generalized_jsd(s, t)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, s, create_graph=True)


def test_no_grad_inference_writes_no_gradient(device):
    s = logits((4, 33), torch.float32, device).requires_grad_()
    t = logits((4, 33), torch.float32, device)
    with torch.no_grad():
        loss = K.generalized_jsd(s, t)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss.double(), generalized_jsd_reference(s.detach(), t), rtol=2e-6, atol=0)


def test_module_form(device):
    s = logits((4, 33), torch.float32, device).requires_grad_()
    t = logits((4, 33), torch.float32, device)
    lab = torch.tensor([1, 2, -1, 3], device=device)
    crit = K.GeneralizedJSDLoss(beta=0.5, temperature=2.0, ignore_index=-1)
    torch.testing.assert_close(crit(s, t, lab), K.generalized_jsd(s, t, beta=0.5, temperature=2.0, labels=lab,
                                                                  ignore_index=-1))
    assert "beta=0.5" in repr(crit)
    with pytest.raises(ValueError, match="beta"):
        K.GeneralizedJSDLoss(beta=1.5)


# ------------------------------------------------------------------ loss_scale (gradient accumulation's 1 / n)
def random_loss_scale():
    """A factor for loss_scale: of either sign (a weighted difference of losses), never 1."""
    return (float(torch.rand(())) * 2 + 0.05) * (-1.0 if float(torch.rand(())) < 0.3 else 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("form", ["logits", "topk"])
def test_loss_scale_multiplies_loss_and_gradients(device, dtype, beta, reduction, form):
    # loss_scale c: the loss (each token's for none) and every gradient are c times float64's, with grad_output 1
    # (the forward wrote them scaled: backward has nothing to rescale).
    vocab = 301
    s = logits((3, 4, vocab), dtype, device, scale=2.0).requires_grad_()
    lab = labels_for((3, 4), device)
    c = random_loss_scale()
    kw = dict(beta=beta, temperature=1.5, labels=lab, reduction=reduction)
    if form == "logits":
        t = logits((3, 4, vocab), dtype, device, scale=2.0).requires_grad_()
    else:
        t, kw["teacher_topk"] = None, topk_teacher((3, 4), vocab, 7, device)
    out, grads = run(s, t, None, loss_scale=c, **kw)
    ref, ref_grads = reference(s, t, torch.full(out.shape, c, dtype=torch.float64, device=device), **kw)
    assert_close(out, ref * c, LOSS_TOL[dtype], "loss")
    assert len(grads) == len(ref_grads) == (2 if form == "logits" else 1)
    tol = 1e-4 if dtype == torch.float32 else GRAD_TOL[dtype] if dtype != torch.float64 else 1e-11
    for g, r, name in zip(grads, ref_grads, ("student grad", "teacher grad")):
        assert g.dtype == dtype
        assert_close(g, r, tol, name)
        assert (g[lab == -100] == 0).all()
    if reduction == "none":
        assert (out[lab == -100] == 0).all()


@pytest.mark.parametrize("form", ["logits", "topk"])
def test_loss_scale_equals_dividing_the_loss(device, form):
    # loss_scale = 1 / 4 against (loss / 4).backward(): the same loss and, up to bfloat16 rounding (the divided
    # loss's gradient is rounded twice: once as written, once rescaled), the same gradient.
    s = logits((6, 1000), torch.bfloat16, device).requires_grad_()
    lab = labels_for((6,), device)
    kw = dict(beta=0.5 if form == "logits" else 0.0, temperature=2.0, labels=lab)
    if form == "logits":
        kw["teacher_logits"] = logits((6, 1000), torch.bfloat16, device)
    else:
        kw["teacher_topk"] = topk_teacher((6,), 1000, 20, device)
    folded = K.generalized_jsd(s, loss_scale=0.25, **kw)
    (g_folded,) = torch.autograd.grad(folded, s)
    divided = K.generalized_jsd(s, **kw) / 4
    (g_divided,) = torch.autograd.grad(divided, s)
    torch.testing.assert_close(folded, divided, rtol=1e-6, atol=0)
    assert relative_error(g_folded, g_divided) <= 2**-8
    assert float(g_folded.abs().max()) > 0


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_scale_all_masked_and_zero(device, reduction):
    s = logits((4, 50), torch.float32, device).requires_grad_()
    t = logits((4, 50), torch.float32, device)
    masked = torch.full((4,), -100, device=device)
    out, (g,) = run(s, t, None, labels=masked, reduction=reduction, loss_scale=0.125)
    assert (out == 0).all() and (g == 0).all()
    out, (g,) = run(s, t, None, labels=labels_for((4,), device), reduction=reduction, loss_scale=0.0)
    assert (out == 0).all() and (g == 0).all()


def test_loss_scale_with_retain_graph_and_the_module(device):
    s = logits((4, 33), torch.float32, device).requires_grad_()
    t = logits((4, 33), torch.float32, device)
    loss = K.generalized_jsd(s, t, beta=0.5, loss_scale=0.5)
    (g1,) = torch.autograd.grad(loss, s, retain_graph=True)
    (g2,) = torch.autograd.grad(loss * 3, s)  # recomputed by the second backward, scaled alike
    torch.testing.assert_close(g2, 3 * g1)
    (g0,) = torch.autograd.grad(K.generalized_jsd(s, t, beta=0.5), s)
    torch.testing.assert_close(g1, 0.5 * g0)
    crit = K.GeneralizedJSDLoss(beta=0.5, loss_scale=0.5)
    torch.testing.assert_close(crit(s, t), loss)
    assert "loss_scale=0.5" in repr(crit) and "loss_scale" not in repr(K.GeneralizedJSDLoss())


@pytest.mark.parametrize("bad,error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                       (-float("inf"), ValueError), ("0.5", TypeError), (True, TypeError),
                                       (None, TypeError)])
def test_loss_scale_bad_values_raise(device, bad, error):
    s = logits((2, 10), torch.float32, device).requires_grad_()
    t = logits((2, 10), torch.float32, device)
    with pytest.raises(error, match="loss_scale"):
        K.generalized_jsd(s, t, loss_scale=bad)
    with pytest.raises(error, match="loss_scale"):
        K.GeneralizedJSDLoss(loss_scale=bad)


def test_loss_scale_refuses_a_tensor(device):
    s = logits((2, 10), torch.float32, device).requires_grad_()
    t = logits((2, 10), torch.float32, device)
    with pytest.raises(TypeError, match="multiply the loss"):
        K.generalized_jsd(s, t, loss_scale=torch.tensor(0.5))
    # A direct call of the module: a non-finite loss_scale, and one beside a given device scale, are refused.
    if device == "cpu":  # (an error raised in a CUDA extension's host code can crash the process on some set-ups)
        mod = K.load(device, extension="distill")
        args = (s.detach(), t, None, None, None, -100, 0.0, 1.0, 1, True, False, None)
        with pytest.raises(RuntimeError, match="finite"):
            mod.distill_forward(*args, None, float("nan"))
        with pytest.raises(RuntimeError, match="fold loss_scale"):
            mod.distill_forward(*args, torch.tensor(0.5, dtype=torch.float64), 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["forward KL", "JSD", "reverse KL", "topk"])
def test_loss_scale_long_rows_cuda(form):
    # The fast kernels (rows of 128256 bf16 logits): each takes the folded scale in its gradient pass.
    s = logits((8, 128256), torch.bfloat16, "cuda", scale=2.0).requires_grad_()
    lab = labels_for((8,), "cuda")
    beta = {"forward KL": 0.0, "JSD": 0.5, "reverse KL": 1.0, "topk": 0.0}[form]
    kw = dict(beta=beta, temperature=2.0, labels=lab)
    t = None
    if form == "topk":
        kw["teacher_topk"] = topk_teacher((8,), 128256, 100, "cuda")
    else:
        t = logits((8, 128256), torch.bfloat16, "cuda", scale=2.0)
    c = random_loss_scale()
    if form == "JSD":  # a negative factor: the 16-bit gradient pass then takes its guarded loop (no log2 of it)
        c = -abs(c)
    out, (g,) = run(s, t, None, loss_scale=c, **kw)
    ref, (r,) = reference(s, t, torch.tensor(c, dtype=torch.float64, device="cuda"), **kw)
    assert_close(out, ref * c, LOSS_TOL[torch.bfloat16], "loss")
    assert_grad_close(g, r, torch.bfloat16, "student grad")
    assert (g[lab == -100] == 0).all()
    plain, (g1,) = run(s, t, None, **kw)
    torch.testing.assert_close(out, plain * c, rtol=1e-6, atol=0)
    assert relative_error(g, g1 * c) <= 2**-8


def test_deterministic(device):
    s = logits((16, 1000), torch.bfloat16, device).requires_grad_()
    t = logits((16, 1000), torch.bfloat16, device)
    a, (ga,) = run(s, t, None, beta=0.5)
    b, (gb,) = run(s, t, None, beta=0.5)
    assert torch.equal(a, b) and torch.equal(ga, gb)


def test_meta_tensors_give_shapes():
    s = torch.empty(3, 4, 50, device="meta", requires_grad=True)
    t = torch.empty(3, 4, 50, device="meta")
    out = K.generalized_jsd(s, t, reduction="none")
    assert out.device.type == "meta" and out.shape == (3, 4) and out.dtype == torch.float32
    assert K.generalized_jsd(s.detach().half(), t.half()).shape == ()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("teacher", ["logits", "topk"])
def test_meta_tensors_give_gradients(dtype, teacher):
    # Shape-only tracing through autograd: the gradients' shapes and dtypes are the CPU twin's (backward once
    # asked the kernels' module for meta tensors and raised; the float16 route computes its gradient in backward).
    def grads(device):
        s = torch.randn(3, 4, 50, dtype=dtype).to(device).requires_grad_()
        t = torch.randn(3, 4, 50, dtype=dtype).to(device).requires_grad_()
        lp, idx = torch.log_softmax(torch.randn(3, 4, 50), -1).topk(5)
        labels = torch.tensor([[0, -100, 1, 2]] * 3).to(device)
        if teacher == "topk":
            loss = K.generalized_jsd(s, teacher_topk=(idx.to(device), lp.to(device)), beta=0.5, labels=labels)
        else:
            loss = K.generalized_jsd(s, t, beta=0.5, labels=labels, reduction="none").sum()
        (loss * 2).backward()
        return [g for g in (s.grad, t.grad) if g is not None]

    meta, cpu = grads("meta"), grads("cpu")
    assert len(meta) == len(cpu) == (1 if teacher == "topk" else 2)
    for m, c in zip(meta, cpu):
        assert m.device.type == "meta" and (m.shape, m.dtype) == (c.shape, c.dtype)


# ------------------------------------------------------------------------------------ 6. torch.library
def test_opcheck(device):
    s = logits((4, 37), torch.float32, device).requires_grad_()
    t = logits((4, 37), torch.float32, device).requires_grad_()
    lab = torch.tensor([1, -100, 2, 3], device=device)
    torch.library.opcheck(torch.ops.kldiv_inline.distill_forward.default,
                          (s, t, None, None, lab, -100, 0.5, 2.0, 2, 1.0, True, True))
    idx, lp = topk_teacher((4,), 37, 5, device)
    torch.library.opcheck(torch.ops.kldiv_inline.distill_forward.default,
                          (s, None, idx, prepared_topk(idx, lp, 37), None, -100, 0.0, 1.0, 0, 0.25, True, False))
    # float16's backward (the gradients with grad_output folded in): one value, and one per row
    s16, t16 = s.detach().half(), t.detach().half()
    go = torch.tensor(3.0, device=device)
    torch.library.opcheck(torch.ops.kldiv_inline.distill_grad.default,
                          (s16, t16, None, None, lab, -100, 0.5, 2.0, 2, 1.0, go, True, True))
    torch.library.opcheck(torch.ops.kldiv_inline.distill_grad.default,
                          (s16, None, idx, prepared_topk(idx, lp, 37), None, -100, 0.0, 1.0, 0, 0.25,
                           torch.rand(4, device=device) - 0.5, True, False))
    # torch.compile's op: the loss alone, its backward through distill_grad
    torch.library.opcheck(torch.ops.kldiv_inline.distill_loss.default,
                          (s, t, None, None, lab, -100, 0.5, 2.0, 2, 1.0, True, True))
    torch.library.opcheck(torch.ops.kldiv_inline.distill_loss.default,
                          (s, None, idx, prepared_topk(idx, lp, 37), None, -100, 0.0, 1.0, 0, 0.25, True, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
@pytest.mark.parametrize("case", ["contiguous", "sliced", "sliced_offset", "one_row", "vocab_one"])
def test_gradient_lies_like_the_student_rows(device, dtype, case):
    # distill_forward's new gradient takes the student rows' row stride and storage offset modulo a 16-byte chunk
    # (grad_like_rows): rows sliced out of a padded vocabulary get a gradient whose rows lie on the 16-byte grid as
    # theirs do, so the fast kernels need no copy (a contiguous gradient beside them took the general kernel, ~3-4 x
    # slower), and contiguous rows a contiguous gradient. The fake (torch.compile's view) must give the same strides:
    # checked here against the real call under FakeTensorMode. Values: those of the contiguous rows, per row.
    from torch._subclasses.fake_tensor import FakeTensorMode
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    n, v = (1, 37) if case == "one_row" else (5, 1) if case == "vocab_one" else (5, 37)
    width = v if case == "contiguous" else v + 2 * vec + 3
    big = logits((n + 1, width + 3), dtype, device)
    s = big[1:, 3 : 3 + v] if case == "sliced_offset" else big[:n, :v]
    if case == "contiguous":
        s = s.contiguous()
    t = logits((n, v), dtype, device)
    lab = torch.tensor([1, -100, 2, 3, 4][:n], device=device)
    op = torch.ops.kldiv_inline.distill_forward.default
    args = (None, None, lab, -100, 0.5, 2.0, 0, 1.0, True, False)
    poison_allocator(device)
    loss, gs, _ = op(s, t, *args)
    stride = v + (s.stride(0) - v) % vec if n > 1 else v
    assert gs.shape == s.shape and gs.stride() == (stride, 1), (gs.stride(), s.stride())
    assert gs.storage_offset() % vec == s.storage_offset() % vec
    if case == "contiguous":
        assert gs.is_contiguous()
    with FakeTensorMode() as fm:
        fake = op(fm.from_tensor(s), fm.from_tensor(t), None, None, fm.from_tensor(lab), *args[3:])
    assert fake[1].shape == gs.shape and fake[1].stride() == gs.stride(), (fake[1].stride(), gs.stride())
    loss_c, gs_c, _ = op(s.contiguous(), t, *args)
    assert_close(loss, loss_c, 1e-6, case)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gs.float(), gs_c.float(), rtol=tol, atol=tol * float(gs_c.float().abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("sliced, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float16)],
                         ids=["contiguous", "sliced", "float16"])
def test_torch_compile_fullgraph(device, sliced, dtype):
    # (sliced: student rows of 200 out of rows of 203, whose gradient is laid out like them, stride 203, in the
    # compiled graph as in eager; test_gradient_lies_like_the_student_rows checks the fake's strides themselves.
    # float16: backward computes the gradient with grad_output folded in, through a custom op of its own)
    s = (logits((8, 203), dtype, device)[:, :200] if sliced else logits((8, 200), dtype, device))
    s.requires_grad_()
    t = logits((8, 200), dtype, device)
    lab = labels_for((8,), device)

    def step(a, b, y):  # (with a loss_scale: the custom op's schema carries it)
        return K.generalized_jsd(a, b, beta=0.5, temperature=2.0, labels=y, loss_scale=0.75)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(s, t, lab)
    (g,) = torch.autograd.grad(loss * 2, s)
    ref, (rg,) = reference(s, t, torch.tensor(1.5, dtype=torch.float64, device=device), beta=0.5, temperature=2.0,
                           labels=lab)
    assert_close(loss, ref * 0.75, 2e-6, "loss")
    assert_grad_close(g, rg, dtype, "grad")


def test_torch_compile_fullgraph_of_one_entry_rows_with_a_wide_stride():
    # [N, 1] logits from a transposed [1, N]: the stride along the vocabulary is N. Eager calls take them as a view
    # (as_strided with storage_offset()), which Dynamo could not trace: fullgraph failed where V > 1 compiled.
    s = torch.randn(1, 6, dtype=torch.float64).t().requires_grad_()
    t = torch.randn(1, 6, dtype=torch.float64).t()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: K.generalized_jsd(a, b, beta=0.5), backend="aot_eager", fullgraph=True)
    loss = compiled(s, t)
    (g,) = torch.autograd.grad(loss, s)
    ref, (rg,) = reference(s, t, None, beta=0.5)  # (one entry: every distribution is 1 there, the loss 0)
    assert float(ref) == 0.0 and abs(float(loss)) < 1e-30, float(loss)  # (the double lanes' rounding: ~5e-34)
    assert g.shape == s.shape and float((g - rg).abs().max()) < 1e-30


def test_torch_compile_runs_the_kernel_once_a_pass_and_refuses_double_backward(monkeypatch):
    # The traced backward recomputed the gradient beside the one the forward wrote, and the partitioner moved that
    # recomputation (it reads no grad_out) into the forward: two full passes there, a written gradient unread, and
    # under create_graph=True a penalty on the gradient silently dropped. Now the forward computes the loss alone
    # and backward the gradient, grad_out folded in.
    from kldiv_inline import distill

    mod, seen = distill._module(torch.device("cpu")), []

    class Recording:
        def __getattr__(self, name):
            fn = getattr(mod, name)
            return lambda *a: seen.append((name, a[9:11] if name == "distill_forward" else ())) or fn(*a)

    monkeypatch.setitem(distill._MODULES, "cpu", Recording())
    s, t = logits((8, 300), torch.float32, "cpu").requires_grad_(), logits((8, 300), torch.float32, "cpu")
    lab = labels_for((8,), "cpu")

    def step(a, b, y):
        return K.generalized_jsd(a, b, beta=0.5, temperature=2.0, labels=y)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(s, t, lab)
    assert seen == [("distill_forward", (False, False))], seen
    (g,) = torch.autograd.grad(loss * 3, s)
    assert [n for n, _ in seen].count("distill_forward") == 2 and seen[-1] == ("distill_forward", (True, False))
    ref, (rg,) = reference(s, t, torch.tensor(3.0, dtype=torch.float64), beta=0.5, temperature=2.0, labels=lab)
    assert_close(loss, ref, 2e-6, "loss")
    assert_grad_close(g, rg, torch.float32, "grad", grad_out=3.0)
    loss = compiled(s, t, lab)
    (g,) = torch.autograd.grad(loss, s, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((g**2).sum() + s.sum(), s)


@pytest.mark.slow
def test_torch_compile_with_dynamic_shapes():
    # dynamic=True makes the Python floats symbolic: math.isfinite of loss_scale could not be traced.
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, y, ls: K.generalized_jsd(a, b, beta=0.3, labels=y, loss_scale=ls),
                             fullgraph=True, dynamic=True)
    for rows in (4, 7):
        s, t = logits((rows, 100), torch.float32, "cpu").requires_grad_(), logits((rows, 100), torch.float32, "cpu")
        lab = labels_for((rows,), "cpu")
        loss = compiled(s, t, lab, 0.5)
        (g,) = torch.autograd.grad(loss, s)
        ref, (rg,) = reference(s, t, torch.tensor(0.5, dtype=torch.float64), beta=0.3, labels=lab)
        assert_close(loss, ref * 0.5, 2e-6, f"loss {rows}")
        assert_grad_close(g, rg, torch.float32, f"grad {rows}", grad_out=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["student", "self_distillation"])
def test_cuda_graph_capture(teacher_grad):
    # (self_distillation: the teacher's gradient too, a second launch of the fast kernel with the rows exchanged)
    s = logits((32, 5000), torch.bfloat16, "cuda").requires_grad_()
    t = logits((32, 5000), torch.bfloat16, "cuda").requires_grad_(teacher_grad)
    wrt = [s, t] if teacher_grad else [s]
    lab = labels_for((32,), "cuda")
    for _ in range(2):  # warm up: build, attribute set-up
        K.generalized_jsd(s, t, labels=lab, beta=0.5).backward()
    s.grad = t.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        loss = K.generalized_jsd(s, t, labels=lab, beta=0.5)
        grads = torch.autograd.grad(loss, wrt)
    s.data.copy_(logits((32, 5000), torch.bfloat16, "cuda"))  # fresh inputs in the captured buffers
    t.data.copy_(logits((32, 5000), torch.bfloat16, "cuda"))
    g.replay()
    torch.cuda.synchronize()
    # The replay computes what an eager call does, bit for bit (the kernels are deterministic), and the loss is
    # float64's. (The gradient's accuracy is the accuracy tests'; compared by norm here, a sharp row's JSD gradient,
    # a small difference, once went past the bfloat16 bound on an H200.)
    eager = K.generalized_jsd(s, t, labels=lab, beta=0.5)
    eager_grads = torch.autograd.grad(eager, wrt)
    assert torch.equal(loss, eager) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))
    ref = generalized_jsd_reference(s.detach().double(), t.double(), labels=lab, beta=0.5)
    assert_close(loss, ref, 2e-6, "loss")


@pytest.mark.gpu
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["student", "self_distillation"])
def test_no_host_sync(teacher_grad):
    s = logits((16, 3000), torch.bfloat16, "cuda").requires_grad_()
    t = logits((16, 3000), torch.bfloat16, "cuda").requires_grad_(teacher_grad)
    lab = labels_for((16,), "cuda")
    K.generalized_jsd(s, t, labels=lab).backward()  # built and warmed up
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = K.generalized_jsd(s, t, labels=lab, beta=0.5)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_device_scale_multiplies_loss_and_gradients(device):
    # distill_forward's scale (the fused LM head passes batchmean's divisor, counted on the device): with reduction
    # sum, loss and gradients are the sum's times the scale; with any other reduction it is refused.
    s = logits((6, 700), torch.bfloat16, device)
    t = logits((6, 700), torch.bfloat16, device)
    lab = labels_for((6,), device)
    mod = K.load(device, extension="distill")
    for beta in (0.0, 0.5):
        plain = mod.distill_forward(s, t, None, None, lab, -100, beta, 1.5, 1, True, False)
        c = float(torch.rand(())) + 0.1
        scaled = mod.distill_forward(s, t, None, None, lab, -100, beta, 1.5, 1, True, False, None,
                                     torch.tensor(c, dtype=torch.float64, device=device))
        torch.testing.assert_close(scaled[0], plain[0] * c, rtol=1e-6, atol=0)
        # The kernel rounds g c to bfloat16 once, the expectation rounds g and then g c (one bfloat16 step apart at
        # most); and where ps - pt cancels, the two launches' float roundings (~2^-24 of the probabilities, the scale
        # taken in at another place) are a larger part of a tiny gradient: an absolute floor at 2^-20 of the largest
        # (an H200 saw two steps, 1.5e-11, at a gradient of 1.8e-9).
        g = plain[1].float()
        torch.testing.assert_close(scaled[1].float(), (g * c).bfloat16().float(), rtol=2**-7,
                                   atol=2**-20 * float(g.abs().max()) * c)
    if device == "cpu":  # an error raised in a CUDA extension's host code can crash the process on some set-ups
        with pytest.raises(RuntimeError, match="reduction sum only"):
            mod.distill_forward(s, t, None, None, lab, -100, 0.0, 1.5, 2, True, False, None,
                                torch.tensor(0.5, dtype=torch.float64, device=device))


@pytest.mark.gpu
def test_in_place_gradient_buffer():
    # The fused LM head writes d logits over the logits: the kernel reads a row before writing its gradient.
    s = logits((8, 128256), torch.bfloat16, "cuda")
    t = logits((8, 128256), torch.bfloat16, "cuda")
    mod = K.load("cuda", extension="distill")
    for beta in (0.0, 0.5, 1.0):
        expect = mod.distill_forward(s, t, None, None, None, -100, beta, 2.0, 1, True, False)
        buf = s.clone()
        got = mod.distill_forward(buf, t, None, None, None, -100, beta, 2.0, 1, True, False, buf)
        assert got[1].data_ptr() == buf.data_ptr()
        assert torch.equal(got[0], expect[0]) and torch.equal(buf, expect[1])
    # One row (on a 16-byte boundary whatever its length) of 50001 entries, so the last block's slice ends in a
    # partial chunk read from device memory, and a teacher that nearly agrees: no read of a row's logits, the
    # tail's included, may come after the gradient written over them (a second sum of the forward KL's terms did,
    # in kernels/NOTES.md's version 20).
    s = logits((1, 50001), torch.bfloat16, "cuda")
    t = (s.double() + 1e-2 * torch.randn(s.shape, dtype=torch.float64, device="cuda")).to(torch.bfloat16)
    for beta in (0.0, 1.0):
        expect = mod.distill_forward(s, t, None, None, None, -100, beta, 2.0, 0, True, False)
        buf = s.clone()
        got = mod.distill_forward(buf, t, None, None, None, -100, beta, 2.0, 0, True, False, buf)
        assert torch.equal(got[0], expect[0]) and torch.equal(buf, expect[1]), beta
        ref = generalized_jsd_reference(s.double(), t.double(), beta=beta, temperature=2.0, reduction="none")
        assert_close(got[0], ref, 1e-4, f"in place, beta={beta}")


# ------------------------------------------------------------------------------------------- 7. errors
def test_bad_input_raises_clearly(device):
    s = logits((4, 10), torch.float32, device)
    t = logits((4, 10), torch.float32, device)
    cases = [
        (dict(teacher_logits=t.to_sparse()), NotImplementedError, "sparse_coo tensor.*to_dense"),
        (dict(teacher_logits=t[:, :9]), ValueError, "same shape"),
        (dict(teacher_logits=t.double()), TypeError, "same dtype"),
        (dict(teacher_logits=None), ValueError, "exactly one"),
        (dict(teacher_logits=t, beta=1.5), ValueError, "beta"),
        (dict(teacher_logits=t, beta=-0.1), ValueError, "beta"),
        (dict(teacher_logits=t, temperature=0.0), ValueError, "temperature"),
        (dict(teacher_logits=t, temperature=float("inf")), ValueError, r"temperature must lie in \(0, inf\)"),
        (dict(teacher_logits=t, temperature=float("nan")), ValueError, r"temperature must lie in \(0, inf\)"),
        (dict(teacher_logits=t, reduction="mean"), ValueError, "reduction"),
        (dict(teacher_logits=t, reduction=["sum"]), ValueError, "reduction"),
        (dict(teacher_logits=t, labels=torch.zeros(3, dtype=torch.long, device=device)), ValueError, "leading"),
        (dict(teacher_logits=t, labels=torch.zeros(4, device=device)), TypeError, "integer"),
        (dict(teacher_logits=t, beta=True), TypeError, "real number"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            K.generalized_jsd(s, **kw)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        K.generalized_jsd(s.long(), t.long())
    with pytest.raises(ValueError, match="vocabulary"):
        K.generalized_jsd(s[:, :0], t[:, :0])
    with pytest.raises(TypeError, match="integer tensor, got torch.bool"):
        K.generalized_jsd(s, t, labels=torch.ones(4, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="int64"):
        K.generalized_jsd(s, t, ignore_index=2**70)
    # The module checks its settings where it is made.
    for kw, exc in ((dict(temperature=float("inf")), ValueError), (dict(ignore_index=1.5), TypeError),
                    (dict(beta=2.0), ValueError), (dict(reduction="mean"), ValueError)):
        with pytest.raises(exc):
            K.GeneralizedJSDLoss(**kw)


def test_function_transforms_and_forward_ad_raise(device):
    # vmap's batched tensors have no storage a kernel can read (the CPU twin used to abort the process), and
    # forward-mode AD's tangent would be dropped without a word: both are clear errors.
    from torch.autograd import forward_ad

    s = logits((2, 4, 20), torch.float32, device)
    t = logits((4, 20), torch.float32, device)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.vmap(lambda x: K.generalized_jsd(x, t))(s)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda x: K.generalized_jsd(x, t))(s[0])
    with pytest.raises(NotImplementedError, match="forward-mode"), forward_ad.dual_level():
        K.generalized_jsd(forward_ad.make_dual(s[0], torch.randn_like(s[0])), t)
    w = logits((20, 8), torch.float32, device)
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.vmap(lambda h: K.fused_linear_generalized_jsd(h, w, teacher_logits=t))(
            logits((2, 4, 8), torch.float32, device))


def test_one_entry_vocabulary_with_any_strides(device):
    s = logits((1, 5), torch.float32, device).t()  # [5, 1] with stride 5 along the vocabulary
    t = logits((5, 1), torch.float32, device)
    assert s.stride(-1) != 1
    out = K.generalized_jsd(s, t, reduction="none")  # one entry: both distributions are 1 there, the KL 0
    assert out.shape == (5,) and float(out.abs().max()) < 1e-12
    w = logits((1, 3), torch.float32, device)
    h = logits((5, 3), torch.float32, device)
    assert abs(float(K.fused_linear_generalized_jsd(h, w, teacher_logits=s))) < 1e-12


@pytest.mark.gpu
def test_mixed_devices_raise():
    s = logits((4, 10), torch.float32, "cuda")
    with pytest.raises(ValueError, match="one device"):
        K.generalized_jsd(s, s.cpu())


def test_empty_batch(device):
    s = logits((0, 10), torch.float32, device).requires_grad_()
    t = logits((0, 10), torch.float32, device)
    assert K.generalized_jsd(s, t).item() == 0
    assert K.generalized_jsd(s, t, reduction="sum").item() == 0
    assert K.generalized_jsd(s, t, reduction="none").shape == (0,)
    K.generalized_jsd(s, t).backward()
    assert s.grad.shape == (0, 10)
    # A vocabulary stride other than 1 on an empty [0, V] (contiguous() keeps an empty tensor's strides, and the
    # kernels refused them: "unit stride along the vocabulary"), with a top-k teacher too
    wide = logits((0, 20), torch.float32, device)[:, ::2].requires_grad_()
    for reduction in ("batchmean", "sum", "none"):
        assert K.generalized_jsd(wide, t[:, :10] + 0, reduction=reduction).numel() in (0, 1)
    K.generalized_jsd(wide, logits((0, 20), torch.float32, device)[:, ::2]).backward()
    assert wide.grad.shape == (0, 10)
    pair = (torch.zeros(0, 2, dtype=torch.int64, device=device), torch.full((0, 2), -1.0, device=device))
    assert K.generalized_jsd(wide, teacher_topk=pair).item() == 0


def test_no_fallback_to_pytorch_softmax(device, monkeypatch):
    # The kernels' path never calls PyTorch's softmax/kl_div.
    def boom(*a, **k):
        raise AssertionError("fell back to PyTorch")

    s = logits((4, 30), torch.float32, device).requires_grad_()
    t = logits((4, 30), torch.float32, device)
    expect = K.generalized_jsd(s.detach(), t, beta=0.5)
    for name in ("log_softmax", "softmax", "logsumexp"):
        monkeypatch.setattr(torch, name, boom)
        monkeypatch.setattr(torch.nn.functional, name, boom, raising=False)
    monkeypatch.setattr(torch.nn.functional, "kl_div", boom)
    loss = K.generalized_jsd(s, t, beta=0.5)
    loss.backward()
    assert torch.equal(loss.detach(), expect) and math.isfinite(float(loss))


def test_cpu_kernel_under_vmap_raises_instead_of_aborting():
    # Below the front end's check: the CPU twin called directly on vmap's storage-less tensors must raise (it
    # threw inside an OpenMP region, which aborts the process; hence a child process here).
    code = ("import torch, kldiv_inline as K\n"
            "mod = K.load('cpu', extension='distill')\n"
            "t = torch.randn(4, 20)\n"
            "f = lambda x: mod.distill_forward(x, t, None, None, None, -100, 0.0, 1.0, 0, False, False)[0]\n"
            "try:\n"
            "    torch.func.vmap(f)(torch.randn(2, 4, 20))\n"
            "except RuntimeError as e:\n"
            "    print('raised', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "raised" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_module_errors_reach_python_in_a_process_of_their_own():
    # tools/check_module_errors.py: the distill module's formatted and plain errors each raise a RuntimeError in a
    # child process (the CUDA module's too where a GPU is visible). Extensions built by a compiler that links no
    # shared libstdc++ died on the formatted ones (the loader now leaves such a compiler out).
    tool = Path(__file__).resolve().parent.parent / "tools" / "check_module_errors.py"
    proc = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(lines) >= 2 and all(": raised: distill" in ln for ln in lines), lines


def test_bench_accumulation_row_quarters_loss_and_gradient(monkeypatch):
    # The distillation suite's fwd+bwd/4 row (gradient accumulation): a quarter of fwd+bwd's loss and gradient (a
    # power of two, so exact in every dtype), each provider its own way: ours through loss_scale (folded into the
    # forward), the peers and the reference by dividing the loss before backward.
    from kldiv_inline import bench_distill as BD
    s, t, y, _, _ = BD.make_inputs(8, 64, "cpu")
    makers = [lambda p, name=name: BD.logits_providers(0.0, p, "cpu")[name] for name in (BD.OURS, "torch_eager")]
    for make in makers + [lambda p: BD.logits_reference(0.0, p)]:
        loss1, g1 = make("fwd+bwd")(*BD._fresh_student(s, t, y))
        loss4, g4 = make(BD.ACCUMULATED)(*BD._fresh_student(s, t, y))
        assert torch.equal(loss4, loss1 / BD.ACCUMULATION) and g1.abs().max() > 0
        assert torch.equal(g4, g1 / BD.ACCUMULATION)
    calls = []  # ours is given loss_scale (no division in backward): seen in its call
    real = BD.generalized_jsd
    monkeypatch.setattr(BD, "generalized_jsd", lambda *a, **kw: calls.append(kw.get("loss_scale")) or real(*a, **kw))
    BD.logits_providers(0.0, BD.ACCUMULATED, "cpu")[BD.OURS](*BD._fresh_student(s, t, y))
    assert calls == [1 / BD.ACCUMULATION]


# The TRL-style peer the suites time: the reference's loss, and a masked token's row left out whatever it holds
# (TRL selects the unmasked tokens; a mask multiplied in made NaN of a masked row's NaN or inf).
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_peer_matches_the_reference_and_leaves_masked_tokens_out(beta):
    from kldiv_inline import peers
    s, t = logits((6, 50), torch.float64, "cpu"), logits((6, 50), torch.float64, "cpu")
    lab = labels_for((6,), "cpu")
    for how in ("finite", "inf", "all -inf"):
        if how == "inf":
            s[0, 3] = math.inf  # (labels_for masks token 0)
        elif how == "all -inf":
            s[0] = -math.inf
        got = peers.trl_generalized_jsd(s, t, lab, beta=beta, temperature=2.0)
        ref = generalized_jsd_reference(s, t, beta=beta, temperature=2.0, labels=lab)
        assert torch.isfinite(got), how
        # 1e-6 of the loss beside float32's rounding of a log-probability (~log V: the peer works in float32, as
        # TRL upcasts to float): a loss of 0.09 (logits of spread 0.5) came out 1.05e-7 off, 1.2e-6 of itself
        bound = 1e-6 * abs(float(ref)) + torch.finfo(torch.float32).eps * math.log(s.shape[-1])
        assert abs(float(got) - float(ref)) <= bound, f"{how} beta={beta}: {float(got)} against {float(ref)}"


# The usual recipe runs the teacher under torch.inference_mode(): its logits (and labels made there) cannot be
# saved for backward ("Inference tensors cannot be saved"), which the op did with every input. Each dtype's path:
# the fused gradient rescaled (float32, bfloat16), recomputed with grad_output folded in (float16), a second
# backward (retain_graph); a top-k teacher's pair too. The same bits as with ordinary tensors of those values.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("form", ["logits", "topk"])
def test_a_teacher_and_labels_made_under_inference_mode(device, dtype, form):
    s = logits((6, 50), dtype, device).requires_grad_()
    with torch.inference_mode():
        t = logits((6, 50), dtype, device)
        lab = torch.randint(0, 50, (6,), device=device).masked_fill(torch.rand(6, device=device) < 0.3, -100)
        lp, idx = torch.log_softmax(t.float(), -1).topk(7, dim=-1)
    go = torch.rand(6, device=device) + 0.5
    found = []
    for made in ("inference", "ordinary"):
        tt, ll, ii, pp = (t, lab, idx, lp) if made == "inference" else (x.clone() for x in (t, lab, idx, lp))
        assert all(x.is_inference() == (made == "inference") for x in (tt, ll, ii, pp))
        teacher = dict(teacher_logits=tt) if form == "logits" else dict(teacher_topk=(ii, pp))
        out = K.generalized_jsd(s, **teacher, beta=0.5, labels=ll, reduction="none")
        (g1,) = torch.autograd.grad(out, s, go, retain_graph=True)
        (g2,) = torch.autograd.grad(out, s, go)
        found.append((out.detach(), g1, g2))
    for a, b in zip(*found):
        assert torch.equal(a, b)
    assert (found[0][1][lab == -100] == 0).all() and found[0][1].abs().max() > 0
    # Held outside save_for_backward, the teacher is let go by a backward that frees the graph, as a saved tensor
    # is: a loss kept after its step (logged) held its teacher's logits.
    with torch.inference_mode():
        t2 = logits((6, 50), dtype, device)
    alive = weakref.ref(t2)
    out = K.generalized_jsd(s, t2, beta=0.5)
    out.backward()
    del t2
    assert alive() is None and out is not None


# torch.autograd's batched backward (is_grads_batched=True, jacobian(vectorize=True)) hands backward a grad_output
# with no storage: the kernels called on it raised "Cannot access data pointer"; now the registered op takes it
# slice by slice and the fused gradient is scaled out of place. Against PyTorch's autograd of the float64 formula.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=_id)
def test_batched_backward(device, dtype):
    s = logits((4, 9), dtype, device).requires_grad_()
    t = logits((4, 9), dtype, device)
    gos = torch.tensor([1.0, 0.5, -2.0], dtype=torch.float32, device=device)
    (ours,) = torch.autograd.grad(K.generalized_jsd(s, t, beta=0.5), s, gos, is_grads_batched=True)
    sr = s.detach().double().requires_grad_()
    (truth,) = torch.autograd.grad(generalized_jsd_reference(sr, t.double(), beta=0.5), sr, gos.double(),
                                   is_grads_batched=True)
    assert ours.shape == (3, 4, 9) and relative_error(ours, truth) <= {torch.float64: 1e-12}.get(dtype, 4e-3)
    jac = torch.autograd.functional.jacobian(lambda a: K.generalized_jsd(a, t, beta=0.5, reduction="none"),
                                             s.detach(), vectorize=True)
    ref = torch.autograd.functional.jacobian(
        lambda a: generalized_jsd_reference(a, t.double(), beta=0.5, reduction="none"), sr.detach(), vectorize=True)
    assert jac.shape == (4, 4, 9) and relative_error(jac, ref) <= {torch.float64: 1e-12}.get(dtype, 4e-3)


# A negative view (x.conj().imag of a complex x) holds the negated values in memory and PyTorch's ops negate them
# when they read it; the kernels read the memory. Logits with a unit stride along the vocabulary went to the kernels
# as views (the loss of the negated logits), a top-k teacher's row was checked negated (a legal teacher refused as
# holding too little mass), and float64's grad_output reached the in-place rescale as it was (the gradient's sign
# flipped). (torch._neg_view makes the contiguous negative views that .imag, whose stride is 2, does not.)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=_id)
def test_negative_views_are_read_as_their_values(device, dtype):
    def negative(x):
        v = torch._neg_view(-x)
        assert v.is_neg() and torch.equal(v, x)
        return v

    s, t = logits((5, 40), dtype, device), logits((5, 40), dtype, device)
    lab = labels_for((5,), device)
    ns = negative(s).requires_grad_()
    loss = K.generalized_jsd(ns, negative(t), beta=0.5, temperature=1.5, labels=lab, reduction="none")
    go = random_grad_out(loss)
    (g,) = torch.autograd.grad(loss, ns, negative(go))
    ref, (rg,) = reference(s.requires_grad_(), t, go, beta=0.5, temperature=1.5, labels=lab, reduction="none")
    assert_close(loss, ref, 2e-6 if dtype != torch.float64 else 1e-12, "loss")
    assert_grad_close(g, rg, dtype, "grad", grad_out=2.5)
    idx, lp = topk_teacher((3,), 40, 1, device)
    sk = logits((3, 40), dtype, device)
    ours = K.generalized_jsd(sk, teacher_topk=(idx, negative(lp)), reduction="none")
    ref, _ = reference(sk, teacher_topk=(idx, lp), reduction="none")
    assert_close(ours, ref, 2e-6 if dtype != torch.float64 else 1e-6, "top-k loss")


# A teacher's logits (or labels) refilled in place for the next micro-batch before this one's backward: backward
# read the saved inputs to check their versions even where it only rescales the gradient the forward wrote, and
# raised PyTorch's in-place error where PyTorch's own loss (which keeps no teacher) runs. Now the inputs are read
# only by a backward that computes again: float16's, and a second one, refuse a changed input as before.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=_id)
def test_a_teacher_refilled_before_backward(device, dtype):
    s = logits((6, 50), dtype, device).requires_grad_()
    t, lab = logits((6, 50), dtype, device), labels_for((6,), device)
    ref, (rg,) = reference(s, t, beta=0.5, labels=lab)
    loss = K.generalized_jsd(s, t, beta=0.5, labels=lab)
    with torch.no_grad():
        t.copy_(logits((6, 50), dtype, device))  # the next micro-batch's teacher, in the same buffer
        lab.copy_(labels_for((6,), device))
    if dtype == torch.float16:  # (its backward computes the gradient from the inputs: a changed one is refused)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, s)
        return
    (g,) = torch.autograd.grad(loss, s, retain_graph=True)
    assert_close(loss, ref, 2e-6, "loss")
    assert_grad_close(g, rg, dtype, "grad")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # a second one computes again
        torch.autograd.grad(loss, s)
