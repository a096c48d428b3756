#!/usr/bin/env bash
# Unsloth for bench/bench_trl_peer.py's `unsloth` arm on the GPU machine (Python 3.12, torch 2.11.0+cu130, no network),
# beside vLLM 0.26.0 (../shared/device/vllm-wheels.sh) and TRL's set (bench/trl_wheels.sh: peft 0.21.2, bitsandbytes
# 0.50.2, multiprocess, pandas). Downloads into .unslothwhl/ (~23 MiB) the newest release pair and what its
# requirements need that the image and those two sets lack, each checked against its METADATA (Requires-Dist):
#   unsloth 2026.10.9, unsloth_zoo 2026.10.9   torch <2.15 (2.11 ok), transformers <=5.17.0 (the image's 5.17.0 ok),
#                                              peft >=0.18, bitsandbytes >=0.45.5 (TRL's set), accelerate >=0.34.1 (ok);
#                                              they know vLLM 0.22-0.26 (unsloth/import_fixes.py), no upper bound
#   trl 1.15.0        unsloth pins trl <=1.15.0 (the TRL arm's 1.16.0 is refused); 1.15 takes vLLM 0.21-0.31
#   datasets 4.8.5    unsloth pins datasets <5.0.0, !=4.4.*, !=4.5.0 (TRL's set carries 5.2.0); TRL 1.15 wants >=4.7
#   fsspec 2026.2.0   datasets 4.8.5 wants fsspec <=2026.2.0: installed only where the image's is newer
#   torchao 0.18.0, cut_cross_entropy 25.1.1, tyro 1.0.17 (+ typeguard 4.6.1), hf_transfer 0.1.9, json5, nest_asyncio,
#   structlog, certifi 2026.10.19.post1 (unsloth wants >= 2026.10.19), diffusers 0.42.1 (+ importlib_metadata 8.7.1)
#   xformers 0.0.35   unsloth wants >=0.0.27.post2; PyPI's wheel may not load beside a cu130 torch, and then Unsloth
#                     says so and uses PyTorch's attention (unsloth/models/_utils.py): the arm's log tells which
# Unsloth's wheel ships its web app (studio/, ~60 MiB unpacked); the arm does not use it and it is cut from the wheel.
#
# Usage, in the project root on the CPU machine:  bash bench/unsloth_wheels.sh
# On the GPU machine, after vLLM's and TRL's installs in the same warm session, carry [".unslothwhl"]:
#   bash bench/unsloth_install.sh
set -euo pipefail
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
grep -qx "/.unslothwhl/" "$ex" 2>/dev/null || echo "/.unslothwhl/" >> "$ex"
get() {  # get DIR REQUIREMENT...
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
rm -rf .unslothwhl && mkdir -p .unslothwhl
get .unslothwhl unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 fsspec==2026.2.0 \
  torchao==0.18.0 cut_cross_entropy==25.1.1 tyro==1.0.17 typeguard==4.6.1 hf_transfer==0.1.9 json5==0.17.3 \
  nest_asyncio==1.6.0 structlog==26.1.0 certifi==2026.10.19.post1 diffusers==0.42.1 importlib_metadata==8.7.1 \
  xformers==0.0.35
(cd .unslothwhl && zip -q -d unsloth-2026.10.9-*.whl 'studio/*' >/dev/null)
ls -la .unslothwhl
du -sm .unslothwhl | awk '{print $2": "$1" MiB"}'
