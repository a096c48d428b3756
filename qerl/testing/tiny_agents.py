"""A tiny chat model for episode tests: the tiny random-init model of ``tiny_models`` with the embedded (ChatML)
tokenizer carrying Qwen2.5's tool-calling template, and weights that end a turn often.

A random-init model over a 49k vocabulary almost never samples its end-of-turn token, so its turns would all be cut
by ``max_new_tokens`` and no episode would reach a second turn. Here every token embedding gets a constant channel
and the output row of the end-of-turn token reads it: the end-of-turn token has a fixed share of each next-token
distribution (``end_logit`` sets it: 9.2 gives about one in six), every other token stays random.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.testing.tiny_models import save_tiny_model
from qerl.tools.chat_template import with_chat_template


def save_tiny_chat_model(directory: str | Path, architecture: str = "qwen2", end_logit: float = 9.2, seed: int = 0
                         ) -> Path:
    """Write the tiny model (float32) and its tokenizer (``qwen2_5`` template) to ``directory``; ``architecture``
    one with its own output matrix (``qwen2``, ``llama``, ``qwen3_moe``: the tied ones would move the embeddings too)."""
    if architecture not in ("qwen2", "llama", "qwen3_moe"):
        raise ValueError(f"architecture must be qwen2, llama or qwen3_moe (untied output matrix), got "
                         f"{architecture!r}.")
    from transformers import AutoModelForCausalLM

    directory = save_tiny_model(directory, architecture, seed=seed, dtype=torch.float32)
    tokenizer = with_chat_template(load_tokenizer(EMBEDDED_MODEL), "qwen2_5")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embeddings[:, 0] = 1.0  # a constant channel: after the final RMSNorm it is the same large value everywhere
        head[:, 0] = 0.0
        hidden = model(torch.tensor([[tokenizer.eos_token_id, 5, 6]]), output_hidden_states=True).hidden_states[-1]
        head[tokenizer.eos_token_id, 0] = end_logit / float(hidden[0, :, 0].mean())
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """One user message each, rendered by the tokenizer's chat template, ready for the model's turn."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in questions]


class GoOn:
    """An environment for episode tests: answers the model's first two replies with a user message, then ends; scores
    the replies it saw."""

    def reset(self, **row) -> None:
        self.replies = 0

    def step(self, message: str) -> str | None:
        self.replies += 1
        return None if self.replies >= 3 else f"Go on ({self.replies})."

    def get_reward(self) -> float:
        return float(self.replies)
