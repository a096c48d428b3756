"""Reading a run folder: what it trained, from which weights, how it scored (yaml, json, safetensors headers, event
files: cheap), every input checked before any weight is read; and qerl's own trained policy built from it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qerl.hub import resolve_model
from qerl.model.policy import PolicyConfig

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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
        state = read_checkpoint(checkpoint)
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
        steps = read_checkpoint(last).get("global_step") if adapter is None and last.is_file() else None
    val_scores, val_step = last_validation_scores(directory)
    return TrainedRun(directory, config, policy, Path(policy.adapter) if policy.adapter else None, checkpoint, steps,
                      val_scores, val_step)


def read_checkpoint(path: Path) -> dict:
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


def load_trained_policy(run: TrainedRun, dtype: str = "float32", device: str = "cpu"):
    """qerl's own policy (PeftModel on the run's base) with the trained weights of ``run``, in eval mode."""
    policy = dataclasses.replace(run.policy, dtype=dtype, gradient_checkpointing=False).build(device)
    if run.checkpoint is not None:
        state = {k.removeprefix("policy."): v for k, v in read_checkpoint(run.checkpoint)["state_dict"].items()}
        unexpected = policy.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"--ckpt {run.checkpoint}: {len(unexpected)} tensors ({unexpected[0]}, ...) are not in "
                             "the policy that model.policy.* builds; export it with the run that wrote it.")
    policy.eval()
    return policy


def rollout_length(run: TrainedRun) -> int:
    """The run's completion budget (``model.sampling.max_new_tokens``)."""
    model = run.config.get("model") or {}
    before = ((model.get("rollout") or {}).get("init_args") or {}).get("max_new_tokens")  # a run saved before the move
    return int((model.get("sampling") or {}).get("max_new_tokens", before or 256))
