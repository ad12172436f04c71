"""The notebooks under notebooks/: stored without outputs, in step with notebooks/_build_notebooks.py, and each
runs top to bottom in a Jupyter kernel of this interpreter, from the notebooks/ folder.

Without a GPU the notebooks run their quick CPU sizes (about a minute each on two cores, once the CPU module
is in the build cache); with one, they run its small sizes too unless KLDIV_NB_FULL=1 is set, which runs
the full GPU study (many minutes).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parent.parent
NB_DIR = REPO / "notebooks"
NAMES = ["01_correctness.ipynb", "02_performance.ipynb", "03_naive_to_roofline.ipynb"]
CELL_TIMEOUT_S = 1800  # a cold build of the kit's CUDA module inside a cell takes minutes


def read(name: str):
    return nbformat.read(NB_DIR / name, as_version=4)


def test_all_notebooks_listed():
    assert sorted(p.name for p in NB_DIR.glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_stored_without_outputs(name):
    nb = read(name)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{name}: cells {dirty} hold outputs or execution counts; store notebooks without them "
                       "(python notebooks/_build_notebooks.py writes them clean)")


def test_notebooks_match_their_generator():
    spec = importlib.util.spec_from_file_location("_build_notebooks", NB_DIR / "_build_notebooks.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    built = gen.notebooks()
    assert sorted(built) == NAMES
    for name, nb in built.items():
        stored = json.loads((NB_DIR / name).read_text())
        assert stored == json.loads(nbformat.writes(nb)), (
            f"{name} differs from notebooks/_build_notebooks.py: edit the cells there and run it")


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory):
    """A kernel spec that starts ipykernel with this very interpreter (whatever `python3` a system's
    default spec would find)."""
    from jupyter_client.kernelspec import KernelSpecManager

    root = tmp_path_factory.mktemp("kernels")
    (root / "kldiv-test").mkdir()
    (root / "kldiv-test" / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kldiv-inline tests", "language": "python",
    }))
    return KernelSpecManager(kernel_dirs=[str(root)])


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, kernel_specs, tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = read(name)
    env = dict(os.environ)
    env.setdefault("KLDIV_NB_FULL", "0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    km = KernelManager(kernel_name="kldiv-test", kernel_spec_manager=kernel_specs)
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NB_DIR)}})
    t0 = time.perf_counter()
    try:
        client.execute(env=env)  # raises CellExecutionError at the first cell that fails
    finally:
        nbformat.write(nb, tmp_path / name)  # the executed notebook, to read after a failure
    print(f"{name}: {time.perf_counter() - t0:.0f} s, executed copy in {tmp_path / name}")

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # The figures are shown inline (the kit's plots module selects a headless backend on import).
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} showed no figure"
