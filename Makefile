# edgespec — the two commands a fresh machine needs: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EDGESPEC := $(VENV)/bin/edgespec
# CUDA=1 builds llama-cpp-python with -DGGML_CUDA=on (CUDA_ARCHITECTURES="80;86;89;90" by default).
CUDA ?= 0
export CUDA
# RPC=1 adds llama.cpp's RPC backend to the wheel (-DGGML_RPC=ON: [target] rpc_servers) and
# `make rpc-server` builds the server for the helper boxes. A venv made without it: rm .venv/.installed.
RPC ?= 0
export RPC
HOST ?= 127.0.0.1
PORT ?= 50051
# the OpenAI/Anthropic-compatible HTTP API beside gRPC (0 = off)
HTTP_PORT ?= 8080
# the demo's whole stack: two chat models (the F32 target, its Q8_0 twin on demand), embeddings, rerank
CONFIG ?= configs/demo.toml
PYTEST_ARGS ?=

.PHONY: all venv install proto models serve lint test test-fast test-nightly bundle clean bench rpc-server

all: install

# The venv is (re)made when pyproject.toml changes. llama-cpp-python comes from a wheel we build
# ourselves with explicit CMake flags (see tools/build-llama-wheel.sh: pip's cache ignores CMAKE_ARGS).
$(VENV)/.installed: pyproject.toml tools/build-llama-wheel.sh tools/cpu-flags.sh $(wildcard tools/patches/*.patch)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	WHEEL=$$(tools/build-llama-wheel.sh $(PY) | tail -n1) && \
	  $(PIP) install -q --no-deps --force-reinstall "$$WHEEL"
	$(PIP) install -q -e '.[dev]'
	touch $@

venv install: $(VENV)/.installed proto

# Generated protobuf/gRPC modules are build products (never committed, never stale:
# a test regenerates them and compares).
proto: $(VENV)/.installed
	$(PY) tools/gen_protos.py

models: install
	$(EDGESPEC) models prepare-demo

serve: install models
	$(EDGESPEC) serve --config $(CONFIG) --host $(HOST) --port $(PORT) $(if $(filter-out 0,$(HTTP_PORT)),--http-port $(HTTP_PORT))

# ruff and mypy ([tool.ruff], [tool.mypy] in pyproject.toml): no models; mypy reads the protobuf stubs.
lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: install models
	tools/ensure-test-deps.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# the nightly tier: `make test` plus the full hypothesis example counts (tests/conftest.py)
test-nightly: install models
	tools/ensure-test-deps.sh
	$(PY) -m pytest --hypothesis-profile=nightly $(PYTEST_ARGS)

test-fast: install
	tools/ensure-test-deps.sh
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install models
	$(EDGESPEC) bench --suite structured --modes plain,chain,tree,auto

# MODELS=name1,name2 bundles those manifest entries (`edgespec models add`), MODELS=none none
# (software-only); unset: every model in the manifest, the demo pair prepared first.
MODELS ?=
export MODELS
bundle: install $(if $(MODELS),,models)
	tools/make-bundle.sh

rpc-server: install
	tools/build-rpc-server.sh $(PY)

clean:
	rm -rf $(VENV) build dist edgespec/proto *.egg-info
