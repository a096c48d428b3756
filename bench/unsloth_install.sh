#!/usr/bin/env bash
# On the GPU machine (see bench/unsloth_wheels.sh), after vLLM's ($VSITE) and TRL's ($TRLSITE, bench/trl_install.sh)
# installs: installs the carried .unslothwhl into $USITE (/root/usite, which a warm machine keeps between calls);
# fsspec and certifi only where the image's do not satisfy datasets 4.8.5 / unsloth. $USITE goes first on the path, so
# its TRL 1.15.0 and datasets 4.8.5 win over TRL's set for the `unsloth` arm only. Then run the arm with
#   export PYTHONPATH=$USITE:$VSITE:$TRLSITE:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
set -eu
USITE=${USITE:-/root/usite} VSITE=${VSITE:-/root/vsite} TRLSITE=${TRLSITE:-/root/trlsite}
export PYTHONPATH=$USITE:$VSITE:$TRLSITE:$PWD
mkdir -p "$USITE"
wheels=$(ls .unslothwhl/*.whl 2>/dev/null || true)
[ -n "$wheels" ] || { echo "no wheels: carry .unslothwhl (bench/unsloth_wheels.sh writes it)"; exit 1; }
need=$(python3 - $wheels <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.version import Version
keep = {"fsspec": lambda v: v <= Version("2026.2.0"), "certifi": lambda v: v >= Version("2026.10.19")}
for wheel in sys.argv[1:]:
    name = wheel.rsplit("/", 1)[-1].split("-")[0].lower()
    try:
        have = Version(version(name))
    except PackageNotFoundError:
        have = None
    if name in keep and have is not None and keep[name](have):
        print(f"{name} {have} is there and fits", file=sys.stderr)
        continue
    print(wheel)
PY
)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$USITE" $need
python3 - <<'PY'
from importlib.metadata import version
for name in ("unsloth", "unsloth_zoo", "trl", "datasets", "fsspec", "peft", "bitsandbytes", "transformers", "torch",
             "vllm", "xformers", "torchao", "certifi"):
    try:
        print(name, version(name))
    except Exception as err:  # noqa: BLE001
        print(name, "missing:", err)
PY
python3 -c "import unsloth, trl; print('unsloth imports; trl', trl.__version__)" 2>&1 | grep -vE "^\s*$" | tail -12
