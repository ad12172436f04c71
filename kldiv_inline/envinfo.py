"""What ran where: device names, versions, commit and command, written beside every result file."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return cpu_model()


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def device_slug(device: str) -> str:
    """The results folder for a device: e.g. ``nvidia-h100-80gb-hbm3``, or ``cpu-<model>``."""
    return slug(device_name(device)) if device == "cuda" else "cpu-" + slug(cpu_model())[:48]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def is_source_tree() -> bool:
    """Whether the package runs from the project's source tree (pyproject.toml and kernels/ beside it), not from
    a copy installed into site-packages."""
    return (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "kernels").is_dir()


def _is_checkout() -> bool:
    """A source tree that is the top of its own git repository: an installed copy may lie inside some other
    repository (a project's .venv), whose commit says nothing of this code."""
    top = _git("rev-parse", "--show-toplevel") if is_source_tree() else None
    return top is not None and Path(top).resolve() == REPO_ROOT


def other_kernels() -> str | None:
    """The kernels/ directory ``KLDIV_INLINE_KERNELS`` points at, where it is not the checkout's own."""
    env = os.environ.get("KLDIV_INLINE_KERNELS")
    if not env:
        return None
    root = Path(env).expanduser().resolve()
    return None if root == (REPO_ROOT / "kernels").resolve() else str(root)


def commit() -> str:
    """``KLDIV_INLINE_COMMIT`` when set (a copy of the tree on another machine may carry a stale .git: on the
    lent GPUs one answered the session's first commit), else HEAD's hash, with ``+dirty`` when files under
    kernels/ or kldiv_inline/ (or a script count_as_code named) differ from it (new files too: an untracked variant
    is timed as well), and
    ``+other-kernels`` when ``KLDIV_INLINE_KERNELS`` builds another kernels/ tree. An installed copy of the
    package, not a checkout, says ``unknown (installed <version>)``. The variable gets ``+dirty`` too where the
    checkout's HEAD is the commit it names (its hash or a prefix) and those files differ: a run of edited kernels
    was recorded as the clean commit (and resumed as one)."""
    mark = "+other-kernels" if other_kernels() else ""
    named = os.environ.get("KLDIV_INLINE_COMMIT")
    if named:
        return named + ("+dirty" if _dirty_at(named) else "") + mark
    if not is_source_tree():
        return f"unknown (installed {_version()})" + mark
    if not _is_checkout():  # a copy of the tree without its .git
        return "unknown" + mark
    head = _git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if _dirty() else "") + mark


# Files outside kernels/ and kldiv_inline/ that this process's runs execute and record through write_env (a script
# of tools/ that writes results: count_as_code), counted in +dirty with them.
_SCRIPTS: list[str] = []


def count_as_code(path: str | os.PathLike) -> None:
    """Count ``path``, a script of the checkout that writes results through write_env (tools/bench_vocab_parallel.py),
    in this process's +dirty: an edited one was recorded as the clean commit. Only the script that runs: a scratch
    probe beside it in tools/ makes no run dirty (nor blocks --resume)."""
    with contextlib.suppress(ValueError, OSError):
        rel = Path(path).resolve().relative_to(REPO_ROOT.resolve()).as_posix()
        if rel not in _SCRIPTS:
            _SCRIPTS.append(rel)


def _dirty() -> bool:
    """Whether files under kernels/ or kldiv_inline/ (and the scripts count_as_code named) differ from the
    checkout's HEAD (new files too)."""
    # Not the Makefile or pyproject.toml: they run and install this code, and what a run was run with its env.json
    # records apart (command, torch, variables, builds). (core.fileMode off: a copy of the tree on another machine
    # may change permission bits, which change no code)
    return bool(_git("-c", "core.fileMode=false", "status", "--porcelain", "--untracked-files=normal", "--",
                     "kernels", "kldiv_inline", *_SCRIPTS))


def _dirty_at(named: str) -> bool:
    """Whether this checkout's HEAD is the commit ``named`` (KLDIV_INLINE_COMMIT: a hash or a prefix of one) and
    its files differ from it. Where HEAD is another commit (a stale .git in a copy), the name is trusted as it is."""
    prefix = named.partition("+")[0].lower()
    if "+dirty" in named or len(prefix) < 4 or not (is_source_tree() and _is_checkout()):
        return False
    head = _git("rev-parse", "HEAD") or ""
    return head.startswith(prefix) and _dirty()


def _version() -> str:
    from importlib import metadata

    try:
        return "kldiv_inline " + metadata.version("kldiv_inline")
    except metadata.PackageNotFoundError:
        return "kldiv_inline, version unknown"


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


# Environment variables that change how the collectives, the allocator or the launches behave, and so the times:
# recorded with every run (PyTorch's NCCL flight recorder, for one, gathers the Python stack at every collective).
TIMING_VARIABLES = ("TORCH_NCCL_", "TORCH_FR_", "NCCL_", "TORCH_SYMM_MEM_", "PYTORCH_CUDA_ALLOC_CONF",
                    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING",
                    "CUDA_LAUNCH_BLOCKING", "OMP_NUM_THREADS",
                    "KLDIV_DISTILL_")  # the distillation kernels' own knobs (KLDIV_DISTILL_FAST=0: the general kernel)
# Variables named whole (not as prefixes: CC would take CCACHE_DIR in): the compilers a build takes (the CPU twin's
# speed follows its compiler), and whether a compiler the loader would leave out is kept.
TIMING_NAMES = ("CC", "CXX", "KLDIV_INLINE_KEEP_COMPILER")


def timing_variables() -> dict:
    """The TIMING_VARIABLES and TIMING_NAMES set in this process (name -> value)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(TIMING_VARIABLES) or k in TIMING_NAMES}


# The arguments the command line's main() runs with, while it runs (None: this process's sys.argv): main([...])
# called from Python (a notebook) recorded the interpreter's own arguments as the run's command.
_COMMAND_ARGV: list[str] | None = None


@contextlib.contextmanager
def command_argv(argv: list[str]):
    """environment() records ``argv`` as the command (after ``python -m kldiv_inline``) inside the block."""
    global _COMMAND_ARGV
    saved, _COMMAND_ARGV = _COMMAND_ARGV, list(argv)
    try:
        yield
    finally:
        _COMMAND_ARGV = saved


def _command() -> str:
    """The command that replays this run."""
    if _COMMAND_ARGV is not None:
        return shlex.join(["python", "-m", "kldiv_inline", *_COMMAND_ARGV])
    return shlex.join(["python", "-m", "kldiv_inline", *sys.argv[1:]]) if sys.argv else ""


def environment(device: str) -> dict:
    kernels_dir = other_kernels()
    env = {
        "device": device,
        "device_name": device_name(device),
        "cpu": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # The CUDA version torch was built with, under a name that says so: on a CPU run no CUDA ran, and goals.md
        # says "torch built with CUDA" for records that carry this key (older ones keep the text they were given).
        "torch_cuda_build": torch.version.cuda,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "commit": commit(),
        **({"kernels_dir": kernels_dir} if kernels_dir else {}),
        "command": _command(),  # replayable
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "variables": timing_variables(),
    }
    from .loader import loaded_builds

    builds = loaded_builds()
    if builds:  # the kernels' builds loaded by now, and the compilers that made them (their manifests' record)
        env["builds"] = builds
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update({
            "driver": driver_version(),
            "sm_count": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
        })
    return env


def read_env(path: Path) -> dict:
    """A results folder's env.json ({} where there is none), or a clear error naming it where it is no JSON record
    (cut mid-write by hand, a merge's conflict): check wrote its CSV and then died on json's error, minutes in."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path} is not a JSON record ({e}): mend it, or remove it with its run's files") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path} is not a JSON record of a run (an object): mend it, or remove it with its run's "
                         "files")
    return data


def read_csv(path: Path, **kw):
    """A results CSV as a pandas frame (``kw``: pandas.read_csv's), or a clear error naming it where it is empty or
    not a CSV of those columns (pandas' EmptyDataError was all bench and plot said of an empty bench.csv)."""
    import pandas as pd

    try:
        return pd.read_csv(path, **kw)
    except pd.errors.EmptyDataError:
        raise SystemExit(f"{path} is empty (not even its header): remove it, or give the run another folder") from None
    except (pd.errors.ParserError, ValueError) as e:
        raise SystemExit(f"{path} cannot be read as a results CSV ({e}): mend it, or remove it") from None


def write_atomic(path: Path, text: str) -> Path:
    """``path`` holds ``text`` whole or keeps what it held: written beside it, then renamed over it, so a run killed
    mid-write (a device's time limit) never leaves a truncated results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


# Keys environment() writes only sometimes: an earlier run's must not outlive it in a merged record (a
# kernels_dir beside a commit that says no other kernels were built).
SOMETIMES_KEYS = ("kernels_dir", "driver", "sm_count", "capability", "memory_gib", "builds")


def _merge_environment(data: dict, record: dict) -> None:
    for key in SOMETIMES_KEYS:
        data.pop(key, None)
    data.update(record)


def write_env(folder: Path, device: str, extra: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Merge this run's environment (and ``extra``) into ``folder/env.json``, less the keys in ``drop``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "env.json"
    data = read_env(path)
    for key in drop:
        data.pop(key, None)
    _merge_environment(data, environment(device))
    if extra:
        data.update(extra)
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


# Keys of env.json that only a bench run writes: where they are, the record at the top is that run's.
BENCH_KEYS = ("floor_gbps", "read_gbps", "partial", "earlier_parts")


def write_check_env(folder: Path, device: str) -> Path:
    """check's record in ``folder/env.json``: under ``check`` always, and at the top too where no bench run has
    written one. A bench run's commit, command and date are those its numbers carry into goals.md and status.md,
    and the ones --resume compares: a check run beside it (at another commit, with another command) must not
    replace them."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "env.json"
    data = read_env(path)
    record = environment(device)
    if not ((folder / "bench.csv").exists() or any(k in data for k in BENCH_KEYS)):
        _merge_environment(data, record)
    data["check"] = record
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
