# %% [markdown]
# # 2. Performance: the kit's op against PyTorch eager, torch.compile and Liger
#
# The same code as `python -m kldiv_inline bench` (`kldiv_inline.bench`, the KL suite on the kit's one
# harness, `kldiv_inline.harness`): every provider is checked against float64 before it is timed (a wrong
# one is reported, not timed); CUDA events after warm-up, the L2 cache flushed before each call when the
# inputs are at most twice its size, inputs rotated among several sets; the median with 20% and 80%
# quantiles. The **floor** is the bytes that must move (each input read once; for forward + backward the
# gradient written once too) over the best read bandwidth measured at the start (`kldiv_inline.floors`:
# PyTorch's `x.sum()` and, on a GPU, the kit's own read kernel); on a card it knows, each row also gives the
# percentage of the vendor's peak bandwidth.
#
# The figures are drawn by `kldiv_inline.plots`, the functions that draw `results/<device>/*.png`, so the
# last section can lay this run beside the committed results of the same device.
#
# Without a GPU the harness times the CPU twin against eager PyTorch on the CPU with a wall clock, at the CPU
# cases of `python -m kldiv_inline bench` (those of the committed `results/cpu-*` runs; well under a minute on
# two cores): a run of the same code path, not a performance claim. torch.compile and Liger are GPU peers here.

# %% tags=["parameters"]
# Parameters: the only cell to edit. FULL: the sizes of a GPU study; without a GPU a quick CPU run.
# KLDIV_NB_FULL=1 or 0 in the environment overrides the default either way.
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("KLDIV_NB_FULL", "1" if DEVICE == "cuda" else "0") == "1"

# The cases of `python -m kldiv_inline bench` (bench.headline_cases and bench.sweep_cases), so the plots match
# the committed ones: on a GPU when FULL, on the CPU always (its cases are small). A quick GPU run (not FULL)
# times float32 probability rows of QUICK_FEATURES, QUICK_BATCHES rows instead.
CLI_CASES = FULL or DEVICE == "cpu"
QUICK_FEATURES = 1024
QUICK_BATCHES = (16, 64, 256, 1024)
REPS = 30 if CLI_CASES else 5  # timed calls per provider and case (30: the CLI's default)
BANDWIDTH_BYTES = 1 << 30  # buffer of the floor's read-bandwidth measurement (the CLI's size)

# %%
import sys
import time
from pathlib import Path

ROOT = Path.cwd().resolve().parent  # this notebook runs in <repo>/notebooks
if (ROOT / "kldiv_inline").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the kit straight from the checkout

import matplotlib.pyplot as plt

from kldiv_inline import plots

# %matplotlib inline

print(f"device {DEVICE}, FULL={FULL}, the CLI's cases: {CLI_CASES}, torch {torch.__version__}")

# %% [markdown]
# ## The cases and the floor
#
# Each `bench.Case` is a form (`probs`: probabilities in, the log taken inside; `logprobs`: PyTorch's
# convention), a dtype, a shape, the passes to time (`fwd`, `fwd+bwd`) and a timer (`cuda` events, or
# `wall`: back-to-back calls from Python, for launch-bound sizes where host time is the cost). The
# headline cases are the sizes whose speed-ups the README quotes; the sweep goes from tiny to more than the
# L2 cache.

# %%
from kldiv_inline import bench, floors

TIMER = "cuda" if DEVICE == "cuda" else "wall"
if CLI_CASES:
    headline, sweep = bench.headline_cases(DEVICE), bench.sweep_cases(DEVICE)
else:
    sweep = [bench.Case("probs", torch.float32, b, QUICK_FEATURES, ("fwd", "fwd+bwd"), TIMER)
             for b in QUICK_BATCHES]
    headline = [bench.Case("probs", torch.float32, 4 * QUICK_BATCHES[-1], QUICK_FEATURES, ("fwd", "fwd+bwd"),
                           TIMER)]
for case in headline + sweep:
    print(f"{'headline' if case in headline else 'sweep':<9}{case.form:<9}{str(case.dtype):<15}"
          f"{case.batch:>6} x {case.features:<7}{', '.join(case.passes):<14}timer {case.timer}")

floor = floors.measure_floor(DEVICE, BANDWIDTH_BYTES)
sources = ", ".join(f"{name} {gbps:.0f}" for name, gbps in floor.sources.items())
print(f"\nfloor on {DEVICE}: {floor.gbps:.0f} GB/s from {floor.source} (GB/s read by {sources}); "
      f"vendor peak: {floors.device_peak_gbps(DEVICE) or 'not known here'}")

# %% [markdown]
# ## Timing
#
# `bench.run_case` hands our op and the peers that exist on this device (`bench.providers`: on a GPU
# torch.compile, and Liger when it is installed) to `harness.bench`, one case per pass, and returns one row
# per provider and pass; `bench.table` prints them. The first torch.compile call of a shape includes its
# compilation; warm-up calls absorb it.

# %%
rows = {"headline": [], "sweep": []}
t0 = time.perf_counter()
for kind, cases in (("headline", headline), ("sweep", sweep)):
    for case in cases:
        rows[kind] += bench.run_case(case, DEVICE, floor, variants=[], reps=REPS, warmup=3)
print(bench.table(rows["headline"] + rows["sweep"]))
print(f"\n{time.perf_counter() - t0:.0f} s")
missing = sorted({r["impl"] for r in rows["sweep"] if r["status"] == "not installed"})
if missing:
    print("not installed here:", ", ".join(missing))
bad = [r for r in rows["headline"] + rows["sweep"] if r["impl"] == bench.OURS and r["status"] != "ok"]
assert not bad, bad

# %% [markdown]
# ## The figures
#
# The rows go through the files the CLI writes (`bench.write_csv`, then `plots.load_bench`, here in a
# temporary folder), so the frame is exactly what the committed plots are drawn from. For every swept
# (pass, form, dtype): time per call against size (log-log, 20-80% bands, the floor dashed), and the
# achieved bandwidth (bytes that must move / time) against the floor's bandwidth. Then the speed-up
# of our op over each peer at the headline cases: above 1, ours is faster.
#
# On a CPU, inputs of a few MiB sit in its caches, so times under the "floor" (measured on a buffer of
# `BANDWIDTH_BYTES`) are possible there, and a shared machine makes the wall-clock quantiles wide.

# %%
import json
import tempfile

SCRATCH = Path(tempfile.mkdtemp())


def frame(rows):
    """The rows as the CLI stores them, read back the way the plots read committed results."""
    return plots.load_bench(bench.write_csv(rows, SCRATCH / "bench.csv"))


def show_bench(df, floor_gbps, title, cases=None):
    """Time and bandwidth against size for each swept (pass, form, dtype), then the speed-ups."""
    for pass_, form, dtype in sorted(set(zip(df["pass"], df["form"], df["dtype"]))):
        if plots.sweep_frame(df, pass_, form, dtype)["numel"].nunique() < 2:
            continue  # a single size: no curve to draw
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
        plots.plot_time_vs_size(df, pass_, form, dtype, ax=axes[0], ours=bench.OURS)
        plots.plot_bandwidth(df, pass_, form, dtype, floor_gbps, ax=axes[1], ours=bench.OURS)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        plt.show()
    plots.plot_speedups(df, bench.OURS, cases=cases, title=title)
    plt.show()


df = frame(rows["headline"] + rows["sweep"])
HEADLINE_CASES = list(plots.headline_frame(frame(rows["headline"]), bench.OURS)["case"].unique())
show_bench(df, floor.gbps, f"this run: {DEVICE}, torch {torch.__version__}", cases=HEADLINE_CASES)

# %% [markdown]
# At the headline cases, each provider's time, its ratio to ours and its distance from the floor
# (`plots.headline_frame`, the table behind the bars), one row per case and pass: a case timed forward and
# forward + backward has two rows, never one averaged over both (each cell is one measurement; the assert
# makes sure).

# %%
headline_table = plots.headline_frame(frame(rows["headline"]), bench.OURS)
assert not headline_table.duplicated(["case", "pass", "impl"]).any(), "two rows for one cell of the table"
(headline_table
 .pivot_table(index=["case", "pass"], columns="impl", values=["median_ms", "speedup_of_ours", "x_floor"],
              aggfunc="first", sort=False)
 .round(3))

# %% [markdown]
# ## The committed results of this device
#
# `make results` on a machine writes `results/<device>/bench.csv` and `env.json` (card, commit, command,
# the floor's bandwidth). If this device has a folder there, the cell draws it with the same function as this
# run. When this run timed the CLI's cases (on the CPU, or FULL on a GPU) the two can be compared figure by
# figure; a quick GPU run's sizes are not the committed ones. The committed file also holds the other suites'
# rows (distillation, the fused LM head), drawn as figures of their own. Expect differences where a size is
# launch-bound (host speed), on a different card or CPU of the same name, and from run to run on a shared
# machine.

# %%
from kldiv_inline.envinfo import device_slug

committed = ROOT / "results" / device_slug(DEVICE)
if (committed / "bench.csv").exists():
    env_file = committed / "env.json"
    env = json.loads(env_file.read_text()) if env_file.exists() else {}
    floor_gbps = env.get("floor_gbps", env.get("read_gbps"))  # runs before the kit's read kernel: read_gbps
    print({k: env.get(k) for k in ("device_name", "torch", "commit", "command", "date_utc")})
    print(f"floor {floor_gbps} GB/s")
    show_bench(plots.load_bench(committed / "bench.csv"), floor_gbps, f"committed: {committed.relative_to(ROOT)}")
else:
    folders = sorted(p.parent.name for p in (ROOT / "results").glob("*/bench.csv"))
    print(f"no committed results for this device ({committed.relative_to(ROOT)}); "
          f"results/ holds: {', '.join(folders) or 'none'}")
