# Two commands set up a fresh machine: `make serve` (serve the bundled default model on
# 127.0.0.1:2242) and `make test`. Both create the virtual environment on first use.
VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch (on disk on our CI machines); set TORCH_SPEC=torch for a CUDA machine.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	# A KoboldCpp API client for the Kobold tests; its declared extras (image libraries) are not
	# needed by its core client, whose imports (requests, aiohttp) the test extra carries.
	$(PY) -m pip install --quiet --no-deps koboldapi==0.5.4
	# The H200 image's triton, beside ours: tests compile the kernels for sm_90 with both.
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/triton-3.6 triton==3.6.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/paphos run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check paphos tests benchmarks scripts
