"""A prompt source for benchmarks on random-weight models: questions of random tokens, distinct per prompt.

    --data.sources+=random_prompts.RandomTokenPrompts --data.sources.tokenizer=DIR \
        --model.agent.chat_template bench/plain_prompt.jinja                      (bench/ on the Python path)

A random-init MoE sends the rows of prompts that share some of their text (the embedded arithmetic questions or
GSM8K's, and even random ones, through one chat template: its system prompt and turn markers) to a few experts at
every layer, where a trained router spreads them (``bench/routing_skew.py``). Questions of random tokens laid out
without the template's text (``plain_prompt.jinja``) give the routing of ``bench_moe_decode.py``'s random-token
prompts, close to a uniform router's. Their answers are never right (the reward is 0): for timing only.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

from pathlib import Path

from qerl.data.sources.base import PromptSource, Row

PLAIN_TEMPLATE = Path(__file__).with_name("plain_prompt.jinja")  # the messages' text alone


class RandomTokenPrompts(PromptSource):
    """Endless questions of ``tokens`` random token ids of ``tokenizer`` (a directory or hub id), decoded to text.

    Args:
        tokenizer: the tokenizer whose vocabulary the tokens are drawn from (an embedded model's name, HF id or
            directory, as ``model.policy.model``).
        tokens: tokens per question (the chat template adds its own; keep the sum under the data module's
            ``max_prompt_tokens``).
        seed: seed of the draws.
    """

    infinite = True

    def __init__(self, tokenizer: str, tokens: int = 160, seed: int = 0):
        from qerl.hub import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer)
        self.tokens, self.seed = tokens, seed
        self.special = set(self.tokenizer.all_special_ids)
        self.stats = Counter()

    def __iter__(self) -> Iterator[Row]:
        rng = random.Random(self.seed)
        vocab = len(self.tokenizer)
        while True:
            ids = [i for i in (rng.randrange(vocab) for _ in range(self.tokens)) if i not in self.special]
            self.stats["rows"] += 1
            yield {"question": self.tokenizer.decode(ids), "answer": "0", "source": "random_tokens"}
