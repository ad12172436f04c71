"""The performance goals (the KL suite's P1-P5, the distillation suite's D1-D6) and their evaluation from
benchmark rows.

P1: 16384^2 float32 probabilities, forward; P2: 4096 x 128256 bfloat16 log-probabilities, forward; P3: P1's
forward + backward; P4: a launch-bound 128 x 4096 forward, end to end from Python; P5: the CPU twin. The
fraction-of-peak goals hold on any card with a vendor peak (the H100 and H200 are the targets). One more
goal checks the measurement itself: no row timed with CUDA events may beat the floor (time / floor >= 1.0),
or the floor is not one (the floor of the bytes that must move, where a row has one: x_floor_moved).

goals.md beside a bench.csv is derived from it by these functions (``python -m kldiv_inline plot`` redraws it
with the PNGs), so the verdicts can be re-checked from the committed CSV without a GPU.
"""
from __future__ import annotations

import math

# (name, device, pass, form, dtype, batch, features, timer, what, peer or None, bound).
# "x_floor": our time / floor <= bound. "speedup": peer time / our time >= bound. "rel_err": <= bound.
# "pct_of_peak": our GB/s in % of the card's vendor peak >= bound.
GOALS = [
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "pct_of_peak", None, 90.0),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "x_floor", None, 1.05),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "speedup", "torch_eager", 5.0),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "speedup", "torch_compile", 1.05),
    ("P1", "cuda", "fwd", "probs", "float32", 16384, 16384, "cuda", "rel_err", None, 1e-6),
    ("P2", "cuda", "fwd", "logprobs", "bfloat16", 4096, 128256, "cuda", "pct_of_peak", None, 90.0),
    ("P2", "cuda", "fwd", "logprobs", "bfloat16", 4096, 128256, "cuda", "x_floor", None, 1.05),
    ("P2", "cuda", "fwd", "logprobs", "bfloat16", 4096, 128256, "cuda", "speedup", "liger", 1.10),
    ("P3", "cuda", "fwd+bwd", "probs", "float32", 16384, 16384, "cuda", "pct_of_peak", None, 85.0),
    ("P3", "cuda", "fwd+bwd", "probs", "float32", 16384, 16384, "cuda", "x_floor", None, 1.15),
    ("P3", "cuda", "fwd+bwd", "probs", "float32", 16384, 16384, "cuda", "speedup", "torch_compile", 1.5),
    ("P4", "cuda", "fwd", "probs", "float32", 128, 4096, "wall", "speedup", "torch_eager", 3.0),
    ("P5", "cpu", "fwd", "probs", "float32", 2048, 4096, "wall", "speedup", "torch_eager", 3.0),
]


# The distillation suite (kldiv_inline.bench_distill: bf16 logits 4096 x 128256, T = 2, 10% masked), matched on
# pass, form and beta: (name, pass, form, beta, what, peer or None, bound). "peak_x_grad": the memory a step
# allocates beyond its inputs, over the bytes of the student's gradient (no float32 copy of tokens x vocabulary).
DISTILL_GOALS = [
    ("D1", "fwd+bwd", "logits", 0.0, "x_floor", None, 1.3),
    ("D1", "fwd+bwd", "logits", 0.0, "speedup", "torch_compile", 3.5),
    ("D1", "fwd+bwd", "logits", 0.0, "speedup", "liger", 10.0),
    ("D2", "fwd+bwd", "logits", 0.5, "x_floor", None, 1.4),
    ("D2", "fwd+bwd", "logits", 0.5, "speedup", "torch_compile", 9.0),
    ("D3", "fwd", "logits", 0.0, "x_floor", None, 1.2),
    ("D4", "fwd+bwd", "topk", 0.0, "x_floor", None, 1.3),
    ("D5", "fwd+bwd", "logits", 0.0, "peak_x_grad", None, 1.1),
    ("D6", "fwd", "logits", 0.0, "rel_err", None, 1e-5),
]


# The vocabulary split across GPUs (tools/bench_vocab_parallel.py: the same global problem on 1 and on N GPUs),
# matched on form and beta: (name, form, beta, what, bound). "scaling": our time on N GPUs / ours on one <= bound;
# "scaling_graph": the same for the training steps captured in a CUDA graph (the bench's --graph rows, "<ours>_graph",
# over the captured one-GPU step: the eager split step waits on its host path, a captured one does not);
# "vs_peer": the Megatron-style peer's time on N GPUs / ours on N >= bound.
VOCAB_GOALS = [
    ("V1", "logits", 0.0, "scaling", 0.6),
    ("V1", "logits", 0.0, "scaling_graph", 0.6),
    ("V1", "logits", 0.0, "vs_peer", 4.0),
    ("V1", "logits", 0.5, "scaling", 0.6),
    ("V1", "logits", 0.5, "scaling_graph", 0.6),
    ("V1", "logits", 0.5, "vs_peer", 4.0),
    ("V2", "fused_linear", 0.0, "scaling", 0.6),
    ("V2", "fused_linear", 0.0, "vs_peer", 4.0),
    ("V2", "fused_linear", 0.5, "scaling", 0.6),
    ("V2", "fused_linear", 0.5, "vs_peer", 4.0),
]


def short_commit(commit, n: int) -> str:
    """env.json's commit with its hash cut to ``n`` characters and its marks kept (``+dirty``, ``+other-kernels``:
    cut whole, a run of changed code read as the clean commit's in status.md and the plots' captions)."""
    text = str(commit or "?")
    head, plus, marks = text.partition("+")
    return (head[:n] if len(head) == 40 else head) + plus + marks


def _number(value) -> float | None:
    """A CSV cell as a float; None when empty (NaN, None or '')."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return None if v != v else v


def pick_row(rows: list[dict], match) -> dict | None:
    """The row ``match`` accepts: a timed one ("ok") before one that failed its check or raised; None if none."""
    found = [r for r in rows if match(r)]
    return next((r for r in found if r.get("status") == "ok"), found[0] if found else None)


def _one_gpu(row: dict) -> bool:
    """A row of a run on one device (the split's rows across GPUs carry world > 1)."""
    world = _number(row.get("world"))
    return world is None or world == 1


def untimed(goal: str, case: str, target: str, mine: dict) -> dict:
    """The verdict on a goal whose case ours did not pass: NO, whatever the peers did. A run whose kernel broke
    must not leave an older run's "yes" standing as the latest (status.md takes each goal's latest row)."""
    return {"goal": goal, "case": case, "target": target, "value": math.nan, "ours_ms": math.nan, "met": False,
            "status": str(mine.get("status"))}


def no_peer_time(out: list[dict], goal: str, case: str, target: str, mine: dict, peer: str,
                 other: dict | None) -> bool:
    """Whether the peer's row ``other`` gives no time to judge a goal against: it is missing (no verdict), or the
    peer ran and was not timed (failed its check, raised, not installed), where the goal's row goes to ``out``
    not measured (``met`` None), with the peer and its status. Left out, that goal vanished from goals.md without
    a word; judged NO, a run on a machine without the peer would replace a measured verdict in status.md, which
    keeps a run's measured row over a later run's unmeasured one (status_markdown)."""
    if other is None:
        return True
    if other.get("status") == "ok":
        return False
    out.append({"goal": goal, "case": case, "target": target, "value": math.nan,
                "ours_ms": _number(mine.get("median_ms")), "met": None, "status": str(other.get("status")),
                "peer": peer})
    return True


def met_word(goal: dict) -> str:
    """A goal's verdict as the tables print it: yes, NO, or not measured (a peer not timed: no_peer_time); "(bound
    within 20-80%)" after it where the run's spread straddles the bound, a verdict another run may turn."""
    if goal["met"] is None:
        return "not measured"
    word = "yes" if goal["met"] else "NO"
    bound, span = goal.get("bound"), goal.get("spread")
    if bound is not None and span is not None and span[0] <= bound <= span[1]:
        word += " (bound within 20-80%)"
    return word


def spread_text(goal: dict) -> str:
    """The spread column: the goal's value at the run's 20% and 80% quantiles, "-" where it has none."""
    span = goal.get("spread")
    if span is None or goal.get("status", "ok") != "ok":
        return "-"
    if goal["target"].startswith("%"):
        return f"{span[0]:.1f}-{span[1]:.1f}%"
    return f"{span[0]:.3f}-{span[1]:.3f}"


def spread(what: str, value: float, mine: dict, other: dict | None = None) -> tuple[float, float] | None:
    """A time goal's value over the run's 20-80% quantiles (lowest, highest), None where the rows lack them or the
    goal is not a time (memory, error). The verdict is the median's, as the goals define it; where the bound lies
    inside this range, another run may well give the other verdict (the tables say so).
    x_floor: our time / a fixed floor; pct_of_peak: inverse in our time; speedup: the peer's over ours, their
    quantiles crossed (peer's 20% over our 80%, and the reverse); scaling: ours on N GPUs over ours on one, the same."""
    def q(row, name):
        return _number(row.get(name)) if row is not None else None

    median, low, high = q(mine, "median_ms"), q(mine, "q20_ms"), q(mine, "q80_ms")
    if value is None or value != value or not median or not low or not high:
        return None
    if what == "x_floor":  # (floor_goal passes x_floor_moved so: the same floor-over-time ratio)
        return value * low / median, value * high / median
    if what == "pct_of_peak":
        return value * median / high, value * median / low
    if what in ("speedup", "scaling"):
        o_low, o_high = q(other, "q20_ms"), q(other, "q80_ms")
        if not o_low or not o_high:
            return None
        return (o_low / high, o_high / low) if what == "speedup" else (low / o_high, high / o_low)
    return None


def floor_goal(rows: list[dict]) -> dict | None:
    """The lowest time / floor over every row timed with CUDA events (any provider): below 1.0 the floor is
    no floor. Those rows read their inputs from memory (the L2 is flushed before each call); wall-clock rows
    (the CPU, launch-bound GPU cases) are not flushed, and small inputs may come from a cache faster. Where a row
    has the floor of the bytes that must move (x_floor_moved: the distillation rows, whose masked tokens' logits
    need not be read), that one: a kernel that skips what it need not read may beat the goals' floor, not this."""
    def ratio(r):
        moved = _number(r.get("x_floor_moved"))
        return moved if moved is not None else _number(r.get("x_floor"))

    timed = [r for r in rows if r.get("status") == "ok" and r.get("timer") == "cuda" and ratio(r) is not None]
    if not timed:
        return None
    low = min(timed, key=ratio)
    value = ratio(low)
    case = f"{low['impl']} {low['pass']} {low['form']} {low['dtype']} {low['batch']}x{low['features']}"
    return {"goal": "floor", "case": f"every row timed by CUDA events (lowest: {case})",
            "target": "time / floor >= 1.0", "value": value,
            "ours_ms": _number(low["median_ms"]), "met": value >= 1.0, "bound": 1.0,
            "spread": spread("x_floor", value, low)}


def goal_rows(rows: list[dict], device: str, ours: str) -> list[dict]:
    """Each goal of GOALS for `device` ("cuda" or "cpu") that the rows measured for provider `ours`, its
    value and whether it is met, then the floor goal."""
    def find(impl, g):
        def match(r):
            key = (r["impl"], r["pass"], r["form"], r["dtype"], int(r["batch"]), int(r["features"]), r["timer"])
            return key == (impl, *g[2:8]) and _one_gpu(r)
        return pick_row(rows, match)

    out = []
    for g in GOALS:
        if g[1] != device:
            continue
        name, what, peer, bound = g[0], g[8], g[9], g[10]
        case = f"{g[2]} {g[3]} {g[4]} {g[5]}x{g[6]}"
        text = {"speedup": f"{peer} time / ours >= {bound}", "pct_of_peak": f"% of vendor peak >= {bound:g}",
                "x_floor": f"time / floor <= {bound}"}.get(what, f"relative error <= {bound:g}")
        mine = find(ours, g)
        if mine is None:
            continue
        if mine.get("status") != "ok":
            out.append(untimed(name, case, text, mine))
            continue
        if what == "speedup":
            other = find(peer, g)
            if no_peer_time(out, name, case, text, mine, peer, other):
                continue
            value = _number(other["median_ms"]) / _number(mine["median_ms"])
            ok = value >= bound
        else:
            other = None
            value = _number(mine.get(what))
            if value is None:  # e.g. pct_of_peak on a card without a known peak, or an older CSV
                continue
            ok = value >= bound if what == "pct_of_peak" else value <= bound
        out.append({"goal": name, "case": case, "target": text, "value": value,
                    "ours_ms": _number(mine["median_ms"]), "met": bool(ok), "bound": bound,
                    "spread": spread(what, value, mine, other)})
    if device == "cuda":
        from .bench_linear import goal_rows as linear_goal_rows  # the fused LM head's goals (L1-L4)

        out += distill_goal_rows(rows, ours) + linear_goal_rows(rows, ours) + vocab_goal_rows(rows, ours)
    floor = floor_goal(rows)
    return out + ([floor] if floor else [])


def vocab_goal_rows(rows: list[dict], ours: str, peer: str = "megatron_style") -> list[dict]:
    """VOCAB_GOALS measured in rows that carry a `world` column (a run over several GPUs)."""
    def find(impl, form, beta, world):
        return pick_row(rows, lambda r: (r.get("impl") == impl and r.get("form") == form
                                      and _number(r.get("beta")) == beta and _number(r.get("world")) == world))

    worlds = {_number(r.get("world")) for r in rows} - {None, 1.0}
    out = []
    for world in sorted(worlds):
        for name, form, beta, what, bound in VOCAB_GOALS:
            impl = f"{ours}_graph" if what == "scaling_graph" else ours
            mine, one = find(impl, form, beta, world), find(impl, form, beta, 1.0)
            if mine is None:
                continue
            case = f"fwd+bwd {form} beta={beta:g} {mine['dtype']} {int(mine['batch'])}x{int(mine['features'])}"
            how = "steps captured in a CUDA graph: " if what == "scaling_graph" else ""
            text = (f"{how}time on {world:g} GPUs / on 1 <= {bound}" if what in ("scaling", "scaling_graph")
                    else f"{peer} time / ours on {world:g} GPUs >= {bound}")
            failed = next((r for r in (mine, one) if r is not None and r.get("status") != "ok"), None)
            if failed is not None:  # ours on N GPUs, or on the one it is measured against
                out.append(untimed(name, case, text, failed))
                continue
            if what in ("scaling", "scaling_graph"):
                if one is None:
                    continue
                value = _number(mine["median_ms"]) / _number(one["median_ms"])
                ok = value <= bound
                span = spread("scaling", value, mine, one)
            else:
                other = find(peer, form, beta, world)
                if no_peer_time(out, name, case, text, mine, peer, other):
                    continue
                value = _number(other["median_ms"]) / _number(mine["median_ms"])
                ok = value >= bound
                span = spread("speedup", value, mine, other)
            out.append({"goal": name, "case": case, "target": text, "value": value,
                        "ours_ms": _number(mine["median_ms"]), "met": bool(ok), "bound": bound, "spread": span})
    return out


def distill_goal_rows(rows: list[dict], ours: str) -> list[dict]:
    """DISTILL_GOALS measured in the rows (the distillation suite's size only), their values and verdicts."""
    def find(impl, pass_, form, beta):
        return pick_row(rows, lambda r: (r.get("impl") == impl and r.get("pass") == pass_ and r.get("form") == form
                                      and _number(r.get("beta")) == beta and r.get("dtype") == "bfloat16"
                                      and _one_gpu(r) and (int(r["batch"]), int(r["features"])) == (4096, 128256)))

    out = []
    for name, pass_, form, beta, what, peer, bound in DISTILL_GOALS:
        case = f"{pass_} {form} beta={beta:g} bfloat16 4096x128256"
        text = {"speedup": f"{peer} time / ours >= {bound}", "peak_x_grad": f"peak memory / gradient bytes <= {bound}",
                "x_floor": f"time / floor <= {bound}"}.get(what, f"relative error <= {bound:g}")
        mine = find(ours, pass_, form, beta)
        if mine is None:
            continue
        if mine.get("status") != "ok":
            out.append(untimed(name, case, text, mine))
            continue
        other = None
        if what == "speedup":
            other = find(peer, pass_, form, beta)
            if no_peer_time(out, name, case, text, mine, peer, other):
                continue
            value = _number(other["median_ms"]) / _number(mine["median_ms"])
            ok = value >= bound
        elif what == "peak_x_grad":
            peak = _number(mine.get("peak_mib"))
            if peak is None:
                continue
            value = peak / (int(mine["batch"]) * int(mine["features"]) * 2 / 2**20)
            ok = value <= bound
        else:
            value = _number(mine.get(what))
            if value is None:
                continue
            ok = value <= bound
        out.append({"goal": name, "case": case, "target": text, "value": value,
                    "ours_ms": _number(mine["median_ms"]), "met": bool(ok), "bound": bound,
                    "spread": spread(what, value, mine, other)})
    return out


def format_value(goal: dict) -> str:
    """A goal's measured value as goals.md, status.md and the README's tables print it."""
    if goal.get("status", "ok") != "ok":  # ours (or the peer named) failed its check or raised: no value to show
        word = goal["status"].split(":")[0]
        return f'peer "{goal["peer"]}" not timed: {word}' if goal.get("peer") else "not timed: " + word
    if goal["target"].startswith("relative") or "rel_err" in goal["target"]:  # 0.000 would hide a 2e-5
        return f"{goal['value']:.2e}"
    if goal["target"].startswith("%"):
        return f"{goal['value']:.1f}%"
    return f"{goal['value']:.3f}"


def goals_markdown(goals: list[dict], env: dict) -> str:
    floor = ""
    if env.get("floor_gbps"):
        sources = {k.removeprefix("read_gbps_"): v for k, v in env.items() if k.startswith("read_gbps_")}
        floor = (f" Floor: read {env['floor_gbps']:.0f} GB/s ({env.get('floor_source')}; "
                 + ", ".join(f"{k} {v:.0f}" for k, v in sorted(sources.items())) + ")"
                 + (f", vendor peak {env['peak_gbps']:.0f} GB/s." if env.get("peak_gbps") else "."))
    versions = f"torch {env.get('torch')}, CUDA {env.get('cuda')}"
    if "torch_cuda_build" in env and env.get("device") != "cuda":
        # A CPU run ran no CUDA: the version is that torch was built with. (Records from before this key keep the
        # text their committed goals.md was written with.)
        build = env["torch_cuda_build"]
        versions = f"torch {env.get('torch')} built with " + (f"CUDA {build}" if build else "no CUDA") + ", CPU only"
    lines = [f"Measured on {env.get('device_name')} ({versions}, "
             f"commit {env.get('commit')}), `{env.get('command')}`, {env.get('date_utc')}.{floor}"
             + (f" Partial run: {env['partial']}." if env.get("partial") else ""), "",
             "| goal | case | target | measured | 20-80% | median (ms) | met |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for g in goals:
        ms = "-" if g["ours_ms"] != g["ours_ms"] else f"{g['ours_ms']:.4f}"  # (NaN: not timed)
        lines.append(f"| {g['goal']} | {g['case']} | {g['target']} | {format_value(g)} | {spread_text(g)} | {ms} "
                     f"| {met_word(g)} |")
    return "\n".join(lines) + "\n"


def _goal_order(name: str) -> tuple:
    """P1..P5, D1.., L1.., V1.., then the floor goal."""
    head, digits = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")):]
    return ("PDLV".find(head) if head in ("P", "D", "L", "V") else 4, int(digits) if digits else 0)


def status_markdown(runs: list[tuple[str, list[dict], dict]]) -> str:
    """The table of status.md: for each (goal, case, target, card), the row of the latest run (by its env.json's
    date) that measured it; the floor goal (no row may beat the floor) as the lowest over all of the card's runs.
    ``runs``: (folder, its goal rows, its env.json) per run."""
    latest: dict[tuple, tuple] = {}
    for folder, goals, env in runs:
        card = str(env.get("device_name") or folder)
        if (env.get("world") or 1) > 1:
            card += f" x {env['world']}"
        date = str(env.get("date_utc") or "")
        for g in goals:
            if g["goal"] == "floor":  # a check of each run, not of the code: the lowest over every run of the card
                key = ("floor", "", g["target"], card)
                if key not in latest or g["value"] < latest[key][3]["value"]:
                    latest[key] = (date, folder, env, g)
                continue
            key = (g["goal"], g["case"], g["target"], card)
            # (a measured row over an unmeasured one whatever their dates: a later run without the peer says
            # nothing of the goal; the row shown names its run, commit and date)
            held = latest.get(key)
            if held is None or ((g["met"] is not None, date) >= (held[3]["met"] is not None, held[0])):
                latest[key] = (date, folder, env, g)
    lines = ["Each goal on each card as the latest committed run measured it (its folder, commit and date; a partial "
             "run's rows are marked). Written by `python -m kldiv_inline plot` (and `make results`) from every "
             "bench.csv under results/: runs of some suites only live in folders of their own, so no one folder's "
             "goals.md holds every goal. The latest run is not always at the newest commit: the run column says "
             "which code was measured. The floor row is the lowest time / floor of all the card's runs. A time "
             "goal's verdict is its median's; 20-80% is the value at the run's 20% and 80% quantiles (a speedup "
             "crosses the peer's and ours), and a verdict whose bound lies within it says so: another run may turn "
             "it.", "",
             "| goal | case | target | card | measured | 20-80% | met | run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(latest, key=lambda k: (_goal_order(k[0]), k[1], k[2], k[3])):
        date, folder, env, g = latest[key]
        card = key[3]
        run = f"{folder} ({short_commit(env.get('commit'), 7)}, {date[:10] or '?'}" + (
            ", partial)" if env.get("partial") else ")")
        lines.append(f"| {g['goal']} | {g['case']} | {g['target']} | {card} | {format_value(g)} | {spread_text(g)} "
                     f"| {met_word(g)} | {run} |")
    return "\n".join(lines) + "\n"
