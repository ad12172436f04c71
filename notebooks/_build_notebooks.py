"""Writes the three notebooks of this folder from the cell sources below, without outputs.

Edit a cell here, then run ``python notebooks/_build_notebooks.py``; tests/test_notebooks.py fails when a
stored notebook differs from what this script writes, or holds outputs. Cell ids are fixed so that the
files only change where a cell does.

Every notebook starts with one parameter cell: ``FULL`` (the sizes of a GPU study) defaults to "a GPU is
visible" and ``KLDIV_NB_FULL=0/1`` overrides it; without a GPU the CUDA-only cells print a note and the CPU
twin of the kernels runs instead.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str, *tags: str):
    cell = new_code_cell(textwrap.dedent(text).strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


# The first code cells of every notebook: the parameters (one cell, `parameters` tag as papermill expects),
# then the path set-up that lets the notebook import the kit from a checkout without `pip install -e .`.
PARAMETERS_HEAD = r'''
# Parameters: the only cell to edit. FULL: the sizes of a GPU study; without a GPU a quick CPU run.
# KLDIV_NB_FULL=1 or 0 in the environment overrides the default either way.
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("KLDIV_NB_FULL", "1" if DEVICE == "cuda" else "0") == "1"
'''

SETUP = r'''
import sys
import time
from pathlib import Path

ROOT = Path.cwd().resolve().parent  # this notebook runs in <repo>/notebooks
if (ROOT / "kldiv_inline").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the kit straight from the checkout

import matplotlib.pyplot as plt

import kldiv_inline as K
from kldiv_inline import plots
%matplotlib inline

print(f"device {DEVICE}, FULL={FULL}, torch {torch.__version__}")
'''


# ------------------------------------------------------------------------------------ 01 correctness
NB01 = [
    md(r'''
    # 1. Correctness: the kit's KL divergence against PyTorch in float64

    `kldiv_inline.kl_div` has `torch.nn.functional.kl_div`'s signature and semantics; `kl_div_from_probs`
    takes probabilities and takes their log inside the kernel (`F.kl_div(torch.log(p), t)` in one pass). This
    notebook checks both against PyTorch's own `kl_div` evaluated in float64 (`kldiv_inline.reference`):

    1. the compiled module and one call: value, shape, dtype;
    2. every reduction, dtype, shape and memory layout;
    3. the edge cases: zeros in the target, infinities, NaN, empty tensors;
    4. gradients, against float64 autograd and finite differences;
    5. the kit's whole check grid, as `python -m kldiv_inline check` runs it;
    6. where the seed's naive kernel goes wrong on the same inputs, and ours doesn't;
    7. how the error grows with the problem's size, per dtype.

    Without a GPU everything runs on the CPU twin (`kernels/kldiv_cpu.cpp`), which shares its per-element
    arithmetic with the CUDA kernels (`kernels/kldiv_common.h`); the seed is CUDA only, so its cells print a
    note there and show our op on the same inputs.
    '''),
    code(PARAMETERS_HEAD + r'''
# Sizes of the error-against-size sweep (section 7): elements per input, rows of 1024 probabilities.
SWEEP_NUMEL = [2**k for k in (range(10, 29, 3) if FULL else range(10, 21, 2))]
''', "parameters"),
    code(SETUP),
    md(r'''
    ## 1. The compiled module

    `K.load(backend)` builds `kernels/kldiv.cu` (or the CPU twin) with the bindings on first use and caches the
    build under `~/.cache/kldiv_inline`, keyed on a hash of every source and header it includes: a new process
    imports the cached `.so` directly, an edited kernel gets a new name and a new build. The op picks the
    module from the tensors' device, so code that only computes losses never calls `load` itself.
    '''),
    code(r'''
    t0 = time.perf_counter()
    module = K.load(DEVICE)
    print(f"{module.__name__}: backend {module.backend()!r}, loaded in {time.perf_counter() - t0:.2f} s")
    print(module.__file__)
    '''),
    md(r'''
    ## One call: the number, its shape and its dtype

    The seed's problem: rows of probabilities `p` (predictions) and `t` (targets), loss
    $\sum_{ij} t_{ij}(\log t_{ij} - \log p_{ij}) / \text{batch}$. The inputs below are softmax rows with a random
    temperature (`reference.probability_rows`). The result is a 0-d tensor of the inputs' dtype, as PyTorch's.
    `relative_error` is $\lVert out - ref\rVert / \lVert ref\rVert$ in float64, and infinite when the two
    disagree on where the NaN and infinite values are.
    '''),
    code(r'''
    from kldiv_inline.reference import kl_div_reference, probability_rows, relative_error

    p = probability_rows(64, 1000, device=DEVICE)
    t = probability_rows(64, 1000, device=DEVICE)
    ours = K.kl_div_from_probs(p, t)  # reduction="batchmean", the seed's
    ref = kl_div_reference(p, t, "batchmean", from_probs=True)
    print(f"kldiv_inline  {ours.item():.9f}  shape {tuple(ours.shape)}  {ours.dtype}")
    print(f"float64       {ref.item():.9f}  shape {tuple(ref.shape)}  {ref.dtype}")
    print(f"relative error {relative_error(ours, ref):.1e}")
    '''),
    md(r'''
    ## 2. Every reduction, each input form

    `reduction="none"` is compared element by element: a kernel that skipped or misplaced elements cannot hide
    behind a sum. The three forms are PyTorch's (`input` = log-probabilities), the same with `log_target=True`,
    and the fused probability form. `"mean"` divides by every element, not by the batch, and warns as PyTorch
    does; the warning is silenced here.
    '''),
    code(r'''
    import warnings

    from kldiv_inline.ops import REDUCTIONS

    logp = p.log()
    FORMS = [  # (name, op, input, target, log_target, from_probs)
        ("probs", K.kl_div_from_probs, p, t, False, True),
        ("logprobs", K.kl_div, logp, t, False, False),
        ("log_target", K.kl_div, logp, t.log(), True, False),
    ]
    print(f"{'reduction':<11}{'form':<12}{'shape':>12}{'rel err':>10}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reduction in REDUCTIONS:
            for name, op, x, y, log_target, from_probs in FORMS:
                out = op(x, y, reduction=reduction, log_target=log_target)
                ref = kl_div_reference(x, y, reduction, log_target, from_probs)
                assert out.shape == ref.shape and out.dtype == x.dtype
                print(f"{reduction:<11}{name:<12}{str(tuple(out.shape)):>12}{relative_error(out, ref):>10.1e}")
    '''),
    md(r'''
    ## Dtypes

    float16 and bfloat16 inputs are computed in float32; float32 sums stay in float32 for a few terms per
    thread and go on in double; float64 is float64 throughout. The reference takes the same (rounded) inputs,
    so the error below is the kernel's own, including the rounding of the result to the input's dtype.
    Tolerances are `check.TOLERANCE`: a few units of each dtype's rounding.
    '''),
    code(r'''
    from kldiv_inline.check import TOLERANCE

    for dtype, tol in TOLERANCE.items():
        x, y = p.to(dtype), t.to(dtype)
        out = K.kl_div_from_probs(x, y)
        err = relative_error(out, kl_div_reference(x, y, "batchmean", from_probs=True))
        print(f"{str(dtype):<16} result {str(out.dtype):<16} rel err {err:.1e}  tolerance {tol:.0e}")
        assert out.dtype == dtype and err <= tol
    '''),
    md(r'''
    ## Shapes and memory layouts

    `kldiv_inline.check.CASES` holds the inputs on which hand-written kernels usually slip: a 0-d scalar, an
    odd length, 3-D rows, transposed and sliced views (strided, unaligned starts) and broadcast operands. The
    kernels read each operand through its strides (`kernels/kldiv_plan.h` merges the dimensions it can), so a
    view costs no copy. `check.check_one` compares with float64 and returns the relative error (infinite for a
    wrong shape or dtype).
    '''),
    code(r'''
    from kldiv_inline import check

    print(f"{'case':<22}{'input shape':>14}{'contiguous':>12}{'none':>10}{'batchmean':>11}")
    for case in check.CASES:
        x, y = case.make(torch.float32, DEVICE, True, False)  # (dtype, device, from_probs, log_target)
        errors = [check.check_one(x, y, reduction, False, True) for reduction in ("none", "batchmean")]
        print(f"{case.name:<22}{str(tuple(x.shape)):>14}{str(x.is_contiguous()):>12}"
              f"{errors[0]:>10.1e}{errors[1]:>11.1e}")
        assert max(errors) <= TOLERANCE[torch.float32]
    '''),
    md(r'''
    ## 3. Edge cases

    One element per situation, with `reduction="none"`:

    - a target of 0: PyTorch defines $0 \cdot \log 0 = 0$ (`xlogy`), so the term is 0, not NaN;
    - a prediction of 0 where the target is not: an infinite loss, the true KL divergence;
    - both 0: $\log 0 = -\infty$ times 0 is NaN in PyTorch's formula, and so in ours;
    - infinite and NaN inputs propagate as PyTorch's do.

    Then empty inputs: the sum of nothing is 0; `mean` and `batchmean` divide 0 by 0, NaN, as in PyTorch.
    '''),
    code(r'''
    inf, nan = float("inf"), float("nan")
    pairs = [(0.2, 0.5), (0.3, 0.0), (0.0, 0.4), (0.0, 0.0), (inf, 0.1), (0.5, inf), (nan, 0.2), (0.2, nan)]
    pe = torch.tensor([a for a, _ in pairs], device=DEVICE)
    te = torch.tensor([b for _, b in pairs], device=DEVICE)
    ours = K.kl_div_from_probs(pe, te, reduction="none")
    ref = kl_div_reference(pe, te, "none", from_probs=True)
    for (a, b), o, r in zip(pairs, ours.tolist(), ref.tolist()):
        print(f"p = {a:<4}  t = {b:<4}   kldiv_inline {o:>9.5f}   float64 {r:>9.5f}")
    print(f"relative error {relative_error(ours, ref):.1e} (NaN and inf in the same places)")
    assert relative_error(ours, ref) <= TOLERANCE[torch.float32]
    '''),
    code(r'''
    empty = torch.empty(0, 5, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reduction in REDUCTIONS:
            out = K.kl_div_from_probs(empty, empty, reduction)
            ref = kl_div_reference(empty, empty, reduction, from_probs=True)
            print(f"{reduction:<10} kldiv_inline {str(out.tolist()):>5} shape {tuple(out.shape)}   "
                  f"float64 {str(ref.tolist()):>5} shape {tuple(ref.shape)}")
            assert out.shape == ref.shape and relative_error(out, ref) == 0
    '''),
    md(r'''
    ## 4. Gradients

    Autograd through the op against autograd through `F.kl_div` in float64, with respect to the input and to
    the target, for every reduction (a random weighting stands for the upstream gradient of `"none"`). When
    the input requires grad and the loss is reduced, the forward pass already writes d loss / d input (one
    write more, no extra read) and backward only scales it: the training step costs one pass over the data.
    '''),
    code(r'''
    weight = torch.randn(p.shape, dtype=torch.float64, device=DEVICE)


    def gradients(op, x, y, reduction, log_target):
        """d loss / d input and d loss / d target by autograd."""
        x, y = x.detach().requires_grad_(), y.detach().requires_grad_()
        loss = op(x, y, reduction=reduction, log_target=log_target)
        loss.backward(weight.to(loss.dtype) if reduction == "none" else None)
        return x.grad, y.grad


    def reference_op(from_probs):
        return lambda x, y, reduction, log_target: kl_div_reference(x, y, reduction, log_target, from_probs)


    print(f"{'reduction':<11}{'form':<12}{'d/d input':>10}{'d/d target':>12}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reduction in REDUCTIONS:
            for name, op, x, y, log_target, from_probs in FORMS:
                gx, gy = gradients(op, x, y, reduction, log_target)
                rx, ry = gradients(reference_op(from_probs), x.double(), y.double(), reduction, log_target)
                ex, ey = relative_error(gx, rx), relative_error(gy, ry)
                print(f"{reduction:<11}{name:<12}{ex:>10.1e}{ey:>12.1e}")
                assert max(ex, ey) <= 2e-5  # float32: a couple of roundings
    '''),
    md(r'''
    `torch.autograd.gradcheck` compares those gradients with finite differences, in float64, for both
    operands. (At a target of exactly 0 PyTorch's own gradient with respect to the target is NaN,
    pytorch#89558; the kit returns the same, so the check uses positive targets.)
    '''),
    code(r'''
    a = probability_rows(4, 16, dtype=torch.float64, device=DEVICE, scale=1.0).requires_grad_()
    b = probability_rows(4, 16, dtype=torch.float64, device=DEVICE, scale=1.0).requires_grad_()
    for reduction in ("none", "sum", "batchmean"):
        ok = torch.autograd.gradcheck(lambda a, b: K.kl_div_from_probs(a, b, reduction), (a, b))
        ok &= torch.autograd.gradcheck(lambda a, b: K.kl_div(a.log(), b, reduction=reduction), (a, b))
        print(f"gradcheck {reduction:<10} {ok}")
    '''),
    md(r'''
    ## 5. The whole grid

    `python -m kldiv_inline check` runs every case above in every dtype, both input forms, with and without
    `log_target`, in every reduction, on fresh random inputs, and writes `results/<device>/correctness.csv`.
    Here the same function, `check.run_checks`, with its summary; the figure is `plots.plot_correctness`, the
    drawing of `results/<device>/correctness.png`. The CSV goes to a temporary folder, not into `results/`.
    '''),
    code(r'''
    import tempfile

    t0 = time.perf_counter()
    rows = list(check.run_checks(DEVICE))
    failed = [r for r in rows if not r["ok"]]
    print(check.summary_table(rows))
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed in {time.perf_counter() - t0:.1f} s")
    for r in failed[:10]:
        print("FAILED", r)
    plots.plot_correctness(check.write_csv(rows, Path(tempfile.mkdtemp()) / "correctness.csv"))
    plt.show()
    assert not failed
    '''),
    md(r'''
    ## 6. Where the seed's design fails, and ours doesn't

    The seed (`kernels/variants/v0_seed.cu`, described in `shared/seed.md`) computes the same loss with one
    block per row, two logs per element, a float `atomicAdd`, then `.item()` and a new one-element tensor. It
    takes the tensors' data pointers and its first two sizes at face value. Measured on an H200 in one run, it
    returned `[1]`-shaped results, NaN on zero targets, 0.040938 instead of 0.040850 for a non-contiguous
    input, and 0.0105 instead of 0.6577 for a (4, 8, 100) input.

    The inputs are KernelBench's own (`kldiv_inline.kernelbench.get_inputs`: softmax of uniform noise, rows
    close to uniform), at smaller sizes. The seed is CUDA only: without a GPU the cells below say so and still
    run our op on the same inputs.
    '''),
    code(r'''
    from kldiv_inline import kernelbench
    from kldiv_inline.variants import load_variant

    seed = load_variant("v0_seed") if DEVICE == "cuda" else None
    if seed is None:
        print("No GPU here: the seed's rows below are skipped; our op runs on the CPU twin.")


    def compare(title, p, t):
        """The float64 reference, our op and the seed on the same inputs: value, shape, relative error."""
        ref = kl_div_reference(p, t, "batchmean", from_probs=True)
        ours = K.kl_div_from_probs(p, t)
        print(title)
        print(f"  float64 reference  {ref.item():>10.6f}  shape {list(ref.shape)}")
        print(f"  kldiv_inline       {ours.item():>10.6f}  shape {list(ours.shape)}  "
              f"rel err {relative_error(ours, ref):.1e}")
        assert ours.shape == ref.shape and relative_error(ours, ref) <= TOLERANCE[p.dtype]
        if seed is None:
            print("  seed (v0_seed)     skipped: CUDA only, no GPU here")
            return
        try:
            out = seed.kl_div_probs_batchmean(p, t)
        except RuntimeError as e:
            print(f"  seed (v0_seed)     raised: {str(e).splitlines()[0]}")
            return
        print(f"  seed (v0_seed)     {out.item():>10.6f}  shape {list(out.shape)}  "
              f"rel err {relative_error(out.reshape(()), ref):.1e}")
    '''),
    md(r'''
    **The result's shape.** PyTorch returns a 0-d scalar; the seed a one-element vector. KernelBench's checker
    compares shapes first, so it fails the seed on any input; in a training loop the `[1]` broadcasts silently.
    '''),
    code(r'''
    p, t = kernelbench.get_inputs(128, (4096,), device=DEVICE)
    compare("128 x 4096 float32", p, t)
    '''),
    md(r'''
    **Zeros in the target.** `t * log(t)` at `t = 0` is `0 * -inf`, NaN; PyTorch's `xlogy` defines it as 0.
    Sparse or smoothed-then-truncated targets hit this all the time.
    '''),
    code(r'''
    t_zeros = t.masked_fill(torch.rand(t.shape, device=DEVICE) < 0.3, 0.0)
    t_zeros = t_zeros / t_zeros.sum(-1, keepdim=True)  # still probability rows
    compare("the same, 30% of the targets 0", p, t_zeros)
    '''),
    md(r'''
    **A non-contiguous input.** `p.t().contiguous().t()` holds the same values as `p`, stored column by
    column. The seed walks memory as if it were row-major and pairs each target with the wrong prediction: a
    plausible, wrong number. Our kernel reads through the strides. KernelBench's rows are so close to uniform
    that a wrong pairing moves the loss only in its fifth digit, so the rows here are more peaked
    (`probability_rows` with a softmax temperature of 2).
    '''),
    code(r'''
    p = probability_rows(128, 4096, device=DEVICE, scale=2.0)
    t = probability_rows(128, 4096, device=DEVICE, scale=2.0)
    p_columns = p.t().contiguous().t()  # same values, column-major storage
    assert torch.equal(p_columns, p) and not p_columns.is_contiguous()
    compare("peaked rows, predictions stored row-major", p, t)
    compare("the same values, predictions stored column-major", p_columns, t)
    '''),
    md(r'''
    **A 3-D input.** The seed reads sizes 0 and 1 as (batch, features): (4, 8, 100) is taken for 4 rows of 8,
    and 3168 of the 3200 elements are never read. `batchmean` divides by the first dimension, 4, in both.
    '''),
    code(r'''
    p3, t3 = kernelbench.get_inputs(4, (8, 100), device=DEVICE)
    compare("4 x 8 x 100 float32", p3, t3)
    '''),
    md(r'''
    **Other dtypes and training.** The seed takes float32 only, and it has no backward: its result is a fresh
    tensor with no autograd history. Ours takes every floating dtype and backpropagates.
    '''),
    code(r'''
    p, t = kernelbench.get_inputs(128, (4096,), device=DEVICE)
    compare("128 x 4096 float16", p.half(), t.half())

    x = p.detach().requires_grad_()
    K.kl_div_from_probs(x, t).backward()
    print("kldiv_inline: d loss / d p computed, finite:", bool(x.grad.isfinite().all()))
    if seed is not None:
        out = seed.kl_div_probs_batchmean(x, t)
        print("seed: result requires grad:", out.requires_grad, "(no backward: not usable as a training loss)")
    '''),
    md(r'''
    What fixed each: the kit's kernels write a 0-d result on the device (no `.item()`, no host copy), use
    PyTorch's `xlogy` semantics (`kernels/kldiv_common.h`), plan the iteration from sizes and strides over any
    number of dimensions (`kernels/kldiv_plan.h`), dispatch over the floating dtypes, and are registered with
    autograd (`kldiv_inline/ops.py`). What the seed's host synchronisation costs in time is in notebook 3.

    ## 7. Relative error against size, per dtype

    A sum of $n$ float32 terms added one by one loses about $n \epsilon$ of its value; the kernels keep short
    float32 sums per thread and add those in double, so the error should stay flat as $n$ grows. Below:
    `batchmean` of rows of 1024 probabilities (softmax of unit-variance logits, so that none rounds to 0 in
    16 bits) against float64 of the same rounded inputs, per dtype, over `SWEEP_NUMEL` elements. Dotted lines:
    the tolerances of `check.TOLERANCE`. For 16-bit inputs the error is mostly the rounding of the result
    itself to 16 bits.
    '''),
    code(r'''
    FEATURES = 1024
    errors = {dtype: [] for dtype in TOLERANCE}
    for numel in SWEEP_NUMEL:
        p64 = probability_rows(numel // FEATURES, FEATURES, dtype=torch.float64, device=DEVICE, scale=1.0)
        t64 = probability_rows(numel // FEATURES, FEATURES, dtype=torch.float64, device=DEVICE, scale=1.0)
        for dtype in TOLERANCE:
            x, y = p64.to(dtype), t64.to(dtype)
            err = relative_error(K.kl_div_from_probs(x, y), kl_div_reference(x, y, "batchmean", from_probs=True))
            errors[dtype].append(err)
        del p64, t64

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (dtype, errs), color in zip(errors.items(), plt.cm.tab10.colors):
        ax.plot(SWEEP_NUMEL, [max(e, 1e-17) for e in errs], "o-", color=color,
                label=str(dtype).removeprefix("torch."))
        ax.axhline(TOLERANCE[dtype], ls=":", lw=1, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("elements per input")
    ax.set_ylabel("relative error of batchmean vs float64")
    ax.set_title(f"kldiv_inline on {DEVICE} (dotted: tolerances)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    plt.show()
    assert all(e <= TOLERANCE[d] for d, errs in errors.items() for e in errs)
    '''),
]


# ------------------------------------------------------------------------------------ 02 performance
NB02 = [
    md(r'''
    # 2. Performance: the kit's op against PyTorch eager, torch.compile and Liger

    The same harness as `python -m kldiv_inline bench` (`kldiv_inline.bench`): every provider is checked
    against float64 before it is timed (a wrong one is reported, not timed); CUDA events after warm-up, the L2
    cache flushed before each call when the inputs fit in it, inputs rotated among several sets; the median
    with 20% and 80% quantiles. The **floor** is the bytes that must move (each input read once; for
    forward + backward the gradient written once too) over the read bandwidth measured at the start.

    The figures are drawn by `kldiv_inline.plots`, the functions that draw `results/<device>/*.png`, so the
    last section can lay this run beside the committed results of the same device.

    Without a GPU the harness times the CPU twin against eager PyTorch on the CPU with a wall clock, at small
    sizes: a run of the same code path, not a performance claim. torch.compile and Liger are GPU peers here.
    '''),
    code(PARAMETERS_HEAD + r'''
# FULL: the cases of `python -m kldiv_inline bench` (bench.headline_cases and bench.sweep_cases), so the
# plots match the committed ones. Otherwise: float32 probability rows of QUICK_FEATURES, QUICK_BATCHES rows.
QUICK_FEATURES = 1024
QUICK_BATCHES = (16, 64, 256, 1024)
REPS = 30 if FULL else 5  # timed calls per provider and case
BANDWIDTH_BYTES = 1 << 30 if DEVICE == "cuda" else 64 << 20  # buffer of the read-bandwidth measurement
''', "parameters"),
    code(SETUP),
    md(r'''
    ## The cases and the floor

    Each `bench.Case` is a form (`probs`: probabilities in, the log taken inside; `logprobs`: PyTorch's
    convention), a dtype, a shape, the passes to time (`fwd`, `fwd+bwd`) and a timer (`cuda` events, or
    `wall`: back-to-back calls from Python, for launch-bound sizes where host time is the cost). The
    headline cases are the sizes whose speed-ups the README quotes; the sweep goes from tiny to more than the
    L2 cache.
    '''),
    code(r'''
    from kldiv_inline import bench

    TIMER = "cuda" if DEVICE == "cuda" else "wall"
    if FULL:
        headline, sweep = bench.headline_cases(DEVICE), bench.sweep_cases(DEVICE)
    else:
        sweep = [bench.Case("probs", torch.float32, b, QUICK_FEATURES, ("fwd", "fwd+bwd"), TIMER)
                 for b in QUICK_BATCHES]
        headline = [bench.Case("probs", torch.float32, 4 * QUICK_BATCHES[-1], QUICK_FEATURES, ("fwd", "fwd+bwd"),
                               TIMER)]
    for case in headline + sweep:
        print(f"{'headline' if case in headline else 'sweep':<9}{case.form:<9}{str(case.dtype):<15}"
              f"{case.batch:>6} x {case.features:<7}{', '.join(case.passes):<14}timer {case.timer}")

    read_gbps, copy_gbps = bench.read_bandwidth_gbps(DEVICE, BANDWIDTH_BYTES)
    print(f"\nmeasured on {DEVICE}: read {read_gbps:.0f} GB/s, copy {copy_gbps:.0f} GB/s (read + write)")
    '''),
    md(r'''
    ## Timing

    `bench.run_case` times our op and the peers that exist on this device (`bench.providers`: on a GPU
    torch.compile, and Liger when it is installed) on each case and returns one row per provider and pass;
    `bench.table` prints them. The first torch.compile call of a shape includes its compilation; warm-up
    calls absorb it.
    '''),
    code(r'''
    flush = bench.L2Flush(DEVICE)
    rows = {"headline": [], "sweep": []}
    t0 = time.perf_counter()
    for kind, cases in (("headline", headline), ("sweep", sweep)):
        for case in cases:
            rows[kind] += bench.run_case(case, DEVICE, read_gbps, variants=[], reps=REPS, warmup=3, flush=flush)
    print(bench.table(rows["headline"] + rows["sweep"]))
    print(f"\n{time.perf_counter() - t0:.0f} s")
    missing = sorted({r["impl"] for r in rows["sweep"] if r["status"] == "not installed"})
    if missing:
        print("not installed here:", ", ".join(missing))
    bad = [r for r in rows["headline"] + rows["sweep"] if r["impl"] == "kldiv_inline" and r["status"] != "ok"]
    assert not bad, bad
    '''),
    md(r'''
    ## The figures

    The rows go through the files the CLI writes (`bench.write_csv`, then `plots.load_bench`, here in a
    temporary folder), so the frame is exactly what the committed plots are drawn from. For every swept
    (pass, form, dtype): time per call against size (log-log, 20-80% bands, the floor dashed), and the
    achieved bandwidth (bytes that must move / time) against the measured read bandwidth. Then the speed-up
    of our op over each peer at the headline cases: above 1, ours is faster.

    On a CPU, inputs of a few MiB sit in its caches, so times under the "floor" (measured on a buffer of
    `BANDWIDTH_BYTES`) are possible there, and a shared machine makes the wall-clock quantiles wide.
    '''),
    code(r'''
    import json
    import tempfile

    SCRATCH = Path(tempfile.mkdtemp())


    def frame(rows):
        """The rows as the CLI stores them, read back the way the plots read committed results."""
        return plots.load_bench(bench.write_csv(rows, SCRATCH / "bench.csv"))


    def show_bench(df, read_gbps, title, cases=None):
        """Time and bandwidth against size for each swept (pass, form, dtype), then the speed-ups."""
        for pass_, form, dtype in sorted(set(zip(df["pass"], df["form"], df["dtype"]))):
            if plots.sweep_frame(df, pass_, form, dtype)["numel"].nunique() < 2:
                continue  # a single size: no curve to draw
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
            plots.plot_time_vs_size(df, pass_, form, dtype, ax=axes[0])
            plots.plot_bandwidth(df, pass_, form, dtype, read_gbps, ax=axes[1])
            fig.suptitle(title, fontsize=9)
            fig.tight_layout()
            plt.show()
        fig, ax = plt.subplots(figsize=(9, 4.5))
        plots.plot_speedups(df, cases=cases, ax=ax)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        plt.show()


    df = frame(rows["headline"] + rows["sweep"])
    HEADLINE_CASES = list(plots.headline_frame(frame(rows["headline"]))["case"].unique())
    show_bench(df, read_gbps, f"this run: {DEVICE}, torch {torch.__version__}", cases=HEADLINE_CASES)
    '''),
    md(r'''
    At the headline cases, each provider's time, its ratio to ours and its distance from the floor
    (`plots.headline_frame`, the table behind the bars):
    '''),
    code(r'''
    (plots.headline_frame(frame(rows["headline"]))
     .pivot_table(index="case", columns="impl", values=["median_ms", "x_floor"])
     .round(3))
    '''),
    md(r'''
    ## The committed results of this device

    `make results` on a machine writes `results/<device>/bench.csv` and `env.json` (card, commit, command,
    measured bandwidth). If this device has a folder there, the cell draws it with the same function as this
    run, so the two can be compared figure by figure. Expect differences where a size is launch-bound (host
    speed) and on a different card.
    '''),
    code(r'''
    from kldiv_inline.envinfo import device_slug

    committed = ROOT / "results" / device_slug(DEVICE)
    if (committed / "bench.csv").exists():
        env_file = committed / "env.json"
        env = json.loads(env_file.read_text()) if env_file.exists() else {}
        print({k: env.get(k) for k in ("device_name", "torch", "commit", "command", "date_utc", "read_gbps")})
        show_bench(plots.load_bench(committed / "bench.csv"), env.get("read_gbps"),
                   f"committed: {committed.relative_to(ROOT)}")
    else:
        folders = sorted(p.parent.name for p in (ROOT / "results").glob("*/bench.csv"))
        print(f"no committed results for this device ({committed.relative_to(ROOT)}); "
              f"results/ holds: {', '.join(folders) or 'none'}")
    '''),
]


# ------------------------------------------------------------------------------ 03 naive to roofline
NB03 = [
    md(r'''
    # 3. From the naive kernel to the roofline

    The seed's problem (KernelBench level 1 #98): `F.kl_div(torch.log(p), t, reduction="batchmean")` over
    16384 x 16384 float32 probability rows, 1 GiB per input. Every element is read once and used for a few
    arithmetic operations, so the loss is **memory-bound**: no kernel can beat the time it takes to read the
    two inputs once, the floor. This notebook walks the variants under `kernels/variants/` in order, then
    the production kernel, and for each one checks it against float64 and times it at that size:

    | step | file | what changed |
    | --- | --- | --- |
    | v0 | `v0_seed.cu` | the seed: one block per row, two logs per element, `atomicAdd`, `.item()` |
    | v1 | `v1_grid_stride.cu` | a grid sized to the GPU, 64-bit indices, xlogy, deterministic sum on the device |
    | v2 | `v2_vectorized.cu` | 16-byte loads, two vectors in flight, four accumulators |
    | v3 | `v3_ratio_log.cu` | one log per element: $t \log(t/p)$ |
    | production | `kernels/kldiv.cu` | v3's arithmetic for every dtype, layout, reduction, with the fused gradient |

    Then the launch-bound end (a small problem, where the seed's host synchronisation dominates), and the edit
    loop: change a kernel file, call the loader again, see the rebuild, see a compile error at its real line.

    The variants are CUDA only; without a GPU their cells print a note, the production op runs as its CPU
    twin at a small size, and the edit loop uses a tiny CPU-only source.
    '''),
    code(PARAMETERS_HEAD + r'''
# The seed's problem at full size; a small stand-in otherwise.
BATCH, FEATURES = (16384, 16384) if FULL else (256, 4096)
SMALL_BATCH, SMALL_FEATURES = 128, 4096  # launch-bound: host time is most of the cost
REPS = 30 if FULL else 5  # timed calls per step
BANDWIDTH_BYTES = 1 << 30 if DEVICE == "cuda" else 64 << 20  # buffer of the read-bandwidth measurement
''', "parameters"),
    code(SETUP),
    md(r'''
    ## The floor

    Reading both inputs once at the read bandwidth measured on this device (a `sum` over
    `BANDWIDTH_BYTES`): that is the time of a kernel that does nothing but read. On an H200, measured in one
    run: 4279 GB/s, so 0.50 ms for the two 1 GiB inputs.
    '''),
    code(r'''
    from kldiv_inline import bench
    from kldiv_inline.reference import kl_div_reference, relative_error
    from kldiv_inline.variants import load_variant, variant_names, variants_dir

    read_gbps, _ = bench.read_bandwidth_gbps(DEVICE, BANDWIDTH_BYTES)
    TIMER = "cuda" if DEVICE == "cuda" else "wall"
    case = bench.Case("probs", torch.float32, BATCH, FEATURES, ("fwd",), TIMER)
    floor_ms = case.bytes_moved("fwd") / read_gbps / 1e6
    print(f"{DEVICE}: read {read_gbps:.0f} GB/s; {BATCH} x {FEATURES} float32, "
          f"{case.bytes_moved('fwd') / 2**30:.3f} GiB to read: floor {floor_ms:.4f} ms")
    print("variants:", ", ".join(variant_names()))
    '''),
    md(r'''
    Each step goes through `step`: `bench.check_provider` compares the loss with float64 first (a wrong
    kernel is reported and not timed), then `bench.time_cuda` (CUDA events; the L2 cache flushed before each
    call when the inputs fit in it) or `bench.time_wall` (back-to-back calls from Python, one synchronisation
    per 50 on a GPU). The rows have the bench CSV's columns. (On a CPU, inputs of a few MiB sit in its caches:
    times under the floor are possible there.)
    '''),
    code(r'''
    x, t = bench.make_inputs(case, DEVICE)
    flush = bench.L2Flush(DEVICE)
    rows = []


    def step(impl, fn, case=case, inputs=(x, t)):
        """Check fn against float64, then time it; print one line and keep a row like bench's."""
        floor = case.bytes_moved("fwd") / read_gbps / 1e6
        row = {"device": DEVICE, "impl": impl, "pass": "fwd", "form": case.form, "dtype": "float32",
               "batch": case.batch, "features": case.features, "floor_ms": floor, "timer": case.timer}
        row["rel_err"] = err = bench.check_provider(fn, *inputs, case, "fwd")
        if not err <= bench.TOL[case.dtype]:
            print(f"{impl:<16} WRONG: relative error {err:.1e}, not timed")
            rows.append({**row, "status": "wrong"})
            return
        with torch.inference_mode():
            if case.timer == "wall" or DEVICE != "cuda":
                times = bench.time_wall(fn, [inputs], REPS, 3, DEVICE, inner=50 if DEVICE == "cuda" else 1)
            else:
                fits = case.bytes_moved("fwd") <= 2 * bench.l2_bytes(DEVICE)
                times = bench.time_cuda(fn, [inputs], REPS, 3, flush if fits else None)
        med, q20, q80 = bench.quantiles(times)
        rows.append({**row, "median_ms": med, "q20_ms": q20, "q80_ms": q80, "status": "ok",
                     "gbps": case.bytes_moved("fwd") / med / 1e6, "x_floor": med / floor})
        print(f"{impl:<16} rel err {err:.1e}   {med:9.4f} ms  ({q20:.4f}-{q80:.4f})   {med / floor:6.2f} x floor")


    def run_variant(name, case=case, inputs=(x, t)):
        if DEVICE != "cuda":
            print(f"{name:<16} skipped: the variants are CUDA kernels and there is no GPU here")
            return
        step(name, load_variant(name).kl_div_probs_batchmean, case, inputs)
    '''),
    md(r'''
    ## v0: the seed

    One thread block of 256 threads per row, each thread striding over the row's features with two accurate
    `logf` calls per element (`t * (log t - log p)`); a shared-memory tree per block writes one partial per
    row; a second kernel of 64 blocks adds the partials with a float `atomicAdd` (in arbitrary order: the last
    bits change from run to run); then `.item()` copies the sum to the host, waits for the GPU, divides on the
    CPU and copies a one-element tensor back. Notebook 1 shows its wrong answers; here its speed.

    At this size one block per row is fine (16384 blocks keep the GPU busy), and the copy and the wait cost
    little next to reading 2 GiB: measured on an H200 in one run, 0.67 ms, 1.34x the floor. The flaws that
    matter are elsewhere: correctness, and the small sizes below.
    '''),
    code(r'''
    run_variant("v0_seed")
    '''),
    md(r'''
    ## v1: the seed's design fixed, not yet tuned

    A grid sized to the GPU (as many blocks of 512 as fit on all SMs at once) walking the whole tensor with a
    grid-stride loop; 64-bit indices; xlogy semantics (a zero target contributes 0); warp-shuffle block sums
    written as double partials; a one-block kernel adds them in a fixed order and writes the 0-d result on the
    device. Deterministic, no atomics, no host synchronisation, any number of dimensions.

    It is *slower* than v0 at this size (measured on an H200 in one run: 0.73 ms against 0.67 ms). Each
    element still costs two scalar loads and two accurate `logf` of about twenty instructions each: at this
    size that work is already close to what the SMs can issue while the memory streams, so the few
    instructions v1 adds per element (64-bit index arithmetic, the zero-target test) show up as time. Fixing
    correctness first and speed after keeps the two apart; v2 and v3 take the instructions back out.
    '''),
    code(r'''
    run_variant("v1_grid_stride")
    '''),
    md(r'''
    ## v2: wider loads, more bytes in flight

    16-byte loads (`float4` through the read-only path), two vectors of each input in flight per iteration,
    four independent accumulators per thread. One load instruction now brings four elements, and the loop's
    index arithmetic is shared by eight: fewer instructions per element. And a streaming kernel is limited by
    the bytes it keeps in flight: four times the bytes per load, two loads issued before the first is used.
    Same arithmetic as v1. Measured on an H200 in one run: 0.61 ms, 1.21x the floor. The changes:
    '''),
    code(r'''
    import difflib


    def show_diff(a, b):
        """The lines that differ between two variant files, with one line of context."""
        old = (variants_dir() / f"{a}.cu").read_text().splitlines()
        new = (variants_dir() / f"{b}.cu").read_text().splitlines()
        for line in difflib.unified_diff(old, new, f"{a}.cu", f"{b}.cu", n=1, lineterm=""):
            print(line)


    show_diff("v1_grid_stride", "v2_vectorized")
    run_variant("v2_vectorized")
    '''),
    md(r'''
    ## v3: one log per element

    $t(\log t - \log p) = t \log(t/p)$: one IEEE division and one accurate `logf` instead of two `logf`. With
    the loads now wide, the two logs per element were what kept v2 from the floor; the ratio form halves that
    work and, as a bonus, avoids cancelling two logs of similar size. The literal formula stays for the cases
    where the ratio is not a normal number (t = 0, p <= 0, infinities, NaN, over- and underflow), so the
    semantics are PyTorch's. The float accumulators are emptied into a double every 8 iterations, which keeps
    the relative error near 1e-8 at 2^28 terms. Measured on an H200 in one run: 0.52 ms, 1.03x the floor.
    '''),
    code(r'''
    show_diff("v2_vectorized", "v3_ratio_log")
    run_variant("v3_ratio_log")
    '''),
    md(r'''
    ## Production: `kldiv_inline.kl_div_from_probs`

    v3's arithmetic in `kernels/kldiv.cu`, for every floating dtype (the hardware log for 16-bit inputs,
    whose error is far below their resolution), strided and broadcast operands, the four reductions and both
    input forms, plus the fused gradient of the training pass, behind PyTorch's checks and autograd
    (`kldiv_inline/ops.py`). Measured on an H200 in one run: 0.518 ms, 1.03x the floor. Without a GPU this
    is the CPU twin.

    For context, the peers on the same inputs (`bench.providers`): PyTorch eager (a `log` pass, then
    `kl_div`), and on a GPU torch.compile and Liger (which takes log-probabilities, so `torch.log` first) when
    installed. Measured on an H200 in one run: eager 2.74 ms, torch.compile 0.64 ms, Liger with its
    `torch.log` 0.99 ms.
    '''),
    code(r'''
    for impl, fn in bench.providers(case, DEVICE, [], "fwd").items():
        if fn is None:
            print(f"{impl:<16} not installed")
        else:
            step(impl, fn)
    '''),
    md(r'''
    Every step against the floor (the dashed line), from this run:
    '''),
    code(r'''
    done = [r for r in rows if r["status"] == "ok" and r["batch"] == BATCH]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(done) + 1.2))
    ax.barh([r["impl"] for r in done], [r["median_ms"] for r in done],
            xerr=[[r["median_ms"] - r["q20_ms"] for r in done], [r["q80_ms"] - r["median_ms"] for r in done]],
            color=[plots.COLORS.get(r["impl"], "tab:gray") for r in done])
    ax.axvline(floor_ms, color="k", ls="--", lw=1, label=f"floor {floor_ms:.3f} ms")
    ax.invert_yaxis()
    ax.set_xlabel("median time per call (ms)")
    ax.set_title(f"{BATCH} x {FEATURES} float32, forward, {DEVICE}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    '''),
    md(r'''
    ## The launch-bound end: 128 x 4096

    At 2 MiB per input the GPU reads the data in about a microsecond; what a call costs is the host's work
    to launch it. Timed end to end from Python (50 back-to-back calls, one synchronisation), the seed's
    `.item()` stands out: every call waits for the GPU and copies twice. Measured on an H200 in one run: v0
    46 us, v1 16 us (no synchronisation), production 13.8 us (a fast path in `ops.py` skips the checks that
    the C++ side repeats anyway).
    '''),
    code(r'''
    small = bench.Case("probs", torch.float32, SMALL_BATCH, SMALL_FEATURES, ("fwd",), "wall")
    small_inputs = bench.make_inputs(small, DEVICE)
    for name in ("v0_seed", "v1_grid_stride"):
        run_variant(name, small, small_inputs)
    step("kldiv_inline", K.kl_div_from_probs, small, small_inputs)
    '''),
    md(r'''
    ## The edit loop

    The loader hashes every source and every header it includes; an edit gives a new module name, so the
    next `load_sources` call rebuilds (or finds that build in the cache), and the old module stays importable
    beside it. Sources are compiled with `#line` directives, so a compiler error names the real file and line,
    and `KernelBuildError.errors` holds those lines.

    Below, a copy of a kernel in a temporary folder: on a GPU, `v3_ratio_log.cu` with its bindings (we change
    its block size); without one, a tiny C++ module in plain CPython API (no torch headers: it compiles in
    about a second) whose only function returns a constant. The builds of this section go to a temporary
    cache, removed at the end. (For the kit's own kernels the loop is the same: edit `kernels/kldiv.cu`, then
    `kldiv_inline.ops.reload()`.)
    '''),
    code(r'''
    import shutil
    import tempfile

    WORK = Path(tempfile.mkdtemp(prefix="kldiv_edit_loop_")).resolve()
    os.environ["KLDIV_INLINE_CACHE"] = str(WORK / "cache")  # this section's builds stay in WORK

    TINY_CPP = """\
    // A module with one function, value(), in plain CPython API: no torch headers, a one-second build.
    #include <Python.h>
    static const long kValue = 7;
    static PyObject* value(PyObject*, PyObject*) { return PyLong_FromLong(kValue); }
    static PyMethodDef methods[] = {{"value", value, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
    #define STR_(x) #x
    #define STR(x) STR_(x)
    #define CAT_(a, b) a##b
    #define CAT(a, b) CAT_(a, b)
    static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
    PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
    """

    if DEVICE == "cuda":
        for name in ("v3_ratio_log.cu", "variant_bindings.cpp"):
            shutil.copy(variants_dir() / name, WORK / name)
        SOURCES = [WORK / "v3_ratio_log.cu", WORK / "variant_bindings.cpp"]
        ORIGINAL, EDITED = "constexpr int kThreads = 512;", "constexpr int kThreads = 256;"
    else:
        (WORK / "tiny.cpp").write_text(TINY_CPP)
        SOURCES = [WORK / "tiny.cpp"]
        ORIGINAL, EDITED = "static const long kValue = 7;", "static const long kValue = 8;"


    def edit(old, new):
        """Replace one line of the kernel file, as an editor would."""
        text = SOURCES[0].read_text()
        assert text.count(old) == 1, old
        SOURCES[0].write_text(text.replace(old, new))
        line = text[:text.index(old)].count("\n") + 1
        print(f"edited {SOURCES[0].name}:{line}: {new}")


    def build():
        """load_sources, timed; then what the module computes."""
        t0 = time.perf_counter()
        mod = K.load_sources(SOURCES)
        print(f"module {mod.__name__}, ready in {time.perf_counter() - t0:.2f} s")
        if DEVICE == "cuda":
            loss = mod.kl_div_probs_batchmean(x, t)
            ref = kl_div_reference(x, t, "batchmean", from_probs=True)
            print(f"  loss {loss.item():.6f}, rel err {relative_error(loss, ref):.1e}")
        else:
            print(f"  value() = {mod.value()}")
        return mod


    first = build()
    '''),
    md(r'''
    Change a constant and load again: a new hash, a new name, a new build.
    '''),
    code(r'''
    edit(ORIGINAL, EDITED)
    second = build()
    assert second.__name__ != first.__name__
    if DEVICE == "cuda":
        step("v3, 256 threads", second.kl_div_probs_batchmean)
    '''),
    md(r'''
    A deliberate bug: a compile error. The build fails with `KernelBuildError`; its `.errors` are the
    compiler's lines, and they name the file we edited and the line of the edit, not a generated `main.cpp`
    or `cuda.cu` in the build folder.
    '''),
    code(r'''
    edit(EDITED, EDITED.replace(";", " +;"))
    try:
        build()
        raise AssertionError("the broken source compiled")
    except K.KernelBuildError as e:
        print("KernelBuildError; the first of its .errors, with the source line:")
        print("\n".join(e.errors[:3]))
        assert str(SOURCES[0]) in e.errors[0]
    '''),
    md(r'''
    Undo the bug: the sources hash to the second version again, so the loader returns that module at once,
    with no build.
    '''),
    code(r'''
    edit(EDITED.replace(";", " +;"), EDITED)
    again = build()
    assert again is second

    del os.environ["KLDIV_INLINE_CACHE"]
    shutil.rmtree(WORK, ignore_errors=True)
    '''),
]


NOTEBOOKS = {
    "01_correctness.ipynb": NB01,
    "02_performance.ipynb": NB02,
    "03_naive_to_roofline.ipynb": NB03,
}


def notebooks() -> dict[str, nbformat.NotebookNode]:
    """Every notebook of this folder, by file name, as this script writes it."""
    out = {}
    for name, cells in NOTEBOOKS.items():
        prefix = name.split("_")[0]
        for i, cell in enumerate(cells):
            cell.id = f"nb{prefix}-{i:02d}"
        nb = new_notebook(cells=cells, metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        })
        nbformat.validate(nb)
        out[name] = nb
    return out


def main() -> None:
    for name, nb in notebooks().items():
        nbformat.write(nb, HERE / name)
        print(HERE / name)


if __name__ == "__main__":
    main()
