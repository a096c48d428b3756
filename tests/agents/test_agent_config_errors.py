"""Agent config mistakes fail while the command line is parsed, in one line naming the option and the fix, before any
model loads."""

from pathlib import Path

import pytest

from qerl.cli import cli_main

ROOT = Path(__file__).resolve().parents[2]
MY_TOOLS = ROOT / "tests" / "tools" / "my_tools.py"
CALCULATOR = ["--model.agent.tools", "[qerl.tools.calculator:calculator]"]


def fails(args, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", "--config", str(ROOT / "configs" / "debug.yaml"), *args])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return next(line for line in lines if line.startswith("error: "))


@pytest.mark.parametrize("args, expected", [
    (["--model.agent.tools", "[no_such_module:fn]"],
     "model.agent.tools[0]='no_such_module:fn' cannot be loaded (ModuleNotFoundError"),
    (["--model.agent.tools", f"[{MY_TOOLS}:undocumented]"], "no docstring! Fix: make it a function with type hints"),
    (["--model.agent.tools", f"[{MY_TOOLS}:unhinted]"], "missing a type hint in function unhinted Fix:"),
    (["--model.agent.environment", f"{MY_TOOLS}:multiply"], "model.agent.environment="),
    ([*CALCULATOR], "model.agent.chat_template: the chat template of 'smollm2-135m-instruct' does not show tools"),
    ([*CALCULATOR, "--model.agent.chat_template", "chatml9"], "model.agent.chat_template='chatml9': neither"),
    ([*CALCULATOR, "--model.agent.chat_template", "qwen2_5", "--model.dapo.overlong_buffer", "2"],
     "model.dapo.overlong_buffer=2: must be 0 with model.agent"),
    ([*CALCULATOR, "--model.agent.chat_template", "qwen2_5", "--model.agent.max_turns", "0"],
     "model.agent.max_turns=0: must be >= 1"),
])
def test_agent_mistakes_are_one_line_before_anything_loads(args, expected, capsys, no_model_loads, tmp_path,
                                                           monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert expected in fails(args, capsys)
    assert not (tmp_path / "runs").exists()
