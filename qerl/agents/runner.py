"""``model.agent`` made concrete for a run: its tools loaded, its environment's factory, the tokenizer's call format,
checked against the chat template; ``run`` plays one batch's episodes."""

from __future__ import annotations

from qerl.agents.config import AgentConfig
from qerl.agents.episode import Episodes, Sampler, run_episodes
from qerl.tools.chat_template import call_format, check_tool_support
from qerl.tools.environment import environment_tools


class EpisodeRunner:
    """The episodes of a run.

    Args:
        config: ``model.agent``.
        tokenizer: the policy's tokenizer, with ``config.chat_template`` applied.
        model: the model's name, for error messages.
        template_kwargs: extra chat template variables (the data's ``chat_template_kwargs``).
    """

    def __init__(self, config: AgentConfig, tokenizer, model: str, template_kwargs: dict | None = None):
        self.config, self.tokenizer, self.template_kwargs = config, tokenizer, dict(template_kwargs or {})
        self.tools, self.environment = config.load()
        self.schemas = [t.schema for t in self.tools]
        if self.environment is not None:
            self.schemas += [t.schema for t in environment_tools(self.environment.make())]
        check_tool_support(tokenizer, self.schemas, model)
        self.call_format = call_format(tokenizer)

    def run(self, sample: Sampler, batch: dict, group_size: int, eos_ids: list[int], pad_id: int,
            max_new_tokens: int) -> Episodes:
        """``group_size`` episodes of each prompt of ``batch`` (its ``prompt_ids`` rendered with the tools; its
        ``columns`` reset the environments)."""
        rows = batch.get("columns") or [{} for _ in batch["prompt_ids"]]
        return run_episodes(sample, batch["prompt_ids"], rows, group_size, self.tokenizer, eos_ids, pad_id,
                            self.config, self.tools, self.environment, max_new_tokens, self.call_format,
                            self.schemas, self.template_kwargs)
