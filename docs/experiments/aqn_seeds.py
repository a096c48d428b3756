"""Arms x seeds of the AQN experiment (issues 22, 40) through the real ``train.py``, resumable, into one JSON.

    python docs/experiments/aqn_seeds.py --device cuda --seeds 0 1 2 3 4 --parallel 16 --threads 1 --steps 100 \\
        --time-limit 400 --out docs/results/aqn_seeds.json --archive docs/results/aqn_seeds_runs.tar.gz
        # the same again until it prints "complete" (time limit + --stop-grace: one call of at most 10 minutes)
    python docs/experiments/aqn_report.py docs/results/aqn_seeds.json     # statistics, plots, docs/learning.md

Every run is ``train.py fit --config configs/experiments/aqn_arithmetic.yaml`` with the arm's options (the config's
``model.optimizer.lr`` is the recipe rate; ``bf16_lr_low`` scales it by the recipes' rule, ``configs/recipes/bf16.yaml``'s rate
over ``configs/gpu.yaml``'s):

    nvfp4_aqn         NVFP4 base weights + LoRA + AQN          (the QeRL method)
    nvfp4             NVFP4 + LoRA, no AQN                     (AQN's share: against nvfp4_aqn)
    bf16_lr_high      bf16 + LoRA, no AQN, the NVFP4 rate      (quantization's share at one rate: against nvfp4)
    bf16_lr_low       bf16 + LoRA, no AQN, the bf16 rate       (the baseline as the recipes run it)
    bf16_aqn          bf16 + LoRA + AQN, the bf16 rate         (noise without quantization: against bf16_lr_low)
    bf16_aqn_lr_high  bf16 + LoRA + AQN, the NVFP4 rate        (the same against bf16_lr_high: noise's share in both
                                                                formats at one rate, beside nvfp4_aqn - nvfp4)
    nvfp4_aqn_lr_low  NVFP4 + LoRA + AQN, the bf16 rate        (quantization's share with noise at the bf16 rate:
                                                                against bf16_aqn; the rate's: against nvfp4_aqn)

The rollout-correction experiment (issue 51: ``--experiment correction``, its own ``--work`` / ``--out`` defaults)
runs NVFP4 + AQN at the NVFP4 rate with three corrections of the sampler / trainer gap, each as a TRL or verl user
would set it, all else as ``nvfp4_aqn``:

    nvfp4_aqn                  token-level truncated IS, cap 2           (today's default; verl's rollout_is: token)
    nvfp4_aqn_sequence_mask    sequence_mask, C_max 3, no C_min          (TRL's default vllm_importance_sampling_mode)
    nvfp4_aqn_icepop           token_mask, [0.5, 5]                      (IcePop)

    python docs/experiments/aqn_seeds.py --experiment correction --device cuda --seeds 0 1 2 3 4 --parallel 16 \
        --threads 1 --steps 100 --time-limit 540 --archive docs/results/correction_seeds_runs.tar.gz
        # the same again until it prints "complete"
    python docs/experiments/correction_report.py docs/results/correction_seeds.json   # the table and the decision

Decision rule, fixed before any run: the primary measure is each run's final held-out accuracy (the AQN experiment's:
flexible accuracy at the experiment's last validation, ``aqn_report.summarize``), paired by seed against
``nvfp4_aqn``. The default (``token_truncate``, cap 2) changes to a candidate only if the mean paired difference
(candidate - nvfp4_aqn) over the 5 seeds is positive and its 95% t-interval (``aqn_stats.paired_difference``) lies
above 0; if both candidates qualify, the one with the larger mean difference. Otherwise the default stays, and
``docs/learning.md`` says which differences the seeds can and cannot see. The mismatch statistics logged every step
(``train/sampling_logp_diff_*``, ``train/is_raw_ratio_*``, ``train/is_masked_*``) are reported beside the score and
decide nothing; a candidate that masks more than half of the tokens (mean ``train/is_masked_frac`` > 0.5) is named as
training on a minority of the batch whatever its score. The fp32 LM head for the sampler (TRL's
``cast_lm_head_to_fp32``) waits for these statistics: it is worth building only if the head's rounding is a visible
share of ``train/sampling_logp_diff_mean``.

With a bf16 policy the AQN callback's noise goes into the bf16 model's RMSNorm weights during the rollout exactly as
into the NVFP4 model's (every engine perturbs the norms of the policy it samples; ``configs/recipes/bf16.yaml`` keeps
AQN on too), so each noise contrast differs in that one setting, at one rate.

Seed S sets ``seed_everything``, the AQN noise seed, the rollout's sampling seed, the data shuffle and the training
questions (the ``seed`` of every training source): arms run with the same S see the same questions in the same order
from the same LoRA initialization, so differences between arms can be paired by seed. The untrained model's held-out
score (step 0 of every curve) is one ``train.py validate`` per quantization: LoRA B starts at 0 and evaluation is
greedy, so it does not depend on the seed, the arm's rate or AQN. These run first, before any training run starts:
they also write the model cache that the training runs then only read.

Layout under ``--work``: ``<arm>/seed_<S>/version_0/`` (events, ``checkpoints/last.ckpt``, ``eval/``), ``run.json``
(the run's ``train.py`` arguments) and ``result.json`` (written when the run has finished) beside it, the run's output
in ``<arm>/seed_<S>.log``; ``base_<quantization>/`` for the untrained scores.

Resuming: a run with a ``result.json`` is skipped. A run that was stopped (``--time-limit``, a signal, a crash)
restarts from the newer of its ``checkpoints/last.ckpt`` and ``interrupted.ckpt`` (the one SIGTERM has it write
after the step and validation in progress; ``fit --ckpt_path``: the adapter, optimizer, schedules, data position and
random streams of the uninterrupted run; steps after that checkpoint are run and logged again, and when the event
files are read back the later value of a step wins), or from scratch when it has none (its directory is cleared
first). A run killed before it wrote ``interrupted.ckpt`` (``--stop-grace``) and resumed from a ``last.ckpt``
written just before a validation never makes that validation (Lightning skips it on resume): the report then has no
final score for a run missing its last one. A run directory made with other arguments is refused, not mixed. The
JSON is rewritten after every run that finishes, with the runs complete so far (``complete`` says whether all are).

``--time-limit SECONDS`` stops the runs still going at that time (SIGTERM, then ``--stop-grace`` seconds to write
their checkpoint) and writes the JSON, so a long experiment goes through in calls of bounded length: the same
command again continues it. ``--archive FILE`` keeps the finished runs (``run.json`` + ``result.json`` of each, a
few kB) in one tar.gz, rewritten with the JSON, and restores from it the ones missing under ``--work`` at the start:
a call on a fresh machine, with the archive carried over, runs only what was not finished (a run stopped mid-way
there starts again from step 0). Options after ``--`` go to every ``train.py`` call
(e.g. ``-- --trainer.val_check_interval 10``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_runs import merged_scalars  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/experiments/aqn_arithmetic.yaml"
ARMS = {  # name -> (quantization, AQN on, the rate: "high" = the config's, "low" = by the bf16 recipes' rule)
    "nvfp4_aqn": ("nvfp4", True, "high"),
    "nvfp4": ("nvfp4", False, "high"),
    "bf16_lr_high": ("bf16", False, "high"),
    "bf16_lr_low": ("bf16", False, "low"),
    "bf16_aqn": ("bf16", True, "low"),
    "bf16_aqn_lr_high": ("bf16", True, "high"),
    "nvfp4_aqn_lr_low": ("nvfp4", True, "low"),
    "nvfp4_aqn_sequence_mask": ("nvfp4", True, "high"),  # issue 51's corrections: ARM_OPTIONS
    "nvfp4_aqn_icepop": ("nvfp4", True, "high"),
}
CORRECTION = "--model.loss.init_args.correction."
ARM_OPTIONS = {  # arm -> train.py options beyond quantization, AQN and rate
    "nvfp4_aqn_sequence_mask": [CORRECTION + "mode", "sequence_mask", CORRECTION + "clip_max", "3.0"],
    "nvfp4_aqn_icepop": [CORRECTION + "mode", "token_mask", CORRECTION + "clip_min", "0.5", CORRECTION + "clip_max",
                         "5.0"],
}
EXPERIMENTS = {  # --experiment -> (its arms, default --work, default --out)
    "aqn": (["nvfp4_aqn", "nvfp4", "bf16_lr_high", "bf16_lr_low", "bf16_aqn", "bf16_aqn_lr_high", "nvfp4_aqn_lr_low"],
            "runs/aqn_seeds", "docs/results/aqn_seeds.json"),
    "correction": (["nvfp4_aqn", "nvfp4_aqn_sequence_mask", "nvfp4_aqn_icepop"], "runs/correction_seeds",
                   "docs/results/correction_seeds.json"),
}
CALLS = "calls.json"  # in the work directory and the archive: every call of the experiment so far

DEVICES = {  # --device -> train.py options: fp32 is the faster dtype on a CPU, bf16 on a GPU
    "cuda": ["--trainer.accelerator", "gpu", "--model.policy.dtype", "bfloat16"],
    "cpu": ["--trainer.accelerator", "cpu", "--model.policy.dtype", "float32"],
}
TRAIN_TAGS = {  # key in the JSON -> TensorBoard tag, one value per step
    "reward": "train/reward",
    "accuracy": "train/accuracy",
    "rollout_entropy": "rollout/entropy",  # the sampling policy's entropy (NVFP4 + noise) on its own samples
    "train_entropy": "train/entropy",  # the clean training policy's entropy on the same tokens (teacher-forced)
    "aqn_sigma": "train/aqn_sigma",
    "completion_length": "train/completion_length",
    "learning_rate": "train/lr",
    # the sampler (NVFP4 + AQN) against the trainer, and what the rollout correction did with it
    "sampling_logp_diff_mean": "train/sampling_logp_diff_mean",
    "sampling_logp_diff_max": "train/sampling_logp_diff_max",
    "is_raw_ratio_mean": "train/is_raw_ratio_mean",
    "is_ratio_mean": "train/is_ratio_mean",
    "is_masked_frac": "train/is_masked_frac",
    "is_masked_seq_frac": "train/is_masked_seq_frac",
}


def bf16_lr_ratio(root: Path = ROOT) -> float:
    """The recipes' rule for the 16-bit LoRA rate: ``configs/recipes/bf16.yaml``'s rate over ``configs/gpu.yaml``'s."""
    gpu = yaml.safe_load((root / "configs" / "gpu.yaml").read_text())["model"]["optimizer"]["lr"]
    bf16 = yaml.safe_load((root / "configs" / "recipes" / "bf16.yaml").read_text())["model"]["optimizer"]["lr"]
    return float(bf16) / float(gpu)


@dataclass
class Job:
    """One ``train.py`` call: a training run (arm, seed) or the untrained score of a quantization (seed None)."""

    name: str  # "nvfp4_aqn/seed_0" or "base_nvfp4"
    directory: Path  # the logger's <save_dir>/<name>: holds version_0/, run.json, result.json
    args: list[str]  # train.py arguments, without --ckpt_path and --threads (they change between attempts)
    arm: str | None = None
    seed: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def version_dir(self) -> Path:
        return self.directory / "version_0"

    @property
    def result_path(self) -> Path:
        return self.directory / "result.json"

    @property
    def log_path(self) -> Path:
        return self.directory.with_suffix(".log")


def plan(args, config: dict) -> list[Job]:
    """The base scores of the quantizations in use, then every (arm, seed) run, seeds outermost (a partial
    experiment then has whole seeds of every arm, which can be paired)."""
    lr_high = float(config["model"]["optimizer"]["lr"])
    rates = {"high": lr_high, "low": lr_high * bf16_lr_ratio()}
    common = ["--config", args.config, *DEVICES[args.device]]
    work = Path(args.work)
    jobs = []
    for quantization in sorted({ARMS[a][0] for a in args.arms}):
        name = f"base_{quantization}"
        jobs.append(Job(name, work / name, [
            "validate", *common, "--model.policy.quantization", quantization,
            "--trainer.logger.init_args.save_dir", str(work), "--trainer.logger.init_args.name", name,
            "--trainer.logger.init_args.version", "0", *args.passthrough,
        ], meta={"quantization": quantization}))
    for seed in args.seeds:
        for arm in args.arms:
            quantization, aqn, rate = ARMS[arm]
            lr = rates[rate]
            run_args = [
                "fit", *common,
                "--seed_everything", str(seed), "--aqn.seed", str(seed), "--data.seed", str(seed),
                "--model.sampling.seed", str(seed), "--data.sources", json.dumps(seeded_sources(config, seed)),
                "--model.policy.quantization", quantization, "--aqn.enabled", str(aqn).lower(), "--model.optimizer.lr", repr(lr),
                "--trainer.logger.init_args.save_dir", str(work / arm),
                "--trainer.logger.init_args.name", f"seed_{seed}", "--trainer.logger.init_args.version", "0",
            ]
            run_args += ARM_OPTIONS.get(arm, [])
            if args.steps is not None:
                run_args += ["--trainer.max_steps", str(args.steps)]
            jobs.append(Job(f"{arm}/seed_{seed}", work / arm / f"seed_{seed}", run_args + args.passthrough, arm, seed,
                            {"quantization": quantization, "aqn": aqn, "lr": lr}))
    return jobs


def seeded_sources(config: dict, seed: int) -> list[dict]:
    """The config's training sources with ``seed`` set in each one that takes a seed (each seed its own questions)."""
    sources = config.get("data", {}).get("sources") or []
    out = []
    for source in sources:
        source = json.loads(json.dumps(source))
        init = source.setdefault("init_args", {})
        if "seed" in init or source["class_path"].rsplit(".", 1)[-1] in ("ArithmeticExpressions", "ArithmeticSource"):
            init["seed"] = seed
        out.append(source)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Reading a finished run back.


def run_result(job: Job, max_steps: int) -> dict | None:
    """The per-seed result of a finished training run from its event files, or None when it logged fewer than
    ``max_steps`` steps (stopped early). Steps count optimizer steps done: TensorBoard's x of a training batch is its
    index (step - 1), and a validation is logged at the index of the last batch before it."""
    scalars = merged_scalars(job.version_dir) if job.version_dir.exists() else {}
    rewards = scalars.get(TRAIN_TAGS["reward"], {})
    if len(rewards) < max_steps:
        return None
    steps = sorted(rewards)[:max_steps]
    result = {"seed": job.seed, **job.meta, "steps": [s + 1 for s in steps]}
    for key, tag in TRAIN_TAGS.items():
        points = scalars.get(tag, {})
        result[key] = [points.get(s) for s in steps]
    result["heldout"] = heldout_curves(scalars)
    return result


def heldout_curves(scalars: dict[str, dict[int, float]]) -> dict[str, list]:
    """``{"steps": [...], "<metric>": [...]}`` for every ``val/<metric>`` tag (``expressions_acc``,
    ``expressions_acc_flexible``, ``expressions_level2_acc``, ...), steps counted as optimizer steps done (the
    validation tags are logged at that step, the step their ``eval/val_step<N>.jsonl`` is named after)."""
    tags = sorted(t for t in scalars if t.startswith("val/"))
    steps = sorted({s for t in tags for s in scalars[t]})
    curves: dict[str, list] = {"steps": steps}
    for tag in tags:
        curves[tag.removeprefix("val/")] = [scalars[tag].get(s) for s in steps]
    return curves


def base_result(job: Job) -> dict | None:
    """The untrained model's held-out scores ``{"<metric>": value}`` from a finished ``validate`` run, and its verdict
    on every greedy question (``questions``: question, source, correct, correct_flexible, from the run's
    ``eval/val_step0.jsonl``), so that the formats' scores can be compared question by question."""
    scalars = merged_scalars(job.version_dir) if job.version_dir.exists() else {}
    values = {t.removeprefix("val/"): points[max(points)] for t, points in scalars.items() if t.startswith("val/")}
    if not values:
        return None
    records = job.version_dir / "eval" / "val_step0.jsonl"
    questions = []
    if records.exists():
        for line in records.read_text().splitlines():
            row = json.loads(line)
            if row.get("mode") == "greedy":
                questions.append({k: row.get(k) for k in ("question", "source", "correct", "correct_flexible")})
    return {**job.meta, "heldout": values, "questions": questions}


def with_base(result: dict, base: dict | None) -> dict:
    """The run's result with the untrained score as step 0 of its held-out curves, and ``final_heldout_<metric>``
    (the last validation) with ``final_heldout_step`` (its step)."""
    curves = result["heldout"]
    keys = [k for k in curves if k != "steps"]
    if base is not None:
        curves = {"steps": [0, *curves["steps"]], **{k: [base["heldout"].get(k), *curves[k]] for k in keys}}
    finals = {f"final_heldout_{k}": curves[k][-1] for k in keys if curves[k] and curves[k][-1] is not None}
    if curves["steps"]:
        finals["final_heldout_step"] = curves["steps"][-1]
    return {**result, "heldout": curves, **finals}


# ----------------------------------------------------------------------------------------------------------------
# Running.


def prepare(job: Job) -> list[str]:
    """The arguments of the next attempt: resume from the last checkpoint when there is one, else start clean.
    Refuses a directory that holds a run with other arguments."""
    record = job.directory / "run.json"
    if record.exists():
        previous = json.loads(record.read_text())["args"]
        if previous != job.args:
            raise SystemExit(f"error: {job.directory} holds a run with other arguments ({record}); use another --work, "
                             "or delete that directory to run it again with these.")
    last = newest_checkpoint(job.version_dir / "checkpoints")
    if job.seed is not None and last is not None:
        return [*job.args, "--ckpt_path", str(last)]
    if job.version_dir.exists():
        shutil.rmtree(job.version_dir)  # a start from scratch must not read the stopped attempt's events
    job.directory.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"args": job.args}, indent=1))
    return list(job.args)


def newest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint a stopped run resumes from: the newer of ``last.ckpt`` (the periodic one) and
    ``interrupted.ckpt`` (written when SIGTERM stopped it, after the step, and the validation, in progress: resuming
    from ``last.ckpt`` instead would redo those steps and skip a validation that ``last.ckpt`` was written before)."""
    found = [p for p in (directory / "last.ckpt", directory / "interrupted.ckpt") if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def record_attempt(job: Job, seconds: float) -> None:
    """Add one attempt's wall time to the job's ``run.json`` (the attempts of a resumed run add up)."""
    record = job.directory / "run.json"
    data = json.loads(record.read_text())
    data["attempt_seconds"] = [*data.get("attempt_seconds", []), round(seconds, 1)]
    record.write_text(json.dumps(data, indent=1))


def finish(job: Job, max_steps: int, final_validation: bool = False) -> bool:
    """Write the job's ``result.json`` if it has finished; True if it has. It holds ``wall_seconds``: the wall time of
    the job's attempts (while ``--parallel`` runs shared the machine: the experiment's GPU time is about the sum over
    runs divided by ``--parallel``). With ``final_validation`` (the schedule validates at the last step) a run that
    lacks that validation has not finished: its checkpoints go, so that its next attempt starts from step 0."""
    result = run_result(job, max_steps) if job.seed is not None else base_result(job)
    if result is None:
        return False
    if job.seed is not None and final_validation and not has_final_validation(result, max_steps):
        start_over(job, max_steps)
        return False
    attempts = json.loads((job.directory / "run.json").read_text()).get("attempt_seconds", [])
    job.result_path.write_text(json.dumps({**result, "wall_seconds": round(sum(attempts), 1)}))
    return True


def has_final_validation(result: dict, max_steps: int) -> bool:
    return max_steps in result.get("heldout", {}).get("steps", [])


def start_over(job: Job, max_steps: int) -> None:
    """A run that ended without the validation at its last step (resumed past it): its result and checkpoints go, so
    that its next attempt runs from step 0."""
    job.result_path.unlink(missing_ok=True)
    shutil.rmtree(job.version_dir / "checkpoints", ignore_errors=True)
    print(f"{job.name}: no validation at step {max_steps} (resumed past it): to run again from step 0", flush=True)


def trainer_option(config: dict, args, name: str):
    """``trainer.<name>`` as every run gets it: the passthrough option (after ``--``) over the config's value."""
    override = next((args.passthrough[i + 1] for i, a in enumerate(args.passthrough[:-1])
                     if a == f"--trainer.{name}"), None)
    return override if override is not None else config.get("trainer", {}).get(name)


def validates_at_last_step(config: dict, args, max_steps: int) -> bool:
    """Whether the runs' schedule validates after their last step (``trainer.val_check_interval``, an int number of
    steps, dividing ``max_steps``)."""
    interval = trainer_option(config, args, "val_check_interval")
    try:
        interval = int(interval)
    except (TypeError, ValueError):
        return False
    return interval >= 1 and max_steps % interval == 0


def config_max_steps(config: dict, args) -> int:
    if args.steps is not None:
        return args.steps
    return int(trainer_option(config, args, "max_steps"))


def device_info(device: str) -> dict:
    info = {"requested": device, "host_cpus": os.cpu_count(), "platform": platform.platform()}
    for package in ("torch", "transformers", "lightning", "peft"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    if device == "cuda" and shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
        info["gpu"] = query.stdout.strip()
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def archive_finished(jobs: list[Job], path: Path, calls: list[dict] | None = None) -> int:
    """Write ``run.json`` and ``result.json`` of every finished job into the tar.gz ``path`` (named ``<job>/...``),
    with the experiment's ``calls.json`` when given, through a temporary file renamed into place; returns how many
    jobs it holds."""
    finished = [j for j in jobs if j.result_path.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for job in finished:
            for name in ("run.json", "result.json"):
                tar.add(job.directory / name, arcname=f"{job.name}/{name}")
        if calls is not None:
            data = json.dumps(calls, indent=1).encode()
            info = tarfile.TarInfo(CALLS)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    partial.replace(path)
    return len(finished)


def earlier_calls(work: Path, archive: Path | None) -> list[dict]:
    """The calls that ran this experiment before (command, parallel runs, start and end), from the work directory,
    else from the archive a fresh machine was given: the page's time and command come from all of them."""
    if (work / CALLS).exists():
        return json.loads((work / CALLS).read_text())
    if archive is not None and archive.exists():
        with tarfile.open(archive, "r:gz") as tar:
            if CALLS in tar.getnames():
                return json.loads(tar.extractfile(CALLS).read())
    return []


def restore_finished(jobs: list[Job], path: Path, max_steps: int | None = None) -> list[str]:
    """Put back, from the archive ``path``, every job finished there and not here, if it ran with the same arguments
    (another run under that name is left to ``prepare`` to refuse) and, given ``max_steps``, made its validation at
    that step (else it runs again); returns the names restored."""
    restored = []
    with tarfile.open(path, "r:gz") as tar:
        names = set(tar.getnames())
        for job in jobs:
            if job.result_path.exists() or f"{job.name}/result.json" not in names:
                continue
            record = json.loads(tar.extractfile(f"{job.name}/run.json").read())
            if record.get("args") != job.args:
                continue
            result = tar.extractfile(f"{job.name}/result.json").read()
            if max_steps is not None and job.seed is not None and not has_final_validation(json.loads(result),
                                                                                            max_steps):
                continue
            job.directory.mkdir(parents=True, exist_ok=True)
            (job.directory / "run.json").write_text(json.dumps(record, indent=1))
            job.result_path.write_bytes(result)
            restored.append(job.name)
    return restored


def command(args) -> str:
    """This call's command line, as the page shows it."""
    return shlex.join(["python", "docs/experiments/aqn_seeds.py", *args.argv])


def collect(args, config: dict, jobs: list[Job], max_steps: int, started: str, calls: list[dict]) -> dict:
    """The experiment's JSON from the ``result.json`` of every finished job; ``calls`` lists every call so far,
    this one last."""
    results = {j.name: json.loads(j.result_path.read_text()) for j in jobs if j.result_path.exists()}
    base = {j.meta["quantization"]: results.get(j.name) for j in jobs if j.seed is None}
    arms = {}
    for arm in args.arms:
        quantization, aqn, _ = ARMS[arm]
        runs = [j for j in jobs if j.arm == arm]
        arms[arm] = {
            "quantization": quantization,
            "aqn": aqn,
            "options": ARM_OPTIONS.get(arm, []),
            "lr": runs[0].meta["lr"] if runs else None,
            "seeds": [with_base(results[j.name], base.get(quantization)) for j in runs if j.name in results],
        }
    missing = [j.name for j in jobs if j.name not in results]
    return {
        "arms": arms,
        "base": base,
        "steps": max_steps,
        "parallel": args.parallel,
        "gpus": args.gpus,
        "complete": not missing,
        "missing": missing,
        "config": {"path": args.config, "settings": config},
        "train_args": {j.name: j.args for j in jobs},
        "command": command(args),
        "device": device_info(args.device),
        "started": started,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "calls": calls,
    }


def run_jobs(args, jobs: list[Job], max_steps: int, on_finish, final_validation: bool = False) -> list[str]:
    """Run the unfinished jobs, ``args.parallel`` at a time, until all are done or the time limit; returns the names
    of jobs that failed (non-zero exit without being stopped by us)."""
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    pending = [j for j in jobs if not j.result_path.exists()]
    running: list[tuple[Job, subprocess.Popen, object]] = []
    gpu_of: dict[str, int] = {}  # job name -> the GPU its run was given (--gpus > 1)
    started: dict[str, float] = {}  # job name -> time.monotonic() of its attempt's start
    failed: list[str] = []
    retried: set[str] = set()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
               [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    stopping = []

    def stop(signum=None, frame=None):
        stopping.append(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while (pending or running) and not stopping:
            if deadline is not None and time.monotonic() >= deadline:
                print(f"time limit: stopping {len(running)} runs (they resume from their checkpoints)", flush=True)
                break
            # The untrained scores first, on their own: they also write the model cache (the embedded model's
            # conversion, its NVFP4 checkpoint) that every run then reads instead of writing it again.
            bases_left = any(j.seed is None for j in pending) or any(j.seed is None for j, _, _ in running)
            while pending and len(running) < args.parallel and not (bases_left and pending[0].seed is not None):
                job = pending.pop(0)
                attempt = prepare(job)
                log = job.log_path.open("a")
                log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} train.py {' '.join(attempt)}\n")
                log.flush()
                command = [sys.executable, "train.py", *attempt, "--threads", str(args.threads)]
                run_env = env
                if args.gpus > 1:
                    gpu_of[job.name] = least_loaded_gpu([gpu_of[j.name] for j, _, _ in running], args.gpus)
                    run_env = {**env, "CUDA_VISIBLE_DEVICES": str(gpu_of[job.name])}
                print(f"start {job.name}" + (" (resuming)" if "--ckpt_path" in attempt else ""), flush=True)
                process = subprocess.Popen(command, cwd=ROOT, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
                running.append((job, process, log))
                started[job.name] = time.monotonic()
            time.sleep(args.poll)
            for item in list(running):
                job, process, log = item
                if process.poll() is None:
                    continue
                running.remove(item)
                log.close()
                record_attempt(job, time.monotonic() - started[job.name])
                if process.returncode == 0 and finish(job, max_steps, final_validation):
                    print(f"done  {job.name}", flush=True)
                    on_finish()
                elif job.name not in retried:  # once more, after the others (a run of many at once can run out
                    retried.add(job.name)       # of GPU memory); it resumes from its last checkpoint
                    pending.append(job)
                    pending.sort(key=lambda j: j.seed is not None)  # (untrained scores still go first)
                    print(f"FAILED {job.name} (exit {process.returncode}): again after the others; see "
                          f"{job.log_path}", flush=True)
                else:
                    failed.append(job.name)
                    print(f"FAILED {job.name} (exit {process.returncode}): see {job.log_path}", flush=True)
    finally:
        for job, process, log in running:  # stopped by the time limit or a signal: checkpoints stay, resume later
            signal_group(process, signal.SIGTERM)
        for job, process, log in running:
            try:  # (time for the step, or the validation, in progress to finish and the checkpoint to be written)
                process.wait(timeout=args.stop_grace)
            except subprocess.TimeoutExpired:
                signal_group(process, signal.SIGKILL)
                process.wait()
            log.close()
            record_attempt(job, time.monotonic() - started[job.name])
        for s, handler in previous.items():
            signal.signal(s, handler)
    return failed


def least_loaded_gpu(running_on: list[int], gpus: int) -> int:
    """The GPU (0..gpus-1) running the fewest of the runs in progress (``running_on``: the GPU of each); the lowest
    such index."""
    load = [running_on.count(g) for g in range(gpus)]
    return load.index(min(load))


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """Signal a run's process group (train.py and its reward workers), unless it has ended already."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, passthrough = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- go to every train.py call.")
    parser.add_argument("--experiment", choices=list(EXPERIMENTS), default="aqn",
                        help="which arms (and default --work / --out): issues 22/40's AQN arms or issue 51's "
                             "corrections")
    parser.add_argument("--arms", nargs="+", default=None, choices=list(ARMS), help="default: the experiment's")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--device", choices=list(DEVICES), default="cuda")
    parser.add_argument("--config", default=CONFIG, help="the train.py config every run starts from")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (each its own process)")
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs the parallel runs are spread over (CUDA devices 0..N-1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads per run (default: the machine's cores over --parallel)")
    parser.add_argument("--work", default=None, help="where the runs live (resumed from there; default: the "
                        "experiment's)")
    parser.add_argument("--out", default=None, help="the experiment's JSON (default: the experiment's)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds after which running runs are stopped (they resume on the next call)")
    parser.add_argument("--archive", default=None,
                        help="tar.gz of the finished runs: restored from at the start, rewritten with the JSON")
    parser.add_argument("--stop-grace", type=float, default=120.0,
                        help="seconds a run stopped by the time limit gets to write its checkpoint before it is killed")
    parser.add_argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args(ours)
    if (args.parallel < 1 or args.gpus < 1 or (args.steps is not None and args.steps < 1)
            or len(set(args.seeds)) != len(args.seeds)):
        parser.error("--parallel, --gpus and --steps must be >= 1, and --seeds distinct")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.parallel)
    arms, work, out = EXPERIMENTS[args.experiment]
    args.arms, args.work, args.out = args.arms or list(arms), args.work or work, args.out or out
    args.passthrough, args.argv = passthrough, argv
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config = yaml.safe_load((ROOT / args.config).read_text())
    max_steps = config_max_steps(config, args)
    final_validation = validates_at_last_step(config, args, max_steps)
    jobs = plan(args, config)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    archive = Path(args.archive) if args.archive else None
    if archive is not None and archive.exists():
        restored = restore_finished(jobs, archive, max_steps if final_validation else None)
        if restored:
            print(f"restored {len(restored)} finished runs from {args.archive}", flush=True)
    previous = earlier_calls(Path(args.work), archive)
    for job in jobs:  # a run finished here without its last validation runs again
        if final_validation and job.seed is not None and job.result_path.exists() and not has_final_validation(
                json.loads(job.result_path.read_text()), max_steps):
            start_over(job, max_steps)

    def write() -> dict:
        call = {"command": command(args), "parallel": args.parallel, "gpus": args.gpus, "threads": args.threads,
                "time_limit": args.time_limit, "started": started,
                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "runs_done": sum(j.result_path.exists() for j in jobs)}
        calls = previous + [call] if todo or not previous else previous  # a call that ran nothing adds no time
        Path(args.work).mkdir(parents=True, exist_ok=True)
        (Path(args.work) / CALLS).write_text(json.dumps(calls, indent=1))
        data = collect(args, config, jobs, max_steps, started, calls)
        out.write_text(json.dumps(data, indent=1))
        if archive is not None:
            archive_finished(jobs, archive, calls)
        return data

    todo = [j.name for j in jobs if not j.result_path.exists()]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs done; running {len(todo)}, {args.parallel} at a time, "
          f"{args.threads} threads each", flush=True)
    failed = run_jobs(args, jobs, max_steps, write, final_validation) if todo else []
    data = write()
    print(f"wrote {out} ({'complete' if data['complete'] else 'missing: ' + ', '.join(data['missing'])})", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
