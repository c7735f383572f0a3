"""One-pass statistics on real ONNX Runtime runs: batch-size and order independence, exact shard merging (the
power-of-two grid folds exactly as the range grows), non-finite values, and bad calibration data."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.calibration import CalibrationData, Observer, build_table, calibrate, tensors_to_observe
from tensorsmith.calibration.statistics import BINS, Statistics, TensorStatistics
from tensorsmith.calibration.thresholds import NUM_BINS
from tensorsmith.core.errors import CalibrationError
from tensorsmith.runtime.specs import TensorSpec

SPECS = [TensorSpec("x", "float32", ("batch", 16))]


class Masked(torch.nn.Module):
    """Two Linear layers, then a MatMul fed by a tensor that is mostly -inf (like an additive mask)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(16, 32)
        self.second = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(torch.relu(self.first(x)))
        mask = torch.where(x > 1.5, 0.0, float("-inf"))  # about 93% -inf
        return h + (mask @ torch.ones(16, 16)).clamp(min=-1.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    path = tmp_path_factory.mktemp("calibration") / "masked.onnx"
    torch.onnx.export(
        Masked().eval(), (torch.randn(2, 16),), str(path), dynamo=False, opset_version=17, input_names=["x"],
        dynamic_axes={"x": {0: "batch"}},
    )  # fmt: skip
    return onnx.load(str(path))


SAMPLES = np.random.default_rng(0).standard_normal((96, 16)).astype(np.float32)


def scales(model: onnx.ModelProto, samples: np.ndarray, batch_size: int) -> dict[str, float]:
    data = CalibrationData([{"x": samples}], SPECS, batch_size=batch_size)
    table = calibrate(model, data, "entropy")
    return {name: t.int8_scale for name, t in table.tensors.items()}


def test_scales_are_bit_identical_for_any_batch_size_and_order(model: onnx.ModelProto) -> None:
    reference = scales(model, SAMPLES, batch_size=8)
    assert scales(model, SAMPLES, batch_size=1) == reference
    assert scales(model, SAMPLES, batch_size=32) == reference
    assert scales(model, SAMPLES[::-1].copy(), batch_size=8) == reference


def test_shards_merge_exactly_into_the_union(model: onnx.ModelProto, tmp_path: Path) -> None:
    """Shards with different ranges (the second holds the largest values), saved and loaded as `tensorsmith
    calibrate` writes them, merge into exactly what one pass over the union gives."""
    observer = Observer(model, tensors_to_observe(model))
    scaled = SAMPLES * np.linspace(0.1, 3.0, len(SAMPLES), dtype=np.float32)[:, None]
    shard_a, shard_b = CalibrationData([{"x": scaled[:40]}], SPECS), CalibrationData([{"x": scaled[40:]}], SPECS)
    a, b = observer.collect(shard_a, channels=observer.tensors), observer.collect(shard_b, channels=observer.tensors)
    a.save(tmp_path / "a.npz", "graph")
    loaded, graph = Statistics.load(tmp_path / "a.npz")
    assert graph == "graph"
    merged = loaded.merge(b)
    whole = observer.collect(CalibrationData([{"x": scaled}], SPECS, batch_size=7), channels=observer.tensors)
    assert merged.samples == whole.samples == 96
    assert any(a.tensors[name].exponent != b.tensors[name].exponent for name in a.tensors)
    for name, statistics in whole.tensors.items():
        assert merged.tensors[name].amax == statistics.amax
        assert merged.tensors[name].count == statistics.count
        assert merged.tensors[name].nonfinite == statistics.nonfinite
        assert merged.tensors[name].exponent == statistics.exponent
        np.testing.assert_array_equal(merged.tensors[name].histogram, statistics.histogram)
        np.testing.assert_array_equal(merged.channel_amax[name], whole.channel_amax[name])


def test_a_growing_range_folds_bins_into_exactly_the_larger_range() -> None:
    values = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    growing = TensorStatistics("t")
    for part in (values[:10] * 0.01, values[10:100] * 0.5, values[100:]):
        growing.observe(part)
    once = TensorStatistics("t")
    once.observe(np.concatenate([values[:10] * 0.01, values[10:100] * 0.5, values[100:]]))
    assert growing.exponent == once.exponent and growing.amax == once.amax
    np.testing.assert_array_equal(growing.histogram, once.histogram)
    bins, covered = once.threshold_histogram()
    assert NUM_BINS <= len(bins) <= BINS and covered >= once.amax > covered - covered / len(bins)


def test_a_mostly_nonfinite_tensor_is_reported_and_left_unquantized(model: onnx.ModelProto) -> None:
    data = CalibrationData([{"x": SAMPLES}], SPECS)
    table = calibrate(model, data, "entropy")
    masked = [t for t in table.tensors.values() if t.nonfinite]
    assert len(masked) == 1
    assert not masked[0].quantize and "not finite" in masked[0].reason
    assert masked[0].name not in table.int8_scales()
    assert all(t.quantize for t in table.tensors.values() if not t.nonfinite)


def test_statistics_exclude_nonfinite_values() -> None:
    statistics = TensorStatistics("t")
    values = np.array([1.0, -3.0, np.inf, -np.inf, np.nan, 2.0, 0.0], np.float32)
    statistics.observe(values)
    assert statistics.amax == 3.0 and statistics.count == 4 and statistics.nonfinite == 3
    bins, covered = statistics.threshold_histogram()
    assert statistics.exponent == 2 and covered >= 3.0  # [0, 4): 3.0 lands in bin 3072 of 4096
    assert bins.sum() == 4 and bins[-1] == 1 and bins[0] == 1


def test_calibration_table_methods(model: onnx.ModelProto) -> None:
    observer = Observer(model, tensors_to_observe(model))
    statistics = observer.collect(CalibrationData([{"x": SAMPLES}], SPECS))
    tables = {method: build_table(statistics.tensors, method, 96) for method in ("entropy", "percentile", "minmax")}
    for name in tables["minmax"].tensors:
        minmax = tables["minmax"].tensors[name]
        assert minmax.threshold == minmax.amax
        assert tables["entropy"].tensors[name].threshold <= minmax.amax
        assert tables["percentile"].tensors[name].threshold <= minmax.amax
        assert minmax.fp8_scale == pytest.approx(minmax.amax / 448)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"y": np.zeros((4, 16), np.float32)}, r"do not match the model's inputs \['x'\] \(missing \['x'\]\)"),
        ({"x": np.zeros((4, 16), np.float64)}, "array 'x' is float64, the input is x:float32"),
        ({"x": np.zeros((4, 8), np.float32)}, "array 'x' has size 8 on axis 1"),
        ({"x": np.zeros(16, np.float32)}, "array 'x' has shape \\[16\\]"),
        ({"x": np.full((4, 16), np.nan, np.float32)}, "array 'x' holds no finite value"),
        ({"x": np.zeros((0, 16), np.float32)}, "holds no samples"),
    ],
)
def test_bad_calibration_data_names_the_file_and_array(tmp_path: Path, arrays: dict, message: str) -> None:
    path = tmp_path / "calibration.npz"
    np.savez(path, **arrays)
    with pytest.raises(CalibrationError, match=message) as caught:
        list(CalibrationData(path, SPECS).batches())
    assert str(path) in str(caught.value)


def test_missing_data_and_empty_folders(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="does not exist"):
        list(CalibrationData(tmp_path / "none.npz", SPECS).batches())
    with pytest.raises(CalibrationError, match="holds no .npz files"):
        list(CalibrationData(tmp_path, SPECS).batches())


def test_a_folder_of_files_and_a_sample_cap(tmp_path: Path) -> None:
    for index in range(3):
        np.savez(tmp_path / f"part{index}.npz", x=np.full((10, 16), index, np.float32))
    data = CalibrationData(tmp_path, SPECS, batch_size=4, limit=25)
    batches = list(data.batches())
    assert sum(len(batch["x"]) for batch in batches) == 25
    assert max(len(batch["x"]) for batch in batches) == 4
