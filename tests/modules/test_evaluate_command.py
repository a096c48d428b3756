"""The README's evaluation command without training: ``train.py validate`` with configs/eval_reasoning.yaml and
lighteval's sampling (configs/eval_lighteval.yaml) on local files in the hub schemas; pass@k beside mean@k, equal to
the unbiased estimator of the JSONL's verdicts. A verl compute_score as the reward (whose verdict depends on the
completion's text) gives the samples mixed verdicts, so the pass@k values are not all 0 or 1."""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import yaml

from qerl.data.user_rewards import load_function

ROOT = Path(__file__).resolve().parents[2]
PARITY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)
'''


def hub_files(tmp_path: Path) -> dict[str, str]:
    """Three questions per set, each in its hub dataset's columns."""
    tables = {
        "AIME2024": [{"id": i, "problem": f"Find {i} + {i}.", "solution": f"$\\boxed{{{2 * i}}}$", "answer": str(2 * i),
                      "url": "u", "year": 2024} for i in range(3)],
        "AIME2025": [{"id": i, "problem": f"Find {i} * 3.", "answer": str(3 * i)} for i in range(3)],
        "AMC2023": [{"id": i, "question": f"Find {i} + 1.", "answer": float(i + 1), "url": "u"} for i in range(3)],
        "MATH500": [{"problem": f"Find {i} - 1.", "solution": "s", "answer": str(i - 1), "subject": "Algebra",
                     "level": 1 + i, "unique_id": f"test/algebra/{i}.json"} for i in range(3)],
    }
    out = {}
    for name, rows in tables.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = str(path)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_validate_scores_aime_amc_math500_with_lightevals_sampling_and_pass_at_k(tiny_model_dirs, tmp_path,
                                                                                  monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl.cli import cli_main

    (tmp_path / "parity.py").write_text(textwrap.dedent(PARITY))
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / "eval_reasoning.yaml").read_text())
    files = hub_files(tmp_path)
    sources = [{"class_path": s["class_path"], "init_args": {**(s.get("init_args") or {}),
                                                            "data_files": files[s["class_path"].rpartition(".")[2]]}}
               for s in config["data"]["val_sources"]]  # the config's sources, reading the local files
    try:
        cli_main(["validate", "--model.rollout", "qerl.rollout.builtin.BuiltinRollout",  # as a recipe sets it
                  "--config", str(ROOT / "configs" / "eval_reasoning.yaml"),
                  "--config", str(ROOT / "configs" / "eval_lighteval.yaml"),
                  "--model.policy.model", str(tiny_model_dirs["qwen2"]), "--model.policy.dtype", "float32",
                  "--model.policy.lora_rank", "4", "--data.val_sources", json.dumps(sources),
                  "--model.evaluation.samples", "4", "--model.sampling.max_new_tokens", "6",
                  "--model.reward", "qerl.data.custom_reward.CustomRewardFunction",
                  "--model.reward.init_args.path", "parity.py", "--model.reward.init_args.num_workers", "1",
                  "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                  "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    finally:
        load_function.cache_clear()
    log_dir = tmp_path / "runs" / "eval_reasoning" / "version_0"
    events = EventAccumulator(str(log_dir)).Reload()
    values = {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}
    records = [json.loads(line) for line in (log_dir / "eval" / "val_step0.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in records} == {"sampled"} and {r["temperature"] for r in records} == {0.6}  # no greedy
    verdicts = defaultdict(list)
    for r in records:
        verdicts[(r["source"], r["question"])].append(r["correct"])
    assert {source for source, _ in verdicts} == {"aime24", "aime25", "amc23", "math500"}
    assert all(len(v) == 4 for v in verdicts.values())
    mixed = 0
    for source in ("aime24", "aime25", "amc23", "math500"):
        questions = [v for (s, _), v in verdicts.items() if s == source]
        for k in (2, 4):
            want = sum(pass_at_k(4, sum(v), k) for v in questions) / len(questions)
            assert abs(values[f"val/{source}_pass@{k}"] - want) < 1e-6, (source, k)
        assert abs(values[f"val/{source}_mean@4"] - sum(map(sum, questions)) / 12) < 1e-6
        mixed += sum(0 < sum(v) < 4 for v in questions)
    assert mixed > 0  # some question has right and wrong samples: pass@2 differs from mean@4 and from 0/1 there
    assert "val/math500_level2_mean@4" in values


def test_eval_gsm8k_reads_a_local_copy_as_its_comment_says(tiny_model_dirs, tmp_path, monkeypatch):
    # what a user without the developers' data does: a local file in GSM8K's schema through the documented override
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl.cli import cli_main

    config = ROOT / "configs" / "eval_gsm8k.yaml"
    override = next(line for line in config.read_text().splitlines() if "val_sources.init_args.data_files" in line)
    option, path = override.lstrip("# ").split()[:2]
    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1\n#### {i + 1}"} for i in range(3)]
    (tmp_path / path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    cli_main(["validate", "--config", str(config), option, path, "--model.policy.model", str(tiny_model_dirs["llama"]),
              "--model.policy.dtype", "float32", "--model.policy.lora_rank", "4",
              "--model.rollout", "qerl.rollout.builtin.BuiltinRollout", "--model.sampling.max_new_tokens", "2",
              "--trainer.accelerator", "cpu", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
              "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    log_dir = tmp_path / "runs" / "eval_gsm8k" / "version_0"
    assert "val/gsm8k_acc" in EventAccumulator(str(log_dir)).Reload().Tags()["scalars"]
    assert len((log_dir / "eval" / "val_step0.jsonl").read_text().splitlines()) == 3
