#!/usr/bin/env bash
# On the GPU machine (see bench/trl_wheels.sh): installs the carried TRL wheels into $TRLSITE (/tmp/trlsite), each one
# only where the image (and vLLM's $VSITE, /tmp/vsite) lacks that package at a version TRL 1.16 accepts; pyarrow from
# .trlwhl-arrow when carried. VSITE / TRLSITE may name folders under /root, which a warm machine keeps between calls.
# Then run with
#   export PYTHONPATH=$VSITE:$TRLSITE:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
set -eu
export PYTHONPATH=${VSITE:-/tmp/vsite}:${TRLSITE:-/tmp/trlsite}:$PWD
mkdir -p ${TRLSITE:-/tmp/trlsite}
wheels=$(ls .trlwhl/*.whl .trlwhl-arrow/*.whl 2>/dev/null || true)
[ -n "$wheels" ] || { echo "no wheels: carry .trlwhl (bench/trl_wheels.sh writes it)"; exit 1; }
# pandas >= 2.1.1 (TRL), pyarrow >= 24 (datasets): an image that has them keeps its own
need=$(python3 - $wheels <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.version import Version
floor = {"pandas": "2.1.1", "pyarrow": "24.0.0"}
for wheel in sys.argv[1:]:
    name = wheel.rsplit("/", 1)[-1].split("-")[0].lower()
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if name in floor and have is not None and Version(have) >= Version(floor[name]):
        print(f"{name} {have} is there", file=sys.stderr)
        continue
    print(wheel)
PY
)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ${TRLSITE:-/tmp/trlsite} $need
python3 - <<'PY' || echo "pyarrow is missing or older than 24: run once more carrying [\".trlwhl-arrow\"]"
import datasets, pandas, pyarrow, trl, peft
print("trl", trl.__version__, "datasets", datasets.__version__, "peft", peft.__version__, "pandas", pandas.__version__,
      "pyarrow", pyarrow.__version__)
PY
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
  || echo "vLLM is not installed"
