"""The loader (kldiv_inline/loader.py): cache key and hits, #line error mapping, rebuilds after failures,
toolchain errors, target architectures, and its lock (concurrent and killed builders).

The tiny test extensions use the CPython C API rather than pybind11 or torch headers, so they compile in about
a second (the loader passes no_implicit_headers=True). Each test builds into its own cache (KLDIV_INLINE_CACHE
under tmp_path), except the kit's own modules, which use the default cache that the other tests share.
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

import kldiv_inline
from kldiv_inline import loader

REPO = Path(__file__).resolve().parent.parent

# A Python module named TORCH_EXTENSION_NAME with one function, value() -> int, returning VALUE_EXPR.
_CAPI_MODULE = """\
#include <Python.h>
{prelude}
#define KL_STR_(x) #x
#define KL_STR(x) KL_STR_(x)
#define KL_CAT_(a, b) a##b
#define KL_CAT(a, b) KL_CAT_(a, b)
static PyObject* py_value(PyObject*, PyObject*) {{ return PyLong_FromLong({value}); }}
static PyMethodDef methods[] = {{{{"value", py_value, METH_NOARGS, nullptr}}, {{nullptr, nullptr, 0, nullptr}}}};
static PyModuleDef moddef = {{PyModuleDef_HEAD_INIT, KL_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods}};
PyMODINIT_FUNC KL_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {{ return PyModule_Create(&moddef); }}
"""


def capi_module(value: str, prelude: str = "") -> str:
    return _CAPI_MODULE.format(prelude=prelude, value=value)


# The CUDA tiny extension: a kernel and a host function in a .cu, bound from a .cpp.
TINY_CU = """\
#include "scale.h"
__global__ void k(int* p) { *p = SCALE; }
int value() { return SCALE; }
"""
TINY_BIND = capi_module("value()", prelude="int value();")


def build_dirs(root: Path | None = None) -> list[Path]:
    root = root or loader.cache_root()
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache for this test; CUDA code is compiled for sm_90 only (fast, and no GPU needed)."""
    monkeypatch.setenv("KLDIV_INLINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    root = loader.cache_root()
    assert root.is_relative_to(tmp_path)
    return root


@pytest.fixture
def tiny_cuda(tmp_path, cache):
    """scale.h -> base.h, k.cu (includes scale.h), bind.cpp: value() == 7."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "base.h").write_text("#define BASE 3\n")
    (src / "scale.h").write_text('#include "base.h"\n#define SCALE (BASE + 4)\n')
    (src / "k.cu").write_text(TINY_CU)
    (src / "bind.cpp").write_text(TINY_BIND)
    return src


def tiny_cuda_sources(src: Path) -> list[Path]:
    return [src / "k.cu", src / "bind.cpp"]


# ---------------------------------------------------------------------------------------- subprocesses
# Loads sys.argv[1:] with load_sources and prints JSON: the value, how long load_sources took (after the
# imports) and how many times it called cpp_extension.load_inline (0: a cache hit, no ninja).
_CHILD = r"""
import json, os, sys, time
import torch
from torch.utils import cpp_extension
import kldiv_inline

calls = []
_real = cpp_extension.load_inline
def _counting(*args, **kwargs):
    calls.append(kwargs.get("name"))
    return _real(*args, **kwargs)
cpp_extension.load_inline = _counting

ready, go = os.environ.get("KL_TEST_READY"), os.environ.get("KL_TEST_GO")
if ready:  # start loading together with the other children
    open(ready, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.005)
t0 = time.perf_counter()
m = kldiv_inline.load_sources(sys.argv[1:])
seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({"value": m.value(), "load_s": seconds, "builds": len(calls), "file": m.__file__}))
"""


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def child_cmd(tmp_path: Path, sources) -> list[str]:
    script = tmp_path / "child_load.py"
    if not script.exists():
        script.write_text(_CHILD)
    # sys.executable is the interpreter running the tests (the project's .venv python).
    return [sys.executable, str(script), *map(str, sources)]


def child_result(proc_stdout: str, proc_stderr: str = "") -> dict:
    for line in proc_stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"the child printed no result\nstdout:\n{proc_stdout}\nstderr:\n{proc_stderr[-4000:]}")


def run_child(tmp_path: Path, sources, timeout: float = 180, **env) -> dict:
    proc = subprocess.run(child_cmd(tmp_path, sources), env=child_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return child_result(proc.stdout, proc.stderr)


# ------------------------------------------------------------------------------- 1. cache miss and hit
def test_second_load_in_process_returns_same_module(tiny_cuda, cache, monkeypatch):
    m1 = kldiv_inline.load_sources(tiny_cuda_sources(tiny_cuda))
    assert m1.value() == 7
    dirs = build_dirs()
    assert len(dirs) == 1 and (dirs[0] / loader._BUILD_MARK).exists()
    so_mtime = Path(m1.__file__).stat().st_mtime_ns
    # The second load is memoised: it neither builds nor imports the .so again.
    for fn in (loader, "_import_so"), (loader, "_build"), (cpp_extension, "load_inline"):
        monkeypatch.setattr(*fn, lambda *a, _n=fn[1], **k: pytest.fail(f"the second load called {_n}"))
    m2 = kldiv_inline.load_sources(tiny_cuda_sources(tiny_cuda))
    assert m2 is m1
    assert build_dirs() == dirs
    assert Path(m1.__file__).stat().st_mtime_ns == so_mtime


def test_new_process_is_a_fast_cache_hit(tmp_path, tiny_cuda, cache):
    m = kldiv_inline.load_sources(tiny_cuda_sources(tiny_cuda))
    dirs = build_dirs()
    so_mtime = Path(m.__file__).stat().st_mtime_ns
    res = run_child(tmp_path, tiny_cuda_sources(tiny_cuda))
    assert res["value"] == 7
    assert res["builds"] == 0, "a new process rebuilt an unchanged extension (expected a cache hit)"
    assert res["file"] == m.__file__
    assert res["load_s"] < 3.0, f"cache hit took {res['load_s']:.2f} s"
    assert build_dirs() == dirs
    assert Path(m.__file__).stat().st_mtime_ns == so_mtime


def test_editing_sources_rebuilds(tiny_cuda, cache):
    srcs = tiny_cuda_sources(tiny_cuda)
    m1 = kldiv_inline.load_sources(srcs)
    assert m1.value() == 7

    (tiny_cuda / "k.cu").write_text(TINY_CU.replace("return SCALE;", "return SCALE + 1;"))
    m2 = kldiv_inline.load_sources(srcs)
    assert m2.__name__ != m1.__name__
    assert m2.value() == 8
    assert len(build_dirs()) == 2

    (tiny_cuda / "bind.cpp").write_text(capi_module("value() + 100", prelude="int value();"))
    m3 = kldiv_inline.load_sources(srcs)
    assert m3.__name__ not in (m1.__name__, m2.__name__)
    assert m3.value() == 108
    assert len(build_dirs()) == 3


def test_editing_included_headers_rebuilds(tiny_cuda, cache):
    srcs = tiny_cuda_sources(tiny_cuda)
    m1 = kldiv_inline.load_sources(srcs)
    assert m1.value() == 7

    (tiny_cuda / "scale.h").write_text('#include "base.h"\n#define SCALE (BASE + 5)\n')  # included by k.cu
    m2 = kldiv_inline.load_sources(srcs)
    assert m2.__name__ != m1.__name__
    assert m2.value() == 8

    (tiny_cuda / "base.h").write_text("#define BASE 10\n")  # included by scale.h, two levels down
    m3 = kldiv_inline.load_sources(srcs)
    assert m3.__name__ not in (m1.__name__, m2.__name__)
    assert m3.value() == 15
    assert len(build_dirs()) == 3

    # Back to the first contents: the first build again, no new one.
    (tiny_cuda / "scale.h").write_text('#include "base.h"\n#define SCALE (BASE + 4)\n')
    (tiny_cuda / "base.h").write_text("#define BASE 3\n")
    assert kldiv_inline.load_sources(srcs) is m1
    assert len(build_dirs()) == 3


# ------------------------------------------------------------------------ 2. compile-error line mapping
_BAD_BODY = "// 1\n// 2\n// 3\n// 4\n// 5\n{sig} {{\n  return 1 +;\n}}\n"  # the error is on line 7


def _assert_maps_to(err: kldiv_inline.KernelBuildError, location: str):
    msg = str(err)
    assert location in msg, msg
    assert err.errors and location in err.errors[0], err.errors  # the first error line is the real one
    # No error location in load_inline's generated files, only in ours.
    assert not re.search(r"(cuda\.cu\(\d+\)|main\.cpp:\d+)", msg), msg


def test_cu_compile_error_names_real_file_and_line(tmp_path, cache):
    bad = tmp_path / "bad.cu"
    bad.write_text(_BAD_BODY.format(sig="__device__ int f()"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([bad])
    _assert_maps_to(info.value, f"{bad}(7)")  # nvcc style


def test_cpp_compile_error_names_real_file_and_line(tmp_path, cache):
    bad = tmp_path / "bad.cpp"
    bad.write_text(_BAD_BODY.format(sig="int f()"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([bad])
    _assert_maps_to(info.value, f"{bad}:7:")  # gcc style


@pytest.mark.parametrize("suffix", [".cpp", ".cu"])
def test_a_bracket_left_open_names_the_file_that_opened_it(tmp_path, cache, suffix):
    # Joined into one file, a '{' the first source never closes runs into the second (or torch's headers that
    # one includes: the notebook's scale2.cpp gave 31758 error lines, none naming it); the compiler's note naming
    # the open bracket's file and line is now the hint (g++: "first.cpp:1:9: note: to match this '{'"; nvcc:
    # 'first.cu(1): note #3196-D: to match this "{"', after "At end of source: error"). A single .cpp source's own
    # error already names it: no hint there (nvcc's "At end of source" names no file, so a lone .cu gets the hint).
    first, second = tmp_path / f"first{suffix}", tmp_path / f"second{suffix}"
    first.write_text("int f() {\n  return 1;\n")
    second.write_text("int g() { return 2; }\n")
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([first, second])
    assert info.value.hint is not None and f"{first}:1:" in info.value.hint and "still open" in info.value.hint, (
        info.value.hint, str(info.value))
    if suffix == ".cpp":
        with pytest.raises(kldiv_inline.KernelBuildError) as info:
            kldiv_inline.load_sources([first])
        assert info.value.hint is None and f"{first}:2:" in str(info.value)
    # A macro whose expansion breaks a call leaves the same note on a line that closes its bracket: no hint
    (tmp_path / "m.h").write_text("#define M 1 2\n")
    macro = tmp_path / f"macro{suffix}"
    macro.write_text('#include "m.h"\nint foo(int, int);\nint y = foo(M, 3);\n')
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([macro, second])
    assert info.value.hint is None, info.value.hint


def test_compile_error_in_header_names_the_header(tmp_path, cache):
    (tmp_path / "bad.h").write_text("// 1\ninline int g() {\n  return 2 *;\n}\n")
    src = tmp_path / "uses.cpp"
    src.write_text('// 1\n#include "bad.h"\nint h() { return g(); }\n')
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src])
    _assert_maps_to(info.value, f"{tmp_path / 'bad.h'}:3:")


def test_a_header_behind_a_symbolic_link_follows_the_links_folder(tmp_path, cache):
    # src/sub/h.h links to shared/h.h, which includes "inner.h": the compiler finds it beside the link (the file
    # as it opened it), where the loader looked beside the target, so an edit to the inner.h compiled was a hit.
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "h.h").write_text('#pragma once\n#include "inner.h"\n')
    (tmp_path / "src" / "sub" / "h.h").symlink_to(tmp_path / "shared" / "h.h")
    src = tmp_path / "src" / "op.cpp"
    src.write_text(capi_module("VAL", prelude='#include "sub/h.h"'))
    (tmp_path / "src" / "sub" / "inner.h").write_text("#define VAL 1\n")
    assert kldiv_inline.load_sources([src]).value() == 1
    (tmp_path / "src" / "sub" / "inner.h").write_text("#define VAL 2\n")
    assert kldiv_inline.load_sources([src]).value() == 2


def test_a_header_saved_during_the_build_is_not_filed_under_the_old_key(tmp_path, cache, monkeypatch):
    # The key hashes the headers before the build and the compiler reads them during it: a header saved in between
    # (an editor's save while a notebook cell builds) filed the new code under the old text's key, so going back
    # to the old text gave the new code, in this process and every later one.
    from torch.utils import cpp_extension

    header = tmp_path / "val.h"
    header.write_text("#define VAL 1\n")
    src = tmp_path / "op.cpp"
    src.write_text(capi_module("VAL + PLUS", prelude='#include "val.h"'))
    real, saves = cpp_extension.load_inline, []

    def saved_while_building(*args, **kwargs):
        if not saves:
            saves.append(header.write_text("#define VAL 2\n"))  # once, after the key was taken
        return real(*args, **kwargs)

    monkeypatch.setattr(cpp_extension, "load_inline", saved_while_building)
    # (a flag given as an iterator reaches the second try too: -DPLUS=0 from a generator, used up by the first)
    flags = (f for f in ["-DPLUS=0"])
    assert kldiv_inline.load_sources([src], extra_cflags=flags).value() == 2  # built again from what is on disk
    header.write_text("#define VAL 1\n")
    # This process imported the mixed build under the old text's name, and Python imports a name once: it says so.
    with pytest.raises(RuntimeError, match="restart"):
        kldiv_inline.load_sources([src], extra_cflags=["-DPLUS=0"])
    # Another process builds the old text (no build was filed under its key).
    code = f"import kldiv_inline; print(kldiv_inline.load_sources([{str(src)!r}], extra_cflags=['-DPLUS=0']).value())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.split()[-1] == "1", run.stderr[-2000:]


def test_a_templates_error_names_the_line_that_instantiated_it(tmp_path, cache):
    # std::sort of a type with no operator<: g++ reports the error inside the standard library's header, and names
    # the researcher's line only above it ("required from here"), which the message used to drop.
    src = tmp_path / "sorts.cpp"
    src.write_text("#include <algorithm>\n#include <vector>\nstruct Pair { int a; };\n// 4\n// 5\n"
                   "int f() {\n  std::vector<Pair> v(3);\n  std::sort(v.begin(), v.end());\n  return 0;\n}\n")
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src])
    assert f"{src}:8:" in str(info.value) and any(f"{src}:8:" in e for e in info.value.errors), str(info.value)


def test_a_templates_error_names_the_line_that_instantiated_it_nvcc(tmp_path, cache):
    # nvcc reports the error at the template and names the instantiating line after it ("detected during
    # instantiation of ... at line 7"), beyond the two lines of context kept before.
    # (the second: an operator's error lists its candidates in notes, each with a source line and caret, before
    # the chain)
    src = tmp_path / "twice.cu"
    for body, line in (("template <typename T> __device__ int twice(T x) {\n  return x.missing * 2;\n}\n// 5\n// 6\n"
                        "__global__ void k(int* o) { Pair p{1}; o[0] = twice(p); }\n", 7),
                       ("template <typename T> __device__ bool less(T a, T b) {\n  return a < b;\n}\n// 5\n"
                        "__global__ void k(int* o) { Pair p{1}; o[0] = less(p, p); }\n", 6)):
        src.write_text("struct Pair { int a; };\n" + body)
        with pytest.raises(kldiv_inline.KernelBuildError) as info:
            kldiv_inline.load_sources([src])
        assert f"at line {line}" in str(info.value) and f"{src}(3)" in str(info.value), str(info.value)


@pytest.mark.parametrize("suffix", [".cpp", ".cu"])
def test_same_static_helper_in_two_sources_says_they_are_one_translation_unit(tmp_path, cache, suffix):
    # Valid as separate files (g++ a.cpp b.cpp links), but load_inline joins one language's sources into one file.
    a, b = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    a.write_text("static long helper() { return 1; }\nlong from_a() { return helper(); }\n")
    b.write_text("static long helper() { return 2; }\nlong from_b() { return helper(); }\n")
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([a, b])
    msg = str(info.value)
    assert "one translation unit" in msg and "static" in msg, msg
    hint = msg.splitlines()[-1]  # after the compiler's lines, which still come first
    assert hint.startswith("hint:") and str(a) in hint and str(b) in hint, msg
    assert str(b) in info.value.errors[0], info.value.errors


# A compiler driver that finds no shared libstdc++ (prints the bare name for -print-file-name, as the lent GPU
# machines' CC/CXX wrappers did) and fails every real compile or link, so a build that uses it fails.
_NO_LIBSTDCXX_DRIVER = """#!/bin/sh
case "$1" in -print-file-name=*) echo "${1#-print-file-name=}"; exit 0;; esac
echo "this compiler should have been left out" >&2
exit 1
"""


def test_a_compiler_that_finds_no_shared_libstdcxx_is_left_out(tmp_path, cache, monkeypatch, caplog):
    # Its extensions crashed the process when they raised a formatted error: the default compiler builds instead,
    # with a warning, the environment is as it was afterwards, and KLDIV_INLINE_KEEP_COMPILER=1 keeps it.
    driver = tmp_path / "bad-g++"
    driver.write_text(_NO_LIBSTDCXX_DRIVER)
    driver.chmod(0o755)
    assert not loader._finds_shared_libstdcxx(str(driver))
    assert loader._finds_shared_libstdcxx("c++")  # the default here finds its library
    monkeypatch.setenv("CXX", str(driver))
    src = tmp_path / "m.cpp"
    src.write_text(capi_module("41 + 1"))
    with caplog.at_level("WARNING", logger="kldiv_inline"):
        assert kldiv_inline.load_sources([src]).value() == 42
    assert os.environ["CXX"] == str(driver)
    assert any("finds no shared libstdc++" in r.getMessage() and str(driver) in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv("KLDIV_INLINE_KEEP_COMPILER", "1")
    src.write_text(capi_module("41 + 2"))
    with pytest.raises(kldiv_inline.KernelBuildError):
        kldiv_inline.load_sources([src])


def test_build_environment_restores_the_variables(monkeypatch):
    monkeypatch.setenv("CC", "cc-before")
    monkeypatch.delenv("CXX", raising=False)
    with loader._build_environment({"CC": None, "CXX": "c++-during"}):
        assert "CC" not in os.environ and os.environ["CXX"] == "c++-during"
    assert os.environ["CC"] == "cc-before" and "CXX" not in os.environ


# ------------------------------------------------------------------- 3. rebuild after a failed build
def test_rebuild_after_failed_build_in_same_process(tmp_path, cache):
    src = tmp_path / "flaky.cpp"
    src.write_text(capi_module("4 +"))
    with pytest.raises(kldiv_inline.KernelBuildError):
        kldiv_inline.load_sources([src])
    src.write_text(capi_module("4 + 1"))
    assert kldiv_inline.load_sources([src]).value() == 5


def test_rebuild_after_failed_build_with_same_name(tmp_path, cache, monkeypatch):
    """The fix lies outside the cache key (a header named through a macro, which the loader does not follow), so
    the retry has the failed build's name: torch's JIT versioner alone would skip the build and fail to import
    (a known PyTorch issue: a failed JIT build's version is kept)."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "fix.h").write_text("#define FIXED_VALUE (6 +)\n")
    monkeypatch.setenv("CPATH", str(inc))
    src = tmp_path / "samename.cpp"
    src.write_text(capi_module("FIXED_VALUE", prelude="#define FIX_HEADER <fix.h>\n#include FIX_HEADER"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src])
    failed_name = info.value.name
    (inc / "fix.h").write_text("#define FIXED_VALUE (6 + 1)\n")
    m = kldiv_inline.load_sources([src])
    assert m.__name__ == failed_name
    assert m.value() == 7


def test_damaged_cache_entry_is_rebuilt(tmp_path, cache):
    src = tmp_path / "damaged.cpp"
    src.write_text(capi_module("9"))
    # Build and load in children: this process must not map the .so that gets damaged.
    first = run_child(tmp_path, [src])
    assert first["value"] == 9 and first["builds"] == 1
    so = Path(first["file"])
    so.unlink()
    so.write_bytes(b"not an ELF file")  # newer than its objects: ninja alone would keep it
    second = run_child(tmp_path, [src])
    assert second["value"] == 9 and second["builds"] == 1
    assert second["file"] == first["file"]


# --------------------------------------------------------------------------------- 4. toolchain errors
@pytest.fixture
def no_compiler_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(cpp_extension, "load_inline", lambda *a, **k: calls.append(k) or pytest.fail(
        "load_inline ran although the toolchain check should have failed"))
    return calls


def test_missing_nvcc_raises_toolchain_error(tmp_path, cache, monkeypatch, no_compiler_runs):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ninja = shutil.which("ninja")
    assert ninja, "ninja must be installed for the loader"
    (bindir / "ninja").symlink_to(ninja)
    monkeypatch.setenv("PATH", str(bindir))  # ninja, but no nvcc
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.setenv(var, "")  # so that monkeypatch restores it, set or not
        monkeypatch.delenv(var)
    # Hide the /usr/local/cuda fallback too.
    real_path = loader.Path
    hidden = tmp_path / "no-cuda-here"
    monkeypatch.setattr(loader, "Path", lambda *a: hidden if a == ("/usr/local/cuda",) else real_path(*a))
    assert loader._cuda_home() is None

    src = tmp_path / "needs_nvcc.cu"
    src.write_text("__global__ void k() {}\n")
    with pytest.raises(kldiv_inline.ToolchainError, match="nvcc") as info:
        kldiv_inline.load_sources([src])
    assert "CUDA_HOME" in str(info.value)
    assert no_compiler_runs == []
    assert build_dirs() == []
    # A CPU-only build needs no nvcc.
    assert loader._check_toolchain(with_cuda=False) is None


def test_cuda_major_mismatch_raises_toolchain_error(tmp_path, cache, monkeypatch, no_compiler_runs):
    torch_major = int(torch.version.cuda.split(".")[0])
    other = (12, 4) if torch_major != 12 else (11, 8)
    monkeypatch.setattr(loader, "_nvcc_version", lambda home: other)
    src = tmp_path / "mismatch.cu"
    src.write_text("__global__ void k() {}\n")
    with pytest.raises(kldiv_inline.ToolchainError) as info:
        kldiv_inline.load_sources([src])
    msg = str(info.value)
    assert f"CUDA {other[0]}.{other[1]}" in msg and torch.version.cuda in msg, msg
    assert no_compiler_runs == []
    assert build_dirs() == []


def test_cuda_home_resolution(tmp_path, monkeypatch):
    def toolkit(root: Path) -> Path:
        (root / "bin").mkdir(parents=True)
        (root / "include").mkdir()
        (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (root / "bin" / "nvcc").chmod(0o755)
        (root / "include" / "cuda_runtime.h").write_text("")
        return root

    real = toolkit(tmp_path / "cuda-13.9")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "nvcc"  # a shell wrapper, not a link (like /usr/local/bin/nvcc on some images)
    wrapper.write_text(f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    assert loader._cuda_home() == str(real)
    other = toolkit(tmp_path / "other")
    monkeypatch.setenv("CUDA_PATH", str(real))
    assert loader._cuda_home() == str(real)  # CUDA_PATH wins over PATH
    monkeypatch.setenv("CUDA_HOME", str(other))
    assert loader._cuda_home() == str(other)  # and CUDA_HOME over CUDA_PATH (torch's order)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "nowhere"))
    assert loader._cuda_home() == str(other)  # the variable not in use is not checked


# ------------------------------------------------------------------------------- 5. the kit's modules
# Default cache (no KLDIV_INLINE_CACHE override): built once, shared with the other test files.
def test_kit_load_cuda_is_the_cuda_module():
    m = kldiv_inline.load("cuda")
    assert m.backend() == "cuda"
    assert m.__name__.startswith("kldiv_cuda_")
    assert Path(m.__file__).parent.parent == loader.cache_root()
    assert kldiv_inline.load("cuda") is m


def test_kit_load_cuda_distill_builds_without_a_gpu():
    # CI has no GPU but compiles every CUDA source of the kit: the distillation kernels too.
    m = kldiv_inline.load("cuda", extension="distill")
    assert m.backend() == "cuda"
    assert hasattr(m, "distill_forward") and hasattr(m, "distill_phase")


def test_kit_load_cpu_is_the_cpu_module():
    m = kldiv_inline.load("cpu")
    assert m.backend() == "cpu"
    assert m.__name__.startswith("kldiv_cpu_")
    assert kldiv_inline.load("cpu") is not kldiv_inline.load("cuda")


def test_kernels_root_packaged_copy_then_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("KLDIV_INLINE_KERNELS", raising=False)
    assert loader.kernels_root() == REPO / "kernels"  # this checkout (no packaged copy beside the package)
    packaged = tmp_path / "_kernels"
    packaged.mkdir()
    monkeypatch.setattr(loader, "_PACKAGED_KERNELS", packaged)
    assert loader.kernels_root() == packaged  # an installed wheel
    monkeypatch.setattr(loader, "_PACKAGED_KERNELS", tmp_path / "absent")
    monkeypatch.setattr(loader, "_CHECKOUT", tmp_path / "not-a-checkout")
    with pytest.raises(FileNotFoundError) as info:
        loader.kernels_root()
    assert "KLDIV_INLINE_KERNELS" in str(info.value) and str(tmp_path / "absent") in str(info.value)
    monkeypatch.setenv("KLDIV_INLINE_KERNELS", str(tmp_path / "typo"))
    with pytest.raises(FileNotFoundError, match="KLDIV_INLINE_KERNELS"):
        loader.kernels_root()
    monkeypatch.setenv("KLDIV_INLINE_KERNELS", str(packaged))
    assert loader.kernels_root() == packaged


# ------------------------------------------------------------------------------------ 6. architectures
@pytest.mark.parametrize("env, archs", [("8.0;9.0+PTX", ["8.0", "9.0+PTX"]), (" 8.6 9.0 ", ["8.6", "9.0"])])
def test_cuda_arch_list_honours_env(monkeypatch, env, archs):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    assert loader.cuda_arch_list() == archs


def test_cuda_arch_list_without_env(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loader.cuda_arch_list() == [loader.DEFAULT_CUDA_ARCH] == ["9.0"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (8, 0), (9, 0)][i])
    assert loader.cuda_arch_list() == ["8.0", "9.0"]


def test_gencode_flags():
    assert loader._gencode_flags(["8.0", "9.0+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_arch_list_reaches_nvcc_and_the_cache_key(tmp_path, cache, monkeypatch):
    src = tmp_path / "arch"
    src.mkdir()
    (src / "scale.h").write_text("#define SCALE 7\n")
    (src / "k.cu").write_text(TINY_CU)
    (src / "bind.cpp").write_text(TINY_BIND)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    m = kldiv_inline.load_sources(tiny_cuda_sources(src))
    assert m.value() == 7
    ninja_file = (Path(m.__file__).parent / "build.ninja").read_text()
    assert sorted(set(re.findall(r"-gencode=\S+", ninja_file))) == sorted(loader._gencode_flags(["8.0", "9.0+PTX"]))

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    m90 = kldiv_inline.load_sources(tiny_cuda_sources(src))
    assert m90.__name__ != m.__name__  # other targets, other build
    ninja_file = (Path(m90.__file__).parent / "build.ninja").read_text()
    assert set(re.findall(r"-gencode=\S+", ninja_file)) == {"-gencode=arch=compute_90,code=sm_90"}


# --------------------------------------------------------------------------------------- 7. concurrency
def test_concurrent_builders_of_one_extension(tmp_path, cache):
    src = tmp_path / "together.cpp"
    src.write_text(capi_module("42"))
    go = tmp_path / "go"
    procs, readies = [], []
    for i in range(2):
        ready = tmp_path / f"ready{i}"
        readies.append(ready)
        procs.append(subprocess.Popen(child_cmd(tmp_path, [src]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=child_env(KL_TEST_READY=ready, KL_TEST_GO=go)))
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in readies):
            assert time.monotonic() < deadline, "children did not start"
            assert all(p.poll() is None for p in procs), "a child exited early"
            time.sleep(0.01)
        go.touch()  # both call load_sources now
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"child failed:\n{out}\n{err[-4000:]}"
    results = [child_result(out, err) for out, err in outs]
    assert [r["value"] for r in results] == [42, 42]
    # The lock serialised them: one built, the other found the finished build.
    assert sorted(r["builds"] for r in results) == [0, 1]
    assert len(build_dirs()) == 1


# _CHILD, its load's error printed as its result.
_CHILD_CATCHING = _CHILD.replace(
    "m = kldiv_inline.load_sources(sys.argv[1:])",
    "try:\n    m = kldiv_inline.load_sources(sys.argv[1:])\nexcept Exception as e:\n"
    "    print('RESULT ' + json.dumps({'error': f'{type(e).__name__}: {e}', 'builds': len(calls)}))\n"
    "    sys.exit(0)")


def test_processes_waiting_for_a_build_that_fails_get_its_error(tmp_path, cache):
    # Ranks started together (torchrun, srun) wait for one another's build of the same key; when it failed, each
    # built it again in turn, to the same error (about a minute a CUDA build, one rank after another).
    assert "except Exception" in _CHILD_CATCHING
    src = tmp_path / "broken.cpp"
    src.write_text(capi_module("missing_name"))
    real = shutil.which("c++")
    slow = tmp_path / "slow_cxx"  # a compile that lasts long enough for every child to be waiting for it
    slow.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) sleep 3;; esac\nexec {real} "$@"\n')
    slow.chmod(0o755)
    script = tmp_path / "child_catching.py"
    script.write_text(_CHILD_CATCHING)
    go = tmp_path / "go"
    procs, readies = [], []
    for i in range(3):
        ready = tmp_path / f"ready{i}"
        readies.append(ready)
        procs.append(subprocess.Popen([sys.executable, str(script), str(src)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env=child_env(KL_TEST_READY=ready, KL_TEST_GO=go, CXX=slow)))
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in readies):
            assert time.monotonic() < deadline, "children did not start"
            assert all(p.poll() is None for p in procs), "a child exited early"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [child_result(out, err) for out, err in outs]
    assert all("KernelBuildError" in r["error"] and "missing_name" in r["error"] for r in results), results
    assert sorted(r["builds"] for r in results) == [0, 0, 1], results
    # A process that starts after the failure builds again (its cause may be mended outside the key).
    later = subprocess.run([sys.executable, str(script), str(src)], capture_output=True, text=True, timeout=300,
                           env=child_env(CXX=slow))
    assert child_result(later.stdout, later.stderr)["builds"] == 1


def test_a_failure_of_the_moment_is_not_passed_to_waiting_processes(tmp_path):
    # A compiler killed (out of memory) or a full disk says nothing of the sources: the processes that waited for
    # that build build again rather than raise its error.
    killed = kldiv_inline.KernelBuildError("x_0123456789abcdef", ["c++: fatal error: Killed signal terminated "
                                                                  "program cc1plus"], "log")
    loader._record_failure(tmp_path, killed)
    assert not (tmp_path / loader._FAILED_MARK).exists()
    for line in ("/src/big.cpp:20000:40: fatal error: error writing to /tmp/ccX.s: No space left on device",
                 "/src/a.cpp:2:18: fatal error: error closing /tmp/ccX.s: No space left on device"):
        loader._record_failure(tmp_path, kldiv_inline.KernelBuildError("x_0123456789abcdef", [line], "log"))
        assert not (tmp_path / loader._FAILED_MARK).exists(), line
    for lines in (["/src/a.cpp:3:1: error: expected ';'", "virtual memory exhausted: Cannot allocate memory"],
                  ["/src/a.cpp:3:1: error: expected ';'", "/usr/bin/ld: final link failed: No space left on device"]):
        loader._record_failure(tmp_path, kldiv_inline.KernelBuildError("x_0123456789abcdef", lines, "log"))
        assert not (tmp_path / loader._FAILED_MARK).exists(), lines
    for line in ("ptxas fatal   : Memory allocation failure", "ptxas error   : out of memory",
                 "ptxas fatal   : Could not open output file '/scratch/tmpxft_000369b3_0000000a'",
                 "ptxas fatal   : Input file '/tmp/tmpxft_0001-6.ptx' could not be opened"):
        loader._record_failure(tmp_path, kldiv_inline.KernelBuildError("x_0123456789abcdef", [line], "log"))
        assert not (tmp_path / loader._FAILED_MARK).exists(), line
    # The sources' own, at a line or not (nvcc's front end at a file's end; ptxas on a kernel's resources or a
    # device function declared and never defined): the same sources fail the same way.
    for line in ("/src/a.cpp:3:7: error: 'x' was not declared in this scope", "/src/a.cu(12): error: identifier",
                 'At end of source: error: expected a "}"',
                 "ptxas error   : Entry function '_Z1kPf' uses too much shared data (0x3a980 bytes, 0xc000 max)",
                 "ptxas fatal   : Unresolved extern function '_Z1ff'"):
        loader._record_failure(tmp_path, kldiv_inline.KernelBuildError("x_0123456789abcdef", [line], "log"))
        assert (tmp_path / loader._FAILED_MARK).exists()
        (tmp_path / loader._FAILED_MARK).unlink()
    # A source line quoted under the error may hold the system's words: still the sources' own failure
    for lines in (['kldiv.cu(42): error: identifier "cudaMallocc" is undefined',
                   '    TORCH_CHECK(p != nullptr, "kldiv: out of memory");'],
                  ["/src/a.cpp:9:3: error: 'tile' was not declared in this scope",
                   "    9 |   tile(); // Out of memory guard"],
                  ["/src/x.cpp:3:20: error: expected ';' at end of declaration",  # (clang < 19: no gutter)
                   "int a = 1 // No space left on device"]):
        loader._record_failure(tmp_path, kldiv_inline.KernelBuildError("x_0123456789abcdef", lines, "log"))
        assert (tmp_path / loader._FAILED_MARK).exists(), lines
        (tmp_path / loader._FAILED_MARK).unlink()


# ------------------------------------------------------------------------------ 8. a killed build
def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _signal(pid: int, sig: int):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the builder's compiler processes")
def test_killed_build_does_not_block_the_next(tmp_path, cache):
    # pybind11 makes this build take seconds, long enough to kill it half way.
    src = tmp_path / "killed.cpp"
    src.write_text("#include <pybind11/pybind11.h>\nint v() { return 13; }\n"
                   "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"value\", &v); }\n")
    proc = subprocess.Popen(child_cmd(tmp_path, [src]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env())
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob("killed_*/build.ninja")):  # written just before ninja starts
            assert proc.poll() is None, f"the builder exited early:\n{proc.communicate()}"
            assert time.monotonic() < deadline, "the builder never started ninja"
            time.sleep(0.02)
        time.sleep(1.0)
        # Kill the builder and everything it started (ninja puts compilers in their own process groups, so
        # killing the group would leave them running): stop them all, top down, so none starts another, then
        # kill them.
        victims: list[int] = []
        while True:
            new = [pid for pid in [proc.pid, *_descendants(proc.pid)] if pid not in victims]
            if not new:
                break
            for pid in new:
                _signal(pid, signal.SIGSTOP)
            victims += new
        for pid in victims:
            _signal(pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    (build_dir,) = build_dirs()
    assert not (build_dir / loader._BUILD_MARK).exists(), "the build finished before it was killed"

    res = run_child(tmp_path, [src], timeout=180)  # a stale lock would hang here until the timeout
    assert res["value"] == 13
    assert res["builds"] == 1
    assert (build_dir / loader._BUILD_MARK).exists()


# ------------------------------------------------------------------------------------ 9. bad arguments
def test_unknown_backend_raises_value_error(no_compiler_runs):
    with pytest.raises(ValueError, match="metal"):
        kldiv_inline.load("metal")
    assert no_compiler_runs == []


def test_bad_sources_raise(tmp_path, cache, no_compiler_runs):
    with pytest.raises(ValueError):
        kldiv_inline.load_sources([])
    with pytest.raises(FileNotFoundError):
        kldiv_inline.load_sources([tmp_path / "missing.cpp"])
    (tmp_path / "x.h").write_text("")
    with pytest.raises(ValueError, match="#include"):
        kldiv_inline.load_sources([tmp_path / "x.h"])
    (tmp_path / "x.cu").write_text("")
    with pytest.raises(ValueError, match="cuda=False"):
        kldiv_inline.load_sources([tmp_path / "x.cu"], cuda=False)
    assert no_compiler_runs == []


# ------------------------------------------------------------------------- 10. damaged and read-only caches
def _so_of(build_dir: Path) -> Path:
    (so,) = [p for p in build_dir.iterdir() if p.suffix == ".so"]
    return so


def test_truncated_cached_so_is_rebuilt(tmp_path, cache):
    """A cut-short copy of the .so (disk full, interrupted copy) would kill the importing process with SIGBUS."""
    src = tmp_path / "truncated.cpp"
    src.write_text(capi_module("11"))
    first = run_child(tmp_path, [src])
    so = Path(first["file"])
    data = so.read_bytes()
    so.write_bytes(data[: len(data) // 2])
    second = run_child(tmp_path, [src])  # before the manifest check: the child died with SIGBUS
    assert second["value"] == 11 and second["builds"] == 1
    assert second["file"] == first["file"] and so.stat().st_size == len(data)


def test_corrupted_cached_so_of_same_size_is_rebuilt(tmp_path, cache):
    src = tmp_path / "flipped.cpp"
    src.write_text(capi_module("12"))
    first = run_child(tmp_path, [src])
    so = Path(first["file"])
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    second = run_child(tmp_path, [src])
    assert second["value"] == 12 and second["builds"] == 1
    assert so.read_bytes() != bytes(data)


def test_manifest_records_the_so(tmp_path, cache):
    src = tmp_path / "manifest.cpp"
    src.write_text(capi_module("1"))
    m = kldiv_inline.load_sources([src])
    so = Path(m.__file__)
    manifest = json.loads((so.parent / loader._BUILD_MARK).read_text())
    import hashlib
    assert manifest["so"] == so.name
    assert manifest["size"] == so.stat().st_size
    assert manifest["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert manifest["build_s"] > 0
    # ...and the compilers that built it, which env.json's "builds" names beside the numbers (the CPU twin's
    # speed follows its compiler): a C++ compiler's version line, no CUDA tools for a CPU build.
    assert set(manifest["toolchain"]) == {"cxx"} and manifest["toolchain"]["cxx"]
    assert manifest["toolchain"] == loader.toolchain(False)
    base = loader._module_base(src.stem)
    assert loader.loaded_builds()[base] == {"module": so.parent.name, "toolchain": manifest["toolchain"]}
    from kldiv_inline.envinfo import environment
    assert environment("cpu")["builds"][base]["toolchain"] == manifest["toolchain"]


def _refuse_writes_under(root: Path, monkeypatch: pytest.MonkeyPatch):
    """Make every write, create, rename and delete under ``root`` fail with EROFS, as on a read-only mount
    (the tests may run as root, which chmod does not stop)."""
    import builtins
    import errno
    import io

    root_s = os.path.abspath(root)

    def inside(p) -> bool:
        if isinstance(p, int):
            return False
        path = os.path.abspath(os.fsdecode(p))
        return path == root_s or path.startswith(root_s + os.sep)

    def erofs(p):
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(p))

    real_open, real_os_open = builtins.open, os.open

    def open_(file, mode="r", *a, **k):
        if inside(file) and any(c in mode for c in "wax+"):
            raise erofs(file)
        return real_open(file, mode, *a, **k)

    def os_open(path, flags, *a, **k):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
            raise erofs(path)
        return real_os_open(path, flags, *a, **k)

    def refusing(real):
        def f(path, *a, **k):
            if inside(path):
                raise erofs(path)
            return real(path, *a, **k)
        return f

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    for name in ("mkdir", "rename", "replace", "unlink", "remove", "rmdir", "utime", "chmod", "symlink", "link"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


def test_read_only_cache_hit_imports_without_writing(tmp_path, cache):
    src = tmp_path / "prebuilt.cpp"
    src.write_text(capi_module("21"))
    assert run_child(tmp_path, [src])["builds"] == 1  # built elsewhere: this process has not loaded it
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    with pytest.MonkeyPatch.context() as mp:
        _refuse_writes_under(cache, mp)
        assert kldiv_inline.load_sources([src]).value() == 21  # before: EROFS opening the lock file
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before


def test_read_only_cache_miss_says_what_to_do(tmp_path, cache, no_compiler_runs):
    cache.mkdir(parents=True)
    src = tmp_path / "never_built.cpp"
    src.write_text(capi_module("22"))
    with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError) as info:
        _refuse_writes_under(cache, mp)
        kldiv_inline.load_sources([src])
    msg = str(info.value)
    assert "read-only" in msg and str(cache) in msg and "KLDIV_INLINE_CACHE" in msg and "never_built" in msg, msg
    assert no_compiler_runs == []


def _read_only_mount_prefix(path: Path) -> list[str] | None:
    """A command prefix that runs its command with ``path`` bind-mounted read-only (a private mount
    namespace), or None where this machine does not allow it."""
    unshare = shutil.which("unshare")
    if not unshare or not Path("/proc/self/ns/mnt").exists():
        return None
    for flags in (["-m"], ["-r", "-m"]):  # root; else a user namespace
        script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
        prefix = [unshare, *flags, "sh", "-c", script, str(path)]
        probe = subprocess.run([*prefix, "sh", "-c", f'! touch "{path}/.probe" 2>/dev/null'], capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


def test_read_only_mounted_cache_hit_in_new_process(tmp_path, cache):
    src = tmp_path / "mounted.cpp"
    src.write_text(capi_module("23"))
    first = run_child(tmp_path, [src])
    prefix = _read_only_mount_prefix(cache)
    if prefix is None:
        pytest.skip("cannot bind-mount read-only here (unshare/mount not permitted)")
    proc = subprocess.run([*prefix, *child_cmd(tmp_path, [src])], env=child_env(), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    res = child_result(proc.stdout, proc.stderr)
    assert res["value"] == 23 and res["builds"] == 0 and res["file"] == first["file"]


# ------------------------------------------------------------------- 11. paths with spaces and non-ASCII
def test_paths_with_spaces_and_non_ascii(tmp_path, monkeypatch):
    root = tmp_path / "my kernels é $HOME"  # $: ninja's escape character, and the shell's
    inc = tmp_path / "inc dir ü"
    root.mkdir()
    inc.mkdir()
    monkeypatch.setenv("KLDIV_INLINE_CACHE", str(tmp_path / "cache dir ß"))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    (root / "base.h").write_text("#define BASE 3\n")  # beside the sources, #include "..."
    (inc / "scale.h").write_text("#define SCALE (BASE + 4)\n")  # through include_dirs, #include <...>
    (root / "k.cu").write_text('#include "base.h"\n#include <scale.h>\n'
                               "__global__ void k(int* p) { *p = SCALE; }\nint value() { return SCALE; }\n")
    (root / "bind.cpp").write_text(TINY_BIND)
    m = kldiv_inline.load_sources([root / "k.cu", root / "bind.cpp"], include_dirs=[inc])
    assert m.value() == 7
    assert Path(m.__file__).parent.parent == loader.cache_root()

    (root / "bad.cpp").write_text(_BAD_BODY.format(sig="int f()"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([root / "bad.cpp"])
    _assert_maps_to(info.value, f"{root / 'bad.cpp'}:7:")


def test_non_ascii_source_stem_and_name_give_an_importable_module(tmp_path, cache):
    # A module's init function is looked up under a punycode name when the module's name is not ASCII.
    src = tmp_path / "café.cpp"
    src.write_text(capi_module("1"))
    m = kldiv_inline.load_sources([src])
    assert m.value() == 1
    assert re.fullmatch(r"cafe_[0-9a-f]{16}", m.__name__), m.__name__
    named = kldiv_inline.load_sources([src], name="naïve 模块")
    assert named.value() == 1
    assert re.fullmatch(r"naive__[0-9a-f]{16}", named.__name__), named.__name__


# -------------------------------------------------------------------- 12. what the cache key covers
def test_editing_angle_included_header_from_include_dirs_rebuilds(tmp_path, cache):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "cfg.h").write_text("#include <deep.h>\n#define CFG (DEEP * 2)\n")
    (inc / "deep.h").write_text("#define DEEP 5\n")
    src = tmp_path / "angle.cpp"
    src.write_text(capi_module("CFG", prelude="#include <cfg.h>"))  # and <Python.h>: not in include_dirs
    m1 = kldiv_inline.load_sources([src], include_dirs=[inc])
    assert m1.value() == 10
    (inc / "deep.h").write_text("#define DEEP 6\n")  # two levels down, angle brackets both times
    m2 = kldiv_inline.load_sources([src], include_dirs=[inc])
    assert m2.__name__ != m1.__name__
    assert m2.value() == 12


_ANGLE, _QUOTE, _FORCED = "#include <flagged.h>", '#include "flagged.h"', ""  # how the source reaches it


@pytest.mark.parametrize("flags, prelude", [
    (lambda d: [f"-I{d}"], _ANGLE), (lambda d: ["-I", str(d)], _ANGLE), (lambda d: ["-isystem", str(d)], _ANGLE),
    (lambda d: ["-iquote", str(d)], _QUOTE), (lambda d: [f"-iquote{d}"], _QUOTE),
    (lambda d: ["-idirafter", str(d)], _ANGLE), (lambda d: [f"-idirafter{d}"], _ANGLE),
    (lambda d: ["-include", str(d / "flagged.h")], _FORCED), (lambda d: [f"-include{d / 'flagged.h'}"], _FORCED),
], ids=["-Idir", "-I dir", "-isystem dir", "-iquote dir", "-iquotedir", "-idirafter dir", "-idirafterdir",
        "-include file", "-includefile"])
def test_editing_header_found_through_include_flags_rebuilds(tmp_path, cache, flags, prelude):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "flagged.h").write_text("#define FLAGGED 2\n")
    src = tmp_path / "flagged.cpp"
    src.write_text(capi_module("FLAGGED", prelude=prelude))
    m1 = kldiv_inline.load_sources([src], extra_cflags=flags(inc))
    assert m1.value() == 2
    (inc / "flagged.h").write_text("#define FLAGGED 7\n")
    m2 = kldiv_inline.load_sources([src], extra_cflags=flags(inc))
    assert m2.__name__ != m1.__name__ and m2.value() == 7


def test_editing_the_header_the_compiler_uses_rebuilds_whatever_the_search_order(tmp_path, cache):
    # <answer.h> beside the source (the loader's -I) and in a folder of extra_cflags' -I, which comes first on the
    # command line: the compiler takes that one.
    inc = tmp_path / "inc"
    inc.mkdir()
    (tmp_path / "answer.h").write_text("#define ANSWER 100\n")
    (inc / "answer.h").write_text("#define ANSWER 1\n")
    src = tmp_path / "shadowed.cpp"
    src.write_text(capi_module("ANSWER", prelude="#include <answer.h>"))
    m1 = kldiv_inline.load_sources([src], extra_cflags=[f"-I{inc}"])
    assert m1.value() == 1
    (inc / "answer.h").write_text("#define ANSWER 2\n")
    m2 = kldiv_inline.load_sources([src], extra_cflags=[f"-I{inc}"])
    assert m2.__name__ != m1.__name__ and m2.value() == 2


def _key_of(monkeypatch, sources, **kwargs) -> str:
    """The extension name (its cache key) load_sources gives these sources, stopped before compiling."""
    def stop(*a, **k):
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(cpp_extension, "load_inline", stop)
    with pytest.raises(kldiv_inline.KernelBuildError, match="stopped before compiling") as info:
        kldiv_inline.load_sources(sources, **kwargs)
    return info.value.name


# nvcc's own spellings of -I, -isystem and -include (long names, "=", comma lists): a header edited there was
# served the old build.
@pytest.mark.parametrize("flags, prelude", [
    (lambda d: [f"--include-path={d}"], _ANGLE), (lambda d: ["--include-path", str(d)], _ANGLE),
    (lambda d: [f"-I/nonexistent,{d}"], _ANGLE), (lambda d: [f"--system-include={d}"], _ANGLE),
    (lambda d: ["--pre-include", str(d / "flagged.h")], _FORCED),
], ids=["--include-path=dir", "--include-path dir", "-Ia,dir", "--system-include=dir", "--pre-include file"])
def test_editing_header_found_through_nvcc_include_flags_changes_the_key(tmp_path, cache, monkeypatch, flags,
                                                                          prelude):
    _assert_an_edit_of_flagged_h_changes_the_key(tmp_path, monkeypatch, "flagged.cu", prelude,
                                                 extra_cuda_cflags=flags(tmp_path / "inc"))


def _assert_an_edit_of_flagged_h_changes_the_key(tmp_path, monkeypatch, source: str, prelude: str, **kwargs):
    """inc/flagged.h reached by ``prelude`` from tmp_path/``source``: the key is the same twice, and another once
    the header is edited."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "flagged.h").write_text("#define FLAGGED 2\n")
    src = tmp_path / source
    src.write_text(f"{prelude}\nint value() {{ return FLAGGED; }}\n")
    before = _key_of(monkeypatch, [src], **kwargs)
    assert _key_of(monkeypatch, [src], **kwargs) == before
    (inc / "flagged.h").write_text("#define FLAGGED 7\n")
    assert _key_of(monkeypatch, [src], **kwargs) != before


# Legal spellings of an include the key missed (an edit to the header was a cache hit on the old build).
@pytest.mark.parametrize("prelude", ['#include /* why */ "flagged.h"', '%:include "flagged.h"',
                                     '#include_next <flagged.h>', '/* first */ # /* then */ include <flagged.h>'])
def test_editing_a_header_included_in_another_spelling_changes_the_key(tmp_path, cache, monkeypatch, prelude):
    _assert_an_edit_of_flagged_h_changes_the_key(tmp_path, monkeypatch, "flagged.cpp", prelude,
                                                 include_dirs=[tmp_path / "inc"])


def test_a_response_file_in_the_flags_is_part_of_the_key(tmp_path, cache, monkeypatch):
    # extra_cflags=["@flags.rsp"] (gcc reads its arguments from the file): only the flag's text was in the key, so
    # an edited file was a cache hit on the old build; a header found through an -I it names was not followed.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inner.rsp").write_text("-DVAL=3\n")
    (tmp_path / "flags.rsp").write_text("-Iinc @inner.rsp\n")
    _assert_an_edit_of_flagged_h_changes_the_key(tmp_path, monkeypatch, "flagged.cpp", "#include <flagged.h>",
                                                 extra_cflags=["@flags.rsp"])
    src = [tmp_path / "flagged.cpp"]
    before = _key_of(monkeypatch, src, extra_cflags=["@flags.rsp"])
    (tmp_path / "inner.rsp").write_text("-DVAL=4\n")
    assert _key_of(monkeypatch, src, extra_cflags=["@flags.rsp"]) != before
    assert loader._expand_response_files(["@flags.rsp", "@missing.rsp"]) == ["-Iinc", "-DVAL=4", "@missing.rsp"]
    (tmp_path / "inner.rsp").write_text("@flags.rsp\n")  # (one that names itself)
    with pytest.raises(ValueError, match="nested more than 10 deep"):
        loader._expand_response_files(["@flags.rsp"])


def test_a_hit_needs_no_compiler(tmp_path, cache, monkeypatch):
    # A cache built once serves a machine without compilers (a runtime image, a read-only mount): nothing about the
    # compilers but CC / CXX's values is in the key, so none is run or looked for on a hit.
    src = tmp_path / "hit.cpp"
    src.write_text(capi_module("5"))
    built = kldiv_inline.load_sources([src])
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert kldiv_inline.load_sources([src]) is built


@pytest.mark.parametrize("variable, value", [
    ("NVCC_APPEND_FLAGS", "-DTAG=2"), ("NVCC_PREPEND_FLAGS", "-DTAG=2"), ("NVCC_CCBIN", "/opt/other/g++"),
    ("PYTORCH_NVCC", "ccache nvcc"), ("CUDA_INC_PATH", "/opt/other/include")])
def test_variables_that_set_nvccs_flags_change_the_key(tmp_path, cache, monkeypatch, variable, value):
    # nvcc reads NVCC_APPEND_FLAGS / NVCC_PREPEND_FLAGS / NVCC_CCBIN itself, torch PYTORCH_NVCC and CUDA_INC_PATH:
    # none of them was in the key, so a build made with other flags was loaded.
    for v in loader._CUDA_BUILD_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    src = tmp_path / "keyed.cu"
    src.write_text("__global__ void k() {}\n")
    before = _key_of(monkeypatch, [src])
    monkeypatch.setenv(variable, value)
    assert _key_of(monkeypatch, [src]) != before


def test_march_native_for_nvccs_host_compiler_keys_the_cpu(tmp_path, cache, monkeypatch):
    # -march=native through nvcc (-Xcompiler) builds host code for this CPU as extra_cflags' does, but only the
    # latter put the CPU in the key: a cache shared by two CPUs could load code the other's cannot run.
    src = tmp_path / "native.cu"
    src.write_text("__global__ void k() {}\n")
    keys = []
    for cpu in ("cpu A", "cpu B"):
        monkeypatch.setattr(loader, "_cpu_fingerprint", lambda cpu=cpu: cpu)
        keys.append(_key_of(monkeypatch, [src], extra_cuda_cflags=["-Xcompiler=-march=native"]))
    assert keys[0] != keys[1]


@pytest.mark.parametrize("variable", ["CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"])
def test_editing_header_found_through_the_compilers_search_variables_changes_the_key(tmp_path, cache, monkeypatch,
                                                                                    variable):
    # A header the compiler found through CPATH (or C/CPLUS_INCLUDE_PATH) was not in the key: an edit of it was a
    # cache hit, the old module served.
    monkeypatch.setenv(variable, f"/nonexistent{os.pathsep}{tmp_path / 'inc'}")
    _assert_an_edit_of_flagged_h_changes_the_key(tmp_path, monkeypatch, "flagged.cpp", _QUOTE)


@pytest.mark.parametrize("suffix", [".cpp", ".cu"])
@pytest.mark.parametrize("shadow", ["another source's folder", "include_dirs", "-I"])
def test_a_quoted_include_that_another_folder_shadows_is_refused(tmp_path, cache, monkeypatch, suffix, shadow):
    # load_inline joins a language's sources into one file in its build folder, so a source's #include "cfg.h"
    # is looked for in the include folders (the flags', include_dirs, the sources' folders in order) before its
    # own: two folders' sources each including their own cfg.h both compiled the first folder's, silently.
    monkeypatch.setattr(cpp_extension, "load_inline", lambda *a, **k: pytest.fail("compiled a shadowed include"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / f"first{suffix}").write_text('#include "cfg.h"\nint first() { return CFG; }\n')
    (a / "cfg.h").write_text("#define CFG 1\n")
    (b / f"second{suffix}").write_text('#include "cfg.h"\nint second() { return CFG; }\n')
    (b / "cfg.h").write_text("#define CFG 2\n")
    flag = "extra_cuda_cflags" if suffix == ".cu" else "extra_cflags"
    if shadow == "another source's folder":
        sources, kwargs, shadowed, taken = [a / f"first{suffix}", b / f"second{suffix}"], {}, b, a
    elif shadow == "include_dirs":
        sources, kwargs, shadowed, taken = [b / f"second{suffix}"], {"include_dirs": [a]}, b, a
    else:
        sources, kwargs, shadowed, taken = [b / f"second{suffix}"], {flag: [f"-I{a}"]}, b, a
    with pytest.raises(ValueError, match="distinct names") as info:
        kldiv_inline.load_sources(sources, **kwargs)
    assert str(shadowed / "cfg.h") in str(info.value) and str(taken / "cfg.h") in str(info.value)
    # A copy of the same text is refused too: its own quoted includes are found beside it (a cfg.h that includes
    # "inner.h", different in each folder, compiled the first folder's inner.h)
    (b / "cfg.h").write_text("#define CFG 1\n")
    with pytest.raises(ValueError, match="distinct names"):
        kldiv_inline.load_sources(sources, **kwargs)


def test_a_sources_folder_also_named_a_system_folder_is_searched_after_every_other(tmp_path, cache, monkeypatch):
    # -isystem (or -idirafter, CPLUS_INCLUDE_PATH) naming a folder the loader passes as -I makes the compiler drop
    # that -I: the folder is searched after all the others, so its source's "cfg.h" was the next folder's.
    monkeypatch.setattr(cpp_extension, "load_inline", lambda *a, **k: pytest.fail("compiled a shadowed include"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "first.cpp").write_text('#include "cfg.h"\nint first() { return CFG; }\n')
    (a / "cfg.h").write_text("#define CFG 1\n")
    (b / "second.cpp").write_text("int second() { return 2; }\n")
    (b / "cfg.h").write_text("#define CFG 2\n")
    with pytest.raises(ValueError, match="distinct names"):
        kldiv_inline.load_sources([a / "first.cpp", b / "second.cpp"], extra_cflags=[f"-isystem{a}"])
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(a))
    with pytest.raises(ValueError, match="distinct names"):
        kldiv_inline.load_sources([a / "first.cpp", b / "second.cpp"])


def test_a_quoted_include_behind_the_sources_folder_is_not_refused(tmp_path, cache, monkeypatch):
    # -isystem folders (and -idirafter, CPATH's) are searched after every -I, the sources' folders among them:
    # the header beside the source is the one compiled, so a same-named one there is no reason to refuse.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "second.cpp").write_text('#include "cfg.h"\nint second() { return CFG; }\n')
    (b / "cfg.h").write_text("#define CFG 2\n")
    (a / "cfg.h").write_text("#define CFG 1\n")
    assert _key_of(monkeypatch, [b / "second.cpp"], extra_cflags=[f"-isystem{a}", f"-idirafter{a}"])


def test_the_sources_order_is_part_of_the_key(tmp_path, cache):
    # One translation unit in the order given: a macro the first file defines reaches the second. The other
    # order was served the first order's build.
    (tmp_path / "a.cpp").write_text("#define KL_SCALE 2\n")
    (tmp_path / "b.cpp").write_text(capi_module("KL_SCALE", prelude="#ifndef KL_SCALE\n#define KL_SCALE 3\n#endif"))
    first = kldiv_inline.load_sources([tmp_path / "a.cpp", tmp_path / "b.cpp"], name="ordered")
    assert first.value() == 2
    second = kldiv_inline.load_sources([tmp_path / "b.cpp", tmp_path / "a.cpp"], name="ordered")
    assert second.__name__ != first.__name__ and second.value() == 3


@pytest.mark.parametrize("how", ["path", "-L -l"])
def test_rebuilding_a_library_the_link_flags_name_relinks(tmp_path, cache, how):
    lib = tmp_path / "lib"
    lib.mkdir()
    src = tmp_path / "use.cpp"
    src.write_text(capi_module("helper_value()", prelude="long helper_value();"))
    ldflags = [str(lib / "libhelper.a")] if how == "path" else [f"-L{lib}", "-lhelper"]

    def library_returning(value: int):
        (lib / "helper.cpp").write_text(f"long helper_value() {{ return {value}; }}\n")
        subprocess.run(["g++", "-O1", "-fPIC", "-c", str(lib / "helper.cpp"), "-o", str(lib / "helper.o")],
                       check=True)
        (lib / "libhelper.a").unlink(missing_ok=True)
        subprocess.run(["ar", "rcs", str(lib / "libhelper.a"), str(lib / "helper.o")], check=True)
        return kldiv_inline.load_sources([src], extra_ldflags=ldflags)

    assert library_returning(1).value() == 1
    assert library_returning(2).value() == 2


_CHILD_LINKING = r"""
import json, sys
from torch.utils import cpp_extension
import kldiv_inline

calls = []
_real = cpp_extension.load_inline
cpp_extension.load_inline = lambda *a, **k: (calls.append(k.get("name")), _real(*a, **k))[1]
try:
    value = kldiv_inline.load_sources([sys.argv[1]], extra_ldflags=[f"-L{sys.argv[2]}", "-lkltestfoo"]).value()
    print("RESULT " + json.dumps({"value": value, "builds": len(calls)}))
except Exception as e:
    print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}", "builds": len(calls)}))
"""


def test_a_whole_build_that_does_not_load_here_is_kept(tmp_path, cache):
    # A library the module links, found by the dynamic loader only through LD_LIBRARY_PATH: a process without it
    # took the complete entry for a stale one, deleted it, built it again, failed the same way (a bare ImportError)
    # and left no manifest, so the next process, with the variable, built it a third time.
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "foo.c").write_text("int foo_value(void) { return 7; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "libkltestfoo.so"), str(lib / "foo.c")], check=True)
    src = tmp_path / "uselib.cpp"
    src.write_text(capi_module("foo_value()", prelude='extern "C" int foo_value(void);'))
    script = tmp_path / "child_linking.py"
    script.write_text(_CHILD_LINKING)

    def run(**env):
        base = child_env(**env)
        if "LD_LIBRARY_PATH" not in env:
            base.pop("LD_LIBRARY_PATH", None)
        proc = subprocess.run([sys.executable, str(script), str(src), str(lib)], env=base, capture_output=True,
                              text=True, timeout=180)
        return child_result(proc.stdout, proc.stderr)

    assert run(LD_LIBRARY_PATH=lib) == {"value": 7, "builds": 1}
    (entry,) = build_dirs()
    without = run()
    assert without["builds"] == 0, without
    assert "KernelBuildError" in without["error"] and "libkltestfoo.so" in without["error"], without
    assert "LD_LIBRARY_PATH" in without["error"] and "rpath" in without["error"], without
    assert (entry / loader._BUILD_MARK).is_file()  # kept whole
    assert run(LD_LIBRARY_PATH=lib) == {"value": 7, "builds": 0}


def test_a_class_bound_again_is_not_built_again(tmp_path, cache, monkeypatch):
    # pybind11 registers a class once per process: an edited module binding the same class was built, did not load
    # (restart), and every retry in the same process built it again before saying so (its entry whole since the
    # first).
    src = tmp_path / "counter.cpp"
    body = ("#include <pybind11/pybind11.h>\nstruct Counter {{ int v() {{ return {v}; }} }};\n"
            "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n"
            "  pybind11::class_<Counter>(m, \"Counter\").def(pybind11::init<>()).def(\"v\", &Counter::v);\n}}\n")
    src.write_text(body.format(v=1))
    assert kldiv_inline.load_sources([src]).Counter().v() == 1
    src.write_text(body.format(v=2))
    with pytest.raises(kldiv_inline.KernelBuildError, match="restart"):
        kldiv_inline.load_sources([src])
    builds = []
    real = cpp_extension.load_inline
    monkeypatch.setattr(cpp_extension, "load_inline", lambda *a, **k: (builds.append(k["name"]), real(*a, **k))[1])
    with pytest.raises(kldiv_inline.KernelBuildError, match="restart"):
        kldiv_inline.load_sources([src])
    assert builds == []


def test_a_source_that_is_not_utf8_names_its_file_and_line(tmp_path, cache, no_compiler_runs):
    src = tmp_path / "latin1.cpp"
    src.write_bytes(capi_module("1").encode() + b"// 90\xb0 in Latin-1\n")
    with pytest.raises(ValueError, match=re.escape(f"{src}:11: byte 0xb0 is not UTF-8")):
        kldiv_inline.load_sources([src])
    assert no_compiler_runs == []
    # A form feed (a page break, which old sources have) is no line break to the compiler: the line stays 11.
    src.write_bytes(capi_module("1").encode().replace(b"\n", b"\n\f", 1) + b"// 90\xb0 in Latin-1\n")
    with pytest.raises(ValueError, match=re.escape(f"{src}:11: byte 0xb0 is not UTF-8")):
        kldiv_inline.load_sources([src])
    # A lone \r (an old Mac file) is a line break to the compiler, and \r\n is one.
    for end in (b"\r", b"\r\n"):
        src.write_bytes(capi_module("1").encode().replace(b"\n", end) + b"// 90\xb0 in Latin-1" + end)
        with pytest.raises(ValueError, match=re.escape(f"{src}:11: byte 0xb0 is not UTF-8")):
            kldiv_inline.load_sources([src])


def test_sources_without_a_python_module_say_so(tmp_path, cache):
    src = tmp_path / "plain.cpp"
    src.write_text("int twice(int x) { return 2 * x; }\n")
    with pytest.raises(kldiv_inline.KernelBuildError, match=r"PYBIND11_MODULE.*functions="):
        kldiv_inline.load_sources([src])


def test_a_link_error_shows_the_linkers_own_line(tmp_path, cache):
    src = tmp_path / "linked.cpp"
    src.write_text(capi_module("1"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src], extra_ldflags=["-lkldiv_no_such_library"])
    assert any("kldiv_no_such_library" in e and "-l" in e for e in info.value.errors), info.value.errors
    assert "kldiv_no_such_library" in str(info.value)
    assert not any(e.startswith("ninja:") for e in info.value.errors), info.value.errors


@pytest.fixture
def fake_cpuinfo(tmp_path, monkeypatch):
    """Writes the /proc/cpuinfo the loader reads next (its fingerprint is cached: cleared around the test, so no
    other test sees a made-up CPU)."""
    fake = tmp_path / "cpuinfo"
    real_path = loader.Path
    monkeypatch.setattr(loader, "Path", lambda *a: fake if a == ("/proc/cpuinfo",) else real_path(*a))

    def write(text: str):
        fake.write_text(text)
        loader._cpu_fingerprint.cache_clear()

    loader._cpu_fingerprint.cache_clear()
    yield write
    loader._cpu_fingerprint.cache_clear()


def test_march_native_builds_are_keyed_on_the_cpus_instruction_sets(tmp_path, cache, monkeypatch, fake_cpuinfo):
    # One model name, two sets of extensions (a VM that hides AVX-512): -march=native code of one may not run on
    # the other.
    def stop(*a, **k):
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(cpp_extension, "load_inline", stop)
    src = tmp_path / "native.cpp"
    src.write_text(capi_module("1"))

    def name_on(flags: str) -> str:
        fake_cpuinfo(f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                     f"flags\t\t: {flags}\n\nprocessor\t: 1\n")
        with pytest.raises(kldiv_inline.KernelBuildError, match="stopped before compiling") as info:
            kldiv_inline.load_sources([src], extra_cflags=["-march=native"])
        return info.value.name

    avx2 = name_on("fpu sse2 avx2")
    assert name_on("fpu sse2 avx2 avx512f") != avx2
    assert name_on("fpu sse2 avx2") == avx2


# ------------------------------------------------------------------ 13. bindings and link errors
def test_functions_without_torch_extension_h_says_to_include_it(tmp_path, cache, no_compiler_runs):
    src = tmp_path / "plain.cpp"
    src.write_text("int twice(int x) { return 2 * x; }\n")
    with pytest.raises(ValueError, match=r"torch/extension\.h") as info:
        kldiv_inline.load_sources([src], functions=["twice"])
    assert str(src) in str(info.value)
    assert no_compiler_runs == []


def test_functions_with_torch_extension_h_in_an_included_header_pass_the_check(tmp_path, cache, monkeypatch):
    reached = []

    def stop(*a, **k):
        reached.append(k["functions"])
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(cpp_extension, "load_inline", stop)
    (tmp_path / "common.h").write_text("#pragma once\n#include <torch/extension.h>\n")
    src = tmp_path / "bound.cpp"
    src.write_text('#include "common.h"\nint twice(int x) { return 2 * x; }\n')
    with pytest.raises(kldiv_inline.KernelBuildError, match="stopped before compiling"):
        kldiv_inline.load_sources([src], functions=["twice"])
    assert reached == [["twice"]]
    # The header in a folder the flags name, or forced in by them: the compiler finds it, so must the check.
    (tmp_path / "flagged").mkdir()
    (tmp_path / "flagged" / "ext.h").write_text("#pragma once\n#include <torch/extension.h>\n")
    (tmp_path / "by_flag.cpp").write_text('#include "ext.h"\nint twice(int x) { return 2 * x; }\n')
    (tmp_path / "forced.cpp").write_text("int twice(int x) { return 2 * x; }\n")
    for source, flags in (("by_flag.cpp", [f"-I{tmp_path / 'flagged'}"]),
                          ("forced.cpp", ["-include", str(tmp_path / "flagged" / "ext.h")])):
        with pytest.raises(kldiv_inline.KernelBuildError, match="stopped before compiling"):
            kldiv_inline.load_sources([tmp_path / source], functions=["twice"], extra_cflags=flags)
    assert len(reached) == 3


def test_undefined_symbol_at_import_is_a_build_error(tmp_path, cache):
    src = tmp_path / "undefined.cpp"
    src.write_text(capi_module("missing_helper(3)", prelude="int missing_helper(int);"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src])
    msg = str(info.value)
    assert "missing_helper(int)" in msg and "not defined" in msg, msg
    assert any("missing_helper(int)" in e for e in info.value.errors)
    assert not (build_dirs()[0] / loader._BUILD_MARK).exists()  # not a cache hit next time


# ----------------------------------------------------------------------- 14. announcing cold builds
def _announcements(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kldiv_inline:")]


def test_cold_build_says_so_once_and_hits_are_silent(tmp_path, cache, capfd):
    src = tmp_path / "announced.cpp"
    src.write_text(capi_module("5"))
    m = kldiv_inline.load_sources([src])
    lines = _announcements(capfd.readouterr().err)
    assert len(lines) == 2, lines
    assert re.fullmatch(rf"kldiv_inline: building {m.__name__} \(first use of these sources, ~\d+ s\)\.\.\.",
                        lines[0]), lines
    assert re.fullmatch(rf"kldiv_inline: built {m.__name__} in \d+\.\d s", lines[1]), lines
    built_s = json.loads((Path(m.__file__).parent / loader._BUILD_MARK).read_text())["build_s"]

    assert kldiv_inline.load_sources([src]) is m
    proc = subprocess.run(child_cmd(tmp_path, [src]), env=child_env(), capture_output=True, text=True, timeout=180)
    assert child_result(proc.stdout, proc.stderr)["builds"] == 0
    assert _announcements(capfd.readouterr().err + proc.stderr) == []

    # An edit: the estimate is the last build's time of the same extension.
    src.write_text(capi_module("6"))
    kldiv_inline.load_sources([src])
    lines = _announcements(capfd.readouterr().err)
    assert f"~{max(1, round(built_s))} s)" in lines[0], lines


def test_build_announcements_can_be_silenced(tmp_path, cache, capfd):
    import logging
    src = tmp_path / "quiet.cpp"
    src.write_text(capi_module("5"))
    log = logging.getLogger("kldiv_inline")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        kldiv_inline.load_sources([src])
    finally:
        log.setLevel(level)
    assert _announcements(capfd.readouterr().err) == []


# ------------------------------------------------------------------------------- 15. CUDA_HOME
@pytest.mark.parametrize("var", ["CUDA_HOME", "CUDA_PATH"])
def test_cuda_home_without_nvcc_raises(tmp_path, cache, monkeypatch, no_compiler_runs, var):
    for v in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.setenv(v, "")
        monkeypatch.delenv(v)
    nowhere = tmp_path / "nowhere"
    monkeypatch.setenv(var, str(nowhere))
    src = tmp_path / "needs_toolkit.cu"
    src.write_text("__global__ void k() {}\n")
    with pytest.raises(kldiv_inline.ToolchainError) as info:
        kldiv_inline.load_sources([src])
    msg = str(info.value)
    assert f"{var}={nowhere}" in msg and "bin/nvcc" in msg, msg
    assert no_compiler_runs == []
    assert build_dirs() == []


# ---------------------------------------------------------------------------- 16. TORCH_CUDA_ARCH_LIST
@pytest.mark.parametrize("env, archs", [
    ("Hopper", ["9.0+PTX"]),
    ("Ampere", ["8.0", "8.6+PTX"]),
    ("Ada 9.0a", ["8.9+PTX", "9.0a"]),
    ("Blackwell+Tegra;Hopper", ["11.0", "9.0+PTX"]),
    ("8.0;8.0;9.0", ["8.0", "9.0"]),
])
def test_cuda_arch_list_maps_names_as_torch_does(monkeypatch, env, archs):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    assert loader.cuda_arch_list() == archs


def test_cuda_arch_list_native_is_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "native")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loader.cuda_arch_list() == [loader.DEFAULT_CUDA_ARCH]


@pytest.mark.parametrize("env, bad, hint", [
    ("sm_90", "sm_90", "9.0"),
    ("9,0", "9,0", "9.0"),
    ("8.0;compute_90", "compute_90", "9.0"),
    ("Hopper+PTX", "Hopper+PTX", "Hopper"),
    ("hopper", "hopper", "Hopper"),
    ("90", "90", "9.0"),
])
def test_bad_cuda_arch_list_is_rejected_before_compiling(tmp_path, cache, monkeypatch, no_compiler_runs, env, bad,
                                                         hint):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    src = tmp_path / "arch.cu"
    src.write_text("__global__ void k() {}\n")
    with pytest.raises(ValueError) as info:
        kldiv_inline.load_sources([src])
    msg = str(info.value)
    assert "TORCH_CUDA_ARCH_LIST" in msg and repr(bad) in msg and f"{hint!r}" in msg, msg
    assert "Hopper" in msg and "+PTX" in msg  # the accepted forms
    assert no_compiler_runs == []


def test_cuda_arch_that_nvcc_cannot_target_is_rejected_before_compiling(tmp_path, cache, monkeypatch,
                                                                        no_compiler_runs):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "3.5;9.0")  # 3.5 (Kepler) left nvcc in CUDA 12
    src = tmp_path / "old_arch.cu"
    src.write_text("__global__ void k() {}\n")
    with pytest.raises(kldiv_inline.ToolchainError) as info:
        kldiv_inline.load_sources([src])
    msg = str(info.value)
    assert "'3.5'" in msg and "9.0" in msg and "nvcc" in msg, msg
    assert no_compiler_runs == []


# ------------------------------------------------------------------ 16. a researcher's loop, its rough edges
def test_sources_in_two_folders_build_alike_in_every_process(tmp_path, cache):
    # The sources' folders were added to the search as a set, whose order follows Python's string hashes, seeded
    # per process: the cache key changed between processes (a rebuild), and so did which of two cfg.h a quoted
    # #include found (1 or 2).
    for d, v in (("d1", 1), ("d2", 2)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "cfg.h").write_text(f"#define CFG {v}\n")
    (tmp_path / "d1" / "one.cpp").write_text(capi_module("CFG", prelude='#include "cfg.h"'))
    (tmp_path / "d2" / "two.cpp").write_text("int two_helper() { return 2; }\n")
    sources = [tmp_path / "d1" / "one.cpp", tmp_path / "d2" / "two.cpp"]
    seen = [run_child(tmp_path, sources, PYTHONHASHSEED=seed) for seed in (0, 1, 2, 3)]
    assert {r["value"] for r in seen} == {1} and len({r["file"] for r in seen}) == 1, seen
    assert [r["builds"] for r in seen] == [1, 0, 0, 0]


def test_a_build_cut_short_is_built_again_by_the_next_call(tmp_path, cache, monkeypatch):
    # Ctrl-C in a notebook (or a full disk) mid-build: torch's versioner kept the sources as built, so the next
    # call skipped the build and imported the .so the loader had just removed (an ImportError).
    src = tmp_path / "cut.cpp"
    src.write_text(capi_module("11"))
    real = cpp_extension._write_ninja_file_and_build_library

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kldiv_inline.load_sources([src])
    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", real)
    assert kldiv_inline.load_sources([src]).value() == 11


def test_sources_flags_and_folders_given_alone_or_twice(tmp_path, cache, no_compiler_runs):
    # A str where a list is expected was iterated letter by letter ("kernel source not found: /…/o"); a source
    # listed twice failed with redefinitions and no word on why.
    src = tmp_path / "alone.cpp"
    src.write_text(capi_module("1"))
    with pytest.raises(ValueError, match="a source given twice"):
        kldiv_inline.load_sources([src, tmp_path / ".." / tmp_path.name / "alone.cpp"])
    assert no_compiler_runs == []


def test_a_str_path_and_flags_relative_to_the_working_directory(tmp_path, cache, monkeypatch):
    # One path as a str; -I and -include folders and files relative to the working directory, which the key read
    # but the compiler (run in the build folder) did not find; a file with a UTF-8 byte-order mark (a stray
    # character behind the loader's #line); a header with one, whose first-line #include the key missed.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "inner.h").write_text("#define INNER 20\n")
    (tmp_path / "inc" / "outer.h").write_text('\ufeff#include "inner.h"\n#define OUTER (INNER + 1)\n')
    (tmp_path / "forced.h").write_text("#define FORCED 100\n")
    (tmp_path / "rel.cpp").write_text("\ufeff" + capi_module("OUTER + FORCED", prelude='#include "outer.h"'))
    m = kldiv_inline.load_sources("rel.cpp", extra_cflags=["-Iinc", "-include", "forced.h"])
    assert m.value() == 121
    (tmp_path / "inc" / "inner.h").write_text("#define INNER 30\n")
    assert kldiv_inline.load_sources("rel.cpp", extra_cflags=["-Iinc", "-include", "forced.h"]).value() == 131


def test_a_quoted_folder_with_a_space_is_followed(tmp_path, cache):
    # The flags go through the shell: "-I'/a b'" is one folder, whose headers the key now follows (it looked for a
    # folder named with the quotes, and an edit there left the old module).
    inc = tmp_path / "inc dir"
    inc.mkdir()
    (inc / "sp.h").write_text("#define SP 1\n")
    (tmp_path / "sp.cpp").write_text(capi_module("SP", prelude='#include "sp.h"'))
    flags = [f"-I{shlex.quote(str(inc))}"]
    assert kldiv_inline.load_sources([tmp_path / "sp.cpp"], extra_cflags=flags).value() == 1
    (inc / "sp.h").write_text("#define SP 2\n")
    assert kldiv_inline.load_sources([tmp_path / "sp.cpp"], extra_cflags=flags).value() == 2


def test_errors_are_the_compilers_errors_not_warnings_or_quoted_source(tmp_path, cache):
    src = tmp_path / "warn.cpp"
    src.write_text(capi_module("check(1)", prelude='#warning "error paths untested"\n'
                                                   "static int check(int error) { return error + missing_name; }"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src])
    errors = info.value.errors
    assert any("missing_name" in e and "error" in e for e in errors), errors
    assert not any("warning" in e for e in errors) and not any(re.match(r"\s*\d+\s*\|", e) for e in errors), errors


def test_verbose_build_errors_keep_their_file_and_line(tmp_path, cache, capfd):
    # verbose=True: torch streams the compiler's output and kept none of it for the error (errors == []).
    src = tmp_path / "verr.cpp"
    src.write_text(capi_module("missing_name"))
    with pytest.raises(kldiv_inline.KernelBuildError) as info:
        kldiv_inline.load_sources([src], verbose=True)
    assert any(f"{src}:" in e and "missing_name" in e for e in info.value.errors), info.value.errors


def test_a_class_bound_again_in_one_process_says_to_restart():
    # pybind11 registers a bound class once per process: an edited extension that binds the same class does not
    # load beside the earlier build (a raw ImportError before).
    err = ImportError('generic_type: type "Counter" is already registered!')
    failure = loader._load_failure("counter_0123456789abcdef", err)
    assert isinstance(failure, kldiv_inline.KernelBuildError)
    assert "restart" in str(failure) and "py::module_local()" in str(failure)


def test_flag_spellings_that_are_not_relative_paths(tmp_path, cache, monkeypatch):
    # "-I=dir" (gcc: under the sysroot, here "/"; nvcc: "-I dir") was made "<cwd>/=dir"; a relative folder inside a
    # flag of several shell words cannot be rewritten, and is refused rather than missed by the compiler.
    monkeypatch.chdir(tmp_path)
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "eq.h").write_text("#define EQ 3\n")
    (tmp_path / "eq.cpp").write_text(capi_module("EQ", prelude='#include "eq.h"'))
    assert kldiv_inline.load_sources([tmp_path / "eq.cpp"], extra_cflags=["--sysroot=/", f"-I={inc}"]).value() == 3
    for flags in (["-I inc"], ["-Iinc -Wall"], ["-I'inc'"]):
        with pytest.raises(ValueError, match="relative path 'inc' inside quotes or several shell words"):
            kldiv_inline.load_sources([tmp_path / "eq.cpp"], extra_cflags=flags)
    options = loader._SEARCH_DIR_FLAGS + loader._FORCED_INCLUDE_FLAGS
    assert loader._absolute_flags(["-gencode=arch=compute_90,code=sm_90", "-Xcompiler", "-fopenmp", "-DNAME=v",
                                   "-I-"], options, nvcc=True) == \
        ["-gencode=arch=compute_90,code=sm_90", "-Xcompiler", "-fopenmp", "-DNAME=v", "-I-"]
    # nvcc's -I=dir is -I dir, read in the build folder: made absolute (gcc's, under the sysroot, is not).
    assert loader._absolute_flags(["-I=inc"], options, nvcc=True) == [f"-I={inc}"]
    assert loader._absolute_flags(["-I=inc"], options) == ["-I=inc"]
    # A forced include spelled -include=name stays as given unless it is a file here (a search folder may hold it).
    nvcc_options = options + tuple(loader._NVCC_LONG_FLAGS)
    assert loader._absolute_flags(["-include=eq.h", "--pre-include=eq.h"], nvcc_options, nvcc=True) == \
        ["-include=eq.h", "--pre-include=eq.h"]
    # An absolute folder inside a host-compiler option string is no relative path ("-I /usr/..." was read
    # as the path " /usr/...").
    for flag in ("-Xcompiler '-I /usr/include'", "--compiler-options '-isystem /usr/include'"):
        assert loader._absolute_flags([flag], options, nvcc=True) == [flag]


def test_a_compiler_message_that_is_not_utf8_is_a_build_error(tmp_path, cache):
    # gcc echoes a header's Latin-1 byte on an error's line: torch's decode of its output raised UnicodeDecodeError.
    (tmp_path / "latin.h").write_bytes(b"static int caf\xe9 = missing_name; // caf\xe9\n")
    (tmp_path / "latin.cpp").write_text(capi_module("1", prelude='#include "latin.h"'))
    for verbose in (False, True):
        with pytest.raises(kldiv_inline.KernelBuildError) as info:
            kldiv_inline.load_sources([tmp_path / "latin.cpp"], verbose=verbose)
        assert any("missing_name" in e for e in info.value.errors), info.value.errors
