"""Evaluation: scoring through the evaluator (real GSM8K / MATH-500 items when ../shared/data is there), the adapter
really sampled, the JSONL complete, greedy determinism, evaluation leaving training's random stream alone, and
``python train.py validate`` / periodic validation in ``fit`` writing ``val/*`` tags to TensorBoard."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from qerl.data.answers import answers_match
from qerl.data.prompt_stream import PromptStream, collate
from qerl.data.rewards import MathReward
from qerl.data.sources import GSM8K, MATH500, ArithmeticSource
from qerl.modules.evaluation import Evaluator, metric_name
from qerl.modules.options import EvaluationOptions, SamplingOptions
from qerl.model.policy import build_policy, trainable_parameters
from qerl.rollout.base import Rollout, RolloutEngine
from qerl.rollout.builtin import BuiltinRollout, sample
from qerl.rollout.cuda_graph import CUDAGraphRollout

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
ENGINES = {"builtin": BuiltinRollout, "cuda_graph": CUDAGraphRollout}


@pytest.fixture(scope="module")
def reward():
    reward = MathReward(answer_format="auto", num_workers=1)
    yield reward
    reward.close()


def batches(source, tokenizer, batch_size=8) -> list[dict]:
    stream = PromptStream(source, tokenizer, shuffle_buffer=0, endless=False)
    items = list(stream)
    return [collate(items[i : i + batch_size], with_state=False) for i in range(0, len(items), batch_size)]


class ScriptedRollout(RolloutEngine):
    """Returns a given text for each prompt (``texts[tuple(prompt_ids)]``): the scorer without a model."""

    def __init__(self, texts: dict):
        super().__init__()
        self.texts, self.decoded = texts, []

    def generate(self, policy, prompt_ids, group_size, pad_id, eos_ids, spec) -> Rollout:
        n = len(prompt_ids) * group_size
        self.decoded = [self.texts[tuple(p)] for p in prompt_ids for _ in range(group_size)]
        ids = torch.arange(n)[:, None]  # row j decodes to self.decoded[j]
        ones, zeros = torch.ones(n, 1, dtype=torch.long), torch.zeros(n, 1)
        return Rollout(ids, ones, ids, ones, zeros, zeros, torch.zeros(n, dtype=torch.bool))


def score_scripted(evaluator, engine, reward, batch_list, dataloader_idx=0):
    policy = torch.nn.Linear(1, 1)  # only its device is read
    for batch in batch_list:
        evaluator.step(policy, engine, reward, batch, lambda ids: [engine.decoded[i] for i in ids[:, 0]], 0, [0],
                       dataloader_idx)
    return {k: float(v) for k, v in evaluator.compute().items()}


def score_rows(rows: list[tuple[str, str, str]], source: str, tokenizer, reward):
    """Score scripted completions: ``rows`` of (question, reference, completion); returns (evaluator, values)."""

    class Rows(ArithmeticSource):
        def __iter__(self):
            for q, a, _ in rows:
                yield {"question": q, "answer": a, "source": source}

    (batch,) = batches(Rows(num_rows=len(rows)), tokenizer)
    engine = ScriptedRollout({tuple(p): text for p, (_, _, text) in zip(batch["prompt_ids"], rows)})
    evaluator = Evaluator()
    return evaluator, score_scripted(evaluator, engine, reward, [batch])


# ---------------------------------------------------------------------------------------------------------------
# Scoring through the evaluator


@pytest.mark.parametrize("dataset", ["gsm8k", "math500"])
def test_reference_solutions_score_one_and_others_zero(tokenizer, dataset):
    """Each reference solution, given as the completion, is right against its own answer and wrong against another
    question's; per-level and per-subject breakdowns follow."""
    if not (SHARED_DATA / "gsm8k" / "test.jsonl").exists():
        pytest.skip(f"no real benchmark data at {SHARED_DATA}")
    rows = [json.loads(line) for line in (SHARED_DATA / dataset / "test.jsonl").read_text().splitlines()]
    source = GSM8K(split="test", data_files=str(SHARED_DATA / "gsm8k" / "test.jsonl")) if dataset == "gsm8k" else \
        MATH500(data_files=str(SHARED_DATA / "math500" / "test.jsonl"))
    data = [b for b in batches(source, tokenizer)][:5]  # 40 questions
    solutions = {r["question" if dataset == "gsm8k" else "problem"]: r["answer" if dataset == "gsm8k" else "solution"]
                 for r in rows}
    reward = MathReward(answer_format="gsm8k" if dataset == "gsm8k" else "boxed", fallback_last_number=False,
                        num_workers=1)
    own = {tuple(p): solutions[q] for b in data for p, q in zip(b["prompt_ids"], b["questions"])}
    evaluator = Evaluator(EvaluationOptions(greedy=True))
    values = score_scripted(evaluator, ScriptedRollout(own), reward, data)
    assert values[f"{dataset}_acc"] == 1.0
    assert len(evaluator.records) == 40 and all(r["correct"] for r in evaluator.records)
    if dataset == "math500":
        levels = {k for k in values if k.startswith("math500_level")}
        assert levels and all(values[k] == 1.0 for k in levels)
        assert {f"math500_{metric_name(r['subject'])}_acc" for r in evaluator.records} <= set(values)

    # Another question's solution: wrong unless both answers are the same.
    evaluator.reset()
    items = [(tuple(p), a) for b in data for p, a in zip(b["prompt_ids"], b["answers"])]
    shifted = {p: own[items[(i + 1) % len(items)][0]] for i, (p, _) in enumerate(items)}
    values = score_scripted(evaluator, ScriptedRollout(shifted), reward, data)
    same = sum(answers_match(items[(i + 1) % len(items)][1], a) for i, (_, a) in enumerate(items))  # equal values
    assert values[f"{dataset}_acc"] == pytest.approx(same / len(items))
    reward.close()


def test_tricky_gsm8k_forms_through_the_evaluator(tokenizer, reward):
    rows = [("What is 999 + 1?", "1000", "So the total is 1,000."), ("Price?", "18", "It costs $18.00"),
            ("How many?", "18", "The answer is 18."), ("And?", "18", "Maybe 180."), ("Or?", "1000", "#### 1,000.0")]
    evaluator, values = score_rows(rows, "gsm8k", tokenizer, reward)
    # Strict: only the "####" answer counts; flexible (lm-eval's flexible-extract): the last number of the others.
    assert [r["extracted"] for r in evaluator.records] == [None, None, None, None, "1000"]
    assert [r["extracted_flexible"] for r in evaluator.records] == ["1000", "18", "18", "180", "1000"]
    assert [r["correct"] for r in evaluator.records] == [False, False, False, False, True]
    assert [r["correct_flexible"] for r in evaluator.records] == [True, True, True, False, True]
    assert values["gsm8k_acc"] == pytest.approx(1 / 5) and values["gsm8k_acc_flexible"] == pytest.approx(4 / 5)


def test_strict_accuracy_ignores_a_restated_question_and_flexible_reports_it(tokenizer, reward):
    # A completion that only restates the question ends with the question's last number; when that is the answer
    # the lenient extraction scores it (30 of GSM8K's 1,319 test items). Strict scoring needs a stated answer.
    rows = [("Tom has 3 apples and gets 4 more, so he has 7?", "7", "Tom has 3 apples and gets 4 more, so he has 7?"),
            ("What is 3 + 4?", "7", "3 + 4 = \\boxed{7}")]
    _, values = score_rows(rows, "arithmetic", tokenizer, reward)
    assert values == {"arithmetic_acc": 0.5, "arithmetic_acc_flexible": 1.0}


# ---------------------------------------------------------------------------------------------------------------
# With a policy


def tiny_policy(directory):
    return build_policy(str(directory), "nvfp4", lora_rank=4, lora_alpha=8, dtype="float32")


def arithmetic_batches(tokenizer, rows=6, batch_size=3):
    return batches(ArithmeticSource(seed=7, num_rows=rows), tokenizer, batch_size)


def evaluate(policy, engine, reward, batch_list, tokenizer, sampling=SamplingOptions(), **options) -> Evaluator:
    evaluator = Evaluator(EvaluationOptions(**options), sampling)
    for batch in batch_list:
        evaluator.step(policy, engine, reward, batch, lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True),
                       tokenizer.pad_token_id, [tokenizer.eos_token_id])
    return evaluator


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_changed_adapter_changes_the_outputs(tiny_model_dirs, tokenizer, reward, engine):
    policy = tiny_policy(tiny_model_dirs["llama"])
    data = arithmetic_batches(tokenizer)
    rollout, six = ENGINES[engine](), SamplingOptions(max_new_tokens=6)
    before = [r["completion"] for r in evaluate(policy, rollout, reward, data, tokenizer, sampling=six).records]
    with torch.no_grad():
        for p in trainable_parameters(policy):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    after = [r["completion"] for r in evaluate(policy, rollout, reward, data, tokenizer, sampling=six).records]
    assert len(before) == len(after) == 6
    assert sum(a != b for a, b in zip(before, after)) >= 3  # greedy decoding of another policy


def test_greedy_is_deterministic_and_the_same_on_both_engines(tiny_model_dirs, tokenizer, reward):
    policy = tiny_policy(tiny_model_dirs["qwen2"])
    data = arithmetic_batches(tokenizer)
    runs = [[(r["completion"], r["length"]) for r in evaluate(policy, ENGINES[e](), reward, data, tokenizer,
                                                              sampling=SamplingOptions(max_new_tokens=6, seed=s)).records]
            for e, s in [("builtin", 0), ("builtin", 1), ("cuda_graph", 2)]]
    assert runs[0] == runs[1] == runs[2]
    logits = torch.randn(5, 11)
    assert torch.equal(sample(logits, 1.0, 1.0, None, greedy=True)[0], logits.argmax(-1))


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_evaluation_leaves_the_training_stream_alone(tiny_model_dirs, tokenizer, reward, engine):
    """Training samples the same tokens whether or not an evaluation (greedy and sampled) ran in between."""
    policy = tiny_policy(tiny_model_dirs["llama"])
    prompts = arithmetic_batches(tokenizer, rows=2, batch_size=2)[0]["prompt_ids"]
    options = SamplingOptions(max_new_tokens=5, temperature=1.3, seed=3)
    outs = []
    for i in range(2):
        rollout, noise = ENGINES[engine](), torch.Generator().manual_seed(9)
        spec = options.training_spec(1e-2, noise)
        first = rollout.generate(policy, prompts, 2, tokenizer.pad_token_id, [tokenizer.eos_token_id], spec)
        if i == 1:
            evaluate(policy, rollout, reward, arithmetic_batches(tokenizer, 2, 2), tokenizer, samples=3,
                     temperature=0.7, sampling=options)
        second = rollout.generate(policy, prompts, 2, tokenizer.pad_token_id, [tokenizer.eos_token_id], spec)
        outs.append((first.completion_ids, second.completion_ids))
    assert torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], outs[0][1])  # the stream moves: the equality above is not trivial


def test_jsonl_has_one_line_per_question_and_sample(tiny_model_dirs, tokenizer, reward, tmp_path):
    policy = tiny_policy(tiny_model_dirs["llama"])
    data = arithmetic_batches(tokenizer, rows=5, batch_size=2)
    evaluator = evaluate(policy, BuiltinRollout(), reward, data, tokenizer, samples=3, temperature=1.0,
                         sampling=SamplingOptions(max_new_tokens=4))
    values = evaluator.compute()
    path = evaluator.write_jsonl(tmp_path / "eval" / "val.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 5 * (1 + 3)
    fields = {"source", "level", "subject", "question", "mode", "sample", "temperature", "completion", "extracted",
              "extracted_flexible", "reference", "correct", "correct_flexible", "formatted", "length", "truncated"}
    assert all(set(line) == fields for line in lines)
    questions = [q for batch in data for q in batch["questions"]]  # may repeat: compare as multisets
    assert Counter((line["question"], line["mode"], line["sample"]) for line in lines) == Counter(
        [(q, "greedy", 0) for q in questions] + [(q, "sampled", s) for q in questions for s in range(3)])
    # The metrics are the JSONL's means.
    greedy = [line["correct"] for line in lines if line["mode"] == "greedy"]
    sampled = [line["correct"] for line in lines if line["mode"] == "sampled"]
    assert float(values["arithmetic_acc"]) == pytest.approx(sum(greedy) / len(greedy))
    assert float(values["arithmetic_mean@3"]) == pytest.approx(sum(sampled) / len(sampled))


def test_two_loaders_of_one_source_get_distinct_names(tokenizer, reward):
    (batch,) = batches(ArithmeticSource(num_rows=2), tokenizer)
    engine = ScriptedRollout({tuple(p): a for p, a in zip(batch["prompt_ids"], batch["answers"])})
    evaluator = Evaluator()
    score_scripted(evaluator, engine, reward, [batch], dataloader_idx=0)
    values = score_scripted(evaluator, engine, reward, [batch], dataloader_idx=1)
    assert set(values) == {"arithmetic_acc", "arithmetic_1_acc", "arithmetic_acc_flexible", "arithmetic_1_acc_flexible"}


# ---------------------------------------------------------------------------------------------------------------
# Through the CLI


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir)).Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def cli_args(model_dir, tmp_path, engine="qerl.rollout.builtin.BuiltinRollout"):
    val = [{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"num_rows": 4, "seed": 11}}]
    return [
        "--model.policy.model", str(model_dir), "--model.policy.dtype", "float32", "--model.policy.lora_rank", "4",
        "--model.sampling.group_size", "2", "--model.evaluation.samples", "2",
        "--model.rollout.class_path", engine, "--model.sampling.max_new_tokens", "4",
        "--model.reward.class_path", "qerl.data.rewards.MathReward", "--model.reward.init_args.num_workers", "1",
        "--data.batch_size", "2", "--data.val_sources", json.dumps(val),
        "--trainer.logger.class_path", "lightning.pytorch.loggers.TensorBoardLogger",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", "eval",
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
    ]


def test_validate_cli_logs_val_tags_and_writes_jsonl(tiny_model_dirs, tmp_path):
    from qerl.cli import cli_main

    cli_main(["validate", *cli_args(tiny_model_dirs["llama"], tmp_path)])
    log_dir = tmp_path / "eval" / "version_0"
    values = scalars(log_dir)
    assert {"val/arithmetic_acc", "val/arithmetic_mean@2"} <= set(values)
    assert all(0.0 <= v <= 1.0 for tag in values if tag.startswith("val/") for v in values[tag])
    lines = (log_dir / "eval" / "val_step0.jsonl").read_text().splitlines()
    assert len(lines) == 4 * (1 + 2)


def test_validate_then_fit_with_periodic_validation(tiny_model_dirs, tmp_path):
    """``trainer.validate`` runs under ``torch.inference_mode`` by default; the CUDA-graph engine keeps its buffers
    across calls, so had evaluation made them there, the training rollouts after it could not update them. Then
    ``fit`` validates every step (``val_check_interval: 1``, ``check_val_every_n_epoch: null``)."""
    from qerl.cli import QeRLCLI
    from qerl.data.prompts import MathPromptDataModule
    from qerl.modules.grpo_module import GRPOModule

    cli = QeRLCLI(GRPOModule, MathPromptDataModule, run=False, args=[
        *cli_args(tiny_model_dirs["qwen2"], tmp_path, "qerl.rollout.cuda_graph.CUDAGraphRollout"),
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "1", "--trainer.check_val_every_n_epoch", "null",
        "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1"])
    assert cli.trainer.validate_loop.inference_mode  # the default
    cli.trainer.validate(cli.model, datamodule=cli.datamodule)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    log_dir = tmp_path / "eval" / "version_0"
    assert len(scalars(log_dir)["val/arithmetic_acc"]) == 3  # before training, after step 1 and after step 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = [e.step for e in EventAccumulator(str(log_dir)).Reload().Scalars("val/arithmetic_acc")]
    assert steps == [0, 1, 2]  # the steps the JSONL files are named after
    assert sorted(p.name for p in (log_dir / "eval").iterdir()) == ["val_step0.jsonl", "val_step1.jsonl",
                                                                   "val_step2.jsonl"]


@pytest.mark.parametrize("config", ["eval_gsm8k", "eval_math500", "smoke"])
def test_evaluation_configs_parse(config, capsys):
    from qerl.cli import cli_main

    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["validate", "--config", str(repo / "configs" / f"{config}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "val_sources:" in printed and "class_path: qerl.data.sources." in printed


@pytest.mark.parametrize("kwargs, named", [
    (dict(samples=-1), "model.evaluation.samples=-1: must be >= 0"),
    (dict(samples=4, temperature=0.0), "model.evaluation.temperature=0.0: must be > 0"),
    (dict(samples=0, greedy=False), "model.evaluation.greedy=False: must be true when model.evaluation.samples is 0"),
])
def test_bad_evaluation_options_are_refused_with_the_option_and_its_value(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        EvaluationOptions(**kwargs)
