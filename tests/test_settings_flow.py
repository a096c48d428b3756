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
