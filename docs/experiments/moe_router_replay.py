"""Router replay on a tiny random Qwen3-MoE (CPU): how often the sampler and the training forward route a generated
token differently, and how far apart their log-probs are with and without replaying the rollout's routing.

    PYTHONPATH=. python docs/experiments/moe_router_replay.py [--out docs/results]

For each AQN sigma of the recipes' schedule (0 = stage 0, then 1e-4 ... 1e-2, and 5e-2 beyond it), a
``BuiltinRollout`` samples with the NVFP4 policy (+ noise) and records its expert choices; the clean policy then
recomputes the sampled tokens' log-probs over the whole sequences, once routing on its own and once replaying the
rollout's choices. Reported per sigma: the fraction of (generated token, MoE layer) pairs whose top-k set differs
(``train/router_mismatch_frac``), of generated tokens with a difference in any layer, and the mean |log-prob gap|
between sampler and trainer over the generated tokens (all of them, and those that were rerouted), without and with
replay. Writes ``<out>/moe_router_replay_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from qerl.model.policy import build_policy
from qerl.model.routing import NOT_FED, RoutingRecorder, routed, topk_differs
from qerl.rollout.builtin import BuiltinRollout, position_ids
from qerl.rollout.sampling_spec import SamplingSpec
from qerl.testing.tiny_models import save_tiny_model

SIGMAS = (0.0, 1e-4, 1e-3, 1e-2, 5e-2)
PROMPTS, PROMPT_TOKENS, GROUP, NEW = 16, 24, 4, 48


@torch.no_grad()
def trainer_logprobs(policy, rollout, replay=None):
    """The clean policy's log-probs ``[N, L]`` of the sampled tokens, and its own routing ``[layers, N, P + L, k]``."""
    ids = torch.cat((rollout.prompt_ids, rollout.completion_ids), 1)
    mask = torch.cat((rollout.prompt_mask, rollout.completion_mask), 1)
    with routed(policy, None if replay is None else replay.flatten(1, 2)) as own:
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float()
    P = rollout.prompt_ids.shape[1]
    lp = logits[:, P - 1:-1].log_softmax(-1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    return lp, torch.stack(own).view(len(own), *ids.shape, -1)


def measure(policy, sigma: float, seed: int) -> dict:
    engine = BuiltinRollout()
    spec = SamplingSpec(max_new_tokens=NEW, temperature=1.0, seed=seed, noise_sigma=sigma,
                        noise_generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 40000, (PROMPT_TOKENS,), generator=g).tolist() for _ in range(PROMPTS)]
    recorder = RoutingRecorder()
    with recorder.recording(policy):
        rollout = engine.generate(policy, prompts, GROUP, 0, [2], spec, routing=recorder)
    P = rollout.prompt_ids.shape[1]
    choices = recorder.choices(rollout.prompt_ids.shape[0], P + rollout.completion_ids.shape[1])
    lp_own, own = trainer_logprobs(policy, rollout)
    lp_replay, _ = trainer_logprobs(policy, rollout, replay=choices)
    completion = rollout.completion_mask.bool()
    fed = (choices[0, :, P:, 0] != NOT_FED) & completion  # generated tokens the rollout fed through the model
    differs = topk_differs(own[:, :, P:], choices[:, :, P:]) & fed  # [layers, N, L]
    # a token's log-prob depends on the routing of every earlier position: "rerouted" = some earlier generated
    # token (or itself) was routed differently in some layer
    rerouted = (differs.any(0).long().cumsum(-1) > 0) & completion
    gap_own = (rollout.logprobs - lp_own).abs()
    gap_replay = (rollout.logprobs - lp_replay).abs()
    return dict(
        sigma=sigma, tokens=int(completion.sum()), pairs_compared=int(fed.sum()) * choices.shape[0],
        router_mismatch_frac=float(differs.sum() / max(1, int(fed.sum()) * choices.shape[0])),
        router_mismatch_token_frac=float(differs.any(0).sum() / max(1, int(fed.sum()))),
        rerouted_tokens_frac=float(rerouted.sum() / completion.sum()),
        logprob_gap=float(gap_own[completion].mean()), logprob_gap_replay=float(gap_replay[completion].mean()),
        logprob_gap_rerouted=float(gap_own[rerouted].mean()) if rerouted.any() else 0.0,
        logprob_gap_rerouted_replay=float(gap_replay[rerouted].mean()) if rerouted.any() else 0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(Path(tmp) / "moe", "qwen3_moe", hidden_size=128, layers=4)
        policy = build_policy(str(path), "nvfp4", lora_rank=8, dtype="float32")
    with torch.no_grad():  # a trained-looking adapter: B away from zero
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02, generator=torch.Generator().manual_seed(len(name)))
    policy.eval()
    rows = []
    for sigma in SIGMAS:
        runs = [measure(policy, sigma, seed) for seed in range(args.seeds)]
        row = {k: (sum(r[k] for r in runs) / len(runs) if k != "sigma" else sigma) for k in runs[0]}
        rows.append(row)
        print(f"sigma {sigma:7.0e}  mismatch pairs {row['router_mismatch_frac']:.4f}  tokens "
              f"{row['router_mismatch_token_frac']:.4f}  rerouted {row['rerouted_tokens_frac']:.3f}  "
              f"|dlogp| {row['logprob_gap']:.5f} -> replay {row['logprob_gap_replay']:.5f}  "
              f"(rerouted tokens {row['logprob_gap_rerouted']:.5f} -> {row['logprob_gap_rerouted_replay']:.5f})",
              flush=True)
    out = Path(args.out) / "moe_router_replay_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    model = dict(architecture="qwen3_moe", hidden_size=128, layers=4, experts=8, top_k=2, lora_rank=8,
                 quantization="nvfp4", prompts=PROMPTS, group=GROUP, new_tokens=NEW, seeds=args.seeds)
    out.write_text(json.dumps({"device": "cpu", "model": model, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
