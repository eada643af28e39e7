# `make serve` and `make test` each create .venv if missing and install the project into it first:
# `serve` the runtime dependencies only, `test` (and `lint`) the `[test]` extra too. Each install has its
# own stamp, so `make test` after `make serve` still installs the test extra.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= demo
# The model id clients send as "model" (and GET /v1/models lists): the last part of MODEL, so `demo` by default.
SERVED_MODEL_NAME ?= $(notdir $(patsubst %/,%,$(MODEL)))
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install install-test serve test lint soak gpu-wheels

$(PY):
	python3 -m venv $(VENV)

$(VENV)/.installed-runtime: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $@ $(VENV)/.installed-runtime

install: $(VENV)/.installed-runtime
install-test: $(VENV)/.installed-test

# Serves the OpenAI-compatible API and WebSocket chat on http://$(HOST):$(PORT) (Ctrl-C stops it).
serve: install
	$(PY) -m mmserve serve --model $(MODEL) --served-model-name $(SERVED_MODEL_NAME) --host $(HOST) --port $(PORT)

lint: install-test
	$(PY) -m ruff check .

test: install-test lint
	$(PY) -m pytest -q

# Minutes of mixed traffic (text, images, video; HTTP and WebSocket; cancels and disconnects) against an
# in-process server on a tiny model made on the fly; prints a report and fails on any leak or error.
SOAK_S ?= 180
soak: install
	$(PY) -m tests.soak --duration-s $(SOAK_S)

# Wheels (Python 3.12, x86-64) of the packages mmserve imports that the lent GPU machine's image lacks, for
# scripts/gpu_checks.sh there (carried as .whl).
GPU_WHEEL_PLATFORMS := $(foreach p,2014 _2_17 _2_28 _2_31,--platform manylinux$(p)_x86_64)
gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_WHEEL_PLATFORMS) -d .whl av==18.1.0 msgspec==0.23.0 pyzmq==27.3.0 llguidance==1.9.1
