"""Command line: ``python -m kldiv_inline check | bench | plot | results``.

``check``   correctness against float64 PyTorch -> results/<device>/correctness.csv + env.json (under "check")
``bench``   timings against the peers          -> results/<device>/bench.csv + goals.md + env.json
``plot``    PNGs, goals.md and status.md from the CSVs under results/  (no GPU needed)
``results`` check, then bench, then plot: what ``make results`` runs.

On a machine without a GPU every step runs on the CPU twin.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from .envinfo import REPO_ROOT, is_source_tree

INTERRUPTED = 130  # main's status after Ctrl-C: 128 + SIGINT, as a shell reports a program SIGINT stopped


def _suites(text: str) -> list[str]:
    from .bench import SUITES

    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"suites are a comma-separated list of {', '.join(SUITES)}; got {text!r}")
    return names


def _tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"token counts are a comma-separated list of positive integers; got {text!r}")
    return sorted(set(tokens))  # a count given twice is one case (it was run and written twice)


def _reps(text: str) -> int:
    try:
        reps = int(text)
    except ValueError:
        reps = 0
    if reps < 1:  # refused here, not after the floor's measurement: a median of no calls is no time
        raise argparse.ArgumentTypeError(f"timed calls are a positive integer; got {text!r}")
    return reps


def _unusable_folder(path: Path) -> str | None:
    """Why ``path`` cannot take a run's files (it, or a folder above it, is a file; or none can be written there),
    or None: asked before a run's work starts, so a mistyped path is not found only when the first file is
    written, minutes in."""
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a folder"
    held = path
    while not held.exists():
        held = held.parent
    if not held.is_dir():
        return f"{held} is a file, so {path} cannot be a folder"
    if not os.access(held, os.W_OK | os.X_OK):
        return f"{held} is not writable"
    return None


def _check_folders(parser: argparse.ArgumentParser, args) -> None:
    """A clear error (before any work) for a --results or --out that cannot be used."""
    results = Path(args.results)
    if args.cmd == "plot":
        if not results.exists():
            parser.error(f"--results {results}: no such folder")
        if not results.is_dir():
            parser.error(f"--results {results} is a file, not a folder of results")
        why = _unusable_folder(Path(args.out)) if args.out else None
        if why:
            parser.error(f"--out: {why}")
        if not args.out:  # (goals.md, status.md and the PNGs are written into the results folders themselves)
            from . import plots

            runs = [d for d in results.iterdir() if d.is_dir() and plots.holds_run(d)]
            for folder in [results, *sorted(runs)]:
                if not os.access(folder, os.W_OK | os.X_OK):
                    parser.error(f"--results: {folder} is not writable (plot writes goals.md, status.md and the "
                                 "PNGs there; --out puts them elsewhere)")
        return
    from .envinfo import device_slug

    why = _unusable_folder(results) or _unusable_folder(results / device_slug(args.device))
    if why:
        parser.error(f"--results: {why}")


def _device(arg: str | None) -> str:
    import torch

    if arg in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if arg == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA GPU is visible to torch")
    return arg


def cmd_check(args) -> int:
    from . import check
    from .envinfo import device_slug, read_env, write_check_env

    device = args.device
    folder = Path(args.results) / device_slug(device)
    read_env(folder / "env.json")  # one that cannot be read is refused before the checks' minutes, not after
    rows = list(check.run_checks(device))
    path = check.write_csv(rows, folder / "correctness.csv")
    write_check_env(folder, device)
    print(check.summary_table(rows))
    failed = [r for r in rows if not r["ok"]]
    for r in failed[:20]:
        print("FAILED", {k: r[k] for k in ("case", "dtype", "form", "log_target", "reduction", "output", "rel_err")})
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed -> {path}")
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from . import bench

    return bench.main(args)


def cmd_plot(args) -> int:
    from . import plots
    from .bench import OURS, PEERS

    results = Path(args.results)
    out = Path(args.out) if args.out else None
    if plots.holds_run(results):
        # One run's folder (results/<device>/) given itself: its PNGs and goals.md. status.md (every goal over
        # every run) belongs to the folder of runs above it, where its run column names each run's folder.
        written = plots.plot_folder(results, out, ours=OURS, peers=PEERS)
        status = None
        print(f"plot: {results} is one run's folder; status.md, over every run, is written by "
              f"`plot --results {results.parent}`", file=sys.stderr)
    else:
        written = plots.plot_all(results, out, ours=OURS, peers=PEERS)
        status = plots.write_status(results, OURS, out)  # each goal's latest run, over every folder
    if not written and not status:  # (goals.md is written wherever a bench.csv is)
        sys.exit(f"plot: no bench.csv or correctness.csv under {results}: nothing to draw (give the folder that "
                 "`check`, `bench` or `results` wrote, as its --results)")
    for p in written + ([status] if status else []):
        print(p)
    if not any(p.suffix == ".png" for p in written):
        # The goals are written and are this command's output too (exit 0): a run cut short after one case, say,
        # has goals and no figure. It said "no bench.csv ...: nothing to draw" and exited 1 beside its bench.csv.
        print(f"plot: no rows to draw under {results} (no size swept, no case with ours and a peer both timed): "
              "goals written, no figure", file=sys.stderr)
    return 0


def cmd_results(args) -> int:
    """check, bench, plot: a failed check is reported in the exit status, but the timings still run
    (bench itself refuses to time a provider that gives a wrong number)."""
    from .bench import check_suites
    from .envinfo import device_slug

    check_suites(args, Path(args.results) / device_slug(args.device))  # before the check's minutes, not after
    status = cmd_check(args)
    status |= cmd_bench(args)
    args.out = None
    status |= cmd_plot(args)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kldiv_inline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    # The checkout's results/; an installed copy's the working directory's (not a folder inside site-packages).
    results_default = str((REPO_ROOT if is_source_tree() else Path.cwd()) / "results")

    def timed(p):  # what bench and results share: the cases, the repetitions, the suites and their sizes
        from .bench import SUITES

        p.add_argument("--headline-only", action="store_true", help="only the P1-P5 cases, no size sweep")
        p.add_argument("--reps", type=_reps, default=30,
                       help="timed calls per provider and case (the distill and linear suites: at most 10; env.json's "
                            "suite_reps records the calls each suite ran)")
        p.add_argument("--suites", default=",".join(SUITES), type=_suites,
                       help=f"comma-separated suites to run, of {', '.join(SUITES)} (default: all)")
        p.add_argument("--kl-only", dest="suites", action="store_const", const=["kl"], help="--suites kl")
        p.add_argument("--linear-sweep", action="store_true",
                       help="the fused LM head over 1k-16k tokens too (else its goals' 4096 tokens only on a GPU); "
                            "with --suites linear and its own --results folder, a run that fits where the whole "
                            "results run does not")
        p.add_argument("--linear-tokens", type=_tokens, default=None, metavar="N[,N...]",
                       help="the fused LM head at these token counts instead (hidden 4096 and vocabulary 128256 on "
                            "a GPU; forward KL, and both betas at the goals' 4096)")

    def common(p):
        p.add_argument("--results", default=results_default, help="results folder (default: %(default)s)")
        p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")

    subparsers = {}
    p = subparsers["check"] = sub.add_parser("check", help="correctness against float64 PyTorch")
    common(p)
    p.set_defaults(func=cmd_check)
    p = subparsers["bench"] = sub.add_parser("bench", help="timings against the peers")
    common(p)
    timed(p)
    p.add_argument("--resume", action="store_true",
                   help="finish a run that a time limit cut short, with its options (other suites, sizes or "
                        "--reps are refused): keeps the cases its bench.csv holds (same clean commit, same card, "
                        "same torch, threads and timing variables) and runs the rest")
    p.set_defaults(func=cmd_bench)
    p = subparsers["plot"] = sub.add_parser("plot", help="PNGs, goals.md and status.md from the results CSVs")
    p.add_argument("--results", default=results_default,
                   help="results folder to read (and, without --out, to write into; default: %(default)s)")
    p.add_argument("--out", default=None, help="where PNGs go (default: beside each CSV)")
    p.set_defaults(func=cmd_plot)
    p = subparsers["results"] = sub.add_parser("results", help="check, bench and plot: what `make results` runs")
    common(p)
    timed(p)
    p.set_defaults(func=cmd_results)
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser.parse_args(argv)
    if hasattr(args, "device"):
        args.device = _device(args.device)  # every command sees the resolved device, "cuda" or "cpu"
    _check_folders(subparsers[args.cmd], args)  # (its usage line, not the top level's)
    from .envinfo import command_argv

    with command_argv(argv):  # env.json's command: these arguments, also when main([...]) is called from Python
        try:
            return args.func(args)
        except KeyboardInterrupt:  # (what was written is said by the step that was cut short; no traceback)
            print(f"python -m kldiv_inline {args.cmd}: interrupted", file=sys.stderr)
            return INTERRUPTED


def _die_by_sigint() -> None:
    """End this process by SIGINT itself, after main has said it was interrupted: a shell loop or a script
    around the command sees death by the signal (as with any program Ctrl-C stops) and stops too, where an
    exit status of 130 would let a `for` loop go on to its next command."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def run_as_program() -> None:
    """``python -m kldiv_inline``: main's status as the exit status, or death by SIGINT after Ctrl-C."""
    status = main()
    if status == INTERRUPTED and os.name == "posix":
        _die_by_sigint()
    sys.exit(status)


if __name__ == "__main__":
    run_as_program()
