"""The trainer people run for LoRA GRPO on one GPU, measured beside qerl in one session: TRL's ``GRPOTrainer`` with a
colocated vLLM, at the end-to-end benchmark's settings, then qerl's CUDA-graph engine and qerl's vLLM engine.

    python bench/bench_trl_peer.py --tokenizer DIR --out bench/results [--arms trl,qerl_nvfp4,qerl_bf16,...]
        [--new-tokens 2048] [--steps 3] [--trl-micro-batch 8] [--vllm-gpu-memory-utilization auto]

Arms ``trl``, ``trl_qlora`` and ``unsloth`` are the peers; ``qerl_*`` are qerl's engines.

Arms (``--arms``, run one after the other, each in a process of its own so the next finds the GPU free):

- ``trl``: TRL 1.16 ``GRPOTrainer`` on the bf16 checkpoint ``bench_train_e2e.py`` writes (random weights, real
  Qwen2.5 shapes, the tokenizer's vocabulary), peft LoRA r16 / alpha 16 on q,k,v,o,gate,up,down, bf16, gradient
  checkpointing (GRPOConfig's default), ``use_vllm=True, vllm_mode="colocate"``, ``vllm_enable_sleep_mode=True``
  (TRL's advice against out-of-memory: level 2, the weights are re-pushed each step), ``loss_type="dapo"``,
  ``beta=0``, eps 0.2 / 0.28, the recipe's AdamW settings; one generation of prompts x G rows per optimizer step
  (``per_device_train_batch_size`` x ``gradient_accumulation_steps`` = rows). Fixed lengths: vLLM's
  ``ignore_eos`` and ``min_tokens`` through ``generation_kwargs``. ``vllm_gpu_memory_utilization`` ``auto``: the
  share that holds vLLM's weights and the KV cache of every row at full length plus 4 GiB (what TRL's estimator
  computes), rounded up to 0.05. The reward is a seeded random number (the step's cost does not depend on it).
- ``trl_qlora``: the same with the base in bitsandbytes NF4, loaded as TRL's script does with ``--load_in_4bit``
  (``get_quantization_config(ModelConfig(load_in_4bit=True))``: NF4, no nested quantization, bf16 compute, given to
  the trainer as ``quantization_config`` with the checkpoint's path). What TRL 1.16 does with it, from its source:
  seeing a ``bnb.nn.Linear4bit`` it starts vLLM with ``quantization="bitsandbytes"`` (vLLM quantizes the bf16
  checkpoint to NF4 itself while loading, keeping its own per-block scales on the parameters); the trainable LoRA
  weights are cast to bf16. Each step's weight sync calls peft's ``merge_adapter()``: for every 4-bit layer peft
  dequantizes the base, adds B @ A, copies the sum to the CPU and quantizes it again (``Params4bit``, back on the
  GPU); TRL then hands vLLM each ``named_parameters()`` tensor, i.e. the merged layers' packed NF4 codes, which vLLM's
  loader copies into its packed weights while keeping the scales it computed at start (the new scales are not
  parameters and are not sent); then ``unmerge_adapter()`` dequantizes, subtracts and quantizes once more, so the
  frozen base can move by a rounding error every step once the adapter is nonzero. With ``vllm_enable_sleep_mode``
  TRL sleeps vLLM at level 2, which discards weights: the codes are pushed again, the scales (vLLM allocated them
  while loading) are not. The report shows both effects: ``logp_gap`` (TRL's
  ``sampling/sampling_logp_difference/mean``, vLLM's log-probs of its samples against the policy's, median over steps;
  the bf16 arm's is the reference) and ``base_drift`` (mean |change| of the first LoRA-wrapped layer's dequantized
  base over the run / its mean |value|; zero where nothing moved it). For every TRL arm it also reads TRL's importance
  weight of the samples (its IS settings are in the arm's ``config``) and the gradient's norm from TRL's logs (weight
  0 and norm 0: the step trained nothing). Sampled lengths are forced, so the times hold whatever vLLM samples.
- ``unsloth``: Unsloth's GRPO as its notebooks run it, ``FastLanguageModel.from_pretrained(..., load_in_4bit=False,
  fast_inference=True, max_lora_rank=16)`` (vLLM inside the model; the LoRA goes to vLLM as a LoRA request, not
  merged), ``FastLanguageModel.get_peft_model`` (r16 / alpha 16 on the same seven projections, Unsloth's gradient
  checkpointing), ``UNSLOTH_VLLM_STANDBY=1`` (its sleep mode for RL; ``--trl-sleep false`` turns it off), then TRL's
  ``GRPOTrainer`` as patched by Unsloth at the TRL arm's settings, fixed lengths through Unsloth's
  ``vllm_sampling_params``. Unsloth pins TRL <= 1.15 and datasets < 5: it runs in a call of its own with
  ``bench/unsloth_wheels.sh`` / ``bench/unsloth_install.sh`` (TRL 1.15.0), on the same machine as the other arms.
- ``qerl_nvfp4``, ``qerl_bf16``: ``bench_train_e2e.fit`` with the CUDA-graph engine; ``qerl_vllm_nvfp4``,
  ``qerl_vllm_bf16``: the same with qerl's vLLM engine (``VLLMRollout``, LoRA hot-swapped, its share planned).

TRL times its phases only towards wandb / mlflow / trackio (``profiling/Time taken: GRPOTrainer.*``) and logs
``step_time`` (the wall time of the step's micro-steps, generation included), so the TRL arm measures for itself:
a subclass times ``_generate`` (weight sync, vLLM wake-up, sampling, sleep) and ``_generate_and_score_completions``
(that plus the rewards and the policy's log-probs of the sampled tokens, which TRL recomputes for its importance
sampling correction), a ``TrainerCallback`` the whole optimizer step (``on_step_begin`` to ``on_step_end``), each
after a device synchronize. TRL: rollout = ``_generate_and_score_completions``, train = step - rollout. qerl: rollout
and train are its ``perf/rollout_s`` and ``perf/train_s``. Peak: PyTorch's peak allocated GiB in the arm's process
(qerl's ``perf/peak_memory_gb``) and the device's peak used memory over the whole arm, sampled by this process
(NVML) less what was used before the arm started (vLLM's pools, CUDA contexts and the caching allocator's slack
count there). Medians over the steps after the first.

Each arm's result is kept in ``--parts`` as it ends, and every call merges what is there into
``trl_peer_<device>[_<n>tok].json`` and prints the table: the arms can run in separate calls on one machine. On the
GPU machine vLLM 0.26 comes from ``shared/device/vllm-install.sh`` and TRL from ``bench/trl_wheels.sh`` /
``bench/trl_install.sh``. ``--device cpu --tiny`` checks the TRL arm's code on a CPU (tiny random Qwen2, transformers'
``generate`` instead of vLLM).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ARMS = {  # arm -> (system, weights) as the table names them
    "trl": ("TRL GRPOTrainer + vLLM colocate", "bf16"),
    "trl_qlora": ("TRL GRPOTrainer + vLLM colocate, load_in_4bit", "nf4"),
    "unsloth": ("Unsloth (fast_inference vLLM) + TRL GRPOTrainer", "bf16"),
    "qerl_nvfp4": ("qerl CUDA-graph engine", "nvfp4"),
    "qerl_bf16": ("qerl CUDA-graph engine", "bf16"),
    "qerl_vllm_nvfp4": ("qerl vLLM engine", "nvfp4"),
    "qerl_vllm_bf16": ("qerl vLLM engine", "bf16"),
}
TRAINERS = ("trl", "trl_qlora", "unsloth")  # the arms that run TRL's GRPOTrainer (trl_arm)
BASELINE = "qerl_nvfp4"  # every arm's step is divided by this one's
# what the report reads from TRL's logs, median over the steps: vLLM's mean |log-prob - the policy's| of the sampled
# tokens; the importance weight TRL gives the samples (after its default sequence_mask, which zeroes a sequence whose
# exp(sum of its tokens' log-prob differences) exceeds 3); the gradient's norm before clipping
TRL_LOGGED = {"logp_gap": "sampling/sampling_logp_difference/mean",
              "is_weight_mean": "sampling/importance_sampling_ratio/mean", "grad_norm": "grad_norm"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------------------- the TRL arm


def prompt_texts(tokenizer, n: int, max_prompt_tokens: int) -> list[str]:
    """The first ``n`` prompts qerl's default data gives (``ArithmeticSource``, chat template, seeded shuffle)."""
    from qerl.data.prompt_stream import PromptStream
    from qerl.data.sources import ArithmeticSource

    stream = iter(PromptStream(ArithmeticSource(seed=0), tokenizer, max_prompt_tokens=max_prompt_tokens))
    return [next(stream)["prompt"] for _ in range(n)]


def vllm_share(model_dir: Path, rows: int, max_len: int, total_bytes: int, four_bit: bool = False) -> float:
    """The GPU share that holds vLLM's copy of the weights and the KV cache of ``rows`` rows of ``max_len`` tokens
    plus 4 GiB (activations, graphs, sampler), rounded up to 0.05. ``four_bit``: vLLM holds the decoder layers'
    linear weights as bitsandbytes NF4 (half a byte a weight and a float32 scale per 64), the rest in bf16."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if four_bit:
        hidden, kv_heads = config["hidden_size"], config["num_key_value_heads"]
        per_layer = (hidden * config["num_attention_heads"] * head_dim * 2 + hidden * kv_heads * head_dim * 2
                     + 3 * hidden * config["intermediate_size"])
        weights -= config["num_hidden_layers"] * per_layer * (2 - 0.5 - 4 / 64)
    kv = rows * max_len * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    return min(0.95, math.ceil((weights + kv + 4 * 2**30) / total_bytes * 20) / 20)


def first_base_weight(model):
    """The first LoRA-wrapped layer's frozen base weight in float32 on the CPU, dequantized where it is 4-bit."""
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(base, "weight"):
            continue
        weight = base.weight
        if getattr(weight, "quant_state", None) is not None:
            from bitsandbytes.functional import dequantize_4bit

            return dequantize_4bit(weight.data, weight.quant_state).float().cpu()
        return weight.detach().float().cpu()
    raise ValueError("no LoRA-wrapped layer in the model")


def random_reward(completions, **kwargs) -> list[float]:
    """A seeded random number per completion: GRPO's advantages are then non-zero, as with a real task."""
    rng = random.Random(len(completions))
    return [rng.random() for _ in completions]


def trl_arm(model_dir: str, opts: dict) -> dict:
    """TRL's GRPOTrainer for ``opts["steps"]`` optimizer steps; per-step times and memory, TRL's own logs."""
    steps, logs, config = [], [], {}
    try:
        return _trl_arm(Path(model_dir), opts, steps, logs, config)
    except Exception as err:  # noqa: BLE001  an arm that fails is a result (out of memory, an unsupported path)
        return {"error": f"{type(err).__name__}: {str(err)[:600]}", "traceback": traceback.format_exc()[-3000:],
                "steps": steps, "trl_logs": logs, "config": config}


def _trl_arm(model_dir: Path, opts: dict, steps: list, logs: list, config: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # TRL drives the in-process engine's model runner
    if opts["unsloth"]:  # Unsloth first: it patches transformers, peft and TRL's trainers as it is imported
        os.environ.setdefault("UNSLOTH_VLLM_STANDBY", "1" if opts["sleep"] else "0")  # its sleep mode for RL
        from unsloth import FastLanguageModel
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer, ModelConfig, get_quantization_config

    cuda = opts["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class StepClock(TrainerCallback):
        """Wall time of each optimizer step and of the phases the trainer below marks, after a device sync."""

        def __init__(self):
            self.phases, self.start = {}, 0.0

        @contextlib.contextmanager
        def phase(self, name: str):
            sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                sync()
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - start

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.phases = {}
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            step_s = time.perf_counter() - self.start
            rollout = self.phases.get("rollout", 0.0)
            steps.append({"step": state.global_step, "step_s": step_s, "rollout_s": rollout,
                          "generate_s": self.phases.get("generate", 0.0), "train_s": step_s - rollout,
                          "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                          "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0})
            print(f"TRL step {state.global_step}: {steps[-1]}", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs_out.append({"step": state.global_step, **{k: v for k, v in (logs or {}).items()
                                                             if isinstance(v, (int, float))}})

    logs_out = logs

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation (``_generate``) and whole rollout phase are timed by ``clock``."""

        def __init__(self, *args, clock: StepClock, **kwargs):
            self.clock = clock
            super().__init__(*args, **kwargs)

        def _generate(self, *args, **kwargs):
            with self.clock.phase("generate"):
                return super()._generate(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            with self.clock.phase("rollout"):
                return super()._generate_and_score_completions(*args, **kwargs)

    rows, new = opts["prompts"] * opts["group_size"], opts["new_tokens"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": prompt_texts(tokenizer, opts["prompts"] * opts["steps"],
                                                        opts["max_prompt_tokens"])})
    dtype = "bfloat16" if cuda else "float32"
    # As TRL's own script (trl/scripts/grpo.py) loads a model: the trainer gets the path, GRPOConfig's
    # model_init_kwargs the dtype, and the trainer's quantization_config what ``--load_in_4bit`` makes of ModelConfig
    quantization = get_quantization_config(ModelConfig(model_name_or_path=str(model_dir), dtype=dtype,
                                                       load_in_4bit=True)) if opts["qlora"] else None
    max_len = opts["max_prompt_tokens"] + new
    share = opts["vllm_gpu_memory_utilization"]
    if share == "auto":
        share = (vllm_share(model_dir, rows, max_len, torch.cuda.mem_get_info()[1], four_bit=opts["qlora"])
                 if cuda else 0.3)
    use_vllm = cuda and not opts["no_vllm"]
    generation = ({"ignore_eos": True, "min_tokens": new} if use_vllm else {"min_new_tokens": new})
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    model, more = str(model_dir), {"model_init_kwargs": {"dtype": dtype}}
    if opts["unsloth"]:  # as Unsloth's GRPO notebooks do: its model with vLLM inside, its LoRA, TRL's trainer
        from vllm import SamplingParams

        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(model_dir), max_seq_length=max_len, dtype=torch.bfloat16, load_in_4bit=False,
            fast_inference=True, max_lora_rank=16, gpu_memory_utilization=share, random_state=0)
        model = FastLanguageModel.get_peft_model(
            model, r=16, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, random_state=0,
            use_gradient_checkpointing="unsloth" if opts["checkpointing"] else False)
        lora = None
        more = {"vllm_sampling_params": SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=new,
                                                       min_tokens=new, ignore_eos=True)}
    micro = opts["trl_micro_batch"]
    if rows % micro:
        raise ValueError(f"--trl-micro-batch {micro} must divide prompts x group size ({rows}).")
    args = GRPOConfig(
        output_dir=str(Path(opts["work"]) / "trl_out"), report_to="none", logging_steps=1, save_strategy="no",
        max_steps=opts["steps"], per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
        num_generations=opts["group_size"], max_completion_length=new, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, max_grad_norm=0.2,
        lr_scheduler_type="constant", beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
        mask_truncated_completions=False, bf16=cuda, use_cpu=not cuda, gradient_checkpointing=opts["checkpointing"],
        use_vllm=use_vllm, vllm_mode="colocate", vllm_enable_sleep_mode=opts["sleep"] and not opts["unsloth"],
        vllm_gpu_memory_utilization=share, vllm_max_model_length=max_len, generation_kwargs=generation,
        shuffle_dataset=False, seed=0, log_completions=False, dataloader_num_workers=0,
        **more,
    )
    record = lambda: config.update({k: getattr(args, k, None) for k in (  # noqa: E731
        "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
        "num_generations", "max_completion_length", "gradient_checkpointing", "use_vllm", "vllm_mode",
        "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length", "loss_type", "beta",
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max", "bf16", "top_k")})
    record()
    config["generation_kwargs"] = generation
    config["quantization_config"] = quantization.to_dict() if quantization is not None else None
    clock = StepClock()
    start = time.perf_counter()
    trainer = TimedGRPOTrainer(model=model, reward_funcs=random_reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, quantization_config=quantization, peft_config=lora,
                               callbacks=[clock], clock=clock)
    init_s = time.perf_counter() - start  # loading, peft wrapping and, with use_vllm, vLLM's start (profile, graphs)
    record()  # as the trainer left them (Unsloth's trainer sets the sleep mode and top_k for its engine)
    base_before = first_base_weight(trainer.model)
    trainer.train()
    # the base is frozen: what moved it is each step's merge_adapter / unmerge_adapter round trip before the sync
    base_after = first_base_weight(trainer.model)
    base_drift = ((base_after - base_before).abs().mean() / base_before.abs().mean()).item()
    steady = lambda key: statistics.median(s[key] for s in steps[1:] or steps)  # noqa: E731  first step warms up
    lengths = [entry["completions/mean_length"] for entry in logs if "completions/mean_length" in entry]
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    for name in ("vllm", "peft", "bitsandbytes", "unsloth", "unsloth_zoo", "datasets"):
        with contextlib.suppress(ImportError):
            versions[name] = __import__(name).__version__
    return {
        "rollout_s": steady("rollout_s"), "generate_s": steady("generate_s"),
        "score_s": steady("rollout_s") - steady("generate_s"), "train_s": steady("train_s"),
        "step_s": steady("step_s"), "peak_gb": max(s["peak_gb"] for s in steps),
        "peak_reserved_gb": max(s["peak_reserved_gb"] for s in steps),
        "completion_length": statistics.median(lengths[1:] or lengths) if lengths else None,
        "base_drift": base_drift,
        "trl_step_time_s": [entry["step_time"] for entry in logs if "step_time" in entry],
        "init_s": init_s, "steps": steps, "trl_logs": logs, "config": config, "versions": versions,
    }


# ---------------------------------------------------------------------------------------------------- qerl's arms


def qerl_arm(model_dir: str, quantization: str, engine: str, opts: dict) -> dict:
    """``bench_train_e2e.fit`` at the same settings (its defaults of the 7B reproduction command)."""
    import bench_train_e2e

    args = argparse.Namespace(
        lengths="fixed", label="trlpeer", engine=engine, micro_batch_tokens=opts["micro_batch_tokens"],
        kv_cache_dtypes="", profile_update=None, checkpointing=False, new_tokens=opts["new_tokens"],
        group_size=opts["group_size"], prompts=opts["prompts"], micro_batch=opts["micro_batch"],
        steps=opts["steps"], overrides=list(opts["overrides"]))
    try:
        result = bench_train_e2e.fit(Path(model_dir), quantization, args, Path(opts["work"]) / "runs")
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {str(err)[:600]}", "traceback": traceback.format_exc()[-3000:]}
    result["step_s"] = result["rollout_s"] + result["train_s"]
    return result


# ---------------------------------------------------------------------------------------------------- measuring


class DevicePeak:
    """The device's peak used memory (GiB) while the block runs, sampled every 50 ms (NVML; else cudaMemGetInfo),
    less what was in use when it started."""

    def __init__(self, enabled: bool):
        self.enabled, self.peak, self.before = enabled, 0.0, 0.0
        self._stop, self._read = threading.Event(), None

    def _reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]))
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
        except Exception:  # noqa: BLE001  no NVML: the CUDA runtime's view of the same device
            import torch

            return lambda: (lambda free, total: (total - free) / 2**30)(*torch.cuda.mem_get_info())

    def _loop(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        if self.enabled:
            self._read = self._reader()
            self.before = self.peak = self._read()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self._stop.set()
            self._thread.join()

    @property
    def used_gb(self) -> float | None:
        return self.peak - self.before if self.enabled else None


def run_arm(arm: str, dirs: dict, opts: dict, own_process: bool) -> dict:
    from bench_train_e2e import in_own_process

    if arm in TRAINERS:
        fn, fn_args = trl_arm, (str(dirs["bf16"]), {**opts, "qlora": arm == "trl_qlora", "unsloth": arm == "unsloth"})
    else:
        quantization = ARMS[arm][1]
        fn, fn_args = qerl_arm, (str(dirs[quantization]), quantization,
                                 "vllm" if arm.startswith("qerl_vllm") else "cuda_graph", opts)
    start = time.perf_counter()
    with DevicePeak(opts["device"] == "cuda") as memory:
        result = in_own_process(fn, *fn_args) if own_process else fn(*fn_args)
    result.update(arm=arm, wall_s=time.perf_counter() - start, device_peak_gb=memory.used_gb,
                  device_used_before_gb=memory.before if memory.enabled else None,
                  date=datetime.datetime.now().isoformat(timespec="seconds"))
    return result


# ---------------------------------------------------------------------------------------------------- the report


def table_row(arm: str, result: dict, baseline: dict | None) -> dict:
    system, weights = ARMS[arm]
    if result.get("config", {}).get("use_vllm") is False:  # a CPU check: transformers' generate samples
        system = system.replace("vLLM colocate", "transformers generate")
    row = {"arm": arm, "system": system, "weights": weights}
    if "error" in result:
        return {**row, "error": result["error"]}
    for key in ("rollout_s", "generate_s", "score_s", "train_s", "step_s", "peak_gb", "device_peak_gb",
                "completion_length", "base_drift"):
        if result.get(key) is not None:
            row[key] = result[key]
    for key, logged in TRL_LOGGED.items():  # the TRL arms' own measures, from their logs
        values = [entry[logged] for entry in result.get("trl_logs", []) if entry.get(logged) is not None]
        if values:
            row[key] = statistics.median(values)
    if baseline and "step_s" in baseline:
        row["step_over_qerl_nvfp4"] = result["step_s"] / baseline["step_s"]
        row["rollout_over_qerl_nvfp4"] = result["rollout_s"] / baseline["rollout_s"]
        row["train_over_qerl_nvfp4"] = result["train_s"] / baseline["train_s"]
    return row


def merge(parts: Path, settings: dict) -> dict:
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(parts.glob("*.json")) if p.stem in ARMS}
    for arm in [a for a, r in runs.items() if r.get("settings") != settings]:
        print(f"not merged: {parts / arm}.json was run with other settings ({runs.pop(arm).get('settings')})")
    baseline = runs.get(BASELINE)
    rows = [table_row(arm, runs[arm], baseline) for arm in ARMS if arm in runs]
    devices = sorted({r.get("device", "?") for r in runs.values()})
    return {"device": " + ".join(devices), "date": max((r["date"] for r in runs.values()), default=""),
            "settings": settings, "rows": rows, "runs": runs}


def command_for(runs: dict, argv: list[str]) -> str:
    """This call's command line with ``--arms`` naming every arm in the report (arms may come from several calls)."""
    argv, arms = list(argv), ",".join(arm for arm in ARMS if arm in runs)
    for i, a in enumerate(argv):
        if a == "--arms" and i + 1 < len(argv):
            argv[i + 1] = arms
        elif a.startswith("--arms="):
            argv[i] = f"--arms={arms}"
    if not any(a == "--arms" or a.startswith("--arms=") for a in argv):
        argv[:0] = ["--arms", arms]
    return " ".join(["python bench/bench_trl_peer.py", *argv])


def print_table(report: dict) -> None:
    s = report["settings"]
    print(f"\n{s['model']}, {s['prompts']} prompts x G={s['group_size']}, {s['new_tokens']} new tokens (fixed), "
          f"{report['device']}")
    print(f"{'arm':18}{'rollout s':>11}{'(generate)':>11}{'train s':>10}{'step s':>10}{'peak GB':>9}"
          f"{'device GB':>10}{'x qerl nvfp4':>13}{'logp gap':>10}{'IS weight':>10}{'grad norm':>10}{'base drift':>11}")
    fmt = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in report["rows"]:
        if "error" in r:
            print(f"{r['arm']:18}  failed: {r['error'][:100]}")
            continue
        print(f"{r['arm']:18}{fmt(r.get('rollout_s')):>11}{fmt(r.get('generate_s')):>11}{fmt(r.get('train_s')):>10}"
              f"{fmt(r.get('step_s')):>10}{fmt(r.get('peak_gb'), 1):>9}{fmt(r.get('device_peak_gb'), 1):>10}"
              f"{fmt(r.get('step_over_qerl_nvfp4')):>13}{fmt(r.get('logp_gap'), 4):>10}"
              f"{fmt(r.get('is_weight_mean'), 3):>10}{fmt(r.get('grad_norm'), 4):>10}"
              f"{'-' if r.get('base_drift') is None else format(r['base_drift'], '.1e'):>11}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a directory with the embedded model's tokenizer (not with --tiny)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--arms", default="trl,qerl_nvfp4,qerl_bf16,qerl_vllm_nvfp4,qerl_vllm_bf16",
                        help=f"comma-separated, run in this order: {', '.join(ARMS)}; none: write the models only")
    parser.add_argument("--size", default="qwen2.5-7b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="prompt cap; vLLM's max_model_len adds it")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per arm; the first is a warm-up")
    parser.add_argument("--trl-micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size (rows)")
    parser.add_argument("--trl-checkpointing", type=lambda v: v.lower() == "true", default=True,
                        help="TRL's gradient_checkpointing (its default: true)")
    parser.add_argument("--trl-sleep", type=lambda v: v.lower() == "true", default=True,
                        help="vllm_enable_sleep_mode (TRL's advice against out-of-memory)")
    parser.add_argument("--vllm-gpu-memory-utilization", type=lambda v: v if v == "auto" else float(v),
                        default="auto", help="TRL's vllm_gpu_memory_utilization (auto: weights + full KV + 4 GiB)")
    parser.add_argument("--micro-batch", type=int, default=64, help="qerl's micro_batch_size")
    parser.add_argument("--micro-batch-tokens", type=lambda v: v if v == "auto" else int(v), default="auto")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen2 instead of --size (CPU check)")
    parser.add_argument("--no-vllm", action="store_true", help="TRL samples with transformers' generate")
    parser.add_argument("--in-process", action="store_true", help="run the arms in this process (CPU check)")
    parser.add_argument("--work", default="/tmp/qerl_e2e")
    parser.add_argument("--parts", default=None, help="where each arm's result is kept (default: WORK/trl_peer_<n>tok)")
    parser.add_argument("--keep", default=None,
                        help="an earlier report (bench/results/trl_peer_*.json): its arms of the same settings join "
                             "this call's where this machine has not run them (each keeps its date and kept_from)")
    parser.add_argument("overrides", nargs="*", help="more train.py options for qerl's arms (after --)")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a and a != "none"]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; use some of {list(ARMS)}")
    if args.device == "cpu" and [a for a in arms if a not in TRAINERS]:
        parser.error("--device cpu runs the TRL arms only (qerl's engines need CUDA): use --arms trl")
    if not args.tiny and not args.tokenizer:
        parser.error("--tokenizer DIR is needed (or --tiny)")
    work = Path(args.work)
    parts = Path(args.parts) if args.parts else work / f"trl_peer_{args.new_tokens}tok"
    parts.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        from qerl.testing.tiny_models import save_tiny_model

        model = "tiny-qwen2"
        dirs = {"bf16": work / model}
        if not (dirs["bf16"] / "config.json").exists():
            save_tiny_model(dirs["bf16"], "qwen2", dtype=__import__("torch").float32)
    else:
        from transformers import AutoTokenizer

        from bench_train_e2e import write_models

        model = args.size
        vocab = len(AutoTokenizer.from_pretrained(args.tokenizer))
        dirs = {q: work / f"{args.size}-{q}" for q in ("nvfp4", "bf16")}
        if not all((d / "config.json").exists() for d in dirs.values()):  # an earlier call on this machine wrote them
            dirs = write_models(args.size, args.tokenizer, work, vocab)
    if not arms:  # --arms none: only the checkpoints (a call of its own ahead of the arms)
        print(f"models in {work}; no arm run")
        return
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    opts = {"device": args.device, "prompts": args.prompts, "group_size": args.group_size,
            "new_tokens": args.new_tokens, "max_prompt_tokens": args.max_prompt_tokens, "steps": args.steps,
            "trl_micro_batch": args.trl_micro_batch, "checkpointing": args.trl_checkpointing, "sleep": args.trl_sleep,
            "vllm_gpu_memory_utilization": args.vllm_gpu_memory_utilization, "no_vllm": args.no_vllm,
            "micro_batch": args.micro_batch, "micro_batch_tokens": args.micro_batch_tokens, "work": str(work),
            "overrides": args.overrides}
    settings = {"model": model, "prompts": args.prompts, "group_size": args.group_size,
                "new_tokens": args.new_tokens, "lengths": "fixed", "steps": args.steps, "lora_rank": 16,
                "trl_micro_batch": args.trl_micro_batch, "qerl_micro_batch_tokens": args.micro_batch_tokens}
    if args.keep:  # before the arms run: an arm run here replaces the kept one
        for arm, run in json.loads(Path(args.keep).read_text()).get("runs", {}).items():
            if arm in ARMS and arm not in arms and not (parts / f"{arm}.json").exists():
                (parts / f"{arm}.json").write_text(json.dumps({**run, "kept_from": args.keep}, indent=2))
    for arm in arms:
        print(f"=== {arm}", flush=True)
        result = run_arm(arm, dirs, opts, own_process=not args.in_process)
        result.update(device=device, command=" ".join(sys.argv), settings=settings)
        (parts / f"{arm}.json").write_text(json.dumps(result, indent=2, default=str))
        print(f"{arm}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items() if isinstance(v, float)), flush=True)
        if "error" in result:
            print(f"{arm} failed: {result['error']}\n{result.get('traceback', '')}", flush=True)
    report = merge(parts, settings)
    report["command"] = command_for(report["runs"], argv if argv is not None else sys.argv[1:])
    print_table(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if args.device == "cpu" else (device.split()[1].lower() if len(device.split()) > 1 else "gpu")
    path = out / f"trl_peer_{tag}{'' if args.new_tokens == 2048 else f'_{args.new_tokens}tok'}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
