"""Kernel files -> torch.utils.cpp_extension.load_inline -> a cached, importable Python module.

Why not plain load_inline: it writes every source into ``<build>/main.cpp`` / ``cuda.cu`` (so compiler
errors name those files), keys its cache on a name the caller picks, does not rebuild after a failed build
in the same process (pytorch#119206), and needs a GPU or ``TORCH_CUDA_ARCH_LIST`` to pick a target.
This module adds, around it:

* a name that carries a hash of every source and every header they include (found by following
  ``#include "..."``), the flags, the torch/CUDA versions and the target architectures: an edit rebuilds,
  an unchanged tree is a cache hit, and a hit in a new process imports the ``.so`` directly (no ninja);
* ``#line`` directives, so errors point at ``kernels/kldiv.cu:123``, and ``KernelBuildError`` carrying them;
* clear ``ToolchainError`` messages for a missing ``nvcc``/``ninja`` or a CUDA major-version mismatch;
* an OS file lock (released by the kernel if a builder dies) so concurrent builders don't collide and a
  killed build never blocks the next one.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Mapping, Sequence

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

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_BUILD_MARK = "kldiv_inline.ok"  # written after a successful build; its presence makes a hit importable

# Flags of the kit's own kernels. -O3 everywhere; the CPU twin uses OpenMP (torch ships libgomp.so.1, which
# the dynamic linker reuses) and -march=native is safe because the build is JIT on the machine that runs it
# (the CPU model is part of the cache key). -fno-trapping-math lets GCC vectorise selects around divisions
# (we never rely on floating-point exceptions; NaN and inf results are unchanged).
_KIT_CFLAGS = ["-O3"]  # the C++ standard is torch's choice (C++17 up to 2.13, C++20 from 2.14)
_KIT_CPU_CFLAGS = ["-fopenmp", "-march=native", "-fno-trapping-math"]
_KIT_CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

# One module object per (name) for the life of the process.
_MODULES: dict[str, object] = {}
_FAILED: set[str] = set()


class KernelBuildError(RuntimeError):
    """The compiler rejected a kernel source. ``.errors`` holds the compiler's error lines (real file:line)."""

    def __init__(self, name: str, errors: list[str], log: str):
        self.name, self.errors, self.log = name, errors, log
        shown = "\n".join(errors[:40]) or log[-4000:]
        super().__init__(f"building extension {name!r} failed:\n{shown}")


class ToolchainError(RuntimeError):
    """A build tool is missing or does not match torch (nvcc, ninja, CUDA major version)."""


# ----------------------------------------------------------------------------------------------- paths
def kernels_root() -> Path:
    """The kit's ``kernels/`` directory (``KLDIV_INLINE_KERNELS`` overrides)."""
    env = os.environ.get("KLDIV_INLINE_KERNELS")
    return Path(env).resolve() if env else Path(__file__).resolve().parent.parent / "kernels"


def cache_root() -> Path:
    """Where builds live: ``KLDIV_INLINE_CACHE``, else ``TORCH_EXTENSIONS_DIR``, else ``~/.cache``."""
    for var in ("KLDIV_INLINE_CACHE", "TORCH_EXTENSIONS_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser() / "kldiv_inline"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kldiv_inline" / "extensions"


# ----------------------------------------------------------------------------------------- toolchain
def _cuda_home() -> str | None:
    """CUDA_HOME/CUDA_PATH, else the toolkit holding the ``nvcc`` on PATH (following wrapper links)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and os.path.exists(os.path.join(os.environ[var], "bin", "nvcc")):
            return os.environ[var]
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


def cuda_arch_list() -> list[str]:
    """Target architectures: TORCH_CUDA_ARCH_LIST if set, else the visible GPUs', else DEFAULT_CUDA_ARCH."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return [a for a in re.split(r"[;\s]+", env) if a]
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return [f"{ma}.{mi}" for ma, mi in sorted(caps)]
    return [DEFAULT_CUDA_ARCH]


def _gencode_flags(archs: Sequence[str]) -> list[str]:
    flags = []
    for a in archs:
        ptx = a.endswith("+PTX")
        num = a.replace("+PTX", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


# ------------------------------------------------------------------------------------------ sources
def _resolve_includes(path: Path, include_dirs: Sequence[Path], seen: dict[Path, str]) -> None:
    """Read ``path`` and, recursively, every quoted include found beside it or in include_dirs."""
    path = path.resolve()
    if path in seen:
        return
    text = path.read_text()
    seen[path] = text
    for inc in _INCLUDE_RE.findall(text):
        for d in (path.parent, *include_dirs):
            cand = d / inc
            if cand.is_file():
                _resolve_includes(cand, include_dirs, seen)
                break


@functools.lru_cache(maxsize=None)
def _cpu_fingerprint() -> str:
    """The host CPU, for builds with -march=native (whose code may not run on another CPU)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    import platform
    return platform.processor() or platform.machine()


def _with_line(path: Path, text: str) -> str:
    # #line takes a C string literal: escape backslashes and quotes in the path.
    name = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{name}"\n{text}\n'


# -------------------------------------------------------------------------------------- build + load
@contextlib.contextmanager
def _flock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _import_built(name: str, build_dir: Path):
    so = build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if not so.exists():
        so = build_dir / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, so,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(so)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compiler_errors(log: str) -> list[str]:
    """The lines of a ninja/nvcc/g++ log that state an error, with a little context after each."""
    lines = log.splitlines()
    out = []
    wrappers = ("FAILED:", "ninja:", "Error building extension")  # ninja's and torch's lines, not the compiler's
    for i, line in enumerate(lines):
        if (re.search(r"\berror\b", line, re.IGNORECASE) and not line.startswith(wrappers)
                and not re.search(r"errors? detected in the compilation of", line)):
            out.append(line)
            # The compiler's context (the source line, a caret), not the next build command.
            out.extend(l for l in lines[i + 1:i + 3]
                       if l.strip() and "error" not in l.lower() and not re.match(r"\s*\[\d+/\d+\]", l))
    return out


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

    ``paths``: ``.cu`` files go to nvcc, ``.cpp`` files to the host compiler; headers they include with
    ``#include "..."`` (beside them or in ``include_dirs``) are part of the cache key. ``functions`` lists
    the functions to bind (their declarations must be visible in a ``.cpp`` source); leave it out when a
    ``.cpp`` source holds its own ``PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)``. ``cuda`` defaults to
    "any .cu given". The module is memoised per process.
    """
    srcs = [Path(p).resolve() for p in paths]
    if not srcs:
        raise ValueError("load_sources needs at least one source file")
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
    incs = [Path(d).resolve() for d in include_dirs]
    for d in {p.parent for p in srcs}:
        if d not in incs:
            incs.append(d)

    texts: dict[Path, str] = {}
    for p in srcs:
        _resolve_includes(p, incs, texts)

    cflags = list(_KIT_CFLAGS) + list(extra_cflags)
    cuda_cflags = list(_KIT_CUDA_CFLAGS) + list(extra_cuda_cflags)
    archs = cuda_arch_list() if with_cuda else []
    if with_cuda:
        cuda_cflags += _gencode_flags(archs)
    include_flags = [f"-I{d}" for d in incs]

    key = hashlib.sha256()
    for p in sorted(texts):
        key.update(str(p).encode() + b"\0" + texts[p].encode() + b"\0")
    fn_key = sorted(functions.items()) if isinstance(functions, Mapping) else functions
    for part in (repr(list(fn_key) if fn_key is not None else None),
                 repr(cflags), repr(cuda_cflags), repr(list(extra_ldflags)), repr(include_flags),
                 torch.__version__, str(torch.version.cuda), sys.version, repr(archs),
                 _cpu_fingerprint() if any("native" in f for f in cflags) else ""):
        key.update(part.encode() + b"\0")
    digest = key.hexdigest()[:16]
    base = re.sub(r"\W", "_", name or srcs[0].stem)
    ext_name = f"{base}_{digest}"

    if ext_name in _MODULES:
        return _MODULES[ext_name]

    build_dir = cache_root() / ext_name
    with _flock(cache_root() / f".{ext_name}.lock"):
        if (build_dir / _BUILD_MARK).exists():
            try:
                module = _import_built(ext_name, build_dir)
                _MODULES[ext_name] = module
                return module
            except ImportError:
                # A damaged cache entry: rebuild it below, from scratch (ninja would keep a broken .so that is
                # newer than its objects).
                shutil.rmtree(build_dir, ignore_errors=True)
        _check_toolchain(with_cuda)
        module = _build(ext_name, build_dir, cpp_srcs, cuda_srcs, texts, functions, cflags + include_flags,
                        cuda_cflags + include_flags, list(extra_ldflags), with_cuda, verbose)
    _MODULES[ext_name] = module
    return module


def _build(ext_name, build_dir: Path, cpp_srcs, cuda_srcs, texts, functions, cflags, cuda_cflags, ldflags,
           with_cuda, verbose):
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # Torch before 2.14 used the existence of <build>/lock as the lock, so a killed builder left it behind and
    # every later build waited forever. Only we build in this directory (we hold its flock): such a file is
    # stale. Torch 2.14+ locks the file with the OS instead (cpp_extension.FileLock); leave it alone there.
    if not hasattr(cpp_extension, "FileLock"):
        with contextlib.suppress(FileNotFoundError):
            (build_dir / "lock").unlink()
    if ext_name in _FAILED:
        # pytorch#119206: the JIT versioner remembers the failed attempt and would skip the rebuild.
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(ext_name, None)
    (build_dir / _BUILD_MARK).unlink(missing_ok=True)

    cpp_sources = [_with_line(p, texts[p]) for p in cpp_srcs]
    if functions is not None:
        # load_inline appends the generated bindings after our sources: give them their own file name.
        cpp_sources.append('#line 1 "<kldiv_inline generated bindings>"\n')
    cuda_sources = [_with_line(p, texts[p]) for p in cuda_srcs]
    if not cpp_sources:
        cpp_sources = ["// no host sources"]
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
        _FAILED.add(ext_name)
        log = str(e)
        if isinstance(e, subprocess.CalledProcessError) and e.output:
            log += "\n" + (e.output.decode() if isinstance(e.output, bytes) else e.output)
        raise KernelBuildError(ext_name, _compiler_errors(log), log) from None
    _FAILED.discard(ext_name)
    (build_dir / _BUILD_MARK).write_text("ok\n")
    return module


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
