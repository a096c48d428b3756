"""GRPOModule: one RL step of GRPO / DAPO on an NVFP4 (or bf16) LoRA policy, with manual optimization.

One ``training_step`` = one batch of B prompts:

    (1) rollout     G completions per prompt from the rollout engine (NVFP4 + AQN noise), with their log-probs
    (2) rewards     answer checking and the user's reward functions, weighted (+ DAPO overlong shaping)
    (3) advantages  group-relative (``model.advantage``: GRPO's mean/std or RLOO's leave-one-out); DAPO dynamic
                    sampling drops groups whose rewards are all equal and, with ``dapo.max_refill_rounds``, rolls out
                    more prompts of the stream until the batch holds ``data.batch_size`` groups with signal
    (4) loss        clipped surrogate with truncated IS, in micro-batches of rows of similar length within a token
                    budget (no padding work), log-probs from hidden states in chunks
    (5) optimizer   clip grad-norm, AdamW step, warmup + cosine; ``update.num_iterations`` updates per rollout

What this keeps and drops, against the QeRL reference: no critic, no reference model unless the loss's beta > 0
(then the base with the adapter disabled); truncated-completion masking and dynamic sampling as in DAPO; the IS
correction between the rollout policy (NVFP4 + noise) and the clean training policy is on by default; the
training forward never materializes a dequantized weight (the NVFP4 kernels run on packed storage).

``trainer.global_step`` counts optimizer steps (``update.num_iterations`` per batch), so ``max_steps``, the LR
schedule and the AQN stages are all in optimizer steps.

``validation_step`` / ``test_step`` score the policy (adapter applied, no noise) on the data module's ``val_sources``
with an ``Evaluator``: greedy pass@1 and mean accuracy over k samples, logged as ``val/<source>_acc`` and
``val/<source>_mean@k`` (strict: a stated answer; ``..._flexible`` beside them: the last number) (``test/...`` for
``test``) with per-level / per-subject breakdowns, plus a JSONL of every
completion under ``<log_dir>/eval/``. During ``fit`` set ``trainer.val_check_interval: N`` and
``trainer.check_val_every_n_epoch: null`` (the prompt stream never ends an epoch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from qerl.agents.config import AgentConfig
from qerl.agents.episode import Episodes
from qerl.agents.metrics import log_episodes
from qerl.agents.runner import EpisodeEngine, EpisodeRunner
from qerl.data.rewards import MathReward, RewardSum, overlong_penalty
from qerl.hub import load_tokenizer
from qerl.model.aqn import AQNSchedule
from qerl.model.policy import PolicyConfig, save_adapter, trainable_parameters
from qerl.modules.advantages import Advantage, GroupAdvantage, informative_groups
from qerl.modules.dynamic_sampling import InformativeFraction, Sample, cat_samples, kept_groups, refill_size
from qerl.modules.evaluation import Evaluator
from qerl.modules.expert_routing import ExpertRouting
from qerl.modules.loss import DAPOLoss, PolicyLoss
from qerl.modules.optimizer import adamw_with_schedule
from qerl.modules.options import (DAPOOptions, EvaluationOptions, OptimizerOptions, RewardOptions, SamplingOptions,
                                 UpdateOptions, check_options)
from qerl.modules.policy_update import UpdateSettings, UpdateSteps, policy_update
from qerl.modules.step_logging import StepLogger, logged_step
from qerl.ranks import gather_rank_states, own_rank_state, rank_seed
from qerl.rollout.builtin import BuiltinRollout
from qerl.rollout.base import RolloutEngine
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.tools.chat_template import with_chat_template

class GRPOModule(L.LightningModule):
    """The policy, its loss and the RL step.

    Args:
        policy: the model and its LoRA (see ``PolicyConfig``).
        loss: the policy loss; its class picks the variant (``DAPOLoss``, ``GRPOLoss``, ``DrGRPOLoss``, ``GSPOLoss``,
            ``CISPOLoss``).
        advantage: the advantage estimator (``GroupAdvantage``, ``RLOOAdvantage``); None: ``GroupAdvantage()``.
        reward: scores completions against reference answers (the ``math`` reward; evaluation's accuracy).
        rewards: your own reward functions added to ``reward``, their weights and limits (``RewardOptions``).
        rollout: the rollout engine (``BuiltinRollout`` samples with the policy itself).
        sampling: how training samples (``SamplingOptions``: group_size, max_new_tokens, temperature, top_p, seed);
            the module hands them to the engine with every rollout, with this step's AQN noise.
        aqn: the Adaptive Quantization Noise schedule (the YAML's ``aqn:`` section; None: no noise).
        update: how the update runs (``UpdateOptions``: micro-batches, optimizer steps per rollout, LM-head chunk).
        optimizer: AdamW and its warmup + cosine schedule (``OptimizerOptions``: lr, betas, clip, ...).
        dapo: DAPO's dynamic sampling (with refills), overlong filtering and soft punishment (``DAPOOptions``).
        evaluation: how validate / test score the policy (``EvaluationOptions``).
        log_samples_every: write a few prompt/completion texts to TensorBoard every this many steps (0 disables).
        expert_routing: a mixture-of-experts policy's routing in the step (``ExpertRouting``: the rollout's expert
            choices recorded, their mismatch logged, router replay); None: ``ExpertRouting()``. Dense policies: unused.
        agent: multi-turn episodes with tools or an environment (see ``AgentConfig``); without tools and environment
            each sample is one completion.
    """

    def __init__(
        self,
        policy: PolicyConfig = PolicyConfig(),
        loss: PolicyLoss | None = None,
        advantage: Advantage | None = None,
        reward: MathReward | None = None,
        rewards: RewardOptions = RewardOptions(),
        rollout: RolloutEngine | None = None,
        sampling: SamplingOptions = SamplingOptions(),
        aqn: AQNSchedule | None = None,
        update: UpdateOptions = UpdateOptions(),
        optimizer: OptimizerOptions = OptimizerOptions(),
        dapo: DAPOOptions = DAPOOptions(),
        evaluation: EvaluationOptions = EvaluationOptions(),
        log_samples_every: int = 10,
        expert_routing: ExpertRouting | None = None,
        agent: AgentConfig = AgentConfig(),
    ):
        super().__init__()
        check_options("model", [
            ("dapo.overlong_buffer", dapo.overlong_buffer, dapo.overlong_buffer < sampling.max_new_tokens,
             f"smaller than model.sampling.max_new_tokens ({sampling.max_new_tokens})"),
            ("dapo.overlong_buffer", dapo.overlong_buffer, dapo.overlong_buffer == 0 or not agent.enabled,
             "0 with model.agent (an episode's length is its turns and tool outputs: bound it with "
             "model.agent.max_episode_tokens)"),
            ("log_samples_every", log_samples_every, log_samples_every >= 0, ">= 0 (0 turns it off)"),
        ])
        policy.validate()
        agent.validate()
        self.agent_config = agent
        self.save_hyperparameters(ignore=["loss", "reward", "rollout", "advantage", "aqn", "expert_routing"])
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the trainable weights only; the frozen base comes from disk
        self.policy_config = policy
        self.loss = loss if loss is not None else DAPOLoss()
        self.advantage = advantage if advantage is not None else GroupAdvantage()
        self.reward = reward if reward is not None else MathReward()
        self.rewards = RewardSum(self.reward, rewards.functions, rewards.weights, rewards.timeout_s,
                                 failure_steps=rewards.failure_steps)
        self.rollout = rollout if rollout is not None else BuiltinRollout()
        self.sampling = sampling
        self.update_options = update
        self.optimizer_options = optimizer
        self.dapo = dapo
        self.informative_fraction = InformativeFraction()  # sizes the refills; checkpointed per rank
        self.aqn = aqn if aqn is not None else AQNSchedule(enabled=False)
        self.noise_generator = torch.Generator().manual_seed(self.aqn.seed)  # checkpointed: a resume draws the same
        self.evaluator = Evaluator(evaluation, sampling)
        self.write_eval_jsonl = evaluation.jsonl
        self.step_logger = StepLogger(sampling.group_size, update.num_iterations, with_kl=self.loss.beta > 0)
        self.refill_prompts: Callable[[int], dict] | None = None  # the data module's, handed over at fit's setup
        self.checkpoint_step = 0  # optimizer steps behind the weights loaded by validate/test --ckpt_path
        self.expert_routing = expert_routing if expert_routing is not None else ExpertRouting()
        self.policy = None
        self.tokenizer = None
        self.episodes: EpisodeRunner | None = None  # built with the tokenizer when model.agent has tools
        self._step_episodes: list[Episodes] = []  # this step's episodes (refills included), for the logs

    def setup(self, stage: str) -> None:
        # Runs once the process knows its rank, before a checkpoint's state is loaded.
        self.noise_generator.manual_seed(rank_seed(self.aqn.seed, self.trainer.global_rank))
        if stage == "fit" and self.dapo.max_refill_rounds:  # the refills' prompts: the data module's, taken once
            datamodule = getattr(self.trainer, "datamodule", None)
            if not hasattr(datamodule, "refill_prompts"):
                raise ValueError(f"model.dapo.max_refill_rounds={self.dapo.max_refill_rounds}: refills draw prompts "
                                 "from the data module's stream, and this run has none that can (use "
                                 "MathPromptDataModule).")
            self.refill_prompts = datamodule.refill_prompts()

    def configure_model(self) -> None:
        if self.policy is None:
            # the tokenizer first: a chat template without tools fails before the weights load
            self.tokenizer = with_chat_template(load_tokenizer(self.policy_config.model), self.agent_config.chat_template)
            if self.agent_config.enabled:
                datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
                self.episodes = EpisodeRunner(self.agent_config, self.tokenizer, self.policy_config.model,
                                              getattr(datamodule, "chat_template_kwargs", None))
            self.policy = self.policy_config.build(self.device)
            # Every rank loads the same frozen weights: DDP need not broadcast them (nor can it: gloo has no fp8).
            self._ddp_params_and_buffers_to_ignore = [
                n for n, p in self.named_parameters() if not p.requires_grad
            ] + [n for n, _ in self.named_buffers()]

    # ------------------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict, batch_idx: int) -> dict:
        G = self.sampling.group_size
        # GPU memory held between steps (weights, optimizer), then each phase's peak
        memory = {"resident": self._allocated_gb(torch.cuda.memory_allocated)}
        self._allocated_gb(torch.cuda.max_memory_allocated)  # the rollout's peak starts here

        # (1) rollout: G samples per prompt from the rollout policy (NVFP4 + AQN noise), with sampling log-probs;
        # (2) rewards: answer checking and the user's functions, weighted, then DAPO's soft overlong punishment
        spec = self._training_spec()
        sample = self._rollout_and_rewards(batch, spec)
        # DAPO's dynamic sampling as published: more prompts of the stream until B groups carry signal
        batch_size, refill_rounds = len(batch["prompt_ids"]), 0
        if self.dapo.max_refill_rounds:
            sample, refill_rounds = self._refill(sample, batch_size, spec)
        rollout, completions, rewards, _, correct, rollout_s = sample
        self.rewards.check_streaks(self._all_reduce_sum, self.device)  # a reward failing everywhere stops the run
        memory["rollout"] = self._allocated_gb(torch.cuda.max_memory_allocated, engine_asleep=False)  # peak: awake

        # (3) advantages within each group; uninformative groups (and those past the batch) and truncated completions
        # get no loss
        advantages = self.advantage(rewards, G)  # [N]
        informative = informative_groups(rewards, G)  # [groups]
        kept = kept_groups(informative, batch_size) if self.dapo.dynamic_sampling else informative  # [groups]
        loss_mask = rollout.model_mask.clone()  # [N, L]: the model's own tokens (not tool results)
        if self.dapo.dynamic_sampling:
            loss_mask *= kept.repeat_interleave(G)[:, None]
        if self.dapo.mask_truncated:
            loss_mask *= (~rollout.truncated)[:, None]

        # (4) + (5) micro-batched clipped policy-gradient loss, backward into LoRA (+ norms), optimizer steps
        lr = self.lr_schedulers().get_last_lr()[0]  # this step's LR: the update below steps the scheduler
        start = time.perf_counter()
        opt = self.optimizers()
        steps = UpdateSteps(opt, self.lr_schedulers(), self.manual_backward, self._all_reduce_sum,
                            lambda norm: self.clip_gradients(opt, gradient_clip_val=norm, gradient_clip_algorithm="norm"),
                            self.trainer.world_size)
        with self.expert_routing.update(self.policy):  # MoE: the rollout's expert choices against the update's
            stats, entropy, update_tokens = policy_update(self.policy, self.loss, rollout, advantages, loss_mask,
                                                          self._update_settings(), steps, self.expert_routing.forward)
        train_s = time.perf_counter() - start
        memory["update"] = self._allocated_gb(torch.cuda.max_memory_allocated)

        log = self.step_logger
        log.step(self, rollout, rewards, correct, informative, stats, entropy, rollout_s, train_s, lr, update_tokens,
                 memory, kept=kept, batch_size=batch_size, refill_rounds=refill_rounds)
        log.rewards(self, sample.per_reward, self.rewards.failure_counts(), self.rewards.take_seconds(),
                    informative.numel())
        routing = self.expert_routing.metrics()  # MoE: the rollout's expert choices against the update's
        if routing:
            self.log_dict(routing, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True)
        log.skipped(self, batch.get("skipped"))
        log.signal(bool(informative.any()))
        if self.hparams.log_samples_every and batch_idx % self.hparams.log_samples_every == 0:
            log.samples(self, batch, completions, rewards)
        if self._step_episodes:
            episodes, self._step_episodes = self._step_episodes, []
            log_episodes(self, episodes, batch["prompts"][0], rewards, self._all_reduce_sum, logged_step(self.trainer),
                         bool(self.hparams.log_samples_every) and batch_idx % self.hparams.log_samples_every == 0)
        return {"entropy": entropy.detach().cpu(), "rollout_entropy": rollout.entropy[rollout.model_mask.bool()].cpu()}

    def _training_spec(self) -> SamplingSpec:
        """This step's sampling: the module's options and the AQN schedule's sigma at this optimizer step (logged)."""
        step, total = self.global_step, self.trainer.max_steps
        sigma = self.aqn.sigma(step, total)
        self.log("train/aqn_sigma", sigma, on_step=True, on_epoch=False, batch_size=1)
        self.log("train/aqn_stage", float(self.aqn.stage(step, total)), on_step=True, on_epoch=False, batch_size=1)
        return self.sampling.training_spec(sigma, self.noise_generator)

    def _rollout_and_rewards(self, batch: dict, spec: SamplingSpec) -> Sample:
        """(1) G samples per prompt of ``batch`` from the rollout engine, timed, and (2) their rewards."""
        G = self.sampling.group_size
        start = time.perf_counter()
        episodes = None
        if self.episodes is not None:  # multi-turn: the reward reads each trajectory's last turn
            episodes = self.expert_routing.play(  # MoE: every turn's expert choices, laid out over the trajectories
                lambda engine: self.episodes.play(engine, self.policy, batch, G, self.tokenizer.pad_token_id,
                                                  self._eos_ids(), spec), self.rollout, self.policy)
            self._step_episodes.append(episodes)
            rollout, completions = episodes.rollout, episodes.answers
        else:
            rollout = self.expert_routing.sample(
                self.rollout, self.policy, batch["prompt_ids"], G, self.tokenizer.pad_token_id, self._eos_ids(), spec
            )
            completions = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
        rollout_s = time.perf_counter() - start

        rewards, per_reward = self.rewards(completions, batch, G)  # [N] weighted total, {name: [N]}
        rewards = rewards.to(self.device)  # [N]
        if episodes is not None and episodes.environment_rewards is not None:  # the environment owns its scale
            rewards += episodes.environment_rewards.to(rewards)
            per_reward = {**per_reward, self.episodes.environment.name: episodes.environment_rewards}
        correct = self.reward.last_stats["correct"]
        if self.dapo.overlong_buffer > 0:
            rewards += overlong_penalty(rollout.lengths, spec.max_new_tokens, self.dapo.overlong_buffer,
                                        self.dapo.overlong_penalty).to(rewards)
        return Sample(rollout, completions, rewards, per_reward, correct, rollout_s)

    def _refill(self, sample: Sample, batch_size: int, spec: SamplingSpec) -> tuple[Sample, int]:
        """Roll out more prompts of this rank's stream (``max_refill_rounds`` rollouts at most) until ``batch_size``
        groups have rewards that differ; each refill sized from the running fraction of such groups. Returns every
        rollout as one ``Sample`` (rows in sampling order) and the number of refills."""
        G, samples = self.sampling.group_size, [sample]
        found = int(informative_groups(sample.rewards, G).sum())  # a device sync: the decision needs the count
        self.informative_fraction.update(found, len(sample.completions) // G)
        rounds = 0
        while found < batch_size and rounds < self.dapo.max_refill_rounds:
            n = refill_size(batch_size - found, self.informative_fraction.value, batch_size)
            samples.append(self._rollout_and_rewards(self.refill_prompts(n), spec))
            new = int(informative_groups(samples[-1].rewards, G).sum())
            self.informative_fraction.update(new, n)
            found, rounds = found + new, rounds + 1
        return cat_samples(samples, self.tokenizer.pad_token_id or 0), rounds

    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the ranks (a collective: every rank calls it)."""
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def _allocated_gb(self, counter, engine_asleep: bool = True) -> float:
        """``counter`` (PyTorch's allocated or peak allocated memory, GiB), without what the rollout engine's sleep
        handed back to the GPU where it slept throughout; a new peak starts. 0 off CUDA."""
        if self.device.type != "cuda":
            return 0.0
        allocated = (counter(self.device) - (self.rollout.sleeping_bytes() if engine_asleep else 0)) / 2**30
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated

    def _update_settings(self) -> UpdateSettings:
        u = self.update_options
        return UpdateSettings(u.micro_batch_size, u.micro_batch_tokens, u.num_iterations, u.logprob_chunk_size,
                              self.optimizer_options.max_grad_norm, self.sampling.temperature,
                              self.tokenizer.pad_token_id or 0)

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(self.policy.get_base_model().generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return sorted(i for i in ids if i is not None)

    # ------------------------------------------------------------------------------------------------------------
    # Evaluation: one Evaluator pass per batch, metrics and the JSONL at the end of the run.
    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx)

    def test_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._evaluation_step(batch, dataloader_idx)

    def on_validation_epoch_start(self) -> None:
        self.evaluator.reset()

    def on_test_epoch_start(self) -> None:
        self.evaluator.reset()

    def on_validation_epoch_end(self) -> None:
        self._evaluation_end("val")

    def on_test_epoch_end(self) -> None:
        self._evaluation_end("test")

    def _evaluation_step(self, batch: dict, dataloader_idx: int) -> None:
        # `validate`/`test` run under torch.inference_mode by default (fit's validation does not); tensors made there
        # (an engine's KV buffers, CUDA-graph state, kept across calls) could never be updated by a later training
        # rollout. Plain no_grad avoids that.
        with torch.inference_mode(False), torch.no_grad():
            engine = self.rollout if self.episodes is None else EpisodeEngine(self.episodes, self.rollout, batch)
            self.evaluator.step(
                self.policy, engine, self.reward, batch,
                lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True),
                self.tokenizer.pad_token_id, self._eos_ids(), dataloader_idx,
            )

    def _evaluation_end(self, stage: str) -> None:
        if self.trainer.sanity_checking:  # the pre-fit check of a few batches: neither logged nor written
            self.evaluator.reset()
            return
        values = {f"{stage}/{k}": v for k, v in self.evaluator.compute().items()}  # synced across ranks
        in_fit = self.trainer.state.fn == "fit"
        self.log_dict(values, on_step=False, on_epoch=True, add_dataloader_idx=False, sync_dist=False,
                      logger=not in_fit)
        if in_fit:  # at the batches trained, as the JSONL's step (Lightning's step here is one less: the last batch's)
            for logger in self.loggers:
                logger.log_metrics({k: float(v) for k, v in values.items()}, step=logged_step(self.trainer) + 1)
        if self.write_eval_jsonl:
            directory = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "eval"
            step = self.global_step if in_fit else max(self.global_step, self.checkpoint_step)
            path = self.evaluator.write_jsonl(directory / f"{stage}_step{step}.jsonl",
                                              self.trainer.is_global_zero)
            if path is not None:
                self.print(f"{stage}: {len(self.evaluator.records)} completions (this rank) written to {path}")
        self.evaluator.reset()

    # ------------------------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        return adamw_with_schedule(trainable_parameters(self.policy), self.optimizer_options, self.trainer.max_steps)

    # Checkpoints keep only what training changes (LoRA + norms), the RNG and a PEFT export of the adapter.
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        # every rank's random streams (collectives under DDP): a resume continues each rank's draws
        checkpoint["qerl_rng"] = gather_rank_states({
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None})
        checkpoint["qerl_rollout"] = self.rollout.state_dict()  # sampling generator: a resume draws the same samples
        checkpoint["qerl_aqn"] = gather_rank_states({"generator": self.noise_generator.get_state()})
        # the refills' sizing: a resume draws as many prompts as the uninterrupted run
        checkpoint["qerl_informative_fraction"] = gather_rank_states(self.informative_fraction.state_dict())
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if self.trainer.is_global_zero and log_dir:
            save_adapter(self.policy, Path(log_dir) / "adapter")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.checkpoint_step = int(checkpoint.get("global_step", 0))  # validate/test restore no step count
        rng = own_rank_state(checkpoint.get("qerl_rng"))
        if rng:
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        if "qerl_rollout" in checkpoint:
            self.rollout.load_state_dict(checkpoint["qerl_rollout"])
        noise = own_rank_state(checkpoint.get("qerl_aqn"))
        if noise is not None:  # else this rank was not in the saved run: its stream starts from its seed
            self.noise_generator.set_state(noise["generator"])
        fraction = own_rank_state(checkpoint.get("qerl_informative_fraction"))
        if fraction:
            self.informative_fraction.load_state_dict(fraction)

