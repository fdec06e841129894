# Every target that runs code first makes sure .venv exists and holds the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export REMAT_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: venv train test test-all test-oldest lint clean

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

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_PY) -m pytest $(OLDEST_TESTS) $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -m "" $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests train.py

clean:
	rm -rf outputs multirun .pytest_cache
