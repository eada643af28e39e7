# `make serve` and `make test` each create .venv if missing and install the project into it first.
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL ?= assets/models/tiny-qwen2-vl

.PHONY: install serve test lint

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

# Until the HTTP server lands, this runs a short offline generation on the default model.
serve: install
	$(PY) -m mmserve generate --model $(MODEL)

lint: install
	$(PY) -m ruff check .

test: install lint
	$(PY) -m pytest -q
