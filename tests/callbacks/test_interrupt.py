"""Ctrl-C and SIGTERM on a real ``python train.py`` process: fit leaves a checkpoint and prints the resume command,
and the resume continues from it; an interrupted ``validate`` keeps its run directory and what it scored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qerl.callbacks.interrupt import resume_command
from qerl.cli import cli_main

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "debug.yaml")
pytestmark = pytest.mark.slow


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """The process's output once it exits; one still running at ``timeout`` is killed (no child outlives the test)
    and the test fails with the end of what it printed."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {timeout} s after the signal:\n{proc.communicate()[0][-3000:]}")


def wait_for(path_glob: str, root: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not list(root.glob(path_glob)):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {path_glob} in {timeout} s"
        time.sleep(0.2)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_fit_leaves_a_checkpoint_and_the_resume_command_that_continues(tiny_model_dirs, tmp_path,
                                                                                     signum):
    args = ["fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]), "--trainer.max_steps",
            "10000", "--trainer.logger.init_args.save_dir", "runs", "--model.sampling.max_new_tokens", "16"]
    proc = start(tmp_path, *args)
    wait_for("runs/debug/version_0/checkpoints/epoch=0-step=1.ckpt", tmp_path, proc)  # the first step is done
    proc.send_signal(signum)
    output = finish(proc)
    checkpoint = tmp_path / "runs/debug/version_0/checkpoints/interrupted.ckpt"
    assert checkpoint.exists(), output[-3000:]
    assert proc.returncode == 128 + signum, output[-3000:]  # 130 / 143: `fit ... && export` does not go on
    assert "Traceback" not in output, output[-3000:]
    assert f"--ckpt_path {checkpoint.relative_to(tmp_path)}" in output or f"--ckpt_path {checkpoint}" in output
    import torch

    step = torch.load(checkpoint, weights_only=False, map_location="cpu")["global_step"]
    assert 1 <= step < 10000
    os.chdir(tmp_path)  # the resume command is relative to where the run started
    try:
        cli = cli_main([*args[:5], "--trainer.max_steps", str(step + 1), *args[7:], "--ckpt_path", str(checkpoint)])
    finally:
        os.chdir(ROOT)
    assert cli.trainer.global_step == step + 1  # one more step after the interrupted ones
    assert Path(cli.trainer.log_dir).name == "version_0"  # logging into the same run
    saved = checkpoint.parent
    assert torch.load(saved / "last.ckpt", weights_only=False, map_location="cpu")["global_step"] == step + 1
    assert not list(saved.glob("*-v1.ckpt"))  # last.ckpt is the newest state, no last-v1.ckpt beside a stale one


def test_an_interrupted_validate_keeps_its_run_directory_and_the_scored_jsonl(tiny_model_dirs, tmp_path):
    val = [{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"seed": 1, "num_rows": 100000}}]
    proc = start(tmp_path, "validate", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
                 "--trainer.logger.init_args.save_dir", "runs", "--data.val_sources", json.dumps(val),
                 "--data.val_batch_size", "2")
    wait_for("runs/debug/version_0/hparams.yaml", tmp_path, proc)
    time.sleep(3)  # some batches scored (none is fine too: the file and the directory must stay either way)
    proc.send_signal(signal.SIGINT)
    output = finish(proc)
    scored = tmp_path / "runs/debug/version_0/eval/val_step0_interrupted.jsonl"
    assert scored.exists(), output[-3000:]
    for line in scored.read_text().splitlines():
        assert json.loads(line)["source"] == "arithmetic"


def test_the_resume_command_replaces_an_earlier_checkpoint_path():
    argv = ["train.py", "fit", "--config", "a b.yaml", "--ckpt_path", "old.ckpt", "--ckpt_path=x.ckpt"]
    assert resume_command(Path("new.ckpt"), argv) == "python train.py fit --config 'a b.yaml' --ckpt_path new.ckpt"
