"""What the model may call during an episode, and how it is told: tools as TRL users write them.

    loading.py        ``model.tools`` / ``model.environment`` entries -> callables and their JSON schemas
                      (transformers' ``get_json_schema``), checked when the config is parsed
    environment.py    the stateful environment of one trajectory (TRL's ``environment_factory`` shape)
    chat_template.py  the chat template that shows the schemas and renders tool results (``apply_chat_template``)
    calls.py          the model's tool calls parsed in its family's format (Qwen ``<tool_call>``, Llama 3 JSON)
    execution.py      one call run with a timeout; every failure becomes the tool's answer, counted by kind
    python.py         the Python tool: model-written code in a separate, limited process
    calculator.py     an arithmetic tool (the embedded model's recipe)
"""
