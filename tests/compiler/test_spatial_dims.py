"""An ONNX source whose spatial dims are free and constrained, like a paddle2onnx text detector (stride 32, skip
connections): compiled as written it is verified at the sizes its engines are tuned for, and `--dim` declares its
dims from the command line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tensorsmith.compiler import CompileConfig
from tensorsmith.compiler.flags import parse_dim_flag
from tensorsmith.compiler.frontend.feeds import onnx_source_outputs
from tensorsmith.compiler.frontend.source import open_source
from tensorsmith.core.errors import ConfigError
from tests.conftest import run_cli

# The names paddle2onnx writes for a detector's batch, height and width.
BATCH, HEIGHT, WIDTH = (f"p2o.DynamicDimension.{axis}" for axis in range(3))


class TinyUNet(nn.Module):
    """Five stride-2 convolutions down, five nearest ×2 upsamplings back, each concatenated with the skip of its
    size: runs only where height and width are multiples of 32."""

    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.down = nn.ModuleList(nn.Conv2d(width, width, 3, stride=2, padding=1) for _ in range(5))
        self.up = nn.ModuleList(nn.Conv2d(2 * width, width, 3, padding=1) for _ in range(5))
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        skips = []
        for conv in self.down:
            skips.append(x)
            x = torch.relu(conv(x))
        for conv, skip in zip(self.up, reversed(skips), strict=True):
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = torch.relu(conv(torch.cat([x, skip], dim=1)))
        return torch.sigmoid(self.head(x))


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("detector") / "det.onnx"
    torch.manual_seed(0)
    axes = {0: BATCH, 2: HEIGHT, 3: WIDTH}
    torch.onnx.export(
        TinyUNet().eval(), (torch.randn(1, 3, 64, 64),), str(path), dynamo=False, opset_version=17,
        input_names=["x"], output_names=["maps"], dynamic_axes={"x": axes, "maps": axes},
    )  # fmt: skip
    return path


def test_a_stride_32_detector_compiles_with_no_dims_given(detector: Path, tmp_path: Path) -> None:
    """Verified at its engines' opt (64×64, a batch kept small), not at x[3, 3, 4, 6]; the cpu timing too."""
    result = run_cli("compile", detector, "--target", "cpu", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["dims"] == {}
    assert manifest["default_dims"] == ["p2o_DynamicDimension_0", "p2o_DynamicDimension_1", "p2o_DynamicDimension_2"]
    assert manifest["variants"][0]["accuracy"]["max_relative_error"] <= 1e-4


def test_dim_flags_set_the_dims_and_verification_uses_their_opt(detector: Path, tmp_path: Path) -> None:
    """By the name as written or its identifier; opt 96 is verified as is (97 would not run)."""
    result = run_cli("compile", detector, "--target", "cpu", "-o", tmp_path / "out", "--dim", f"{HEIGHT}=32:96:128",
                     "--dim", "p2o_DynamicDimension_2=32:64:64", "--dim", f"{BATCH}=::2")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["dims"] == {
        "p2o_DynamicDimension_1": {"min": 32, "opt": 96, "max": 128},
        "p2o_DynamicDimension_2": {"min": 32, "opt": 64, "max": 64},
        "p2o_DynamicDimension_0": {"min": 1, "opt": None, "max": 2},
    }
    assert manifest["default_dims"] == []


def test_the_default_range_warning_names_the_dim_flag(detector: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        open_source(CompileConfig.create({"source": str(detector)}))
    warned = [record.getMessage() for record in caplog.records if "no range declared" in record.getMessage()]
    assert len(warned) == 1 and "--dim NAME=MIN:OPT:MAX" in warned[0] and "[dims.NAME]" in warned[0]


@pytest.mark.parametrize(
    ("value", "reason"),
    [("x=1:2", "is not NAME=MIN:OPT:MAX"), ("=1:2:3", "is not NAME=MIN:OPT:MAX"), ("x=a:2:3", "is not NAME="),
     ("x=64:32:16", "need min <= opt <= max"), ("x=0:0:4", "opt and max are at least 1")],
)  # fmt: skip
def test_a_malformed_dim_flag_is_one_line_naming_it(value: str, reason: str, detector: Path, tmp_path: Path) -> None:
    result = run_cli("compile", detector, "--dim", value, "-o", tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --dim '{value}'") and reason in line and "(hint: e.g. --dim " in line
    assert not (tmp_path / "out").exists()


def test_dim_flag_forms() -> None:
    assert parse_dim_flag("p2o.DynamicDimension.1=32:640:1280") == (HEIGHT, {"min": 32, "opt": 640, "max": 1280})
    assert parse_dim_flag("batch=::16") == ("batch", {"max": 16})
    with pytest.raises(ConfigError, match="is not NAME=MIN:OPT:MAX"):
        parse_dim_flag("batch=16")


def test_a_source_that_fails_at_the_tuned_sizes_is_verified_at_small_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """y = x + table[0:S]: a table of 16 positions takes S = 4, not the engines' opt of 64."""
    path = tmp_path / "positions.onnx"

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.table(torch.arange(x.shape[1]))

    torch.onnx.export(Positions().eval(), (torch.randn(2, 8, 4),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], dynamic_axes={"x": {0: "N", 1: "S"}})  # fmt: skip
    source = open_source(CompileConfig.create({"source": str(path)}))
    with caplog.at_level(logging.WARNING):
        run = onnx_source_outputs(source.config, onnx.load(str(path)))
    assert run.feeds["x"].shape == (3, 4, 4) and run.outputs[0].shape == (3, 4, 4) and not run.tuned
    assert np.isfinite(run.outputs[0]).all()
    assert any("fails at the sizes its engines are tuned for (x[3, 64, 4])" in r.getMessage() for r in caplog.records)
    # and the whole compile measures and times the cpu variant at the sizes verification used
    from tensorsmith.compiler import compile

    result = compile(CompileConfig.create({"source": str(path), "targets": ["cpu"]}), tmp_path / "out")
    assert result.manifest.targets[0].status == "not-needed" and result.manifest.variants[0].accuracy
