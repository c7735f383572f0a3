"""Calibration at scale: statistics of shards (files, and Ray tasks on a local Ray) merge into exactly what one
process collects, and `compile --calibration-stats` gives the same scales and the same variant bytes as a compile
that reads the data; statistics of another graph are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorsmith.calibration.statistics import Statistics
from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.calibrate import calibrate
from tensorsmith.core.errors import CalibrationError
from tests.conftest import run_cli


class Block(torch.nn.Module):
    """A transformer MLP block: LayerNorm → Linear → GELU → Linear, with one loud channel (what smoothing is for)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(32)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        with torch.no_grad():
            self.norm.weight[3] = 8.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """The block as an ONNX file, 96 calibration samples (batches of 16 line up with 4 shards of 24) and 16
    held-out ones."""
    folder = tmp_path_factory.mktemp("block")
    path = folder / "block.onnx"
    torch.onnx.export(Block().eval(), (torch.randn(2, 8, 32),), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    rng = np.random.default_rng(0)
    np.savez(folder / "calibration.npz", x=rng.standard_normal((96, 8, 32)).astype(np.float32))
    np.savez(folder / "evaluation.npz", x=rng.standard_normal((16, 8, 32)).astype(np.float32))
    return path, folder / "calibration.npz", folder / "evaluation.npz"


def _config(block: tuple[Path, Path, Path], **fields: object) -> CompileConfig:
    path, calibration, evaluation = block
    values = {"source": str(path), "precision": "int8", "calibration_batch_size": 8, "evaluation": str(evaluation),
              "calibration": str(calibration), **fields}  # fmt: skip
    return CompileConfig.create({key: value for key, value in values.items() if value is not None})


def test_shard_files_merge_into_the_unsharded_compile(block: tuple[Path, Path, Path], tmp_path: Path) -> None:
    whole = compile(_config(block), tmp_path / "whole")
    for index in range(4):
        result = calibrate(_config(block), tmp_path / "stats" / f"shard{index}.npz", (index, 4))
        assert result.samples == 24 and result.graph_sha256 == whole.manifest.model.sha256
    merged = compile(_config(block, calibration=None, calibration_stats=str(tmp_path / "stats" / "*.npz")),
                     tmp_path / "merged")  # fmt: skip
    expected = json.loads((tmp_path / "whole" / "calibration.json").read_text())
    actual = json.loads((tmp_path / "merged" / "calibration.json").read_text())
    assert actual["samples"] == expected["samples"] == 96
    assert {name: t["int8_scale"] for name, t in actual["tensors"].items()} == {
        name: t["int8_scale"] for name, t in expected["tensors"].items()
    }
    assert any(t["note"] for t in actual["tensors"].values())  # the smoothed activation: its amax, derived
    variants = {v.name: v.sha256 for v in whole.manifest.variants}
    assert {v.name: v.sha256 for v in merged.manifest.variants} == variants and "cpu-int8" in variants


@pytest.mark.slow
def test_ray_tasks_give_the_statistics_of_one_process(block: tuple[Path, Path, Path], tmp_path: Path) -> None:
    import ray

    from tensorsmith.compiler.calibrate import calibrate_on_ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        distributed = calibrate_on_ray(_config(block), tmp_path / "ray.npz", shards=4)
    finally:
        ray.shutdown()
    single = calibrate(_config(block), tmp_path / "one.npz")
    assert distributed.graph_sha256 == single.graph_sha256 and distributed.samples == single.samples == 96
    (a, _), (b, _) = Statistics.load(tmp_path / "ray.npz"), Statistics.load(tmp_path / "one.npz")
    assert set(a.tensors) == set(b.tensors) and set(a.channel_amax) == set(b.channel_amax)
    for name, statistics in b.tensors.items():
        assert (a.tensors[name].amax, a.tensors[name].exponent) == (statistics.amax, statistics.exponent)
        np.testing.assert_array_equal(a.tensors[name].histogram, statistics.histogram)
    for name, amax in b.channel_amax.items():
        np.testing.assert_array_equal(a.channel_amax[name], amax)


def test_statistics_of_another_graph_are_refused(block: tuple[Path, Path, Path], tmp_path: Path) -> None:
    calibrate(_config(block, opset=18), tmp_path / "stats.npz")
    config = _config(block, calibration=None, calibration_stats=str(tmp_path / "stats.npz"))
    with pytest.raises(CalibrationError, match="collected on another graph"):
        compile(config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_calibrate_command_writes_a_shard(block: tuple[Path, Path, Path], tmp_path: Path) -> None:
    path, calibration, _ = block
    out = tmp_path / "s.npz"
    result = run_cli("calibrate", str(path), "--calibration", str(calibration), "--shard", "1/3", "-o", str(out),
                     "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["samples"] == 32 and summary["shard"] == [1, 3] and out.is_file()
    bad = run_cli("calibrate", str(path), "--calibration", str(calibration), "--shard", "3/3", "-o", str(out))
    assert bad.exit_code == 1 and "--shard 3/3: I must be in 0..2" in bad.output
