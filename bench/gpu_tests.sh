#!/usr/bin/env bash
# The GPU test tier (``pytest -m gpu``: CUDA-graph replay == eager tokens, log-probs == a full recomputation, LoRA and
# AQN noise inside captured graphs, the GEMV / training / fused decode kernels vs float64) on the GPU machine.
#
#     bash bench/gpu_tests.sh [extra pytest arguments]
#
# Run from anywhere; wheels the machine lacks (jsonargparse, compressed-tensors, math-verify) are installed from
# .whl/ when it is there. Exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
exec python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu "$@"
