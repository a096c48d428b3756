"""docs/performance.md is what docs/make_performance.py writes from bench/results/*.json (so its figures cannot drift
from the results), and new results files land in their benchmark's section without editing the page by hand."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_performance", ROOT / "docs" / "make_performance.py")
make_performance = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("make_performance", make_performance)  # dataclasses look their module up there
_spec.loader.exec_module(make_performance)


def section(page: str, title: str) -> str:
    """The text of one '## title' section of the page."""
    start = page.index(f"\n## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start:end if end != -1 else None]


def test_committed_page_is_what_the_committed_results_give():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert make_performance.render(ROOT / "bench" / "results") == page, (
        "docs/performance.md is out of date: run python docs/make_performance.py and commit the page")


def test_every_results_file_is_on_the_page_with_its_device_date_and_command():
    page = (ROOT / "docs" / "performance.md").read_text()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        result = json.loads(path.read_text())
        line = next(line for line in page.splitlines() if line.startswith(f"`{path.name}`: "))
        command = result.get("command", make_performance.section_of(path.name).command)
        assert result["device"] in line and str(result.get("date", "undated"))[:10] in line and command in line


def test_committed_plots_show_the_committed_results():
    page = (ROOT / "docs" / "performance.md").read_text()
    specs = make_performance.plot_specs(ROOT / "bench" / "results")
    assert {f"performance/{n}_h100.png" for n in ("kernel", "gemv", "rollout", "train_e2e")} <= set(specs)
    for name in specs:
        assert f"]({name})" in page
    assert make_performance.stale_plots(ROOT / "bench" / "results", ROOT / "docs" / "performance.md") == []


def test_a_changed_result_makes_its_plot_stale(results, tmp_path_factory):
    docs = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "docs" / "performance", docs / "performance")
    page = docs / "performance.md"
    assert make_performance.stale_plots(results, page) == []
    changed = json.loads((results / "train_e2e_h100.json").read_text())
    changed["rows"][0]["step_s_nvfp4"] = 30.0
    (results / "train_e2e_h100.json").write_text(json.dumps(changed))
    assert make_performance.stale_plots(results, page) == [docs / "performance" / "train_e2e_h100.png"]
    with pytest.raises(ValueError, match="not a PNG"):
        make_performance.png_text(results / "train_e2e_h100.json")


def test_headlines_name_the_file_they_come_from():
    glance = section((ROOT / "docs" / "performance.md").read_text(), "At a glance")
    for name in ("kernel_h100.json", "rollout_h100.json", "train_e2e_h100.json"):
        assert f"(`{name}`)" in glance


def test_rollout_table_shows_each_rows_own_figures():
    page = (ROOT / "docs" / "performance.md").read_text()
    rows = json.loads((ROOT / "bench" / "results" / "rollout_h100.json").read_text())["rows"]
    text = section(page, "Rollout: decode speed, NVFP4 vs bf16")
    for r in rows:
        line = next(line for line in text.splitlines()
                    if line.startswith(f"| {r['model']} | {r['lora_rank']} | {r['batch']} |"))
        assert f"| {r['ms_step_nvfp4']:.2f} |" in line
        if r["ms_step_bf16"]:
            assert f"| {r['ms_step_bf16']:.2f} | {r['ms_step_bf16'] / r['ms_step_nvfp4']:.2f} |" in line


def cells_of(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.fixture
def results(tmp_path) -> Path:
    """A results directory holding a copy of the committed end-to-end result."""
    shutil.copy(ROOT / "bench" / "results" / "train_e2e_h100.json", tmp_path / "train_e2e_h100.json")
    return tmp_path


def test_new_end_to_end_keys_and_a_memory_file_are_rendered_without_editing_the_script(results):
    new = {"device": "NVIDIA H200", "date": "2026-12-01T10:00:00", "command": "python bench/bench_train_e2e.py --x",
           "rows": [{"model": "qwen2.5-7b", "prompts": 16, "group_size": 8, "new_tokens": 2048,
                     "lengths": "lognormal", "step_s_nvfp4": 31.5, "step_s_bf16": 47.25, "step_s_qlora": 190.0,
                     "update_s_nvfp4": 20.0, "update_s_bf16": 30.0, "step_bf16_over_nvfp4": 1.5,
                     "lengths_drawn": [400, 812]}]}
    (results / "train_e2e_h200.json").write_text(json.dumps(new))
    memory = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-02", "command": "python bench/bench_memory.py",
              "rows": [{"model": "qwen2.5-32b", "peak_gb": 71.25, "peak_gb_rollout": 60.5, "peak_gb_update": 71.25,
                        "step_s": 88.0}]}
    (results / "train_e2e_memory_h100.json").write_text(json.dumps(memory))
    page = make_performance.render(results)

    e2e = section(page, "End to end: one GRPO step")
    assert "`train_e2e_h200.json`: NVIDIA H200, 2026-12-01" in e2e and "`python bench/bench_train_e2e.py --x`" in e2e
    header = next(line for line in e2e.splitlines() if line.startswith("| model | prompts") and "qlora" in line)
    row = next(line for line in e2e.splitlines() if "lognormal" in line)
    cells = dict(zip(cells_of(header), cells_of(row)))
    assert cells["step s (nvfp4 / bf16 / qlora)"] == "31.50 / 47.25 / 190.00"
    assert cells["update s (nvfp4 / bf16 / qlora)"] == "20.00 / 30.00 / -"
    assert cells["step bf16 / nvfp4"] == "1.50" and cells["lengths"] == "lognormal"
    assert "lengths drawn" not in header  # lists and objects stay in the file
    assert "train_e2e_memory_h100.json" not in e2e  # the memory file has its own section

    mem = section(page, "Memory")
    assert "`train_e2e_memory_h100.json`: NVIDIA H100 80GB HBM3, 2026-12-02" in mem
    assert "| model | peak GB | peak GB rollout | peak GB update | step s |" in mem
    assert "| qwen2.5-32b | 71.25 | 60.50 | 71.25 | 88.00 |" in mem
    assert "GRPO step, 16 prompts x 8, 2048 new tokens (lognormal lengths): NVFP4 31.5 s vs bf16 47.2 s" in section(
        page, "At a glance")


def test_a_file_no_section_can_render_is_an_error_naming_it(results):
    (results / "mystery_h100.json").write_text(json.dumps({"device": "x", "value": 3}))
    with pytest.raises(ValueError, match="mystery_h100.json.*add a section"):
        make_performance.render(results)


def test_a_results_file_missing_a_field_is_an_error_naming_the_file_and_field(results):
    broken = json.loads((results / "train_e2e_h100.json").read_text())
    rollout = {"device": "x", "date": "2026-12-01", "rows": broken["rows"]}  # end-to-end rows in a rollout file
    (results / "rollout_h100.json").write_text(json.dumps(rollout))
    with pytest.raises(ValueError, match="rollout_h100.json: missing or malformed field 'lora_rank'"):
        make_performance.render(results)


def test_unknown_files_with_rows_get_a_plain_table(results):
    (results / "new_bench_h100.json").write_text(json.dumps(
        {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-03", "command": "python bench/new.py",
         "rows": [{"batch": 4, "ms": 1.25, "nested": {"skip": 1}}, {"batch": 8, "ms": 2.5, "note": "a|b"}]}))
    text = section(make_performance.render(results), "Other results")
    assert "| batch | ms | note |" in text and "| 4 | 1.25 | - |" in text and "| 8 | 2.50 | a/b |" in text


def test_check_mode_reports_a_stale_page(results, tmp_path_factory, capsys):
    page = tmp_path_factory.mktemp("page") / "performance.md"
    shutil.copytree(ROOT / "docs" / "performance", page.parent / "performance")  # the plots, current for `results`
    assert make_performance.main(["--results", str(results), "--page", str(page)]) == 0
    assert make_performance.main(["--results", str(results), "--page", str(page), "--check"]) == 0
    page.write_text(page.read_text() + "\nedited by hand\n")
    assert make_performance.main(["--results", str(results), "--page", str(page), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_trl_peer_parts_merge_into_a_table_with_ratios_a_headline_and_a_plot(results, tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bench_trl_peer", ROOT / "bench" / "bench_trl_peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    parts = tmp_path_factory.mktemp("parts")
    settings = {"model": "qwen2.5-7b", "prompts": 16, "group_size": 8, "new_tokens": 2048, "lengths": "fixed",
                "steps": 3, "lora_rank": 16, "trl_micro_batch": 8, "qerl_micro_batch_tokens": "auto"}
    common = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-27T01:00:00", "settings": settings}
    arms = {"trl": {"rollout_s": 40.0, "generate_s": 32.0, "train_s": 35.0, "step_s": 75.0, "peak_gb": 50.5,
                    "base_drift": 2.5e-4, "config": {"use_vllm": True},
                    "trl_logs": [{"sampling/sampling_logp_difference/mean": g, "grad_norm": n,
                                  "sampling/importance_sampling_ratio/mean": w}
                                 for g, n, w in ((0.0029, 0.0, 0.0), (0.0031, 0.04, 0.25), (0.0035, 0.05, 0.5))]
                    + [{"train_runtime": 9.0}]},
            "qerl_nvfp4": {"rollout_s": 20.0, "train_s": 15.0, "step_s": 35.0, "peak_gb": 60.25,
                           "kept_from": "bench/results/trl_peer_h100.json", "date": "2026-11-26T09:00:00"},
            "trl_qlora": {"error": "ValueError: vLLM cannot load 4-bit | merged weights"},
            "qerl_bf16": {"rollout_s": 21.0, "train_s": 14.0, "step_s": 35.0, "settings": {**settings, "steps": 2}}}
    for arm, result in arms.items():
        (parts / f"{arm}.json").write_text(json.dumps({**common, **result}))
    report = peer.merge(parts, settings)
    assert [r["arm"] for r in report["rows"]] == ["trl", "trl_qlora", "qerl_nvfp4"]  # qerl_bf16: other settings
    report["command"] = peer.command_for(report["runs"], ["--tokenizer", ".tok", "--arms", "trl"])
    assert report["command"] == "python bench/bench_trl_peer.py --tokenizer .tok --arms trl,trl_qlora,qerl_nvfp4"
    (results / "trl_peer_h100.json").write_text(json.dumps(report))
    page = make_performance.render(results)

    text = section(page, "Against TRL: GRPOTrainer with a colocated vLLM")
    assert f"`trl_peer_h100.json`: NVIDIA H100 80GB HBM3, 2026-11-27. Reproduce: `{report['command']}`" in text
    header = next(line for line in text.splitlines() if line.startswith("| arm |"))
    cells = {row[0]: dict(zip(cells_of(header), row)) for row in
             (cells_of(line) for line in text.splitlines() if line.startswith("| trl") or line.startswith("| qerl"))}
    assert cells["trl"]["step s"] == "75.00" and cells["trl"]["of which sampling s"] == "32.00"
    assert cells["trl"]["step / qerl NVFP4 step"] == "2.14" and cells["qerl_nvfp4"]["step / qerl NVFP4 step"] == "1.00"
    assert cells["trl_qlora"]["failed with"] == "ValueError: vLLM cannot load 4-bit / merged weights"
    assert cells["trl_qlora"]["step s"] == "-"
    assert ("Carried over from an earlier machine's report (`--keep`), with the date each was measured: qerl_nvfp4 "
            "2026-11-26 on NVIDIA H100 80GB HBM3.") in text
    assert cells["trl"]["vLLM log-prob gap"] == "0.0031" and cells["trl"]["base drift"] == "2.5e-04"  # medians
    assert cells["trl"]["TRL's IS weight"] == "0.250" and cells["trl"]["grad norm"] == "0.0400"
    assert cells["qerl_nvfp4"]["TRL's IS weight"] == "-" and cells["qerl_nvfp4"]["grad norm"] == "-"
    assert cells["qerl_nvfp4"]["vLLM log-prob gap"] == "-" and cells["qerl_nvfp4"]["base drift"] == "-"
    assert ("qwen2.5-7b GRPO step, 16 prompts x 8, 2048 new tokens: qerl NVFP4 35.0 s vs TRL GRPOTrainer + vLLM 75.0 s "
            "(2.14x) (`trl_peer_h100.json`)") in section(page, "At a glance")
    plot = make_performance.plot_specs(results)["performance/trl_peer_h100.png"]
    assert plot["categories"] == ["rollout", "train", "step"]
    assert {s["label"]: s["y"] for s in plot["series"]} == {
        "TRL vLLM colocate bf16": [40.0, 35.0, 75.0], "qerl CUDA-graph engine nvfp4": [20.0, 15.0, 35.0]}
    assert "](performance/trl_peer_h100.png)" in text


def test_decode_peer_parts_merge_into_ms_per_step_per_row_count_with_ratios_a_headline_and_a_plot(results, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_decode_peer", ROOT / "bench" / "bench_decode_peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    parts = tmp_path / "parts"
    parts.mkdir()
    settings = {"model": "qwen2.5-7b", "rows": [1, 128], "prompt": 256, "short": 64, "long": 320, "lora_rank": 16,
                "group_size": "min(8, rows)"}
    common = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-28T01:00:00", "settings": settings}
    arms = {"vllm_nvfp4": {"rows": {"1": {"ms_step": 5.0}, "128": {"ms_step": 15.6}},
                           "linear": "CompressedTensorsLinearMethod / MarlinNvFp4"},
            "vllm_bf16": {"rows": {"1": {"ms_step": 7.5}, "128": {"ms_step": 13.6}}},
            "qerl_nvfp4": {"rows": {"1": {"ms_step": 2.5}, "128": {"ms_step": 10.4}}},
            "qerl_bf16": {"error": "OutOfMemoryError: CUDA out of memory"},
            "qerl_bf16_old": {"rows": {"1": {"ms_step": 1.0}}}}  # not an arm's name: ignored
    for arm, result in arms.items():
        (parts / f"{arm}.json").write_text(json.dumps({**common, **result}))
    report = peer.merge(parts, settings)
    other = tmp_path / "other"
    other.mkdir()
    (other / "vllm_bf16.json").write_text(json.dumps({**common, **arms["vllm_bf16"],
                                                      "settings": {**settings, "long": 512}}))
    assert "ms_step_vllm_bf16" not in peer.merge(other, settings)["rows"][0]  # run at other settings: not merged
    assert [r["rows"] for r in report["rows"]] == [1, 128]
    assert report["rows"][1]["vllm_nvfp4_over_qerl_nvfp4"] == pytest.approx(1.5)
    assert "qerl_bf16_over_qerl_nvfp4" not in report["rows"][1]  # the failed arm has no figure
    report["command"] = "python bench/bench_decode_peer.py --tokenizer DIR --out bench/results"
    (results / "decode_peer_h100.json").write_text(json.dumps(report))
    page = make_performance.render(results)

    text = section(page, "Against vLLM: the decode step alone")
    header = next(line for line in text.splitlines() if line.startswith("| rows |"))
    cells = {row[0]: dict(zip(cells_of(header), row)) for row in
             (cells_of(line) for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 128 "))}
    assert cells["1"]["vLLM NVFP4 ms"] == "5.00" and cells["1"]["qerl NVFP4 ms"] == "2.50"
    assert cells["1"]["vLLM NVFP4 / qerl NVFP4"] == "2.00" and cells["128"]["vLLM bf16 / vLLM NVFP4"] == "0.87"
    assert cells["128"]["qerl bf16 ms"] == "-" and cells["128"]["vLLM bf16 / qerl bf16"] == "-"
    assert "qerl_bf16 failed: OutOfMemoryError: CUDA out of memory" in text
    assert "vllm_nvfp4 `CompressedTensorsLinearMethod / MarlinNvFp4`" in text
    assert "context 320-576" in text
    assert ("qwen2.5-7b decode step with LoRA r16, vLLM's time / qerl's: NVFP4 2.00x at 1 rows, NVFP4 1.50x at 128 "
            "rows (`decode_peer_h100.json`)") in section(page, "At a glance")
    plot = make_performance.plot_specs(results)["performance/decode_peer_h100.png"]
    assert {s["label"]: (s["x"], s["y"]) for s in plot["series"]} == {
        "vLLM NVFP4": ([1, 128], [5.0, 15.6]), "vLLM bf16": ([1, 128], [7.5, 13.6]),
        "qerl NVFP4": ([1, 128], [2.5, 10.4])}
