# `make serve` and `make test` each create .venv if missing and install the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= demo
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test lint

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
