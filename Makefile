# Every target that runs code first makes sure .venv exists and holds the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
export REMAT_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: venv train test test-all test-oldest lint docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

# The oldest torch pyproject allows (remat.TORCH_MIN), from the registry, in a venv of its
# own. `===` takes the registry's build, not a local +cpu wheel of the same release (which
# the registry's torchvision build does not load with).
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed
OLDEST_TORCH := torch===2.13.0 torchvision===0.28.0
# the suites that reach torch internals (remat._compat's users) and the compat tests, in
# the order `make test` runs them: the planner's forked traces must run before the
# strategies' in-process torch.compile backward, after which autograd refuses to run in a
# forked child
OLDEST_TESTS := tests/measure tests/planner tests/strategies tests/test_compat.py

$(OLDEST_STAMP): pyproject.toml
	test -x $(OLDEST_PY) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --upgrade pip
	$(OLDEST_PY) -m pip install $(OLDEST_TORCH)
	$(OLDEST_PY) -m pip install -e ".[dev]"
	touch $(OLDEST_STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# pytest-xdist workers; tests that share a module's fixture or start multi-process runs keep
# to one worker (--dist loadgroup in pyproject.toml, groups in tests/conftest.py)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS)

test: $(STAMP)
	$(PY) -m pytest $(XDIST) $(ARGS)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_PY) -m pytest $(OLDEST_TESTS) $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "" --timeout 1200 $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests train.py

# The docs extra (Sphinx, MyST-Parser, Furo) goes into the same .venv, once per pyproject.toml.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -e ".[dev,docs]"
	touch $(DOCS_STAMP)

# Warnings are errors: a broken link, a bad docstring or a page outside the toctree fails.
docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf outputs multirun .pytest_cache docs/_build
