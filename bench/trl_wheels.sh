#!/usr/bin/env bash
# TRL 1.16 for bench/bench_trl_peer.py on the GPU machine (Python 3.12, no network). Downloads TRL and what it
# imports that the GPU image lacks or vLLM's set (../shared/device/vllm-wheels.sh) does not bring, for cp312 manylinux:
#   .trlwhl/       trl 1.16.0, datasets 5.2.0 (TRL imports it at module level), multiprocess 0.70.19 (datasets'; its
#                  dill 0.4.1 comes with vLLM's set), peft 0.21.2 (the version qerl is tested with), pandas 3.1.1,
#                  bitsandbytes 0.50.2 with only its CUDA 13.0 library (the trl_qlora arm)          ~20 MiB
#   .trlwhl-arrow/ pyarrow 26.0.1 (datasets needs >= 24), ~53 MiB: needed only where the image's pyarrow is missing
#                  or older (KINDS.md lists pyarrow in the image; bench/trl_install.sh says which case holds)
# Not carried: accelerate, transformers, torch, numpy, huggingface_hub, jinja2, psutil, pyyaml, packaging, xxhash,
# fsspec, requests, tqdm, python-dateutil (in the image); dill (vLLM's set).
#
# Usage, in the project root on the CPU machine:  bash bench/trl_wheels.sh
# On the GPU machine, after vLLM's install (shared/device/vllm-install.sh) in the same warm session:
#   carry [".trlwhl"]:        bash bench/trl_install.sh        (and, if it says so, a call carrying [".trlwhl-arrow"])
set -euo pipefail
ex=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$ex")"
for d in /.trlwhl/ /.trlwhl-arrow/; do grep -qx "$d" "$ex" 2>/dev/null || echo "$d" >> "$ex"; done
get() {  # get DIR REQUIREMENT...
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"
}
rm -rf .trlwhl .trlwhl-arrow && mkdir -p .trlwhl .trlwhl-arrow
get .trlwhl trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 peft==0.21.2 pandas==3.1.1 bitsandbytes==0.50.2
# bitsandbytes ships a library per CUDA / ROCm / XPU version; the image's torch is CUDA 13.0
(cd .trlwhl && zip -q -d bitsandbytes-0.50.2-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' \
  'bitsandbytes/libbitsandbytes_cuda132.so' 'bitsandbytes/libbitsandbytes_rocm*.so' \
  'bitsandbytes/libbitsandbytes_xpu*.so' >/dev/null)
get .trlwhl-arrow pyarrow==26.0.1
ls -la .trlwhl .trlwhl-arrow
du -sm .trlwhl .trlwhl-arrow | awk '{print $2": "$1" MiB"}'
echo "each GPU call carries one of the two folders (under 60 MiB each)"
