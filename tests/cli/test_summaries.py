"""What `compile` and `inspect` print for people: sentences, not Python dicts or record fields; and the progress
they show while they work (a spinner line without a count on a terminal, a line now and then in a CI log)."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from tensorsmith.cli.output import PlainReporter, RichReporter
from tests.conftest import run_cli, run_cli_json


def block_onnx(path: Path) -> Path:
    """TorchScript's export at opset 17: LayerNormalization written by the exporter, GELU decomposed (Erf)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                 torch.nn.Linear(64, 16)).eval()  # fmt: skip
    torch.onnx.export(module, (torch.randn(2, 64),), str(path), dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"])  # fmt: skip
    return path


def test_an_int4_compile_and_its_inspect_read_as_sentences(tmp_path: Path) -> None:
    out = tmp_path / "out"
    flags = ["--precision", "int4", "--int4-algorithm", "rtn", "--target", "cpu", "--target", "sm_86"]
    result = run_cli("compile", block_onnx(tmp_path / "block.onnx"), "--input", "x:float32:batch,64", "-o", out, *flags)
    assert result.exit_code == 0, result.stderr
    printed = result.stdout
    assert "source: an ONNX file at opset 17, compiled at opset 21" in printed
    (fuse,) = [line for line in printed.splitlines() if line.startswith("  pass fuse: ")]
    assert "1 LayerNorm written by the exporter already" in fuse and "1 GELU (erf) fused" in fuse
    assert "pass fold_attention_scale: found no attention scales" in printed
    # each variant's passes say which variant they wrote
    assert re.search(r"pass weight_only_int4, for variant cpu-int4: 2 matmuls quantized", printed), printed
    assert re.search(r"pass weight_only_int4, for variant int4: 2 matmuls quantized", printed), printed
    assert re.search(r"target cpu: variant cpu-int4 runs on (ONNX Runtime|OpenVINO), no engine to build", printed)
    for raw in ("{'", "exporter: none", "not-needed", " via "):
        assert raw not in printed, printed
    assert "pass weight_only_int4, for variant int4" in (out / "report.html").read_text()  # its pipeline table

    inspected = run_cli("inspect", out)
    assert inspected.exit_code == 0, inspected.stderr
    assert "source: an ONNX file at opset 17, compiled at opset 21" in inspected.stdout
    assert "target sm_86: variant int4 built with tensorrt-rtx" in inspected.stdout
    assert "()" not in inspected.stdout and "changed=" not in inspected.stdout


def test_a_stage_on_a_terminal_shows_no_count_and_a_counted_task_does() -> None:
    screen = io.StringIO()
    with RichReporter(Console(file=screen, force_terminal=True, width=100)) as reporter:
        reporter.stage("exporting the model")
        with reporter.task("calibrating", 4) as advance:
            advance(1)
            time.sleep(0.3)  # rich refreshes the lines 10 times a second
    assert "exporting the model" in screen.getvalue() and "1/4" in screen.getvalue()
    assert "0/?" not in screen.getvalue()


def test_a_long_stage_off_a_terminal_logs_that_it_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tensorsmith.progress"), PlainReporter(first_beat=0.05) as reporter:
        reporter.stage("exporting the model")
        time.sleep(0.3)  # beats at 0.05 s and 0.15 s (the waits double)
        reporter.stage("running graph passes")
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "exporting the model" and lines[-1] == "running graph passes"
    assert all(re.fullmatch(r"exporting the model: still running \(\d+ s\)", line) for line in lines[1:-1])
    assert len(lines) >= 3


def test_a_long_counted_step_off_a_terminal_says_how_far_and_how_long_is_left(caplog: pytest.LogCaptureFixture) -> None:
    """AWQ's search at 8B runs for half an hour under one stage: its beat names the task, its count and the time
    left at the rate so far."""
    with caplog.at_level(logging.INFO, logger="tensorsmith.progress"), PlainReporter(first_beat=0.05) as reporter:
        reporter.stage("int4 awq")
        with reporter.task("scale and clipping search", 4) as advance:
            advance(1)
            time.sleep(0.2)
    lines = [record.getMessage() for record in caplog.records]
    assert any(
        re.fullmatch(r"int4 awq: still running \(\d+ s; scale and clipping search 1/4, about \d+ s left\)", line)
        for line in lines
    ), lines
    assert lines[-1] == "scale and clipping search: 1/4 done"


def test_targets_that_did_not_build_say_why_in_a_sentence() -> None:
    from tensorsmith.compiler.report.summary import target_sentence
    from tensorsmith.runtime.manifest import TargetRecord

    pending = TargetRecord(name="sm_90", variant="fp16", builder="tensorrt", status="pending",
                           reason="TensorRT is not installed: run `tensorsmith build OUT --target sm_90`")  # fmt: skip
    failed = TargetRecord(name="sm_75", variant="fp16", builder="tensorrt-rtx", status="failed", reason="out of memory")
    assert target_sentence(pending) == (
        "sm_90: variant fp16, engine pending: TensorRT is not installed: run `tensorsmith build OUT --target sm_90`"
    )
    assert target_sentence(failed) == "sm_75: variant fp16, the tensorrt-rtx build failed: out of memory"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen2 of hidden 64 whose MLP width 120 is no multiple of 16 (INT4's smallest block): its down_proj stays in
    float, the other weight MatMuls take INT4 in blocks of 64; token ids to calibrate and evaluate on beside it."""
    import transformers

    from tests.compiler.test_decoders import COMMON, DECODER

    directory = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**DECODER, "intermediate_size": 120}, **COMMON))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.15)  # as test_decoders does: greedy choices that are not near-ties
    model.eval().save_pretrained(str(directory / "checkpoint"))
    for name, seed in (("tokens", 0), ("evaluation", 1)):
        ids = np.random.default_rng(seed).integers(3, COMMON["vocab_size"], (8, 32)).astype(np.int64)
        np.savez(directory / f"{name}.npz", input_ids=ids)
    return directory


def _variant_line(printed: str, name: str) -> str:
    (line,) = [line for line in printed.splitlines() if line.startswith(f"  variant {name} (")]
    return line


@pytest.mark.slow
def test_int4_on_a_small_decoder_says_what_went_to_int4_and_why_the_rest_did_not(qwen2: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_cli("compile", qwen2 / "checkpoint", "-o", out, "--precision", "int4", "--int4-algorithm", "rtn",
                     "--target", "cpu")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    recipe = json.loads((out / "precision.json").read_text())["recipes"]["cpu-int4"]
    layers = recipe["layers"]
    int4 = [layer for layer in layers if layer["precision"] == "int4"]
    floats = [layer for layer in layers if layer["precision"] == "fp32"]
    assert len(int4) + len(floats) == len(layers) and len(floats) == 2  # the two down_proj
    line = _variant_line(result.stdout, "cpu-int4")
    pattern = r"; (\d+) of (\d+) weight MatMuls in int4 \((\d+) % of their FLOPs\), (\d+) in fp32 \((\d+) %\): "
    shares = re.search(pattern, line)
    assert shares is not None, line
    assert [int(group) for group in shares.groups()] == [
        len(int4), len(layers), round(100 * recipe["quantized_flops_fraction"]), len(floats),
        round(100 * (1 - recipe["quantized_flops_fraction"])),
    ]  # fmt: skip
    # each float layer named, with its reason from precision.json
    reason = floats[0]["reason"]
    assert "is not a multiple of 16" in reason and {layer["reason"] for layer in floats} == {reason}
    assert line.endswith(f": {floats[0]['module']}, {floats[1]['module']} ({reason})"), line
    # the pass's counts are precision.json's: the float layers skipped, not only the named weights it refused
    assert f"pass weight_only_int4, for variant cpu-int4: {len(int4)} matmuls quantized, 0 activations scaled, " \
        f"{len(floats)} skipped" in result.stdout  # fmt: skip
    assert _variant_line(run_cli("inspect", out).stdout, "cpu-int4") == line


@pytest.mark.slow
def test_a_budget_no_quantized_layer_meets_says_the_variant_holds_none(qwen2: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    compiled = run_cli_json(
        "compile", qwen2 / "checkpoint", "-o", out, "--precision", "auto", "--budget", "max-abs<=0.000001",
        "--calibration", qwen2 / "tokens.npz", "--eval-data", qwen2 / "evaluation.npz", "--target", "cpu",
    )  # fmt: skip
    assert compiled["ok"] and "passes" in compiled  # the manifest's keys kept
    layers = json.loads((out / "precision.json").read_text())["recipes"]["cpu-int4"]["layers"]
    assert {layer["precision"] for layer in layers} == {"fp32"}
    (said,) = compiled["unquantized_variants"].values()
    assert list(compiled["unquantized_variants"]) == ["cpu-int4"]
    assert said.startswith(f"no layer in int4: all {len(layers)} weight MatMuls in fp32: "), said
    assert "budget leaves, under max-abs<=1e-06)" in said and "is not a multiple of 16" in said  # both reasons
    assert _variant_line(run_cli("inspect", out).stdout, "cpu-int4").endswith(f"; {said}")


def test_layer_shares_count_each_precision_and_group_the_float_reasons() -> None:
    from tensorsmith.compiler.report.summary import layer_sentence
    from tensorsmith.compiler.variants.precision_plan import LayerChoice, RecipePlan

    def row(index: int, precision: str, reason: str, flops: int = 100) -> LayerChoice:
        return LayerChoice(name=f"MatMul_{index}", module=f"layers.{index}.mlp", op="MatMul", flops=flops,
                           precision=precision, reason=reason)  # fmt: skip

    given_back = "search: given back, the verified variant missed the budget with it"
    rows = [row(0, "int4", "search: move 1", 400), row(1, "int4", "search: move 2", 400), row(2, "int8-weight",
            "search: move 3"), *(row(index, "fp16", given_back) for index in range(3, 8)),
            row(8, "fp16", "override '*lm_head'", 1)]  # fmt: skip
    recipe = RecipePlan(precision="int4", float_regions="fp16", met=True, quantized_flops_fraction=0.59,
                        evaluations=1, embeddings="", layers=rows)  # fmt: skip
    assert layer_sentence(recipe, "perplexity-ratio<=1.01") == (
        "2 of 9 weight MatMuls in int4 (57 % of their FLOPs), 1 in int8-weight (7 %), 6 in fp16 (36 %): "
        f"layers.3.mlp, layers.4.mlp, layers.5.mlp and 2 more ({given_back}, under perplexity-ratio<=1.01); "
        "layers.8.mlp (override '*lm_head')"
    )
    kept = recipe.model_copy(update={"layers": [row(index, "fp16", given_back) for index in range(4)]})
    assert layer_sentence(kept, "perplexity-ratio<=1.01") == (
        "no layer in int4: the budget perplexity-ratio<=1.01 kept all 4 in fp16"
    )
