"""A non-editable install (a wheel, as `pip install .` builds) carries the kernel sources and works from
anywhere: no checkout beside it, a working directory outside the repository."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What a wheel build does not need (and would be slow or wrong to copy): caches, environments, outputs.
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".ipynb_checkpoints", "results", "notebooks")

# Runs in a fresh interpreter whose sys.path has the install target (and the venv's torch), not the repo.
_FIRST_CALL = r"""
import sys
import torch
import torch.nn.functional as F
import kldiv_inline as K
from kldiv_inline import loader

target = sys.argv[1]
assert K.__file__.startswith(target), f"imported {K.__file__}, not the installed copy under {target}"
assert str(loader.kernels_root()).startswith(target), loader.kernels_root()
assert K.load("cpu").backend() == "cpu"
p = torch.rand(64, 33, dtype=torch.float64).softmax(-1).float()
t = torch.rand(64, 33, dtype=torch.float64).softmax(-1).float()
got = K.kl_div(p.log(), t, reduction="none")
want = F.kl_div(p.double().log(), t.double(), reduction="none")
torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)
print("OK", loader.kernels_root())
"""


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of this checkout (a wheel build writes build/ and *.egg-info into its source)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_NOT_COPIED)
    _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist")], timeout=300)
    (whl,) = (tmp / "dist").glob("kldiv_inline-*.whl")
    return whl


def test_wheel_ships_every_kernel_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernel_files = [p.relative_to(REPO / "kernels").as_posix() for p in (REPO / "kernels").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts]
    assert kernel_files
    missing = [f for f in kernel_files if f"kldiv_inline/_kernels/{f}" not in names]
    assert not missing, f"not in the wheel: {missing}"


@pytest.mark.slow
def test_first_call_after_a_wheel_install(wheel, tmp_path):
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
         timeout=300)
    script = tmp_path / "first_call.py"
    script.write_text(_FIRST_CALL)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KLDIV_INLINE_KERNELS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(target)  # before site-packages, where an editable install of the repo may be
    env["KLDIV_INLINE_CACHE"] = str(tmp_path / "cache")
    proc = _run([sys.executable, str(script), str(target)], cwd=outside, env=env, timeout=600)
    assert proc.stdout.startswith("OK "), proc.stdout
