"""Settings travel down as values: how to sample is one ``SamplingSpec`` per ``generate`` call, never state set on an
engine from outside, and the module never reads a sampling setting back out of its engine."""

import re
from pathlib import Path

QERL = Path(__file__).resolve().parents[1] / "qerl"


def sources(folder: Path) -> dict[Path, str]:
    return {path: path.read_text() for path in folder.rglob("*.py")}


def test_no_engine_takes_sampling_settings_as_state():
    for path, text in sources(QERL).items():
        assert "set_noise" not in text, path
        assert not re.search(r"def sampling\(", text), path  # the old context manager that swapped settings in and out
    for path, text in sources(QERL / "rollout").items():  # an engine keeps no sampling setting of its own
        if path.name in ("sampling_spec.py", "run_settings.py"):  # values, not engines
            continue
        assert not re.search(r"self\.(noise_\w+|temperature|top_p|greedy|max_new_tokens)\b", text), path


def test_the_module_reads_no_setting_of_its_engine():
    settings = r"rollout\.(temperature|top_p|max_new_tokens|greedy|seed|noise\w*)\b"
    for path, text in sources(QERL / "modules").items():
        assert not re.search(settings, text), path


def test_every_engine_generates_from_a_spec():
    import inspect

    from qerl.rollout.builtin import BuiltinRollout
    from qerl.rollout.cuda_graph import CUDAGraphRollout
    from qerl.rollout.vllm import VLLMRollout

    for engine in (BuiltinRollout, CUDAGraphRollout, VLLMRollout):
        parameters = list(inspect.signature(engine.generate).parameters)
        assert parameters[:7] == ["self", "policy", "prompt_ids", "group_size", "pad_id", "eos_ids", "spec"], engine
        assert set(parameters[7:]) <= {"routing"}, engine  # a MoE's expert-choice recorder, not a sampling setting
        assert not {"max_new_tokens", "temperature", "top_p", "seed"} & set(inspect.signature(engine).parameters)


PLANNED_ENGINE_SETTINGS = ("wave_rows", "wide_batch_bf16", "keep_kv_cache", "gpu_memory_utilization", "max_model_len")


def self_assignments(cls) -> dict[str, set[str]]:
    """method name -> the attributes of ``self`` it assigns (``self.x = ...``, ``self.x, y = ...``, ``self.x += ...``)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found: dict[str, set[str]] = {}
    for method in (n for n in tree.body[0].body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(method):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        found.setdefault(method.name, set()).add(leaf.attr)
    return found


def test_no_engine_method_decides_a_planned_setting():
    """An engine takes its planned settings (``settings.PLANNED``) once, in its constructor: no other method of it
    assigns one (what the engine decided at run time before the resolution owned these values)."""
    from qerl.rollout.builtin import BuiltinRollout
    from qerl.rollout.cuda_graph import CUDAGraphRollout
    from qerl.rollout.vllm import VLLMRollout

    for engine in (BuiltinRollout, CUDAGraphRollout, VLLMRollout):
        planned = set(engine.settings.PLANNED)
        assert planned <= set(PLANNED_ENGINE_SETTINGS), engine
        for method, names in self_assignments(engine).items():
            if method != "__init__":
                assert not names & planned, (engine.__name__, method, names & planned)


def test_nothing_outside_an_engine_writes_its_planned_settings():
    """No object sets a planned value on a built engine or module from outside (``engine.wave_rows = ...``); the
    resolution writes concrete values into the parsed config only, before anything is built (``qerl/run/``)."""
    import ast

    planned = {*PLANNED_ENGINE_SETTINGS, "micro_batch_tokens"}
    for path, text in sources(QERL).items():
        if path.parent.name == "run":  # the resolution: values written into the config namespace before any build
            continue
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for leaf in (leaf for target in targets for leaf in ast.walk(target)):
                outside = isinstance(leaf, ast.Attribute) and not (
                    isinstance(leaf.value, ast.Name) and leaf.value.id == "self")
                assert not (outside and leaf.attr in planned), (path, node.lineno, ast.unparse(node))


def test_the_module_reads_no_planned_setting_of_its_engine():
    planned = rf"rollout\.({'|'.join(PLANNED_ENGINE_SETTINGS)}|kv_cache_dtype|length_bucket)\b"
    for path, text in sources(QERL / "modules").items():
        assert not re.search(planned, text), path
