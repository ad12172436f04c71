# %% [markdown]
# # 3. From the naive kernel to the roofline
#
# The seed's problem (KernelBench level 1 #98): `F.kl_div(torch.log(p), t, reduction="batchmean")` over
# 16384 x 16384 float32 probability rows, 1 GiB per input. Every element is read once and used for a few
# arithmetic operations, so the loss is **memory-bound**: no kernel can beat the time it takes to read the
# two inputs once, the floor. This notebook walks the variants under `kernels/variants/` in order, then
# the production kernel, and for each one checks it against float64 and times it at that size:
#
# | step | file | what changed |
# | --- | --- | --- |
# | v0 | `v0_seed.cu` | the seed: one block per row, two logs per element, `atomicAdd`, `.item()` |
# | v1 | `v1_grid_stride.cu` | a grid sized to the GPU, 64-bit indices, xlogy, deterministic sum on the device |
# | v2 | `v2_vectorized.cu` | 16-byte loads, two vectors in flight, four accumulators |
# | v3 | `v3_ratio_log.cu` | one log per element: $t \log(t/p)$ |
# | production | `kernels/kldiv.cu` | v3's arithmetic for every dtype, layout, reduction, with the fused gradient |
#
# Then the launch-bound end (a small problem, where the seed's host synchronisation dominates), and the edit
# loop: change a kernel file, call the loader again, see the rebuild, see a compile error at its real line.
#
# The variants are CUDA only; without a GPU their cells print a note, the production op runs as its CPU
# twin at a small size, and the edit loop uses a tiny CPU-only source.

# %% tags=["parameters"]
# Parameters: the only cell to edit. FULL: the sizes of a GPU study; without a GPU a quick CPU run.
# KLDIV_NB_FULL=1 or 0 in the environment overrides the default either way.
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("KLDIV_NB_FULL", "1" if DEVICE == "cuda" else "0") == "1"

# The seed's problem at full size; a small stand-in otherwise.
BATCH, FEATURES = (16384, 16384) if FULL else (256, 4096)
SMALL_BATCH, SMALL_FEATURES = 128, 4096  # launch-bound: host time is most of the cost
REPS = 30 if FULL else 5  # timed calls per step
BANDWIDTH_BYTES = 1 << 30 if DEVICE == "cuda" else 64 << 20  # buffer of the read-bandwidth measurement

# %%
import sys
import time
from pathlib import Path

ROOT = Path.cwd().resolve().parent  # this notebook runs in <repo>/notebooks
if (ROOT / "kldiv_inline").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the kit straight from the checkout

import matplotlib.pyplot as plt

import kldiv_inline as K
from kldiv_inline import plots

# %matplotlib inline

print(f"device {DEVICE}, FULL={FULL}, torch {torch.__version__}")

# %% [markdown]
# ## The floor
#
# Reading both inputs once at the best read bandwidth measured on this device (`kldiv_inline.floors`: a
# `sum` over `BANDWIDTH_BYTES` and, on a GPU, the kit's own read kernel, `kernels/read_floor.cu`): that is
# the time of a kernel that does nothing but read. The floors of the committed GPU runs are in the next
# section's table.

# %%
from kldiv_inline import bench, floors, harness
from kldiv_inline.variants import load_variant, variant_names, variants_dir

floor = floors.measure_floor(DEVICE, BANDWIDTH_BYTES)
TIMER = "cuda" if DEVICE == "cuda" else "wall"
case = bench.Case("probs", torch.float32, BATCH, FEATURES, ("fwd",), TIMER)
floor_ms = floor.ms(case.bytes_moved("fwd"))
print(f"{DEVICE}: read {floor.gbps:.0f} GB/s ({floor.source}); {BATCH} x {FEATURES} float32, "
      f"{case.bytes_moved('fwd') / 2**30:.3f} GiB to read: floor {floor_ms:.4f} ms")
print("variants:", ", ".join(variant_names()))

# %% [markdown]
# ## What the committed runs measured
#
# `make results` on an H200 and on an H100 timed every step of this notebook, with the same harness, at the
# seed's size (16384 x 16384 float32 probabilities, forward, CUDA events) and at the launch-bound size of the
# last section (128 x 4096, end to end from Python). Their files are committed: `results/nvidia-h200/` and
# `results/nvidia-h100-80gb-hbm3/`, each a `bench.csv` and an `env.json` (the card, the commit the run was
# made at, its date, the floor's bandwidth and where it came from). The cell reads them and prints, per card,
# each step's median time, its ratio to the floor (`x floor`) and its time over the step before it
# (`x prev step`; below 1: faster). Every figure quoted for a GPU below is one of these rows: one run per
# card, at the commit printed; a rerun, a later commit or another card gives other numbers, and the two cards
# do not always agree on the order of neighbouring steps. `show_committed` prints one step's rows beside this
# run's.

# %%
import json

import pandas as pd
from IPython.display import display

COMMITTED = ["nvidia-h200", "nvidia-h100-80gb-hbm3"]  # folders under results/
STEPS = ["v0_seed", "v1_grid_stride", "v2_vectorized", "v3_ratio_log", "kldiv_inline"]
PEERS = ["torch_eager", "torch_compile", "liger"]
SIZES = {"16384x16384": (16384, 16384), "128x4096": (128, 4096)}


def committed_run(folder):
    """env.json, and per size of SIZES this notebook's rows of results/<folder>/bench.csv (float32
    probabilities, forward, checked ok), one per provider."""
    env = json.loads((ROOT / "results" / folder / "env.json").read_text())
    df = plots.load_bench(ROOT / "results" / folder / "bench.csv")
    df = df[(df["form"] == "probs") & (df["dtype"] == "float32") & (df["pass"] == "fwd") & (df["status"] == "ok")]
    rows = {}
    for label, (batch, features) in SIZES.items():
        at = df[(df["batch"] == batch) & (df["features"] == features)]
        assert not at["impl"].duplicated().any(), f"{folder}: two rows of one provider at {label}"
        rows[label] = at.set_index("impl")
    return env, rows


runs = {folder: committed_run(folder) for folder in COMMITTED if (ROOT / "results" / folder / "bench.csv").exists()}


def committed_table(rows):
    """One run's rows as a table: per size, each provider's median, x floor and time over the step before."""
    table = pd.DataFrame(index=[i for i in STEPS + PEERS if any(i in r.index for r in rows.values())])
    for label, r in rows.items():
        unit, scale = ("ms", 1.0) if label == "16384x16384" else ("us", 1e3)
        table[f"{label} {unit}"] = r["median_ms"].reindex(table.index) * scale
        table[f"{label} x floor"] = r["x_floor"].reindex(table.index)
        steps = r["median_ms"].reindex(STEPS)
        table[f"{label} x prev step"] = (steps / steps.shift(1)).reindex(table.index)
    return table.round(3)


for folder, (run_env, run_rows) in runs.items():  # (names of their own: `rows` is the harness's, below)
    floors_us = ", ".join(f"{label} {r['floor_ms'].iloc[0] * 1e3:.1f} us" for label, r in run_rows.items() if len(r))
    print(f"results/{folder}: {run_env.get('device_name')}, commit {str(run_env.get('commit'))[:7]}, "
          f"{run_env.get('date_utc')}, floor {run_env.get('floor_gbps')} GB/s ({run_env.get('floor_source')}); "
          f"floor per call: {floors_us}")
    display(committed_table(run_rows))
if not runs:
    print("no committed GPU runs under results/:", ", ".join(COMMITTED))


def show_committed(impl, size="16384x16384"):
    """impl's rows at `size` in the committed runs, one line per card."""
    for env, rows in runs.values():
        if impl in rows[size].index:
            r = rows[size].loc[impl]
            print(f"{'':<16} committed at {size}, {env.get('device_name')} ({str(env.get('commit'))[:7]}): "
                  f"{r.median_ms:.4f} ms, {r.x_floor:.2f} x floor")


# %% [markdown]
# Each step goes through `step`, which hands the kernel to the kit's harness, as `python -m kldiv_inline
# bench` does: `harness.bench` checks the loss against PyTorch's in float64 first (a wrong kernel is
# reported and not timed), then times it with CUDA events (the L2 cache flushed before each call when the
# inputs are at most twice its size) or, for a `wall` case, back to back from Python (one synchronisation
# per 50 calls on a GPU). `rows` keeps the harness's rows. (On a CPU, inputs of a few MiB sit in its caches:
# times under the floor are possible there.)

# %%
x, t = bench.make_inputs(case, DEVICE)
REFERENCE = bench.reference("probs", "fwd")  # F.kl_div(torch.log(p), t, "batchmean"), run in float64
rows = []


def step(impl, fn, case=case, inputs=(x, t)):
    """Check fn against float64, then time it (harness.bench); print one line and keep the row."""
    shape = {"batch": case.batch, "features": case.features}
    hcase = harness.Case(f"{case.batch}x{case.features}", inputs, shape)
    r = harness.bench({impl: fn}, [hcase], reference=REFERENCE, bytes_moved=lambda *_: case.bytes_moved("fwd"),
                      timer=case.timer, reps=REPS, warmup=3, floor=floor, inference_mode=True).iloc[0]
    rows.append(r.to_dict())
    if r.status != "ok":
        print(f"{impl:<16} {r.status.upper()}: relative error {r.rel_err:.1e}, not timed")
        return
    peak = f"   {r.pct_of_peak:5.1f}% of peak" if r.pct_of_peak == r.pct_of_peak else ""  # NaN off a known card
    print(f"{impl:<16} rel err {r.rel_err:.1e}   {r.median_ms:9.4f} ms  ({r.q20_ms:.4f}-{r.q80_ms:.4f})   "
          f"{r.x_floor:6.2f} x floor{peak}")


def run_variant(name, case=case, inputs=(x, t)):
    if DEVICE != "cuda":
        print(f"{name:<16} skipped: the variants are CUDA kernels and there is no GPU here")
        return
    fn = load_variant(name).kl_div_probs_batchmean
    if name == "v0_seed":  # its result has shape [1] (notebook 1): compare and time its value as a 0-d view
        step(name, lambda p, t: fn(p, t).reshape(()), case, inputs)
    else:
        step(name, fn, case, inputs)


# %% [markdown]
# ## v0: the seed
#
# One thread block of 256 threads per row, each thread striding over the row's features with two accurate
# `logf` calls per element (`t * (log t - log p)`); a shared-memory tree per block writes one partial per
# row; a second kernel of 64 blocks adds the partials with a float `atomicAdd` (in arbitrary order: the last
# bits change from run to run); then `.item()` copies the sum to the host, waits for the GPU, divides on the
# CPU and copies a one-element tensor back. Notebook 1 shows its wrong answers; here its speed.
#
# At this size one block per row is fine (16384 blocks keep the GPU busy), and the copy and the wait cost
# little next to reading 2 GiB; in the committed runs v0 is off the floor by more on the H200 than on the
# H100 (its rows, below). The flaws that matter most are elsewhere: correctness, and the small sizes below.

# %%
run_variant("v0_seed")
show_committed("v0_seed")

# %% [markdown]
# ## v1: the seed's design fixed, not yet tuned
#
# A grid sized to the GPU (as many blocks of 512 as fit on all SMs at once) walking the whole tensor with a
# grid-stride loop; 64-bit indices; xlogy semantics (a zero target contributes 0); warp-shuffle block sums
# written as double partials; a one-block kernel adds them in a fixed order and writes the 0-d result on the
# device. Deterministic, no atomics, no host synchronisation, any number of dimensions.
#
# In the committed runs it is no faster than v0 at this size: slower on the H200, about level on the H100
# (the `x prev step` column). Each element still costs two scalar loads and two accurate `logf` of about
# twenty instructions each: at this size that work is likely already close to what the SMs can issue while
# the memory streams, so the few instructions v1 adds per element (64-bit index arithmetic, the zero-target
# test) can show up as time. Fixing correctness first and speed after keeps the two apart; v2 and v3 take
# instructions back out.

# %%
run_variant("v1_grid_stride")
show_committed("v1_grid_stride")

# %% [markdown]
# ## v2: wider loads, more bytes in flight
#
# 16-byte loads (`float4` through the read-only path), two vectors of each input in flight per iteration,
# four independent accumulators per thread. One load instruction now brings four elements, and the loop's
# index arithmetic is shared by eight: fewer instructions per element. And a streaming kernel is limited by
# the bytes it keeps in flight: four times the bytes per load, two loads issued before the first is used.
# Same arithmetic as v1. In the committed runs it is faster than v1 on both cards, by more on the H200, where
# v1 was further from the floor. The changes:

# %%
import difflib


def show_diff(a, b):
    """The lines that differ between two variant files, with one line of context."""
    old = (variants_dir() / f"{a}.cu").read_text().splitlines()
    new = (variants_dir() / f"{b}.cu").read_text().splitlines()
    for line in difflib.unified_diff(old, new, f"{a}.cu", f"{b}.cu", n=1, lineterm=""):
        print(line)


show_diff("v1_grid_stride", "v2_vectorized")
run_variant("v2_vectorized")
show_committed("v2_vectorized")

# %% [markdown]
# ## v3: one log per element
#
# $t(\log t - \log p) = t \log(t/p)$: one IEEE division and one accurate `logf` instead of two `logf`. With
# the loads now wide, the two logs per element are the largest per-element cost left in v2; the ratio form
# halves that work and, as a bonus, avoids cancelling two logs of similar size. The literal formula stays for
# the cases where the ratio is not a normal number (t = 0, p <= 0, infinities, NaN, over- and underflow), so
# the semantics are PyTorch's. The float accumulators are emptied into a double every 8 iterations, which
# keeps the relative error of the float32 sum small over 2^28 terms (notebook 1 measures the error against
# size). In the committed runs v3 is faster than v2 on both cards, but on the H200 it is still clearly off the
# floor (its `x floor`); the production kernel, next, comes closer there.

# %%
show_diff("v2_vectorized", "v3_ratio_log")
run_variant("v3_ratio_log")
show_committed("v3_ratio_log")

# %% [markdown]
# ## Production: `kldiv_inline.kl_div_from_probs`
#
# v3's arithmetic in `kernels/kldiv.cu`, for every floating dtype (the hardware log for 16-bit inputs,
# whose error is far below their resolution), strided and broadcast operands, the four reductions and both
# input forms, plus the fused gradient of the training pass, behind PyTorch's checks and autograd
# (`kldiv_inline/ops.py`). In the committed runs it is the fastest of the steps on both cards and the
# closest to the floor; on the H100, v2, v3 and production are close together. Without a GPU this is the CPU
# twin.
#
# For context, the peers on the same inputs (`bench.providers`): PyTorch eager (a `log` pass, then
# `kl_div`), and on a GPU torch.compile and Liger (which takes log-probabilities, so `torch.log` first) when
# installed. In the committed runs eager is several times the floor on both cards and Liger with its
# `torch.log` is between eager and torch.compile; torch.compile is about level with production on the H100
# and further from the floor than production on the H200.

# %%
for impl, fn in bench.providers(case, DEVICE, [], "fwd").items():
    if fn is None:
        print(f"{impl:<16} not installed")
    else:
        step(impl, fn)
    show_committed(impl)

# %% [markdown]
# Every step against the floor (the dashed line), from this run:

# %%
done = [r for r in rows if r["status"] == "ok" and r["batch"] == BATCH]
fig, ax = plt.subplots(figsize=(7, 0.45 * len(done) + 1.2))
ax.barh([r["provider"] for r in done], [r["median_ms"] for r in done],
        xerr=[[r["median_ms"] - r["q20_ms"] for r in done], [r["q80_ms"] - r["median_ms"] for r in done]],
        color=[plots.COLORS.get(r["provider"], "tab:gray") for r in done])
ax.axvline(floor_ms, color="k", ls="--", lw=1, label=f"floor {floor_ms:.3f} ms")
ax.invert_yaxis()
ax.set_xlabel("median time per call (ms)")
ax.set_title(f"{BATCH} x {FEATURES} float32, forward, {DEVICE}")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The launch-bound end: 128 x 4096
#
# At 2 MiB per input the floor is a small part of what a call costs (the committed `x floor` at 128x4096 is
# far above 1): the cost is the host's work to launch it. Timed end to end from Python (50 back-to-back calls,
# one synchronisation), the seed's `.item()` stands out: every call waits for the GPU and copies twice, and in
# the committed runs v0 is the slowest of the steps here on both cards, well behind v1-v3, which never
# synchronise. The production op does more host work per call than the variants' bare bindings (PyTorch's
# custom-op dispatch, autograd, the checks; a fast path in `ops.py` skips the Python-side checks that the C++
# side repeats anyway): in the committed runs it is no faster than v1-v3 at this size, slower than each of them
# on both cards. At this end host time, not the kernel, separates them.

# %%
small = bench.Case("probs", torch.float32, SMALL_BATCH, SMALL_FEATURES, ("fwd",), "wall")
small_inputs = bench.make_inputs(small, DEVICE)
for name in ("v0_seed", "v1_grid_stride"):
    run_variant(name, small, small_inputs)
    show_committed(name, "128x4096")
step("kldiv_inline", K.kl_div_from_probs, small, small_inputs)
show_committed("kldiv_inline", "128x4096")

# %% [markdown]
# ## The edit loop
#
# The loader hashes every source and every header it includes; an edit gives a new module name, so the
# next `load_sources` call rebuilds (or finds that build in the cache), and the old module stays importable
# beside it. Sources are compiled with `#line` directives, so a compiler error names the real file and line,
# and `KernelBuildError.errors` holds those lines.
#
# Below, a copy of a kernel in a temporary folder: on a GPU, `v3_ratio_log.cu` with the header and bindings
# it shares with the other variants (we change its block size); without one, a tiny C++ module in plain
# CPython API (no torch headers: it compiles quickly) whose only function returns a constant. The builds of
# this section go to a temporary cache, removed at the end; the cell saves your `KLDIV_INLINE_CACHE` (or that
# it was unset) once, so running it again does not take the scratch cache for yours.
#
# For the kit's own kernels the loop is the same, with the files the module of your backend compiles
# (`kldiv_inline.loader.KIT_EXTENSIONS`, printed below, and the headers they include): for the KL op
# `kernels/kldiv.cu` on a GPU and `kernels/kldiv_cpu.cpp` on the CPU, each with `kernels/kldiv_bindings.cpp`
# and the headers both share (`kldiv_common.h`, `kldiv_plan.h`); an edit of `kldiv.cu` changes nothing on a
# CPU-only machine. Then `kldiv_inline.ops.reload()` (for `kl_div`: `kldiv*` files) or
# `kldiv_inline.distill.reload()` (for `generalized_jsd` and the fused head: `distill*` files; both for a header
# both include, `scale_span.cuh`), or a restart of the kernel, makes the ops use the new build.

# %%
import os
import shutil
import tempfile
from pathlib import Path

if "USER_CACHE" not in globals():  # saved once: a second run of this cell must not save its own scratch cache
    USER_CACHE = os.environ.get("KLDIV_INLINE_CACHE")  # yours (None: unset), given back at the end
SCRATCH_FOLDERS = globals().get("SCRATCH_FOLDERS", [])  # every scratch folder of this section, removed at the end
WORK = Path(tempfile.mkdtemp(prefix="kldiv_edit_loop_")).resolve()
SCRATCH_FOLDERS.append(WORK)
os.environ["KLDIV_INLINE_CACHE"] = str(WORK / "cache")  # this section's builds stay in WORK

# %%
from kldiv_inline.loader import KIT_EXTENSIONS

for extension, files in KIT_EXTENSIONS.items():
    print(f"the kit's {extension} module compiles, on {DEVICE}: {', '.join(files[DEVICE])}")

TINY_CPP = """\
// A module with one function, value(), in plain CPython API: no torch headers, a quick build.
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
    for name in ("v3_ratio_log.cu", "variant_common.cuh", "variant_bindings.cpp"):
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
    """load_sources, timed; then what the module computes (on a GPU: the loss, checked by the harness)."""
    t0 = time.perf_counter()
    mod = K.load_sources(SOURCES)
    print(f"module {mod.__name__}, ready in {time.perf_counter() - t0:.2f} s")
    if DEVICE == "cuda":
        checked = harness.check({"edited": mod.kl_div_probs_batchmean}, REFERENCE, [harness.Case("loss", (x, t))])
        print(f"  rel err {checked['rel_err'].iloc[0]:.1e}, ok: {checked['ok'].iloc[0]}")
    else:
        print(f"  value() = {mod.value()}")
    return mod


first = build()

# %% [markdown]
# Change a constant and load again: a new hash, a new name, a new build.

# %%
edit(ORIGINAL, EDITED)
second = build()
assert second.__name__ != first.__name__
if DEVICE == "cuda":
    step("v3, 256 threads", second.kl_div_probs_batchmean)

# %% [markdown]
# A deliberate bug: a compile error. The build fails with `KernelBuildError`; its `.errors` are the
# compiler's lines, and they name the file we edited and the line of the edit, not a generated `main.cpp`
# or `cuda.cu` in the build folder.

# %%
edit(EDITED, EDITED.replace(";", " +;"))
try:
    build()
    raise AssertionError("the broken source compiled")
except K.KernelBuildError as e:
    print("KernelBuildError; the first of its .errors, with the source line:")
    print("\n".join(e.errors[:3]))
    assert str(SOURCES[0]) in e.errors[0]

# %% [markdown]
# Undo the bug: the sources hash to the second version again, so the loader returns that module at once,
# with no build.

# %%
edit(EDITED.replace(";", " +;"), EDITED)
again = build()
assert again is second

# %% [markdown]
# Your `KLDIV_INLINE_CACHE` back (unset again if it was unset), and every scratch folder of this section gone.

# %%
if "USER_CACHE" in globals():  # once; a second run of this cell has nothing left to give back
    if USER_CACHE is None:
        os.environ.pop("KLDIV_INLINE_CACHE", None)
    else:
        os.environ["KLDIV_INLINE_CACHE"] = USER_CACHE
    del USER_CACHE  # the next run of the section's first cell saves yours again
for folder in globals().get("SCRATCH_FOLDERS", []):
    shutil.rmtree(folder, ignore_errors=True)
SCRATCH_FOLDERS = []
