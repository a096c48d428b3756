"""Export a trained run to a folder that vLLM or transformers serve as it is (and ``huggingface_hub.upload_folder``
uploads as it is).

    python -m qerl.export --run runs/smoke/version_0 --output smoke-vllm                      # vLLM: base + LoRA
    python -m qerl.export --run runs/smoke/version_0 --output smoke-bf16 --format merged-bf16  # plain transformers
    python -m qerl.export --run runs/smoke/version_0 --ckpt last.ckpt --output smoke-nvfp4 --format merged-nvfp4

Formats (the trained RMSNorm weights are full modules, which vLLM's LoRA loader refuses, so they always go into the
base weights):

    vllm          the run's base checkpoint (NVFP4 linears byte-identical to ``python -m qerl.quantize``) with the
                  trained norms written in, and ``adapter/`` holding only the LoRA matrices
    merged-bf16   LoRA merged (in fp32) into the dequantized weights, trained norms in place: a plain model
    merged-nvfp4  merged-bf16 quantized again by ``qerl.quantize``; the error this adds is measured per layer and as
                  the greedy-answer agreement with the trained policy on the run's validation questions

Every export carries the tokenizer with its chat template, a generation config, the run's ``config.yaml`` and a
model card (README.md) with the serve command, the training steps and the run's last validation scores.
Bad input (no adapter, an adapter of another base) is refused by ``read_run`` before any weight is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from qerl.hub import load_tokenizer, resolve_model
from qerl.model.checkpoint_io import DEFAULT_TARGETS, load_model
from qerl.model.policy import DTYPES, PolicyConfig, quiet_custom_layers, with_lora_layers
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint, save_nvfp4
from qerl.nvfp4.format import dequantize
from qerl.nvfp4.linear import NVFP4Linear
from qerl.quantize import exit_status, quantize_checkpoint
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.rollout.vllm import vllm_lora_rank

FORMATS = ("vllm", "merged-bf16", "merged-nvfp4")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
SERVED_NAME = "policy"  # the LoRA name in the serve command (the `model` field of requests)
# The held-out questions of configs/smoke.yaml: the agreement check's questions when the run validated on none.
DEFAULT_VAL_SOURCE = {"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"seed": 1234, "num_rows": 24}}


@dataclass
class TrainedRun:
    """What a run folder says about the policy it trained (read without loading any weight)."""

    directory: Path
    config: dict  # the run's config.yaml (LightningCLI's resolved config)
    policy: PolicyConfig  # model.policy, with ``adapter`` set when the weights come from an adapter folder
    adapter: Path | None  # the PEFT adapter folder the trained weights come from, or None (then ``checkpoint``)
    checkpoint: Path | None  # the Lightning checkpoint the trained weights come from, or None (then ``adapter``)
    steps: int | None  # optimizer steps behind the exported weights
    val_scores: dict[str, float] = field(default_factory=dict)  # last value of every val/* scalar
    val_step: int | None = None  # the logged step of those values

    @property
    def lora_rank(self) -> int:
        return self.policy.lora_rank


# --------------------------------------------------------------------------------------------------------------
# Reading a run (cheap: yaml, json, safetensors headers, event files).


def read_run(run: str | Path, ckpt: str | Path | None = None, adapter: str | Path | None = None) -> TrainedRun:
    """Check the run folder and the trained weights against the run's base model and describe them.

    Raises ValueError / FileNotFoundError naming the option, the problem and the fix.
    """
    import yaml

    directory = Path(run)
    if not (directory / "config.yaml").is_file():
        raise FileNotFoundError(
            f"--run {run}: no config.yaml there. Point --run at the folder `python train.py fit` wrote "
            "(runs/<name>/version_<k>, holding config.yaml, adapter/ and checkpoints/)."
        )
    if ckpt is not None and adapter is not None:
        raise ValueError("--ckpt and --adapter both given: the trained weights come from one of them; pass one.")
    config = yaml.safe_load((directory / "config.yaml").read_text())
    raw_policy = dict((config.get("model") or {}).get("policy") or {})
    if "lora_targets" in raw_policy:
        raw_policy["lora_targets"] = tuple(raw_policy["lora_targets"])
    policy = PolicyConfig(**raw_policy)
    checkpoint = None
    if ckpt is not None:
        checkpoint = Path(ckpt)
        if not checkpoint.is_file() and (directory / "checkpoints" / ckpt).is_file():
            checkpoint = directory / "checkpoints" / ckpt
        if not checkpoint.is_file():
            raise FileNotFoundError(
                f"--ckpt {ckpt}: no such file (looked there and in {directory / 'checkpoints'}). Pass a file name from "
                f"that folder, e.g. --ckpt last.ckpt."
            )
        state = _checkpoint(checkpoint)
        trained = {k.removeprefix("policy."): v.shape for k, v in state["state_dict"].items()}
        steps = state.get("global_step")
        _check_fits_base(trained, policy, f"--ckpt {checkpoint}")
        # The checkpoint holds the trained tensors only; their LoRA config is the run's (model.policy.*).
        policy = dataclasses.replace(policy, adapter=None)
    else:
        folder = Path(adapter) if adapter is not None else directory / "adapter"
        option = f"--adapter {adapter}" if adapter is not None else f"--run {run}"
        missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
        if missing:
            saved = sorted((p.name for p in (directory / "checkpoints").glob("*.ckpt")), key=lambda n: n != "last.ckpt")
            hint = f"pass --ckpt {saved[0]} (found in checkpoints/)" if saved else "train until a checkpoint is saved"
            raise FileNotFoundError(
                f"{option}: {folder} has no PEFT adapter ({', '.join(missing)} missing). The adapter is written with "
                f"each checkpoint of `train.py fit`; {hint}, or pass --adapter DIR."
            )
        trained = _safetensors_shapes(folder / "adapter_model.safetensors")
        adapter_config = json.loads((folder / "adapter_config.json").read_text())
        _check_fits_base(trained, policy, option)
        policy = dataclasses.replace(
            policy, adapter=str(folder), lora_rank=int(adapter_config["r"]),
            lora_alpha=float(adapter_config["lora_alpha"]),
        )
        last = directory / "checkpoints" / "last.ckpt"
        steps = _checkpoint(last).get("global_step") if adapter is None and last.is_file() else None
    val_scores, val_step = last_validation_scores(directory)
    return TrainedRun(directory, config, policy, Path(policy.adapter) if policy.adapter else None, checkpoint, steps,
                      val_scores, val_step)


def _checkpoint(path: Path) -> dict:
    # A qerl checkpoint holds the trainable tensors, their optimizer state and small Python objects (RNG states).
    return torch.load(path, map_location="cpu", weights_only=False)


def _safetensors_shapes(path: Path) -> dict[str, torch.Size]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: torch.Size(f.get_slice(k).get_shape()) for k in f.keys()}


def _check_fits_base(trained: dict[str, torch.Size], policy: PolicyConfig, option: str) -> None:
    """Every trained tensor (PEFT adapter keys or a checkpoint's policy keys) must sit on a module of the run's base
    model with a matching shape. Builds the base on the meta device from its config.json: nothing is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model(policy.model)
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    modules = dict(skeleton.named_modules())
    fix = (f"export the adapter with the run that trained it (--run), or train one on {policy.model} "
           "(the run's model.policy.model)")
    if not trained:
        raise ValueError(f"{option}: holds no trained tensor; {fix}.")
    for key, shape in trained.items():
        module_name, kind = _trained_module(key)
        module = modules.get(module_name)
        if module is None:
            raise ValueError(f"{option} does not fit the base model {policy.model}: it trains {module_name}, which the "
                             f"base has not; {fix}.")
        if kind == "lora_A":
            fits = shape[-1] == module.in_features
        elif kind == "lora_B":
            fits = shape[0] == module.out_features
        else:
            fits = tuple(shape) == tuple(module.weight.shape)
        if not fits:
            raise ValueError(f"{option} does not fit the base model {policy.model}: {key} has shape {tuple(shape)}, "
                             f"which does not fit {module_name} ({module}); {fix}.")


def _trained_module(key: str) -> tuple[str, str]:
    """A trained tensor's key (``base_model.model.<module>.lora_A[.default].weight`` in an adapter or a checkpoint,
    ``...<module>[.modules_to_save.default].weight`` for a norm) -> (module name in the base model, kind)."""
    name = key.removeprefix("base_model.model.").removesuffix(".weight").removesuffix(".default")
    for kind in ("lora_A", "lora_B"):
        if name.endswith("." + kind):
            return name.removesuffix("." + kind), kind
    return name.removesuffix(".modules_to_save"), "module"


def last_validation_scores(directory: Path) -> tuple[dict[str, float], int | None]:
    """The last value of every ``val/*`` scalar in the run's TensorBoard event files, and the step it was logged at."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not any(directory.glob("events.out.tfevents.*")):
        return {}, None
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    scores, step = {}, None
    for tag in events.Tags()["scalars"]:
        if tag.startswith("val/"):
            last = events.Scalars(tag)[-1]
            scores[tag], step = last.value, max(step or 0, last.step)
    return scores, step


# --------------------------------------------------------------------------------------------------------------
# The trained policy and the questions it is checked on.


def load_trained_policy(run: TrainedRun, dtype: str = "float32", device: str = "cpu"):
    """qerl's own policy (PeftModel on the run's base) with the trained weights of ``run``, in eval mode."""
    policy = dataclasses.replace(run.policy, dtype=dtype, gradient_checkpointing=False).build(device)
    if run.checkpoint is not None:
        state = {k.removeprefix("policy."): v for k, v in _checkpoint(run.checkpoint)["state_dict"].items()}
        unexpected = policy.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"--ckpt {run.checkpoint}: {len(unexpected)} tensors ({unexpected[0]}, ...) are not in "
                             "the policy that model.policy.* builds; export it with the run that wrote it.")
    policy.eval()
    return policy


def validation_questions(run: TrainedRun, tokenizer, max_questions: int | None = None) -> tuple[list, list[str]]:
    """(prompt token ids, reference answers) of the run's validation sources, formatted as the run formatted them;
    the held-out arithmetic questions of configs/smoke.yaml when the run had none."""
    from jsonargparse import ArgumentParser

    from qerl.data.prompts import MathPromptDataModule

    data = dict(run.config.get("data") or {})
    data["val_sources"] = data.get("val_sources") or [DEFAULT_VAL_SOURCE]
    data["num_workers"] = 0
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MathPromptDataModule, "data")
    module = parser.instantiate(parser.parse_object({"data": data})).data
    module.tokenizer = tokenizer
    prompts, answers = [], []
    for loader in module.val_dataloader():
        for batch in loader:
            prompts += batch["prompt_ids"]
            answers += batch["answers"]
    return prompts[:max_questions], answers[:max_questions]


def greedy_completions(model, tokenizer, prompts: list, max_new_tokens: int) -> list[list[int]]:
    """Greedy completions (token ids up to and including EOS) with the engine ``train.py validate`` uses."""
    engine = BuiltinRollout()
    eos = sorted({tokenizer.eos_token_id, *_as_list(getattr(model.generation_config, "eos_token_id", None))} - {None})
    spec = SamplingSpec(max_new_tokens=max_new_tokens, greedy=True, stream="separate")
    rollout = engine.generate(model, prompts, 1, tokenizer.pad_token_id, eos, spec)
    return [ids[mask.bool()].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def rollout_length(run: TrainedRun) -> int:
    """The run's completion budget (``model.sampling.max_new_tokens``)."""
    model = run.config.get("model") or {}
    before = ((model.get("rollout") or {}).get("init_args") or {}).get("max_new_tokens")  # a run saved before the move
    return int((model.get("sampling") or {}).get("max_new_tokens", before or 256))


# --------------------------------------------------------------------------------------------------------------
# The formats.


def lora_only_adapter(policy, output: Path) -> Path:
    """Write the policy's LoRA matrices, without the trained norms, as a PEFT adapter vLLM loads."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    output.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(policy).items() if ".lora_" in k}
    config = dataclasses.replace(policy.peft_config["default"], modules_to_save=None)
    config.base_model_name_or_path = str(output.parent.resolve())  # the exported base beside it
    config.save_pretrained(str(output))
    save_file(state, str(output / "adapter_model.safetensors"), metadata={"format": "pt"})
    return output


def unload_adapter(policy) -> nn.Module:
    """The base model with the trained norms in place of the original ones and no LoRA (peft's ``unload`` keeps the
    trained copy of each ``modules_to_save`` module)."""
    return policy.unload()


def merge_adapter(policy) -> nn.Module:
    """A plain transformers model: every LoRA merged into its dequantized base weight in fp32 (peft's own merge, once
    each NVFP4Linear is replaced by the dense Linear it stands for), trained norms in place."""
    from peft.tuners.lora import LoraLayer

    for module in policy.modules():
        if isinstance(module, LoraLayer) and isinstance(module.get_base_layer(), NVFP4Linear):
            module.base_layer = dense_linear(module.get_base_layer())
    return policy.float().merge_and_unload(safe_merge=True)


def dense_linear(layer: NVFP4Linear) -> nn.Linear:
    """The fp32 ``nn.Linear`` whose weight is the NVFP4 layer's dequantized weight."""
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    dense.weight = nn.Parameter(layer.dequantize(torch.float32), requires_grad=False)
    if layer.bias is not None:
        dense.bias = nn.Parameter(layer.bias.detach().float(), requires_grad=False)
    return dense


def requantization_error(merged_dir: Path, nvfp4_dir: Path) -> dict[str, float]:
    """Per quantized layer: ``||dequant(Q(W)) - W|| / ||W||`` for the merged weight W and its NVFP4 re-quantization."""
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        handles = [safe_open(str(f), framework="pt") for f in sorted(folder.glob("*.safetensors"))]
        return {k: h for h in handles for k in h.keys()}

    merged, quantized = tensors(merged_dir), tensors(nvfp4_dir)
    errors = {}
    for key in sorted(quantized):
        if not key.endswith(".weight_packed"):
            continue
        layer = key.removesuffix(".weight_packed")
        w = merged[f"{layer}.weight"].get_tensor(f"{layer}.weight").float()
        q = dequantize(*(quantized[f"{layer}.{k}"].get_tensor(f"{layer}.{k}")
                         for k in ("weight_packed", "weight_scale", "weight_global_scale")), dtype=torch.float32)
        errors[layer] = float((q - w).norm() / w.norm().clamp(min=torch.finfo(torch.float32).tiny))
    return errors


@dataclass
class Agreement:
    """Greedy answers of the export against the trained policy's, on the same questions."""

    questions: int
    same_completion: int  # token-identical completions
    policy_correct: int
    export_correct: int
    differing: list[int]  # indices of the questions whose completions differ

    def line(self) -> str:
        return (f"greedy agreement with the trained policy: {self.same_completion}/{self.questions} completions "
                f"identical; correct answers {self.export_correct} (export) vs {self.policy_correct} (policy)")


def agreement(policy_completions, export_completions, answers, tokenizer, reward=None) -> Agreement:
    from qerl.data.rewards import MathReward

    reward = reward or MathReward(num_workers=1)
    texts = [tokenizer.batch_decode(c, skip_special_tokens=True) for c in (policy_completions, export_completions)]
    correct = [int(reward.check(t, answers)[0].sum()) for t in texts]
    differing = [i for i, (a, b) in enumerate(zip(policy_completions, export_completions)) if a != b]
    return Agreement(len(answers), len(answers) - len(differing), correct[0], correct[1], differing)


def _reward(run: TrainedRun):
    from jsonargparse import ArgumentParser

    from qerl.data.rewards import MathReward

    reward = (run.config.get("model") or {}).get("reward")
    if not reward:
        return MathReward(num_workers=1)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(MathReward, "reward")
    return parser.instantiate(parser.parse_object({"reward": reward})).reward


# --------------------------------------------------------------------------------------------------------------
# The export.


def export(
    run: str | Path,
    output: str | Path,
    format: str = "vllm",
    ckpt: str | None = None,
    adapter: str | None = None,
    dtype: str = "bfloat16",
    check: bool | None = None,
    max_questions: int | None = None,
    max_new_tokens: int | None = None,
    force: bool = False,
    log=print,
) -> dict:
    """Write ``run``'s trained policy to ``output`` in ``format``; returns the export report (also export.json).

    ``check`` (default: on for ``merged-nvfp4``) decodes the validation questions greedily with the trained policy
    and with the export and counts the completions that differ.
    """
    if format not in FORMATS:
        raise ValueError(f"--format {format!r}: use one of {', '.join(FORMATS)}.")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not (force and (output / "export.json").is_file()):
        raise FileExistsError(
            f"--output {output} is not empty; choose another folder"
            + (" (--force replaces an earlier export only, and this folder holds none)." if force
               else ", or pass --force to replace the export there."))
    trained = read_run(run, ckpt, adapter)  # every input check, before any weight is read
    check = format == "merged-nvfp4" if check is None else check
    tokens = max_new_tokens or rollout_length(trained)
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    tokenizer = load_tokenizer(trained.policy.model)
    policy = load_trained_policy(trained, dtype)
    report: dict = {"format": format, "dtype": dtype, "run": str(Path(run).resolve()), "steps": trained.steps,
                    "weights": str(trained.checkpoint or trained.adapter)}
    if check:
        prompts, answers = validation_questions(trained, tokenizer, max_questions)
        log(f"decoding {len(prompts)} validation questions greedily with the trained policy")
        reference = greedy_completions(policy, tokenizer, prompts, tokens)

    if format == "vllm":
        write_vllm(policy, output, tokenizer, quantized=trained.policy.quantization == "nvfp4")
        report["lora_rank"] = trained.lora_rank
    else:
        requantize = trained.policy.lora_targets if format == "merged-nvfp4" else None
        report.update(write_merged(policy, output, tokenizer, dtype, requantize, log))
    del policy
    tokenizer.save_pretrained(output)
    write_generation_config(output, tokenizer, rollout_length(trained))

    if check:
        model = load_export(output, format, dtype)
        result = agreement(reference, greedy_completions(model, tokenizer, prompts, tokens), answers, tokenizer,
                           _reward(trained))
        report["agreement"] = dataclasses.asdict(result)
        log(result.line())
    (output / "training_config.yaml").write_text((trained.directory / "config.yaml").read_text())
    (output / "export.json").write_text(json.dumps(report, indent=2))
    (output / "README.md").write_text(model_card(trained, output, format, report))
    if format == "vllm":
        log(serve_command(output, trained.lora_rank, served_dtype(trained, dtype)))
    else:
        log(f"wrote {output}: load it with AutoModelForCausalLM.from_pretrained({str(output)!r})"
            if format == "merged-bf16" else f"wrote {output}: vllm serve {output.resolve()}")
    return report


def write_vllm(policy, output: Path, tokenizer, quantized: bool = True) -> None:
    """The base with the trained norms (NVFP4 when ``quantized``) and ``adapter/`` with the LoRA matrices only."""
    lora_only_adapter(policy, output / "adapter")
    base = unload_adapter(policy)
    if quantized:
        save_nvfp4(base, output, tokenizer=tokenizer)
    else:
        base.save_pretrained(output)


def write_merged(policy, output: Path, tokenizer, dtype: str, requantize: tuple[str, ...] | None = None,
                 log=print) -> dict:
    """The merged model in ``dtype``; with ``requantize`` (target layer names) quantized again to NVFP4, returning
    ``{"relative_error": {layer: error}}``."""
    merged = merge_adapter(policy).to(DTYPES[dtype])
    if requantize is None:
        merged.save_pretrained(output)
        return {}
    with tempfile.TemporaryDirectory(prefix="qerl-merged-") as folder:
        merged.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del merged
        quantize_checkpoint(folder, output, requantize, force=True, log=lambda line: None)
        errors = requantization_error(Path(folder), output)
    for layer, error in errors.items():
        log(f"re-quantization error {layer}: {error:.4%}")
    values = list(errors.values())
    log(f"re-quantization error over {len(values)} layers: mean {sum(values) / len(values):.4%}, max {max(values):.4%}")
    return {"relative_error": errors}


def load_export(output: str | Path, format: str, dtype: str = "float32"):
    """The exported model as its users load it: transformers for ``merged-bf16``; for the NVFP4 formats qerl's NVFP4
    loader (transformers has no NVFP4 kernel), with the adapter through peft for ``vllm``."""
    output = Path(output)
    if format == "merged-bf16":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(output, dtype=DTYPES[dtype]).eval()
    if not is_nvfp4_checkpoint(output):  # the vllm format of a run trained on a bf16 base
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(output, dtype=DTYPES[dtype])
    else:
        base = load_model(str(output), "nvfp4", _quantized_targets(output), DTYPES[dtype])
    if format == "merged-nvfp4":
        return base
    from peft import LoraConfig, PeftModel

    config = with_lora_layers(LoraConfig.from_pretrained(str(output / "adapter")))
    with quiet_custom_layers():
        return PeftModel.from_pretrained(base, str(output / "adapter"), config=config).eval()


def _quantized_targets(output: Path) -> tuple[str, ...]:
    from safetensors import safe_open

    leaves = set()
    for f in output.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            leaves |= {k.removesuffix(".weight_packed").rsplit(".", 1)[-1] for k in handle.keys()
                       if k.endswith(".weight_packed")}
    return tuple(sorted(leaves)) or DEFAULT_TARGETS


def write_generation_config(output: Path, tokenizer, max_new_tokens: int) -> None:
    """generation_config.json that stops at the chat template's end of turn and pads with the tokenizer's pad."""
    from transformers import AutoConfig, GenerationConfig

    if (output / "generation_config.json").exists():
        generation = GenerationConfig.from_pretrained(output)
    else:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(output))
    eos = sorted({tokenizer.eos_token_id, *_as_list(generation.eos_token_id)} - {None})
    generation.eos_token_id = eos[0] if len(eos) == 1 else eos
    generation.pad_token_id = tokenizer.pad_token_id
    generation.max_new_tokens = max_new_tokens
    generation.save_pretrained(output)


def served_dtype(run: TrainedRun, dtype: str) -> str | None:
    """The ``--dtype`` the serve line must name: ``float32`` for a dense float32 base, which vLLM's ``auto`` would
    run in bfloat16 (it downcasts float32 checkpoints); None where ``auto`` takes the checkpoint's own dtype."""
    return "float32" if dtype == "float32" and run.policy.quantization != "nvfp4" else None


def serve_command(output: Path, rank: int, dtype: str | None = None) -> str:
    directory = output.resolve()
    return (f"vllm serve {directory} --enable-lora --lora-modules {SERVED_NAME}={directory / 'adapter'} "
            f"--max-lora-rank {vllm_lora_rank(rank)}" + (f" --dtype {dtype}" if dtype else ""))


def model_card(run: TrainedRun, output: Path, format: str, report: dict) -> str:
    """README.md: how to serve the export, what trained it, how it scored, what the export changed."""
    import yaml

    directory = output.resolve()
    policy = (run.config.get("model") or {}).get("policy") or {}
    library = "peft" if format == "vllm" else "transformers"
    quantized = format == "merged-nvfp4" or (format == "vllm" and run.policy.quantization == "nvfp4")
    lines = ["---", f"library_name: {library}", "tags: [qerl, grpo, lora"
             + (", nvfp4, compressed-tensors" if quantized else "") + "]", "---", "",
             f"# {run.directory.parent.name}/{run.directory.name} ({format})", "",
             f"Trained with qerl (GRPO/DAPO on {policy.get('quantization', 'nvfp4')} base weights + LoRA) from "
             f"`{policy.get('model')}`; exported with `python -m qerl.export --format {format}`.", "", "## Serve", ""]
    if format == "vllm":
        rank = vllm_lora_rank(run.lora_rank)
        dtype = served_dtype(run, report["dtype"])
        lines += [
            "The base checkpoint holds the trained RMSNorm weights; `adapter/` holds the LoRA matrices only.", "",
            "```bash", serve_command(output, run.lora_rank, dtype), "```", "",
            f"Requests name the adapter as the model: `\"model\": \"{SERVED_NAME}\"`. The same in Python:", "",
            "```python", "from vllm import LLM, SamplingParams", "from vllm.lora.request import LoRARequest", "",
            f"llm = LLM(model={str(directory)!r}, enable_lora=True, max_lora_rank={rank}"
            + (f", dtype={dtype!r})" if dtype else ")"),
            f"policy = LoRARequest({SERVED_NAME!r}, 1, {str(directory / 'adapter')!r})",
            "outputs = llm.chat([{\"role\": \"user\", \"content\": \"What is 3 + 5?\"}], "
            "SamplingParams(temperature=0, max_tokens=256), lora_request=policy)", "```"]
    else:
        lines += ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f"model = AutoModelForCausalLM.from_pretrained({str(directory)!r})",
                  f"tokenizer = AutoTokenizer.from_pretrained({str(directory)!r})", "```", "",
                  f"or `vllm serve {directory}`"
                  + (" (transformers reads the NVFP4 weights through compressed-tensors)." if format == "merged-nvfp4"
                     else ".")]
    lines += ["", "## Training", "",
              f"- steps: {run.steps if run.steps is not None else 'unknown (no checkpoint beside the adapter)'}",
              f"- trained weights: `{report['weights']}`", "- config (the run's config.yaml, in full in "
              "`training_config.yaml`):", "", "```yaml", yaml.safe_dump({"model": run.config.get("model")},
                                                                      sort_keys=False).rstrip(), "```", "",
              "## Validation (the run's last scores)", ""]
    if run.val_scores:
        lines += [f"Logged at step {run.val_step} of the run's TensorBoard curves:", "", "| metric | value |",
                  "|---|---|"]
        lines += [f"| {tag} | {value:.4f} |" for tag, value in sorted(run.val_scores.items())]
    else:
        lines += ["The run logged no validation scores (`val/*`)."]
    if "relative_error" in report:
        values = list(report["relative_error"].values())
        lines += ["", "## Re-quantization", "",
                  f"The merged weights were quantized to NVFP4 again: relative error per layer "
                  f"mean {sum(values) / len(values):.4%}, max {max(values):.4%} (all layers in `export.json`)."]
    if "agreement" in report:
        a = report["agreement"]
        lines += ["", f"Greedy completions on {a['questions']} validation questions: {a['same_completion']} identical "
                      f"to the trained policy's; correct {a['export_correct']} (export) vs {a['policy_correct']} "
                      "(policy)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl.export", description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="the run folder: runs/<name>/version_<k>")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--ckpt", help="take the trained weights from this checkpoint (a file in checkpoints/)")
    weights.add_argument("--adapter", help="take them from this PEFT adapter folder (default: the run's adapter/)")
    parser.add_argument("--output", required=True, help="the export folder")
    parser.add_argument("--format", default="vllm", choices=FORMATS, help="what to write (default: vllm)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of the dense weights")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare greedy answers of the export and the policy (default: on for merged-nvfp4)")
    parser.add_argument("--max-questions", type=int, help="check on at most this many validation questions")
    parser.add_argument("--max-new-tokens", type=int, help="completion length of the check (default: the run's)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    args = parser.parse_args(argv)
    return exit_status(lambda: export(args.run, args.output, args.format, args.ckpt, args.adapter, args.dtype,
                                      args.check, args.max_questions, args.max_new_tokens, args.force))


if __name__ == "__main__":
    sys.exit(main())
