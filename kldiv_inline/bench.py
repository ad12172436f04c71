"""Timing harness: the kit's op, its kernel variants and the peers, side by side on one device in one run.

Method (see ../shared/anchors.md and the device notes): CUDA events around each call after warm-up; the L2
cache flushed (a 256 MiB write) before every timed call when the inputs fit in it; inputs rotated among
several sets; median with 20% and 80% quantiles. The floor is the bytes that must move (each input read
once, plus the gradient written once for fwd+bwd) over the read bandwidth measured at the start of the run.
Each provider is checked against float64 before it is timed; a wrong one is reported, not timed.
Launch-bound sizes are also timed end to end from Python (``timer=wall``): back-to-back calls, one sync.
On a machine without a GPU the same harness times the CPU twin with a wall clock.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import check
from .goals import goal_rows, goals_markdown
from .ops import kl_div, kl_div_from_probs
from .reference import kl_div_reference, probability_rows, relative_error

COLUMNS = ["device", "impl", "pass", "form", "dtype", "batch", "features", "median_ms", "q20_ms", "q80_ms",
           "gbps", "floor_ms", "x_floor", "rel_err", "status", "timer"]


# ---------------------------------------------------------------------------------------------- timing
def quantiles(times_ms: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else times_ms * 9
    return statistics.median(times_ms), qs[1], qs[7]


class L2Flush:
    """Overwrites a buffer larger than the L2 cache, so the next call reads its inputs from memory."""

    def __init__(self, device: str):
        self.buf = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device == "cuda" else None

    def __call__(self):
        if self.buf is not None:
            self.buf.fill_(1)


def l2_bytes(device: str) -> int:
    if device != "cuda":
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "L2_cache_size", 50 << 20)


def time_cuda(fn: Callable, args_sets: list, reps: int, warmup: int, flush: L2Flush | None) -> list[float]:
    for i in range(warmup):
        fn(*args_sets[i % len(args_sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush()
        starts[i].record()
        fn(*args_sets[i % len(args_sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def time_wall(fn: Callable, args_sets: list, reps: int, warmup: int, device: str, inner: int = 1) -> list[float]:
    """Wall time per call; with inner > 1, back-to-back calls with one sync (host overhead included)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(warmup):
        fn(*args_sets[i % len(args_sets)])
    sync()
    out = []
    for i in range(reps):
        t0 = time.perf_counter()
        for j in range(inner):
            fn(*args_sets[(i * inner + j) % len(args_sets)])
        sync()
        out.append((time.perf_counter() - t0) * 1e3 / inner)
    return out


def read_bandwidth_gbps(device: str, nbytes: int = 1 << 30, reps: int = 20) -> tuple[float, float]:
    """(read GB/s of a read-only reduction, copy GB/s counting read + write) over nbytes."""
    x = torch.rand(nbytes // 4, device=device)
    y = torch.empty_like(x)
    if device == "cuda":
        t_read = statistics.median(time_cuda(lambda a: a.sum(), [(x,)], reps, 3, None))
        t_copy = statistics.median(time_cuda(lambda a: y.copy_(a), [(x,)], reps, 3, None))
    else:
        t_read = statistics.median(time_wall(lambda a: a.sum(), [(x,)], max(3, reps // 4), 1, device))
        t_copy = statistics.median(time_wall(lambda a: y.copy_(a), [(x,)], max(3, reps // 4), 1, device))
    return nbytes / t_read / 1e6, 2 * nbytes / t_copy / 1e6


# ------------------------------------------------------------------------------------------- providers
@dataclasses.dataclass
class Case:
    form: str          # "probs": predictions are probabilities (log inside); "logprobs": PyTorch's convention
    dtype: torch.dtype
    batch: int
    features: int
    passes: tuple[str, ...] = ("fwd",)
    timer: str = "cuda"  # "cuda" events, or "wall" (end to end from Python)

    @property
    def numel(self) -> int:
        return self.batch * self.features

    def bytes_moved(self, pass_: str) -> int:
        tensors = 3 if pass_ == "fwd+bwd" else 2
        return tensors * self.numel * torch.finfo(self.dtype).bits // 8


def make_inputs(case: Case, device: str):
    p = probability_rows(case.batch, case.features, dtype=torch.float64, device=device)
    t = probability_rows(case.batch, case.features, dtype=torch.float64, device=device)
    x = p if case.form == "probs" else p.log()
    return x.to(case.dtype), t.to(case.dtype)


def _eager(form):
    if form == "probs":
        return lambda p, t: F.kl_div(torch.log(p), t, reduction="batchmean")
    return lambda x, t: F.kl_div(x, t, reduction="batchmean")


def _ours(form):
    if form == "probs":
        return lambda p, t: kl_div_from_probs(p, t, reduction="batchmean")
    return lambda x, t: kl_div(x, t, reduction="batchmean")


def _compiled(form):
    # Static shapes, compiled afresh for each case (run_case resets Dynamo): one compiled function reused
    # over the sweep would go dynamic after the second shape and then run slower than eager.
    return torch.compile(_eager(form), dynamic=False)


def _liger(form):
    try:
        from liger_kernel.transformers.functional import liger_kl_div
    except Exception:  # not installed, or no triton here
        return None
    if form == "probs":
        return lambda p, t: liger_kl_div(torch.log(p), t, reduction="batchmean")
    return lambda x, t: liger_kl_div(x, t, reduction="batchmean")


def _variant(name):
    from .variants import load_variant

    mod = load_variant(name)
    return lambda p, t: mod.kl_div_probs_batchmean(p, t)


def providers(case: Case, device: str, variants: list[str], pass_: str) -> dict[str, Callable | None]:
    out: dict[str, Callable | None] = {"kldiv_inline": _ours(case.form), "torch_eager": _eager(case.form)}
    if device == "cuda":
        out["torch_compile"] = _compiled(case.form)
        out["liger"] = _liger(case.form)
        # The variants implement the seed's problem only: probabilities in, float32, batchmean, forward.
        if case.form == "probs" and case.dtype == torch.float32 and pass_ == "fwd":
            for v in variants:
                out[v] = _variant(v)
    return out


# ------------------------------------------------------------------------------------------------ runs
def _with_backward(fn):
    def run(x, t):
        x.grad = None
        loss = fn(x, t)
        loss.backward()
        return loss
    return run


def check_provider(fn, x, t, case: Case, pass_: str) -> float:
    """Relative error of the loss (and of the gradient for fwd+bwd) against float64."""
    ref = kl_div_reference(x.detach(), t, "batchmean", from_probs=case.form == "probs")
    if pass_ == "fwd":
        with torch.no_grad():
            out = fn(x, t)
        return relative_error(out.reshape(()), ref)
    xr = x.detach().double().requires_grad_()
    r = F.kl_div(torch.log(xr) if case.form == "probs" else xr, t.double(), reduction="batchmean")
    r.backward()
    xg = x.detach().requires_grad_()
    out = fn(xg, t)
    out.backward()
    return max(relative_error(out.reshape(()), r.detach()), relative_error(xg.grad, xr.grad))


TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def run_case(case: Case, device: str, read_gbps: float, variants: list[str], reps: int, warmup: int,
             flush: L2Flush) -> list[dict]:
    rows = []
    x, t = make_inputs(case, device)
    fits = case.bytes_moved("fwd") <= 2 * l2_bytes(device)
    n_sets = 1
    if fits:  # rotate among input sets that together overflow the L2
        n_sets = min(8, max(2, (3 * l2_bytes(device)) // max(1, case.bytes_moved("fwd")) + 1))
    sets = [(x, t)] + [make_inputs(case, device) for _ in range(n_sets - 1)]
    torch._dynamo.reset()  # torch.compile sees each case's shapes fresh
    for pass_ in case.passes:
        floor_ms = case.bytes_moved(pass_) / read_gbps / 1e6
        for impl, fn in providers(case, device, variants, pass_).items():
            row = {"device": device, "impl": impl, "pass": pass_, "form": case.form,
                   "dtype": str(case.dtype).removeprefix("torch."), "batch": case.batch,
                   "features": case.features, "floor_ms": floor_ms, "timer": case.timer}
            if fn is None:
                rows.append({**row, "status": "not installed"})
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    err = check_provider(fn, x, t, case, pass_)
                row["rel_err"] = err
                if not err <= TOL[case.dtype]:
                    rows.append({**row, "status": "wrong"})
                    continue
                if pass_ == "fwd+bwd":
                    run = _with_backward(fn)
                    run_sets = [(a.detach().requires_grad_(), b) for a, b in sets]
                else:
                    run, run_sets = fn, sets
                with warnings.catch_warnings(), torch.inference_mode(pass_ == "fwd"):
                    warnings.simplefilter("ignore")
                    if case.timer == "wall" or device != "cuda":
                        inner = 50 if device == "cuda" else 1
                        times = time_wall(run, run_sets, reps, warmup, device, inner=inner)
                    else:
                        times = time_cuda(run, run_sets, reps, warmup, flush if fits else None)
            except Exception as e:  # a provider that fails is reported, the run goes on
                rows.append({**row, "status": f"error: {type(e).__name__}: {str(e)[:120]}"})
                continue
            med, q20, q80 = quantiles(times)
            rows.append({**row, "median_ms": med, "q20_ms": q20, "q80_ms": q80,
                         "gbps": case.bytes_moved(pass_) / med / 1e6, "x_floor": med / floor_ms,
                         "status": "ok"})
        torch.cuda.empty_cache() if device == "cuda" else None
    return rows


def headline_cases(device: str) -> list[Case]:
    """The goals of issue 4 (P1-P5), named so the README can quote them."""
    if device != "cuda":
        return [Case("probs", torch.float32, 2048, 4096, ("fwd",), "wall")]  # P5
    return [
        Case("probs", torch.float32, 16384, 16384, ("fwd", "fwd+bwd")),  # P1, P3
        Case("logprobs", torch.bfloat16, 4096, 128256, ("fwd",)),         # P2
        Case("probs", torch.float32, 128, 4096, ("fwd",), "wall"),         # P4
    ]


def sweep_cases(device: str) -> list[Case]:
    """Rows of 16384 features from tiny to more than 1 GiB per input (float32), both passes."""
    if device != "cuda":
        return [Case("probs", torch.float32, b, 4096, ("fwd", "fwd+bwd"), "wall") for b in (16, 128, 512, 2048)]
    return ([Case("probs", torch.float32, b, 16384, ("fwd", "fwd+bwd")) for b in (16, 256, 2048, 20480)]
            + [Case("logprobs", torch.bfloat16, b, 128256, ("fwd",)) for b in (64, 1024)])


def write_csv(rows: list[dict], path: Path) -> Path:
    return check.write_csv(rows, path, columns=COLUMNS)


def table(rows: list[dict]) -> str:
    lines = [f"{'impl':<16}{'pass':<8}{'form':<9}{'dtype':<9}{'shape':>14}{'median ms':>11}{'x floor':>9}"
             f"{'status':>8}"]
    for r in rows:
        shape = f"{r['batch']}x{r['features']}"
        med = f"{r['median_ms']:.4f}" if r.get("median_ms") is not None else "-"
        xf = f"{r['x_floor']:.3f}" if r.get("x_floor") is not None else "-"
        lines.append(f"{r['impl']:<16}{r['pass']:<8}{r['form']:<9}{r['dtype']:<9}{shape:>14}{med:>11}{xf:>9}"
                     f"  {r['status'][:40]}")
    return "\n".join(lines)


def main(args) -> int:
    from .envinfo import device_slug, write_env
    from .variants import variant_names

    device = args.device  # resolved by the CLI: "cuda" or "cpu"
    folder = Path(args.results) / device_slug(device)
    read_gbps, copy_gbps = read_bandwidth_gbps(device)
    print(f"{device}: read {read_gbps:.0f} GB/s, copy {copy_gbps:.0f} GB/s", file=sys.stderr)
    variants = variant_names() if device == "cuda" else []
    cases = headline_cases(device) + ([] if getattr(args, "headline_only", False) else sweep_cases(device))
    flush = L2Flush(device)
    reps = getattr(args, "reps", 30)
    rows = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda it, **kw: it  # noqa: E731
    for case in tqdm(cases, desc="bench", file=sys.stderr):
        rows += run_case(case, device, read_gbps, variants, reps=reps, warmup=5, flush=flush)
    path = write_csv(rows, folder / "bench.csv")
    env_path = write_env(folder, device, {"read_gbps": round(read_gbps, 1), "copy_gbps": round(copy_gbps, 1)})
    goals = goal_rows(rows, device)
    (folder / "goals.md").write_text(goals_markdown(goals, json.loads(env_path.read_text())))
    print(table(rows))
    for g in goals:
        print(f"{g['goal']} {g['case']}: {g['target']}: {g['value']:.4g} {'met' if g['met'] else 'NOT MET'}")
    print(f"-> {path}")
    return 0
