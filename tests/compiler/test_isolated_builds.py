"""Engine builds run in a child process (compiler/engines/isolated.py): what its native libraries print themselves
is logged, never written raw on the user's console."""

from __future__ import annotations

import logging
import os

import pytest

from tensorsmith.compiler.engines.isolated import run_isolated


def test_what_the_child_prints_itself_is_logged_not_shown(capfd: pytest.CaptureFixture[str],
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """TensorRT for RTX prints some warnings on the process's own stdout and stderr, past its logger."""
    caplog.set_level(logging.INFO, logger="tensorsmith")
    printed = "echo WARNING: printed on stdout; echo WARNING: printed on stderr >&2"
    assert run_isolated(os.system, (printed,), "building x.onnx for sm_86") == 0
    shown = capfd.readouterr()
    assert "printed" not in shown.out + shown.err
    logged = {record.getMessage() for record in caplog.records if record.levelno == logging.INFO}
    assert {f"building x.onnx for sm_86: WARNING: printed on {stream}" for stream in ("stdout", "stderr")} <= logged
