"""The prompt text a question becomes: the chat template over the question, with the answer format's instruction."""

from __future__ import annotations

# Instructions appended to the question. ``boxed`` is the Qwen2.5-Math / DeepSeek-R1 prompt; ``tags`` the
# DeepSeek-R1-Zero / open-r1 format that the reference recipes reward.
FORMAT_INSTRUCTIONS = {
    "none": "",
    "gsm8k": "Solve the problem step by step, then write the final number on its own line as `#### <number>`.",
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "tags": (
        "First think about the reasoning process, then give the answer. Enclose the reasoning in <think> </think> and "
        "the final answer in <answer> </answer> tags, i.e. <think> reasoning here </think><answer> answer here </answer>."
    ),
}

def format_prompt(
    tokenizer, question: str | list[dict], answer_format: str = "none", system_prompt: str | None = None,
    instruction: str | None = None, chat_template_kwargs: dict | None = None,
) -> str:
    """The chat-formatted prompt text, ending with the assistant turn's opening (``add_generation_prompt``);
    ``instruction`` replaces the answer format's standard one. A conversation (a list of ``{"role", "content"}``
    messages) goes through the chat template as it is, the instruction appended to its last user message and
    ``system_prompt`` put first unless it opens with a system message of its own. An instruction that contains
    ``{question}`` is the whole user message instead, the question in its place (lighteval's prompts put the
    instruction first). ``chat_template_kwargs`` go to the template (Qwen3's ``enable_thinking``)."""
    instruction = FORMAT_INSTRUCTIONS[answer_format] if instruction is None else instruction
    messages = [dict(m) for m in question] if isinstance(question, list) else [{"role": "user", "content": question}]
    users = [m for m in messages if m["role"] == "user"]
    if instruction and users:
        text = users[-1]["content"]
        users[-1]["content"] = (instruction.replace("{question}", text) if "{question}" in instruction
                                else f"{text}\n{instruction}")
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(chat_template_kwargs or {}))
