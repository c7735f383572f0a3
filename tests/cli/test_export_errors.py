"""A failed export says the exporters' own causes (tests/cli/test_bad_inputs.py has the one-line rows); these check
what else the newcomer sees: a hint that fits the source, the exporters' tracebacks with -v, and none of torch's
own error lines ("E1201 … always_classified is unsupported.") without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_bad_inputs import FACTORY, directory_export_fails
from tests.conftest import run_cli

REPOSITORY = Path(__file__).parents[2]
TORCH_ERROR_LINE = "always_classified is unsupported"  # what torch.export's logger says as the trace fails


def test_a_directory_export_failure_hints_at_no_forward_arguments_and_v_logs_the_tracebacks(tmp_path: Path) -> None:
    result = run_cli("-v", "compile", *directory_export_fails(tmp_path), "-o", tmp_path / "out")
    assert result.exit_code == 1
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "forward()" not in line and "declares a GPT2LMHeadModel's inputs itself" in line, line
    for exporter in ("dynamo", "torchscript"):
        assert f"the {exporter} exporter's traceback" in result.stderr
    # the exporters' frames and their innermost error, not only tensorsmith's
    assert "torch/onnx/_internal/exporter/" in result.stderr and "torch/export/" in result.stderr
    assert "RuntimeError: Sizes of tensors must match" in result.stderr


def _compile_in_a_process(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """torch's loggers write to the stderr of the process that imported torch: a process of its own shows them."""
    command = [sys.executable, "-m", "tensorsmith.cli.main", *flags, "compile", FACTORY, "--input",
               "x:float32:batch,7", "-o", str(out)]  # fmt: skip
    return subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_torch_error_lines_show_with_v_only(tmp_path: Path) -> None:
    quiet = _compile_in_a_process(tmp_path / "quiet")
    assert quiet.returncode == 1 and "error: could not export" in quiet.stderr, quiet.stderr
    assert "check the declared inputs match forward()'s arguments" in quiet.stderr  # a factory's hint
    assert TORCH_ERROR_LINE not in quiet.stderr and "fake_tensor" not in quiet.stderr, quiet.stderr
    verbose = _compile_in_a_process(tmp_path / "verbose", "-v")
    assert verbose.returncode == 1 and TORCH_ERROR_LINE in verbose.stderr, verbose.stderr
