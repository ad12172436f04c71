"""Tests of kldiv_inline.fused_linear_generalized_jsd (kldiv_inline/fused_linear.py): the LM head fused with the
distillation divergence, chunk by chunk of tokens.

The reference materialises the logits in float64 (hidden.double() @ weight.double().T + bias) and takes
kldiv_inline.reference.generalized_jsd_reference of them; its autograd gives the gradients w.r.t. hidden, weight
and bias. Inputs are fresh random tensors each run (conftest reseeds; the seed is printed), the calls run with
uninitialised memory poisoned (harness.poisoned), and every gradient is compared per element (relative error of
the whole tensor) as well as the loss.
"""
from __future__ import annotations

import pytest
import torch

import kldiv_inline as K
from kldiv_inline import fused_linear
from kldiv_inline.harness import poisoned
from kldiv_inline.reference import generalized_jsd_reference, relative_error

BETAS = [0.0, 0.5, 1.0]
TEACHERS = ["hidden", "logits", "topk"]
# float32 and float64 inputs: the logits and the products are exact to the dtype's rounding, so the loss and the
# gradients keep its accuracy (the loss is accumulated in float32 lanes, the gradients rounded a few times).
LOSS_TOL = {torch.float64: 1e-12, torch.float32: 2e-6}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.fixture(autouse=True)
def _print_seed(_fresh_seed):
    print(f"torch.manual_seed({_fresh_seed})")


def _id(d):
    return str(d).removeprefix("torch.")


# ------------------------------------------------------------------------------------------- helpers
def head(lead, hidden_size, vocab, dtype, device, bias=True, scale=None):
    """Hidden states [*lead, H] and an LM head (weight [V, H], bias [V] or None) whose logits have a random
    spread (softmaxes from flat to sharp)."""
    scale = float(torch.rand(())) * 3 + 0.5 if scale is None else scale
    h = torch.randn(*lead, hidden_size, dtype=torch.float64)
    w = torch.randn(vocab, hidden_size, dtype=torch.float64) * scale / hidden_size**0.5
    b = torch.randn(vocab, dtype=torch.float64) * 0.5 if bias else None
    return tuple(x.to(device=device, dtype=dtype) if x is not None else None for x in (h, w, b))


def topk_teacher(lead, vocab, k, device):
    lp_all = torch.log_softmax(torch.randn(*lead, vocab, dtype=torch.float64) * 2.5, dim=-1)
    lp, idx = lp_all.topk(k, dim=-1)
    perm = torch.argsort(torch.rand(*lead, k), dim=-1)  # any order, as a server may return them
    return idx.gather(-1, perm).to(device), lp.gather(-1, perm).float().to(device)


def teacher(form, lead, vocab, dtype, device, bias=True):
    """(keyword arguments of the fused call, the reference's teacher as logits or top-k)."""
    if form == "hidden":
        th, tw, tb = head(lead, 12, vocab, dtype, device, bias)  # a teacher with another hidden size
        kw = dict(teacher_hidden=th, teacher_weight=tw, teacher_bias=tb)
        logits = th.double() @ tw.double().T + (tb.double() if tb is not None else 0)
        return kw, dict(teacher_logits=logits)
    if form == "logits":
        t = (torch.randn(*lead, vocab, dtype=torch.float64) * 2).to(device=device, dtype=dtype)
        return dict(teacher_logits=t), dict(teacher_logits=t.double())
    idx, lp = topk_teacher(lead, vocab, 5, device)
    return dict(teacher_topk=(idx, lp)), dict(teacher_topk=(idx, lp.double()))


def labels_for(lead, device, frac=0.25, ignore_index=-100):
    lab = torch.randint(0, 1000, lead, device=device)
    mask = torch.rand(lead, device=device) < frac
    mask.view(-1)[0] = True  # at least one masked, one kept
    mask.view(-1)[-1] = False
    return lab.masked_fill(mask, ignore_index)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]


def run(h, w, b, teacher_kw, grad_out=1.0, **kw):
    """The fused loss and its gradients w.r.t. whichever of h, w, b require grad (poisoned memory)."""
    with poisoned(h.device.type):
        loss = K.fused_linear_generalized_jsd(h, w, student_bias=b, **teacher_kw, **kw)
        wrt = [x for x in (h, w, b) if x is not None and x.requires_grad]
        grads = torch.autograd.grad(loss * grad_out, wrt) if wrt else []
    return loss, grads


def reference(h, w, b, teacher_ref, grad_out=1.0, dtype=torch.float64, **kw):
    """The loss of materialised logits (in ``dtype``, float64 by default) and its gradients w.r.t. the inputs
    that require grad."""
    hr, wr, br = [x.detach().to(dtype).requires_grad_(x.requires_grad) if x is not None else None for x in (h, w, b)]
    logits = hr @ wr.T + (br if br is not None else 0)
    t = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in teacher_ref.items()}
    loss = generalized_jsd_reference(logits, **t, **kw)
    wrt = [x for x in (hr, wr, br) if x is not None and x.requires_grad]
    grads = torch.autograd.grad(loss * grad_out, wrt) if wrt else []
    return loss, grads


def assert_close(out, ref, tol, what):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    err = relative_error(out.detach(), ref.detach())
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


# --------------------------------------------------------------------------------- 1. values and gradients
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("form", TEACHERS)
def test_matches_float64(device, dtype, beta, form):
    lead, vocab = (3, 5), 37
    h, w, b = leaves(*head(lead, 16, vocab, dtype, device))
    t_kw, t_ref = teacher(form, lead, vocab, dtype, device)
    kw = dict(beta=beta, temperature=float(torch.rand(())) * 2 + 0.5, labels=labels_for(lead, device))
    go = float(torch.rand(())) + 0.5
    loss, grads = run(h, w, b, t_kw, go, chunk_size=7, **kw)  # 15 tokens: chunks of 7, 7 and 1
    ref, rgrads = reference(h, w, b, t_ref, go, **kw)
    assert loss.shape == () and loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(loss, ref, LOSS_TOL[dtype], "loss")
    for g, r, x, name in zip(grads, rgrads, (h, w, b), ("hidden", "weight", "bias")):
        assert g.dtype == dtype and g.shape == x.shape
        assert_close(g, r, GRAD_TOL[dtype], f"grad {name}")


@pytest.mark.parametrize("chunk", [1, 7, 15, 64, None])
@pytest.mark.parametrize("bias", [True, False])
def test_chunk_sizes(device, chunk, bias):
    # One token per chunk, an odd size leaving a remainder, exactly the tokens, more than the tokens, the default.
    lead, vocab = (15,), 50
    h, w, b = leaves(*head(lead, 24, vocab, torch.float64, device, bias))
    t_kw, t_ref = teacher("hidden", lead, vocab, torch.float64, device, bias)
    kw = dict(beta=0.5, temperature=1.3, labels=labels_for(lead, device))
    loss, grads = run(h, w, b, t_kw, chunk_size=chunk, **kw)
    ref, rgrads = reference(h, w, b, t_ref, **kw)
    assert_close(loss, ref, 1e-12, "loss")
    assert len(grads) == (3 if bias else 2)
    for g, r in zip(grads, rgrads):
        assert_close(g, r, 1e-12, "grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("form", TEACHERS)
def test_16bit_against_materialised_references(device, dtype, beta, form):
    lead, vocab = (40,), 1000
    h, w, b = leaves(*head(lead, 64, vocab, dtype, device))
    t_kw, t_ref = teacher(form, lead, vocab, dtype, device)
    kw = dict(beta=beta, temperature=float(torch.rand(())) * 2 + 0.5, labels=labels_for(lead, device, 0.2))
    loss, grads = run(h, w, b, t_kw, chunk_size=6, **kw)
    # The loss: ours makes the logits in the inputs' dtype (one rounding each), as PyTorch's addmm does, 6 tokens
    # at a time. Of those very logits the float64 divergence is ours up to float32 accumulation. (They are made
    # here 6 tokens at a time too: cuBLAS picks its kernel, so its order of accumulation and the last bit of a
    # 16-bit logit, by the number of rows.)
    def addmm_chunks(bias, x, weight):
        rows = [x[r0:r0 + 6] for r0 in range(0, x.shape[0], 6)]
        return torch.cat([fused_linear._linear(r, weight, bias, r.new_empty(r.shape[0], weight.shape[0]))
                          for r in rows])

    with torch.no_grad():
        logits = addmm_chunks(b, h, w)
        t_mat = {k: v for k, v in t_kw.items() if k == "teacher_topk" or k == "teacher_logits"}
        if form == "hidden":
            t_mat = dict(teacher_logits=addmm_chunks(t_kw["teacher_bias"], t_kw["teacher_hidden"],
                                                     t_kw["teacher_weight"]))
        same_logits = generalized_jsd_reference(logits, **{k: (v.double() if isinstance(v, torch.Tensor) else
                                                              (v[0], v[1].double())) for k, v in t_mat.items()}, **kw)
    assert_close(loss, same_logits, 2e-5, "loss (float64 of the same rounded logits)")
    # Against the float64 loss of unrounded logits, the rounding of each logit (at most 2^-9 of it in bf16, 2^-12
    # in fp16) moves the loss by at most sum |d loss / d logit| |logit| 2^-9 to first order: that, doubled, is
    # the tolerance (the reference's own gradients w.r.t. both logits give it).
    s64 = (h.detach().double() @ w.detach().double().T + b.detach().double()).requires_grad_()
    t64 = {k: (v.detach().clone().requires_grad_() if k == "teacher_logits" else v) for k, v in t_ref.items()}
    ref = generalized_jsd_reference(s64, **t64, **kw)
    logit_grads = torch.autograd.grad(ref, [s64] + ([t64["teacher_logits"]] if "teacher_logits" in t64 else []))
    unit = 2.0**-9 if dtype == torch.bfloat16 else 2.0**-12
    moved = sum(float((g.abs() * x.detach().abs()).sum()) for g, x in
                zip(logit_grads, [s64] + ([t64["teacher_logits"]] if "teacher_logits" in t64 else [])))
    diff = abs(float(loss.detach()) - float(ref.detach()))
    assert diff <= 2 * unit * moved + 1e-7, (diff, moved)
    # The gradients: against a float32 reference materialised from the same 16-bit tensors. Ours round the logits,
    # d logits and the products to the 16-bit dtype, as PyTorch's own 16-bit path (matmul, generalized_jsd,
    # autograd) does in other places: ours must be as close to float32 as that path, within a factor of 2.
    _, r32 = reference(h, w, b, t_ref, dtype=torch.float32, **kw)
    hm, wm, bm = leaves(h, w, b)
    t_logits = t_mat.get("teacher_logits")
    mat = K.generalized_jsd(torch.addmm(bm, hm, wm.T), t_logits, teacher_topk=t_mat.get("teacher_topk"), **kw)
    rm = torch.autograd.grad(mat, [hm, wm, bm])
    for g, r, m, name in zip(grads, r32, rm, ("hidden", "weight", "bias")):
        assert g.dtype == dtype
        err, err_torch = relative_error(g, r), relative_error(m, r)
        assert err <= 2 * err_torch + 1e-3, f"grad {name}: {err:.2e} from float32, PyTorch's path {err_torch:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_equals_generalized_jsd_on_materialised_logits(device, dtype):
    lead, vocab = (2, 9), 300
    h, w, b = leaves(*head(lead, 32, vocab, dtype, device))
    th, tw, tb = head(lead, 20, vocab, dtype, device)
    kw = dict(beta=0.5, temperature=2.0, labels=labels_for(lead, device))
    loss, grads = run(h, w, b, dict(teacher_hidden=th, teacher_weight=tw, teacher_bias=tb), chunk_size=5, **kw)
    hm, wm, bm = leaves(h, w, b)
    mat = K.generalized_jsd(torch.addmm(bm, hm.reshape(-1, 32), wm.T).reshape(*lead, vocab),
                            torch.addmm(tb, th.reshape(-1, 20), tw.T).reshape(*lead, vocab), **kw)
    assert_close(loss, mat, 2e-6, "loss")
    if dtype == torch.float32:
        for g, m in zip(grads, torch.autograd.grad(mat, [hm, wm, bm])):
            assert_close(g, m, 2e-5, "grad")


# ------------------------------------------------------------------------------------------ 2. masks
@pytest.mark.parametrize("skip_masked", [False, True])
@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
@pytest.mark.parametrize("form", TEACHERS)
def test_all_masked_is_zero(device, reduction, form, skip_masked):
    lead, vocab = (6,), 30
    h, w, b = leaves(*head(lead, 8, vocab, torch.float32, device))
    t_kw, _ = teacher(form, lead, vocab, torch.float32, device)
    lab = torch.full(lead, -7, device=device)
    loss, grads = run(h, w, b, t_kw, labels=lab, ignore_index=-7, reduction=reduction, beta=0.5, chunk_size=4,
                      skip_masked=skip_masked)
    assert torch.equal(loss, torch.zeros_like(loss))
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g))


def test_batchmean_divides_by_unmasked_tokens_of_all_chunks(device):
    lead, vocab = (10,), 40
    h, w, b = leaves(*head(lead, 8, vocab, torch.float64, device))
    t_kw, _ = teacher("logits", lead, vocab, torch.float64, device)
    lab = torch.tensor([1, -100, 2, -100, -100, 3, 4, -100, 5, 6], device=device)
    total, gs = run(h, w, b, t_kw, labels=lab, reduction="sum", chunk_size=3)
    mean, gm = run(h, w, b, t_kw, labels=lab, reduction="batchmean", chunk_size=3)
    torch.testing.assert_close(mean, total / 6, rtol=1e-14, atol=0)
    for a, c in zip(gm, gs):
        torch.testing.assert_close(a, c / 6, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_a_token_without_a_distribution_makes_the_loss_nan(device, dtype):
    # One token whose student and teacher hidden states are both NaN (its two rows of logits NaN): the loss is NaN
    # for every beta, and so is every gradient it reaches, never a finite number. (The JSD's summand once dropped
    # such a token: a finite loss that hid it, beside NaN weight gradients.)
    lead, vocab = (9,), 300
    h, w, b = head(lead, 8, vocab, dtype, device)
    th, tw, tb = head(lead, 12, vocab, dtype, device)
    h[4], th[4] = float("nan"), float("nan")
    for beta in BETAS:
        for reduction in ("batchmean", "sum"):
            hl, wl, bl = leaves(h, w, b)
            loss, (gh, gw, gb) = run(hl, wl, bl, dict(teacher_hidden=th, teacher_weight=tw, teacher_bias=tb),
                                     beta=beta, reduction=reduction, chunk_size=4)
            assert torch.isnan(loss), (beta, reduction, loss)
            assert torch.isnan(gh[4]).all() and torch.isfinite(gh[torch.arange(9) != 4]).all(), beta
            assert torch.isnan(gw).any() and torch.isnan(gb).any(), beta


def test_no_labels_means_every_token(device):
    lead, vocab = (2, 3), 20
    h, w, b = leaves(*head(lead, 8, vocab, torch.float64, device))
    t_kw, t_ref = teacher("topk", lead, vocab, torch.float64, device)
    loss, grads = run(h, w, b, t_kw, beta=1.0, chunk_size=4)
    ref, rgrads = reference(h, w, b, t_ref, beta=1.0)
    assert_close(loss, ref, 1e-12, "loss")
    for g, r in zip(grads, rgrads):
        assert_close(g, r, 1e-12, "grad")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("form", TEACHERS)
@pytest.mark.parametrize("chunk", [1, 4, None])
def test_skip_masked_multiplies_only_unmasked_tokens(device, dtype, form, chunk, monkeypatch):
    # The same loss and gradients as without skip_masked (masked tokens' grad hidden exactly 0), while the chunks'
    # products see only the unmasked tokens' rows: all of them after the first chunk, whose products are queued
    # before the count of unmasked tokens is known (a whole chunk of tokens, the unmasked first).
    lead, vocab = (3, 7), 45
    h, w, b = leaves(*head(lead, 16, vocab, dtype, device))
    t_kw, t_ref = teacher(form, lead, vocab, dtype, device)
    lab = labels_for(lead, device, frac=0.4)
    kw = dict(beta=0.5, temperature=1.7, labels=lab, chunk_size=chunk)
    multiplied = []
    linear = fused_linear._linear
    monkeypatch.setattr(fused_linear, "_linear", lambda x, *a: multiplied.append(x.shape[0]) or linear(x, *a))
    loss, grads = run(h, w, b, t_kw, skip_masked=True, **kw)
    kept, first = int((lab != -100).sum()), min(lab.numel(), chunk or lab.numel())
    assert sum(multiplied) == max(kept, first) * (2 if form == "hidden" else 1), (multiplied, kept)
    multiplied.clear()
    full, fgrads = run(h, w, b, t_kw, **kw)
    assert sum(multiplied) == lab.numel() * (2 if form == "hidden" else 1)
    assert torch.equal(grads[0].reshape(-1, 16)[(lab == -100).view(-1)], torch.zeros(lab.numel() - kept, 16,
                                                                                     dtype=dtype, device=device))
    if dtype in (torch.float64, torch.float32):
        ref, rgrads = reference(h, w, b, t_ref, labels=lab, beta=0.5, temperature=1.7)
        assert_close(loss, ref, LOSS_TOL[dtype], "loss")
        for g, r in zip(grads, rgrads):
            assert_close(g, r, GRAD_TOL[dtype], "grad")
    else:  # 16-bit: each logit rounds alike either way, but grad weight is rounded once per chunk, and the chunks
        # group other tokens (~4e-3 bf16, ~6e-4 fp16 seen over 20 seeds at chunks of 4): 8 units of the dtype
        assert_close(loss, full, 1e-6, "loss")
        for g, f in zip(grads, fgrads):
            assert_close(g, f, 8 * (2.0**-9 if dtype == torch.bfloat16 else 2.0**-12), "grad")


@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
def test_skip_masked_edges(device, reduction):
    lead, vocab = (6,), 30
    h, w, b = leaves(*head(lead, 8, vocab, torch.float64, device))
    t_kw, t_ref = teacher("hidden", lead, vocab, torch.float64, device)
    # No labels: every token, as without skip_masked; no token masked: the same. (Every token masked:
    # test_all_masked_is_zero.)
    for lab in (None, torch.arange(6, device=device)):
        loss, grads = run(h, w, b, t_kw, labels=lab, reduction=reduction, skip_masked=True, chunk_size=4)
        ref, rgrads = reference(h, w, b, t_ref, labels=lab, reduction=reduction)
        assert_close(loss, ref, 1e-12, "loss")
        for g, r in zip(grads, rgrads):
            assert_close(g, r, 1e-12, "grad")
    # Forward only (no gradient wanted), and the module form.
    lab = labels_for(lead, device, frac=0.5)
    with torch.no_grad():
        inference = K.fused_linear_generalized_jsd(h, w, student_bias=b, **t_kw, labels=lab, reduction=reduction,
                                                   skip_masked=True, chunk_size=2)
    module = K.FusedLinearGeneralizedJSDLoss(reduction=reduction, chunk_size=2, skip_masked=True)
    assert "skip_masked=True" in repr(module)
    ref, _ = reference(h, w, b, t_ref, labels=lab, reduction=reduction)
    assert_close(inference, ref, 1e-12, "loss (no grad)")
    assert_close(module(h, w, student_bias=b, **t_kw, labels=lab), ref, 1e-12, "loss (module)")
    with pytest.raises(TypeError, match="skip_masked"):
        K.fused_linear_generalized_jsd(h, w, **t_kw, labels=lab, skip_masked=1)


# --------------------------------------------------------------------------------------- 3. autograd
def test_grad_output_and_retain_graph(device):
    lead, vocab = (9,), 33
    h, w, b = leaves(*head(lead, 8, vocab, torch.float32, device))
    t_kw, _ = teacher("hidden", lead, vocab, torch.float32, device)
    loss = K.fused_linear_generalized_jsd(h, w, student_bias=b, beta=0.5, chunk_size=4, **t_kw)
    g1 = torch.autograd.grad(loss, [h, w, b], retain_graph=True)
    g2 = torch.autograd.grad(loss * -2.5, [h, w, b])  # the second backward recomputes
    for a, c in zip(g1, g2):
        torch.testing.assert_close(c, -2.5 * a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
@pytest.mark.parametrize("form", TEACHERS)
def test_loss_scale_multiplies_loss_and_gradients(device, dtype, reduction, form):
    # loss_scale c (gradient accumulation's 1 / n, folded into the kernels' scale): the loss and every gradient c
    # times float64's, with grad_output 1.
    lead, vocab = (3, 5), 37
    h, w, b = leaves(*head(lead, 16, vocab, dtype, device))
    t_kw, t_ref = teacher(form, lead, vocab, dtype, device)
    kw = dict(beta=0.5, temperature=1.5, labels=labels_for(lead, device), reduction=reduction)
    c = (float(torch.rand(())) + 0.1) * (-1.0 if float(torch.rand(())) < 0.3 else 1.0)
    loss, grads = run(h, w, b, t_kw, chunk_size=7, loss_scale=c, **kw)
    ref, rgrads = reference(h, w, b, t_ref, c, **kw)
    assert_close(loss, ref * c, LOSS_TOL[dtype], "loss")
    assert len(grads) == 3
    for g, r, name in zip(grads, rgrads, ("hidden", "weight", "bias")):
        assert_close(g, r, GRAD_TOL[dtype], f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
def test_loss_scale_16bit_equals_scaling_the_loss(device, dtype, reduction):
    # 16-bit: float16 applies the scale at the end (its range), bfloat16 in the kernels; against grad_output c,
    # the same up to 16-bit rounding.
    lead, vocab = (20,), 300
    h, w, b = leaves(*head(lead, 32, vocab, dtype, device))
    t_kw, _ = teacher("logits", lead, vocab, dtype, device)
    kw = dict(beta=0.0, temperature=2.0, labels=labels_for(lead, device), reduction=reduction, chunk_size=6)
    loss, grads = run(h, w, b, t_kw, loss_scale=0.125, **kw)
    plain, pgrads = run(h, w, b, t_kw, 0.125, **kw)
    torch.testing.assert_close(loss, plain * 0.125, rtol=1e-6, atol=0)
    for g, p, name in zip(grads, pgrads, ("hidden", "weight", "bias")):
        assert relative_error(g, p) <= 2**-6, name
        assert float(g.abs().max()) > 0


def test_loss_scale_module_and_errors(device):
    lead, vocab = (6,), 30
    h, w, _ = leaves(*head(lead, 8, vocab, torch.float32, device, bias=False))
    th, tw, _ = head(lead, 8, vocab, torch.float32, device, bias=False)
    crit = K.FusedLinearGeneralizedJSDLoss(beta=0.5, chunk_size=4, loss_scale=0.25)
    torch.testing.assert_close(crit(h, w, th, tw), K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5,
                                                                                  chunk_size=4) * 0.25)
    assert "loss_scale=0.25" in repr(crit)
    for bad, error in ((float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError),
                       (torch.tensor(0.5), TypeError)):
        with pytest.raises(error, match="loss_scale"):
            K.fused_linear_generalized_jsd(h, w, th, tw, loss_scale=bad)
        with pytest.raises(error, match="loss_scale"):
            K.FusedLinearGeneralizedJSDLoss(loss_scale=bad)


def test_double_backward_raises(device):
    h, w, _ = leaves(*head((4,), 8, 20, torch.float32, device, bias=False))
    t_kw, _ = teacher("logits", (4,), 20, torch.float32, device)
    loss = K.fused_linear_generalized_jsd(h, w, **t_kw)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


@pytest.mark.parametrize("which", ["hidden", "weight", "bias"])
def test_only_some_inputs_require_grad(device, which):
    lead, vocab = (7,), 25
    h, w, b = head(lead, 8, vocab, torch.float64, device)
    h, w, b = [x.requires_grad_(name == which) for x, name in zip((h, w, b), ("hidden", "weight", "bias"))]
    t_kw, t_ref = teacher("hidden", lead, vocab, torch.float64, device)
    lab = labels_for(lead, device)
    loss, (g,) = run(h, w, b, t_kw, chunk_size=3, labels=lab)
    ref, (r,) = reference(h, w, b, t_ref, labels=lab)
    assert_close(loss, ref, 1e-12, "loss")
    assert_close(g, r, 1e-12, f"grad {which}")


@pytest.mark.parametrize("form", TEACHERS)
def test_teacher_is_a_constant(device, form):
    # A teacher tensor that requires grad is no error; no gradient reaches it, and the student's are unchanged.
    lead, vocab = (5,), 30
    h, w, b = leaves(*head(lead, 8, vocab, torch.float32, device))
    t_kw, _ = teacher(form, lead, vocab, torch.float32, device)
    expect, g_expect = run(h, w, b, t_kw, beta=0.5, chunk_size=2)
    if form == "topk":
        t_kw = dict(teacher_topk=(t_kw["teacher_topk"][0], t_kw["teacher_topk"][1].clone().requires_grad_()))
        grads_of = [t_kw["teacher_topk"][1]]
    else:
        t_kw = {k: v.clone().requires_grad_() for k, v in t_kw.items()}
        grads_of = list(t_kw.values())
    loss = K.fused_linear_generalized_jsd(h, w, student_bias=b, beta=0.5, chunk_size=2, **t_kw)
    loss.backward()
    assert torch.equal(loss.detach(), expect)
    assert all(t.grad is None for t in grads_of)
    for x, g in zip((h, w, b), g_expect):
        assert torch.equal(x.grad, g)


def test_no_grad_inference(device):
    lead, vocab = (6,), 40
    h, w, b = leaves(*head(lead, 8, vocab, torch.float32, device))
    t_kw, t_ref = teacher("hidden", lead, vocab, torch.float32, device)
    with torch.no_grad(), poisoned(device):
        loss = K.fused_linear_generalized_jsd(h, w, student_bias=b, chunk_size=4, **t_kw)
    assert loss.grad_fn is None
    assert_close(loss, reference(h.detach(), w.detach(), b.detach(), t_ref)[0], 2e-6, "loss")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_id)
def test_float32_accumulator(device, dtype):
    # 32 chunks: the weight's gradient accumulated in float32 (each chunk's product formed in float32) is closer to
    # a float32 reference than the one accumulated in the weight's 16-bit dtype (rounded once per chunk), and
    # within a few units of the 16-bit rounding of the final value.
    lead, vocab = (96,), 500
    h, w, b = leaves(*head(lead, 32, vocab, dtype, device, scale=2.0))
    t_kw, t_ref = teacher("hidden", lead, vocab, dtype, device)
    kw = dict(beta=0.5, temperature=2.0, labels=labels_for(lead, device, 0.1), chunk_size=3)
    _, g16 = run(h, w, b, t_kw, **kw)
    _, g32 = run(h, w, b, t_kw, accum_dtype=torch.float32, **kw)
    kw.pop("chunk_size")
    _, r = reference(h, w, b, t_ref, dtype=torch.float32, **kw)
    assert g32[1].dtype == dtype
    err16, err32 = relative_error(g16[1], r[1]), relative_error(g32[1], r[1])
    assert err32 <= 0.85 * err16, (err32, err16)  # measured: about 0.6
    assert err32 <= (1.2e-2 if dtype == torch.bfloat16 else 3e-3), err32
    # the other gradients do not depend on the weight's accumulator
    assert torch.equal(g16[0], g32[0]) and torch.equal(g16[2], g32[2])


@pytest.mark.parametrize("accum_dtype", [None, torch.float32], ids=["float16_accumulator", "float32_accumulator"])
def test_float16_weight_gradient_does_not_overflow(device, accum_dtype):
    # grad weight sums every token's contribution; under batchmean the sum is divided by the tokens. In float16 the
    # undivided sum passes 65504 while the gradient itself (~1500 here) does not: it must come out finite and
    # right, as PyTorch's float16 path gives it.
    n, hidden, vocab = 64, 4, 8
    h = torch.randn(n, hidden, dtype=torch.float64) * 0.01
    h[:, 0] = 1500 + torch.rand(n, dtype=torch.float64)  # a large feature the logits do not use (w[:, 0] = 0)...
    h[:, 1] = 1.0
    w = torch.randn(vocab, hidden, dtype=torch.float64) * 0.01
    w[:, 0] = 0.0
    w[0, 1] = 8.0  # ...while student and teacher disagree (entry 0 against entry 1): d logits of order 1
    t = torch.randn(n, vocab, dtype=torch.float64) * 0.01
    t[:, 1] += 8.0
    h16, w16 = leaves(h.half().to(device), w.half().to(device))
    t16 = t.half().to(device)
    lab = labels_for((n,), device, 0.1)
    loss, grads = run(h16, w16, None, dict(teacher_logits=t16), labels=lab, chunk_size=5, accum_dtype=accum_dtype)
    _, ref = reference(h16, w16, None, dict(teacher_logits=t16.double()), labels=lab)
    assert torch.isfinite(grads[1]).all() and ref[1].abs().max() > 1000
    assert_close(grads[1], ref[1], 2e-3, "grad weight")
    assert_close(grads[0], ref[0], 2e-3, "grad hidden")


@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
def test_float16_hidden_gradient_under_a_loss_scaler(device, reduction):
    # float16's grad hidden was scaled in the forward (batchmean's 1 / tokens, loss_scale): over a batch of 4096
    # tokens its entries fell among float16's subnormals, and a GradScaler's factor in backward (65536) could not
    # bring the lost digits back (1.3e-2 relative, and entries of kept tokens 0). Backward now applies the scale with
    # grad_output folded in, each entry rounded once, as the materialised float16 path rounds it.
    n, hidden, vocab = 4096, 32, 256
    h16, w16 = leaves(torch.randn(n, hidden, device=device).half(), (torch.randn(vocab, hidden, device=device) * 0.3)
                      .half())
    t16 = (torch.randn(n, hidden, device=device) @ torch.randn(hidden, vocab, device=device) * 0.3).half()
    kw = dict(labels=labels_for((n,), device, 0.1), beta=0.5, temperature=2.0, reduction=reduction,
              loss_scale=1.0 if reduction == "batchmean" else 1 / n)
    _, grads = run(h16, w16, None, dict(teacher_logits=t16), grad_out=65536.0, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "loss_scale"}
    _, ref = reference(h16, w16, None, dict(teacher_logits=t16.double()), grad_out=65536.0 * kw["loss_scale"],
                       **ref_kw)
    kept = kw["labels"] != -100
    zeros = float((grads[0][kept] == 0).double().mean())  # (a few entries are 0 in float16's rounding anyway)
    assert zeros < 5e-3, f"{zeros:.2%} of the kept tokens' grad hidden entries flushed to 0"
    assert_close(grads[0], ref[0], 2e-3, "grad hidden")
    assert_close(grads[1], ref[1], 2e-3, "grad weight")


def test_hidden_size_zero(device):
    # No features: the logits are the bias alone; grad hidden and grad weight are empty, grad bias is the usual.
    lead, vocab = (5,), 7
    h, w, b = leaves(*head(lead, 0, vocab, torch.float32, device))
    t_kw, t_ref = teacher("logits", lead, vocab, torch.float32, device)
    loss, grads = run(h, w, b, t_kw, chunk_size=2)
    ref, rgrads = reference(h, w, b, t_ref)
    assert_close(loss, ref, 2e-6, "loss")
    assert [tuple(g.shape) for g in grads] == [(5, 0), (7, 0), (7,)]
    assert_close(grads[2], rgrads[2], 2e-5, "grad bias")


# ------------------------------------------------------------------------------- 4. sizes and devices
def test_default_chunk_size():
    cs = fused_linear.default_chunk_size
    # Llama 3's vocabulary in bf16: 1024 tokens with the teacher's buffer (2 x 250.5 MiB), 2048 without.
    assert cs(4096, 128256, 2, 2) == 1024 and cs(4096, 128256, 2, 1) == 2048
    assert cs(100, 128256, 2, 2) == 100 and cs(0, 128256, 2, 2) == 1
    assert cs(4096, 1 << 26, 4, 2) == 1  # rows of 256 MiB: one at a time
    for vocab in (1000, 32000, 50257, 128256, 151936, 262144):
        for itemsize, buffers in ((2, 1), (2, 2), (4, 2), (8, 2)):
            rows = cs(1 << 20, vocab, itemsize, buffers)
            assert rows * vocab * itemsize * buffers <= fused_linear.BUFFER_BYTES
            assert rows % fused_linear.CHUNK_MULTIPLE == 0 or rows < fused_linear.CHUNK_MULTIPLE


@pytest.mark.parametrize("form", TEACHERS)
@pytest.mark.parametrize("skip", [False, True])
def test_default_chunk_counts_the_teachers_buffer(device, form, skip, monkeypatch):
    # The teacher's logits take a [chunk, V] buffer of their own where they are made per chunk (hidden states) or
    # gathered per chunk (given logits with skip_masked): the default chunk then halves, keeping the buffers'
    # bytes within BUFFER_BYTES.
    lead, vocab = (6,), 30
    h, w, b = leaves(*head(lead, 8, vocab, torch.float32, device))
    t_kw, _ = teacher(form, lead, vocab, torch.float32, device)
    calls = []
    default = fused_linear.default_chunk_size
    monkeypatch.setattr(fused_linear, "default_chunk_size", lambda *a: calls.append(a[3]) or default(*a))
    run(h, w, b, t_kw, labels=labels_for(lead, device), skip_masked=skip)
    assert calls == [2 if form == "hidden" or (skip and form == "logits") else 1]


def test_empty_batch(device):
    h, w, b = leaves(*head((0,), 8, 20, torch.float32, device))
    t_kw, _ = teacher("hidden", (0,), 20, torch.float32, device)
    loss, grads = run(h, w, b, t_kw)
    assert loss.item() == 0
    assert [g.shape for g in grads] == [h.shape, w.shape, b.shape]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_strided_and_3d_inputs(device):
    # Hidden states with non-contiguous leading dims and a weight that is a transposed view.
    base = torch.randn(5, 2, 16, dtype=torch.float64, device=device)
    h = base.transpose(0, 1).requires_grad_()
    w = (torch.randn(16, 40, dtype=torch.float64, device=device) * 0.3).t().requires_grad_()
    assert not h.is_contiguous() and not w.is_contiguous()
    t_kw, t_ref = teacher("logits", (2, 5), 40, torch.float64, device)
    loss, grads = run(h, w, None, t_kw, beta=0.5, chunk_size=3)
    ref, rgrads = reference(h, w, None, t_ref, beta=0.5)
    assert_close(loss, ref, 1e-12, "loss")
    for g, r in zip(grads, rgrads):
        assert_close(g, r, 1e-12, "grad")


def test_meta_tensors_give_shapes():
    h = torch.empty(3, 4, 16, device="meta", requires_grad=True)
    w = torch.empty(50, 16, device="meta", requires_grad=True)
    t = torch.empty(3, 4, 50, device="meta")
    loss = K.fused_linear_generalized_jsd(h, w, teacher_logits=t)
    assert loss.device.type == "meta" and loss.shape == () and loss.dtype == torch.float32
    # and through autograd (backward once asked the kernels' module to scale the gradients of meta tensors)
    b = torch.empty(50, device="meta", requires_grad=True)
    (K.fused_linear_generalized_jsd(h, w, teacher_logits=t, student_bias=b, chunk_size=5) * 2).backward()
    for g, x in ((h.grad, h), (w.grad, w), (b.grad, b)):
        assert g.device.type == "meta" and g.shape == x.shape and g.dtype == x.dtype


def test_kernel_refusing_in_place_falls_back_to_a_buffer(device, monkeypatch):
    # Where the kernel cannot write d logits over the logits (CUDA rows too long to sit on chip: it says so when
    # asked), the chunks use a separate gradient buffer, with the same results. Simulated with a module that
    # answers no; the in-place call itself would be refused, so the test fails if it is attempted.
    real = fused_linear._module(torch.device(device))
    calls = []

    class NoInPlace:
        def __getattr__(self, name):  # the module's other functions, as they are
            return getattr(real, name)

        def distill_in_place_ok(self, vocab, element_size, topk):
            return False

        def distill_forward(self, student, *args):
            # (args after the student: teacher ... reduction, want_student, want_teacher, grad_student_out, ...)
            in_place = len(args) > 10 and args[10] is not None and args[10].data_ptr() == student.data_ptr()
            calls.append(in_place)
            assert not in_place, "d logits written over the logits although the kernel said it cannot"
            return real.distill_forward(student, *args)

    lead, vocab = (7,), 40
    h, w, b = leaves(*head(lead, 8, vocab, torch.float64, device))
    t_kw, t_ref = teacher("hidden", lead, vocab, torch.float64, device)
    expect, g_expect = run(h, w, b, t_kw, chunk_size=3, beta=0.5)
    monkeypatch.setattr(fused_linear, "_module", lambda dev: NoInPlace())
    loss, grads = run(h, w, b, t_kw, chunk_size=3, beta=0.5)
    assert calls == [False, False, False]  # three chunks, each into the separate buffer
    assert torch.equal(loss, expect) and all(torch.equal(g, e) for g, e in zip(grads, g_expect))


def test_module_form(device):
    lead, vocab = (6,), 30
    h, w, _ = leaves(*head(lead, 8, vocab, torch.float32, device, bias=False))
    th, tw, _ = head(lead, 8, vocab, torch.float32, device, bias=False)
    lab = torch.tensor([1, 2, -1, 3, 4, 5], device=device)
    crit = K.FusedLinearGeneralizedJSDLoss(beta=0.5, temperature=2.0, ignore_index=-1, chunk_size=4)
    torch.testing.assert_close(crit(h, w, th, tw, labels=lab),
                               K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5, temperature=2.0, labels=lab,
                                                              ignore_index=-1, chunk_size=4))
    assert "chunk_size=4" in repr(crit)
    # labels fifth, as GeneralizedJSDLoss takes them after its two logits (a sixth positional raised a bare
    # "forward() takes from 3 to 5 positional arguments")
    assert torch.equal(crit(h, w, th, tw, lab), crit(h, w, th, tw, labels=lab))
    with pytest.raises(ValueError, match="^fused_linear_generalized_jsd: beta"):  # (its check, its name)
        K.FusedLinearGeneralizedJSDLoss(beta=1.5)
    with pytest.raises(ValueError, match="none"):
        K.FusedLinearGeneralizedJSDLoss(reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        K.FusedLinearGeneralizedJSDLoss(chunk_size=0)


# ------------------------------------------------------------------------------------ 5. torch.library
def test_opcheck(device):
    h, w, b = leaves(*head((6,), 8, 11, torch.float32, device))
    t = torch.randn(6, 11, device=device)
    th, tw, _ = head((6,), 5, 11, torch.float32, device, bias=False)
    lab = torch.tensor([1, -100, 2, 3, 4, 5], device=device)
    op = torch.ops.kldiv_inline.fused_linear_distill.default
    # (..., batchmean, loss_scale, chunk_size, accum_dtype, group_name, skip_masked, offset, whole, want_hidden,
    #  want_weight, want_bias)
    torch.library.opcheck(op, (h, w, b, None, None, None, t, None, None, lab, -100, 0.5, 2.0, True, 1.0, 4, None,
                               None, False, -1, -1, True, True, True))
    torch.library.opcheck(op, (h, w, None, th, tw, None, None, None, None, None, -100, 0.0, 1.0, False, 0.5, 100,
                               None, None, False, -1, -1, True, False, False))
    idx, lp = topk_teacher((6,), 11, 3, device)
    lp = K.distill.traced_topk_normalisation(lp, False)  # (the op takes the teacher's rows prepared: [6, k + 1])
    torch.library.opcheck(op, (h, w, b, None, None, None, None, idx, lp, lab, -100, 1.0, 1.5, True, 0.25, 5, None,
                               None, False, -1, -1, False, True, True))
    torch.library.opcheck(op, (h, w, b, th, tw, None, None, None, None, lab, -100, 0.5, 2.0, True, 1.0, 4, None,
                               None, True, -1, -1, True, True, True))  # skip_masked
    # the traced backward's scaling (no autograd of its own: a double backward through it is refused)
    scale = torch.ops.kldiv_inline.fused_linear_scale.default
    torch.library.opcheck(scale, (torch.randn(6, 8, device=device), torch.tensor(0.5, device=device),
                                  [h.detach(), w.detach()]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    lead, vocab = (12,), 200
    h, w, b = leaves(*head(lead, 16, vocab, torch.float32, device))
    th, tw, tb = head(lead, 16, vocab, torch.float32, device)
    lab = labels_for(lead, device)

    def step(h, w, b, th, tw, tb, y):  # (with a loss_scale: the custom op's schema carries it)
        return K.fused_linear_generalized_jsd(h, w, th, tw, student_bias=b, teacher_bias=tb, beta=0.5,
                                              temperature=2.0, labels=y, chunk_size=5, loss_scale=0.5)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(h, w, b, th, tw, tb, lab)
    grads = torch.autograd.grad(loss * 2, [h, w, b])
    t_ref = dict(teacher_logits=th.double() @ tw.double().T + tb.double())
    ref, rgrads = reference(h, w, b, t_ref, 1.0, beta=0.5, temperature=2.0, labels=lab)
    assert_close(loss, ref * 0.5, 2e-6, "loss")
    for g, r in zip(grads, rgrads):
        assert_close(g, r, GRAD_TOL[torch.float32], "grad")


@pytest.mark.slow
@pytest.mark.parametrize("wrt", ["hidden", "weight"])
def test_torch_compile_refuses_double_backward(device, wrt):
    # The traced backward scaled the forward's gradients (no graph of their own) by a plain multiplication, so
    # AOTAutograd ran create_graph=True through it and a penalty on the gradient lost its terms without a word
    # (the second-order gradient came out as if the penalty were not there). Now it refuses, as the eager path.
    h, w, _ = leaves(*head((4,), 8, 20, torch.float32, device, bias=False))
    th, tw, _ = head((4,), 8, 20, torch.float32, device, bias=False)
    x = h if wrt == "hidden" else w
    (h if wrt == "weight" else w).requires_grad_(False)
    torch._dynamo.reset()
    # (AOTAutograd's cache can serve a backward traced from older code of this package: trace it afresh)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(lambda a, b: K.fused_linear_generalized_jsd(a, b, th, tw, beta=0.5), fullgraph=True)
        (g,) = torch.autograd.grad(compiled(h, w), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((g**2).sum() + x.sum(), x)


# ------------------------------------------------------------------------------------------- 6. errors
def test_bad_input_raises_clearly(device):
    h, w, b = head((4,), 8, 10, torch.float32, device)
    th, tw, tb = head((4,), 6, 10, torch.float32, device)
    t = torch.randn(4, 10, device=device)
    good = dict(teacher_hidden=th, teacher_weight=tw)
    cases = [
        (dict(student_weight=w.to_sparse(), **good), NotImplementedError, "sparse_coo tensor.*to_dense"),
        (dict(student_weight=w[:, :7], **good), ValueError, r"\[V, H\]"),
        (dict(student_weight=w[0], **good), ValueError, r"\[V, H\]"),
        (dict(student_weight=w.double(), **good), TypeError, "float64.*student's hidden states, weight and bias"),
        (dict(student_bias=b[:9], **good), ValueError, r"\[V\]"),
        (dict(student_bias=b.double(), **good), TypeError, "student_bias"),
        (dict(student_bias=[1.0], **good), TypeError, "student_bias"),
        (dict(teacher_hidden=th), ValueError, "both"),
        (dict(teacher_weight=tw), ValueError, "both"),
        (dict(), ValueError, "exactly one teacher"),
        (dict(teacher_logits=t, **good), ValueError, "exactly one teacher"),
        (dict(teacher_logits=t, teacher_bias=tb), ValueError, "teacher_bias needs"),
        (dict(teacher_hidden=th, teacher_weight=tw[:9]), ValueError, "vocabulary of 9"),
        (dict(teacher_hidden=th, teacher_weight=tw[:, :5]), ValueError, r"\[V, H\]"),
        (dict(teacher_hidden=th[:3], teacher_weight=tw), ValueError, "leading dims"),
        (dict(teacher_hidden=th.double(), teacher_weight=tw.double()), TypeError, "one dtype"),
        (dict(teacher_hidden=th, teacher_weight=tw, teacher_bias=tb[:3]), ValueError, "teacher_bias"),
        (dict(teacher_logits=t[:, :9]), ValueError, "same shape"),
        (dict(teacher_logits=t.double()), TypeError, "same dtype"),
        (dict(teacher_topk=(torch.zeros(4, 2, dtype=torch.long, device=device),)), TypeError, "pair"),
        (dict(reduction="none", **good), ValueError, "'none' is not supported"),
        (dict(reduction="mean", **good), ValueError, "reduction"),
        (dict(beta=1.5, **good), ValueError, "beta"),
        (dict(temperature=0.0, **good), ValueError, "temperature"),
        (dict(beta=1 - 1e-9, **good), ValueError, "is 1 in float32"),  # (what float32 lanes cannot hold)
        (dict(temperature=1e-39, **good), ValueError, "too small for the float32 lanes"),
        (dict(labels=torch.zeros(3, dtype=torch.long, device=device), **good), ValueError, "leading"),
        (dict(labels=torch.zeros(4, device=device), **good), TypeError, "integer"),
        (dict(chunk_size=0, **good), ValueError, "chunk_size"),
        (dict(chunk_size=2.0, **good), TypeError, "chunk_size"),
        (dict(chunk_size=True, **good), TypeError, "chunk_size"),
        (dict(chunk_size=2**64, **good), ValueError, r"at most 2\*\*63 - 1"),  # (the op takes an int64)
        (dict(accum_dtype=torch.float64, **good), ValueError, "accum_dtype"),
        (dict(accum_dtype=torch.float16, **good), ValueError, "accum_dtype"),
        (dict(teacher_topk=(torch.full((4, 2), 10, device=device), torch.full((4, 2), -1.0, device=device))),
         ValueError, r"must lie in \[0, 10\)"),
    ]
    for kw, exc, match in cases:
        args = {"student_weight": w, **kw}
        weight = args.pop("student_weight")
        with pytest.raises(exc, match=match) as info:
            K.fused_linear_generalized_jsd(h, weight, **args)
        # (under the name called, also where the check is generalized_jsd's: labels, settings, teacher, top-k)
        assert str(info.value).startswith("fused_linear_generalized_jsd: "), info.value
    with pytest.raises(TypeError, match="float16, bfloat16"):
        K.fused_linear_generalized_jsd(h.long(), w.long(), **good)
    with pytest.raises(TypeError, match="student_weight must be a tensor"):
        K.fused_linear_generalized_jsd(h, None, **good)
    with pytest.raises(ValueError, match="0-d"):
        K.fused_linear_generalized_jsd(h[0, 0], w, teacher_logits=t)
    h16, w16, _ = head((4,), 8, 10, torch.bfloat16, device)
    with pytest.raises(ValueError, match="accum_dtype"):
        K.fused_linear_generalized_jsd(h16, w16, teacher_logits=t.bfloat16(), accum_dtype=torch.float64)


@pytest.mark.gpu
def test_mixed_devices_raise():
    h, w, b = head((4,), 8, 10, torch.float32, "cuda")
    th, tw, _ = head((4,), 8, 10, torch.float32, "cuda")
    with pytest.raises(ValueError, match="one device"):
        K.fused_linear_generalized_jsd(h, w.cpu(), th, tw)
    with pytest.raises(ValueError, match="one device"):
        K.fused_linear_generalized_jsd(h, w, th, tw.cpu())
    with pytest.raises(ValueError, match="one device"):
        K.fused_linear_generalized_jsd(h, w, th, tw, student_bias=b.cpu())


# --------------------------------------------------------------------------------------------- 7. GPU
@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_llama_head_accuracy_cuda(beta):
    # The issue's accuracy goal at Llama 3's head (bf16, 128256 x 4096), on 256 tokens: the loss within 1e-3
    # (relative) of the float64 loss of the same bf16 inputs; the gradients as close to a float32 materialised
    # reference as PyTorch's own bf16 path (within a factor of 2), with the default chunk size (all 256 tokens in
    # one chunk) and with chunks of 64 and a float32 accumulator.
    lead, vocab, hidden = (256,), 128256, 4096
    h, w, _ = leaves(*head(lead, hidden, vocab, torch.bfloat16, "cuda", bias=False, scale=2.0))
    th, tw, _ = head(lead, hidden, vocab, torch.bfloat16, "cuda", bias=False, scale=2.0)
    kw = dict(beta=beta, temperature=2.0, labels=labels_for(lead, "cuda", 0.1))
    t_ref = dict(teacher_logits=th.double() @ tw.double().T)
    ref, _ = reference(h, w, None, t_ref, **kw)
    _, r32 = reference(h, w, None, dict(teacher_logits=th.float() @ tw.float().T), dtype=torch.float32, **kw)
    hm, wm = leaves(h, w)
    mat = K.generalized_jsd(hm @ wm.T, th @ tw.T, **kw)
    rm = torch.autograd.grad(mat, [hm, wm])
    for extra in (dict(), dict(chunk_size=64, accum_dtype=torch.float32)):
        loss, grads = run(h, w, None, dict(teacher_hidden=th, teacher_weight=tw), **kw, **extra)
        assert_close(loss, ref, 1e-3, f"loss {extra}")
        for g, r, m in zip(grads, r32, rm):
            err, err_torch = relative_error(g, r), relative_error(m, r)
            assert err <= 2 * err_torch + 1e-3, (extra, err, err_torch)


@pytest.mark.gpu
def test_long_rows_use_a_separate_gradient_buffer_cuda():
    # float32 rows of 2^19 with a teacher (4 MiB a row) do not fit a cluster's shared memory: the kernel cannot
    # write d logits over the logits (it says so when asked), and the chunks use a separate gradient buffer (the CPU
    # twin always can). (The kernel's own refusal, an error raised in the extension, is not provoked here: on the
    # lent H200s such an error took the process down instead of raising.)
    lead, vocab = (6,), 1 << 19
    mod = fused_linear._module(torch.device("cuda"))
    assert not mod.distill_in_place_ok(vocab, 4, False) and mod.distill_in_place_ok(128256, 2, False)
    h, w, b = leaves(*head(lead, 16, vocab, torch.float32, "cuda"))
    t_kw, t_ref = teacher("hidden", lead, vocab, torch.float32, "cuda")
    kw = dict(beta=0.5, temperature=2.0, labels=labels_for(lead, "cuda"))
    loss, grads = run(h, w, b, t_kw, chunk_size=4, **kw)
    ref, rgrads = reference(h, w, b, t_ref, **kw)
    assert_close(loss, ref, 2e-6, "loss")
    for g, r in zip(grads, rgrads):
        assert_close(g, r, GRAD_TOL[torch.float32], "grad")


@pytest.mark.gpu
def test_extra_memory_cuda():
    # The memory goal at 4096 tokens x hidden 4096 x vocabulary 128256 (bf16), teacher as hidden + weight:
    # beyond the inputs and the parameter gradients (hidden's and weight's), the step allocates the two logit
    # buffers of the default chunk (2 x 1024 x 128256 x 2 bytes = 501 MiB) and little else: <= 1 GiB.
    tokens, hidden, vocab = 4096, 4096, 128256
    h, w, _ = head((tokens,), hidden, vocab, torch.bfloat16, "cuda", bias=False, scale=2.0)
    th, tw, _ = head((tokens,), hidden, vocab, torch.bfloat16, "cuda", bias=False, scale=2.0)
    lab = labels_for((tokens,), "cuda", 0.1)
    h.requires_grad_()
    w.requires_grad_()

    def step():
        loss = K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5, temperature=2.0, labels=lab)
        loss.backward()

    step()  # built and warmed up (cuBLAS workspaces)
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    grads = h.numel() * 2 + w.numel() * 2
    extra_mib = (torch.cuda.max_memory_allocated() - base - grads) / 2**20
    buffers_mib = 2 * 1024 * vocab * 2 / 2**20
    assert extra_mib <= buffers_mib + 64, (extra_mib, buffers_mib)
    assert extra_mib <= 1024


@pytest.mark.gpu
def test_no_host_sync_and_graph_capture():
    lead, vocab = (64,), 5000
    h, w, b = leaves(*head(lead, 64, vocab, torch.bfloat16, "cuda"))
    th, tw, tb = head(lead, 64, vocab, torch.bfloat16, "cuda")
    lab = labels_for(lead, "cuda")

    def step():
        loss = K.fused_linear_generalized_jsd(h, w, th, tw, student_bias=b, teacher_bias=tb, beta=0.5, labels=lab,
                                              chunk_size=16)
        return loss, torch.autograd.grad(loss, [h, w, b])

    expect, g_expect = step()  # built
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # Capturing autograd: autograd's nodes keep the stream they were made on, and a capture that waits on another
    # stream fails (cudaErrorStreamCaptureImplicit, seen on an H100, also after a warm-up on a separate side
    # stream). So fresh leaves, warmed up on the very stream that then captures.
    h, w, b = leaves(h, w, b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            loss, grads = step()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss, expect)
    for g, e in zip(grads, g_expect):
        torch.testing.assert_close(g, e)


@pytest.mark.gpu
def test_skip_masked_cuda():
    # At a size where cuBLAS and the fast kernel run: the same loss as without skip_masked; a capture refused.
    lead, vocab = (96,), 5000
    h, w, b = leaves(*head(lead, 64, vocab, torch.bfloat16, "cuda"))
    th, tw, tb = head(lead, 64, vocab, torch.bfloat16, "cuda")
    lab = labels_for(lead, "cuda", frac=0.5)
    kw = dict(teacher_hidden=th, teacher_weight=tw, teacher_bias=tb, beta=0.5, labels=lab, chunk_size=32)
    loss, grads = run(h, w, b, kw, skip_masked=True)
    full, fgrads = run(h, w, b, kw)
    assert_close(loss, full, 1e-6, "loss")
    for g, f in zip(grads, fgrads):
        assert_close(g, f, 8 * 2.0**-9, "grad")
    assert torch.equal(grads[0][lab == -100], torch.zeros_like(grads[0][lab == -100]))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="skip_masked"):
        with torch.cuda.graph(graph):
            K.fused_linear_generalized_jsd(h, w, student_bias=b, **kw, skip_masked=True)


# ------------------------------------------------------------------------------ 7. the usual recipe's modes
@pytest.mark.parametrize("form", ["hidden", "logits", "topk"])
def test_a_teacher_and_labels_made_under_inference_mode(device, form):
    # The usual recipe runs the teacher under torch.inference_mode(); its tensors cannot be saved for backward
    # ("Inference tensors cannot be saved"), which the op did with every input.
    h, w, b = leaves(*head((2, 5), 8, 40, torch.float32, device))
    with torch.inference_mode():
        t_kw, t_ref = teacher(form, (2, 5), 40, torch.float32, device)
        lab = labels_for((2, 5), device)
    assert all(v.is_inference() for v in (*t_kw.values(), lab) if isinstance(v, torch.Tensor))
    loss = K.fused_linear_generalized_jsd(h, w, student_bias=b, **t_kw, labels=lab, beta=0.5)
    grads = torch.autograd.grad(loss, [h, w, b], retain_graph=True)
    again = torch.autograd.grad(loss, [h, w, b])  # (a second backward recomputes from the held inputs)
    t_ref = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(x.clone() for x in v)) for k, v in t_ref.items()}
    ref, ref_grads = reference(h, w, b, t_ref, labels=lab.clone(), beta=0.5)
    assert_close(loss, ref, 1e-5, "loss")
    for g, g2, r in zip(grads, again, ref_grads):
        assert_close(g, r, GRAD_TOL[torch.float32], "grad")
        assert_close(g2, r, GRAD_TOL[torch.float32], "second grad")


def test_skip_masked_under_autocast(device):
    # Under autocast a bare torch.mm of float32 tensors came out in bfloat16 (or float16), and skip_masked's
    # index_copy_ of it into the float32 grad hidden failed; the op runs its products in the inputs' dtypes.
    h, w, b = leaves(*head((12,), 8, 40, torch.float32, device))
    t_kw, t_ref = teacher("logits", (12,), 40, torch.float32, device)
    lab = labels_for((12,), device, frac=0.5)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, grads = run(h, w, b, t_kw, labels=lab, skip_masked=True, chunk_size=4)
    ref, ref_grads = reference(h, w, b, t_ref, labels=lab)
    assert_close(loss, ref, 1e-5, "loss")
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        assert_close(g, r, GRAD_TOL[torch.float32], "grad")


def test_a_negative_grad_output_is_read_as_its_value(device):
    # A negative view (x.conj().imag) as grad_output: its memory holds the negated value, which the in-place rescale
    # read as it was for float64 (the gradients' sign flipped).
    h, w, _ = leaves(*head((4,), 8, 20, torch.float64, device, bias=False))
    th, tw, _ = head((4,), 8, 20, torch.float64, device, bias=False)
    go = torch.complex(torch.zeros((), dtype=torch.float64), torch.tensor(-1.5, dtype=torch.float64)).conj().imag
    assert go.is_neg() and float(go) == 1.5
    loss = K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5)
    grads = torch.autograd.grad(loss, [h, w], go.to(device))
    ref, rgrads = reference(h, w, None, dict(teacher_logits=th @ tw.T), 1.5, beta=0.5)
    for g, r in zip(grads, rgrads):
        assert_close(g, r, GRAD_TOL[torch.float64], "grad")


def test_a_teacher_refilled_before_backward(device):
    # The teacher's hidden states refilled in place for the next micro-batch before this one's backward, which
    # only rescales the gradients the forward wrote: it raised PyTorch's in-place error (the saved inputs were
    # read to check their versions). A second backward, which computes again, still refuses.
    h, w, _ = leaves(*head((5,), 8, 30, torch.float32, device, bias=False))
    th, tw, _ = head((5,), 8, 30, torch.float32, device, bias=False)
    ref, rgrads = reference(h, w, None, dict(teacher_logits=th @ tw.T), beta=0.5)
    loss = K.fused_linear_generalized_jsd(h, w, th, tw, beta=0.5)
    with torch.no_grad():
        th.copy_(torch.randn_like(th))
    grads = torch.autograd.grad(loss, [h, w], retain_graph=True)
    assert_close(loss, ref, 2e-6, "loss")
    for g, r in zip(grads, rgrads):
        assert_close(g, r, GRAD_TOL[torch.float32], "grad")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, [h, w])


@pytest.mark.parametrize("changed,frozen,refused", [("hidden", None, True), ("weight", None, True),
                                                     ("bias", None, False), ("hidden", "weight", False),
                                                     ("weight", "hidden", False)])
def test_a_student_changed_in_place_before_backward(device, changed, frozen, refused):
    # The backward that only rescales reads no saved input (a teacher refilled in place is fine), but the student's
    # hidden states or weight changed since the forward (an optimizer step before this loss's backward) are refused
    # where PyTorch's materialised head refuses them: the weight where the hidden states' gradient is made (the
    # product saved it), the hidden states where the weight's is; never the bias.
    h, w, b = leaves(*head((5,), 8, 30, torch.float32, device))
    th, tw, _ = head((5,), 8, 30, torch.float32, device, bias=False)
    inputs = dict(hidden=h, weight=w, bias=b)
    if frozen:
        inputs[frozen].requires_grad_(False)
    loss = K.fused_linear_generalized_jsd(h, w, th, tw, student_bias=b, beta=0.5)
    with torch.no_grad():
        inputs[changed].mul_(1.01)
    wrt = [t for t in inputs.values() if t.requires_grad]
    if refused:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, wrt)
    else:
        torch.autograd.grad(loss, wrt)
