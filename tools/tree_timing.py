"""What tools/distill_trees.py and tools/kl_trees.py share: several kernels/ trees built at once (one process
each, through KLDIV_INLINE_KERNELS, the kit from this checkout), then timed by the calling script's own child
process, one per tree and round, the trees alternating so that a drift of the card's clock shows as a spread, not
as a difference; a child prints `case ms` lines, and the table gives each case's times per tree and the last
tree's median against the first's.
"""
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that builds or times `tree`: the kit from this checkout, its kernels from
    `tree`."""
    return {**os.environ, "KLDIV_INLINE_KERNELS": str(tree.resolve()),
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def build(trees: list[Path], snippet: str) -> None:
    """Runs `snippet` (Python that loads an extension) once per tree, all at once; exits if one fails."""
    procs = [subprocess.Popen([sys.executable, "-c", snippet], cwd=ROOT, env=tree_env(t)) for t in trees]
    if any(p.wait() for p in procs):
        sys.exit("a tree failed to build (its error is above)")


def time_rounds(trees: list[Path], child_cmd: list[str], rounds: int) -> dict[tuple[str, Path], list[float]]:
    """Each round, `child_cmd` once per tree (in order); its `case ms` lines, by (case, tree)."""
    times: dict[tuple[str, Path], list[float]] = {}
    for _ in range(rounds):
        for tree in trees:
            out = subprocess.run(child_cmd, env=tree_env(tree), capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{tree}: {out.stderr[-2000:]}")
            for line in out.stdout.splitlines():
                case, ms = line.rsplit(" ", 1)
                times.setdefault((case, tree), []).append(float(ms))
    return times


def print_table(trees: list[Path], times: dict[tuple[str, Path], list[float]], case_width: int) -> None:
    """The card, then one row per case: each tree's times (ms) and, with two trees or more, last / first - 1."""
    import torch

    print(torch.cuda.get_device_name(), torch.__version__)
    cases = list(dict.fromkeys(case for case, _ in times))
    names = [str(t) for t in trees]
    print(f"{'case':<{case_width}}" + "".join(f"{n[-24:]:>26}" for n in names)
          + ("   last / first" if len(names) > 1 else ""))
    for case in cases:
        cols = [times[(case, t)] for t in trees]
        row = f"{case:<{case_width}}" + "".join(f"{' / '.join(f'{x:.3f}' for x in c):>26}" for c in cols)
        if len(cols) > 1:
            row += f"   {statistics.median(cols[-1]) / statistics.median(cols[0]) - 1:+.1%}"
        print(row)
