"""Timing frames and results CSVs -> figures. No GPU needed: every figure is drawn from rows.

``plot_timings`` draws any ``harness.bench`` frame (``harness.plot`` calls it); the rest draws the KL suite's
files under results/<device>/. Which provider is "ours" is always a parameter. The notebooks call the same
functions, so a plot in a notebook and the PNG in results/ are one drawing.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt  # without a display matplotlib picks the Agg backend by itself
import pandas as pd

from .envinfo import read_csv, read_env
from .goals import short_commit

# Fixed colours for the kit's providers, so a provider looks the same in every figure; others take the
# remaining colours of the tab10 cycle in order.
COLORS = {"kldiv_inline": "tab:red", "torch_eager": "tab:blue", "torch_compile": "tab:green",
          "liger": "tab:purple", "v0_seed": "tab:gray", "v1_grid_stride": "tab:brown",
          "v2_vectorized": "tab:olive", "v3_ratio_log": "tab:orange"}
_TAB10 = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
          "tab:olive", "tab:cyan"]


# -------------------------------------------------------------------------------------- any timing frame
def _order(names, ours: str | None) -> list[str]:
    """``ours`` first, then the kit's known providers in a fixed order, then the rest by name."""
    names = list(dict.fromkeys(names))
    known = [n for n in COLORS if n in names and n != ours]
    return ([ours] if ours in names else []) + known + sorted(n for n in names if n not in known and n != ours)


def _colors(names: list[str]) -> dict[str, str]:
    spare = iter([c for c in _TAB10 if c not in {COLORS[n] for n in names if n in COLORS}] * 4)
    return {n: COLORS.get(n) or next(spare) for n in names}


def _lines(df: pd.DataFrame, by: str, x: str, ours: str | None):
    """(name, its timed rows sorted by x, style) per provider, in plotting order."""
    ok = df[df["status"] == "ok"]
    names = _order(ok[by].unique(), ours)
    colors = _colors(names)
    for name in names:
        rows = ok[ok[by] == name].groupby(x, as_index=False).first().sort_values(x)
        style = {"color": colors[name], "lw": 2.4 if name == ours else 1.3, "zorder": 3 if name == ours else 2}
        yield name, rows, style


def _label(name) -> str:
    """A provider's or case's name as matplotlib draws it as given: "$" escaped (mathtext read "mine $x^$" as a
    formula and savefig raised), and a leading "_" behind a zero-width space (the legend hides such labels)."""
    text = str(name).replace("$", r"\$")
    return "\u200b" + text if text.startswith("_") else text


def draw_time(ax, df: pd.DataFrame, *, by: str, x: str, xlabel: str, ours: str | None = None,
              legend: bool = True):
    """Median time against ``x``, log-log, 20-80% bands, the floor dashed."""
    for name, rows, style in _lines(df, by, x, ours):
        ax.plot(rows[x], rows["median_ms"], marker="o", ms=3, label=_label(name), **style)
        ax.fill_between(rows[x], rows["q20_ms"], rows["q80_ms"], alpha=0.2, color=style["color"])
    if "floor_ms" in df and df["floor_ms"].notna().any():
        floor = df.groupby(x, as_index=False)["floor_ms"].first().sort_values(x)
        # A marker at each case: one case makes a line of one point, invisible without it.
        ax.plot(floor[x], floor["floor_ms"], "k--", lw=1, marker="_", ms=12, mew=1.5, label="floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("time per call (ms)")
    ax.grid(True, which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    return ax


def _peak_gbps(df: pd.DataFrame) -> float | None:
    """The vendor peak behind the rows' pct_of_peak (gbps / pct * 100), if any row has one."""
    if "pct_of_peak" not in df:
        return None
    rows = df[df["pct_of_peak"].notna() & (df["pct_of_peak"] > 0)]
    return float((rows["gbps"] / rows["pct_of_peak"] * 100).iloc[0]) if not rows.empty else None


def draw_gbps(ax, df: pd.DataFrame, *, by: str, x: str, xlabel: str, ours: str | None = None,
              floor_gbps: float | None = None, legend: bool = True):
    """Achieved GB/s (bytes that must move / time) against ``x``, 20-80% bands, the floor's bandwidth
    dashed (``floor_gbps``, else the rows') and the vendor peak dotted."""
    for name, rows, style in _lines(df, by, x, ours):
        gb = rows["gbps"] * rows["median_ms"]  # the bytes moved, in 1e6 x GB/s x ms
        ax.plot(rows[x], rows["gbps"], marker="o", ms=3, label=_label(name), **style)
        ax.fill_between(rows[x], gb / rows["q80_ms"], gb / rows["q20_ms"], alpha=0.2, color=style["color"])
    if floor_gbps is None and "floor_gbps" in df and df["floor_gbps"].notna().any():
        floor_gbps = float(df["floor_gbps"].max())
    # Labelled as in draw_time, so one legend serves both panels; the values are written on the lines.
    for value, ls, label in ((floor_gbps, "--", "floor"), (_peak_gbps(df), ":", "vendor peak")):
        if value:
            ax.axhline(value, color="k", ls=ls, lw=1, label=label)
            ax.annotate(f"{label} {value:.0f} GB/s", (0.01, value), xycoords=("axes fraction", "data"),
                        va="bottom", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("GB/s of required traffic")
    ax.grid(True, which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    return ax


def legend_outside(fig, axes) -> None:
    """One legend for all ``axes`` (each label once), right of them, so it covers no line; it also lays the
    figure out. The legend stays inside the figure, so a plain ``savefig`` or a window shows it too: the
    constrained layout keeps a margin for it and lays the axes out in the rest, at every draw (a resized window
    too)."""
    handles = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.set_layout_engine("constrained")  # tight_layout would lay the axes out over a figure legend
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right center", fontsize=8)


def plot_timings(timed: pd.DataFrame, ours: str | None = None, title: str | None = None):
    """A ``harness.bench`` frame as a Figure: time and GB/s against MiB moved, one line per provider; against
    the cases, in their order, where no bytes were given or two cases move the same bytes."""
    df = timed.copy()
    if ours is not None and ours not in set(df["provider"]):
        raise ValueError(f"ours={ours!r} is no provider of this frame: {', '.join(dict.fromkeys(df['provider']))}")
    names = list(dict.fromkeys(df["case"]))
    df["case_index"] = df["case"].map({c: i for i, c in enumerate(names)})
    with_bytes = "bytes" in df and df["bytes"].notna().any()
    # Cases that move the same bytes (one input contiguous and one transposed, say) would share a point on a
    # bytes axis, and a line keeps one of them: such cases are drawn per case, in their order, instead. So are
    # cases where a timed case has no bytes (None, or 0: an empty case), which a bytes axis cannot place.
    timed_ok = df[df["status"] == "ok"] if "status" in df else df
    placed = with_bytes and bool((timed_ok["bytes"].notna() & (timed_ok["bytes"] > 0)).all())
    by_case = not placed or df.groupby("bytes")["case"].nunique().max() > 1
    x, xlabel = ("case_index", "case") if by_case else ("mib_moved", "MiB moved per call")
    if with_bytes:
        df["mib_moved"] = df["bytes"] / 2**20
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        draw_time(axes[0], df, by="provider", x=x, xlabel=xlabel, ours=ours, legend=False)
        draw_gbps(axes[1], df, by="provider", x=x, xlabel=xlabel, ours=ours, legend=False)
    else:  # no bytes_moved: time per case
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        axes = [ax]
        draw_time(ax, df, by="provider", x=x, xlabel=xlabel, ours=ours, legend=False)
    if by_case:
        for ax in axes:
            ax.set_xscale("linear")
            ax.set_xticks(range(len(names)), [_label(n) for n in names], rotation=20)
    fig.suptitle(title or f"{', '.join(dict.fromkeys(df['device']))}: time and bandwidth per provider",
                 fontsize=9)
    legend_outside(fig, axes)
    note_not_drawn(fig, df, "provider")
    return fig


def note_not_drawn(fig, df: pd.DataFrame, by: str) -> None:
    """Rows of ``df`` not timed (a provider, named in column ``by``, that failed its check, raised or is not
    installed) draw nothing: ``fig`` says which, so a provider missing from the lines or bars is not taken for one
    that was never asked. (Below the axes as the figure's x label, which the constrained layout makes room for; the
    status word alone, wrapped.)"""
    if "status" not in df:
        return
    left_out = df[df["status"] != "ok"]
    notes = [f"{_label(p).lstrip(chr(0x200b))} "
             f"({', '.join(dict.fromkeys(g['status'].astype(str).str.split(':').str[0]))}: "
             f"{len(g)} of {int((df[by] == p).sum())} cases)"
             for p, g in left_out.groupby(by, sort=False)]
    if notes:
        fig.supxlabel("\n".join(textwrap.wrap("not drawn: " + "; ".join(notes), 140)), fontsize=7)


# ------------------------------------------------------------------------------- the KL suite's results
# The columns of a bench.csv that the figures and the goals read in every row (every bench.csv bench has written holds
# them), and those of them whose cell places a row (its provider, case and timer): an empty one there is no row.
BENCH_REQUIRED = ("device", "impl", "pass", "form", "dtype", "batch", "features", "median_ms", "q20_ms", "q80_ms",
                  "gbps", "x_floor", "status", "timer")
BENCH_KEYS = ("impl", "pass", "form", "dtype", "batch", "features", "status", "timer")


def read_bench(path: Path) -> pd.DataFrame:
    """A bench.csv as a frame, or a clear error naming it and the column or row it lacks (a bare KeyError or
    TypeError deep in the goals or the figures was all plot said of a column left out or an empty batch cell)."""
    df = read_csv(path)
    missing = [c for c in BENCH_REQUIRED if c not in df.columns]
    if missing:
        raise SystemExit(f"{path} has no {', '.join(missing)} column(s), which plot and the goals read: mend it, "
                         "or remove it")
    for col in BENCH_KEYS:
        cells = pd.to_numeric(df[col], errors="coerce") if col in ("batch", "features") else df[col]
        empty = cells.isna().to_numpy()
        if empty.any():
            row = int(empty.argmax()) + 1
            raise SystemExit(f"{path}: row {row} (after the header) has no {col}"
                             + (" number" if col in ("batch", "features") else "") + f" ({int(empty.sum())} such "
                             "row(s)): mend it, or remove the row")
    return df


def load_bench(path: Path) -> pd.DataFrame:
    df = read_bench(path)
    # A column written twice (an earlier writer of the two-GPU run repeated beta and hidden) is read once.
    twice = [c for c in df.columns if c.endswith(".1") and c[:-2] in df.columns]
    df = df.drop(columns=twice)
    df["numel"] = df["batch"] * df["features"]
    itemsize = df["dtype"].map({"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2})
    df["mib_per_input"] = df["numel"] * itemsize / 2**20
    return df


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` is one run's folder (results/<device>/: its CSVs in it), not a folder of runs."""
    return folder.is_dir() and any((folder / name).is_file() for name in ("bench.csv", "correctness.csv"))


def _device_title(folder: Path, record: str | None = None) -> str:
    """The card, torch and commit of the run in ``folder``; with ``record``, of the run env.json keeps under that
    key (``check``: the correctness run, whose commit may not be the bench run's)."""
    env = folder / "env.json"
    if env.exists():
        e = read_env(env)
        if record and isinstance(e.get(record), dict):
            e = e[record]
        return (f"{e.get('device_name', folder.name)} · torch {e.get('torch', '?')} · "
                f"{short_commit(e.get('commit'), 10)}"
                + (" · partial run (cut short)" if e.get("partial") else ""))
    return folder.name


def sweep_frame(df: pd.DataFrame, pass_: str, form: str, dtype: str) -> pd.DataFrame:
    sel = df[(df["pass"] == pass_) & (df["form"] == form) & (df["dtype"] == dtype) & (df["status"] == "ok")]
    sel = sel[sel["timer"] != "wall"] if (sel["timer"] != "wall").any() else sel
    return sel.sort_values("numel")


def plot_time_vs_size(df: pd.DataFrame, pass_: str, form: str, dtype: str, ax=None, title: str = "",
                      ours: str | None = None, legend: bool = True):
    """Median time against MiB per input, log-log, with 20-80% bands; the floor as a dashed line."""
    ax = ax or plt.subplots(figsize=(6.4, 4.2))[1]
    draw_time(ax, sweep_frame(df, pass_, form, dtype), by="impl", x="mib_per_input", xlabel="MiB per input",
              ours=ours, legend=legend)
    ax.set_title(title or f"{pass_}, {form}, {dtype}")
    return ax


def plot_bandwidth(df: pd.DataFrame, pass_: str, form: str, dtype: str, read_gbps: float | None = None,
                   ax=None, title: str = "", ours: str | None = None, legend: bool = True):
    """Achieved GB/s (bytes that must move / time) against size, with the floor's read bandwidth."""
    ax = ax or plt.subplots(figsize=(6.4, 4.2))[1]
    draw_gbps(ax, sweep_frame(df, pass_, form, dtype), by="impl", x="mib_per_input", xlabel="MiB per input",
              ours=ours, floor_gbps=read_gbps, legend=legend)
    ax.set_title(title or f"bandwidth, {pass_}, {form}, {dtype}")
    return ax


def headline_frame(df: pd.DataFrame, ours: str) -> pd.DataFrame:
    """Each provider's time against ours at every case ours was timed in (peer time / our time). Cases that
    differ in a suite's own columns (beta of the distillation suite, hidden of the fused LM head) stay apart."""
    rows = []
    extra = [c for c in ("beta", "hidden", "world") if c in df]
    ok = df[df["status"] == "ok"]
    for (pass_, form, dtype, timer), g in ok.groupby(["pass", "form", "dtype", "timer"]):
        for key, h in g.groupby(["batch", "features", *extra], dropna=False):
            batch, features, *rest = key
            mine = h[h["impl"] == ours]
            if mine.empty:
                continue
            t_ours = float(mine["median_ms"].iloc[0])
            label = (f"{form} {dtype} {batch}x{features}"
                     + "".join(f" {c}={v:g}" for c, v in zip(extra, rest) if pd.notna(v))
                     + (" (wall clock)" if timer == "wall" else ""))
            for _, r in h.iterrows():
                rows.append({"pass": pass_, "case": label, "form": form, "dtype": dtype, "numel": batch * features,
                             "impl": r["impl"],
                             "median_ms": r["median_ms"], "speedup_of_ours": r["median_ms"] / t_ours,
                             "x_floor": r["x_floor"], "timer": r["timer"]})
    return pd.DataFrame(rows)


def plot_speedups(df: pd.DataFrame, ours: str, peers: list[str] | None = None, cases: list[str] | None = None,
                  title: str = ""):
    """Horizontal bars, one panel per pass: peer time / our time per case (right of 1: ours is faster).
    ``peers`` picks the providers drawn (default: all but ours); ``cases`` the case labels."""
    hf = headline_frame(df, ours)
    hf = hf[hf["impl"] != ours]
    if peers is not None:
        hf = hf[hf["impl"].isin(peers)]
    if cases:
        hf = hf[hf["case"].isin(cases)]
    passes = list(dict.fromkeys(p for p in ("fwd", "fwd+bwd") if p in set(hf["pass"]))) + \
        sorted(set(hf["pass"]) - {"fwd", "fwd+bwd"})
    impls = _order(hf["impl"].unique(), None)
    colors = _colors(impls)
    n_cases = [hf[hf["pass"] == p]["case"].nunique() for p in passes]
    bar_in = 0.16  # inches per bar
    heights = [max(1.2, n * len(impls) * bar_in + 0.5) for n in n_cases]
    fig, axes = plt.subplots(len(passes), 1, figsize=(9.5, sum(heights) + 0.9), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    lo = hf["speedup_of_ours"].min() if not hf.empty else 1.0
    hi = hf["speedup_of_ours"].max() if not hf.empty else 1.0
    for ax, pass_ in zip(axes[:, 0], passes):
        sel = hf[hf["pass"] == pass_].sort_values(["form", "dtype", "timer", "numel"])
        case_names = list(dict.fromkeys(sel["case"]))
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            for i, c in enumerate(case_names):
                v = sel[(sel["case"] == c) & (sel["impl"] == impl)]["speedup_of_ours"]
                if v.empty:
                    continue
                y, value = i - 0.4 + width * (j + 0.5), float(v.iloc[0])
                # From 1 to the value: a peer faster than ours points left.
                ax.barh(y, value - 1.0, width * 0.9, left=1.0, color=colors[impl], label=impl)
                ax.text(value * (1.03 if value >= 1 else 0.97), y, f"{value:.2f}x", va="center",
                        ha="left" if value >= 1 else "right", fontsize=6.5)
        ax.axvline(1.0, color="k", lw=1)
        ax.set_xscale("log")
        ax.set_xlim(min(lo, 1.0) / 1.5, max(hi, 1.0) * 1.6)
        ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_yticks(range(len(case_names)), case_names, fontsize=8)
        ax.set_ylim(len(case_names) - 0.5, -0.5)  # first case on top
        ax.set_title(f"{pass_}: time of each peer / time of {ours}", fontsize=9, loc="left")
        ax.grid(True, axis="x", which="both", alpha=0.3)
    axes[-1, 0].set_xlabel(f"speed-up of {ours} (log scale; right of 1: {ours} is faster)")
    fig.suptitle(title or f"speed-up of {ours} over each peer", fontsize=10, x=0.02, ha="left")
    legend_outside(fig, axes[:, 0])
    # (ours' failed cases too: a case ours was not timed in has no bars at all)
    note_not_drawn(fig, df if peers is None else df[df["impl"].isin([ours, *peers])], "impl")
    return fig


def linear_sweep_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The fused LM head's timed rows (form "linear"), or an empty frame."""
    if "form" not in df or "hidden" not in df:
        return df.iloc[0:0]
    return df[(df["form"] == "linear") & (df["status"] == "ok")]


def plot_linear_sweep(df: pd.DataFrame, ours: str, memory_bound_mib: float | None = None, title: str = ""):
    """The fused LM head against tokens, one row of panels per (beta, hidden, vocabulary): time per training step
    (log-log, 20-80% bands, the matrix-product floor dashed) and the memory each provider's step takes beyond its
    inputs and parameter gradients (``extra_mib``), with ``memory_bound_mib`` dotted."""
    lin = linear_sweep_frame(df)
    # only what was swept: a (beta, shape) timed at one token count (the JSD at the goals' shape) is no curve
    groups = [(k, g) for k, g in lin.groupby(["beta", "hidden", "features"], dropna=False) if g["batch"].nunique() > 1]
    fig, axes = plt.subplots(max(1, len(groups)), 2, figsize=(11, 3.9 * max(1, len(groups))), squeeze=False)
    for ((beta, hidden, vocab), sel), (ax_t, ax_m) in zip(groups, axes):
        draw_time(ax_t, sel, by="impl", x="batch", xlabel="tokens", ours=ours, legend=False)
        ax_t.set_ylabel("time per training step (ms)")
        ax_t.set_title(f"fwd+bwd, beta={beta:g}, hidden {hidden:g}, vocabulary {vocab:g}", fontsize=9)
        drawn = False
        for name, rows, style in _lines(sel, "impl", "batch", ours):
            if "extra_mib" in rows and rows["extra_mib"].notna().any():
                ax_m.plot(rows["batch"], rows["extra_mib"] / 1024, marker="o", ms=3, label=name, **style)
                drawn = True
        if not drawn:  # a CPU run: torch has no peak-memory counter there, so the panel says so, not blank
            ax_m.text(0.5, 0.5, "memory not measured on this device\n(peak memory is counted on a CUDA GPU only)",
                      ha="center", va="center", transform=ax_m.transAxes, fontsize=9)
        if memory_bound_mib:
            ax_m.axhline(memory_bound_mib / 1024, color="k", ls=":", lw=1, label="memory goal")
        ax_m.set_xscale("log")
        ax_m.set_yscale("log")
        ax_m.set_xlabel("tokens")
        ax_m.set_ylabel("extra memory of the step (GiB)")
        ax_m.set_title("beyond inputs and parameter gradients", fontsize=9)
        ax_m.grid(True, which="both", alpha=0.3)
        tokens = sorted(sel["batch"].unique())
        for ax in (ax_t, ax_m):  # the token counts themselves on the x axes (matplotlib's log labels on y: they
            ax.set_xticks(tokens, [f"{t:g}" for t in tokens])  # label minor ticks where a span has no decade)
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
    fig.suptitle(title or "the LM head fused with the divergence: time and memory against tokens", fontsize=10)
    legend_outside(fig, axes.ravel())
    note_not_drawn(fig, df[df["form"] == "linear"] if "form" in df else df.iloc[0:0], "impl")
    return fig


def plot_correctness(path: Path, ax=None, title: str = ""):
    """Worst relative error against float64 per dtype and case, with each dtype's tolerance."""
    df = read_csv(path)
    ax = ax or plt.subplots(figsize=(7.5, 4.2))[1]
    rel = df["rel_err"].where(df["rel_err"].abs() != float("inf"))  # inf (NaN misplaced, a shape): drawn below
    worst = df.assign(rel_err=rel).groupby(["dtype", "case"])["rel_err"].max().unstack(0)
    worst = worst.clip(lower=1e-17)
    worst.plot(ax=ax, marker="o", lw=0)
    for tol in df.groupby("dtype")["tol"].first():
        ax.axhline(tol, ls=":", lw=1, color="gray")
    ax.set_yscale("log")
    # Failed checks marked, so that a figure never looks passed where a check was not: at their error, or at the
    # top of the axis where it is not finite (a log axis draws no inf, and the point was simply missing).
    failed = df[~df["ok"].astype(bool)] if "ok" in df else df.iloc[:0]
    if len(failed):
        finite = worst.stack()
        top = max(1.0, float(finite.max()) * 10) if len(finite) else 1.0
        where = {case: i for i, case in enumerate(worst.index)}
        ax.scatter([where[c] for c in failed["case"]], failed["rel_err"].where(rel.notna(), top).clip(lower=1e-17),
                   marker="X", s=70, color="red", zorder=5, label=f"failed check ({len(failed)})")
        ax.legend(fontsize=7)
    ax.set_ylabel("worst relative error vs float64")
    ax.set_xticks(range(len(worst.index)))
    ax.set_xticklabels(worst.index, rotation=30, ha="right", fontsize=7)
    ax.set_title(title or "correctness against float64 (dotted: tolerances)"
                 + (f"; {len(failed)} FAILED" if len(failed) else ""))
    ax.grid(True, which="both", alpha=0.3)
    return ax


def _folder_goals(folder: Path, ours: str) -> tuple[list[dict], dict]:
    """The goals measured by the run in folder/bench.csv, and its env.json ({} if none)."""
    from .goals import goal_rows

    df = read_bench(folder / "bench.csv")
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    env = read_env(folder / "env.json")
    device = env.get("device") or ("cuda" if (df["device"] == "cuda").any() else "cpu")
    return goal_rows(rows, device, ours), env


def write_goals(folder: Path, ours: str, out: Path | None = None) -> Path:
    """goals.md (in ``out``, default ``folder``) from folder/bench.csv and env.json (the verdicts on the goals for
    that run)."""
    from .goals import goals_markdown

    path = (out or folder) / "goals.md"
    path.write_text(goals_markdown(*_folder_goals(folder, ours)))
    return path


def write_status(results: Path, ours: str, out: Path | None = None) -> Path | None:
    """status.md (in ``out``, default ``results``): each goal on each card as the latest run under ``results``
    measured it (runs of some suites only, on other days and commits, sit in folders of their own, so no single
    folder's goals.md says where every goal stands). None if no run measured a goal."""
    from .goals import status_markdown

    runs = []
    for bench in sorted(results.rglob("bench.csv")):
        goals, env = _folder_goals(bench.parent, ours)
        if goals:
            runs.append((bench.parent.relative_to(results).as_posix(), goals, env))
    if not runs:
        return None
    path = (out or results) / "status.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(status_markdown(runs))
    return path


def plot_folder(folder: Path, out: Path | None = None, *, ours: str, peers: list[str] | None = None) -> list[Path]:
    """Every PNG for one results/<device>/ folder of the KL suite, and its goals.md (first), as written."""
    out = out or folder
    out.mkdir(parents=True, exist_ok=True)
    written = []
    title = _device_title(folder)

    def save(fig, name, caption=None):
        # Below the canvas (the saved image grows to hold it: bbox_inches="tight"), clear of the axes' labels.
        fig.text(0.99, 0.0, caption or title, fontsize=7, ha="right", va="top", color="0.4")
        p = out / name
        fig.savefig(p, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(p)

    bench = folder / "bench.csv"
    if bench.exists():
        df = load_bench(bench)
        written.append(write_goals(folder, ours, out))  # with --out, the source folder is left as it is
        env = folder / "env.json"
        e = read_env(env)
        read_gbps = e.get("floor_gbps") or e.get("read_gbps")  # older runs recorded only read_gbps
        for pass_, form, dtype in df.groupby(["pass", "form", "dtype"]).groups:
            if form == "linear" or sweep_frame(df, pass_, form, dtype)["numel"].nunique() < 2:
                continue  # the fused LM head is bound by its matrix products, not bandwidth: drawn below
            fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
            plot_time_vs_size(df, pass_, form, dtype, ax=axes[0], ours=ours, legend=False)
            plot_bandwidth(df, pass_, form, dtype, read_gbps, ax=axes[1], ours=ours, legend=False)
            legend_outside(fig, axes)
            note_not_drawn(fig, df[(df["pass"] == pass_) & (df["form"] == form) & (df["dtype"] == dtype)], "impl")
            save(fig, f"time_{pass_.replace('+', '_')}_{form}_{dtype}.png")
        if linear_sweep_frame(df)["batch"].nunique() >= 2:
            from .bench_linear import LINEAR_GOALS
            bound = next((b for _, _, what, _, b in LINEAR_GOALS if what == "extra_mib"), None)
            save(plot_linear_sweep(df, ours, bound), "linear_time_memory.png")
        hf = headline_frame(df, ours)
        if not hf.empty and hf["impl"].ne(ours).any():
            # a run with none of the usual peers (the vocabulary split's: the Megatron-style peer, the graph
            # replays) charts every provider it timed
            listed = peers is None or hf["impl"].isin(peers).any()
            save(plot_speedups(df, ours, peers if listed else None), "speedups.png")
    corr = folder / "correctness.csv"
    if corr.exists():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        plot_correctness(corr, ax=ax)
        fig.tight_layout()
        save(fig, "correctness.png", _device_title(folder, "check"))  # the check's own run, not the bench's
    return written


def plot_all(results: Path, out: Path | None = None, *, ours: str, peers: list[str] | None = None) -> list[Path]:
    """PNGs for every folder under ``results`` holding CSVs (results/<device>/, and deeper ones such as a
    separate run's results/linear-sweep/<device>/); with ``out``, at the same relative paths under it."""
    written = []
    folders = sorted({p.parent for p in results.rglob("*.csv")} - {results})
    for folder in folders:
        written += plot_folder(folder, (out / folder.relative_to(results)) if out else None, ours=ours, peers=peers)
    return written
