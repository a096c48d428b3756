"""Evaluation: greedy pass@1 and mean accuracy over k samples, per validation source, with a per-level / per-subject
breakdown and a JSONL of every completion.

``GRPOModule.validation_step`` / ``test_step`` hand each batch to an ``Evaluator``:

    prompts [B] --generate(greedy spec)--> 1 completion each  --reward.check--> correct [B]  (pass@1)
                --generate(T, seed spec)--> k completions each --reward.check--> correct [B*k] (mean@k, pass@j)
    -> MeanMetric per key (``<source>_acc``, ``<source>_mean@k``, ``<source>_pass@j`` for j = 2, 4, ... and k
       (``pass_at_k``: the unbiased estimator), ``<source>_level3_acc``, ``<source>_algebra_acc``)
    -> records (question, completion, extracted answer, reference, verdict, source, level, subject)

Every completion is checked twice, as lm-eval's strict / flexible pair: strictly (only an answer stated in the
reward's format counts: ``<source>_acc``, ``<source>_mean@k`` and the breakdowns) and flexibly (the last number in
the text when no answer is marked: ``<source>_acc_flexible``, ``<source>_mean@k_flexible``).

The rollout engine samples the policy with its adapter (the built-in engines sample the PeftModel itself; an external
engine is synced by ``RolloutSync`` before validation), never with AQN noise, and from a separate random stream (its
own ``SamplingSpec``) so evaluating does not change what training samples. At the end of an evaluation run ``compute``
gives the metric values (synced across ranks by torchmetrics) and ``write_jsonl`` the records of all ranks (written by
rank 0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torchmetrics import MeanMetric

from qerl.data.answers import extract_answer
from qerl.data.rewards import MathReward
from qerl.data.user_rewards import row_arguments
from qerl.modules.pass_at_k import pass_at_k, reported_ks
from qerl.modules.options import EvaluationOptions, SamplingOptions
from qerl.rollout.base import RolloutEngine
from qerl.rollout.sampling_spec import SamplingSpec


def metric_name(text: str) -> str:
    """``"Intermediate Algebra"`` -> ``"intermediate_algebra"`` (TensorBoard tags and ModuleDict keys)."""
    return re.sub(r"[^0-9a-z]+", "_", str(text).lower()).strip("_") or "none"


class Evaluator(nn.Module):
    """Scores a policy on evaluation batches; holds one ``MeanMetric`` per logged key (created on first use).

    Args:
        options: how many samples, at which temperature, greedy or not, their seed (``model.evaluation``).
        sampling: training's sampling options: the completion budget and top-p evaluation shares with training.
    """

    def __init__(self, options: EvaluationOptions = EvaluationOptions(), sampling: SamplingOptions = SamplingOptions()):
        super().__init__()
        self.samples, self.temperature, self.greedy, self.seed = (options.samples, options.temperature,
                                                                  options.greedy, options.seed)
        self.sampling = sampling
        self.metrics = nn.ModuleDict()
        self.records: list[dict] = []
        self._names: dict[tuple[str, int], str] = {}  # (source label, dataloader) -> metric prefix
        self._calls = 0

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
        self.records = []
        self._calls = 0

    def _prefix(self, source: str, dataloader_idx: int) -> str:
        """The source's label, suffixed with the dataloader index when two loaders share a label."""
        key = (source, dataloader_idx)
        if key not in self._names:
            taken = metric_name(source) in self._names.values()
            self._names[key] = metric_name(source) + (f"_{dataloader_idx}" if taken else "")
        return self._names[key]

    def _update(self, key: str, values: torch.Tensor) -> None:
        if key not in self.metrics:
            self.metrics[key] = MeanMetric(sync_on_compute=True).to(values.device)
        self.metrics[key].update(values)

    @torch.no_grad()
    def step(
        self,
        policy,
        engine: RolloutEngine,
        reward: MathReward,
        batch: dict,
        decode: Callable[[torch.Tensor], list[str]],
        pad_id: int,
        eos_ids: list[int],
        dataloader_idx: int = 0,
    ) -> None:
        """Evaluate one batch: greedy and/or k samples per question; update the metrics and keep the records."""
        modes = ([("greedy", 1, dict(greedy=True, temperature=self.sampling.temperature))] if self.greedy else []) + (
            [("sampled", self.samples, dict(temperature=self.temperature))] if self.samples else [])
        device = next(policy.parameters()).device
        n = len(batch["prompt_ids"])
        levels = batch.get("levels") or [None] * n
        subjects = batch.get("subjects") or [None] * n
        questions = batch.get("questions") or batch["prompts"]
        for mode, k, settings in modes:
            # Each call its own seed: batches differ, and the same batch always draws the same samples.
            spec = SamplingSpec(max_new_tokens=self.sampling.max_new_tokens, top_p=self.sampling.top_p,
                                seed=self.seed + self._calls, stream="separate", **settings)
            rollout = engine.generate(policy, batch["prompt_ids"], k, pad_id, eos_ids, spec)
            self._calls += 1
            completions = decode(rollout.completion_ids)
            references, rows = [a for a in batch["answers"] for _ in range(k)], row_arguments(reward, batch, k)
            correct, formatted = reward.check(completions, references, fallback_last_number=False, **rows)  # [n*k]
            flexible, _ = reward.check(completions, references, fallback_last_number=True, **rows)  # [n*k]
            verdicts = correct.bool().tolist(), flexible.bool().tolist(), formatted.bool().tolist()  # the records'
            correct, flexible = correct.to(device), flexible.to(device)
            suffix = "acc" if mode == "greedy" else f"mean@{k}"
            per_question = correct.view(n, k).mean(-1)  # [n]
            per_question_flexible = flexible.view(n, k).mean(-1)  # [n]
            passes = {j: pass_at_k(correct.view(n, k), j).float() for j in reported_ks(k)} if mode == "sampled" else {}
            for i in range(n):
                prefix = self._prefix(batch["sources"][i], dataloader_idx)
                self._update(f"{prefix}_{suffix}_flexible", per_question_flexible[i : i + 1])
                for j, values in passes.items():  # [n] each
                    self._update(f"{prefix}_pass@{j}", values[i : i + 1])
                keys = [f"{prefix}_{suffix}"]
                if levels[i] is not None:
                    keys.append(f"{prefix}_level{levels[i]}_{suffix}")
                if subjects[i] is not None:
                    keys.append(f"{prefix}_{metric_name(subjects[i])}_{suffix}")
                for key in keys:
                    self._update(key, per_question[i : i + 1])
            lengths = rollout.lengths.tolist()
            truncated = rollout.truncated.tolist()
            for j, completion in enumerate(completions):
                i = j // k
                self.records.append({
                    "source": batch["sources"][i],
                    "level": levels[i],
                    "subject": subjects[i],
                    "question": questions[i],
                    "mode": mode,
                    "sample": j % k,
                    "temperature": None if mode == "greedy" else self.temperature,
                    "completion": completion,
                    "extracted": extract_answer(completion, reward.answer_format, fallback_last_number=False),
                    "extracted_flexible": extract_answer(completion, reward.answer_format, fallback_last_number=True),
                    "reference": batch["answers"][i],
                    "correct": verdicts[0][j],
                    "correct_flexible": verdicts[1][j],
                    "formatted": verdicts[2][j],
                    "length": lengths[j],
                    "truncated": truncated[j],
                })

    def compute(self) -> dict[str, torch.Tensor]:
        """Every metric's value over the run (all ranks). Ranks may have met different keys (a subject only one rank
        saw): every rank first creates the union of keys, so each metric syncs on every rank in the same order."""
        keys = sorted(self.metrics)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, keys)
            keys = sorted(set().union(*gathered))
            device = next(iter(self.metrics.values())).device if self.metrics else torch.device("cpu")
            for key in keys:
                if key not in self.metrics:
                    self.metrics[key] = MeanMetric(sync_on_compute=True).to(device)
        # A key that no rank updated has no value (MeanMetric returns nan): leave it out.
        values = {key: self.metrics[key].compute() for key in keys}
        return {key: value for key, value in values.items() if not torch.isnan(value)}

    def write_jsonl(self, path: str | Path, is_global_zero: bool = True) -> Path | None:
        """Write the records of all ranks to ``path`` (one JSON object per line) from rank 0; returns the path there."""
        records = self.records
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, records)
            records = [r for rank in gathered for r in rank]
        if not is_global_zero:
            return None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        return path
