"""Results CSV -> PNG. No GPU needed: every figure is drawn from the files under results/<device>/.

The notebooks call the same functions, so a plot in a notebook and the PNG in results/ are one drawing.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt  # without a display matplotlib picks the Agg backend by itself
import pandas as pd

PEER_ORDER = ["kldiv_inline", "torch_eager", "torch_compile", "liger"]
COLORS = {"kldiv_inline": "tab:red", "torch_eager": "tab:blue", "torch_compile": "tab:green",
          "liger": "tab:purple", "v0_seed": "tab:gray", "v1_grid_stride": "tab:brown",
          "v2_vectorized": "tab:olive", "v3_ratio_log": "tab:orange"}


def load_bench(path: Path) -> pd.DataFrame:
    df = pd.read_csv(path)
    df["numel"] = df["batch"] * df["features"]
    itemsize = df["dtype"].map({"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2})
    df["mib_per_input"] = df["numel"] * itemsize / 2**20
    return df


def _device_title(folder: Path) -> str:
    env = folder / "env.json"
    if env.exists():
        import json

        e = json.loads(env.read_text())
        return f"{e.get('device_name', folder.name)} · torch {e.get('torch', '?')} · {str(e.get('commit', '?'))[:10]}"
    return folder.name


def _impl_order(impls) -> list[str]:
    known = [i for i in PEER_ORDER if i in impls]
    return known + sorted(i for i in impls if i not in known)


def sweep_frame(df: pd.DataFrame, pass_: str, form: str, dtype: str) -> pd.DataFrame:
    sel = df[(df["pass"] == pass_) & (df["form"] == form) & (df["dtype"] == dtype) & (df["status"] == "ok")]
    sel = sel[sel["timer"] != "wall"] if (sel["timer"] != "wall").any() else sel
    return sel.sort_values("numel")


def _per_impl(sel: pd.DataFrame):
    """(impl, its rows by size) in the plotting order, one row per size."""
    for impl in _impl_order(sel["impl"].unique()):
        rows = sel[sel["impl"] == impl].groupby("mib_per_input", as_index=False).first()
        if not rows.empty:
            yield impl, rows


def plot_time_vs_size(df: pd.DataFrame, pass_: str, form: str, dtype: str, ax=None, title: str = ""):
    """Median time against MiB per input, log-log, with 20-80% bands; the floor as a dashed line."""
    sel = sweep_frame(df, pass_, form, dtype)
    ax = ax or plt.subplots(figsize=(6.4, 4.2))[1]
    for impl, s in _per_impl(sel):
        ax.plot(s["mib_per_input"], s["median_ms"], marker="o", ms=3, label=impl, color=COLORS.get(impl))
        ax.fill_between(s["mib_per_input"], s["q20_ms"], s["q80_ms"], alpha=0.2, color=COLORS.get(impl))
    floor = sel.groupby("mib_per_input", as_index=False)["floor_ms"].first()
    ax.plot(floor["mib_per_input"], floor["floor_ms"], "k--", lw=1, label="bandwidth floor")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MiB per input")
    ax.set_ylabel("time per call (ms)")
    ax.set_title(title or f"{pass_}, {form}, {dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_bandwidth(df: pd.DataFrame, pass_: str, form: str, dtype: str, read_gbps: float | None = None,
                   ax=None, title: str = ""):
    """Achieved GB/s (bytes that must move / time) against size, with the measured read bandwidth."""
    sel = sweep_frame(df, pass_, form, dtype)
    ax = ax or plt.subplots(figsize=(6.4, 4.2))[1]
    for impl, s in _per_impl(sel):
        ax.plot(s["mib_per_input"], s["gbps"], marker="o", ms=3, label=impl, color=COLORS.get(impl))
    if read_gbps:
        ax.axhline(read_gbps, color="k", ls="--", lw=1, label=f"measured read {read_gbps:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("MiB per input")
    ax.set_ylabel("GB/s of required traffic")
    ax.set_title(title or f"bandwidth, {pass_}, {form}, {dtype}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def headline_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Our time against each peer's at the headline cases (the largest size of each pass/form/dtype)."""
    rows = []
    for (pass_, form, dtype), g in df[df["status"] == "ok"].groupby(["pass", "form", "dtype"]):
        for (batch, features), h in g.groupby(["batch", "features"]):
            ours = h[h["impl"] == "kldiv_inline"]
            if ours.empty:
                continue
            t_ours = float(ours["median_ms"].iloc[0])
            for _, r in h.iterrows():
                rows.append({"case": f"{pass_} {form} {dtype} {batch}x{features}", "impl": r["impl"],
                             "median_ms": r["median_ms"], "speedup_of_ours": r["median_ms"] / t_ours,
                             "x_floor": r["x_floor"], "timer": r["timer"]})
    return pd.DataFrame(rows)


def plot_speedups(df: pd.DataFrame, cases: list[str] | None = None, ax=None, title: str = ""):
    """Bars: peer time / our time at the headline cases (above 1: we are faster)."""
    hf = headline_frame(df)
    if cases:
        hf = hf[hf["case"].isin(cases)]
    hf = hf[hf["impl"] != "kldiv_inline"]
    ax = ax or plt.subplots(figsize=(7.5, 4.2))[1]
    case_names = list(dict.fromkeys(hf["case"]))
    impls = _impl_order(hf["impl"].unique())
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        vals = [hf[(hf["case"] == c) & (hf["impl"] == impl)]["speedup_of_ours"].max() for c in case_names]
        ax.bar([i + j * width for i in range(len(case_names))], vals, width, label=impl, color=COLORS.get(impl))
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(case_names))])
    ax.set_xticklabels([c.replace(" ", "\n", 3) for c in case_names], fontsize=7)
    ax.set_ylabel("peer time / kldiv_inline time")
    ax.set_yscale("log")
    ax.set_title(title or "speed-up of kldiv_inline over each peer")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    return ax


def plot_correctness(path: Path, ax=None, title: str = ""):
    """Worst relative error against float64 per dtype and case, with each dtype's tolerance."""
    df = pd.read_csv(path)
    ax = ax or plt.subplots(figsize=(7.5, 4.2))[1]
    worst = df.groupby(["dtype", "case"])["rel_err"].max().unstack(0)
    worst = worst.clip(lower=1e-17)
    worst.plot(ax=ax, marker="o", lw=0)
    for dtype, tol in df.groupby("dtype")["tol"].first().items():
        ax.axhline(tol, ls=":", lw=1, color="gray")
    ax.set_yscale("log")
    ax.set_ylabel("worst relative error vs float64")
    ax.set_xticks(range(len(worst.index)))
    ax.set_xticklabels(worst.index, rotation=30, ha="right", fontsize=7)
    ax.set_title(title or "correctness against float64 (dotted: tolerances)")
    ax.grid(True, which="both", alpha=0.3)
    return ax


def write_goals(folder: Path) -> Path:
    """folder/goals.md from folder/bench.csv and env.json (the verdicts on P1-P5 for that run)."""
    import json

    from .goals import goal_rows, goals_markdown

    df = pd.read_csv(folder / "bench.csv")
    rows = df.astype(object).where(df.notna(), None).to_dict("records")
    env = json.loads((folder / "env.json").read_text()) if (folder / "env.json").exists() else {}
    device = env.get("device") or ("cuda" if (df["device"] == "cuda").any() else "cpu")
    path = folder / "goals.md"
    path.write_text(goals_markdown(goal_rows(rows, device), env))
    return path


def plot_folder(folder: Path, out: Path | None = None) -> list[Path]:
    """Every PNG for one results/<device>/ folder."""
    out = out or folder
    out.mkdir(parents=True, exist_ok=True)
    written = []
    title = _device_title(folder)

    def save(fig, name):
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        p = out / name
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)

    bench = folder / "bench.csv"
    if bench.exists():
        df = load_bench(bench)
        write_goals(folder)
        read_gbps = None
        env = folder / "env.json"
        if env.exists():
            import json

            read_gbps = json.loads(env.read_text()).get("read_gbps")
        for (pass_, form, dtype), g in df.groupby(["pass", "form", "dtype"]):
            if sweep_frame(df, pass_, form, dtype)["numel"].nunique() < 2:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
            plot_time_vs_size(df, pass_, form, dtype, ax=axes[0])
            plot_bandwidth(df, pass_, form, dtype, read_gbps, ax=axes[1])
            save(fig, f"time_{pass_.replace('+', '_')}_{form}_{dtype}.png")
        if not headline_frame(df).empty:
            fig, ax = plt.subplots(figsize=(9, 4.5))
            plot_speedups(df, ax=ax)
            save(fig, "speedups.png")
    corr = folder / "correctness.csv"
    if corr.exists():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        plot_correctness(corr, ax=ax)
        save(fig, "correctness.png")
    return written


def plot_all(results: Path, out: Path | None = None) -> list[Path]:
    """PNGs for every results/<device>/ folder holding CSVs."""
    written = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        if any(folder.glob("*.csv")):
            written += plot_folder(folder, (out / folder.name) if out else None)
    return written
