"""``model.agent``: the tools and environment of an episode and its limits, one config group."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qerl.tools.chat_template import check_tool_support, with_chat_template
from qerl.tools.environment import EnvironmentFactory, load_environment
from qerl.tools.loading import Tool, check_unique, load_tools


@dataclass
class AgentConfig:
    """Multi-turn episodes: the model calls tools (or acts on an environment) and continues after each result.

    Without ``tools`` and ``environment`` an episode is one completion (single-turn RL).

    Args:
        tools: tool functions as TRL's ``tools=`` takes them: ``module:function``, ``path/to/file.py:function`` or
            ``{class_path: module.Class, init_args: {...}}`` for a callable class with settings (e.g.
            ``qerl.tools.python.PythonTool``).
        environment: an environment class (TRL's ``environment_factory``): one instance per trajectory slot (reused
            across steps), ``reset(**row)`` from the dataset row, its public methods as tools, optional
            ``step(message)`` and ``get_reward()``.
        chat_template: a template that shows tools when the model's own does not: ``qwen2_5`` (ChatML models) or a
            ``.jinja`` file.
        max_turns: assistant turns per trajectory; a trajectory still calling tools after it ends there.
        max_tool_calls: tool calls per trajectory; a turn that would pass it ends the trajectory.
        max_episode_tokens: tokens per trajectory, prompt + every turn + every observation (None: the prompt plus
            ``max_turns`` times the rollout's max_new_tokens).
        tool_output_chars: a tool's answer is cut to this many characters.
        tool_timeout_s: wall-clock limit of one tool call.
    """

    tools: list[str | dict] | None = None
    environment: str | dict | None = None
    chat_template: str | None = None
    max_turns: int = 4
    max_tool_calls: int = 8
    max_episode_tokens: int | None = None
    tool_output_chars: int = 2048
    tool_timeout_s: float = 10.0

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    def validate(self) -> None:
        for name, value, ok, rule in [
            ("max_turns", self.max_turns, self.max_turns >= 1, ">= 1"),
            ("max_tool_calls", self.max_tool_calls, self.max_tool_calls >= 0, ">= 0"),
            ("max_episode_tokens", self.max_episode_tokens, self.max_episode_tokens is None or self.max_episode_tokens
             >= 2, ">= 2 or null"),
            ("tool_output_chars", self.tool_output_chars, self.tool_output_chars >= 1, ">= 1"),
            ("tool_timeout_s", self.tool_timeout_s, self.tool_timeout_s > 0, "> 0"),
        ]:
            if not ok:
                raise ValueError(f"model.agent.{name}={value!r}: must be {rule}.")

    def load(self) -> tuple[list[Tool], EnvironmentFactory | None]:
        """The tools (loaded and described) and the environment's factory; ``ValueError`` naming the option."""
        self.validate()
        tools = load_tools(self.tools, "model.agent.tools")
        environment = load_environment(self.environment, "model.agent.environment")
        if environment is not None:
            check_unique([*tools, *environment.slot(0)[1]], "model.agent.tools + environment")
        return tools, environment


def episode_tokens(max_prompt_tokens: int, max_new_tokens: int, tools: list | None, environment: str | dict | None,
                   max_turns: int, max_episode_tokens: int | None) -> int | None:
    """The longest trajectory, prompt + every turn + every observation (what the memory plan sizes the update's rows
    and the later turns' prompts for): ``max_episode_tokens``, or the default budget of the episode loop's
    ``token_limit``; None without tools and environment (single-turn)."""
    if not tools and environment is None:
        return None
    return max_episode_tokens if max_episode_tokens is not None else max_prompt_tokens + max_turns * max_new_tokens


def agent_tool_schemas(tools: list[str | dict] | None, environment: str | dict | None, chat_template: str | None = None,
                       model: str | None = None) -> list[dict] | None:
    """The JSON schemas the prompts show (the data module's ``tools``), from ``model.agent``'s tools and environment,
    checked against ``model``'s chat template (or ``chat_template``) when its tokenizer is at hand."""
    config = AgentConfig(tools=tools, environment=environment, chat_template=chat_template)
    if not config.enabled:
        return None
    loaded, factory = config.load()
    schemas = [t.schema for t in loaded]
    if factory is not None:
        schemas += [t.schema for t in factory.slot(0)[1]]
    tokenizer = local_tokenizer(model)
    if tokenizer is not None and (tokenizer.chat_template or chat_template):  # none at all: the data module says so
        check_tool_support(with_chat_template(tokenizer, chat_template, "model.agent.chat_template"), schemas, model,
                           "model.agent.chat_template")
    return schemas


def local_tokenizer(model: str | None):
    """``model``'s tokenizer when it is on this machine (the embedded model, a local directory, the Hugging Face cache),
    else None (no network at parse time: the module checks the template again when it loads the tokenizer)."""
    from huggingface_hub import try_to_load_from_cache

    from qerl.hub import EMBEDDED_MODEL, load_tokenizer

    if model is None:
        return None
    if model != EMBEDDED_MODEL and not Path(model).is_dir():
        try:
            if not isinstance(try_to_load_from_cache(model, "tokenizer_config.json"), str):
                return None
        except ValueError:  # not a hub id either: the CLI's own check names the problem
            return None
    try:
        return load_tokenizer(model)
    except (OSError, ValueError):
        return None
