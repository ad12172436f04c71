"""The notebooks under notebooks/. Each is a pair: NN_name.ipynb, which Jupyter opens, and its percent-format
twin NN_name.py (jupytext; notebooks/jupytext.toml). `make notebooks`, which `make test` runs first, brings each
pair in step (the side saved last wins) and strips outputs, with jupytext and nbstripout themselves. Here: the
pairs are in step and stored without outputs; a notebook saved by JupyterLab (outputs, counts, an edited cell)
or a twin edited as text comes out of that same make step clean and in step; and every notebook runs top to
bottom in a Jupyter kernel of this interpreter, from the notebooks/ folder.

Without a GPU the notebooks run their quick CPU sizes (about a minute each on two cores, once the CPU module
is in the build cache); with one, they run its small sizes too unless KLDIV_NB_FULL=1 is set, which runs
the full GPU study (many minutes).
"""
from __future__ import annotations

import difflib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

REPO = Path(__file__).resolve().parent.parent
NB_DIR = REPO / "notebooks"
NAMES = ["01_correctness.ipynb", "02_performance.ipynb", "03_naive_to_roofline.ipynb", "04_your_own_kernel.ipynb",
         "05_distillation.ipynb"]
CELL_TIMEOUT_S = 1800  # a cold build of the kit's CUDA module inside a cell takes minutes


def read(path: Path):
    return nbformat.read(path, as_version=4)


def inputs(path: Path) -> list[tuple[str, str, list]]:
    """What both sides of a pair hold: each cell's type, source and tags, as jupytext reads the file."""
    jupytext = pytest.importorskip("jupytext")
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in jupytext.read(path).cells]


def assert_pairs_in_step(folder: Path) -> None:
    for name in NAMES:
        ipynb, twin = inputs(folder / name), inputs((folder / name).with_suffix(".py"))
        if ipynb != twin:
            diff = difflib.unified_diff([repr(c) for c in ipynb], [repr(c) for c in twin], name,
                                        Path(name).with_suffix(".py").name, n=0, lineterm="")
            pytest.fail(f"{folder / name} and its .py twin differ (run `make notebooks`):\n" + "\n".join(diff))


def assert_stripped(folder: Path) -> None:
    for name in NAMES:
        nb = read(folder / name)
        nbformat.validate(nb)
        dirty = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
        assert not dirty, f"{folder / name}: cells {dirty} hold outputs or execution counts (run `make notebooks`)"


def test_all_notebooks_listed():
    assert sorted(p.name for p in NB_DIR.glob("*.ipynb")) == NAMES
    assert sorted(p.name for p in NB_DIR.glob("*.py")) == [Path(n).with_suffix(".py").name for n in NAMES]


def test_pairs_in_step():
    assert_pairs_in_step(NB_DIR)


def test_stored_without_outputs():
    assert_stripped(NB_DIR)


def make_notebooks(folder: Path) -> str:
    """`make notebooks` of the repository's Makefile, on `folder`, with this interpreter."""
    pytest.importorskip("jupytext")
    pytest.importorskip("nbstripout")
    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}  # not the outer make's flags
    done = subprocess.run(["make", "-s", "-C", str(REPO), "notebooks", f"NOTEBOOKS={folder}",
                           f"PYTHON={sys.executable}"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture
def copies(tmp_path):
    """The repository's notebooks and their jupytext config, in a scratch folder."""
    for path in NB_DIR.iterdir():
        if path.suffix in (".ipynb", ".py", ".toml"):
            shutil.copy2(path, tmp_path / path.name)
    return tmp_path


def touch_later(path: Path) -> None:
    """Make `path` the most recently saved side of its pair, as a save would."""
    later = time.time() + 2
    os.utime(path, (later, later))


def test_jupyterlab_save_comes_out_clean_and_in_step(copies):
    """JupyterLab without the jupytext extension saves only the .ipynb: an edited cell, outputs, execution
    counts, a new cell with a random id, its own metadata. `make notebooks` carries the edit into the .py
    twin and strips the rest."""
    path = copies / NAMES[0]
    nb = read(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[-1].source += "\nprint('edited in JupyterLab')"
    for count, cell in enumerate(code, 1):
        cell.execution_count = count
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="some output\n")]
    nb.cells.append(nbformat.v4.new_markdown_cell("A cell added in JupyterLab."))
    nb.metadata["language_info"] = {"name": "python", "version": "3.99.0"}
    nbformat.write(nb, path)
    touch_later(path)

    make_notebooks(copies)
    twin = path.with_suffix(".py").read_text()
    assert "print('edited in JupyterLab')" in twin and "A cell added in JupyterLab." in twin
    assert_pairs_in_step(copies)
    assert_stripped(copies)
    assert "language_info" not in json.loads(path.read_text())["metadata"]


def test_twin_edited_as_text_reaches_the_ipynb(copies):
    """An edit of the .py twin (in an editor, or JupyterLab opening the .py) reaches the .ipynb, whose
    stale outputs are stripped."""
    path = copies / NAMES[1]
    nb = read(path)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="stale output\n")]
    nbformat.write(nb, path)
    twin = path.with_suffix(".py")
    twin.write_text(twin.read_text() + "\n# %%\nprint('edited as text')\n")
    touch_later(twin)

    make_notebooks(copies)
    assert read(path).cells[-1].source == "print('edited as text')"
    assert_pairs_in_step(copies)
    assert_stripped(copies)


SCRATCH_CACHE_NOTEBOOKS = ["03_naive_to_roofline.ipynb", "04_your_own_kernel.ipynb"]


def scratch_cache_cells(name: str) -> tuple[str, str]:
    """The code cell of `name` that saves the user's KLDIV_INLINE_CACHE and points it at a scratch folder, and
    the one that gives it back and removes the scratch folders."""
    sources = [c.source for c in read(NB_DIR / name).cells if c.cell_type == "code"]
    setup = [src for src in sources if "SCRATCH_FOLDERS.append" in src]
    cleanup = [src for src in sources if "del USER_CACHE" in src]
    assert len(setup) == 1 and len(cleanup) == 1, f"{name}: expected one scratch cell and one cleanup cell"
    return setup[0], cleanup[0]


@pytest.mark.parametrize("user_cache", [None, "my_cache"])
@pytest.mark.parametrize("name", SCRATCH_CACHE_NOTEBOOKS)
def test_scratch_cache_cells_run_twice(name, user_cache, tmp_path, monkeypatch):
    """In Jupyter a cell is easily run twice. The scratch cell run twice still saves the user's
    KLDIV_INLINE_CACHE (not its own scratch path), and the cleanup cell gives it back, or unsets it when it was
    unset, and removes every scratch folder, also when it runs twice itself and when the notebook runs again in
    the same kernel. (The two cells run in one namespace, as a kernel's; nothing else of the notebook is
    needed, so no kernel is started.)"""
    import tempfile

    setup, cleanup = (compile(src, f"{name}:{i}", "exec") for i, src in enumerate(scratch_cache_cells(name)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the scratch folders go under tmp_path
    mine = None if user_cache is None else str(tmp_path / user_cache)
    if mine is None:
        monkeypatch.delenv("KLDIV_INLINE_CACHE", raising=False)
    else:
        monkeypatch.setenv("KLDIV_INLINE_CACHE", mine)
    namespace: dict = {}
    for _ in range(2):  # the notebook run twice in one kernel
        exec(setup, namespace)
        exec(setup, namespace)
        scratch = sorted(p for p in tmp_path.iterdir() if p.name != user_cache)
        assert len(scratch) == 2, scratch
        assert Path(os.environ["KLDIV_INLINE_CACHE"]).parent in scratch
        exec(cleanup, namespace)
        assert os.environ.get("KLDIV_INLINE_CACHE") == mine
        assert not [p for p in tmp_path.iterdir() if p.name != user_cache], "scratch folders left behind"
        exec(cleanup, namespace)
        assert os.environ.get("KLDIV_INLINE_CACHE") == mine


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

    nb = read(NB_DIR / name)
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
