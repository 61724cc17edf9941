#!/usr/bin/env bash
# GPU check of the vLLM engine (molt/engine/vllm.py), for a session that has a GPU: about 3-8 minutes.
#   bash scripts/gpu_check.sh                          # fp32 engine, log-probs within 1e-3 of transformers
#   MOLT_VLLM_TEST_DTYPE=bfloat16 bash scripts/gpu_check.sh   # if the installed vLLM has no fp32 attention
# Python: $PY, else .venv/bin/python, else python3. vLLM (>= 0.10.2) and pytest-asyncio are installed into it
# when missing: from the wheel folder $MOLT_WHEELHOUSE (default .whl) when there is one, else from the
# configured package index. vLLM pins its own CUDA build of torch: a venv made for the CPU gets that torch.
# The engine bench (bench/engine.py) times the embedded HF engine only; no vLLM bench runs here.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WHEELS=${MOLT_WHEELHOUSE:-.whl}

missing=()
$PY -c "import vllm" 2>/dev/null || missing+=("vllm>=0.10.2")
$PY -c "import pytest_asyncio" 2>/dev/null || missing+=("pytest-asyncio>=0.23")
if ((${#missing[@]})); then
  echo "== installing ${missing[*]} into $PY"
  if [ -d "$WHEELS" ]; then
    timeout 300 $PY -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}"
  else
    timeout 300 $PY -m pip install -q "${missing[@]}" || {
      echo "could not install ${missing[*]}: no package index reachable and no wheel folder $WHEELS" >&2
      exit 2
    }
  fi
fi

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
$PY -c "import sys, torch, vllm; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| vllm', vllm.__version__, '| cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no GPU')"

# -o addopts= drops the project's `-m 'not slow' --timeout=600` (pytest-timeout may be missing); -rs lists
# skips: the check fails if the GPU test was skipped (no vLLM or no CUDA) rather than passing unnoticed.
log=$(mktemp)
# test_weight_group.py: the NCCL refit group (needs 2 GPUs; skipped with one)
timeout 480 $PY -m pytest -q -o addopts= -p no:cacheprovider -rs tests/engine/test_vllm.py \
  tests/engine/test_weight_group.py 2>&1 | tee "$log"
if grep -q "SKIPPED.*needs vLLM" "$log"; then echo "the GPU test was skipped" >&2; exit 3; fi
echo "== GPU check passed"
