"""The peer a user picks to fit a big model on one GPU: QLoRA (transformers + peft + bitsandbytes NF4), HF
``generate`` for the rollout, and qerl's own loss code for the update, at the end-to-end benchmark's settings.

    python bench/bench_qlora_peer.py --model DIR --tokenizer DIR --out bench/results [--new-tokens 256] [--steps 2]
        [--compare train_e2e_<device>_fixed_<label>.json]

``DIR``: the bf16 checkpoint ``bench_train_e2e.py`` writes (random weights, real Qwen2.5 shapes), loaded the way a
QLoRA user loads a model (``BitsAndBytesConfig`` NF4, double quantization, bf16 compute), prepared with peft's
``prepare_model_for_kbit_training`` (gradient checkpointing), LoRA r=16 on q,k,v,o,gate,up,down. Each step: G
samples per prompt from ``generate`` (``min_new_tokens = max_new_tokens``: fixed lengths, as random weights give
ours), then micro-batches of padded rows through the decoder, log-probs from the hidden states in chunks
(``qerl.modules.logprobs``), ``DAPOLoss``, AdamW with the recipe's settings. Prints the medians after the first
step and, with ``--compare``, the ratio to qerl's NVFP4 step at the same settings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compare", default=None)
    args = parser.parse_args()

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from qerl.modules.logprobs import token_logprobs
    from qerl.modules.loss import DAPOLoss

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizer.padding_side = "left"
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, quantization_config=quantization, dtype=torch.bfloat16,
                                                 device_map={"": 0})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]))
    print(f"loaded NF4 + LoRA in {time.perf_counter() - start:.1f} s; "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GB allocated", flush=True)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.99), weight_decay=0.1)
    loss_fn = DAPOLoss()
    g = torch.Generator().manual_seed(0)
    questions = [f"What is {a} + {b}?" for a, b in torch.randint(1, 10, (args.steps * args.prompts, 2), generator=g)]
    rows, timings = args.prompts * args.group_size, []
    for step in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True)
                 for q in questions[step * args.prompts:(step + 1) * args.prompts]]
        batch = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        policy.eval()
        with torch.no_grad():
            sequences = policy.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0,
                                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                        num_return_sequences=args.group_size, pad_token_id=tokenizer.pad_token_id)
        torch.cuda.synchronize()
        rollout_s = time.perf_counter() - start
        policy.train()
        prompt_len = batch["input_ids"].shape[1]
        attention = torch.cat((batch["attention_mask"].repeat_interleave(args.group_size, 0),
                               torch.ones(rows, sequences.shape[1] - prompt_len, dtype=torch.long, device="cuda")), 1)
        completion = sequences[:, prompt_len:]
        mask = torch.ones_like(completion)
        rewards = torch.rand(rows, generator=g).to("cuda")  # random weights: the loss's cost does not depend on them
        grouped = rewards.view(-1, args.group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        weights = loss_fn.token_weights(mask)
        start = time.perf_counter()
        base = policy.get_base_model()
        for idx in torch.arange(rows, device="cuda").split(args.micro_batch):
            hidden = base.get_decoder()(input_ids=sequences[idx], attention_mask=attention[idx],
                                        position_ids=(attention[idx].cumsum(-1) - 1).clamp(min=0),
                                        use_cache=False).last_hidden_state
            logprobs, _ = token_logprobs(hidden[:, prompt_len - 1 : -1], base.get_output_embeddings().weight,
                                         completion[idx], with_entropy=True)
            loss, _ = loss_fn(logprobs, logprobs.detach(), advantages[idx], mask[idx], weights[idx])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.2)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        train_s = time.perf_counter() - start
        timings.append({"rollout_s": rollout_s, "train_s": train_s,
                        "peak_gb": torch.cuda.max_memory_allocated() / 2**30})
        print(f"step {step}: {timings[-1]}", flush=True)
    steady = lambda key: statistics.median(t[key] for t in timings[1:] or timings)  # noqa: E731
    row = {"model": Path(args.model).name, "peer": "qlora-nf4-peft-hf-generate", "prompts": args.prompts,
           "group_size": args.group_size, "new_tokens": args.new_tokens, "micro_batch": args.micro_batch,
           "rollout_s_qlora": steady("rollout_s"), "train_s_qlora": steady("train_s"),
           "peak_gb_qlora": max(t["peak_gb"] for t in timings)}
    row["step_s_qlora"] = row["rollout_s_qlora"] + row["train_s_qlora"]
    if args.compare:
        ours = json.loads(Path(args.compare).read_text())["rows"][0]
        for key in ("rollout_s_nvfp4", "train_s_nvfp4", "step_s_nvfp4"):
            row[key] = ours[key]
        row["step_qlora_over_nvfp4"] = row["step_s_qlora"] / ours["step_s_nvfp4"]
        row["rollout_qlora_over_nvfp4"] = row["rollout_s_qlora"] / ours["rollout_s_nvfp4"]
        row["train_qlora_over_nvfp4"] = row["train_s_qlora"] / ours["train_s_nvfp4"]
    device = torch.cuda.get_device_name()
    print(f"\nQLoRA peer, {args.prompts} x G={args.group_size}, {args.new_tokens} new tokens, {device}")
    for key, value in row.items():
        print(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = device.split()[1].lower() if len(device.split()) > 1 else "gpu"
    report = {"device": device, "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": [row],
              "steps": timings}
    (out / f"qlora_peer_{tag}_{args.new_tokens}tok.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
