# %% [markdown]
# # 4. Your own kernel: write it, build it, check it, time it, edit it
#
# The kit's loop for any kernel of yours, not only its KL divergence:
#
# 1. write the kernel in a file (here the notebook writes it, into a scratch folder);
# 2. build it with `kldiv_inline.load_sources` (cached by a hash of the sources);
# 3. check it against a float64 reference with `harness.check`;
# 4. time it against PyTorch with `harness.bench`, which refuses to time a provider that failed its check;
# 5. plot time and bandwidth against size with `harness.plot`;
# 6. edit the file and go round again: an edit is a new hash, so a rebuild; the check runs again.
#
# The kernel is the smallest useful one: `scale2(x) = 2 * x` for a float32 tensor. On a GPU it is a CUDA
# kernel (`scale2.cu`); without one, the same function in C++ for the CPU (`scale2.cpp`). Both use one
# bindings file. The harness is the same one the kit's own benchmarks go through (`kldiv_inline.harness`):
# CUDA events with the L2 cache flushed and inputs rotated on a GPU, a wall clock on the CPU, the median with
# 20% and 80% quantiles, and the floor (the bytes that must move over the read bandwidth measured here).

# %% tags=["parameters"]
# Parameters: the only cell to edit. FULL: the sizes of a GPU study; without a GPU a quick CPU run.
# KLDIV_NB_FULL=1 or 0 in the environment overrides the default either way.
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("KLDIV_NB_FULL", "1" if DEVICE == "cuda" else "0") == "1"

# Elements per input: from launch-bound to far beyond the caches (GPU study), or a quick CPU run.
SIZES = [1 << k for k in (range(12, 29, 2) if FULL else (12, 16, 20, 22))]
REPS = 30 if FULL else 5  # timed calls per provider and size

# %%
import sys
import time
from pathlib import Path

ROOT = Path.cwd().resolve().parent  # this notebook runs in <repo>/notebooks
if (ROOT / "kldiv_inline").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the kit straight from the checkout

import matplotlib.pyplot as plt
from IPython.display import display

import kldiv_inline as K
from kldiv_inline import harness

# %matplotlib inline

print(f"device {DEVICE}, FULL={FULL}, torch {torch.__version__}")

# %% [markdown]
# ## 1. The kernel, in files
#
# Three files in a scratch folder: the bindings (shared), the CUDA kernel and its CPU counterpart. The CUDA
# version runs one element per thread in a grid-stride loop; the CPU version a plain loop. Each checks its
# input and says what it expects: a bad input gets a clear error, never a wrong number. Every CUDA launch is
# followed by `C10_CUDA_KERNEL_LAUNCH_CHECK()`. The builds of this notebook go to a cache inside the scratch
# folder, removed at the end, so each run shows real builds; without `KLDIV_INLINE_CACHE`, builds stay in
# `~/.cache/kldiv_inline` across sessions. The first cell saves your `KLDIV_INLINE_CACHE` (or that it was
# unset) once, so running it again does not take the scratch cache for yours; the last cell gives it back.

# %%
import os
import shutil
import tempfile
from pathlib import Path

if "USER_CACHE" not in globals():  # saved once: a second run of this cell must not save its own scratch cache
    USER_CACHE = os.environ.get("KLDIV_INLINE_CACHE")  # yours (None: unset), given back at the end
SCRATCH_FOLDERS = globals().get("SCRATCH_FOLDERS", [])  # every scratch folder of this notebook, removed at the end
WORK = Path(tempfile.mkdtemp(prefix="kldiv_your_kernel_")).resolve()
SCRATCH_FOLDERS.append(WORK)
os.environ["KLDIV_INLINE_CACHE"] = str(WORK / "cache")

# %%
(WORK / "scale2_bindings.cpp").write_text("""\
// Python bindings of scale2, for both implementations (scale2.cu and scale2.cpp).
#include <torch/extension.h>

at::Tensor scale2(const at::Tensor& x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scale2", &scale2, "2 * x of a float32 tensor", py::arg("x")); }
""")

(WORK / "scale2.cu").write_text("""\
// scale2 on a CUDA GPU: out = 2 * x for a contiguous float32 tensor, one element per thread of a grid-stride loop.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kThreads = 256;

__global__ void scale2_kernel(const float* __restrict__ in, float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    out[i] = 2.0f * in[i];
  }
}

}  // namespace

at::Tensor scale2(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "scale2: expected a contiguous float32 CUDA tensor, got ", x.scalar_type(), " on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return out;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 16));
  scale2_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(x.data_ptr<float>(),
                                                                            out.data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
""")

(WORK / "scale2.cpp").write_text("""\
// scale2 on the CPU: out = 2 * x for a contiguous float32 tensor, one element after another.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

at::Tensor scale2(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "scale2: expected a contiguous float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) {
    o[i] = 2.0f * in[i];
  }
  return out;
}
""")

KERNEL = WORK / ("scale2.cu" if DEVICE == "cuda" else "scale2.cpp")
SOURCES = [KERNEL, WORK / "scale2_bindings.cpp"]
print(f"{WORK}: {', '.join(sorted(p.name for p in WORK.glob('scale2*')))}; building {KERNEL.name}")

# %% [markdown]
# ## 2. Build
#
# `load_sources` compiles the files (nvcc for `.cu`, the host compiler for `.cpp`) and imports the module.
# Its name carries a hash of the sources, every header they include with `#include "..."`, the flags and
# the toolchain, so an unchanged tree is a cache hit, also in a new process. (`-fopenmp` lets the CPU
# version use ATen's thread pool later on.)

# %%
CFLAGS = ["-fopenmp"] if DEVICE == "cpu" else []


def build():
    """load_sources, timed."""
    t0 = time.perf_counter()
    mod = K.load_sources(SOURCES, name="scale2", extra_cflags=CFLAGS)
    print(f"module {mod.__name__}, ready in {time.perf_counter() - t0:.1f} s")
    return mod


first = build()
x = torch.rand(5, device=DEVICE)
print(x, first.scale2(x), sep="\n")
try:
    first.scale2(x.double())
except RuntimeError as e:
    print("a float64 input:", str(e).splitlines()[0])

# %% [markdown]
# ## 3. Check against float64
#
# A case is a name and the arguments every provider gets; fresh random inputs, never zeros.
# `harness.check` runs the reference on the same inputs upcast to float64, runs each provider with fresh
# memory poisoned (NaN, so an element a kernel forgets to write cannot pass), and compares output by
# output: the relative error $\lVert out - ref\rVert / \lVert ref\rVert$ against the output dtype's
# tolerance, NaN and inf only where the reference has them. PyTorch's own `2 * x` goes through the same
# check. A norm lets a few wrong elements of a long output through (a loop's mishandled tail in bfloat16,
# say); `per_element=True` also holds each element to the tolerance times the output's largest value.

# %%
cases = [harness.Case(f"n={n}", (torch.rand(n, device=DEVICE),)) for n in SIZES]


def torch_scale2(x):
    return 2 * x


checked = harness.check({"mine": first.scale2, "torch": torch_scale2}, reference=torch_scale2, cases=cases)
display(checked)
assert checked["ok"].all()

# %% [markdown]
# ## 4. Time against PyTorch, and against the floor
#
# `bytes_moved` is what a call must move at least: one read and one write of the tensor. From it the
# harness gives the bandwidth (`gbps`), the floor (`floor_ms`: those bytes at the read bandwidth measured on
# this device), `x_floor` (time / floor: 1 is as fast as memory allows) and, on a GPU it knows, the
# percentage of the card's vendor peak. `checked=` hands over the check above, so no provider is timed
# unchecked. (On a CPU, inputs of a few MiB sit in its caches, so times under the floor are possible, and on
# a shared machine the wall-clock times swing from run to run: a run of the code path, not a claim.) The
# harness warns for every provider and case timed under the floor; `floor_warnings_once` shows the first of
# those warnings in full, then names the others (provider, case, x floor) in one line, and lets every other
# warning through as it is.

# %%
import contextlib
import sys
import warnings

COLUMNS = ["provider", "case", "status", "median_ms", "q20_ms", "q80_ms", "gbps", "x_floor", "pct_of_peak"]


def bytes_moved(x):
    return 2 * x.numel() * x.element_size()


@contextlib.contextmanager
def floor_warnings_once():
    """The harness's warnings of times under the floor, one per provider and case, shown once with their count;
    other warnings unchanged."""
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:  # (shown where the cell raises too: they may say why)
        raising = sys.exc_info()[1] is not None
        below = [w for w in caught if "x the floor: faster than" in str(w.message)]
        try:
            for w in caught:
                if w not in below:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if below:
                others = "; ".join(str(w.message).split(": faster than")[0] for w in below[1:])
                more = f" [{len(below) - 1} more in this cell: {others}]" if others else ""
                warnings.warn_explicit(f"{below[0].message}{more}", below[0].category, below[0].filename,
                                       below[0].lineno)
        except Warning:  # (warnings made errors: the cell's own error, not a warning's, is the one to see)
            if not raising:
                raise


with floor_warnings_once():
    timed = harness.bench({"mine": first.scale2, "torch": torch_scale2}, cases=cases, bytes_moved=bytes_moved,
                          checked=checked, reps=REPS)
display(timed[COLUMNS].round(4))
assert (timed["status"] == "ok").all()

# %% [markdown]
# ## 5. Plot
#
# Time and bandwidth against the bytes moved, one line per provider with its 20-80% band, the floor dashed.

# %%
fig = harness.plot(timed, ours="mine", title=f"scale2 on {DEVICE}")
plt.show()

# %% [markdown]
# ## 6. Edit and rerun
#
# An editor changes the file; `edit` below does the same with one replacement, so that the notebook runs on
# its own. First a slip that any of us makes: the loop stops one element early. The sources hash
# differently, so `load_sources` builds a new module (a cache miss). The check catches the slip: the last
# element was never written, it holds the poison. `bench` then refuses to time that provider: its status is
# "wrong".


# %%
def edit(old, new):
    """Replace one piece of the kernel file, as an editor would."""
    text = KERNEL.read_text()
    assert text.count(old) == 1, old
    KERNEL.write_text(text.replace(old, new))
    line = text[: text.index(old)].count("\n") + 1
    print(f"edited {KERNEL.name}:{line}")


edit("i < n;", "i + 1 < n;")
broken = build()
assert broken.__name__ != first.__name__
checked_broken = harness.check({"mine": broken.scale2}, reference=torch_scale2, cases=cases)
display(checked_broken[["provider", "case", "rel_err", "ok", "error"]])
assert not checked_broken["ok"].any()
refused = harness.bench({"mine": broken.scale2}, cases=cases[:1], bytes_moved=bytes_moved,
                        checked=checked_broken, reps=REPS)
print("bench status:", refused["status"].tolist())
assert (refused["status"] == "wrong").all()

# %% [markdown]
# Undo the slip: the sources hash as the first version again, so the loader hands back that module at once,
# with no build.

# %%
edit("i + 1 < n;", "i < n;")
again = build()
assert again is first

# %% [markdown]
# Now a change meant to make it faster. On a GPU: 16-byte loads and stores (`float4`), four elements per
# thread and iteration (so a grid a quarter the size), with a scalar loop for the tail (and for pointers that
# are not 16-byte aligned).
# On the CPU: split the loop over ATen's thread pool (`at::parallel_for`), so every core takes a share.
# Whether it is faster is for the timing to say: it is checked first, then timed beside the first version
# and PyTorch, in one run.

# %%
if DEVICE == "cuda":
    edit("""\
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    out[i] = 2.0f * in[i];
  }""", """\
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool aligned = ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  const int64_t nvec = aligned ? n / 4 : 0;
  for (int64_t i = tid; i < nvec; i += stride) {
    const float4 v = reinterpret_cast<const float4*>(in)[i];
    reinterpret_cast<float4*>(out)[i] = make_float4(2.0f * v.x, 2.0f * v.y, 2.0f * v.z, 2.0f * v.w);
  }
  for (int64_t i = nvec * 4 + tid; i < n; i += stride) {
    out[i] = 2.0f * in[i];
  }""")
    edit("(n + kThreads - 1) / kThreads", "(n + 4 * kThreads - 1) / (4 * kThreads)")
else:
    edit("#include <ATen/core/Tensor.h>", "#include <ATen/Parallel.h>\n#include <ATen/core/Tensor.h>")
    edit("""\
  for (int64_t i = 0; i < n; ++i) {
    o[i] = 2.0f * in[i];
  }""", """\
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      o[i] = 2.0f * in[i];
    }
  });""")
second = build()
providers = {"mine": first.scale2, "mine, edited": second.scale2, "torch": torch_scale2}
checked = harness.check(providers, reference=torch_scale2, cases=cases)
assert checked["ok"].all(), checked
with floor_warnings_once():
    timed = harness.bench(providers, cases=cases, bytes_moved=bytes_moved, checked=checked, reps=REPS)
display(timed.pivot_table(index="case", columns="provider", values="median_ms", sort=False).round(4))
fig = harness.plot(timed, ours="mine, edited", title=f"scale2 on {DEVICE}, before and after the edit")
plt.show()

# %% [markdown]
# Your `KLDIV_INLINE_CACHE` back (unset again if it was unset), and the scratch folders and their build caches
# gone; the files of your own kernel would live in your project, and its builds in the default cache.

# %%
if "USER_CACHE" in globals():  # once; a second run of this cell has nothing left to give back
    if USER_CACHE is None:
        os.environ.pop("KLDIV_INLINE_CACHE", None)
    else:
        os.environ["KLDIV_INLINE_CACHE"] = USER_CACHE
    del USER_CACHE  # the next run of the notebook's scratch cell saves yours again
for folder in globals().get("SCRATCH_FOLDERS", []):
    shutil.rmtree(folder, ignore_errors=True)
SCRATCH_FOLDERS = []
