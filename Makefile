# Every target that runs code first makes sure .venv exists and holds the package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed
export REMAT_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: venv train test test-all lint docs clean

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

# The docs extra (Sphinx, MyST-Parser, Furo) goes into the same .venv, once per pyproject.toml.
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -e ".[dev,docs]"
	touch $(DOCS_STAMP)

# Warnings are errors: a broken link, a bad docstring or a page outside the toctree fails.
docs: $(DOCS_STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf outputs multirun .pytest_cache docs/_build
