"""``python -m qerl.export``: each format, on a tiny random model (a real 2-step ``fit``) and on the embedded model
(a run folder written directly), checked against qerl's own trained policy; and the errors for bad input.

Two steps on a random model move no LoRA matrix (every reward is 0, so every advantage is 0), and an adapter that
changes nothing would make every comparison below pass trivially. So both runs get random LoRA B matrices and
scaled norms, saved through the policy's own ``save_adapter`` (and, for the fit, into ``last.ckpt`` as well).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from qerl.cli import cli_main
from qerl.export import (
    export, greedy_completions, load_export, load_trained_policy, main, read_run, rollout_length, validation_questions,
)
from qerl.hub import EMBEDDED_MODEL, load_tokenizer
from qerl.model.policy import PolicyConfig, save_adapter
from qerl.nvfp4.format import dequantize
from qerl.quantize import quantize_checkpoint

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.yaml")
VAL = [{"class_path": "qerl.data.sources.ArithmeticSource", "init_args": {"seed": 1234, "num_rows": 4}}]
# Greedy comparisons: (questions, completion tokens) per run; few on the embedded model, which decodes slowly on a CPU.
SIZES = {"tiny": (4, 8), "embedded": (2, 4)}
QUESTIONS, TOKENS = SIZES["tiny"]


def randomize(policy, seed: int) -> None:
    """LoRA B ~ N(0, 0.05^2) (peft starts it at 0) and norms scaled by 1 + N(0, 0.1^2): an adapter that matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if not param.requires_grad:
                continue
            noise = torch.randn(param.shape, generator=generator)
            if ".lora_B." in name:
                param.copy_(0.05 * noise)
            elif ".modules_to_save." in name:
                param.mul_(1 + 0.1 * noise)


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dirs, tmp_path_factory) -> Path:
    """A real ``fit`` (2 steps, validated at step 2) on the tiny Qwen2; then the adapter and last.ckpt randomized."""
    root = tmp_path_factory.mktemp("export_fit")
    cli = cli_main([
        "fit", "--config", DEBUG, "--model.policy.model", str(tiny_model_dirs["qwen2"]),
        "--trainer.logger.init_args.save_dir", str(root), "--data.val_sources", json.dumps(VAL),
        "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null",
    ])
    run = Path(cli.trainer.log_dir)
    policy = cli.model.policy
    randomize(policy, seed=0)
    save_adapter(policy, run / "adapter")
    last = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = {f"policy.{n}": p.detach().clone() for n, p in policy.named_parameters()
                                if p.requires_grad}
    torch.save(checkpoint, last)
    return run


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory) -> Path:
    """A run folder of the embedded model written directly: config.yaml and a saved adapter."""
    run = tmp_path_factory.mktemp("export_embedded") / "version_0"
    config = {"model": {"policy": {"model": EMBEDDED_MODEL, "quantization": "nvfp4", "lora_rank": 4,
                                   "lora_alpha": 8.0, "dtype": "float32"},
                        "sampling": {"max_new_tokens": 32},
                        "rollout": {"class_path": "qerl.rollout.builtin.BuiltinRollout"}},
              "data": {"val_sources": VAL}}
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    policy = PolicyConfig(**config["model"]["policy"]).build()
    randomize(policy, seed=1)
    save_adapter(policy, run / "adapter")
    return run


@pytest.fixture(scope="module")
def reference(request):
    """``reference(name)``: the run ``<name>_run`` with qerl's trained policy (float32) on it, the validation questions
    and the policy's greedy completions (built on first use, so the tiny tests never build the embedded run)."""
    cache = {}

    def get(name: str) -> dict:
        if name not in cache:
            run = request.getfixturevalue(f"{name}_run")
            trained = read_run(run)
            tokenizer = load_tokenizer(trained.policy.model)
            policy = load_trained_policy(trained, "float32")
            questions, tokens = SIZES[name]
            prompts, answers = validation_questions(trained, tokenizer, questions)
            cache[name] = {"run": run, "policy": policy, "tokenizer": tokenizer, "prompts": prompts,
                           "answers": answers, "tokens": tokens,
                           "completions": greedy_completions(policy, tokenizer, prompts, tokens)}
        return cache[name]

    return get


def logits(model, prompts) -> torch.Tensor:
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def quantized_base(run: Path, tmp_path: Path, embedded_nvfp4_dir: Path) -> Path:
    """What ``python -m qerl.quantize`` writes for the run's base model."""
    model = read_run(run).policy.model
    if model == EMBEDDED_MODEL:
        return embedded_nvfp4_dir
    return quantize_checkpoint(model, tmp_path / "quantized", log=lambda line: None)


# ---------------------------------------------------------------------------------------------------------------
# vllm: NVFP4 base (+ trained norms) + LoRA-only adapter


@pytest.mark.parametrize("name", ["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def test_vllm_export_keeps_the_linears_moves_norms_into_the_base_and_answers_like_the_policy(
        name, reference, tmp_path, embedded_nvfp4_dir, capsys):
    ref = reference(name)
    run = ref["run"]
    out = tmp_path / "vllm"
    assert main(["--run", str(run), "--output", str(out), "--dtype", "float32", "--no-check"]) == 0
    printed = capsys.readouterr().out
    serve = f"vllm serve {out.resolve()} --enable-lora --lora-modules policy={out.resolve()}/adapter --max-lora-rank 8"
    assert serve in printed and serve in (out / "README.md").read_text()
    assert "enable_lora=True, max_lora_rank=8" in (out / "README.md").read_text()

    exported = load_file(str(out / "model.safetensors"))
    base = load_file(str(quantized_base(run, tmp_path, embedded_nvfp4_dir) / "model.safetensors"))
    packed = [k for k in base if k.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
    assert packed and all(torch.equal(exported[k].view(torch.uint8), base[k].view(torch.uint8)) for k in packed)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "nvfp4-pack-quantized"

    trained = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    norms = {k.removeprefix("base_model.model."): v for k, v in trained.items() if ".lora_" not in k}
    assert norms and all(torch.equal(exported[k], v) for k, v in norms.items())  # float32 export: exact
    assert any(not torch.equal(exported[k], base[k].float()) for k in norms)  # they were trained (randomized)
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert set(adapter) == {k for k in trained if ".lora_" in k}  # LoRA only: vLLM refuses full modules
    assert all(torch.equal(adapter[k], trained[k]) for k in adapter)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and not config["modules_to_save"]

    model = load_export(out, "vllm")  # transformers + peft, on the CPU
    assert greedy_completions(model, ref["tokenizer"], ref["prompts"], ref["tokens"]) == ref["completions"]
    expected = logits(ref["policy"], ref["prompts"])
    torch.testing.assert_close(logits(model, ref["prompts"]), expected, atol=1e-4, rtol=1e-4)
    with ref["policy"].disable_adapter():  # the base with its original norms: the adapter must matter
        assert (logits(ref["policy"], ref["prompts"]) - expected).abs().max() > 1e-2


def test_export_carries_tokenizer_generation_config_and_model_card(tiny_run, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path / "vllm"
    export(tiny_run, out, "vllm", check=False, log=lambda line: None)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    generation = GenerationConfig.from_pretrained(out)
    assert tokenizer.eos_token_id in ([generation.eos_token_id] if isinstance(generation.eos_token_id, int)
                                      else generation.eos_token_id)
    assert generation.max_new_tokens == 4  # debug.yaml's rollout length
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft")
    assert "- steps: 2" in card  # last.ckpt's global_step
    # The validation the fit ran at step 2, read back from its TensorBoard event files.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tiny_run))
    events.Reload()
    value = events.Scalars("val/arithmetic_acc")[-1].value
    assert f"| val/arithmetic_acc | {value:.4f} |" in card
    assert (out / "training_config.yaml").read_text() == (tiny_run / "config.yaml").read_text()


def test_the_check_decodes_as_long_as_the_run_sampled_also_for_a_run_saved_before_model_sampling(tiny_run):
    trained = read_run(tiny_run)
    assert rollout_length(trained) == 4  # debug.yaml's model.sampling.max_new_tokens, as the run saved it
    model = {k: v for k, v in trained.config["model"].items() if k != "sampling"}
    before = {**model, "rollout": {"class_path": "qerl.rollout.builtin.BuiltinRollout",
                                   "init_args": {"max_new_tokens": 32}}}  # the layout before the move
    assert rollout_length(dataclasses.replace(trained, config={"model": before})) == 32
    assert rollout_length(dataclasses.replace(trained, config={"model": model})) == 256  # neither: the default


def test_checkpoint_and_adapter_give_the_same_export(tiny_run, tmp_path):
    export(tiny_run, tmp_path / "a", "vllm", check=False, log=lambda line: None)
    export(tiny_run, tmp_path / "c", "vllm", ckpt="last.ckpt", check=False, log=lambda line: None)
    for file in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, c = load_file(str(tmp_path / "a" / file)), load_file(str(tmp_path / "c" / file))
        assert a.keys() == c.keys() and all(torch.equal(a[k], c[k]) for k in a), file
    assert "- steps: 2" in (tmp_path / "c" / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# merged-bf16 and merged-nvfp4


@pytest.mark.parametrize("name", ["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def test_merged_export_is_a_plain_transformers_model_that_answers_like_the_policy(name, reference, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = reference(name)
    run = ref["run"]
    out = tmp_path / "merged"
    export(run, out, "merged-bf16", dtype="float32", check=False, log=lambda line: None)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert not any("lora" in k or "weight_packed" in k or "modules_to_save" in k for k in tensors)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert greedy_completions(model, ref["tokenizer"], ref["prompts"], ref["tokens"]) == ref["completions"]
    torch.testing.assert_close(logits(model, ref["prompts"]), logits(ref["policy"], ref["prompts"]),
                               atol=1e-4, rtol=1e-4)


def test_merged_bf16_default_is_bf16_and_reports_its_agreement(tiny_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    report = export(tiny_run, out, "merged-bf16", check=True, max_questions=QUESTIONS, max_new_tokens=TOKENS,
                    log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    agreement = report["agreement"]
    assert agreement["questions"] == QUESTIONS
    assert agreement["same_completion"] == QUESTIONS - len(agreement["differing"])
    assert json.loads((out / "export.json").read_text())["agreement"] == agreement


@pytest.mark.parametrize("name", ["tiny", pytest.param("embedded", marks=pytest.mark.slow)])
def test_merged_nvfp4_measures_requantization_and_its_differences_come_from_it(name, reference, tmp_path):
    ref = reference(name)
    run = ref["run"]
    out = tmp_path / "nvfp4"
    lines = []
    report = export(run, out, "merged-nvfp4", dtype="float32", max_questions=len(ref["prompts"]),
                    max_new_tokens=ref["tokens"], log=lines.append)
    errors = report["relative_error"]
    layers = {n for n, m in ref["policy"].get_base_model().named_modules() if hasattr(m, "lora_A")}
    assert set(errors) == layers
    assert all(0 < e < 0.2 for e in errors.values())
    assert any(f"re-quantization error {layer}:" in line for line in lines for layer in list(layers)[:1])

    # One layer by hand: W = dequant(base) + (alpha / r) * B @ A, against the export's NVFP4 weight.
    layer = sorted(layers)[0]
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    a, b = (adapter[f"base_model.model.{layer}.lora_{x}.weight"] for x in "AB")
    base_layer = ref["policy"].get_base_model().get_submodule(layer).get_base_layer()
    w = base_layer.dequantize(torch.float32) + (8.0 / 4) * b.float() @ a.float()
    q = load_file(str(out / "model.safetensors"))
    wq = dequantize(*(q[f"{layer}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")),
                    dtype=torch.float32)
    assert errors[layer] == pytest.approx(float((wq - w).norm() / w.norm()), rel=1e-3)

    # The greedy answers: the export's differ from the policy's exactly where the report says, and only there.
    model = load_export(out, "merged-nvfp4")
    completions = greedy_completions(model, ref["tokenizer"], ref["prompts"], ref["tokens"])
    differing = [i for i, (x, y) in enumerate(zip(completions, ref["completions"])) if x != y]
    assert report["agreement"]["differing"] == differing
    assert report["agreement"]["same_completion"] == len(ref["prompts"]) - len(differing)
    assert f"Greedy completions on {len(ref['prompts'])} validation questions" in (out / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one error naming the option, the problem and the fix, before any weight is read


def test_run_without_adapter_is_refused(tiny_run, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny_run / "config.yaml", run / "config.yaml")
    assert main(["--run", str(run), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: --run {run}: ") and "no PEFT adapter" in error and "--adapter DIR" in error
    assert not (tmp_path / "out").exists()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pass --ckpt last.ckpt"):
        read_run(run)


@pytest.mark.slow  # the embedded run's adapter
def test_adapter_of_another_base_is_refused(tiny_run, embedded_run, tmp_path, capsys):
    adapter = embedded_run / "adapter"
    assert main(["--run", str(tiny_run), "--adapter", str(adapter), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert f"--adapter {adapter} does not fit the base model" in error and "has shape" in error
    assert "(--run)" in error and not (tmp_path / "out").exists()


def test_missing_checkpoint_and_unknown_format_are_refused(tiny_run, tmp_path, capsys):
    assert main(["--run", str(tiny_run), "--output", str(tmp_path / "out"), "--ckpt", "missing.ckpt"]) == 2
    assert "--ckpt missing.ckpt: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--run", str(tiny_run), "--output", str(tmp_path / "out"), "--format", "gguf"])
    assert "invalid choice: 'gguf'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--format 'gguf'"):
        export(tiny_run, tmp_path / "out", "gguf")


def test_folder_that_is_no_run_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.yaml there"):
        read_run(tmp_path)


def test_force_replaces_an_earlier_export_and_nothing_else(tiny_run, tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="holds none"):
        export(tiny_run, other, force=True)
    assert (other / "notes.txt").read_text() == "keep"
    out = tmp_path / "out"
    export(tiny_run, out, "merged-bf16", check=False, log=lambda line: None)
    with pytest.raises(FileExistsError, match="pass --force"):
        export(tiny_run, out, "vllm", check=False)
    export(tiny_run, out, "vllm", check=False, force=True, log=lambda line: None)
    assert json.loads((out / "export.json").read_text())["format"] == "vllm" and (out / "adapter").is_dir()


def test_vllm_export_of_a_run_on_a_bf16_base_writes_a_dense_base(tiny_model_dirs, tmp_path):
    """The 16-bit LoRA baseline (model.policy.quantization: bf16) on the tiny Llama: the base stays dense."""
    run = tmp_path / "version_0"
    run.mkdir()
    policy_config = {"model": str(tiny_model_dirs["llama"]), "quantization": "bf16", "lora_rank": 4,
                     "lora_alpha": 8.0, "dtype": "float32"}
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"policy": policy_config}, "data": {"val_sources": VAL}}))
    policy = PolicyConfig(**policy_config).build()
    randomize(policy, seed=2)
    save_adapter(policy, run / "adapter")
    out = tmp_path / "out"
    report = export(run, out, "vllm", dtype="float32", check=True, max_questions=QUESTIONS, max_new_tokens=TOKENS,
                    log=lambda line: None)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert report["agreement"]["differing"] == [] and report["agreement"]["questions"] == QUESTIONS
    # vLLM's dtype "auto" runs a float32 checkpoint in bfloat16: the serve lines name float32
    card = (out / "README.md").read_text()
    assert "--max-lora-rank 8 --dtype float32" in card and "max_lora_rank=8, dtype='float32')" in card
    assert "nvfp4" not in card.split("---")[1]  # the tags: a dense base
    export(run, tmp_path / "bf16", "vllm", log=lambda line: None)  # bf16: "auto" takes it as it is
    card = (tmp_path / "bf16" / "README.md").read_text()
    assert "--dtype" not in card and "max_lora_rank=8)" in card
    exported = load_file(str(out / "model.safetensors"))
    trained = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    norms = {k.removeprefix("base_model.model."): v for k, v in trained.items() if ".lora_" not in k}
    assert norms and all(torch.equal(exported[k], v) for k, v in norms.items())


def test_exports_answer_like_train_py_validate_on_the_run(tiny_run, tmp_path):
    """The issue's yardstick: the greedy completions `python train.py validate` writes for the run's adapter."""
    cli_main(["validate", "--config", str(tiny_run / "config.yaml"),
              "--model.policy.adapter", str(tiny_run / "adapter"),
              "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", "validate"])
    jsonl = next((tmp_path / "validate").rglob("val_step*.jsonl"))
    expected = [r["completion"] for r in map(json.loads, jsonl.read_text().splitlines()) if r["mode"] == "greedy"]
    trained = read_run(tiny_run)
    tokenizer = load_tokenizer(trained.policy.model)
    prompts, _ = validation_questions(trained, tokenizer)
    assert len(prompts) == len(expected) == 4
    for format in ("vllm", "merged-bf16"):
        out = tmp_path / format
        export(tiny_run, out, format, dtype="float32", check=False, log=lambda line: None)
        completions = greedy_completions(load_export(out, format), tokenizer, prompts, rollout_length(trained))
        assert tokenizer.batch_decode(completions, skip_special_tokens=True) == expected, format


# ---------------------------------------------------------------------------------------------------------------
# The agreement bound, the check's questions, and loading each format as the README says


def test_the_bound_passes_an_export_that_keeps_the_policys_answers_and_fails_the_issues_one():
    from qerl.export import Agreement

    assert not Agreement(24, 4, policy_correct=16, export_correct=6, differing=list(range(20))).passed  # issue 52
    assert Agreement(24, 10, policy_correct=16, export_correct=15, differing=list(range(14))).passed  # 15 >= 14.4
    assert not Agreement(24, 10, policy_correct=16, export_correct=14, differing=list(range(14))).passed
    assert Agreement(24, 0, policy_correct=0, export_correct=0, differing=list(range(24))).passed  # nothing to keep
    assert not Agreement(24, 20, 0, 0, list(range(4)), min_identical=0.9).passed  # 20 < 21.6 identical


def test_an_export_below_its_bound_exits_1_with_the_figures_and_its_folder_is_marked(tiny_run, tmp_path, capsys):
    out = tmp_path / "nvfp4"
    # a share of identical completions above 1 no export reaches: the failing path, whatever the completions
    code = main(["--run", str(tiny_run), "--output", str(out), "--format", "merged-nvfp4", "--max-questions",
                 str(QUESTIONS), "--max-new-tokens", str(TOKENS), "--dtype", "float32", "--min-identical", "1.01"])
    assert code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    report = json.loads((out / "export.json").read_text())["agreement"]
    assert line.startswith(f"error: --format merged-nvfp4: the export answers {report['export_correct']} of "
                           f"{QUESTIONS} check questions correctly, the trained policy {report['policy_correct']}; "
                           f"{report['same_completion']}/{QUESTIONS} completions identical: below the bound")
    assert "--format vllm keeps the LoRA in 16 bits" in line and line.endswith(f"{out} is marked (CHECK_FAILED).")
    assert report["passed"] is False and (out / "CHECK_FAILED").read_text().strip() == line.removeprefix("error: ")
    assert "Below the export's bound" in (out / "README.md").read_text()


def test_a_run_without_validation_sources_is_checked_on_its_own_training_stream(tiny_run, tmp_path):
    run = tmp_path / "version_0"
    config = yaml.safe_load((tiny_run / "config.yaml").read_text())
    del config["data"]["val_sources"]
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copytree(tiny_run / "adapter", run / "adapter")
    trained = read_run(run)
    tokenizer = load_tokenizer(trained.policy.model)
    prompts, answers = validation_questions(trained, tokenizer)
    assert len(prompts) == len(answers) == 24
    texts = tokenizer.batch_decode(prompts)
    assert all("What is" in t for t in texts) and len(set(texts)) > 1  # the run's arithmetic source, in its format


def readme_loading_code() -> dict[str, str]:
    """The README's Python blocks that load an export, keyed by the formats their first comment names."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(# --format .*?)```", readme, flags=re.S)
    return {format: block for block in blocks for format in re.findall(r"--format ([\w-]+)", block.splitlines()[0])}


@pytest.mark.parametrize("format", ["vllm", "merged-bf16", "merged-nvfp4"])
def test_every_format_loads_in_transformers_as_the_readme_says(format, tiny_run, tmp_path):
    code = readme_loading_code()
    assert set(code) == {"vllm", "merged-bf16", "merged-nvfp4"}
    out = tmp_path / format
    export(tiny_run, out, format, check=False, log=lambda line: None)
    scope = {"export": str(out)}
    exec(code[format], scope)  # the README's own lines, as a user pastes them
    model = scope["model"]
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
        expected = load_export(out, format)(input_ids=ids).logits.float()  # qerl's own loader: the NVFP4 layers
    # the same weights: the README's way decompresses NVFP4 to bf16 where qerl dequantizes in float32
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    if format == "vllm":  # the model card's transformers lines load it the same way
        import re

        card = re.findall(r"```python\n(.*?)```", (out / "README.md").read_text(), flags=re.S)[-1]
        assert "PeftModel.from_pretrained" in card
        scope = {}
        exec(card, scope)
        with torch.no_grad():
            assert torch.equal(scope["model"](input_ids=ids).logits.float(), got)
