# The two set-up commands of the README: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The local CPU build first, so that the package's `torch>=...` pulls no CUDA wheels.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev,hf]"
	touch $@

demo: install
	$(VENV)/bin/astraflow demo

test: install
	$(VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check astraflow connectors tests benchmarks
