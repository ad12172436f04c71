# %% [markdown]
# # 1. Correctness: the kit's KL divergence against PyTorch in float64
#
# `kldiv_inline.kl_div` has `torch.nn.functional.kl_div`'s signature and semantics; `kl_div_from_probs`
# takes probabilities and takes their log inside the kernel (`F.kl_div(torch.log(p), t)` in one pass). This
# notebook checks both against PyTorch's own `kl_div` evaluated in float64 (`kldiv_inline.reference`):
#
# 1. the compiled module and one call: value, shape, dtype;
# 2. every reduction, dtype, shape and memory layout;
# 3. the edge cases: zeros in the target, infinities, NaN, empty tensors;
# 4. gradients, against float64 autograd and finite differences;
# 5. the kit's whole check grid, as `python -m kldiv_inline check` runs it;
# 6. where the seed's naive kernel goes wrong on the same inputs, and ours doesn't;
# 7. how the error grows with the problem's size, per dtype.
#
# Without a GPU everything runs on the CPU twin (`kernels/kldiv_cpu.cpp`), which shares its per-element
# arithmetic with the CUDA kernels (`kernels/kldiv_common.h`); the seed is CUDA only, so its cells print a
# note there and show our op on the same inputs.

# %% tags=["parameters"]
# Parameters: the only cell to edit. FULL: the sizes of a GPU study; without a GPU a quick CPU run.
# KLDIV_NB_FULL=1 or 0 in the environment overrides the default either way.
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("KLDIV_NB_FULL", "1" if DEVICE == "cuda" else "0") == "1"

# Sizes of the error-against-size sweep (section 7): elements per input, rows of 1024 probabilities.
SWEEP_NUMEL = [2**k for k in (range(10, 29, 3) if FULL else range(10, 21, 2))]

# %%
import sys
import time
from pathlib import Path

ROOT = Path.cwd().resolve().parent  # this notebook runs in <repo>/notebooks
if (ROOT / "kldiv_inline").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the kit straight from the checkout

import matplotlib.pyplot as plt

import kldiv_inline as K
from kldiv_inline import harness, plots

# %matplotlib inline

print(f"device {DEVICE}, FULL={FULL}, torch {torch.__version__}")

# %% [markdown]
# ## 1. The compiled module
#
# `K.load(backend)` builds `kernels/kldiv.cu` (or the CPU twin) with the bindings on first use and caches the
# build under `~/.cache/kldiv_inline`, keyed on a hash of every source and header it includes: a new process
# imports the cached `.so` directly, an edited kernel gets a new name and a new build. The op picks the
# module from the tensors' device, so code that only computes losses never calls `load` itself.

# %%
t0 = time.perf_counter()
module = K.load(DEVICE)
print(f"{module.__name__}: backend {module.backend()!r}, loaded in {time.perf_counter() - t0:.2f} s")
print(module.__file__)

# %% [markdown]
# ## One call: the number, its shape and its dtype
#
# The seed's problem: rows of probabilities `p` (predictions) and `t` (targets), loss
# $\sum_{ij} t_{ij}(\log t_{ij} - \log p_{ij}) / \text{batch}$. The inputs below are softmax rows with a random
# temperature (`reference.probability_rows`). The result is a 0-d tensor of the inputs' dtype, as PyTorch's.
# `relative_error` is $\lVert out - ref\rVert / \lVert ref\rVert$ in float64, and infinite when the two
# disagree on where the NaN and infinite values are.

# %%
from IPython.display import display

from kldiv_inline.reference import kl_div_reference, probability_rows, relative_error

p = probability_rows(64, 1000, device=DEVICE)
t = probability_rows(64, 1000, device=DEVICE)
ours = K.kl_div_from_probs(p, t)  # reduction="batchmean", the seed's
ref = kl_div_reference(p, t, "batchmean", from_probs=True)
print(f"kldiv_inline  {ours.item():.9f}  shape {tuple(ours.shape)}  {ours.dtype}")
print(f"float64       {ref.item():.9f}  shape {tuple(ref.shape)}  {ref.dtype}")
print(f"relative error {relative_error(ours, ref):.1e}")

# %% [markdown]
# ## 2. Every reduction, each input form
#
# `reduction="none"` is compared element by element: a kernel that skipped or misplaced elements cannot hide
# behind a sum. The three forms are PyTorch's (`input` = log-probabilities), the same with `log_target=True`,
# and the fused probability form. `"mean"` divides by every element, not by the batch, and warns as PyTorch
# does; the warning is silenced here.
#
# From here on the comparisons go through `harness.check`, the kit's one check for any op (the notebook 4
# uses it on a kernel of its own): it runs the reference on the same inputs upcast to float64, runs the op
# with fresh memory poisoned (NaN: an element a kernel forgets to write cannot pass), and compares output by
# output (shape, NaN and inf in the same places, relative error against the dtype's tolerance).

# %%
import warnings

import pandas as pd

from kldiv_inline.ops import REDUCTIONS

logp = p.log()
FORMS = {  # name: (our op, its inputs, log_target, from_probs)
    "probs": (K.kl_div_from_probs, (p, t), False, True),
    "logprobs": (K.kl_div, (logp, t), False, False),
    "log_target": (K.kl_div, (logp, t.log()), True, False),
}


def check_forms(provider, reference, **options):
    """harness.check of provider(op, reduction, log_target) against reference(reduction, log_target,
    from_probs), for every reduction and form: one frame, one row each."""
    frames = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reduction in REDUCTIONS:
            for name, (op, args, log_target, from_probs) in FORMS.items():
                case = harness.Case(f"{reduction} {name}", args, {"reduction": reduction, "form": name})
                frames.append(harness.check({"kldiv_inline": provider(op, reduction, log_target)},
                                            reference(reduction, log_target, from_probs), [case], **options))
    return pd.concat(frames, ignore_index=True)


def loss(op, reduction, log_target):
    return lambda x, y: op(x, y, reduction=reduction, log_target=log_target)


def reference_loss(reduction, log_target, from_probs):
    return lambda x, y: kl_div_reference(x, y, reduction, log_target, from_probs)


checked = check_forms(loss, reference_loss)
display(checked.pivot_table(index="reduction", columns="form", values="rel_err", sort=False))
assert checked["ok"].all(), checked[~checked["ok"]]
for op, args, log_target, _ in FORMS.values():  # the result's dtype is the inputs', as PyTorch's
    assert all(loss(op, r, log_target)(*args).dtype == args[0].dtype for r in ("none", "sum"))

# %% [markdown]
# ## Dtypes
#
# float16 and bfloat16 inputs are computed in float32; float32 sums stay in float32 for a few terms per
# thread and go on in double; float64 is float64 throughout. The reference takes the same (rounded) inputs,
# so the error below is the kernel's own, including the rounding of the result to the input's dtype.
# Tolerances are `harness.TOLERANCE`: a few units of each dtype's rounding.

# %%
from kldiv_inline.harness import TOLERANCE

FLOAT_DTYPES = [dtype for dtype in TOLERANCE if dtype.is_floating_point]  # (the table has complex ones too)
by_dtype = [harness.Case(str(dtype).removeprefix("torch."), (p.to(dtype), t.to(dtype))) for dtype in FLOAT_DTYPES]
checked = harness.check({"kldiv_inline": K.kl_div_from_probs}, reference_loss("batchmean", False, True), by_dtype)
display(checked[["case", "rel_err", "tol", "ok"]])
assert checked["ok"].all()
assert all(K.kl_div_from_probs(*case.args).dtype == case.args[0].dtype for case in by_dtype)

# %% [markdown]
# ## Shapes and memory layouts
#
# `kldiv_inline.check.CASES` holds the inputs on which hand-written kernels usually slip: a 0-d scalar, an
# odd length, 3-D rows, transposed and sliced views (strided, unaligned starts) and broadcast operands. The
# kernels read each operand through its strides (`kernels/kldiv_plan.h` merges the dimensions it can), so a
# view costs no copy. `check.check_one` compares the loss with float64 and returns the relative error (infinite
# for a wrong shape or dtype); `check.check_grads` does the same for both operands' gradients.

# %%
from kldiv_inline import check

print(f"{'case':<22}{'input shape':>14}{'contiguous':>12}{'none':>10}{'batchmean':>11}")
for case in check.CASES:
    x, y = case.make(torch.float32, DEVICE, True, False)  # (dtype, device, from_probs, log_target)
    errors = [check.check_one(x, y, reduction, False, True) for reduction in ("none", "batchmean")]
    print(f"{case.name:<22}{str(tuple(x.shape)):>14}{str(x.is_contiguous()):>12}"
          f"{errors[0]:>10.1e}{errors[1]:>11.1e}")
    assert max(errors) <= TOLERANCE[torch.float32]

# %% [markdown]
# ## 3. Edge cases
#
# One element per situation, with `reduction="none"`:
#
# - a target of 0: PyTorch defines $0 \cdot \log 0 = 0$ (`xlogy`), so the term is 0, not NaN;
# - a prediction of 0 where the target is not: an infinite loss, the true KL divergence;
# - both 0: $\log 0 = -\infty$ times 0 is NaN in PyTorch's formula, and so in ours;
# - infinite and NaN inputs propagate as PyTorch's do.
#
# Then empty inputs: the sum of nothing is 0; `mean` and `batchmean` divide 0 by 0, NaN, as in PyTorch.

# %%
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

# %%
empty = torch.empty(0, 5, device=DEVICE)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for reduction in REDUCTIONS:
        out = K.kl_div_from_probs(empty, empty, reduction)
        ref = kl_div_reference(empty, empty, reduction, from_probs=True)
        print(f"{reduction:<10} kldiv_inline {str(out.tolist()):>5} shape {tuple(out.shape)}   "
              f"float64 {str(ref.tolist()):>5} shape {tuple(ref.shape)}")
        assert out.shape == ref.shape and relative_error(out, ref) == 0

# %% [markdown]
# ## 4. Gradients
#
# Autograd through the op against autograd through `F.kl_div` in float64, with respect to the input and to
# the target, for every reduction (a random weighting stands for the upstream gradient of `"none"`). When
# the input requires grad and the loss is reduced, the forward pass already writes d loss / d input (one
# write more, no extra read) and backward only scales it: the training step costs one pass over the data.
#
# The providers return both gradients; `setup` gives every call (the reference's too) fresh leaves that
# require grad. The tolerance is two roundings of float32: the fused gradient is rounded when written and
# again when scaled by the upstream gradient.

# %%
weight = torch.randn(p.shape, dtype=torch.float64, device=DEVICE)


def gradients(loss_fn, reduction):
    """d loss / d input and d loss / d target by autograd, through loss_fn."""
    def grads(x, y):
        out = loss_fn(x, y)
        out.backward(weight.to(out.dtype) if reduction == "none" else None)
        return x.grad, y.grad
    return grads


def leaves(x, y):
    return x.detach().requires_grad_(), y.detach().requires_grad_()


checked = check_forms(lambda op, r, lt: gradients(loss(op, r, lt), r),
                      lambda r, lt, fp: gradients(reference_loss(r, lt, fp), r),
                      setup=leaves, tolerance={torch.float32: 2e-5})
display(checked.pivot_table(index="reduction", columns="form", values="rel_err", sort=False))
assert checked["ok"].all(), checked[~checked["ok"]]

# %% [markdown]
# `torch.autograd.gradcheck` compares those gradients with finite differences, in float64, for both
# operands. (At a target of exactly 0 PyTorch's own gradient with respect to the target is NaN; the kit
# returns the same, so the check uses positive targets.)

# %%
a = probability_rows(4, 16, dtype=torch.float64, device=DEVICE, scale=1.0).requires_grad_()
b = probability_rows(4, 16, dtype=torch.float64, device=DEVICE, scale=1.0).requires_grad_()
for reduction in ("none", "sum", "batchmean"):
    ok = torch.autograd.gradcheck(lambda a, b, r=reduction: K.kl_div_from_probs(a, b, r), (a, b))
    ok &= torch.autograd.gradcheck(lambda a, b, r=reduction: K.kl_div(a.log(), b, reduction=r), (a, b))
    print(f"gradcheck {reduction:<10} {ok}")

# %% [markdown]
# ## 5. The whole grid
#
# `python -m kldiv_inline check` runs every case above in every dtype, both input forms, with and without
# `log_target`, in every reduction, on fresh random inputs, and writes `results/<device>/correctness.csv`: a row for
# the loss (with reduction='none', each element within the tolerance of its own terms' size, so that one wrong
# element among small ones shows) and one for each operand's gradient (each element likewise, one unit in the last
# place allowed: a float16 mean's gradients lie in the subnormals). Here the same function,
# `check.run_checks`, with its summary; the figure is `plots.plot_correctness`, the drawing of
# `results/<device>/correctness.png`. The CSV goes to a temporary folder, not into `results/`.

# %%
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

# %% [markdown]
# ## 6. Where the seed's design fails, and ours doesn't
#
# The seed, the naive CUDA kernel this kit started from (reproduced in `kernels/variants/v0_seed.cu`),
# computes the same loss with one block per row, two logs per element, a float `atomicAdd`, then `.item()`
# and a new one-element tensor. It takes the tensors' data pointers and its first two sizes at face value.
# On a GPU the cells below print what it returns beside the float64 reference: a `[1]`-shaped result, NaN
# where a target is 0, a plausible but wrong value for a non-contiguous input, and a value computed from a
# small part of a 3-D input.
#
# The inputs are KernelBench's own (`kldiv_inline.kernelbench.get_inputs`: softmax of uniform noise, rows
# close to uniform), at smaller sizes, or peaked rows where that shows a failure better. These cells are a
# demonstration, not a check: each cell draws its inputs on the CPU from a fixed seed (`demo_inputs`), so a
# rerun prints the same figures on the same device (up to the last bits of the seed kernel's atomic sum); the
# checks draw fresh inputs every run (`demo_inputs` puts the global generator back as it was). The seed is
# CUDA only: without a GPU the cells below say so and still run our op on the same inputs.

# %%
from kldiv_inline import kernelbench
from kldiv_inline.variants import load_variant

DEMO_SEED = 0  # the demonstration's inputs, the same on every run (the checks draw fresh ones)


def demo_inputs(draw):
    """draw() from DEMO_SEED on the CPU's global generator, which is then put back as it was: the same inputs
    on every run, and the checks after this section still draw fresh ones."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(DEMO_SEED)
        return draw()


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


# %% [markdown]
# **The result's shape.** PyTorch returns a 0-d scalar; the seed a one-element vector. KernelBench's checker
# compares shapes first, so it fails the seed on any input; in a training loop the `[1]` broadcasts silently.

# %%
p, t = demo_inputs(lambda: kernelbench.get_inputs(128, (4096,), device=DEVICE))
compare("128 x 4096 float32", p, t)

# %% [markdown]
# **Zeros in the target.** `t * log(t)` at `t = 0` is `0 * -inf`, NaN; PyTorch's `xlogy` defines it as 0.
# Sparse or smoothed-then-truncated targets hit this all the time.

# %%
def with_zeros():
    """The cell above's inputs again, and which targets to set to 0."""
    p, t = kernelbench.get_inputs(128, (4096,), device=DEVICE)
    return p, t, (torch.rand(t.shape) < 0.3).to(DEVICE)


p, t, zeros = demo_inputs(with_zeros)
t_zeros = t.masked_fill(zeros, 0.0)
t_zeros = t_zeros / t_zeros.sum(-1, keepdim=True)  # still probability rows
compare("the same, 30% of the targets 0", p, t_zeros)

# %% [markdown]
# **A non-contiguous input.** `p.t().contiguous().t()` holds the same values as `p`, stored column by
# column. The seed walks memory as if it were row-major and pairs each target with the wrong prediction: a
# plausible, wrong number. Our kernel reads through the strides. KernelBench's rows are so close to uniform
# that a wrong pairing barely moves the loss, so the rows here are more peaked (`probability_rows` with a
# softmax temperature of 2).

# %%
p, t = demo_inputs(lambda: [probability_rows(128, 4096, device=DEVICE, scale=2.0) for _ in range(2)])
p_columns = p.t().contiguous().t()  # same values, column-major storage
assert torch.equal(p_columns, p) and not p_columns.is_contiguous()
compare("peaked rows, predictions stored row-major", p, t)
compare("the same values, predictions stored column-major", p_columns, t)

# %% [markdown]
# **A 3-D input.** The seed reads sizes 0 and 1 as (batch, features): (4, 8, 100) is taken for 4 rows of 8,
# and 3168 of the 3200 elements are never read. `batchmean` divides by the first dimension, 4, in both.

# %%
p3, t3 = demo_inputs(lambda: kernelbench.get_inputs(4, (8, 100), device=DEVICE))
compare("4 x 8 x 100 float32", p3, t3)
print(f"  the seed's (batch, features): {tuple(p3.shape[:2])}, {p3.shape[0] * p3.shape[1]} of {p3.numel()} elements")

# %% [markdown]
# **Other dtypes and training.** The seed takes float32 only, and it has no backward: its result is a fresh
# tensor with no autograd history. Ours takes every floating dtype and backpropagates.

# %%
p, t = demo_inputs(lambda: kernelbench.get_inputs(128, (4096,), device=DEVICE))
compare("128 x 4096 float16", p.half(), t.half())

x = p.detach().requires_grad_()
K.kl_div_from_probs(x, t).backward()
print("kldiv_inline: d loss / d p computed, finite:", bool(x.grad.isfinite().all()))
if seed is not None:
    out = seed.kl_div_probs_batchmean(x, t)
    print("seed: result requires grad:", out.requires_grad, "(no backward: not usable as a training loss)")

# %% [markdown]
# What fixed each: the kit's kernels write a 0-d result on the device (no `.item()`, no host copy), use
# PyTorch's `xlogy` semantics (`kernels/kldiv_common.h`), plan the iteration from sizes and strides over any
# number of dimensions (`kernels/kldiv_plan.h`), dispatch over the floating dtypes, and are registered with
# autograd (`kldiv_inline/ops.py`). What the seed's host synchronisation costs in time is in notebook 3.
#
# ## 7. Relative error against size, per dtype
#
# A sum of $n$ float32 terms added one by one loses about $n \epsilon$ of its value; the kernels keep short
# float32 sums per thread and add those in double, so the error should stay flat as $n$ grows. Below:
# `batchmean` of rows of 1024 probabilities (softmax of unit-variance logits, so that none rounds to 0 in
# 16 bits) against float64 of the same rounded inputs, per dtype, over `SWEEP_NUMEL` elements. Dotted lines:
# the tolerances of `harness.TOLERANCE`. For 16-bit inputs the error is mostly the rounding of the result
# itself to 16 bits.

# %%
FEATURES = 1024
errors = {dtype: [] for dtype in FLOAT_DTYPES}
for numel in SWEEP_NUMEL:
    p64 = probability_rows(numel // FEATURES, FEATURES, dtype=torch.float64, device=DEVICE, scale=1.0)
    t64 = probability_rows(numel // FEATURES, FEATURES, dtype=torch.float64, device=DEVICE, scale=1.0)
    cases = [harness.Case(str(dtype), (p64.to(dtype), t64.to(dtype))) for dtype in FLOAT_DTYPES]
    del p64, t64
    checked = harness.check({"kldiv_inline": K.kl_div_from_probs}, reference_loss("batchmean", False, True), cases)
    for dtype, err in zip(FLOAT_DTYPES, checked["rel_err"]):
        errors[dtype].append(err)
    del cases

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
