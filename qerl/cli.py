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
from lightning.pytorch.utilities import rank_zero_only

from qerl.agents.config import agent_tool_schemas
from qerl.callbacks.entropy_logging import EntropyLogger
from qerl.callbacks.interrupt import GracefulInterrupt
from qerl.callbacks.progress import StepProgressBar
from qerl.callbacks.rollout_sync import RolloutSync
from qerl.callbacks.scalar_layout import ScalarLayout
from qerl.data.prompts import MathPromptDataModule, refill_workers_error
from qerl.hub import hub_unavailable
from qerl.model.aqn import AQNSchedule
from qerl.modules.grpo_module import GRPOModule
from qerl.modules.options import max_steps_error
from qerl.run.memory_plan import MemoryPlanError
from qerl.run.renamed_options import renamed_hints
from qerl.run.resolve import (Resolution, UnknownArchitecture, device_memory, engine_kind, model_shape, plan_settings,
                              resolve)


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
        hints = renamed_hints(message) or hints + init_arg_hints(message)
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
    message = re.sub(r"^Call to compute_fn of link .*? failed: ", "", message.strip(), flags=re.DOTALL)  # our own
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
        parser.add_class_arguments(AQNSchedule, "aqn")  # the schedule the module builds each step's noise from
        parser.link_arguments("aqn", "model.aqn", apply_on="instantiate")
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
        # The prompts show model.agent's tools (their schemas, loaded and checked now) through its chat template.
        parser.link_arguments(("model.agent.tools", "model.agent.environment", "model.agent.chat_template",
                               "model.policy.model"), "data.tools", compute_fn=agent_tool_schemas)
        parser.link_arguments("model.agent.chat_template", "data.chat_template")
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
        self._check_refill(config)
        rollout = (config.get("model") or {}).get("rollout") or {}
        default_allocator_settings(str(rollout.get("class_path", "") if hasattr(rollout, "get") else rollout))
        if self.subcommand == "fit":
            if error := max_steps_error(config.trainer.max_steps):
                self._parser(self.subcommand).error(error)
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

    def _check_refill(self, config) -> None:
        """Refills read the training stream in the main process: refuse worker processes now, not at fit's setup."""
        model, data = config.get("model") or {}, config.get("data") or {}
        if self.subcommand == "fit" and model.get("max_refill_rounds") and data.get("num_workers"):
            self._parser(self.subcommand).error(refill_workers_error(data.get("num_workers")))

    def instantiate_classes(self) -> None:
        # The classes are built from the resolved copy of the config (concrete values, qerl.run.resolve; the module's
        # saved hyperparameters are dumped from it), while ``self.config`` stays as the user wrote it (the run's
        # saved config.yaml says ``auto`` where the user did).
        written = self.config
        self._check_hub(written[self.subcommand] if self.subcommand else written)
        self.resolution = self._resolve(written[self.subcommand] if self.subcommand else written)
        self.config = written.clone()
        self.resolution.apply(self.config[self.subcommand] if self.subcommand else self.config)
        # Constructors check every value; one that raises is a configuration mistake, reported like a parse error.
        try:
            self.config_init = self.parser.instantiate_classes(self.config)
        except (ValueError, FileNotFoundError) as error:
            self._parser(self.subcommand).error(str(error))
        finally:
            self.config = written
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        try:
            self.trainer = self.instantiate_trainer()
        except (ValueError, FileNotFoundError) as error:
            self._parser(self.subcommand).error(str(error))

    def _check_hub(self, config) -> None:
        """A hub id that is neither a local path, cached nor reachable: one error line now (one quick request), not
        transformers' minute of retries and a traceback when the model loads."""
        name = str(config.model.policy.model)
        # owner/name; a path is the policy's own check (no config.json there)
        hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None
        if self.subcommand is not None and hub_id and not Path(name).expanduser().exists():
            if reason := hub_unavailable(name):
                self._parser(self.subcommand).error(f"model.policy.model={name!r}: {reason}")

    def _resolve(self, config) -> Resolution:
        """Make the run's open memory and engine settings concrete before anything is built: print the memory plan
        and exit (``--print_memory_plan``), or decide from it; refuse what cannot fit. The plan is made on CUDA (or
        for ``--memory_plan_device_gb``) with a built-in or the vLLM engine, for fit only."""
        parser = self._parser(self.subcommand)
        trains = self.subcommand in ("fit", None)  # None: run=False, the caller fits
        print_only, device_gb = bool(config.get("print_memory_plan")), config.get("memory_plan_device_gb")
        if print_only and not trains:
            parser.error("--print_memory_plan: only for fit (the plan covers the update too).")
        if device_gb is not None and device_gb <= 0:
            parser.error(f"--memory_plan_device_gb={device_gb}: must be > 0 (GiB free on the device).")
        rollout = config.model.get("rollout") if trains else None
        if trains and engine_kind(rollout) is None:
            if print_only:
                name = str(rollout.get("class_path") if hasattr(rollout, "get") else rollout).rpartition(".")[2]
                print(f"memory plan: made for BuiltinRollout, CUDAGraphRollout and VLLMRollout only; {name} sizes "
                      "its own memory.")
                sys.exit(0)
            return Resolution()
        settings = plan_settings(config) if trains else None
        if settings is None:  # not fit, or a value the constructors refuse (naming the option)
            return Resolution()
        free, total = device_memory(config.trainer, device_gb)
        shape = None
        if free is not None or print_only:
            try:
                shape = model_shape(config.model.policy.model)
            except UnknownArchitecture as error:  # not a Llama/Qwen2-style config: train without a plan
                if print_only:
                    parser.error(str(error))
                warnings.warn(f"{error} wave_rows and micro_batch_tokens: auto stay unset.")
            except ValueError as error:
                parser.error(str(error))
        try:
            resolution = resolve(settings, config, shape, free, total)
        except MemoryPlanError as error:
            if print_only and error.plan is not None:
                print(error.plan.table())
            parser.error(str(error))
        if print_only:
            print(resolution.plan.table())
            written = resolution.apply(config.clone())
            print("resolved (what the run is built with): "
                  + (", ".join(f"{k}={v}" for k, v in written.items()) or "nothing was left open"))
            sys.exit(0)
        if resolution.plan is not None and rank_zero_only.rank == 0:
            print(resolution.report())
        return resolution

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
    """PyTorch's CUDA allocator with expandable segments, unless the user configured the allocator or CUDA already
    started. The rollout frees a KV cache and a bf16 weight copy of tens of GiB that the update's activations then take
    over: in fixed-size segments those end up in pieces too small for a [tokens, intermediate] tensor, and a plan near
    the GPU's size runs out of memory with much of it held free (bench/README); expandable segments map what a tensor
    needs, wherever it lies. vLLM's sleep-mode pool cannot use them: vLLM (>= 0.26) turns them off around its own
    allocations when it finds them in ``PYTORCH_CUDA_ALLOC_CONF``, the name it reads, and back on after."""
    if any(name in os.environ for name in ALLOCATOR_SETTINGS) or torch.cuda.is_initialized():
        return
    name = "PYTORCH_CUDA_ALLOC_CONF" if "vllm" in rollout_class_path.lower() else "PYTORCH_ALLOC_CONF"
    os.environ[name] = "expandable_segments:True"


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
