"""The KL suite: the kit's op, its kernel variants and the peers, side by side on one device in one run.

Each case (a form, a dtype, a shape, its passes and its timer) becomes one ``harness.Case`` per pass, with
the KL columns (pass, form, dtype, batch, features) as its meta; ``harness.bench`` checks every provider
against PyTorch in float64 (the loss, and for fwd+bwd the input's gradient too), refuses to time a wrong
one, and times the rest (method: ``kldiv_inline.timing``; floor: ``kldiv_inline.floors``). Launch-bound
sizes are timed end to end from Python (``timer=wall``). On a machine without a GPU the CPU twin is timed
with a wall clock. ``python -m kldiv_inline bench`` writes results/<device>/bench.csv, env.json, goals.md.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from . import floors, harness
from .goals import goal_rows, goals_markdown
from .ops import kl_div, kl_div_from_probs
from .reference import probability_rows

OURS = "kldiv_inline"                                   # the provider the goals and plots measure
PEERS = ["torch_eager", "torch_compile", "liger"]       # the speed-up chart's peers (variants: time plots)

# The CSV's columns: those of older runs first (they still plot), then the floor's and % of peak.
COLUMNS = ["device", "impl", "pass", "form", "dtype", "batch", "features", "median_ms", "q20_ms", "q80_ms",
           "gbps", "floor_ms", "x_floor", "rel_err", "status", "timer", "bytes", "floor_gbps", "floor_source",
           "pct_of_peak", "beta", "peak_mib", "hidden", "extra_mib", "matmul_tflops", "loss_rel_err", "grad_rel_err",
           "grad_rel_err_torch", "loss_rel_err_torch", "moved_bytes", "x_floor_moved", "matmul_tflops_sustained",
           "x_floor_sustained"]


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
        """Both inputs read once; for fwd+bwd the input's gradient written once too."""
        tensors = 3 if pass_ == "fwd+bwd" else 2
        return tensors * self.numel * torch.finfo(self.dtype).bits // 8


def make_inputs(case: Case, device: str):
    p = probability_rows(case.batch, case.features, dtype=torch.float64, device=device)
    t = probability_rows(case.batch, case.features, dtype=torch.float64, device=device)
    x = p if case.form == "probs" else p.log()
    return x.to(case.dtype), t.to(case.dtype)


# ------------------------------------------------------------------------------------------- providers
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

    try:
        mod = load_variant(name)
    except Exception as e:  # a variant that does not build is one failed provider (its row says why), not the run's end
        def fails(p, t, error=e):
            raise error
        return fails
    # The seed's design returns shape [1] (one of its faults, shown in notebook 03), PyTorch a 0-d loss: time
    # it through a 0-d view, as the check compares shapes.
    return lambda p, t: mod.kl_div_probs_batchmean(p, t).reshape(())


def _with_backward(fn):
    """A training step: the loss and d loss / d input (the input is a leaf that requires grad)."""
    def step(x, t):
        x.grad = None
        loss = fn(x, t)
        loss.backward()
        return loss, x.grad
    return step


def providers(case: Case, device: str, variants: list[str], pass_: str) -> dict[str, Callable | None]:
    out: dict[str, Callable | None] = {OURS: _ours(case.form), "torch_eager": _eager(case.form)}
    if device == "cuda":
        out["torch_compile"] = _compiled(case.form)
        out["liger"] = _liger(case.form)
        # The variants implement the seed's problem only: probabilities in, float32, batchmean, forward.
        if case.form == "probs" and case.dtype == torch.float32 and pass_ == "fwd":
            for v in variants:
                out[v] = _variant(v)
    if pass_ == "fwd+bwd":
        out = {name: fn and _with_backward(fn) for name, fn in out.items()}
    return out


def reference(form: str, pass_: str) -> Callable:
    """PyTorch's kl_div (the harness calls it on float64 copies of the inputs)."""
    return _with_backward(_eager(form)) if pass_ == "fwd+bwd" else _eager(form)


# ------------------------------------------------------------------------------------------------ runs
def case_metas(case: Case) -> list[dict]:
    """The columns that name each pass's rows of a case."""
    dtype = str(case.dtype).removeprefix("torch.")
    return [{"pass": pass_, "form": case.form, "dtype": dtype, "batch": case.batch, "features": case.features}
            for pass_ in case.passes]


def run_case(case: Case, device: str, floor: floors.Floor, variants: list[str], reps: int,
             warmup: int) -> list[dict]:
    """The rows of one case, every pass: each provider checked, then timed (or marked wrong)."""
    x, t = make_inputs(case, device)
    torch._dynamo.reset()  # torch.compile sees each case's shapes fresh
    rows = []
    for meta in case_metas(case):
        pass_, dtype = meta["pass"], meta["dtype"]
        args = (x.detach().requires_grad_(), t) if pass_ == "fwd+bwd" else (x, t)
        hcase = harness.Case(f"{pass_} {case.form} {dtype} {case.batch}x{case.features}", args, meta)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peers' deprecation and reduction warnings
            timed = harness.bench(providers(case, device, variants, pass_), [hcase],
                                  reference=reference(case.form, pass_),
                                  bytes_moved=lambda *_, p=pass_: case.bytes_moved(p), timer=case.timer, reps=reps,
                                  warmup=warmup, floor=floor, inference_mode=pass_ == "fwd")
        rows += timed.rename(columns={"provider": "impl"}).to_dict("records")
    return rows


def headline_cases(device: str) -> list[Case]:
    """The cases of the goals P1-P5 (kldiv_inline.goals), named so the README can quote them."""
    if device != "cuda":
        return [Case("probs", torch.float32, 2048, 4096, ("fwd",), "wall")]  # P5
    return [
        Case("probs", torch.float32, 16384, 16384, ("fwd", "fwd+bwd")),  # P1, P3
        Case("logprobs", torch.bfloat16, 4096, 128256, ("fwd",)),         # P2
        Case("probs", torch.float32, 128, 4096, ("fwd",), "wall"),         # P4
    ]


def sweep_cases(device: str) -> list[Case]:
    """Rows of 16384 features from tiny to more than 1 GiB per input (float32), both passes."""
    if device != "cuda":  # (2048's forward is P5's headline case: timed once, not twice)
        return ([Case("probs", torch.float32, b, 4096, ("fwd", "fwd+bwd"), "wall") for b in (16, 128, 512)]
                + [Case("probs", torch.float32, 2048, 4096, ("fwd+bwd",), "wall")])
    return ([Case("probs", torch.float32, b, 16384, ("fwd", "fwd+bwd")) for b in (16, 256, 2048, 20480)]
            + [Case("logprobs", torch.bfloat16, b, 128256, ("fwd",)) for b in (64, 1024)])


def write_csv(rows: list[dict], path: Path) -> Path:
    from .envinfo import write_atomic

    return write_atomic(path, pd.DataFrame(rows).reindex(columns=COLUMNS).to_csv(index=False))


def table(rows: list[dict]) -> str:
    """The rows as the console prints them; beta tells the distillation suite's rows of one case apart (forward
    KL, the JSD, reverse KL), and the provider and pass columns are as wide as their longest name."""
    def num(v, fmt):
        return format(v, fmt) if v is not None and pd.notna(v) else "-"

    def beta(r):
        v = r.get("beta")
        try:
            return "-" if v is None or pd.isna(v) else format(float(v), "g")
        except (TypeError, ValueError):
            return str(v)

    impl_w = max([16] + [len(str(r["impl"])) + 2 for r in rows])
    pass_w = max([10] + [len(str(r["pass"])) + 2 for r in rows])
    lines = [f"{'impl':<{impl_w}}{'pass':<{pass_w}}{'form':<9}{'dtype':<9}{'beta':>5}{'shape':>14}{'median ms':>11}"
             f"{'x floor':>9}{'% peak':>8}  status"]
    for r in rows:
        shape = f"{r['batch']}x{r['features']}"
        lines.append(f"{r['impl']:<{impl_w}}{r['pass']:<{pass_w}}{r['form']:<9}{r['dtype']:<9}{beta(r):>5}"
                     f"{shape:>14}{num(r.get('median_ms'), '.4f'):>11}{num(r.get('x_floor'), '.3f'):>9}"
                     f"{num(r.get('pct_of_peak'), '.1f'):>8}  {r['status'][:40]}")
    return "\n".join(lines)


def floor_env(floor: floors.Floor) -> dict:
    """What env.json records of the floor: its bandwidth and source, every source's, the vendor peak."""
    env = {"floor_gbps": round(floor.gbps, 1), "floor_source": floor.source,
           **{f"read_gbps_{k}": round(v, 1) for k, v in floor.sources.items()}}
    peak = floors.device_peak_gbps(floor.device)
    return {**env, "peak_gbps": peak} if peak else env


# The benchmark's suites, in the order they run (the KL op, distillation from logits, the fused LM head), and the
# suite each bench.csv row belongs to, by its form.
SUITES = ("kl", "distill", "linear")
PARTIAL_NOTE = "the run did not finish: bench.csv holds the cases it did"
SUITE_OF_FORM = {"probs": "kl", "logprobs": "kl", "logits": "distill", "topk": "distill", "linear": "linear"}


# What plot derives from a bench.csv (plots.plot_folder): goals.md and the figures. correctness.png is check's.
DERIVED = ("goals.md", "time_*.png", "speedups.png", "linear_time_memory.png")


def drop_derived(folder: Path) -> None:
    """Removes what was derived from ``folder``'s bench.csv before a run replaces it: an earlier run's goals and
    figures beside rows that are not theirs (plot redraws only what a cut-short run's rows support, and left the
    rest of the previous run's figures standing, captioned as a finished run)."""
    for pattern in DERIVED:
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)


def check_suites(args, folder: Path) -> None:
    """Refuses a run of some suites that would replace a bench.csv holding others' rows (they would be lost:
    give that run a folder of its own), or of fewer cases than the run there (--headline-only over a sweep,
    other --linear-tokens), and --linear-sweep without the linear suite."""
    suites = getattr(args, "suites", None) or SUITES
    if getattr(args, "linear_sweep", False) and "linear" not in suites:
        raise SystemExit("--linear-sweep sweeps the fused LM head: add linear to --suites")
    if getattr(args, "linear_tokens", None) and "linear" not in suites:
        raise SystemExit("--linear-tokens sizes the fused LM head's suite: add linear to --suites")
    if getattr(args, "linear_tokens", None) and getattr(args, "linear_sweep", False):
        raise SystemExit("--linear-sweep and --linear-tokens both pick the fused LM head's sizes: give one")
    device = getattr(args, "device", None) or "cpu"
    if getattr(args, "linear_sweep", False) and device != "cuda":
        raise SystemExit("--linear-sweep times the fused LM head from 1k to 16k tokens on a GPU; on the CPU it would "
                         "time the one small shape the CPU runs: give --linear-tokens for more sizes there")
    from .envinfo import read_env

    path = folder / "bench.csv"
    if not path.exists():
        return
    refuse_dropping(path, suites, "suite", "--suites", "--results", SUITE_OF_FORM)
    env_path = folder / "env.json"
    recorded = read_env(env_path).get("options")
    if isinstance(recorded, dict) and not getattr(args, "resume", False):  # (--resume: the same options, or refused)
        dropped = _cases_dropped(recorded, run_options(args), device)
        if dropped:
            raise SystemExit(f"{path} holds a run with {dropped}, whose rows this run would drop: give this run "
                             "another folder (--results), or run it with the same options")


def refuse_dropping(path: Path, kept, kind: str, flag: str, elsewhere: str, of_form: dict | None = None) -> None:
    """Refuses a run of the ``kept`` groups of rows (``kind``: suites, a script's forms; ``of_form`` maps a row's
    form to its group, else the form is its own) that would replace ``path``, a bench.csv holding rows of others:
    they would be lost. ``flag`` picks the groups and ``elsewhere`` another folder on the command line."""
    from .envinfo import read_csv

    if not path.exists():
        return
    of_form = of_form or {}
    held = {of_form.get(f, f) for f in read_csv(path, usecols=["form"])["form"].dropna().unique()}
    lost = sorted(held - set(kept))
    if lost:
        raise SystemExit(f"{path} holds rows of the {', '.join(lost)} {kind}(s), which {flag} {','.join(kept)} "
                         f"would drop: give this run another folder ({elsewhere}), or run those {kind}s too")


def linear_tokens_timed(options: dict, device: str) -> set[int]:
    """The token counts of the fused LM head's cases that a run of ``options`` (run_options') times on ``device``,
    as main picks them: --linear-tokens', else the default sizes with --linear-sweep or on the CPU, else the goals'
    size alone; none without the linear suite."""
    from . import bench_linear

    if "linear" not in options.get("suites", SUITES):
        return set()
    if options.get("linear_tokens"):
        return {int(t) for t in options["linear_tokens"]}
    if options.get("linear_sweep") or device != "cuda":
        return {size[0] for size in bench_linear.default_sizes(device)}
    return {bench_linear.HEADLINE[0]}


def _cases_dropped(recorded: dict, options: dict, device: str) -> str:
    """What the run of ``recorded`` options made that one of ``options`` would not make (as the flags say it),
    else "". Suites left out are check_suites' to refuse; a run of more cases replaces one of fewer."""
    held = []
    # (--headline-only drops the KL suite's sweep alone: a run without that suite, here or there, drops none of it)
    kl_both = "kl" in options["suites"] and "kl" in recorded.get("suites", SUITES)
    if kl_both and options["headline_only"] and not recorded.get("headline_only"):
        held.append("the size sweep (no --headline-only)")
    if "linear" in options["suites"]:
        had = linear_tokens_timed(recorded, device)
        if not had <= linear_tokens_timed(options, device):
            held.append("--linear-sweep" if recorded.get("linear_sweep") else
                        _as_flag("linear_tokens", sorted(had)) if recorded.get("linear_tokens") else
                        f"the fused LM head at its default {', '.join(str(t) for t in sorted(had))} tokens")
    return " and ".join(held)


# The most timed calls a case of these suites takes, whatever --reps asks: each of their calls is a whole step over a
# 128256-word vocabulary (the fused head's with its matrix products), and 10 keep them short. env.json's suite_reps
# records the calls each suite ran (its options' reps is the flag as given).
SUITE_MAX_REPS = {"distill": 10, "linear": 10}


def suite_reps(reps: int, suites) -> dict[str, int]:
    """The timed calls per case each of ``suites`` runs under --reps ``reps``."""
    return {s: min(reps, SUITE_MAX_REPS.get(s, reps)) for s in SUITES if s in suites}


# What env.json keeps of each earlier part of a resumed run (the part that a time limit cut short).
PART_KEYS = ("date_utc", "command", "platform", "driver", "cpu", "floor_gbps", "builds")


def run_options(args) -> dict:
    """The options that decide which rows a run makes, and how many calls time each (env.json's ``options``): a
    resumed run finishes the run it continues only with the same ones."""
    suites = getattr(args, "suites", None) or SUITES
    tokens = getattr(args, "linear_tokens", None)
    return {"suites": [s for s in SUITES if s in suites], "headline_only": bool(getattr(args, "headline_only", False)),
            "linear_sweep": bool(getattr(args, "linear_sweep", False)),
            "linear_tokens": sorted(int(t) for t in tokens) if tokens else None, "reps": int(getattr(args, "reps", 30))}


def _as_flag(key: str, value) -> str:
    """An option of run_options as it is given on the command line."""
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool) or value is None:
        return flag if value else f"no {flag}"
    if isinstance(value, list):
        return f"{flag} {','.join(str(v) for v in value)}"
    return f"{flag} {value}"


# Recorded variables that do not change a one-device suite's times (these suites never communicate): which card of
# a machine (its model is compared by name), the image's NCCL version, the collectives' settings (a multi-GPU
# machine sets multicast off).
_ONE_DEVICE_IGNORED = ("CUDA_VISIBLE_DEVICES", "NCCL_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_SYMM_MEM_")


def _settings_differ(env: dict, device: str = "cpu") -> str:
    """What of the settings a run's times depend on, beside its code, card and options, differs between the run
    ``env`` records and this process (torch's version; on the CPU, its threads; envinfo.TIMING_VARIABLES but
    _ONE_DEVICE_IGNORED: OMP_NUM_THREADS, the kernels' KLDIV_DISTILL_ switches, ...), as "what there, what here";
    "" if none."""
    import torch

    from .envinfo import timing_variables

    checks = [("torch", "torch", torch.__version__)]
    if device == "cpu":  # (a GPU run's times do not follow the host's thread count)
        checks.append(("cpu_threads", "torch threads", torch.get_num_threads()))
    said = [f"{label} {env.get(key)} there, {value} here" for key, label, value in checks if env.get(key) != value]

    def kept(variables: dict) -> dict:
        return {k: v for k, v in variables.items() if not k.startswith(_ONE_DEVICE_IGNORED)}

    there, here = kept(env.get("variables") or {}), kept(timing_variables())

    def value(name, variables):
        return f"{name}={variables[name]}" if name in variables else f"{name} unset"

    said += [f"{value(name, there)} there, {value(name, here)} here"
             for name in sorted(set(there) | set(here)) if there.get(name) != here.get(name)]
    return "; ".join(said)


def resumed(folder: Path, device: str, options: dict) -> tuple[list[dict], list[dict]]:
    """--resume: the rows of the run in ``folder`` that a time limit cut short, for this run to finish (every suite
    saves each case as it ends), and the earlier parts' records for env.json. Refused unless that run is partial,
    at this commit (a clean one), on a device of this name and under the same settings (_settings_differ): a
    finished folder holds the numbers of one code on one kind of card, and with the same ``options`` (run_options):
    a resumed run of fewer cases would mark the run finished with cases missing. (check_suites has refused a run
    whose suites would drop some of the rows.)"""
    from .envinfo import commit, device_name, read_csv, read_env

    path, env_path = folder / "bench.csv", folder / "env.json"
    if not (path.exists() and env_path.exists()):
        raise SystemExit(f"--resume: {folder} holds no run to continue (no bench.csv and env.json)")
    env = read_env(env_path)
    if not env.get("partial"):
        raise SystemExit(f"--resume: the run in {folder} finished (env.json has no 'partial'): nothing to resume")
    here = commit()
    if env.get("commit") != here or here.startswith("unknown") or "+" in here:  # +dirty, +other-kernels
        raise SystemExit(f"--resume: the run in {folder} is of commit {env.get('commit')}, this code is {here}: "
                         "a run is resumed by the same clean commit only (give this one another folder)")
    if env.get("device_name") != device_name(device):
        raise SystemExit(f"--resume: the run in {folder} ran on {env.get('device_name')}, this device is "
                         f"{device_name(device)}")
    differ = _settings_differ(env, device)
    if differ:
        raise SystemExit(f"--resume: the run in {folder} was timed under other settings ({differ}): rows timed under "
                         "both would be one run's; resume it under its own, or give this run another folder")
    recorded = env.get("options")
    if not isinstance(recorded, dict):
        raise SystemExit(f"--resume: the run in {folder} recorded no options (env.json has no 'options'), so this "
                         "run cannot be shown to make the same cases: give this one another folder")
    differ = [k for k in options if recorded.get(k) != options[k]]
    if differ:
        said = "; ".join(f"{_as_flag(k, recorded.get(k))} there, {_as_flag(k, options[k])} here" for k in differ)
        raise SystemExit(f"--resume: the run in {folder} was made with other options ({said}): resume it with its "
                         "own options, or give this run another folder")
    parts = env.get("earlier_parts", []) + [{k: env[k] for k in PART_KEYS if k in env}]
    return read_csv(path).to_dict("records"), parts


def held_by(rows: list[dict]) -> Callable[[dict], bool]:
    """Whether ``rows`` hold a row of the case a suite describes by ``meta`` (its columns: pass, form, dtype, shape,
    beta, ...; every one equal): the cases a resumed run keeps rather than runs again."""
    def same(a, b) -> bool:
        if isinstance(a, str) or isinstance(b, str):
            return str(a) == str(b)
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False

    return lambda meta: any(all(same(r.get(k), v) for k, v in meta.items()) for r in rows)


def main(args) -> int:
    from .envinfo import device_slug, write_env
    from .variants import variant_names

    device = args.device  # resolved by the CLI: "cuda" or "cpu"
    folder = Path(args.results) / device_slug(device)
    check_suites(args, folder)
    options = run_options(args)
    rows, parts = resumed(folder, device, options) if getattr(args, "resume", False) else ([], [])
    held = held_by(rows)  # a resumed run's cases, not run again
    floor = floors.measure_floor(device)
    sources = ", ".join(f"{k} {v:.0f}" for k, v in floor.sources.items())
    print(f"{device}: floor {floor.gbps:.0f} GB/s from {floor.source} (read GB/s: {sources})", file=sys.stderr)
    variants = variant_names() if device == "cuda" else []
    cases = headline_cases(device) + ([] if getattr(args, "headline_only", False) else sweep_cases(device))
    reps = getattr(args, "reps", 30)
    calls = suite_reps(reps, getattr(args, "suites", None) or SUITES)

    first_save = [True]  # (the previous run's files are dealt with once, at the first save)

    def save(done: bool) -> Path:
        """bench.csv and env.json of the rows so far. Called after each case too, so a run cut short (a device's
        time limit) keeps what it finished; env.json says `partial` until the run ends, and `earlier_parts` what
        it records of the runs whose rows a resumed run kept."""
        extra = {**floor_env(floor), "options": options, "suite_reps": calls,
                 **({"earlier_parts": parts} if parts else {})}
        # read_gbps and copy_gbps: what older runs recorded in place of the floor's keys.
        drop = ("read_gbps", "copy_gbps", "earlier_parts")
        # env.json says partial, with this run's record, before bench.csv is replaced: a cut (Ctrl-C) between the
        # two writes left this run's rows beside the previous run's finished record (its commit, command and
        # date), which plot took for a finished run and --resume refused to continue.
        if first_save:
            # A new run's previous rows go first, so that no cut leaves them beside this run's partial record
            # (which --resume would finish as this commit's); a resumed run's are its own first part, kept. Then
            # what was drawn from them.
            if not getattr(args, "resume", False):
                (folder / "bench.csv").unlink(missing_ok=True)
            drop_derived(folder)
            first_save.clear()
        write_env(folder, device, {**extra, "partial": PARTIAL_NOTE}, drop=drop)
        path = write_csv(rows, folder / "bench.csv")
        if done:
            write_env(folder, device, extra, drop=drop + ("partial",))
        return path

    def keep(case_rows: list[dict]) -> None:
        """A suite's case as it ends: its rows, saved at once (a run cut short keeps them)."""
        rows.extend(case_rows)
        save(done=False)

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda it, **kw: it  # noqa: E731
    suites = getattr(args, "suites", None) or SUITES
    if "kl" in suites:
        for case in tqdm(cases, desc="bench", file=sys.stderr):
            if not all(held(m) for m in case_metas(case)):
                keep(run_case(case, device, floor, variants, reps=reps, warmup=5))
    if "distill" in suites:
        from . import bench_distill

        print("bench: the distillation suite", file=sys.stderr)
        bench_distill.run(device, floor, reps=calls["distill"], on_case=keep, done=held)
    if "linear" in suites:
        from . import bench_linear

        print("bench: the fused LM head's suite", file=sys.stderr)
        tokens = getattr(args, "linear_tokens", None)
        sweep_betas = None
        if tokens:  # hand-picked sweep points: forward KL (SWEEP_BETAS) on a GPU, both betas at the goals' size
            sizes = bench_linear.sizes_of_tokens(device, tokens)
            sweep_betas = bench_linear.SWEEP_BETAS if device == "cuda" else None
        elif getattr(args, "linear_sweep", False) or device != "cuda":
            sizes = None  # the default sizes: the sweep on a GPU, CPU_SHAPE on the CPU
        else:
            sizes = [bench_linear.HEADLINE]

        bench_linear.run(device, reps=calls["linear"], sizes=sizes, sweep_betas=sweep_betas, done=held,
                         on_case=keep)
    path = save(done=True)
    env_path = folder / "env.json"
    goals = goal_rows(rows, device, OURS)
    (folder / "goals.md").write_text(goals_markdown(goals, json.loads(env_path.read_text())))
    print(table(rows))
    for g in goals:
        verdict = "not measured" if g["met"] is None else ("met" if g["met"] else "NOT MET")
        print(f"{g['goal']} {g['case']}: {g['target']}: {g['value']:.4g} {verdict}")
    print(f"-> {path}")
    failed = ours_failed(rows)
    if failed:  # after every file is written: a run whose kernel broke keeps its rows and goals (NO, not timed)
        first = failed[0]
        print(f"bench: {OURS} failed in {len(failed)} row(s) (first: {first.get('pass')} {first.get('form')} "
              f"{first.get('dtype')} {first.get('batch')}x{first.get('features')}: {first.get('status')})",
              file=sys.stderr)
        return 1
    return 0


def ours_failed(rows: list[dict]) -> list[dict]:
    """The kit's own rows (OURS) that failed their check or raised: the run's exit status says so (it said 0 with
    the kit's kernel wrong, so a script or `make results` went on as if it were right). A peer that failed or is not
    installed is its own row's business, not the kit's fault."""
    return [r for r in rows if r.get("impl") == OURS and str(r.get("status")).startswith(("wrong", "error"))]
