"""aqn_seeds.py end to end on CPU with a tiny random model: the base score and one arm x one seed through the real
``train.py``, the JSON it writes, a second call that does no work, a run directory made with other arguments refused,
and a stopped run resumed from its checkpoint ending with the curves of the straight run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from qerl.cli import QeRLCLI
from qerl.data.prompts import MathPromptDataModule
from qerl.data.sources import ArithmeticExpressions
from qerl.modules.grpo_module import GRPOModule

from .conftest import load_script

seeds_script = load_script("aqn_seeds")
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "experiments" / "aqn_arithmetic.yaml"
STEPS = 3


def test_the_experiment_config_holds_out_at_least_200_questions_training_never_draws(tmp_path, monkeypatch,
                                                                                       no_model_loads):
    monkeypatch.chdir(tmp_path)
    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False,
                  args=["--config", str(CONFIG), "--trainer.accelerator", "cpu"])
    train, (heldout,) = cli.datamodule.source, cli.datamodule.val_sources
    assert isinstance(train, ArithmeticExpressions) and isinstance(heldout, ArithmeticExpressions)
    assert (train.split, heldout.split) == ("train", "heldout")
    assert train.heldout_fraction == heldout.heldout_fraction  # the parts are disjoint only then
    questions = {row["question"] for row in heldout}
    assert len(questions) == heldout.num_rows >= 200
    assert type(cli.model.rollout).__name__ == "CUDAGraphRollout"


def test_the_bf16_low_rate_follows_the_recipes_rule():
    gpu = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())["model"]["optimizer"]["lr"]
    bf16 = yaml.safe_load((ROOT / "configs" / "recipes" / "bf16.yaml").read_text())["model"]["optimizer"]["lr"]
    assert seeds_script.bf16_lr_ratio() == pytest.approx(bf16 / gpu) == pytest.approx(0.5)


@pytest.fixture(scope="module")
def small_config(tmp_path_factory) -> Path:
    """The experiment config with a checkpoint after every step, all kept (a stopped run can be made at any step)."""
    config = yaml.safe_load(CONFIG.read_text())
    config["trainer"]["callbacks"][0]["init_args"].update(every_n_train_steps=1, save_top_k=-1)
    path = tmp_path_factory.mktemp("config") / "aqn_small.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def arguments(work: Path, out: Path, config: Path, model: Path, *extra: str) -> list[str]:
    heldout = [{"class_path": "qerl.data.sources.ArithmeticExpressions",
                "init_args": {"split": "heldout", "num_rows": 4, "seed": 1234, "steps": [1, 2]}}]
    return [
        "--device", "cpu", "--arms", "nvfp4_aqn", "--seeds", "0", "--steps", str(STEPS), "--threads", "1",
        "--config", str(config), "--work", str(work), "--out", str(out), "--poll", "0.2", "--",
        "--model.policy.model", str(model), "--model.sampling.max_new_tokens", "4",
        "--model.sampling.group_size", "2", "--data.batch_size", "2", "--model.update.micro_batch_size", "4",
        "--trainer.val_check_interval", "1", "--data.val_batch_size", "4", "--data.val_sources", json.dumps(heldout),
        "--trainer.enable_progress_bar", "false", *extra,
    ]


@pytest.mark.slow
def test_runs_resumes_and_writes_one_json(tiny_model_dirs, small_config, tmp_path, capsys):
    work, out, archive = tmp_path / "work", tmp_path / "aqn.json", tmp_path / "out" / "runs.tar.gz"
    args = arguments(work, out, small_config, tiny_model_dirs["qwen2"])
    args.insert(args.index("--"), "--archive")
    args.insert(args.index("--"), str(archive))
    data = seeds_script.main(args)

    # The JSON: arms -> seeds -> per-seed curves, plus config, command, device.
    assert data["complete"] and json.loads(out.read_text()) == data
    assert {"arms", "config", "command", "device", "base", "steps", "train_args"} <= set(data)
    assert data["command"].startswith("python docs/experiments/aqn_seeds.py --device cpu")
    assert data["device"]["requested"] == "cpu" and data["config"]["settings"]["aqn"]["num_stages"] == 10
    (seed,) = data["arms"]["nvfp4_aqn"]["seeds"]
    assert data["arms"]["nvfp4_aqn"]["lr"] == 2e-4 and data["arms"]["nvfp4_aqn"]["aqn"] is True
    assert seed["seed"] == 0 and seed["steps"] == [1, 2, 3]
    for key in ("reward", "accuracy", "rollout_entropy", "train_entropy", "aqn_sigma", "learning_rate"):
        assert len(seed[key]) == STEPS and all(isinstance(v, float) for v in seed[key]), key
    assert seed["heldout"]["steps"] == [0, 1, 2, 3]  # the untrained score, then a validation after every step
    assert len(seed["heldout"]["expressions_acc_flexible"]) == 4
    assert seed["final_heldout_expressions_acc"] == seed["heldout"]["expressions_acc"][-1]
    assert seed["heldout"]["expressions_acc"][0] == data["base"]["nvfp4"]["heldout"]["expressions_acc"]
    questions = data["base"]["nvfp4"]["questions"]  # the untrained verdict per held-out question (greedy)
    assert len(questions) == 4 and {q["source"] for q in questions} == {"expressions"}
    assert sum(q["correct"] for q in questions) / 4 == data["base"]["nvfp4"]["heldout"]["expressions_acc"]
    assert seed["wall_seconds"] > 0 and data["base"]["nvfp4"]["wall_seconds"] > 0 and data["parallel"] == 1
    (call,) = data["calls"]  # every call so far: its command, runs at once, start and end, runs done by its end
    assert (call["command"], call["parallel"], call["runs_done"]) == (data["command"], 1, 2)
    assert call["started"] <= call["written"]
    train_args = data["train_args"]["nvfp4_aqn/seed_0"]
    for option, value in [("--seed_everything", "0"), ("--aqn.seed", "0"), ("--aqn.enabled", "true"),
                          ("--model.policy.quantization", "nvfp4"), ("--trainer.max_steps", str(STEPS))]:
        assert train_args[train_args.index(option) + 1] == value
    sources = json.loads(train_args[train_args.index("--data.sources") + 1])
    assert sources[0]["init_args"]["seed"] == 0 and sources[0]["init_args"]["split"] == "train"

    # A second call finds everything done and runs nothing.
    run_dir = work / "nvfp4_aqn" / "seed_0"
    stamp = (run_dir / "result.json").stat().st_mtime_ns
    capsys.readouterr()
    again = seeds_script.main(args)
    printed = capsys.readouterr().out
    assert "2 of 2 runs done; running 0" in printed and "start" not in printed and "restored" not in printed
    assert (run_dir / "result.json").stat().st_mtime_ns == stamp
    assert again["arms"] == data["arms"]
    assert again["calls"] == data["calls"]  # a call that ran nothing adds no time

    # On a fresh machine (no work directory) the archive carried over puts the finished runs back: nothing runs.
    work.rename(tmp_path / "work_elsewhere")
    capsys.readouterr()
    fresh = seeds_script.main(args)
    printed = capsys.readouterr().out
    assert "restored 2 finished runs" in printed and "2 of 2 runs done; running 0" in printed and "start" not in printed
    assert fresh["arms"] == data["arms"] and fresh["base"] == data["base"]
    assert fresh["calls"] == data["calls"]  # the history came with the archive
    shutil.rmtree(work)
    (tmp_path / "work_elsewhere").rename(work)
    args = arguments(work, out, small_config, tiny_model_dirs["qwen2"])  # without the archive from here on

    # A run stopped after step 1: its last checkpoint is step 1's, its events go further, it has no result yet.
    checkpoints = run_dir / "version_0" / "checkpoints"
    shutil.copy(next(checkpoints.glob("*step=1.ckpt")), checkpoints / "last.ckpt")
    (run_dir / "result.json").unlink()

    # Other arguments for an unfinished run directory are refused, not mixed in.
    with pytest.raises(SystemExit, match="holds a run with other arguments"):
        seeds_script.main(args + ["--model.optimizer.lr", "1e-3"])

    capsys.readouterr()
    resumed = seeds_script.main(args)
    printed = capsys.readouterr().out
    assert "start nvfp4_aqn/seed_0 (resuming)" in printed and "base_nvfp4" not in printed.split("done")[-1]
    (again_seed,) = resumed["arms"]["nvfp4_aqn"]["seeds"]
    assert len(list((run_dir / "version_0").glob("events.out.tfevents.*"))) >= 2  # the resumed attempt's own file
    for key in ("reward", "rollout_entropy", "train_entropy", "learning_rate"):
        assert again_seed[key] == pytest.approx(seed[key], rel=1e-5), key  # steps 2-3 again, the later values win
    assert again_seed["heldout"] == seed["heldout"]
    assert [c["runs_done"] for c in resumed["calls"]] == [2, 2] and resumed["calls"][0] == data["calls"][0]


@pytest.mark.slow
def test_a_failed_run_is_tried_once_more_after_the_others(tiny_model_dirs, small_config, tmp_path, capsys):
    args = arguments(tmp_path / "work", tmp_path / "aqn.json", small_config, tiny_model_dirs["qwen2"],
                     "--model.no_such_option", "1")  # every train.py call fails
    data = seeds_script.main(args)
    printed = capsys.readouterr()
    assert printed.out.count("again after the others") == 2  # the base score and the one run, once each
    assert printed.out.count("FAILED") == 4 and "failed: base_nvfp4, nvfp4_aqn/seed_0" in printed.err
    assert not data["complete"]


def test_every_arm_differs_from_its_partner_in_one_setting(tmp_path):
    """Issue 40's arms: bf16 + AQN at the bf16 rate (against bf16_lr_low) and at the NVFP4 rate (against bf16_lr_high),
    NVFP4 + AQN at the bf16 rate (against bf16_aqn and nvfp4_aqn); 5 seeds by default, base scores first."""
    args = seeds_script.parse_args(["--device", "cpu", "--work", str(tmp_path)])
    assert args.seeds == [0, 1, 2, 3, 4] and set(args.arms) == set(seeds_script.EXPERIMENTS["aqn"][0])
    jobs = seeds_script.plan(args, yaml.safe_load(CONFIG.read_text()))
    assert [j.name for j in jobs[:2]] == ["base_bf16", "base_nvfp4"] and len(jobs) == 2 + 5 * 7

    def settings(name: str) -> tuple[str, str, float]:
        a = next(j for j in jobs if j.name == name).args
        return a[a.index("--model.policy.quantization") + 1], a[a.index("--aqn.enabled") + 1], \
            float(a[a.index("--model.optimizer.lr") + 1])

    high, low = 2e-4, 2e-4 * seeds_script.bf16_lr_ratio()
    expected = {"bf16_aqn": ("bf16", "true", low), "bf16_lr_low": ("bf16", "false", low),
                "bf16_aqn_lr_high": ("bf16", "true", high), "bf16_lr_high": ("bf16", "false", high),
                "nvfp4_aqn_lr_low": ("nvfp4", "true", low), "nvfp4_aqn": ("nvfp4", "true", high),
                "nvfp4": ("nvfp4", "false", high)}
    for arm, (quantization, aqn, lr) in expected.items():
        got = settings(f"{arm}/seed_3")
        assert got[:2] == (quantization, aqn) and got[2] == pytest.approx(lr), arm


def test_the_correction_experiment_runs_nvfp4_aqn_with_each_correction_and_nothing_else_changed(capsys):
    """Issue 51's arms: today's token TIS (nvfp4_aqn), TRL's default sequence_mask (C_max 3), IcePop's token_mask
    [0.5, 5]; each differs from nvfp4_aqn only in its correction options, which train.py parses."""
    args = seeds_script.parse_args(["--experiment", "correction", "--device", "cpu"])
    assert args.arms == ["nvfp4_aqn", "nvfp4_aqn_sequence_mask", "nvfp4_aqn_icepop"]
    assert (args.work, args.out) == ("runs/correction_seeds", "docs/results/correction_seeds.json")
    jobs = {j.name: j.args for j in seeds_script.plan(args, yaml.safe_load(CONFIG.read_text()))}
    assert list(jobs)[0] == "base_nvfp4" and len(jobs) == 1 + 5 * 3
    reference = jobs["nvfp4_aqn/seed_2"]
    for arm in ("nvfp4_aqn_sequence_mask", "nvfp4_aqn_icepop"):
        got, extra = jobs[f"{arm}/seed_2"], seeds_script.ARM_OPTIONS[arm]
        start = got.index(extra[0])
        assert got[start:start + len(extra)] == extra
        assert [a.replace(arm, "nvfp4_aqn") for a in got[:start] + got[start + len(extra):]] == reference
    from qerl.cli import cli_main
    for arm, mode in (("nvfp4_aqn_sequence_mask", "sequence_mask"), ("nvfp4_aqn_icepop", "token_mask")):
        with pytest.raises(SystemExit) as exit_info:  # --print_config: the options parse, then exit 0
            cli_main(["fit", "--config", str(CONFIG), *seeds_script.ARM_OPTIONS[arm], "--print_config"])
        assert exit_info.value.code in (0, None) and f"mode: {mode}" in capsys.readouterr().out


def test_the_archive_restores_finished_runs_made_with_the_same_arguments(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())

    def jobs_for(*extra: str):
        return seeds_script.plan(seeds_script.parse_args(["--device", "cpu", "--arms", "bf16_aqn", "--seeds", "0", "1",
                                                          "--work", str(tmp_path / "work"), *extra]), config)

    jobs = jobs_for()
    for job in jobs[:2]:  # base_bf16 and bf16_aqn/seed_0 finished, seed 1 not
        job.directory.mkdir(parents=True)
        (job.directory / "run.json").write_text(json.dumps({"args": job.args, "attempt_seconds": [3.0]}))
        job.result_path.write_text(json.dumps({"seed": job.seed, "wall_seconds": 3.0}))
    written = {job.name: job.result_path.read_text() for job in jobs[:2]}
    archive = tmp_path / "out" / "runs.tar.gz"
    assert seeds_script.archive_finished(jobs, archive) == 2

    shutil.rmtree(tmp_path / "work")  # a fresh machine: the same command, no work directory
    assert seeds_script.restore_finished(jobs, archive) == ["base_bf16", "bf16_aqn/seed_0"]
    assert {job.name: job.result_path.read_text() for job in jobs[:2]} == written
    assert not jobs[2].result_path.exists()
    assert seeds_script.restore_finished(jobs, archive) == []  # already here: nothing to put back

    shutil.rmtree(tmp_path / "work")
    other = jobs_for("--steps", "7")  # the training run's arguments differ, the base score's do not
    assert seeds_script.restore_finished(other, archive) == ["base_bf16"]


def test_a_stopped_run_resumes_from_its_newest_checkpoint(tmp_path):
    assert seeds_script.newest_checkpoint(tmp_path) is None
    last, interrupted = tmp_path / "last.ckpt", tmp_path / "interrupted.ckpt"
    last.write_bytes(b"step 20, before its validation")
    assert seeds_script.newest_checkpoint(tmp_path) == last
    interrupted.write_bytes(b"step 23, after SIGTERM")
    os.utime(last, ns=(1_000_000_000, 1_000_000_000))
    assert seeds_script.newest_checkpoint(tmp_path) == interrupted
    os.utime(interrupted, ns=(500_000_000, 500_000_000))  # an old interruption, periodic checkpoints since
    assert seeds_script.newest_checkpoint(tmp_path) == last


def test_a_run_without_its_last_validation_runs_again(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())  # validates every 20 steps
    args = seeds_script.parse_args(["--device", "cpu", "--arms", "nvfp4", "--seeds", "0", "1", "--steps", "100",
                                    "--work", str(tmp_path / "work")])
    assert seeds_script.validates_at_last_step(config, args, 100)
    assert not seeds_script.validates_at_last_step(config, args, 30)
    other = seeds_script.parse_args(["--steps", "30", "--", "--trainer.val_check_interval", "10"])
    assert seeds_script.validates_at_last_step(config, other, 30)
    _, seed_0, seed_1 = seeds_script.plan(args, config)
    for job, steps in ((seed_0, [0, 20, 40, 60, 80, 100]), (seed_1, [0, 20, 40, 60, 80])):
        job.directory.mkdir(parents=True)
        (job.directory / "run.json").write_text(json.dumps({"args": job.args}))
        job.result_path.write_text(json.dumps({"seed": job.seed, "heldout": {"steps": steps}}))
    archive = tmp_path / "runs.tar.gz"
    assert seeds_script.archive_finished([seed_0, seed_1], archive) == 2
    shutil.rmtree(tmp_path / "work")
    assert seeds_script.restore_finished([seed_0, seed_1], archive, 100) == ["nvfp4/seed_0"]
    assert seeds_script.restore_finished([seed_0, seed_1], archive) == ["nvfp4/seed_1"]  # no schedule: both count


def test_runs_go_to_the_gpu_running_the_fewest():
    assert seeds_script.least_loaded_gpu([], 2) == 0
    assert seeds_script.least_loaded_gpu([0], 2) == 1
    assert seeds_script.least_loaded_gpu([0, 1, 1, 0, 2], 3) == 2
    assert seeds_script.least_loaded_gpu([2, 2, 0, 1], 3) == 0  # a tie goes to the lowest index
