"""TensorBoard's "Custom Scalars" dashboard: the charts that belong together, written at the start of every run."""

from __future__ import annotations

import lightning as L

# category -> chart title -> regexes of the scalar tags drawn together (TensorBoard's Multiline charts).
LAYOUT: dict[str, dict[str, list[str]]] = {
    "1 reward and accuracy": {
        "reward (mean, within-group std)": [r"^train/reward$", r"^train/reward_std$"],
        "each reward (math and your model.rewards.functions)": [r"^train/rewards/[^/]+$"],
        "accuracy (training samples)": [r"^train/accuracy$"],
        "held-out accuracy (strict, flexible)": [r"^val/.*_acc$", r"^val/.*_acc_flexible$", r"^val/.*_mean@\d+$"],
        "groups without signal": [r"^train/zero_std_groups_frac$"],
        "dynamic sampling (trained batch's informative fraction, refills)": [r"^train/informative_groups_frac$",
                                                                               r"^train/refill_rounds$"],
        "prompts rolled out per step": [r"^train/prompts_sampled$"],
    },
    "2 entropy and noise": {
        "entropy (training vs rollout policy)": [r"^train/entropy$", r"^rollout/entropy$"],
        "AQN sigma": [r"^train/aqn_sigma$"],
    },
    "3 completions": {
        "completion length (tokens)": [r"^train/completion_length$"],
        "truncated fraction": [r"^train/truncated_frac$"],
    },
    "4 clipping and importance sampling": {
        "clip fractions (low, high)": [r"^train/clip_frac_low$", r"^train/clip_frac_high$"],
        "IS weights (ratio, truncated-IS mean, capped fraction)": [
            r"^train/ratio_mean$", r"^train/is_ratio_mean$", r"^train/is_capped_frac$"],
        "sampler vs trainer log-prob gap (mean, max)": [r"^train/sampling_logp_diff_mean$",
                                                        r"^train/sampling_logp_diff_max$"],
        "IS ratio before its bounds (min, mean, max)": [r"^train/is_raw_ratio_min$", r"^train/is_raw_ratio_mean$",
                                                        r"^train/is_raw_ratio_max$"],
        "masked by the rollout correction (tokens, sequences, off-policy sequences)": [
            r"^train/is_masked_frac$", r"^train/is_masked_seq_frac$", r"^train/off_policy_masked_seq_frac$"],
        "KL to the base policy": [r"^train/kl$"],
    },
    "5 throughput and memory": {
        "seconds per step (rollout, rewards, update)": [r"^perf/rollout_s$", r"^perf/reward_s$", r"^perf/train_s$"],
        "rollout tokens per second": [r"^perf/rollout_tokens_per_s$"],
        "GPU memory (GiB): resident, rollout and update peaks": [r"^perf/resident_gb$", r"^perf/peak_rollout_gb$",
                                                                 r"^perf/peak_update_gb$"],
    },
    "6 data": {
        "skipped rows and prompts": [r"^data/skipped_"],
        "learning rate": [r"^train/lr$"],
    },
}


class ScalarLayout(L.Callback):
    """Writes ``LAYOUT`` as TensorBoard's custom-scalars layout when a run starts (fit, validate or test), so the
    "Custom Scalars" tab opens on grouped charts. A logger other than TensorBoard's is left alone."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        experiment = getattr(trainer.logger, "experiment", None) if trainer.is_global_zero else None
        if hasattr(experiment, "add_custom_scalars"):
            experiment.add_custom_scalars(
                {category: {title: ["Multiline", tags] for title, tags in charts.items()}
                 for category, charts in LAYOUT.items()}
            )
