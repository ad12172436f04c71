# make results : set up, then check, benchmark and plot on the best device here (GPU if any, else CPU)
# make test    : set up, then the whole test suite (GPU tests skip without a GPU)
#
# Set-up makes .venv (python3 -m venv) and installs the package with its test extras. With PYTHON=... an
# existing environment that already has the packages is used as it is, with no installs and no network
# (e.g. a GPU node: `PYTHON=python3 make test`).
PYTHON ?=
ifeq ($(strip $(PYTHON)),)
PY := .venv/bin/python
SETUP := .venv/.installed
else
PY := $(PYTHON)
SETUP := check-env
endif
PYTEST_ARGS ?=

.PHONY: results test check bench plot check-env clean-cache

results: $(SETUP)
	$(PY) -m kldiv_inline results

test: $(SETUP)
	$(PY) -m pytest $(PYTEST_ARGS)

check: $(SETUP)
	$(PY) -m kldiv_inline check

bench: $(SETUP)
	$(PY) -m kldiv_inline bench

plot: $(SETUP)
	$(PY) -m kldiv_inline plot

.venv/.installed: pyproject.toml
	test -x .venv/bin/python || python3 -m venv .venv
	.venv/bin/python -m pip install --upgrade pip
	.venv/bin/python -m pip install -e '.[test]'
	touch $@

# An existing environment: say clearly what is missing instead of failing deep inside a test.
check-env:
	@$(PY) -c "import torch, ninja, numpy, pandas, matplotlib, tqdm, pytest" || \
	  { echo "PYTHON=$(PY) lacks packages: install torch ninja numpy pandas matplotlib tqdm pytest (see environment.yml)"; exit 1; }

clean-cache:
	rm -rf $${KLDIV_INLINE_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/kldiv_inline}
