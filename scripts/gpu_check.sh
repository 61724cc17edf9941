#!/usr/bin/env bash
# The GPU check, in one command, for a session that has a GPU (`make gpu-check`; about 3-5 minutes on an H200):
#   1. the CUDA tests of the trainer (fp32 engine-trainer gap, packed flash attention, one-rank bf16 mesh,
#      host syncs per micro-batch) and of the engine's CUDA graphs (replays equal eager decode, survive a refit),
#      and the CPU tests of the same properties;
#   2. bench/gpu_trainer.py on the Qwen2.5-0.5B shape against a plain Hugging Face loop (appends to
#      docs/benchmarks.md);
#   3. bench/engine_host.py (the host's part of a decode step, on the CPU) and bench/engine.py --device cuda;
#   4. the vLLM engine's tests, only where vLLM is installed (MOLT_VLLM=1 installs it from $MOLT_WHEELHOUSE or
#      the package index first; vLLM pins its own CUDA build of torch).
# Python: $PY, else .venv/bin/python, else python3; the repository root goes on PYTHONPATH, so a bare image
# with torch, transformers and pytest is enough. Results also go to $OUT when it is set (the device tool's).
# Stages as arguments run only those (tests trainer engine vllm; default all): the device tool allows 10 minutes
# a command, so a tight budget can run `gpu_check.sh tests trainer` and then `gpu_check.sh engine`. A failing
# stage does not stop the later ones (a device session is short: get every number); the exit code is 1 then.
# `gpu_check.sh rehearse` (`make gpu-rehearse`) runs the same steps on a CPU, before a GPU session: the test files
# (their CUDA tests skip) and both benches on tiny models (`--tiny`), writing nothing; it catches a crash of the
# check itself, which would cost a device session minutes. Best run with the device image's torch and transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-$(mktemp -d)}
REHEARSE=0
if [ "${1:-}" = rehearse ]; then REHEARSE=1; shift; [ $# -gt 0 ] || set -- tests trainer engine; fi
STAGES=" ${*:-tests trainer engine vllm} "
BENCH=$([ "$REHEARSE" = 1 ] && echo --tiny || echo --write)  # rehearsal: tiny models on CPU, nothing written
want() { [[ "$STAGES" == *" $1 "* ]]; }
failed=""  # stages that failed; the script goes on to the next one and exits 1 at the end
[ "$REHEARSE" = 1 ] || nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true  # an image without it still runs the check
$PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| transformers', transformers.__version__); sys.exit(0 if torch.cuda.is_available() or $REHEARSE else 'torch sees no GPU')"

# -o addopts= drops the project's `-m 'not slow' --timeout=600` (pytest-timeout may be missing); -rs lists skips
if want tests; then
  echo "== trainer and engine tests (CUDA and CPU)"
  timeout 300 $PY -m pytest -q -o addopts= -p no:cacheprovider -rs tests/trainer/test_cuda.py \
    tests/trainer/test_gpu_path.py tests/trainer/test_packing.py tests/engine/test_slots.py 2>&1 \
    | tee "$OUT/trainer_tests.txt" || failed+=" tests"  # the benches still run: one device session, all numbers
  if [ "$REHEARSE" = 0 ] && grep -q "SKIPPED.*needs CUDA" "$OUT/trainer_tests.txt"; then echo "the CUDA tests were skipped" >&2; exit 3; fi
fi

if want trainer; then
  echo "== trainer bench"
  timeout 420 $PY bench/gpu_trainer.py --repeats 3 $BENCH --json "$OUT/gpu_trainer.json" || failed+=" trainer"
  cp docs/benchmarks.md "$OUT/benchmarks.md"
fi

if want engine; then
  echo "== engine bench"
  # the host's part of a decode step on this machine's CPU (what bounds tokens/s besides the GPU's kernels)
  timeout 120 $PY bench/engine_host.py $([ "$REHEARSE" = 1 ] && echo --repeats 1 || echo --write) 2>&1 \
    | tee "$OUT/engine_host.txt" || failed+=" engine-host"
  cp docs/benchmarks.md "$OUT/benchmarks.md"
  timeout 470 $PY bench/engine.py $([ "$REHEARSE" = 1 ] || echo --device cuda) $BENCH 2>&1 | tee "$OUT/engine_bench.txt" || failed+=" engine"
  cp docs/benchmarks.md "$OUT/benchmarks.md"
fi

finish() { [ -z "$failed" ] && echo "== GPU check passed; results in $OUT" && exit 0
  echo "== GPU check FAILED in:$failed; results in $OUT" >&2; exit 1; }
want vllm || finish
if [ "${MOLT_VLLM:-0}" = 1 ] && ! $PY -c "import vllm" 2>/dev/null; then
  WHEELS=${MOLT_WHEELHOUSE:-.whl}
  if [ -d "$WHEELS" ]; then opts=(--no-index --find-links "$WHEELS"); else opts=(); fi
  timeout 300 $PY -m pip install -q "${opts[@]}" "vllm>=0.10.2" "pytest-asyncio>=0.23"
fi
if $PY -c "import vllm" 2>/dev/null; then
  echo "== vLLM engine tests"
  # test_weight_group.py: the NCCL refit group (needs 2 GPUs; skipped with one)
  timeout 480 $PY -m pytest -q -o addopts= -p no:cacheprovider -rs tests/engine/test_vllm.py \
    tests/engine/test_vllm_real.py tests/engine/test_weight_group.py 2>&1 | tee "$OUT/vllm_tests.txt" || failed+=" vllm"
  if grep -q "SKIPPED.*vLLM is not installed" "$OUT/vllm_tests.txt"; then echo "the vLLM test was skipped" >&2; exit 3; fi
else
  echo "== vLLM not installed: its engine tests did not run (MOLT_VLLM=1 installs it)"
fi
finish
