"""Kernel files -> torch.utils.cpp_extension.load_inline -> a cached, importable Python module.

Why not plain load_inline: it writes every source into ``<build>/main.cpp`` / ``cuda.cu`` (so compiler
errors name those files), keys its cache on a name the caller picks, does not rebuild after a failed build
in the same process (its JIT versioner skips sources it has seen), and needs a GPU or ``TORCH_CUDA_ARCH_LIST``
to pick a target.
This module adds, around it:

* a name that carries a hash of every source and every header they include (``#include "..."`` beside them
  or in the include dirs, ``#include <...>`` in the include dirs; the flags' ``-I``, ``-isystem``, ``-iquote``,
  ``-idirafter`` and ``-include`` count), the flags, the torch/CUDA versions and the target architectures:
  an edit rebuilds, an unchanged tree is a cache hit, and a hit in a new process imports the ``.so`` directly
  (no ninja);
* a manifest written last in each build (the ``.so``'s size and SHA-256): a hit imports only a ``.so`` that
  matches it, so a truncated or damaged file is rebuilt instead of crashing the process (SIGBUS), and a hit
  writes and locks nothing, so a prebuilt cache on a read-only mount works;
* ``#line`` directives, so errors point at ``kernels/kldiv.cu:123``, and ``KernelBuildError`` carrying them
  (also for a module that links but does not load: an undefined symbol, demangled);
* checks before any compiler runs, each with a message that says what to fix: ``ToolchainError`` for a
  missing ``nvcc``/``ninja``, a ``CUDA_HOME`` without ``bin/nvcc``, a CUDA major-version mismatch or an
  architecture nvcc cannot target; ``ValueError`` for a ``TORCH_CUDA_ARCH_LIST`` entry torch does not accept
  or ``functions=[...]`` without ``<torch/extension.h>``;
* an OS file lock, taken only to build (released by the kernel if a builder dies), so concurrent builders
  don't collide and a killed build never blocks the next one;
* one line on stderr when a build starts and ends (the ``kldiv_inline`` logger), silent on cache hits;
* a compiler named by ``CC`` / ``CXX`` that links no shared libstdc++ is left out of the build, with a warning,
  where the default compiler links one (``_compiler_env``): its extensions crashed the process whenever they
  raised an error with a formatted message.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

__all__ = [
    "load",
    "load_sources",
    "KernelBuildError",
    "ToolchainError",
    "kernels_root",
    "cache_root",
    "cuda_arch_list",
    "DEFAULT_CUDA_ARCH",
    "KIT_EXTENSIONS",
]

# Compiled for when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset (CI): Hopper, the kit's target.
DEFAULT_CUDA_ARCH = "9.0"

CUDA_SUFFIXES = (".cu",)
CPP_SUFFIXES = (".cpp", ".cc", ".cxx")
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")

# `#include "x.h"` or `#include <x.h>`: (the opening delimiter, the name). Also spelled `%:include` (a digraph),
# `#include_next`, and with comments on the line where blanks may go (`#include /* why */ "x.h"`): an edit to a
# header so included was a cache hit on the old build. (A comment's body holds no "*/", so that a run of comments
# splits one way only: `.*?` there let the match try exponentially many splits, and spanned code between two.)
_BLANK = r'(?:[ \t]|/\*(?:[^*\n]|\*(?!/))*\*/)*'
_INCLUDE_RE = re.compile(rf'^{_BLANK}(?:#|%:){_BLANK}include(?:_next)?{_BLANK}([<"])([^">\n]+)[">]', re.MULTILINE)
# The headers that declare what load_inline's generated bindings use (pybind11, torch::wrap_pybind_function).
_BINDINGS_HEADER_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]torch/(extension|python)\.h[">]', re.MULTILINE)
# Written last in a build (JSON: the .so's name, size and SHA-256, the build's seconds); a cache entry is a
# hit only when its .so matches it.
_BUILD_MARK = "kldiv_inline.manifest.json"
# Part of every cache key: a change to what a cache entry holds gives every extension a new name.
_CACHE_LAYOUT = "2"

# Flags of the kit's own kernels. -O3 everywhere; the CPU twin uses OpenMP (torch ships libgomp.so.1, which
# the dynamic linker reuses) and -march=native is safe because the build is JIT on the machine that runs it
# (the CPU model is part of the cache key). -fno-trapping-math lets GCC vectorise selects around divisions
# (we never rely on floating-point exceptions; NaN and inf results are unchanged).
_KIT_CFLAGS = ["-O3"]  # the C++ standard is torch's choice (C++17 up to 2.13, C++20 from 2.14)
_KIT_CPU_CFLAGS = ["-fopenmp", "-march=native", "-fno-trapping-math"]
_KIT_CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

# One module object per (name) for the life of the process.
_MODULES: dict[str, object] = {}
# The build each extension name was last loaded from (name given -> name with its hash): harness.check records it,
# and bench(checked=) refuses a check made before a name was loaded from another build, since a provider that
# reaches a module through a variable (a lambda over a notebook's `mod`) calls the new build, unchecked.
LAST_LOADED: dict[str, str] = {}
# The compilers each build this process loaded was made by (name with its hash -> what its manifest records):
# env.json's "builds" (loaded_builds), beside the numbers those builds gave.
_TOOLCHAINS: dict[str, dict] = {}


class KernelBuildError(RuntimeError):
    """The compiler rejected a kernel source. ``.errors`` holds the compiler's error lines (real file:line);
    ``.hint`` a line on the likely cause where the loader can tell it (else None), shown after them."""

    def __init__(self, name: str, errors: list[str], log: str, hint: str | None = None):
        self.name, self.errors, self.log, self.hint = name, errors, log, hint
        shown = "\n".join(errors[:40]) or log[-4000:]
        super().__init__(f"building extension {name!r} failed:\n{shown}" + (f"\n{hint}" if hint else ""))


class ToolchainError(RuntimeError):
    """A build tool is missing or does not match torch (nvcc, ninja, CUDA_HOME, CUDA version, target arch)."""


class _StderrHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (a notebook or pytest replaces it after import)."""

    def emit(self, record):
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's contract: report, never raise
            self.handleError(record)


# A cold build takes up to a minute: without a word it looks like a hang, so build announcements reach stderr
# by default. Silence them with logging.getLogger("kldiv_inline").setLevel(logging.WARNING).
_log = logging.getLogger("kldiv_inline")
if not any(getattr(h, "kldiv_inline_default", False) for h in _log.handlers):
    _handler = _StderrHandler()
    _handler.kldiv_inline_default = True
    _handler.setFormatter(logging.Formatter("kldiv_inline: %(message)s"))
    _log.addHandler(_handler)
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)
    _log.propagate = False


# ----------------------------------------------------------------------------------------------- paths
_PACKAGE = Path(__file__).resolve().parent
_PACKAGED_KERNELS = _PACKAGE / "_kernels"  # where a wheel puts kernels/ (pyproject.toml maps it)
_CHECKOUT = _PACKAGE.parent  # a source checkout (editable install): pyproject.toml and kernels/ beside us


def kernels_root() -> Path:
    """The kit's kernel sources: ``KLDIV_INLINE_KERNELS`` if set, else the copy an installed wheel ships
    (``kldiv_inline/_kernels``), else the checkout's ``kernels/``."""
    env = os.environ.get("KLDIV_INLINE_KERNELS")
    if env:
        root = Path(env).expanduser().resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"KLDIV_INLINE_KERNELS={env} is not a directory: point it at a kernels/ "
                                    "directory (or unset it to use the kit's own).")
        return root
    if _PACKAGED_KERNELS.is_dir():
        return _PACKAGED_KERNELS
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "kernels").is_dir():
        return _CHECKOUT / "kernels"
    raise FileNotFoundError(f"kldiv_inline's kernel sources are missing: neither {_PACKAGED_KERNELS} (an "
                            f"installed wheel) nor {_CHECKOUT / 'kernels'} (a source checkout) exists. Reinstall "
                            "the package (`pip install .` ships them) or set KLDIV_INLINE_KERNELS to a kernels/ "
                            "directory.")


def cache_root() -> Path:
    """Where builds live: ``KLDIV_INLINE_CACHE``, else ``TORCH_EXTENSIONS_DIR``, else ``~/.cache``."""
    for var in ("KLDIV_INLINE_CACHE", "TORCH_EXTENSIONS_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser() / "kldiv_inline"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kldiv_inline" / "extensions"


# ----------------------------------------------------------------------------------------- toolchain
def _cuda_home() -> str | None:
    """CUDA_HOME, else CUDA_PATH (torch's order), else the toolkit holding the ``nvcc`` on PATH (following
    wrapper links). A variable that is set must name a toolkit: another one is never used in its place."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            if not os.path.isfile(os.path.join(home, "bin", "nvcc")):
                raise ToolchainError(f"{var}={home} has no bin/nvcc: point {var} at a CUDA toolkit (the directory "
                                     f"holding bin/nvcc, e.g. /usr/local/cuda) or unset it to use the nvcc on PATH.")
            return home
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
        # A shell wrapper (e.g. /usr/local/bin/nvcc -> exec /usr/local/cuda-13.0/bin/nvcc) is not a link.
        with contextlib.suppress(OSError, UnicodeDecodeError):
            text = Path(nvcc).read_text()[:4096]
            m = re.search(r"(/\S+)/bin/nvcc", text)
            if m:
                candidates.append(Path(m.group(1)))
    candidates.append(Path("/usr/local/cuda"))
    for c in candidates:
        if (c / "bin" / "nvcc").exists() and (c / "include" / "cuda_runtime.h").exists():
            return str(c)
    return None


def _nvcc_version(cuda_home: str) -> tuple[int, int]:
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True,
                         text=True, check=False).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise ToolchainError(f"could not read the CUDA version from `{cuda_home}/bin/nvcc --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def _finds_shared_libstdcxx(compiler: str) -> bool:
    """Whether a compiler driver (a command line, as CC / CXX hold one) finds a shared libstdc++ to link
    against: its ``-print-file-name=libstdc++.so`` names a file that exists (a driver that finds none prints
    the bare name back). True when it cannot be told (the command fails or does not know the flag)."""
    try:
        out = subprocess.run([*shlex.split(compiler), "-print-file-name=libstdc++.so"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, ValueError, subprocess.SubprocessError):
        return True
    path = out.stdout.strip()
    return out.returncode != 0 or (os.path.isabs(path) and os.path.exists(path))


# What each variable falls back to when it is left out: torch builds and links with `c++` without CXX, and nvcc
# picks its own host compiler (gcc on the PATH) without CC (torch passes CC to nvcc as -ccbin).
_COMPILER_DEFAULTS = {"CXX": "c++", "CC": "gcc"}


@functools.cache
def _compilers_left_out(cc: str | None, cxx: str | None, keep: bool = False) -> tuple[str, ...]:
    """The variables among CC / CXX (their values given) to leave out of builds: those naming a compiler that
    finds no shared libstdc++ where the default one does. Such a driver (the lent GPU machines' CC/CXX, wrappers
    around a relocated GCC 13 with -B folders that hold no libstdc++.so) built extensions that crashed the process
    with a segmentation fault whenever they raised an error with a formatted message (TORCH_CHECK(cond, "...",
    value)); plain messages raised, and the same sources built by the system's g++ 13 raised every error.
    ``keep`` (KLDIV_INLINE_KEEP_COMPILER=1) keeps them."""
    if keep:
        return ()
    return tuple(var for var, value in (("CC", cc), ("CXX", cxx))
                 if value and not _finds_shared_libstdcxx(value) and _finds_shared_libstdcxx(_COMPILER_DEFAULTS[var]))


def _compiler_env() -> dict[str, str | None]:
    """CC and CXX as builds use them: the environment's, less those _compilers_left_out drops (None: unset)."""
    env = {var: os.environ.get(var) for var in ("CC", "CXX")}
    for var in _compilers_left_out(env["CC"], env["CXX"], os.environ.get("KLDIV_INLINE_KEEP_COMPILER") == "1"):
        env[var] = None
    return env


@contextlib.contextmanager
def _build_environment(env: dict[str, str | None]):
    """os.environ with these variables set (None: removed) for the duration of a build, then as it was; a
    warning for each compiler the build leaves out (_compilers_left_out)."""
    saved = {var: os.environ.get(var) for var in env}
    for var, value in env.items():
        if value is None and saved[var]:
            _log.warning("%s=%s finds no shared libstdc++ to link against (its -print-file-name=libstdc++.so "
                         "names no file): this build uses the default compiler (%s), whose extensions link the "
                         "libstdc++ this process runs. KLDIV_INLINE_KEEP_COMPILER=1 keeps it.",
                         var, saved[var], _COMPILER_DEFAULTS.get(var, "the default"))
    try:
        _set_environ(env)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: dict[str, str | None]) -> None:
    """Each variable set in os.environ, or removed where its value is None."""
    for var, value in values.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


def _check_toolchain(with_cuda: bool) -> str | None:
    """Raise ToolchainError with a fix-it message, or return CUDA_HOME (None for CPU-only builds)."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise ToolchainError("ninja is not installed; torch's JIT builds need it: `pip install ninja`.")
    if not with_cuda:
        return None
    if torch.version.cuda is None:
        raise ToolchainError(f"this torch ({torch.__version__}) is a CPU-only build; the CUDA backend needs a "
                             "CUDA build of torch. Use backend='cpu' or install a CUDA torch.")
    home = _cuda_home()
    if home is None:
        raise ToolchainError("nvcc (the CUDA compiler) was not found: put it on PATH or set CUDA_HOME to the "
                             "CUDA toolkit (e.g. /usr/local/cuda). The CPU backend, load('cpu'), needs no nvcc.")
    major, minor = _nvcc_version(home)
    torch_major = int(torch.version.cuda.split(".")[0])
    if major != torch_major:
        raise ToolchainError(f"nvcc at {home} is CUDA {major}.{minor} but torch {torch.__version__} was built "
                             f"with CUDA {torch.version.cuda}: the major versions must match. Point CUDA_HOME at "
                             f"a CUDA {torch_major}.x toolkit or install a torch built for CUDA {major}.")
    # cpp_extension resolved CUDA_HOME once, at import, possibly to a wrapper's /usr/local; make it agree.
    cpp_extension.CUDA_HOME = home
    os.environ.setdefault("CUDA_HOME", home)
    return home


# The names torch.utils.cpp_extension accepts in TORCH_CUDA_ARCH_LIST, with what each stands for.
_NAMED_ARCHES = {
    "Kepler+Tesla": "3.7", "Kepler": "3.5+PTX", "Maxwell+Tegra": "5.3", "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX", "Volta+Tegra": "7.2", "Volta": "7.0+PTX", "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "11.0", "Blackwell": "10.0;10.3;12.0;12.1+PTX", "Rubin": "10.7+PTX",
}
# A compute capability: 9.0, 9.0a (arch-specific features), 10.0f (family); +PTX also embeds PTX.
_ARCH_RE = re.compile(r"(\d+)\.(\d)([af]?)(\+PTX)?")


def cuda_arch_list() -> list[str]:
    """Target architectures: TORCH_CUDA_ARCH_LIST if set (entries separated by ';' or spaces, names expanded
    as torch expands them; "native" is the same as unset), else the visible GPUs', else DEFAULT_CUDA_ARCH.
    An entry torch would not accept raises ValueError before anything is compiled."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env and env != "native":
        archs: list[str] = []
        for entry in filter(None, re.split(r"[;\s]+", env)):
            for arch in _NAMED_ARCHES.get(entry, entry).split(";"):
                if not _ARCH_RE.fullmatch(arch):
                    raise ValueError(_bad_arch_message(env, entry))
                if arch not in archs:
                    archs.append(arch)
        return archs
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{ma}.{mi}" for ma, mi in sorted(caps)]
    return [DEFAULT_CUDA_ARCH]


def _bad_arch_message(env: str, entry: str) -> str:
    names = {n.lower(): n for n in _NAMED_ARCHES}
    ptx = entry.endswith("+PTX")
    bare = entry.removesuffix("+PTX")
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+?)[.,_]?(\d)([af]?)", bare, re.IGNORECASE)
    if bare.lower() in names:  # names carry their own +PTX
        hint = names[bare.lower()]
    elif m:
        hint = f"{int(m.group(1))}.{m.group(2)}{m.group(3).lower()}" + ("+PTX" if ptx else "")
    else:
        hint = None
    return (f"TORCH_CUDA_ARCH_LIST={env!r}: {entry!r} is not a CUDA architecture torch accepts"
            + (f" (did you mean {hint!r}?)" if hint else "") + ". Separate entries with ';' or spaces; each is a "
            "compute capability like '9.0', '9.0a' (arch-specific) or '10.0f' (family), optionally with '+PTX' "
            f"(also embed PTX), or one of torch's names: {', '.join(_NAMED_ARCHES)}; 'native' alone means the "
            "visible GPUs.")


def _gencode_flags(archs: Sequence[str]) -> list[str]:
    flags = []
    for a in archs:
        ptx = a.endswith("+PTX")
        num = a.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


@functools.cache
def _nvcc_targets(cuda_home: str) -> frozenset[int]:
    """The compute capabilities (as 90, 100, ...) this nvcc compiles for; empty if it cannot say."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
        return frozenset(int(n) for n in re.findall(r"compute_(\d+)", out))
    return frozenset()


def _check_archs(cuda_home: str, archs: Sequence[str]) -> None:
    """ToolchainError before compiling for an architecture this nvcc does not know (it would fail ~15 s into
    the build with an error that names no source)."""
    known = _nvcc_targets(cuda_home)
    if not known:
        return
    bad = [a for a in archs if int("".join(_ARCH_RE.fullmatch(a).group(1, 2))) not in known]
    if bad:
        targets = ", ".join(f"{n // 10}.{n % 10}" for n in sorted(known))
        raise ToolchainError(f"nvcc at {cuda_home} cannot compile for {', '.join(map(repr, bad))} (from "
                             f"TORCH_CUDA_ARCH_LIST or the visible GPUs); it targets {targets}. Set "
                             "TORCH_CUDA_ARCH_LIST to some of those, or use a CUDA toolkit that knows the GPU.")


# ------------------------------------------------------------------------------------------ sources
def _resolve_includes(path: Path, include_dirs: Sequence[Path], seen: dict[Path, str],
                      quote_dirs: Sequence[Path] = ()) -> None:
    """Read ``path`` and, recursively, every header it includes that the compiler may find where we can see it:
    ``"..."`` beside the including file, in quote_dirs or in include_dirs; ``<...>`` in include_dirs. Headers
    found elsewhere (the system's, torch's, CUDA's) are not followed.

    Every match is followed, not the first: the compiler takes the first in its own order (the -iquote folders,
    then the -I folders in command-line order, where the user's flags come before the loader's, then -isystem,
    the system's, -idirafter; nvcc's as g++'s), which the loader would have to reproduce exactly, or the header
    it hashes is not the one compiled and an edit to that one leaves a stale module. With all of them in the key
    the order cannot matter; an edit to a shadowed copy costs a rebuild at most.

    A header reached through a symbolic link is searched beside the link, as the compiler searches beside the
    file as it opened it (the link's folder), not beside its target: so its folder is resolved, its name not."""
    path = path.parent.resolve() / path.name
    if path in seen:
        return
    text = path.read_bytes().decode("utf-8", "surrogateescape")  # any bytes (a system header need not be UTF-8)
    # A UTF-8 byte-order mark (some editors save one): the compiler skips it at a file's start, but behind the
    # #line the loader puts first it is a stray character, and it hid a first line's #include from the key.
    text = text.removeprefix("\ufeff")
    seen[path] = text
    for delim, inc in _INCLUDE_RE.findall(text):
        for d in (path.parent, *quote_dirs, *include_dirs) if delim == '"' else include_dirs:
            cand = d / inc
            if cand.is_file():
                _resolve_includes(cand, include_dirs, seen, quote_dirs)


def _check_quoted_includes(srcs: Sequence[Path], texts: Mapping[Path, str], order: Sequence[Path]) -> None:
    """Refuse a source whose ``#include "x.h"`` would compile another file than the x.h beside it. load_inline joins
    a language's sources into one file in its build folder, so a quoted include in a source is not looked for beside
    that source first, as a compiler given the source itself does: the include folders come first (``order``:
    -iquote, the flags' -I, ``include_dirs``, then the sources' folders in the order given; a folder also named as a
    system folder is searched after all of them). Where one of them holds another x.h ahead of the source's own
    folder, the build would silently use that one (two folders' sources each including their own config.h got the
    first folder's; a copy of the same text is refused too, since its own quoted includes are found beside it).
    Headers that headers include are found beside their includer, as usual: only sources matter."""
    order = list(dict.fromkeys(order))
    for src in srcs:
        here = src.parent
        ahead = order[:order.index(here)] if here in order else order
        for delim, inc in _INCLUDE_RE.findall(texts[src]):
            beside = here / inc
            if delim != '"' or not beside.is_file():
                continue
            for d in ahead:
                other = d / inc
                # (any other file, even one of the same text: its own quoted includes are found beside it)
                if other.is_file() and other.resolve() != beside.resolve():
                    raise ValueError(
                        f'{src}: #include "{inc}" means {beside}, but load_inline compiles the sources of one '
                        f"language as one file in its build folder, where the compiler looks in the include folders "
                        f"first and would take {other} (conditions such as #if are not evaluated here): give the "
                        "two headers distinct names, or include the header by a path no other folder holds")


def _include_flag(d: Path) -> str:
    # torch writes the flags into build.ninja, whose commands run in the shell: quote for the shell (spaces),
    # then escape ninja's own '$'.
    return "-I" + shlex.quote(str(d)).replace("$", "$$")


# The /proc/cpuinfo fields -march=native depends on: the model, and the instruction-set extensions the CPU
# offers, which one model name does not fix (a VM or a BIOS setting hides some, e.g. AVX-512). x86 spells them
# "model name" and "flags", Arm "CPU implementer", "CPU part" and "Features".
_CPUINFO_FIELDS = ("model name", "flags", "CPU implementer", "CPU part", "Features")


@functools.cache
def _cpu_fingerprint() -> str:
    """The host CPU, for builds with -march=native (whose code may not run on another CPU): the first line of
    each of _CPUINFO_FIELDS in /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        first: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field = line.split(":", 1)[0].strip()
            if field in _CPUINFO_FIELDS:
                first.setdefault(field, line)
        if first:
            return "\n".join(first[f] for f in _CPUINFO_FIELDS if f in first)
    import platform
    return platform.processor() or platform.machine()


def _module_base(name: str) -> str:
    """The extension's name before its hash, as an ASCII identifier: Python looks up a non-ASCII module's init
    function under a punycode name (PyInitU_...), which the compiled PyInit_<name> is not, so it would build and
    then fail to import. Accents are dropped (café -> cafe), other characters become '_'; names that meet here
    share a build only where the hash after them (every source's path and text, the flags, ...) is the same too,
    i.e. where the build is the same."""
    ascii_name = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    return re.sub(r"\W", "_", ascii_name, flags=re.ASCII) or "extension"


def _check_utf8(path: Path, text: str) -> None:
    """load_inline writes the given sources out again as UTF-8, where a byte that is not UTF-8 (read as a lone
    surrogate) cannot be written: say which file and line hold one (headers are read by the compiler itself)."""
    # (lines as the compiler counts them: at \r\n, \r or \n, where splitlines also breaks at \f, \v, \x1c-\x1e)
    for n, line in enumerate(re.split(r"\r\n|\r|\n", text), 1):
        bad = next((c for c in line if "\udc80" <= c <= "\udcff"), None)
        if bad is not None:
            raise ValueError(f"{path}:{n}: byte 0x{ord(bad) - 0xdc00:02x} is not UTF-8: load_inline writes the "
                             "sources as UTF-8, so save the file as UTF-8 (or move that text into a header)")


def _with_line(path: Path, text: str) -> str:
    # #line takes a C string literal: escape backslashes and quotes in the path.
    name = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{name}"\n{text}\n'


# -------------------------------------------------------------------------------------- build + load
@contextlib.contextmanager
def _build_lock(ext_name: str, failed: ImportError | None = None):
    """Hold the OS lock of one extension's cache entry (only builders take it: a hit needs no lock). ``failed``:
    why the entry there does not load, if it is whole (said where the cache is read-only)."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fh = open(root / f".{ext_name}.lock", "a+")
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        # OSError(EACCES, ...) is a PermissionError; EROFS stays a plain OSError.
        held = f" (its build there does not load: {failed})" if failed is not None else ""
        raise OSError(e.errno, f"the extension cache {root} is read-only ({e.strerror}) and holds no usable "
                               f"build of {ext_name}{held}: build it once where the cache is writable, or set "
                               "KLDIV_INLINE_CACHE to a writable directory.") from e
    with fh:
        waited_from = time.time()  # (before trying: a build that fails as we try counts as one we waited for)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited_from = None
        except BlockingIOError:
            # Said, as a long build is: a waiting process printed nothing for the whole of another's build.
            _log.info("waiting for another process building %s (lock %s)...", ext_name, fh.name)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield waited_from
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_FAILED_MARK = "kldiv_inline_failed.json"  # a failed build's errors, in its build folder (see _failed_meanwhile)


# A compiler's diagnostic at a file and line (a linker's "file.o: ... undefined reference" too; nvcc's front end at
# the end of a file, "At end of source: error: expected a "}"", and ptxas' on a kernel, "ptxas error   : Entry
# function '...' uses too much shared data", "ptxas fatal   : Unresolved extern function"): what the same sources
# and flags give again. A build killed (out of memory), a full disk or a missing tool says none.
_DIAGNOSTIC_RE = re.compile(r"^\S.*?(?::\d+(?::\d+)?:|\(\d+\):) (?:fatal |catastrophic )?error\b"
                            r"|^At end of source: error\b|^ptxas (?:error|fatal)\s*:"
                            r"|undefined reference to|undefined symbol")


# The system's failures that a compiler reports at a source's line too ("a.cpp:20:40: fatal error: error writing to
# /tmp/ccX.s: No space left on device"): of the moment, not of the sources.
_SYSTEM_RE = re.compile(r"No space left|Disk quota|Input/output error|Too many open files|Cannot allocate memory"
                        r"|Memory allocation failure|[Oo]ut of memory|Could not open|could not be opened"
                        r"|[Cc]annot open (?:output|input|temporary)|Permission denied"
                        r"|Stale file handle|Read-only file system|error (?:writing|closing) ")


# A line a tool says itself: a diagnostic ("x.cpp:3:7: error: ...", "ptxas fatal   : ...") or a tool's own
# message ("/usr/bin/ld: final link failed: ...", "cc1plus: out of memory ...", "virtual memory exhausted: ...").
_TOOL_SAID_RE = re.compile(r"\b(?:error|fatal)\s*:|^(?:\S*/)?(?:ld|collect2|cc1plus|cc1|as|nvcc|ptxas|cicc|c\+\+|g\+\+"
                           r"|gcc|clang\+\+|clang)(?:\.\w+)?: |^virtual memory exhausted", re.IGNORECASE)


def _record_failure(build_dir: Path, err: KernelBuildError) -> None:
    """Leave a failed build's errors where the processes that waited for it will look (_failed_meanwhile), where
    they are the sources' own (a compiler's diagnostic at a file and line): a failure of the moment (a compiler
    killed, a full disk) is built again by each, as before."""
    # (the system's words in a tool's own line, "virtual memory exhausted: Cannot allocate memory" among them, not
    # in the source lines a compiler quotes beneath an error, which may hold the words too)
    said = [e for e in err.errors if e[:1].strip() and not _NOT_AN_ERROR_RE.search(e) and _TOOL_SAID_RE.search(e)]
    if not any(_DIAGNOSTIC_RE.search(e) for e in err.errors) or any(_SYSTEM_RE.search(e) for e in said):
        return
    with contextlib.suppress(OSError, TypeError, ValueError):
        tmp = build_dir / f"{_FAILED_MARK}.tmp"
        tmp.write_text(json.dumps({"errors": err.errors, "log": err.log[-200_000:], "hint": err.hint}))
        os.replace(tmp, build_dir / _FAILED_MARK)


def _failed_meanwhile(ext_name: str, build_dir: Path, waited_from: float | None) -> None:
    """Raise the build error of the same key that another process met while this one waited for the lock: the
    same sources, flags and compilers fail the same way, and ranks started together (torchrun, srun) each built it
    again in turn, ~a minute a CUDA build. A process that starts after the failure builds again (the cause may be
    mended outside the key: a full disk, a missing tool)."""
    mark = build_dir / _FAILED_MARK
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if waited_from is not None and mark.stat().st_mtime >= waited_from:
            failed = json.loads(mark.read_text())
            raise KernelBuildError(ext_name, list(failed["errors"]), str(failed["log"]), failed["hint"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:  # ~1 ms per MB (the kit's CUDA module: 6 MB)
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verified_so(build_dir: Path) -> Path | None:
    """The entry's ``.so`` if the build finished (its manifest exists) and the file still matches the manifest,
    else None. Importing a cut-short ``.so`` would kill the process with SIGBUS, not raise."""
    try:
        manifest = json.loads((build_dir / _BUILD_MARK).read_text())
        so = build_dir / manifest["so"]
        if so.stat().st_size == manifest["size"] and _sha256(so) == manifest["sha256"]:
            return so
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_manifest(build_dir: Path, so: Path, build_s: float, tools: dict | None = None) -> None:
    manifest = {"so": so.name, "size": so.stat().st_size, "sha256": _sha256(so), "build_s": round(build_s, 2),
                **({"toolchain": tools} if tools is not None else {})}
    tmp = build_dir / f"{_BUILD_MARK}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, build_dir / _BUILD_MARK)  # atomic: a reader sees no manifest or a whole one


def _manifest_toolchain(build_dir: Path) -> dict | None:
    """The compilers a cache entry's manifest says built it (None: a manifest written before it said so)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        return json.loads((build_dir / _BUILD_MARK).read_text()).get("toolchain")
    return None


@functools.cache
def _version_line(command: str, pattern: str = "") -> str | None:
    """The first line of ``command --version`` that matches ``pattern``, or None where it cannot run."""
    try:
        out = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip() and re.search(pattern, line)]
    return lines[0] if out.returncode == 0 and lines else None


def toolchain(with_cuda: bool) -> dict[str, str | None]:
    """The compilers a build in this process uses, by their version lines: ``cxx`` (CXX as builds take it, else
    torch's c++), and for CUDA builds ``nvcc`` (the toolkit's release) and ``cc`` (nvcc's host compiler: CC, else
    gcc). None where one cannot be run. The CPU twin's speed follows its compiler, so a run's record names it."""
    env = _compiler_env()
    # (a default resolved on PATH: _version_line keeps one answer per command, and PATH may name another since)
    default = {var: shutil.which(cmd) or cmd for var, cmd in _COMPILER_DEFAULTS.items()}
    tools = {"cxx": _version_line(env["CXX"] or shlex.quote(default["CXX"]))}
    if with_cuda:
        try:
            home = _cuda_home()
        except ToolchainError:
            home = None
        tools["nvcc"] = _version_line(shlex.quote(os.path.join(home, "bin", "nvcc")), "release") if home else None
        tools["cc"] = _version_line(env["CC"] or shlex.quote(default["CC"]))
    return tools


# What else sets a CUDA build's flags or headers, besides the flags given and CC / CXX (in the key already): nvcc's
# own flag variables, torch's nvcc override and the CUDA headers' folder it adds. Variables, not the compilers
# themselves: a hit runs no compiler, so that a cache built once serves a machine that has none.
_CUDA_BUILD_VARIABLES = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN", "PYTORCH_NVCC", "CUDA_INC_PATH")


def loaded_builds() -> dict[str, dict]:
    """The build each extension name was last loaded from in this process, and the compilers that made it (as
    its manifest records them; None for an entry built before manifests did): env.json's ``builds``."""
    return {base: {"module": ext, "toolchain": _TOOLCHAINS.get(ext)} for base, ext in sorted(LAST_LOADED.items())}


def _import_so(name: str, so: Path):
    spec = importlib.util.spec_from_file_location(name, so,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(so)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_cached(name: str, build_dir: Path):
    """(the module of a complete, intact cache entry, None); (None, None) where there is none (missing,
    unfinished, damaged); (None, the ImportError) where a whole entry does not load. Some of those a rebuild
    fixes (torch reinstalled under the same version: symbols that moved); _keep_unloadable raises the others."""
    so = _verified_so(build_dir)
    if so is None:
        return None, None
    try:
        return _import_so(name, so), None
    except ImportError as e:
        return None, e


# Import errors of a whole build that building it again cannot fix: a library it links that the dynamic loader
# does not find here, and pybind11's classes, which a process registers once.
_NOT_FIXED_BY_A_BUILD = ("cannot open shared object file", "is already registered")


def _keep_unloadable(name: str, err: ImportError | None) -> None:
    """Raise, keeping the entry, where a complete build does not load for a reason of this process (the rebuild
    that followed destroyed the good entry, failed the same way, and left nothing for a process that can load
    it; every retry built again)."""
    if err is not None and any(s in str(err) for s in _NOT_FIXED_BY_A_BUILD):
        failure = _load_failure(name, err)
        raise failure from (None if failure is err else err)


def _demangle(symbol: str) -> str:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt and symbol.startswith("_Z"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([cxxfilt, symbol], capture_output=True, text=True, timeout=10).stdout.strip()
            if out:
                return out
    return symbol


def _load_failure(name: str, err: ImportError) -> Exception:
    """A KernelBuildError for a module that linked but does not load because a symbol is missing (shared
    libraries may link with undefined symbols; the dynamic loader finds out) or because nothing defines the
    Python module; other import errors as they are."""
    if "is already registered" in str(err):
        return KernelBuildError(name, [
            f"the build of {name} is complete but does not load in this process: {err}",
            "  pybind11 registers a bound class once per process, and an earlier build binding the same class "
            "(an edit of these sources, or the same sources under another name) is loaded here already: restart "
            "the Python process (the notebook's kernel), where this build loads from the cache, or declare the "
            "class py::module_local()",
        ], str(err))
    m = re.search(r"(\S+): cannot open shared object file", str(err))
    if m:
        return KernelBuildError(name, [
            f"the build of {name} is complete but does not load here: a library it links, {m.group(1)}, is not "
            "found by the dynamic loader",
            "  add its folder to LD_LIBRARY_PATH, or link it with -Wl,-rpath,<its folder> in extra_ldflags; the "
            "build is kept in the cache and loads wherever the library is found",
        ], str(err))
    if "does not define module export function" in str(err):
        return KernelBuildError(name, [
            "the built module has no Python module to import: no .cpp source holds "
            "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), and no functions= were given to bind",
            "  add one of them (load_sources' docstring says how)",
        ], str(err))
    m = re.search(r"undefined symbol: (\S+)", str(err))
    if not m:
        return err
    symbol = m.group(1)
    readable = _demangle(symbol)
    shown = readable if readable == symbol else f"{readable} ({symbol})"
    return KernelBuildError(name, [
        f"the built module does not load: undefined symbol {shown}",
        "  it is declared and used, but not defined in the sources given: add the source file that defines it, "
        "or make the definition's name, signature and namespace match the declaration",
    ], str(err))


def _expected_build_s(base: str, with_cuda: bool, texts: Mapping[Path, str]) -> int:
    """Seconds the build will take: the last build of the same extension (its manifest), else a guess."""
    pattern = re.compile(re.escape(base) + r"_[0-9a-f]{16}")
    last = None
    with contextlib.suppress(OSError):
        for entry in cache_root().iterdir():
            if pattern.fullmatch(entry.name):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    mark = entry / _BUILD_MARK
                    when, seconds = mark.stat().st_mtime, float(json.loads(mark.read_text())["build_s"])
                    if last is None or when > last[0]:
                        last = (when, seconds)
    if last is not None:
        return max(1, round(last[1]))
    # torch's and pybind11's headers dominate a small extension's build (measured here: 25 s for the CPU twin,
    # 50 s for the CUDA module; 1-5 s without them).
    heavy = any(re.search(r'#\s*include\s*[<"](torch|ATen|c10|pybind11)/', t) for t in texts.values())
    return (60 if heavy else 5) if with_cuda else (25 if heavy else 2)


# The linker's own lines, which say which library or symbol failed ("/usr/bin/ld: cannot find -lfoo", "x.o: in
# function ...: undefined reference to ..."): they hold no "error", and collect2's line after them says only that
# ld failed.
_LINKER_RE = re.compile(r"^(?:\S*/)?ld(?:\.\w+)?: |undefined reference to|multiple definition of|cannot find -l")


# Lines with the word "error" that state none: a source line the compiler quotes ("  2 | int check(int error)")
# and a warning ("x.cpp:3:2: warning: #warning "error paths untested"").
_NOT_AN_ERROR_RE = re.compile(r"^\s*\d*\s*\||:\d+(?::\d+)?: warning\b|\(\d+\): warning\b|^\s*warning\b", re.IGNORECASE)
# ptxas names an undefined device function by its mangled name.
_PTXAS_EXTERN_RE = re.compile(r"Unresolved extern function '(\S+)'")


def _compiler_errors(log: str) -> list[str]:
    """The lines of a ninja/nvcc/g++ log that state an error (the linker's and ptxas' fatal ones too), with a
    little context after each."""
    lines = log.splitlines()
    out = []
    wrappers = ("FAILED:", "ninja:", "Error building extension")  # ninja's and torch's lines, not the compiler's
    for i, line in enumerate(lines):
        if line.startswith(wrappers) or re.search(r"errors? detected in the compilation of", line):
            continue
        if _LINKER_RE.search(line):
            out.append(line)
        elif m := _PTXAS_EXTERN_RE.search(line):
            readable = _demangle(m[1])
            out.append(line + (f" ({readable}: declared and called, defined in no source given)"
                               if readable != m[1] else ""))
        elif re.search(r"\b(error|fatal)\b", line, re.IGNORECASE) and not _NOT_AN_ERROR_RE.search(line):
            out.extend(_gcc_required_here(lines, i))
            out.append(line)
            # The compiler's context (the source line, a caret), not the next build command or ninja's lines.
            out.extend(nxt for nxt in lines[i + 1:i + 3]
                       if nxt.strip() and "error" not in nxt.lower() and not re.match(r"\s*\[\d+/\d+\]", nxt)
                       and not nxt.startswith(wrappers) and not _LINKER_RE.search(nxt))
            out.extend(_nvcc_instantiated_at(lines, i))
    return out


# A template's error is reported where the template is (a system header's line, for std::sort of a type with no
# operator<); the researcher's own line is only in the instantiation chain: g++ prints it before the error
# ("op.cpp:8:12:   required from here"), nvcc after it ("detected during ... instantiation of ... at line 8 of
# /x/op.cu"). Without them the message named only the header.
_GCC_CHAIN_RE = re.compile(r":\d+(?::\d+)?:\s+(?:required from|required by|In instantiation of)|: In instantiation of")
_NVCC_CHAIN_RE = re.compile(r"^\s+(?:detected during|instantiation of|\(\d+ more|.*\bat line \d+\b)")


def _gcc_required_here(lines: Sequence[str], i: int) -> list[str]:
    """The "required from here" line of the instantiation chain right above the error at lines[i], if any."""
    j = i
    while j > 0 and _GCC_CHAIN_RE.search(lines[j - 1]):
        j -= 1
    return [ln for ln in lines[j:i] if "required from here" in ln]


def _nvcc_instantiated_at(lines: Sequence[str], i: int) -> list[str]:
    """The lines of nvcc's instantiation chain below the error at lines[i] that say where: the first ("detected
    during ...") and the last, the outermost instantiation. The chain ends the error's block, after its source
    line, caret and notes (an operator's candidates: "note #3328-D" with their own source lines), which the block
    runs until a blank line, another error or the build's next step."""
    chain = []
    for ln in lines[i + 1:]:
        if not ln.strip() or re.search(r"\b(error|fatal)\b", ln, re.IGNORECASE) or ln.startswith(("FAILED:", "[")):
            break
        if _NVCC_CHAIN_RE.match(ln):
            chain.append(ln)
    where = [ln for ln in chain if re.search(r"\bat line \d+\b", ln)]
    return list(dict.fromkeys(where[:1] + where[-1:]))


# A definition the compiler met twice, with the file of the first one: g++ and clang name it on a note after the
# error, nvcc's front end in the error itself ("(previous definition at line 3 of /x/a.cu)").
_GCC_REDEFINED_RE = re.compile(r"^(.+?):\d+:\d+: error: (?:redefinition of|conflicting declaration)")
_GCC_PREVIOUS_RE = re.compile(r"^(.+?):\d+:\d+: note: .*\bprevious")
_NVCC_REDEFINED_RE = re.compile(r"^(.+?)\(\d+\): error: .*has already been (?:defined|declared)"
                                r".*\(previous \w+ at line \d+ of (.+)\)\s*$")


def _redefinitions(log: str) -> list[tuple[str, str]]:
    """(the file of a redefinition, the file of the definition before it) for each the compiler reports."""
    pairs, pending = [], None
    for line in log.splitlines():
        if m := _NVCC_REDEFINED_RE.match(line):
            pairs.append((m[1], m[2]))
        elif m := _GCC_REDEFINED_RE.match(line):
            pending = m[1]
        elif pending and (m := _GCC_PREVIOUS_RE.match(line)):
            pairs.append((pending, m[1]))
            pending = None
    return pairs


# g++'s note on a bracket still open at the end of input: "op.cpp:3:14: note: to match this '{'".
# (quoted as the locale has it: ASCII quotes or typographic ones); nvcc's: 'k.cu(3): note #3196-D: to match this "{"'.
# Only after an error at the end of the input ("expected '}' at end of input", nvcc's "At end of source: error"):
# a macro's unbalanced expansion leaves the same note on a line that closes its bracket.
_UNCLOSED_RE = re.compile(r"^(.*?)(?::(\d+):\d+: note:|\((\d+)\): note #\d+-D:) to match this "
                          r"['\u2018\"]([{(\[])['\u2019\"]", re.MULTILINE)
_END_OF_INPUT_RE = re.compile(r"at end of input|At end of source: error")


def _shared_unit_hint(log: str, srcs: Sequence[Path]) -> str | None:
    """A line for a build that failed because of how load_inline joins one language's sources into one
    translation unit: two of the given sources define the same file-local name (valid as separate files), or a
    bracket one source leaves open runs into the files after it (whose lines, or torch's headers they include,
    then get the errors: none named the source where the '}' is missing)."""
    given = {str(p) for p in srcs}
    for m in _UNCLOSED_RE.finditer(log) if _END_OF_INPUT_RE.search(log) else ():
        # (where an error names that file itself, the compiler said where: no hint)
        named = re.search(rf"^{re.escape(m[1])}(?::\d+:\d+: (?:fatal )?error|\(\d+\): error)", log,
                          re.MULTILINE)
        if m[1] in given and not named:
            return (f"hint: {m[1]}:{m[2] or m[3]}: this '{m[4]}' is still open where the file ends: load_inline joins "
                    "the sources (and its generated bindings) into one file, so the compiler reports the missing "
                    "closing bracket in what comes after it, not in this file.")
    for here, before in _redefinitions(log):
        if here != before and here in given and before in given:
            kind = Path(here).suffix
            return (f"hint: {here} defines again what {before} defines: load_inline compiles all the {kind} sources "
                    "as one translation unit, so their file-static functions and variables, anonymous namespaces "
                    "and macros are shared; give one of them another name, or define it once in a header both "
                    "include.")
    return None


# Flags that add a folder to the compiler's header search, and those that include a file before the source
# (both spellings: ``-I dir`` and ``-Idir``). Only -iquote folders serve ``#include "..."`` alone. nvcc also
# takes long names for them (``--include-path dir``, ``--include-path=dir``) and lists of values separated by
# commas (``-Ia,b``).
_SEARCH_DIR_FLAGS = ("-isystem", "-idirafter", "-iquote", "-I")
_FORCED_INCLUDE_FLAGS = ("-include", "-imacros")
# Environment variables the compilers search for headers as they search -I / -isystem folders.
_SEARCH_VARIABLES = ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
_NVCC_LONG_FLAGS = {"--include-path": "-I", "--system-include": "-isystem", "--pre-include": "-include"}


def _split_flags(flags: Sequence[str], options: Sequence[str]) -> list[tuple[str | None, str, str]]:
    """Each of the flags as (option, value, joint) where one of ``options`` takes a value: given as ``-opt value``
    (joint " "), ``-optvalue`` ("") or a long ``--opt=value`` ("="); any other flag as (None, the flag, "")."""
    out, flags, i = [], list(flags), 0
    while i < len(flags):
        f = flags[i]
        for opt in options:
            if f == opt and i + 1 < len(flags):
                out.append((opt, flags[i + 1], " "))
                i += 1  # the value is not a flag of its own
                break
            if f.startswith(opt) and len(f) > len(opt):
                value = f[len(opt):]
                if opt.startswith("--"):
                    if not value.startswith("="):
                        continue  # another long option that starts alike
                    out.append((opt, value[1:], "="))
                else:
                    out.append((opt, value, ""))
                break
        else:
            out.append((None, f, ""))
        i += 1
    return out


def _flag_values(flags: Sequence[str], options: Sequence[str]) -> list[tuple[str, str]]:
    """(option, value) for each of these options in flags (_split_flags' spellings)."""
    return [(opt, value) for opt, value, _ in _split_flags(flags, options) if opt is not None]


def _shell_words(flags: Sequence[str]) -> list[str]:
    """The arguments the flags are to the compiler: torch writes them into build.ninja as they are, whose
    commands run in the shell, so a flag with a space is two and a quoted one is one ("-I'/a b'" is -I/a b).
    The cache key follows the same words (a quoted folder was looked for with its quotes)."""
    words = []
    for f in flags:
        try:
            words += shlex.split(f)
        except ValueError:  # unbalanced quotes: the compiler's shell fails on them, and says so
            words.append(f)
    return words


def _expand_response_files(flags: Sequence[str]) -> list[str]:
    """gcc's and ld's ``@file`` arguments replaced by the file's words (nested ones too; quoted, as the flags are
    shell words), so that the cache key, and the search for the headers and libraries they name, follow the file's
    contents (an edited response file was a cache hit on the old build). A relative one is read from our working
    directory (the compiler runs in the build folder). ``@name`` that names no file stays, as gcc leaves it."""
    def words(flag: str, depth: int) -> list[str]:
        path = Path(flag[1:]) if flag.startswith("@") and len(flag) > 1 else None
        if path is None or not path.is_file():
            return [flag]
        if depth > 10:
            raise ValueError(f"response file {flag}: nested more than 10 deep (one that names itself?)")
        try:
            inner = shlex.split(path.read_text())
        except ValueError as e:
            raise ValueError(f"response file {flag}: {e}") from None
        return [w for i in inner for w in words(i, depth + 1)]

    out = []
    for f in flags:
        expanded = words(f, 0)
        out += expanded if expanded == [f] else [shlex.quote(w) for w in expanded]
    return out


def _relative_path(value: str) -> bool:
    """Whether a flag's value is a path relative to the working directory: not absolute, and not "=dir" (gcc:
    under the sysroot; nvcc: "-I=dir" is "-I dir"), "$SYSROOT/..." or "-" (gcc's old -I-)."""
    return bool(value) and not os.path.isabs(value) and not value.startswith(("=", "$", "-"))


def _absolute_flags(flags: Sequence[str], options: Sequence[str], nvcc: bool = False,
                    files: bool = False) -> list[str]:
    """``flags`` with the relative folders and files their ``options`` name made absolute (``files``: bare file
    arguments too, a static library in the link flags): the compiler runs in the build folder, where a path
    relative to this process's working directory (the one the cache key read, as include_dirs=) is not found."""
    def absolute(opt: str, value: str) -> str:
        out = []
        for v in value.split(",") if nvcc else [value]:
            eq = "=" if nvcc and v.startswith("=") else ""  # (nvcc: "-I=dir" is "-I dir", read in the build folder)
            v = v[len(eq):]
            if _relative_path(v) and shlex.quote(v) == v:  # (a plain path: quoted ones are left as given)
                forced = _NVCC_LONG_FLAGS.get(opt, opt) in _FORCED_INCLUDE_FLAGS
                if not forced or Path(v).is_file():  # (a forced include may lie in a search folder instead)
                    v = str(Path(v).resolve())
            out.append(eq + v)
        return ",".join(out)

    for f in flags:
        # A flag of several shell words ("-I inc", "-Iinc -Wall"): rewriting a path inside it would mean quoting
        # it for the shell, so a relative one there is refused rather than left for the build folder to miss.
        words = _shell_words([f])
        if len(words) > 1 or words != [f]:
            # (a value may hold words of its own: "-Xcompiler '-I /usr/include/x'" gives -I " /usr/include/x")
            paths = [v.strip() for _, value in _flag_values(_shell_words(words), options)
                     for v in (value.split(",") if nvcc else [value])]
            if files:
                paths += [w for w in words if not w.startswith("-") and Path(w).is_file()]
            bad = [v for v in paths if _relative_path(v.removeprefix("=") if nvcc else v)]
            if bad:
                raise ValueError(f"the flag {f!r} names the relative path {bad[0]!r} inside quotes or several shell "
                                 "words, which the loader does not rewrite: the compiler runs in the build folder, "
                                 "so give an absolute path (or the path plainly as a flag of its own)")
    out = []
    for opt, value, joint in _split_flags(flags, options):
        if opt is None:
            plain = files and not value.startswith("-") and shlex.quote(value) == value and not os.path.isabs(value)
            out.append(str(Path(value).resolve()) if plain and Path(value).is_file() else value)
        elif joint == " ":
            out += [opt, absolute(opt, value)]
        else:
            out.append(opt + joint + absolute(opt, value))
    return out


def _flag_search(flags: Sequence[str], nvcc: bool = False,
                 only: str | None = None) -> tuple[list[Path], list[Path], list[str]]:
    """What the extra flags add to the compiler's header search: the folders for ``#include "..."`` only
    (-iquote), the folders for both kinds (-I, -isystem, -idirafter), and the files forced in before the source
    (-include, -imacros; as given). ``nvcc``: the flags are nvcc's (its long names and comma lists too). ``only``:
    the flags of that one option (e.g. "-I"), the others left out."""
    quote, both, forced = [], [], []
    options = _SEARCH_DIR_FLAGS + _FORCED_INCLUDE_FLAGS + (tuple(_NVCC_LONG_FLAGS) if nvcc else ())
    for opt, value in _flag_values(_shell_words(flags), options):
        opt = _NVCC_LONG_FLAGS.get(opt, opt)
        if only is not None and opt != only:
            continue
        for v in value.split(",") if nvcc else [value]:
            v = v.strip()  # (a value that held words of its own, inside -Xcompiler '...')
            if nvcc and v.startswith("="):
                v = v[1:]  # (nvcc: "-I=dir" is "-I dir")
            elif v.startswith(("=", "$")) or v in ("", "-"):
                continue  # under gcc's sysroot, or gcc's old -I-: not a folder of ours to follow
            if opt in _FORCED_INCLUDE_FLAGS:
                forced.append(v)
            else:
                (quote if opt == "-iquote" else both).append(Path(v).resolve())
    return quote, both, forced


def _linker_inputs(ldflags: Sequence[str]) -> list[Path]:
    """The files the extra link flags bring in that the cache key must follow: files named as they are (a static
    library, an object) and the libraries ``-lname`` finds in the ``-L`` folders given (a rebuilt library there
    must relink the module). Libraries found in the system's folders are not followed."""
    flags = _shell_words(ldflags)
    dirs = [Path(v) for _, v in _flag_values(flags, ("-L",))]
    found = [Path(f) for f in flags if not f.startswith("-") and Path(f).is_file()]
    for _, name in _flag_values(flags, ("-l",)):
        names = [name[1:]] if name.startswith(":") else [f"lib{name}.so", f"lib{name}.a"]
        found += [d / n for d in dirs for n in names if (d / n).is_file()]
    return [p.resolve() for p in found]


def _forced_candidates(name: str, search: Sequence[Path]) -> list[Path]:
    """The files that ``-include name`` may stand for, all to be hashed: the path itself when absolute. A relative
    one the compiler looks for in its working directory (the build folder) and then in the ``#include "..."``
    folders: every match there, and the path from our working directory (where load_sources made such a path
    absolute, _absolute_flags, as it does relative -I folders). One that does not exist is left to the compiler
    to report."""
    cands = [Path(name)] if os.path.isabs(name) else [Path(name).resolve(), *(d / name for d in search)]
    return [c for c in cands if c.is_file()]


def load_sources(
    paths: Iterable[str | os.PathLike],
    *,
    functions: Sequence[str] | Mapping[str, str] | None = None,
    name: str | None = None,
    cuda: bool | None = None,
    extra_cflags: Sequence[str] = (),
    extra_cuda_cflags: Sequence[str] = (),
    extra_ldflags: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike] = (),
    verbose: bool = False,
):
    """Build (or fetch from the cache) an extension from source files and return its Python module.

    ``paths``: ``.cu`` files go to nvcc, ``.cpp`` files to the host compiler; the headers they include
    (``#include "..."`` beside them or in ``include_dirs``, ``#include <...>`` in ``include_dirs``, and in the
    folders and files that ``-I``, ``-isystem``, ``-iquote``, ``-idirafter`` and ``-include`` name in the
    extra flags, and nvcc's ``--include-path``, ``--system-include``, ``--pre-include`` and comma lists), the
    sources' order, and the files the link flags name (a library, or one ``-l`` finds in a ``-L`` folder given)
    are part of the cache key. Only literal ``#include`` lines are followed: a header named through a macro
    (``#include CONFIG_H``) is not, so an edit to it needs a change to a source (or ``make clean-cache``).
    One path, flag or folder may be given alone (a str). The flags reach the compiler through the shell, as
    ``load_inline`` writes them: a flag with a space is two arguments unless quoted (``"-I'/a b'"``); relative
    folders and files in them are read from this process's working directory, as ``include_dirs``.

    All the ``.cpp`` sources are compiled as ONE translation unit, and all the ``.cu`` sources as another:
    ``load_inline`` joins each language's sources into one file (``#line`` directives keep the real names in
    errors). What is private to a file in a separate build is shared between the files of one language here:
    file-static functions and variables, anonymous namespaces and macros. Two files that each define a
    ``static`` helper (or a name in an anonymous namespace) of the same name fail with a redefinition error,
    which the loader follows with a hint naming both files; a macro one file defines is defined in the files
    after it too. Give such helpers distinct names, or define them once in a header that both files include
    (with an include guard). The joined file lives in the build folder, so a source's ``#include "cfg.h"`` is
    looked for in the include folders before the source's own: where one ahead of it holds another cfg.h (even
    a copy), the loader refuses the sources (naming both files) rather than compile the other one.

    ``functions`` lists the functions to bind (their declarations must be visible in a ``.cpp`` source, which
    must include ``<torch/extension.h>``); leave it out when a ``.cpp`` source holds its own
    ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``. ``cuda`` defaults to "any .cu given". The module
    is memoised per process.
    """
    # One path, flag or folder given alone (a str) is a list of one: a str was iterated letter by letter.
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    # (lists once: an iterator of flags used up by a first try would leave a retry without them)
    extra_cflags, extra_cuda_cflags, extra_ldflags, include_dirs = (
        [v] if isinstance(v, (str, os.PathLike)) else list(v)
        for v in (extra_cflags, extra_cuda_cflags, extra_ldflags, include_dirs))
    if functions is not None and not isinstance(functions, (str, Mapping)):
        functions = list(functions)
    for _ in range(_BUILD_TRIES):
        try:
            return _load_sources(paths, functions, name, cuda, extra_cflags, extra_cuda_cflags, extra_ldflags,
                                 include_dirs, verbose)
        except _SourcesChanged as e:
            _log.info("%s: a source or header changed while it was being built: building again", e.args[0])
    raise RuntimeError(f"the sources of {paths} changed during each of {_BUILD_TRIES} builds: save them, then load "
                       "again")


# A source or header saved while the compiler ran: the build holds the old text, the new, or some of each, so it
# is filed under no key (the next try reads them again).
_BUILD_TRIES = 3


# The names whose build this process imported although a source changed during it (_SourcesChanged): what it
# holds is neither text's, and a build of that name again would import as the same module object.
_MIXED: set[str] = set()


def _still(read_texts: Callable[[], dict[Path, str]], texts: dict[Path, str]) -> bool:
    """Whether the sources and headers read now are ``texts``; a file missing for a moment (an editor's save by
    rename) is a change."""
    try:
        return read_texts() == texts
    except OSError:
        return False


class _SourcesChanged(Exception):
    """Raised by _build where the texts hashed for the key are not the texts on disk after the build."""


def _load_sources(paths, functions, name, cuda, extra_cflags, extra_cuda_cflags, extra_ldflags, include_dirs,
                  verbose):
    """load_sources' one try, its arguments as lists (a change to a source during the build: _SourcesChanged)."""
    extra_cflags, extra_cuda_cflags, extra_ldflags = map(_expand_response_files,
                                                         (extra_cflags, extra_cuda_cflags, extra_ldflags))
    extra_cflags = _absolute_flags(extra_cflags, _SEARCH_DIR_FLAGS + _FORCED_INCLUDE_FLAGS)
    extra_cuda_cflags = _absolute_flags(extra_cuda_cflags,
                                        _SEARCH_DIR_FLAGS + _FORCED_INCLUDE_FLAGS + tuple(_NVCC_LONG_FLAGS), nvcc=True)
    extra_ldflags = _absolute_flags(extra_ldflags, ("-L",), files=True)
    srcs = [Path(p).resolve() for p in paths]
    if not srcs:
        raise ValueError("load_sources needs at least one source file")
    twice = sorted({str(p) for p in srcs if srcs.count(p) > 1})
    if twice:  # (joined into one translation unit, a file given twice defines everything twice)
        raise ValueError(f"a source given twice: {', '.join(twice)}")
    for p in srcs:
        if not p.is_file():
            raise FileNotFoundError(f"kernel source not found: {p}")
        if p.suffix not in CUDA_SUFFIXES + CPP_SUFFIXES:
            raise ValueError(f"{p}: expected a {CUDA_SUFFIXES + CPP_SUFFIXES} source (headers are found through "
                             "#include)")
    cuda_srcs = [p for p in srcs if p.suffix in CUDA_SUFFIXES]
    cpp_srcs = [p for p in srcs if p.suffix in CPP_SUFFIXES]
    with_cuda = bool(cuda_srcs) if cuda is None else cuda
    if cuda_srcs and not with_cuda:
        raise ValueError("cuda=False but .cu sources were given")
    if isinstance(functions, str):
        functions = [functions]
    incs = [Path(d).resolve() for d in include_dirs]
    # The sources' folders in the order given (a set's order changed from process to process: the cache key,
    # and which of two same-named headers a quoted #include found, with it).
    for d in dict.fromkeys(p.parent for p in srcs):
        if d not in incs:
            incs.append(d)
    # Folders and files named by the extra flags (-I, -isystem, -idirafter, -iquote, -include, -imacros) reach
    # their compiler through those flags, not ours: the headers found there are part of the cache key too.
    host, device = _flag_search(extra_cflags), _flag_search(extra_cuda_cflags, nvcc=True)
    quote_dirs, flag_dirs, forced = (a + b for a, b in zip(host, device))
    # The compilers' own search variables name folders as -I and -isystem do: their headers count too (an edited
    # header found through CPATH was a cache hit), and their values go into the key.
    env_search = {v: os.environ.get(v, "") for v in _SEARCH_VARIABLES}
    env_dirs = [Path(d).resolve() for value in env_search.values() for d in value.split(os.pathsep) if d]
    search = incs + [d for d in [*flag_dirs, *env_dirs] if d not in incs]

    def read_texts() -> dict[Path, str]:
        texts: dict[Path, str] = {}
        for p in [*srcs, *(c for f in forced for c in _forced_candidates(f, [*quote_dirs, *search]))]:
            _resolve_includes(p, search, texts, quote_dirs)
        return texts

    texts = read_texts()
    for p in srcs:
        _check_utf8(p, texts[p])
    # (a quoted include's search in the joined file: -iquote, then -I in command-line order, the extra flags' before
    # the loader's; -isystem, -idirafter and the search variables come after every -I, so after the sources' own)
    for lang_srcs, flags, nvcc, (lang_quote, _, _) in ((cpp_srcs, extra_cflags, False, host),
                                                       (cuda_srcs, extra_cuda_cflags, True, device)):
        lang_i = _flag_search(flags, nvcc, only="-I")[1]
        # A folder also named as a system folder (-isystem, -idirafter, C_INCLUDE_PATH, CPLUS_INCLUDE_PATH) loses
        # its -I place: the compiler searches it after every -I (so a source there looks in all of them first).
        system = {*_flag_search(flags, nvcc, only="-isystem")[1], *_flag_search(flags, nvcc, only="-idirafter")[1],
                  *(Path(d).resolve() for v in ("C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")
                    for d in env_search[v].split(os.pathsep) if d)}
        _check_quoted_includes(lang_srcs, texts, [d for d in [*lang_quote, *lang_i, *incs] if d not in system])
    if functions is not None:
        host_forced = [c for f in host[2] for c in _forced_candidates(f, [*host[0], *search])]
        _check_bindings_header(cpp_srcs, search, functions, host[0], host_forced)

    cflags = list(_KIT_CFLAGS) + list(extra_cflags)
    cuda_cflags = list(_KIT_CUDA_CFLAGS) + list(extra_cuda_cflags)
    archs = cuda_arch_list() if with_cuda else []
    if with_cuda:
        cuda_cflags += _gencode_flags(archs)
    include_flags = [_include_flag(d) for d in incs]

    key = hashlib.sha256()
    for p in sorted(texts):
        key.update(str(p).encode() + b"\0" + texts[p].encode("utf-8", "surrogateescape") + b"\0")
    fn_key = sorted(functions.items()) if isinstance(functions, Mapping) else functions
    compilers = _compiler_env()
    for p in _linker_inputs(extra_ldflags):  # a library rebuilt under the same name must relink the module
        key.update(str(p).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    # The sources' order too (cpp_srcs, cuda_srcs): each language's sources are joined into one file in the order
    # given, so a macro one defines reaches the ones after it.
    for part in (repr(list(fn_key) if fn_key is not None else None), repr(sorted(compilers.items())),
                 repr([str(p) for p in cpp_srcs]), repr([str(p) for p in cuda_srcs]),
                 repr(cflags), repr(cuda_cflags), repr(list(extra_ldflags)), repr(include_flags),
                 repr(sorted(env_search.items())),
                 repr([(v, os.environ.get(v)) for v in _CUDA_BUILD_VARIABLES] if with_cuda else []),
                 torch.__version__, str(torch.version.cuda), sys.version, repr(archs), _CACHE_LAYOUT,
                 _cpu_fingerprint() if any("native" in f for f in [*cflags, *cuda_cflags]) else ""):
        key.update(part.encode() + b"\0")
    digest = key.hexdigest()[:16]
    base = _module_base(name or srcs[0].stem)
    ext_name = f"{base}_{digest}"

    if ext_name in _MODULES:
        LAST_LOADED[base] = ext_name
        return _MODULES[ext_name]
    if ext_name in _MIXED:
        raise RuntimeError(f"{ext_name}: this process imported a build of these sources made while one of them was "
                           "being saved, and Python loads a module of one name once per process: restart it (the "
                           "kernel of a notebook) to load them; the cache holds no such build")
    build_dir = cache_root() / ext_name
    module, failed = _import_cached(ext_name, build_dir)  # a hit: no lock, no writes (the cache may be read-only)
    if module is None:
        _keep_unloadable(ext_name, failed)
        cuda_home = _check_toolchain(with_cuda)
        if with_cuda:
            _check_archs(cuda_home, archs)
        with _build_lock(ext_name, failed) as waited_from:
            module, failed = _import_cached(ext_name, build_dir)  # another process may have built it meanwhile
            _keep_unloadable(ext_name, failed)
            if module is None:
                _failed_meanwhile(ext_name, build_dir, waited_from)
                with _build_environment(compilers):
                    try:
                        module = _build(ext_name, build_dir, cpp_srcs, cuda_srcs, texts, functions,
                                        cflags + include_flags, cuda_cflags + include_flags, list(extra_ldflags),
                                        with_cuda, verbose, _expected_build_s(base, with_cuda, texts),
                                        unchanged=lambda: _still(read_texts, texts))
                    except KernelBuildError as e:
                        _record_failure(build_dir, e)
                        raise
    _MODULES[ext_name] = module
    _TOOLCHAINS[ext_name] = _manifest_toolchain(build_dir)
    LAST_LOADED[base] = ext_name
    return module


def _check_bindings_header(cpp_srcs: Sequence[Path], include_dirs: Sequence[Path], functions,
                           quote_dirs: Sequence[Path] = (), forced: Sequence[Path] = ()) -> None:
    """load_inline appends generated pybind11 bindings to the .cpp sources, and with no_implicit_headers
    nothing includes what they need: say so before a compiler fails on the generated code. ``include_dirs``,
    ``quote_dirs`` and ``forced``: the host compiler's search (the flags' folders too) and forced includes."""
    reached: dict[Path, str] = {}
    for p in [*cpp_srcs, *forced]:
        _resolve_includes(p, include_dirs, reached, quote_dirs)
    if not any(_BINDINGS_HEADER_RE.search(text) for text in reached.values()):
        given = ", ".join(map(str, cpp_srcs)) or "none"
        raise ValueError(f"functions={list(functions)} are bound by code generated after the .cpp sources, which "
                         f"needs `#include <torch/extension.h>`, but no .cpp source (given: {given}) includes it, "
                         "directly or through its headers: add it to one of them (the loader adds no headers).")


def _build(ext_name, build_dir: Path, cpp_srcs, cuda_srcs, texts, functions, cflags, cuda_cflags, ldflags,
           with_cuda, verbose, expected_s: int, unchanged: Callable[[], bool] = lambda: True):
    """Build from scratch into build_dir (we hold its lock), import, then write the manifest that makes the
    entry a cache hit. An unfinished build (killed, failed) leaves no manifest and is started over next time;
    ninja alone would keep a damaged .so that is newer than its objects. ``unchanged``: whether the sources and
    headers on disk are still the texts of the key; if not, no manifest (_SourcesChanged)."""
    from torch.utils import cpp_extension

    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True)
    # torch's JIT versioner remembers every attempt in this process, and for sources it has seen skips the build:
    # after a failed one, and after one cut short (Ctrl-C in a notebook, a full disk), which left it marked built,
    # so the next call imported the .so just removed above. Here a build is always wanted.
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(ext_name, None)

    cpp_sources = [_with_line(p, texts[p]) for p in cpp_srcs]
    if functions is not None:
        # load_inline appends the generated bindings after our sources: give them their own file name.
        cpp_sources.append('#line 1 "<kldiv_inline generated bindings>"\n')
    cuda_sources = [_with_line(p, texts[p]) for p in cuda_srcs]
    if not cpp_sources:
        cpp_sources = ["// no host sources"]
    _log.info("building %s (first use of these sources, ~%d s)...", ext_name, expected_s)
    start = time.perf_counter()
    try:
        module = cpp_extension.load_inline(
            name=ext_name,
            cpp_sources=cpp_sources,
            cuda_sources=cuda_sources or None,
            functions=functions,
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags if with_cuda else None,
            extra_ldflags=ldflags or None,
            build_directory=str(build_dir),
            verbose=verbose,
            with_cuda=with_cuda,
            # Our sources include what they use; torch/extension.h only where bindings are (much faster).
            no_implicit_headers=True,
        )
    except (RuntimeError, subprocess.CalledProcessError) as e:
        log = str(e)
        if isinstance(e, subprocess.CalledProcessError) and e.output:
            log += "\n" + (e.output.decode() if isinstance(e.output, bytes) else e.output)
        errors = _compiler_errors(log)
        if verbose and not errors:
            # verbose: torch streamed the compiler's output to the terminal and kept none of it for the error;
            # the failing step run again, captured, gives the errors their file and line here too.
            log += "\n" + _build_again(build_dir)
            errors = _compiler_errors(log)
        raise KernelBuildError(ext_name, errors, log, _shared_unit_hint(log, [*cpp_srcs, *cuda_srcs])) from None
    except UnicodeDecodeError:
        # The compiler echoed bytes that are not UTF-8 (a header's Latin-1 comment on an error's line), and torch
        # failed to decode its output: run the failing step again, decoded with replacement characters.
        log = _build_again(build_dir)
        raise KernelBuildError(ext_name, _compiler_errors(log), log,
                               _shared_unit_hint(log, [*cpp_srcs, *cuda_srcs])) from None
    except ImportError as e:
        failure = _load_failure(ext_name, e)
        if any(s in str(e) for s in _NOT_FIXED_BY_A_BUILD):
            # The .so is whole; only this process cannot load it: the manifest makes it a hit after a restart (or
            # where the library it links is found).
            so = next(iter(sorted(build_dir.glob(f"{ext_name}*.so"))), None)
            if so is not None:
                _write_manifest(build_dir, so, time.perf_counter() - start, toolchain(with_cuda))
        if failure is e:
            raise
        raise failure from None
    except OSError as e:  # (a full disk, a folder that went away): say where
        raise OSError(e.errno, f"building {ext_name} in {build_dir}: {e.strerror or e}") from e
    if not unchanged():
        _MIXED.add(ext_name)
        raise _SourcesChanged(ext_name)
    seconds = time.perf_counter() - start
    _write_manifest(build_dir, Path(module.__file__), seconds, toolchain(with_cuda))
    _log.info("built %s in %.1f s", ext_name, seconds)
    return module


def _build_again(build_dir: Path) -> str:
    """The output of ninja run again in ``build_dir`` (the failing step fails again), decoded whatever its bytes."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        again = subprocess.run(["ninja", "-v"], cwd=build_dir, capture_output=True, timeout=900)
        return (again.stdout + again.stderr).decode("utf-8", "replace")
    return ""


# ------------------------------------------------------------------------------------ the kit's own
# The kit's extensions: name -> backend -> its source files under kernels/. Each is its own module (its own
# build and cache entry), so editing one kernel family does not recompile the others.
KIT_EXTENSIONS: dict[str, dict[str, tuple[str, ...]]] = {
    # the KL-divergence op (kldiv_inline.ops)
    "kldiv": {"cuda": ("kldiv.cu", "kldiv_bindings.cpp"), "cpu": ("kldiv_cpu.cpp", "kldiv_bindings.cpp")},
    # divergences of logits for distillation (kldiv_inline.distill)
    "distill": {"cuda": ("distill.cu", "distill_bindings.cpp"), "cpu": ("distill_cpu.cpp", "distill_bindings.cpp")},
}


def load(backend: str = "cuda", *, kernels_dir: str | os.PathLike | None = None, verbose: bool = False,
         extension: str = "kldiv"):
    """The kit's compiled kernels for ``backend`` ("cuda" or "cpu"), built from ``kernels/`` on first use.

    ``extension`` picks one of the kit's modules (``KIT_EXTENSIONS``): "kldiv" (the KL op, see
    ``kernels/kldiv_bindings.cpp``) or "distill" (divergences of logits, ``kernels/distill_bindings.cpp``).
    Both backends of a module export the same functions. ``load("cuda")`` builds CUDA code (it needs nvcc,
    not a GPU) and never falls back to the CPU module.
    """
    if backend not in ("cuda", "cpu"):
        raise ValueError(f"backend must be 'cuda' or 'cpu', got {backend!r}")
    if extension not in KIT_EXTENSIONS:
        raise ValueError(f"extension must be one of {sorted(KIT_EXTENSIONS)}, got {extension!r}")
    kdir = Path(kernels_dir).resolve() if kernels_dir is not None else kernels_root()
    extra = {} if backend == "cuda" else {"extra_cflags": _KIT_CPU_CFLAGS, "extra_ldflags": ["-fopenmp"]}
    return load_sources([kdir / f for f in KIT_EXTENSIONS[extension][backend]], name=f"{extension}_{backend}",
                        cuda=backend == "cuda", verbose=verbose, **extra)
