"""The performance goals (issue 4, P1-P5) and their evaluation from benchmark rows.

goals.md beside a bench.csv is derived from it by these functions (``python -m kldiv_inline plot`` redraws it
with the PNGs), so the verdicts can be re-checked from the committed CSV without a GPU.
"""
from __future__ import annotations


# (name, device, pass, form, dtype, batch, features, timer, what, peer or None, bound).
# "x_floor": our time / floor <= bound. "speedup": peer time / our time >= bound. "rel_err": <= bound.
GOALS = [
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "x_floor", None, 1.05),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "speedup", "torch_eager", 5.0),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "speedup", "torch_compile", 1.05),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "rel_err", None, 1e-6),
    ("P2", "cuda", "fwd", "logprobs", "bfloat16", 4096, 128256, "cuda", "x_floor", None, 1.05),
    ("P2", "cuda", "fwd", "logprobs", "bfloat16", 4096, 128256, "cuda", "speedup", "liger", 1.10),
    ("P3", "cuda", "fwd+bwd", "probs", "float32", 16384, 16384, "cuda", "x_floor", None, 1.15),
    ("P3", "cuda", "fwd+bwd", "probs", "float32", 16384, 16384, "cuda", "speedup", "torch_compile", 1.5),
    ("P4", "cuda", "fwd", "probs", "float32", 128, 4096, "wall", "speedup", "torch_eager", 3.0),
    ("P5", "cpu", "fwd", "probs", "float32", 2048, 4096, "wall", "speedup", "torch_eager", 3.0),
]


def goal_rows(rows: list[dict], device: str) -> list[dict]:
    """Each goal of GOALS for `device` ("cuda" or "cpu") that the rows measured, its value, whether met."""
    def find(impl, g):
        for r in rows:
            if (r["impl"], r["pass"], r["form"], r["dtype"], int(r["batch"]), int(r["features"]), r["timer"]) == \
                    (impl, *g[2:8]) and r.get("status") == "ok":
                return r
        return None

    out = []
    for g in GOALS:
        if g[1] != device:
            continue
        name, what, peer, bound = g[0], g[8], g[9], g[10]
        ours = find("kldiv_inline", g)
        if ours is None:
            continue
        if what == "x_floor":
            value, ok, text = ours["x_floor"], ours["x_floor"] <= bound, f"time / floor <= {bound}"
        elif what == "rel_err":
            value, ok, text = ours["rel_err"], ours["rel_err"] <= bound, f"relative error <= {bound:g}"
        else:
            other = find(peer, g)
            if other is None:
                continue
            value = other["median_ms"] / ours["median_ms"]
            ok, text = value >= bound, f"{peer} time / ours >= {bound}"
        out.append({"goal": name, "case": f"{g[2]} {g[3]} {g[4]} {g[5]}x{g[6]}", "target": text,
                    "value": value, "ours_ms": ours["median_ms"], "met": bool(ok)})
    return out


def goals_markdown(goals: list[dict], env: dict) -> str:
    lines = [f"Measured on {env.get('device_name')} (torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"commit {env.get('commit')}), `{env.get('command')}`, {env.get('date_utc')}.", "",
             "| goal | case | target | measured | our median (ms) | met |", "| --- | --- | --- | --- | --- | --- |"]
    for g in goals:
        val = f"{g['value']:.2e}" if g["target"].startswith("relative") else f"{g['value']:.3f}"
        lines.append(f"| {g['goal']} | {g['case']} | {g['target']} | {val} | {g['ours_ms']:.4f} | "
                     f"{'yes' if g['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"
