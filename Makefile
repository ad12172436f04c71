# make results   : set up, then check, benchmark and plot on the best device here (GPU if any, else CPU); the
#                  default target (plain `make`)
# make test      : set up, sync and strip the notebooks (make notebooks), then the whole test suite (GPU tests
#                  skip without a GPU)
# make notebooks : each notebooks/NN_name.ipynb and its percent-format twin NN_name.py brought in step (the side
#                  saved last wins: jupytext --sync), then outputs stripped from the .ipynb (nbstripout)
# make lint      : ruff over the Python, clang-format over kernels/, and the notebooks as committed: stripped
#                  and in step with their twins (CI runs this before make test)
#
# Set-up makes .venv (python3 -m venv) and installs the package with its test and lint extras. With PYTHON=...
# an existing environment that already has the packages is used as it is, with no installs and no network
# (e.g. a GPU node: `PYTHON=python3 make test`); there the notebook step is skipped, with a message, when
# jupytext or nbstripout is missing.
PYTHON ?=
ifeq ($(strip $(PYTHON)),)
PY := .venv/bin/python
SETUP := .venv/.installed
NB_TOOLS_MISSING := exit 1
else
PY := $(PYTHON)
SETUP := check-env
NB_TOOLS_MISSING := true
endif
PYTEST_ARGS ?=
NOTEBOOKS ?= notebooks
# Keys nbstripout drops besides outputs, counts and its defaults: language_info names the Python that saved it.
NBSTRIP := -m nbstripout --extra-keys metadata.language_info

# What `make lint` leaves out (paths or folders): empty, everything is linted. (Code being rewritten on another
# branch can be listed here until it lands and is brought to the rules with `ruff check --fix`, `clang-format -i`.)
LINT_LATER ?=
CPP_SOURCES = $(filter-out $(LINT_LATER),$(wildcard kernels/*.cu kernels/*.cuh kernels/*.cpp kernels/*.h \
	kernels/*/*.cu kernels/*/*.cuh kernels/*/*.cpp kernels/*/*.h))
CLANG_FORMAT := -c "import clang_format; clang_format.clang_format()"

.PHONY: results test notebooks lint check bench plot check-env nbstripout-install clean-cache

results: $(SETUP)
	$(PY) -m kldiv_inline results

test: $(SETUP) notebooks
	$(PY) -m pytest $(PYTEST_ARGS)

notebooks: $(SETUP)
	@if $(PY) -c "import jupytext, nbstripout" 2>/dev/null; then \
	  $(PY) -m jupytext --quiet --sync $(NOTEBOOKS)/*.ipynb $(NOTEBOOKS)/*.py && $(PY) $(NBSTRIP) $(NOTEBOOKS)/*.ipynb; \
	else \
	  echo "make notebooks: $(PY) lacks jupytext or nbstripout; notebooks not synced or stripped"; $(NB_TOOLS_MISSING); \
	fi

lint: $(SETUP)
	$(PY) -m ruff check $(foreach f,$(LINT_LATER),--extend-exclude $(f)) .
	$(PY) $(CLANG_FORMAT) --dry-run --Werror $(CPP_SOURCES)
	$(PY) $(NBSTRIP) --verify $(NOTEBOOKS)/*.ipynb || \
	  { echo "notebooks hold outputs: run make notebooks (and make nbstripout-install once per clone)"; exit 1; }
	@$(PY) -c "import jupytext" || \
	  { echo "PYTHON=$(PY) lacks jupytext: the notebook pairs cannot be checked (pip install -e '.[test,lint]')"; exit 1; }
	$(PY) -m pytest -q -p no:cacheprovider tests/test_notebooks.py -k pairs_in_step

check: $(SETUP)
	$(PY) -m kldiv_inline check

bench: $(SETUP)
	$(PY) -m kldiv_inline bench

plot: $(SETUP)
	$(PY) -m kldiv_inline plot

.venv/.installed: pyproject.toml
	test -x .venv/bin/python || python3 -m venv .venv
	.venv/bin/python -m pip install --upgrade pip
	.venv/bin/python -m pip install -e '.[test,lint]'
	touch $@

# An existing environment: say clearly what is missing instead of failing deep inside a test.
check-env:
	@$(PY) -c "import torch, ninja, numpy, pandas, matplotlib, tqdm, pytest" || \
	  { echo "PYTHON=$(PY) lacks packages: install torch ninja numpy pandas matplotlib tqdm pytest (see environment.yml)"; exit 1; }

# Once per clone: git strips notebook outputs at `git add` (.gitattributes names the filter; git config holds it).
nbstripout-install: $(SETUP)
	$(PY) -m nbstripout --install
	git config filter.nbstripout.extrakeys metadata.language_info

# The loader's own build folder (loader.cache_root: under KLDIV_INLINE_CACHE or TORCH_EXTENSIONS_DIR when set),
# never the folder such a variable names.
clean-cache: $(SETUP)
	rm -rf "$$($(PY) -c 'from kldiv_inline.loader import cache_root; print(cache_root())')"
