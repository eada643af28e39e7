# `make serve` and `make test` each create .venv if missing and install the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= demo
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint soak

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Serves the OpenAI-compatible API and WebSocket chat on http://$(HOST):$(PORT) (Ctrl-C stops it).
serve: install
	$(PY) -m mmserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: install
	$(PY) -m ruff check .

test: install lint
	$(PY) -m pytest -q

# Minutes of mixed traffic (text, images, video; HTTP and WebSocket; cancels and disconnects) against an
# in-process server on a tiny model made on the fly; prints a report and fails on any leak or error.
SOAK_S ?= 180
soak: install
	$(PY) -m mmserve.bench.soak --duration-s $(SOAK_S)
