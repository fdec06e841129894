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

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -m "" $(ARGS)

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
