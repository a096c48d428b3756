"""The math of one RL step and the LightningModule that runs it, in data-flow order.

(1) prompts come from ``qerl.data``;
(2) ``qerl.model`` builds the frozen NVFP4 (or bf16) policy with LoRA, ``qerl.rollout`` samples G answers each;
(3) ``qerl.data.rewards`` scores them;
(4) ``advantages`` normalises rewards per group (``dynamic_sampling`` keeps and refills the groups with signal),
    ``loss`` turns them into the clipped policy-gradient loss, each token weighted by the ``rollout_correction``
    between the sampler and the trained policy (its ``loss_stats`` add up over micro-batches and ranks);
(5) ``grpo_module`` steps the optimizer (``options``: its option groups; ``optimizer``: AdamW and its schedule;
    ``expert_routing``: a MoE's rollout routing against the update's);
(6) ``qerl.callbacks`` anneal the noise, sync engines and log.
"""
