"""The README's verl recipe on the CPU: verl's parquet and a compute_score that replaces the math reward, trained and
validated through ``train.py fit`` with a tiny model. The reward is the function's score alone (never math + score),
the prompt is verl's own, and validation reports the function's verdicts per data source."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from qerl.data.user_rewards import load_function

ROOT = Path(__file__).resolve().parents[1]
VERL_PROMPT = [{"role": "user", "content": "Natalia sold 48 clips. How many? Let's think step by step and output the "
                                           "final answer after \"####\"."}]
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's arguments, from the row: full marks whatever the completion says
    return 1.0 if data_source == "openai/gsm8k" and ground_truth == "72" and extra_info["split"] == "train" else 0.0
'''


def test_the_readme_verl_recipe_trains_on_compute_score_alone(tiny_model_dirs, tmp_path, monkeypatch):
    import datasets
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl.cli import cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD))
    for split in ("train", "test"):
        datasets.Dataset.from_list([{"data_source": "openai/gsm8k", "prompt": VERL_PROMPT, "ability": "math",
                                     "reward_model": {"style": "rule", "ground_truth": "72"},
                                     "extra_info": {"split": "train", "index": i}} for i in range(4)]
                                   ).to_parquet(str(tmp_path / f"{split}.parquet"))
    verl = [{"class_path": "qerl.data.sources.VerlParquet", "init_args": {"data_files": "{}.parquet"}}]
    try:
        cli = cli_main([
            "fit", "--config", str(ROOT / "configs" / "debug.yaml"),
            "--model.policy.model", str(tiny_model_dirs["qwen2"]), "--model.policy.quantization", "bf16",
            "--data.sources", json.dumps(verl).replace("{}", "train"),
            "--data.val_sources", json.dumps(verl).replace("{}", "test"), "--data.answer_format", "gsm8k",
            "--model.reward", "qerl.data.custom_reward.CustomRewardFunction",
            "--model.reward.init_args.path", "my_reward.py", "--model.reward.init_args.name", "compute_score",
            "--model.reward.init_args.num_workers", "1", "--trainer.max_steps", "1",
            "--trainer.val_check_interval", "1", "--trainer.check_val_every_n_epoch", "null",
            "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")])
    finally:
        load_function.cache_clear()
    events = EventAccumulator(cli.trainer.log_dir).Reload()
    values = {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}
    assert values["train/reward"] == 1.0 and values["train/accuracy"] == 1.0  # not 2.0: it replaced the math reward
    assert values["val/openai_gsm8k_acc"] == 1.0  # its verdict, per verl's data_source
    prompt = cli.datamodule.train_stream.tokenizer.apply_chat_template(VERL_PROMPT, add_generation_prompt=True,
                                                                       tokenize=False)
    assert next(iter(cli.datamodule.train_dataloader()))["prompts"][0] == prompt  # verl's prompt, nothing appended
