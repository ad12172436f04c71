"""Run a notebook's jupytext twin (notebooks/NN_name.py) as a plain script, where Jupyter is not installed (the
lent GPU machines have no IPython, nbclient or ipykernel): `display` prints, figures go to matplotlib's Agg
backend and are not shown. A check that every cell runs at the study's sizes, not a way to read the notebook.

    cd notebooks && python ../tools/run_notebook_twin.py 01_correctness.py
"""
import os
import runpy
import sys
import types

os.environ.setdefault("MPLBACKEND", "Agg")
if "IPython" not in sys.modules:
    try:
        import IPython.display  # noqa: F401  (the real one, where installed)
    except ImportError:
        ipython, display = types.ModuleType("IPython"), types.ModuleType("IPython.display")

        class Image:
            def __init__(self, filename=None, **_):
                self.filename = filename

            def __repr__(self):
                return f"<Image {self.filename}>"

        display.display = lambda *objs, **_: [print(o) for o in objs]
        display.Image = Image
        # matplotlib asks an imported IPython for get_ipython() and version_info: say "not running in IPython"
        ipython.display, ipython.get_ipython, ipython.version_info = display, (lambda: None), (9, 0)
        sys.modules["IPython"], sys.modules["IPython.display"] = ipython, display
runpy.run_path(sys.argv[1], run_name="__main__")
