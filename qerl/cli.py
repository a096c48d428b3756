"""The command line: ``python train.py fit|validate|test --config configs/x.yaml [--model.optimizer.lr 2e-5 ...]``.

A user's mistake (an unknown or misspelled option, a value of the wrong type or out of range, a data file that cannot
be used) ends the command before any model or data loads, with one short ``error:`` line that names the option, the
value and the fix, and exit code 2 as argparse uses; no traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from qerl.agents.config import agent_tool_schemas
from qerl.callbacks.entropy_logging import EntropyLogger
from qerl.callbacks.interrupt import GracefulInterrupt
from qerl.callbacks.progress import StepProgressBar
from qerl.callbacks.rollout_sync import RolloutSync
from qerl.callbacks.scalar_layout import ScalarLayout
from qerl.cli_errors import QeRLArgumentParser, checkpoint_path_problem, config_files, yaml_problem
from qerl.data.prompts import MathPromptDataModule, refill_workers_error
from qerl.data.reward_health import RewardsFailing
from qerl.hub import hub_unavailable
from qerl.model.aqn import AQNSchedule
from qerl.model.experts import routed_experts_of
from qerl.modules.grpo_module import GRPOModule
from qerl.modules.options import max_steps_error
from qerl.run.memory_budget import budget_error, hold_to_budget
from qerl.rollout.vllm import unsupported_policy
from qerl.run.memory_plan import MemoryPlanError
from qerl.run.renamed_options import grouped_hparams
from qerl.run.resolve import (Resolution, UnknownArchitecture, device_memory, engine_kind, model_shape, plan_settings,
                              planning_device, resolve)


class QeRLCLI(LightningCLI):
    """LightningCLI with the RL callbacks always present (a second ``--config`` replaces a YAML callback list, so
    they are not in it), the tokenizer taken from the policy and the reward's answer format from the data's (one
    setting for what the prompt asks for and what the reward accepts), errors reported before anything loads, a
    progress bar in optimizer steps, and resumed runs logging into their own version directory."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parser_class", QeRLArgumentParser)
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # predict has no meaning for a policy trained by RL: validate / test write every completion
        # (model.evaluation.jsonl)
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def parse_arguments(self, parser, args) -> None:
        argv = list(sys.argv[1:] if args is None else args) if isinstance(args, (list, tuple, type(None))) else []
        for path in config_files(argv):
            if Path(path).is_file() and (problem := yaml_problem(path)):
                parser.error(problem)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Lightning's reading of ``--ckpt_path``'s saved module options into the config (they win over the config
        files, so that a resume trains as the checkpointed run did), with the options a checkpoint of an earlier qerl
        saved flat moved into their groups first."""
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": grouped_hparams(hparams)}},
                                                   self.config)
        except SystemExit:
            sys.stderr.write(f"The module options saved in --ckpt_path={ckpt_path} do not parse (above).\n")
            raise

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_class_arguments(AQNSchedule, "aqn")  # the schedule the module builds each step's noise from
        parser.link_arguments("aqn", "model.aqn", apply_on="instantiate")
        parser.add_lightning_class_args(RolloutSync, "rollout_sync")
        parser.add_lightning_class_args(EntropyLogger, "entropy_logging")
        parser.add_lightning_class_args(ScalarLayout, "scalar_layout")
        parser.add_argument(
            "--threads", type=int | None, default=None,
            help="CPU threads torch uses (default: the cores other processes leave free, from the load average "
                 "when the command starts, at least 1; OMP_NUM_THREADS, where set, decides instead). Threads on a "
                 "busy core wait on each other at every operation.",
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
        parser.add_argument(
            "--memory_budget_gb", type=float | None, default=None,
            help="Use at most this many GiB of the GPU: the memory plan is made for them and PyTorch's allocator "
                 "holds no more, so a larger GPU runs as a smaller one and the rest stays free for other processes "
                 "(off CUDA: the plan is made for them). Not with VLLMRollout (size it with gpu_memory_utilization).",
        )
        parser.link_arguments("model.policy.model", "data.tokenizer")
        # The prompts show model.agent's tools (their schemas, loaded and checked now) through its chat template.
        parser.link_arguments(("model.agent.tools", "model.agent.environment", "model.agent.chat_template",
                               "model.policy.model"), "data.tools", compute_fn=agent_tool_schemas)
        parser.link_arguments("model.agent.chat_template", "data.chat_template")
        # The reward is a class so that a config may swap it; its answer format is never set on its own.
        parser.set_defaults({"model.reward": {"class_path": "qerl.data.rewards.MathReward"}})
        parser.set_defaults({"model.loss": {"class_path": "qerl.modules.loss.DAPOLoss"}})  # --print_config shows it
        parser.set_defaults({"model.advantage": {"class_path": "qerl.modules.advantages.GroupAdvantage"}})
        parser.link_arguments("data.answer_format", "model.reward.init_args.answer_format", compute_fn=reward_format)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if problem := checkpoint_path_problem(config.get("ckpt_path")):
            self._parser(self.subcommand).error(problem)
        if config.get("threads") is not None:
            if config.threads < 1:
                self._parser(self.subcommand).error(f"--threads={config.threads}: must be >= 1 (or leave it unset).")
            torch.set_num_threads(config.threads)
        elif "OMP_NUM_THREADS" not in os.environ and hasattr(os, "getloadavg"):
            cores, load = os.cpu_count() or 1, os.getloadavg()[0]
            threads = free_core_threads(cores, load)
            if threads < torch.get_num_threads():
                torch.set_num_threads(threads)
                if rank_zero_only.rank == 0:
                    print(f"threads: {threads} (load {load:.1f} on {cores} cores: the rest are busy; --threads sets it)")
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
            for callback in config.trainer.get("callbacks") or []:
                # One last.ckpt per run, the newest state: a resume overwrites it (and a re-trained step's file)
                # instead of writing last-v1.ckpt beside a stale one.
                if str(getattr(callback, "class_path", "")).endswith("ModelCheckpoint"):
                    callback.init_args.enable_version_counter = False

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
        model = ((config.get("model") or {}).get("policy") or {}).get("model")
        plain_ddp = name.startswith("ddp") and "find_unused_parameters_true" not in name
        if plain_ddp and model and routed_experts_of(str(model)):
            # an expert that none of a rank's tokens chose leaves its LoRA without a gradient on that rank
            self._parser(self.subcommand).error(
                f"trainer.strategy={name}: a mixture-of-experts policy trains the LoRA of experts some rank's tokens "
                "may not reach; use trainer.strategy=ddp_find_unused_parameters_true.")

    def _check_refill(self, config) -> None:
        """Refills read the training stream in the main process: refuse worker processes now, not at fit's setup."""
        model, data = config.get("model") or {}, config.get("data") or {}
        refills = (model.get("dapo") or {}).get("max_refill_rounds")
        if self.subcommand == "fit" and refills and data.get("num_workers"):
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
        for ``--memory_plan_device_gb`` / ``--memory_budget_gb``) with a built-in or the vLLM engine, for fit only;
        a budget holds PyTorch's allocator to it for any subcommand."""
        parser = self._parser(self.subcommand)
        trains = self.subcommand in ("fit", None)  # None: run=False, the caller fits
        print_only, device_gb = bool(config.get("print_memory_plan")), config.get("memory_plan_device_gb")
        if print_only and not trains:
            parser.error("--print_memory_plan: only for fit (the plan covers the update too).")
        if device_gb is not None and device_gb <= 0:
            parser.error(f"--memory_plan_device_gb={device_gb}: must be > 0 (GiB free on the device).")
        budget_gb = config.get("memory_budget_gb")
        if error := budget_error(budget_gb, device_gb, engine_kind(config.model.get("rollout"))):
            parser.error(error)
        if budget_gb is not None and (device := planning_device(config.trainer)).type == "cuda":
            try:  # before anything of the run is allocated there
                hold_to_budget(device, budget_gb)
            except ValueError as error:
                parser.error(str(error))
        rollout = config.model.get("rollout") if trains else None
        if trains and engine_kind(rollout) == "vllm":
            device_type = "cuda" if device_gb is not None else planning_device(config.trainer).type  # (planned for)
            if refusal := unsupported_policy(str(config.model.policy.model), tuple(config.model.policy.lora_targets),
                                             device_type):
                parser.error(refusal)
        if trains and engine_kind(rollout) == "vllm" and replays_routing(config.model.get("expert_routing")):
            parser.error("model.expert_routing.replay=true: router replay needs the rollout's expert choices, which "
                         "VLLMRollout does not record; use class_path: qerl.rollout.cuda_graph.CUDAGraphRollout, or "
                         "replay false.")
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
        free, total = device_memory(config.trainer, device_gb, budget_gb)
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
        self.interrupt = GracefulInterrupt()  # Ctrl-C / SIGTERM: a checkpoint, the resume command, the exit code
        callbacks.append(self.interrupt)
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        kwargs["callbacks"] = callbacks
        kwargs.update(whole_counts(trainer))
        return super().instantiate_trainer(**kwargs)

    def _run_subcommand(self, subcommand: str) -> None:
        # LightningCLI runs the subcommand from its constructor; this is the one place around that run.
        log_dir = self.trainer.log_dir if self.trainer.logger is not None else None
        existed = log_dir is not None and Path(log_dir).exists()
        before = RunFolder.snapshot(Path(log_dir)) if existed else None
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
            # A resume into an earlier run that failed before saving anything (its checkpoint did not load): the
            # folder as it was (Lightning's logger writes hparams.yaml and an events file even for a failed run).
            if before is not None and self.trainer.is_global_zero:
                before.restore_unless_checkpointed(Path(log_dir))
            raise


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """What a run folder held before a command ran in it: its own files (the YAML files' contents) and checkpoints."""

    files: dict[str, bytes | None]  # name -> content of a .yaml file, None for the others (events files)
    checkpoints: dict[str, int]  # checkpoints/<name> -> modification time (ns)

    @classmethod
    def snapshot(cls, folder: Path) -> RunFolder:
        files = {p.name: p.read_bytes() if p.suffix == ".yaml" else None for p in folder.iterdir() if p.is_file()}
        return cls(files, {p.name: p.stat().st_mtime_ns for p in folder.glob("checkpoints/*")})

    def restore_unless_checkpointed(self, folder: Path) -> None:
        """The folder's own files as they were, when the command wrote no checkpoint (it failed before it started)."""
        if RunFolder.snapshot(folder).checkpoints != self.checkpoints:
            return
        for path in folder.iterdir():
            if path.is_file() and path.name not in self.files:
                path.unlink()
            elif path.is_file() and self.files[path.name] is not None:
                path.write_bytes(self.files[path.name])


def free_core_threads(cores: int, load: float) -> int:
    """Threads for torch on ``cores`` cores of which other processes keep ``load`` busy (the 1-minute load average,
    taken before this process works): the free ones, at least 1."""
    return max(1, min(cores, cores - round(load)))


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
    started. The rollout frees a large KV cache and a bf16 weight copy that the update's activations then take
    over: in fixed-size segments those end up in pieces too small for a [tokens, intermediate] tensor, and a plan near
    the GPU's size runs out of memory with much of it held free (bench/README); expandable segments map what a tensor
    needs, wherever it lies. vLLM's sleep-mode pool cannot use them: vLLM (>= 0.26) turns them off around its own
    allocations when it finds them in ``PYTORCH_CUDA_ALLOC_CONF``, the name it reads, and back on after."""
    if any(name in os.environ for name in ALLOCATOR_SETTINGS) or torch.cuda.is_initialized():
        return
    name = "PYTORCH_CUDA_ALLOC_CONF" if "vllm" in rollout_class_path.lower() else "PYTORCH_ALLOC_CONF"
    os.environ[name] = "expandable_segments:True"


def replays_routing(expert_routing) -> bool:
    """Whether the parsed ``model.expert_routing`` asks for router replay (its ``init_args``, or the values alone)."""
    if not hasattr(expert_routing, "get"):
        return bool(getattr(expert_routing, "replay", False))
    return bool((expert_routing.get("init_args") or expert_routing).get("replay"))


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


def main() -> None:
    """``python train.py``: exits 130 / 143 when Ctrl-C / SIGTERM stopped the run (checkpointed, not finished)."""
    try:
        cli = cli_main()
    except SIGTERMException:  # raised past the trainer once its checkpoint is written (GracefulInterrupt)
        sys.exit(128 + signal.SIGTERM)
    except RewardsFailing as error:  # checkpointed too; the reason in one line, not a traceback
        sys.stderr.write(f"error: {error}\n")
        sys.exit(1)
    interrupt = getattr(cli, "interrupt", None)
    sys.exit(interrupt.exit_code if interrupt is not None else 0)


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
