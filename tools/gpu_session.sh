#!/usr/bin/env bash
# What a lent-GPU session runs (the device tool copies the working tree, without .git, to a bare machine
# with torch, triton, pandas, matplotlib and pytest, and no network). Wheels that machine lacks (Liger-Kernel,
# nbclient and friends) travel in .whl/ (see the device README); the commit is passed in, since .git stays here.
#   tools/gpu_session.sh test      # PYTHON=python3 make test: every test, the gpu-marked ones included
#   tools/gpu_session.sh results   # PYTHON=python3 make results: check, bench, plot into results/
#   tools/gpu_session.sh notebooks # execute the three notebooks at full size, executed copies to $OUT
set -euo pipefail
mode=${1:?test|results|notebooks}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
case $mode in
  test) PYTHON=python3 make test PYTEST_ARGS="${PYTEST_ARGS:--q -x}" ;;
  results) PYTHON=python3 make results ;;
  notebooks)
    for nb in notebooks/0*.ipynb; do
      python3 - "$nb" <<'PY'
import sys, time, nbformat
from nbclient import NotebookClient
from pathlib import Path
path = Path(sys.argv[1]); t0 = time.time()
nb = nbformat.read(path, as_version=4)
NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
out = Path(__import__("os").environ.get("OUT", "/tmp")) / path.name
nbformat.write(nb, out)
print(f"{path.name}: ran in {time.time() - t0:.0f} s -> {out}")
PY
    done ;;
esac
