"""What `compile` and `inspect` print for people: sentences, not Python dicts or record fields; and the progress
they show while they work (a spinner line without a count on a terminal, a line now and then in a CI log)."""

from __future__ import annotations

import io
import logging
import re
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tensorsmith.cli.output import PlainReporter, RichReporter
from tests.conftest import run_cli


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
