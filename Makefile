# Two commands set up a fresh machine: `make serve` (serve the bundled default model on
# 127.0.0.1:2242) and `make test`. Both create the virtual environment on first use.
VENV ?= .venv
PYTHON ?= python3
# The torch release the suite runs against. CI machines have its CPU build on disk, which pip
# takes there; elsewhere pip takes PyPI's CUDA build unless the CPU index comes first (README, Tests).
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
	# A real nginx for tests/deploy (Paphos instances behind deploy/nginx/paphos.conf), from Debian
	# where we are root with apt; never fatal, since without it those tests skip. nginx-light is
	# bookworm's small build; later releases only have nginx. (Where an init system runs, Debian
	# starts the package's default site on port 80.)
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
	  && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null \
	       || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null; } \
	  || echo "nginx not installed (needs root and apt): tests/deploy will skip"; }
	# Debian's Chromium for tests/server/test_web_ui.py (Playwright drives it headless; Playwright's own
	# browser download needs a CDN). Never fatal either: without it those browser tests skip.
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
	  || echo "chromium not installed (needs root and apt): tests/server/test_web_ui.py will skip"; }
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/paphos run $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check paphos tests benchmarks scripts
