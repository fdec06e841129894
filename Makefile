# Every target that runs code first makes sure .venv exists and holds the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export REMAT_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: venv train test test-all lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py $(ARGS)

# pytest-xdist workers; tests that share a module's fixture or start multi-process runs keep
# to one worker (--dist loadgroup in pyproject.toml, groups in tests/conftest.py)
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS)

test: $(STAMP)
	$(PY) -m pytest $(XDIST) $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "" --timeout 1200 $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests train.py

clean:
	rm -rf outputs multirun .pytest_cache
