#!/usr/bin/env bash
# Issue 50's measurement on one H200: the 70B-class recipes held to an 80 GB card's memory, beside the 32B recipe,
# and the 70B decode against its weight-read floor. From the repository root, with the wheels and the tokenizer:
#
#     run(command="bash bench/gpu_70b.sh", carry=[".whl", ".tok"], timeout_s=600)      # again until "all done"
#
#   PARTS=decode,72b,llama3.3-70b,32b   what to run, in this order (default: all four)
#   STEPS=3                             optimizer steps per memory row (the first warms up: graphs, Triton)
#   WAIT=540                            seconds this call waits for the job before it hands back what is done
#   RESTART=1                           forget a finished or running job on this machine and start again
#
# The work runs as a job detached from the call (setsid), so that it can outlast the 10-minute limit of one call: each
# call starts it if it is not running (a fresh machine), waits up to WAIT seconds, then copies what is finished to
# $OUT (rollout_h200_70b.json, memory_h200_70b.json, the job's log). Call again while the machine is warm (30 s after
# a call) to wait for the rest. A machine given back loses the job: put the JSONs that came back into bench/results/
# and call again; rows found there are not run again (bench_memory.py --reuse; the decode part is skipped).
#
# The memory rows run after tests/gpu/test_memory_budget_on_gpu.py passes (the allocator held to a budget; ~20 s).
# Parts, with the times expected from the issue's 72B run (about 20 ms per decode step at 32 rows, 40 s of update per
# 64 rows; 16 prompts x 8 at 2,048 tokens decode in 4 waves of 32 rows: about 245 s a step):
#   decode        bench_rollout.py: Qwen2.5-72B and Llama-3.3-70B NVFP4 + LoRA r16 at the plan's waves for 78.6 and
#                 139 GiB (32 and 64 rows), 256 + 1,024 tokens, ms/step over weight bytes / copy bandwidth; ~3 min
#   72b           bench_memory.py 72b:nvfp4:gsm8k held to 78.6 GiB (--memory_budget_gb: the plan and PyTorch's
#                 allocator), lognormal lengths: write the checkpoint ~1 min, load ~1 min, STEPS x ~4.1 min
#   llama3.3-70b  the same for llama3.3-70b:nvfp4:gsm8k (its checkpoint after the 72B one is deleted: the disk holds
#                 one 70B checkpoint)                                                             ~2 + STEPS x 4 min
#   32b           32b:nvfp4:gsm8k held to 78.6 GiB, the step time beside the 70B ones           ~1 + STEPS x 1.4 min
# All four at STEPS=3: about 36 minutes (4 calls); at STEPS=2 about 27 (3 calls). 78.6 GiB is what an idle 80 GB H100
# leaves PyTorch after the CUDA context (the plan's H100 rows were planned for it).
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${PARTS:-decode,72b,llama3.3-70b,32b}
STEPS=${STEPS:-3}
WAIT=${WAIT:-540}
BUDGET_GB=78.6
WORK=/root/qerl_70b
OUT=${OUT:-$WORK/returned}
mkdir -p "$WORK/out" "$OUT"

running() { [[ -f $WORK/job.pid ]] && kill -0 "$(cat "$WORK/job.pid")" 2>/dev/null; }
if [[ -n ${RESTART:-} ]]; then
  running && kill -- -"$(cat "$WORK/job.pid")"  # the job's own process group (setsid)
  rm -rf "$WORK/job.done" "$WORK/job.pid" "$WORK/out"/*
fi

if ! running && [[ ! -f $WORK/job.done ]]; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    .whl/*.whl || exit 1
  rows=$(for p in ${PARTS//,/ }; do [[ $p != decode ]] && printf '%s:nvfp4:gsm8k,' "$p"; done)
  reuse=$([[ -f bench/results/memory_h200_70b.json ]] && echo "--reuse bench/results/memory_h200_70b.json")
  decode=$([[ ,$PARTS, == *,decode,* && ! -f bench/results/rollout_h200_70b.json ]] && echo yes)
  # the job runs from its own copy: a later call's transfer rewrites this tree while the job's processes import it
  rm -rf "$WORK/src" && mkdir -p "$WORK/src" && cp -a bench configs qerl tests train.py pyproject.toml .tok "$WORK/src"/
  cat > "$WORK/job.sh" <<EOF
export PYTHONPATH=$WORK/site:$WORK/src:$WORK/src/bench PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd $WORK/src
date
if [[ -n "$decode" ]]; then
  python3 bench/bench_rollout.py --out $WORK/out --label 70b --models qwen2.5-72b,llama3.3-70b \
    --plan-waves 78.6,139 --new 1024 --budget-s 900 --unfused '' --mma-sync-too '' --no-copy-too '' || echo "decode failed"
fi
if [[ -n "$rows" ]] && ! python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_memory_budget_on_gpu.py; then
  echo "the budget's GPU test failed: no memory rows"
elif [[ -n "$rows" ]]; then
  python3 bench/bench_memory.py --tokenizer .tok --out $WORK/out --label 70b --work $WORK/models --drop-models \
    --memory-budget-gb $BUDGET_GB --steps $STEPS --lengths lognormal --rows ${rows%,} $reuse || echo "memory failed"
fi
date
touch $WORK/job.done
EOF
  setsid nohup bash "$WORK/job.sh" > "$WORK/job.log" 2>&1 < /dev/null &
  echo $! > "$WORK/job.pid"
  echo "started the job (pid $(cat "$WORK/job.pid")): parts $PARTS, $STEPS steps per memory row"
fi

start=$SECONDS
while running && (( SECONDS - start < WAIT )); do sleep 10; done
cp "$WORK"/out/*.json "$OUT"/ 2>/dev/null
tail -c 4000000 "$WORK/job.log" > "$OUT/gpu_70b.log"
grep -vE "Warning|warn\(|^\s*$" "$WORK/job.log" | tail -40
ls -la "$OUT"
if [[ -f $WORK/job.done ]]; then echo "all done"; else echo "still running: call again while the machine is warm"; fi
