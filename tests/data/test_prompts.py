import copy
import itertools

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from qerl.data.prompt_stream import PromptStream, collate
from qerl.data.prompts import MathPromptDataModule
from qerl.data.sources import GSM8K, ArithmeticSource, HubSource

from .helpers import write_jsonl


def loader(stream: PromptStream, batch_size: int = 4, num_workers: int = 0) -> DataLoader:
    return DataLoader(stream, batch_size=batch_size, num_workers=num_workers, collate_fn=collate)


def take(stream: PromptStream, batches: int, num_workers: int = 0) -> list[list[str]]:
    """The questions of ``batches`` batches, committing each batch's position as training would."""
    seen = []
    for batch in itertools.islice(loader(stream, num_workers=num_workers), batches):
        stream.update(batch.pop("stream_state"))
        seen.append(batch["prompts"])
    return seen


def test_chat_template_and_instructions(tokenizer):
    stream = PromptStream(ArithmeticSource(), tokenizer, answer_format="boxed", system_prompt="Be brief.")
    batch = next(iter(loader(stream)))
    assert set(batch) == {"prompts", "prompt_ids", "answers", "sources", "questions", "levels", "subjects", "columns",
                          "stream_state"}
    prompt = batch["prompts"][0]
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is ")
    assert "\\boxed{}" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert batch["prompt_ids"][0] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert batch["prompt_ids"][0].count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # no doubled specials
    assert int(batch["answers"][0]) == sum(map(int, prompt.split("What is ")[1].split("?")[0].split(" + ")))
    with pytest.raises(ValueError, match="read once"):
        PromptStream(ArithmeticSource(), tokenizer, endless=False)
    default = next(iter(loader(PromptStream(ArithmeticSource(num_rows=3), tokenizer, endless=False))))["prompts"][0]
    assert "SmolLM" in default and "boxed" not in default  # the template's own system prompt, no instruction


def test_chat_rows_go_through_the_chat_template_and_their_columns_reach_the_batch(tokenizer, tmp_path):
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "5", "topic": "sums"}] * 2)
    source = HubSource(str(data), question_field="messages")
    stream = PromptStream(source, tokenizer, answer_format="boxed", system_prompt="ignored: the row has its own")
    batch = next(iter(loader(stream, batch_size=2)))
    prompt = batch["prompts"][0]
    assert "{'role'" not in prompt and "[{" not in prompt  # defect: the Python text of the list became the prompt
    assert prompt.startswith("<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?\n")
    assert "\\boxed{}" in prompt and prompt.endswith("<|im_start|>assistant\n") and "ignored" not in prompt
    assert batch["columns"][0]["topic"] == "sums" and batch["questions"][0] == messages
    user_only = write_jsonl(tmp_path / "user.jsonl", [{"messages": messages[1:], "answer": "5"}])
    stream = PromptStream(HubSource(str(user_only), question_field="messages"), tokenizer, system_prompt="Be brief.")
    assert next(iter(stream))["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat")


def test_chat_template_kwargs_reach_the_template_as_qwen3s_thinking_switch(tokenizer):
    """``data.chat_template_kwargs`` are variables of the chat template: Qwen3's template opens an empty think block
    when ``enable_thinking`` is false (the Qwen3 recipes' setting); without them the template's default holds."""
    qwen3_like = copy.deepcopy(tokenizer)
    qwen3_like.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}")
    off = next(iter(PromptStream(ArithmeticSource(), qwen3_like, chat_template_kwargs={"enable_thinking": False})))
    default = next(iter(PromptStream(ArithmeticSource(), qwen3_like)))
    assert off["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert default["prompt"].endswith("<|im_start|>assistant\n") and "<think>" not in default["prompt"]
    module = MathPromptDataModule(tokenizer="smollm2-135m-instruct", chat_template_kwargs={"enable_thinking": False})
    assert module._stream(module.source, 0, True, 0, 1).chat_template_kwargs == {"enable_thinking": False}


def test_length_filter_counts_skipped_prompts(tokenizer, tmp_path):
    rows = [{"question": "short?", "answer": "1"}, {"question": "long " * 300, "answer": "2"}] * 5
    stream = PromptStream(
        HubSource(str(write_jsonl(tmp_path / "x.jsonl", rows))), tokenizer, max_prompt_tokens=64, endless=False
    )
    batches = take(stream, 10)
    assert sum(len(b) for b in batches) == 5
    assert stream.stats["too_long"] == 5 and stream.stats["prompts"] == 5


def test_an_endless_source_whose_prompts_are_all_too_long_is_refused_not_read_forever(tokenizer, monkeypatch):
    import qerl.data.prompt_stream as prompt_stream

    monkeypatch.setattr(prompt_stream, "TOO_LONG_AT_START", 20)
    stream = PromptStream(ArithmeticSource(), tokenizer, max_prompt_tokens=8)  # the template alone is longer
    with pytest.raises(ValueError, match=r"data.max_prompt_tokens=8: the first 20 prompts were all longer .*shortest "
                                         r"\d+ tokens.*Fix: raise data.max_prompt_tokens"):
        next(iter(stream))

def test_long_prompts_after_the_first_that_fits_are_skipped_and_counted_never_refused(tokenizer, tmp_path,
                                                                                       monkeypatch):
    import qerl.data.prompt_stream as prompt_stream

    monkeypatch.setattr(prompt_stream, "TOO_LONG_AT_START", 20)
    rows = [{"question": "short?", "answer": "1"}] + [{"question": "long " * 300, "answer": "2"}] * 25 + [
        {"question": "short again?", "answer": "3"}]
    stream = PromptStream(HubSource(str(write_jsonl(tmp_path / "x.jsonl", rows))), tokenizer, max_prompt_tokens=64,
                          shuffle_buffer=0, endless=False)
    assert [item["answer"] for item in stream] == ["1", "3"]  # (a run that has started is not stopped mid-way)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sharding_covers_a_finite_source_once(tokenizer, tmp_path, num_workers):
    rows = [{"question": f"Question {i}?", "answer": str(i)} for i in range(53)]
    source = HubSource(str(write_jsonl(tmp_path / "rows.jsonl", rows)))
    seen = []
    for rank in range(2):
        stream = PromptStream(source, tokenizer, shuffle_buffer=8, seed=3, endless=False, rank=rank, world_size=2)
        seen += [a for b in loader(stream, batch_size=5, num_workers=num_workers) for a in b["answers"]]
    assert sorted(seen, key=int) == [str(i) for i in range(53)]  # no duplicates, nothing missing
    assert seen != [str(i) for i in range(53)]  # and the shuffle buffer did shuffle


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_round_trip_continues_the_stream(tokenizer, num_workers):
    def stream():
        return PromptStream(ArithmeticSource(max_value=99), tokenizer, shuffle_buffer=16, seed=1)

    reference = take(stream(), 8, num_workers)
    first = stream()
    assert take(first, 5, num_workers) == reference[:5]
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    assert take(resumed, 3, num_workers) == reference[5:]
    assert resumed.stats["prompts"] == 8 * 4


def test_datamodule_errors_name_the_option():
    with pytest.raises(ValueError, match="answer_format"):
        MathPromptDataModule(answer_format="latex")
    with pytest.raises(ValueError, match="batch_size"):
        MathPromptDataModule(batch_size=0)
    with pytest.raises(ValueError, match="weights"):
        MathPromptDataModule(weights=[1.0, 2.0])
    with pytest.raises(FileNotFoundError, match="data_files"):
        MathPromptDataModule(sources=[GSM8K(data_files="no/such/file.jsonl")])
    with pytest.raises(ValueError, match="num_rows"):
        MathPromptDataModule(val_sources=[ArithmeticSource()])


def test_datamodule_builds_from_yaml():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MathPromptDataModule, "data")
    config = parser.parse_string("""
    data:
      batch_size: 4
      answer_format: gsm8k
      sources:
        - class_path: qerl.data.sources.ArithmeticSource
          init_args: {max_value: 20, operations: ["+", "-"]}
        - class_path: qerl.data.sources.BigMathProcessed
      weights: [3, 1]
    """)
    data = parser.instantiate(config).data
    assert data.batch_size == 4 and data.source.weights == [3, 1]
    assert data.source.sources[0].operations == ["+", "-"]


class _Recorder(L.LightningModule):
    """Steps an optimizer once per batch and records the prompts it trained and validated on."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.trained, self.validated, self.skipped = [], [], []

    def training_step(self, batch, batch_idx):
        assert set(batch) == {"prompts", "prompt_ids", "answers", "sources", "questions", "levels", "subjects", "columns",
                              "skipped"}
        self.trained.append(batch["prompts"])
        self.skipped.append(batch["skipped"])
        self.manual_backward(self.weight.sum() * 0)
        self.optimizers().step()

    def validation_step(self, batch, batch_idx):
        self.validated += batch["answers"]

    def configure_optimizers(self):
        return torch.optim.SGD([self.weight], lr=0.1)


def test_trainer_checkpoint_resumes_the_stream(tokenizer, tmp_path):
    val = HubSource(
        str(write_jsonl(tmp_path / "val.jsonl", [{"question": f"V{i}", "answer": str(i)} for i in range(5)]))
    )

    def fit(steps: int, ckpt_path=None, val_sources=None):
        data = MathPromptDataModule(batch_size=2, shuffle_buffer=8, val_sources=val_sources)
        data.tokenizer = tokenizer  # skip loading it again
        model = _Recorder()
        # The endless stream never ends an epoch, so checkpoints must be step-based.
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / f"ckpt{steps}", every_n_train_steps=3)
        trainer = L.Trainer(
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[checkpoint],
            default_root_dir=tmp_path,
            val_check_interval=2,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model, trainer

    straight, _ = fit(5, val_sources=[val])
    assert straight.validated == [str(i) for i in range(5)] * 2  # after steps 2 and 4, read once each, in order
    first, trainer = fit(3)
    assert first.trained == straight.trained[:3]
    state = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=False)["MathPromptDataModule"]
    assert state["train_stream"]["ranks"][0]["rounds"] == {0: 3 * 2}  # the batches trained on, not the one Lightning prefetched
    resumed, _ = fit(5, ckpt_path=trainer.checkpoint_callback.best_model_path)
    assert resumed.trained == straight.trained[3:]


def test_resume_with_another_worker_count_skips_nothing(tokenizer, tmp_path):
    rows = [{"question": f"Q{i}", "answer": str(i)} for i in range(40)]
    source = HubSource(str(write_jsonl(tmp_path / "rows.jsonl", rows)))
    reference = [a for b in take(PromptStream(source, tokenizer, shuffle_buffer=8), 5) for a in b]  # global order
    first = PromptStream(source, tokenizer, shuffle_buffer=8)
    take(first, 3, num_workers=2)  # worker 0 built batches 1 and 3 (global 0, 2, ..., 14), worker 1 batch 2 (1..7)
    resumed = PromptStream(source, tokenizer, shuffle_buffer=8)
    resumed.load_state_dict(first.state_dict())
    # One consumer now: it restarts at the first row some worker had not reached (global 9); 10, 12, 14 repeat.
    assert take(resumed, 1) == [reference[9:13]]


def test_training_batches_carry_the_skip_counts_of_the_stream(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    lines = [f'{{"question": "Q{i}", "answer": "{i}"}}' for i in range(8)]
    lines[2] = '{"question": "Q2", "answer": '  # cut off
    lines[5] = '{"question": "Q5"}'
    lines.append('{"question": "' + "long " * 300 + '", "answer": "9"}')
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="skipped 2 of 9 rows"):
        data = MathPromptDataModule(sources=[HubSource(str(path))], batch_size=2, shuffle_buffer=0)
    data.tokenizer = tokenizer
    model = _Recorder()
    trainer = L.Trainer(max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(model, datamodule=data)
    # 7 rows a pass: the bad ones are counted once however often the endless stream reads the file again
    assert model.skipped[0]["unreadable_line"] == 0  # counted as the stream reaches them: line 3 is still ahead
    assert model.skipped[-1] == {"unreadable_line": 1, "missing_question": 0, "missing_answer": 1,
                                 "no_final_answer": 0, "too_long": 1}  # 12 prompts = 2 passes; the long last row of pass 2 is still ahead


def test_resume_of_two_ranks_continues_each_rank_and_one_rank_skips_nothing(tokenizer, tmp_path):
    rows = [{"question": f"Q{i}", "answer": str(i)} for i in range(60)]
    source = HubSource(str(write_jsonl(tmp_path / "rows.jsonl", rows)))

    def stream(rank=0, world_size=1):
        return PromptStream(source, tokenizer, shuffle_buffer=0, rank=rank, world_size=world_size)

    reference = [a for b in take(stream(), 10) for a in b]  # the global order (no shuffle: Q0, Q1, ...)
    ranks = [stream(0, 2), stream(1, 2)]
    assert take(ranks[0], 3) == [reference[0:8:2], reference[8:16:2], reference[16:24:2]]
    assert take(ranks[1], 2) == [reference[1:8:2], reference[9:16:2]]  # rank 1 one batch behind (it skipped more)
    saved = {"ranks": [r.state_dict() for r in ranks]}  # what the data module gathers into a checkpoint
    for rank in range(2):  # the same two ranks: each continues its own share
        resumed = stream(rank, 2)
        resumed.load_state_dict(saved)
        assert take(resumed, 1) == [reference[24:32:2] if rank == 0 else reference[17:24:2]]
    one = stream()  # one rank: from the first row some rank had not reached (rank 1's Q17); 18, 20, 22 repeat
    one.load_state_dict(saved)
    assert take(one, 1) == [reference[17:21]]


def _prefetching_run(stream: PromptStream, refills: dict[int, int], steps: int, save_after: int | None = None):
    """Training order of the prompts of ``steps`` steps as Lightning feeds them: batch t+1 is fetched before step t
    runs; step t commits its batch, then takes ``refills[t]`` more prompts. Returns the questions per step (batch, then
    refill) and the stream state saved after step ``save_after``."""
    batches = iter(loader(stream))
    ahead = next(batches)
    seen, saved = [], None
    for step in range(steps):
        batch, ahead = ahead, next(batches)  # Lightning's one-batch prefetch
        stream.update(batch.pop("stream_state"))
        refill = [item["question"] for item in stream.take(refills.get(step, 0))]
        seen.append((batch["questions"], refill))
        if step == save_after:
            saved = stream.state_dict()
    return seen, saved


def test_refills_take_the_next_prompts_and_a_resume_continues_exactly(tokenizer):
    def stream():
        return PromptStream(ArithmeticSource(seed=5), tokenizer, shuffle_buffer=16, seed=1)

    straight, saved = _prefetching_run(stream(), {1: 3, 2: 5}, steps=5, save_after=1)
    # Against the stream's order without refills: every prompt read once, in stream order. Step 1's refill is what
    # followed the batch prefetched for step 2; step 2's follows batch 3 (prefetched while step 2 ran).
    plain, _ = _prefetching_run(stream(), {}, steps=8)
    order = [q for batch, _ in plain for q in batch]
    expected = [(order[0:4], []), (order[4:8], order[12:15]), (order[8:12], order[19:24]), (order[15:19], []),
                (order[24:28], [])]
    assert straight == expected
    # Resume after step 1 (mid-run, batch 2 prefetched and untrained): the same batches and refills follow.
    assert len(saved["pending"]) == 4
    resumed_stream = stream()
    resumed_stream.load_state_dict(saved)
    resumed, _ = _prefetching_run(resumed_stream, {0: 5}, steps=3)
    assert resumed == straight[2:]
    assert resumed_stream.stats == _stats_after(stream, {1: 3, 2: 5}, steps=5)


def _stats_after(make, refills, steps):
    s = make()
    _prefetching_run(s, refills, steps)
    return s.stats


def test_take_needs_the_main_process_stream(tokenizer):
    with pytest.raises(RuntimeError, match="num_workers must be 0"):
        PromptStream(ArithmeticSource(), tokenizer).take(2)
    dm = MathPromptDataModule(num_workers=1)
    with pytest.raises(ValueError, match="data.num_workers=1"):
        dm.refill_prompts()  # the source is refused before it is handed over
