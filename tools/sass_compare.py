"""Compares the machine code (SASS, sm_90) of every kernel in two trees of a kit's CUDA source, no GPU needed:
which kernels a change left identical to the instruction (so their timings stand) and which it changed.

    python tools/sass_compare.py OLD_KERNELS_DIR NEW_KERNELS_DIR [--source distill.cu] [--filter fast_rows]
    git archive 3e13ff0 kernels | tar -x -C /tmp/old && python tools/sass_compare.py /tmp/old/kernels kernels

Compiles SOURCE in each directory with torch's include paths and the kit's flags (as tools/ptxas_report.sh does),
disassembles with cuobjdump, and compares each kernel's instructions with addresses and immediates in hex
masked (shared-memory offsets and branch targets move when code elsewhere changes). Prints one line per kernel:
identical, changed (with the instruction counts and the number of differing lines), or only in one tree.
Needs cuobjdump: CUDA's own (CUDA_HOME/bin) or the wheels' (`pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`: cuobjdump runs nvdisasm to disassemble).
"""
import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def cuobjdump() -> str:
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"
    if cuda.exists():
        return str(cuda)
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:  # the nvidia-cuda-cuobjdump wheel puts it under nvidia/cu*/bin
        import nvidia

        for root in nvidia.__path__:
            for cand in Path(root).glob("cu*/bin/cuobjdump"):
                cand.chmod(cand.stat().st_mode | 0o111)
                return str(cand)
    except ImportError:
        pass
    sys.exit("cuobjdump not found: set CUDA_HOME to a CUDA with it, or `pip install nvidia-cuda-cuobjdump "
             "nvidia-cuda-nvdisasm`")


def anonymous(mangled: str) -> str:
    """The mangled name with its anonymous namespace's per-file id (which names the source's path) made the
    standard one, so that the same kernel compiled from two directories has the same name."""
    m = re.search(r"(\d+)_GLOBAL__N_", mangled)
    if not m:
        return mangled
    end = m.end(1) + int(m.group(1))
    return mangled[: m.start(1)] + "12_GLOBAL__N_1" + mangled[end:]


def compile_sass(kernels: Path, source: str, work: Path) -> dict[str, list[str]]:
    import torch
    import torch.utils.cpp_extension as cpp

    inc = [a for p in cpp.include_paths("cuda") + [sysconfig.get_paths()["include"]] for a in ("-isystem", p)]
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    std = "c++20" if (major, minor) >= (2, 14) else "c++17"
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    cubin = work / (kernels.name + ".cubin")
    subprocess.run([str(nvcc), f"-std={std}", "-O3", "--expt-relaxed-constexpr",
                    "-gencode=arch=compute_90,code=sm_90", *inc, f"-I{kernels}", "-cubin", str(kernels / source),
                    "-o", str(cubin)], check=True)
    done = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True)
    if done.returncode:  # (its reason, e.g. "Could not find executable file 'nvdisasm'": the wheel needs that too)
        sys.exit(f"cuobjdump -sass {cubin} failed: {done.stderr.strip()[-2000:]}")
    text = done.stdout
    kernels_sass: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = anonymous(m.group(1))
            kernels_sass[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if name and m:
            kernels_sass[name].append(re.sub(r"0x[0-9a-f]+", "HEX", m.group(1)))
    return kernels_sass


def demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--source", default="distill.cu")
    ap.add_argument("--filter", default="", help="a regex on the demangled kernel name")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "old").mkdir()
        (Path(tmp) / "new").mkdir()
        old = compile_sass(args.old.resolve(), args.source, Path(tmp) / "old")
        new = compile_sass(args.new.resolve(), args.source, Path(tmp) / "new")
    names = sorted(set(old) | set(new))
    pretty = demangle(names)
    for n in names:
        label = pretty[n]
        if args.filter and not re.search(args.filter, label):
            continue
        if n not in old or n not in new:
            print(f"only in {'new' if n in new else 'old'}: {label}")
        elif old[n] == new[n]:
            print(f"identical ({len(old[n])} instructions): {label}")
        else:
            changed = sum(1 for d in difflib.unified_diff(old[n], new[n], lineterm="", n=0)
                          if d[:1] in "+-" and not d.startswith(("+++", "---")))
            print(f"CHANGED ({len(old[n])} -> {len(new[n])} instructions, {changed} lines differ): {label}")


if __name__ == "__main__":
    main()
