"""The command line: ``python train.py fit|validate|test --config configs/x.yaml [--model.lr 2e-5 ...]``.

A user's mistake (an unknown or misspelled option, a value of the wrong type or out of range, a data file that cannot
be used) ends the command before any model or data loads, with one short ``error:`` line that names the option, the
value and the fix, and exit code 2 as argparse uses; no traceback.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from qerl.callbacks.entropy_logging import EntropyLogger
from qerl.callbacks.interrupt import GracefulInterrupt
from qerl.callbacks.noise_annealing import AdaptiveQuantizationNoise
from qerl.callbacks.progress import StepProgressBar
from qerl.callbacks.rollout_sync import RolloutSync
from qerl.callbacks.scalar_layout import ScalarLayout
from qerl.data.prompts import MathPromptDataModule
from qerl.hub import EMBEDDED_MODEL, hub_unavailable, load_config
from qerl.model.memory_plan import GIB, MemoryPlanError, ModelShape, RunSettings, plan_memory
from qerl.modules.grpo_module import GRPOModule
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.cuda_graph import CUDAGraphRollout


class QeRLArgumentParser(LightningArgumentParser):
    """Errors as one line (``error: ...``) instead of the full usage, with the closest valid option for a typo."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
        hints = []
        for unknown in re.findall(r"(?:--|[Kk]ey \"|option ')([\w.]+)", message):
            unknown = unknown if unknown.startswith("--") else f"--{unknown}"
            close = difflib.get_close_matches(unknown, options, n=1, cutoff=0.6) if unknown not in options else []
            if close:
                hints.append(f"did you mean {close[0]}?")
        hints += init_arg_hints(message)
        hint = f" ({'; '.join(hints)})" if hints else ""
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {short_error(message)}{hint}\nAll options: {prog} --help\n")
        self.exit(2)


def init_arg_hints(message: str) -> list[str]:
    """``did you mean eps_low?`` for an init argument a class given by ``class_path`` does not take."""
    owner = re.search(r"class_path '([\w.]+)'", message)
    unknown = re.findall(r"Option '(\w+)' is not accepted", message)
    if not owner or not unknown:
        return []
    module, _, name = owner[1].rpartition(".")
    try:
        accepted = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [f"did you mean {close[0]}?" for u in unknown if (close := difflib.get_close_matches(u, accepted, n=1))]


def short_error(message: str) -> str:
    """The part of a jsonargparse error that says what is wrong: the first reason of a union's errors (not the
    ``None`` alternative's) with the option it concerns, or a type error as ``option=value: expected <type>``."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    key = re.match(r'Parser key "([\w.]+)":', lines[0].strip()) if lines else None
    reasons = []
    for i, line in enumerate(lines):
        if line.strip().startswith("- "):
            indent, parts = len(line) - len(line.lstrip()), [line.strip()[2:]]
            for more in lines[i + 1 :]:
                if len(more) - len(more.lstrip()) <= indent:
                    break
                parts.append(more.strip())
            reasons.append(" ".join(parts))
    reasons = [r for r in reasons if not r.startswith("Expected a <class 'NoneType'>")]
    if reasons:
        return (f"{key[1]}: " if key and not reasons[0].startswith(key[1]) else "") + reasons[0]
    text = " ".join(line.strip() for line in lines)
    typed = re.match(r'Parser key "([\w.]+)": Expected a <class \'(\w+)\'>\. Got value: (.*)', text)
    if typed:
        return f"{typed[1]}={typed[3]}: expected a value of type {typed[2]}."
    return " ".join(line.strip() for line in lines[:2]) if lines else "invalid arguments"


class QeRLCLI(LightningCLI):
    """LightningCLI with the RL callbacks always present (a second ``--config`` replaces a YAML callback list, so
    they are not in it), the tokenizer taken from the policy and the reward's answer format from the data's (one
    setting for what the prompt asks for and what the reward accepts), errors reported before anything loads, a
    progress bar in optimizer steps, and resumed runs logging into their own version directory."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parser_class", QeRLArgumentParser)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(AdaptiveQuantizationNoise, "aqn")
        parser.add_lightning_class_args(RolloutSync, "rollout_sync")
        parser.add_lightning_class_args(EntropyLogger, "entropy_logging")
        parser.add_lightning_class_args(ScalarLayout, "scalar_layout")
        parser.add_argument(
            "--threads", type=int | None, default=None,
            help="CPU threads torch uses (default: torch's choice, one per core). On a machine where other processes "
                 "hold cores, fewer threads than cores avoid waiting on a busy one: 1 on a busy 2-core machine.",
        )
        parser.add_argument(
            "--print_memory_plan", type=bool, default=False,
            help="Print the memory plan (peak GiB of each phase, the wave size and micro-batch budget chosen for the "
                 "free GPU memory) and exit without loading the model (fit only).",
        )
        parser.add_argument(
            "--memory_plan_device_gb", type=float | None, default=None,
            help="Plan for a device with this many GiB free instead of the CUDA device's free memory (on CPU: the "
                 "memory plan is made only with this).",
        )
        parser.link_arguments("model.policy.model", "data.tokenizer")
        # The reward is a class so that a config may swap it; its answer format is never set on its own.
        parser.set_defaults({"model.reward": {"class_path": "qerl.data.rewards.MathReward"}})
        parser.set_defaults({"model.loss": {"class_path": "qerl.modules.loss.DAPOLoss"}})  # --print_config shows it
        parser.link_arguments("data.answer_format", "model.reward.init_args.answer_format", compute_fn=reward_format)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("threads") is not None:
            if config.threads < 1:
                self._parser(self.subcommand).error(f"--threads={config.threads}: must be >= 1 (or leave it unset).")
            torch.set_num_threads(config.threads)
        self._check_strategy(config)
        rollout = (config.get("model") or {}).get("rollout") or {}
        default_allocator_settings(str(rollout.get("class_path", "") if hasattr(rollout, "get") else rollout))
        if self.subcommand == "fit":
            max_steps = config.trainer.max_steps
            if max_steps is None or max_steps < 1:
                self._parser(self.subcommand).error(f"trainer.max_steps={max_steps}: set it to the number of optimizer steps to "
                                  "train (the prompt stream is endless, and the LR and AQN schedules need it).")
            version = resume_version(config.get("ckpt_path"), config.trainer.logger)
            if version is not None:
                config.trainer.logger.init_args.version = version

    def _check_strategy(self, config) -> None:
        """Refuse, before anything loads, the multi-GPU setups qerl does not run (README, "Several GPUs")."""
        trainer = config.get("trainer") or {}
        strategy = trainer.get("strategy")
        name = strategy if isinstance(strategy, str) else str(getattr(strategy, "class_path", "") or "")
        if any(kind in name.lower() for kind in ("fsdp", "deepspeed", "modelparallel")):
            self._parser(self.subcommand).error(
                f"trainer.strategy={name}: not supported: every GPU decodes rollouts from the whole model, which "
                "sharded weights cannot do; use ddp (one process per GPU), and NVFP4 for a model that does not fit "
                "one GPU in bf16.")

    def instantiate_classes(self) -> None:
        # Constructors check every value; one that raises is a configuration mistake, reported like a parse error.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as error:
            self._parser(self.subcommand).error(str(error))
        config = self.config[self.subcommand] if self.subcommand else self.config
        trains = self.subcommand in ("fit", None)  # None: run=False, the caller fits
        name = self.model.policy_config.model
        if self.subcommand is not None and not Path(name).expanduser().exists() and name != EMBEDDED_MODEL:
            if reason := hub_unavailable(name):  # one quick request, not transformers' minute of retries
                self._parser(self.subcommand).error(f"model.policy.model={name!r}: {reason}")
        if config.get("print_memory_plan") and not trains:
            self._parser(self.subcommand).error("--print_memory_plan: only for fit (the plan covers the update too).")
        if trains:
            self._apply_memory_plan(config.get("memory_plan_device_gb"), bool(config.get("print_memory_plan")))

    def _apply_memory_plan(self, device_gb: float | None, print_only: bool) -> None:
        """Plan the run's memory before the model loads: print it and exit (``--print_memory_plan``), or give the
        engine its wave size and the module its micro-batch budget where they are left to the plan; refuse what
        cannot fit. Made on CUDA (or for ``--memory_plan_device_gb``) with a built-in engine only."""
        parser = self._parser(self.subcommand)
        if device_gb is not None and device_gb <= 0:
            parser.error(f"--memory_plan_device_gb={device_gb}: must be > 0 (GiB free on the device).")
        device = self.trainer.strategy.root_device
        free, total = (int(device_gb * GIB),) * 2 if device_gb is not None else device_memory(device)
        if free is None and not print_only:
            return
        engine = self.model.rollout
        if not isinstance(engine, (BuiltinRollout, CUDAGraphRollout)):
            if print_only:
                print(f"memory plan: made for BuiltinRollout and CUDAGraphRollout only; {type(engine).__name__} "
                      "sizes its own memory.")
                sys.exit(0)
            return
        name = self.model.policy_config.model
        try:
            config = load_config(name)
        except (OSError, ValueError) as error:
            parser.error(f"model.policy.model={name!r}: its config cannot be read for the memory plan "
                         f"({str(error).strip().splitlines()[0]}).")
        try:
            shape = ModelShape.from_config(config)
        except AttributeError as error:  # not a Llama/Qwen2-style config: train without a plan
            if print_only:
                parser.error(f"model.policy.model={name!r}: no memory plan for this architecture ({error}).")
            warnings.warn(f"No memory plan for {name} ({error}): wave_rows and micro_batch_tokens: auto stay unset.")
            return
        settings = run_settings(self.model, self.datamodule)
        try:
            plan = plan_memory(shape, settings, free, wave_rows=getattr(engine, "wave_rows", None),
                               micro_batch_tokens=self.model.hparams.micro_batch_tokens, total_bytes=total)
        except MemoryPlanError as error:
            if print_only and error.plan is not None:
                print(error.plan.table())
            parser.error(str(error))
        if print_only:
            print(plan.table())
            sys.exit(0)
        if settings.waves and engine.wave_rows is None:
            engine.wave_rows = plan.wave_rows
        if isinstance(engine, CUDAGraphRollout):  # the engine follows what the plan assumed where it was left open
            if engine.wide_batch_bf16 is None and not plan.wide_batch_bf16:
                engine.wide_batch_bf16 = False  # (a copy the plan counts is still checked against the memory then)
            if engine.keep_kv_cache is None:
                engine.keep_kv_cache = bool(plan.kv_kept_rows)
        self.model.planned_micro_batch_tokens = plan.micro_batch_tokens
        if self.trainer.is_global_zero:
            print(f"memory plan: peak {plan.peak_bytes / GIB:.1f} GiB of {free / GIB:.1f} GiB free; wave_rows "
                  f"{plan.wave_rows}, micro_batch_tokens {plan.micro_batch_tokens} (--print_memory_plan for the table)")

    def instantiate_trainer(self, **kwargs):
        trainer = self._get(self.config_init, "trainer", default={})
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        callbacks.append(GracefulInterrupt())  # Ctrl-C / SIGTERM: a checkpoint and the resume command
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        kwargs["callbacks"] = callbacks
        kwargs.update(whole_counts(trainer))
        return super().instantiate_trainer(**kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        # LightningCLI runs the subcommand from its constructor; this is the one place around that run.
        log_dir = self.trainer.log_dir if self.trainer.logger is not None else None
        existed = log_dir is not None and Path(log_dir).exists()
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            # A run that failed before its first step leaves no version directory behind (only a config copy and an
            # empty event file would be in it), so `runs/<name>` lists real runs only; one that checkpointed or
            # scored something (an interrupted evaluation) stays.
            kept = [Path(log_dir or ".") / name for name in ("checkpoints", "eval")]
            first_step = self.trainer.global_step == 0 and not any(path.exists() for path in kept)
            if log_dir and not existed and first_step and self.trainer.is_global_zero:
                shutil.rmtree(log_dir, ignore_errors=True)
            raise


COUNT_OPTIONS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                 "val_check_interval")


def whole_counts(trainer) -> dict[str, int]:
    """``--trainer.limit_val_batches 1`` means one batch: Lightning reads an int as a count and a float as a fraction,
    but the parser reads these ``int | float`` options as floats first (``typing`` caches ``Union[int, float]`` as the
    equal ``Union[float, int]``), so ``1`` would arrive as 1.0, "all of them". A whole number >= 1 is a count: the
    options of the trainer's configuration to pass as ints."""
    return {key: int(value) for key in COUNT_OPTIONS
            if isinstance(value := trainer.get(key), float) and value >= 1 and value.is_integer()}


ALLOCATOR_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def default_allocator_settings(rollout_class_path: str) -> None:
    """PyTorch's CUDA allocator with expandable segments, unless the user configured the allocator, CUDA already
    started, or the engine is vLLM's (its sleep mode's memory pool refuses them). The rollout frees a KV cache and a
    bf16 weight copy of tens of GiB that the update's activations then take over: in fixed-size segments those end up
    in pieces too small for a [tokens, intermediate] tensor, and a plan near the GPU's size runs out of memory with
    much of it held free (bench/README); expandable segments map what a tensor needs, wherever it lies."""
    if any(name in os.environ for name in ALLOCATOR_SETTINGS) or "vllm" in rollout_class_path.lower():
        return
    if not torch.cuda.is_initialized():
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def device_memory(device: torch.device) -> tuple[int, int] | tuple[None, None]:
    """(free, total) bytes of a CUDA device before the run allocates anything there; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.mem_get_info(device)


def run_settings(model: GRPOModule, datamodule: MathPromptDataModule) -> RunSettings:
    """What the memory plan needs of the configured module, engine and data."""
    policy, hparams, engine = model.policy_config, model.hparams, model.rollout
    graphs = isinstance(engine, CUDAGraphRollout)  # decodes in waves, keeps or frees its static cache
    return RunSettings(
        prompts=datamodule.batch_size, group_size=hparams.group_size, max_prompt_tokens=datamodule.max_prompt_tokens,
        max_new_tokens=engine.max_new_tokens, quantization=policy.quantization, lora_rank=policy.lora_rank,
        lora_targets=tuple(policy.lora_targets), train_norms=policy.train_norms,
        micro_batch_size=hparams.micro_batch_size,
        gradient_checkpointing=policy.gradient_checkpointing, logprob_chunk_size=hparams.logprob_chunk_size,
        engine="cuda_graph" if graphs else "builtin", waves=graphs,
        length_bucket=engine.length_bucket if graphs else 1,
        wide_batch_bf16=engine.wide_batch_bf16 if graphs else False,
        keep_kv_cache=engine.keep_kv_cache if graphs else False,
        kv_cache_dtype=engine.kv_cache_dtype if graphs else "auto",
    )


def reward_format(answer_format: str) -> str:
    """The reward's answer format for the prompt's: a prompt without an instruction accepts any marked answer."""
    return "auto" if answer_format == "none" else answer_format


def resume_version(ckpt_path: str | None, logger) -> str | None:
    """The version directory a checkpoint ``<save_dir>/<name>/<version>/checkpoints/x.ckpt`` belongs to, when the
    configured TensorBoard logger writes to ``<save_dir>/<name>`` and names no version itself: resuming then logs into
    the same directory, so TensorBoard draws one curve per run instead of one per restart."""
    if not ckpt_path or not getattr(logger, "class_path", "").endswith("TensorBoardLogger"):
        return None
    args = logger.init_args
    if args.get("version") is not None:
        return None
    checkpoint = Path(ckpt_path).resolve()
    if checkpoint.parent.name != "checkpoints":
        return None
    run_dir = checkpoint.parent.parent
    name = args.get("name") if args.get("name") is not None else "lightning_logs"
    if run_dir.parent != (Path(args.get("save_dir") or ".") / (name or "")).resolve():
        return None
    return run_dir.name


class DropThirdPartyTips(logging.Filter):
    """Drops Lightning's advertisements (``💡 Tip: ... try installing litlogger``): nothing a qerl user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def cli_main(args: list[str] | None = None) -> QeRLCLI:
    tips = DropThirdPartyTips()
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    lightning_log.addFilter(tips)
    with warnings.catch_warnings():
        # Lightning 2.6 calls a torch pytree API that torch deprecated; nothing in qerl or the user's config does.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        # GRPOModule does all of a step's optimizer updates inside training_step, so the state after them is the
        # one a resume needs; Lightning's advice to save a pre-optimization copy for manual optimization does not
        # apply, and ModelCheckpoint has no setting that turns it off.
        warnings.filterwarnings(
            "ignore", message="Using ModelCheckpoint with manual optimization and every_n_train_steps",
            category=UserWarning,
        )
        try:
            return QeRLCLI(GRPOModule, MathPromptDataModule, args=args, save_config_kwargs={"overwrite": True})
        finally:
            lightning_log.removeFilter(tips)
