"""Tools and environments named in the config: loaded as TRL users write them, every mistake one line."""

from pathlib import Path

import pytest

from qerl.tools.environment import environment_tools, load_environment
from qerl.tools.loading import load_tools

HERE = Path(__file__).parent
MY_TOOLS = str(HERE / "my_tools.py")


def test_a_trl_tool_module_loads_unchanged_with_its_schema():
    tools = load_tools([f"{MY_TOOLS}:multiply", "qerl.tools.calculator:calculator",
                        {"class_path": "qerl.tools.python.PythonTool", "init_args": {"timeout_s": 2}}])
    assert [t.name for t in tools] == ["multiply", "calculator", "python"]
    params = tools[0].schema["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    assert params["required"] == ["a", "b"] and tools[0].fn(a=6, b=7) == 42
    assert tools[2].fn.timeout_s == 2


@pytest.mark.parametrize("entry, message", [
    ("no_such_module:f", r"model.tools\[0\]='no_such_module:f' cannot be loaded \(ModuleNotFoundError"),
    (f"{MY_TOOLS}:missing", r"cannot be loaded \(AttributeError"),
    (f"{MY_TOOLS}:undocumented", "no docstring.*Fix: make it a function with type hints"),
    (f"{MY_TOOLS}:unhinted", "missing a type hint.*Fix: make it a function with type hints"),
    (f"{MY_TOOLS}:fetch", "an async tool.*Fix: make it a plain def"),
    ("multiply", "name it as 'module:name'"),
    ({"class_path": "qerl.tools.python.PythonTool", "init_args": {"seconds": 1}}, "unexpected keyword.*init_args"),
])
def test_config_mistakes_are_one_line_naming_the_option(entry, message):
    with pytest.raises(ValueError, match=message) as error:
        load_tools([entry])
    assert "\n" not in str(error.value) and str(error.value).startswith("model.tools[0]")


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        load_tools([f"{MY_TOOLS}:multiply", f"{MY_TOOLS}:multiply"])


def test_an_environment_class_exposes_its_public_methods_as_tools():
    factory = load_environment(f"{MY_TOOLS}:Counter")
    env = factory.make()
    env.reset(target=5)
    tools = environment_tools(env)
    assert [t.name for t in tools] == ["increment"]  # reset and get_reward are reserved
    tools[0].fn(step=5)
    assert env.get_reward() == 1.0


class AsyncScore:
    """An environment whose reward is a coroutine (TRL awaits one; the episodes here would not)."""

    def reset(self, **row) -> None:
        pass

    async def get_reward(self) -> float:
        return 1.0


def test_an_environment_with_an_async_reward_is_refused_at_load():
    with pytest.raises(ValueError, match="its get_reward is async.*Fix: make it a plain def"):
        load_environment(f"{Path(__file__)}:AsyncScore")


def test_an_environment_that_is_not_a_class_is_refused():
    with pytest.raises(ValueError, match="model.environment=.*not a class with a reset"):
        load_environment(f"{MY_TOOLS}:multiply")
