# The few verbs a contributor needs. Every target creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# DeepSpeed (the adapter tests and benchmarks) builds its CPU ops here once, then reuses them.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions

.PHONY: demo test lint bench install install-dev system-deps gpu-wheels gpu-check wheel

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

# A wheel of the whole package (docs/deploy.md: onto training nodes and a server host).
# `make wheel VENV=<an environment with pip and setuptools>` builds it with that one (no
# .venv created, nothing downloaded): tests/cli/test_wheel.py in a fresh clone.
wheel: | $(BIN)/python
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist/zerowatch-*.whl

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy zerowatch agent server dashboards alerts integrations

bench: install-dev
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/agent_overhead.py
	$(BIN)/python bench/ingest.py

# -- a lent GPU machine (docs/gpu.md) -------------------------------------------------------
# There, python3 holds a CUDA torch and no package registry can be reached. `make gpu-wheels`
# (here, with a registry) downloads, for that machine's Python, the packages the GPU tests
# need that its image lacks, at this .venv's versions, into .gpu-wheels/ (ignored by git:
# carry it with the working tree). `make gpu-check` (there) installs them and the working
# tree itself from there alone into GPU_SITE, then runs bench/gpu_check.py: every `gpu` test,
# the engine's cases, one table. Nothing is installed into the machine's own environment.
GPU_PY ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS := .gpu-wheels
GPU_SITE ?= /tmp/zerowatch-gpu-site
# What the server, the agent and the tests import beyond the GPU image's packages (torch,
# numpy, pytest, pytest-timeout, httpx, rich, typer, pyyaml, psutil, jinja2, urllib3, anyio,
# h11, click, uvloop, prometheus-client, narwhals, typing-extensions are there).
GPU_WHEEL_PACKAGES := tenacity orjson zlib-ng fastapi starlette uvicorn sqlalchemy greenlet \
	alembic mako plotly pydantic pydantic-core annotated-types typing-inspection msgspec \
	swagger-ui-bundle-v2 opentelemetry-api nvidia-ml-py
GPU_PLATFORMS := $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64

gpu-wheels: install-dev
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/python -c 'import sys, importlib.metadata as m; \
		print("\n".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
		$(GPU_WHEEL_PACKAGES) > $(GPU_WHEELS)/requirements.txt
	$(BIN)/pip download -q --no-deps --only-binary=:all: --implementation cp \
		--python-version $(GPU_PYTHON_VERSION) $(GPU_PLATFORMS) -d $(GPU_WHEELS) \
		-r $(GPU_WHEELS)/requirements.txt
	du -sh $(GPU_WHEELS)

gpu-check:
	@test -f $(GPU_WHEELS)/requirements.txt || { echo "no $(GPU_WHEELS)/: run 'make \
		gpu-wheels' where a registry is reachable, and carry $(GPU_WHEELS)"; exit 1; }
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	$(GPU_PY) -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
		--upgrade --target $(GPU_SITE) .
	PYTHONPATH=$(GPU_SITE) PYTHONUNBUFFERED=1 timeout 330 $(GPU_PY) -P bench/gpu_check.py
	# The agent's cost on the GPU (goals: <= 1.02x at the stage-0 step, <= 1.01x at stage 3
	# with 48 layers) and the NVML sampling cost per second.
	PYTHONPATH=$(GPU_SITE) PYTHONUNBUFFERED=1 timeout 120 $(GPU_PY) -P bench/agent_overhead.py \
		--cuda --no-server --stages 0,3 --repeats 4
