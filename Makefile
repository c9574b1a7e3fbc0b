# The few verbs a contributor needs. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# DeepSpeed (the adapter tests and benchmarks) builds its CPU ops here once, then reuses them.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: demo test lint bench install install-dev system-deps

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: a looser requirement alone makes pip take a CUDA build.
	$(BIN)/pip install -q torch==2.13.0

# pip runs again only when pyproject.toml changed (a stamp per extra), so a second `make demo`
# starts at once. setuptools' one notice about editable installs is not a problem here: the
# folders it warns of are the package's own.
PIP_INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e

install: $(VENV)/.installed-all
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) '.[$*]'
	touch $@

# Real Prometheus/promtool, PostgreSQL and headless Chromium for the tests (Debian).
system-deps:
	./.ci/system-deps

demo: install
	$(BIN)/zerowatch demo

test: install-dev system-deps
	$(BIN)/python -m pytest -q

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy zerowatch agent server dashboards alerts integrations

bench: install-dev
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/agent_overhead.py
	$(BIN)/python bench/ingest.py
