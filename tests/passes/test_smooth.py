"""SmoothQuant scaling: the same function in fp32, and a better int8 model when activations have outliers."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from tensorsmith.calibration import CalibrationData, Observer, calibrate
from tensorsmith.core.metrics import mean_cosine
from tensorsmith.passes.quantize import InsertQDQ
from tensorsmith.passes.smooth import SmoothActivations, smoothable_activations
from tensorsmith.runtime.specs import TensorSpec
from tests.passes.graphs import apply, ops, run_onnx

SPECS = [TensorSpec("x", "float32", ("batch", 4, 32))]  # 3-D, so Linear exports as MatMul
OUTLIERS = np.ones(32, np.float32)
OUTLIERS[[3, 17]] = 40.0  # two channels far larger than the rest, as after a transformer's LayerNorm
SAMPLES = (np.random.default_rng(0).standard_normal((128, 4, 32)) * OUTLIERS).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    path = tmp_path_factory.mktemp("smooth") / "mlp.onnx"
    program = torch.onnx.export(
        module, (torch.from_numpy(SAMPLES[:2]),), dynamo=True, input_names=["x"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )  # fmt: skip
    assert program is not None
    program.save(str(path))
    return onnx.load(str(path))


def smoothed(model: onnx.ModelProto, alpha: float) -> onnx.ModelProto:
    import onnx_graphsurgeon as gs

    names = list(smoothable_activations(gs.import_onnx(model)))
    amax = Observer(model, names).collect_channel_amax(CalibrationData([{"x": SAMPLES}], SPECS))
    result, (report,) = apply(model, [SmoothActivations(amax, alpha)])
    assert report.counts["activations_smoothed"] == 2
    return result


def int8_cosine(model: onnx.ModelProto) -> float:
    table = calibrate(model, CalibrationData([{"x": SAMPLES}], SPECS), "minmax")
    quantized, _ = apply(model, [InsertQDQ("int8", table.int8_scales())])
    reference = run_onnx(model, {"x": SAMPLES})[0]
    return mean_cosine(reference, run_onnx(quantized, {"x": SAMPLES})[0])


def test_smoothing_keeps_the_function_and_helps_int8(model: onnx.ModelProto) -> None:
    smooth = smoothed(model, 0.8)
    assert ops(smooth)["Mul"] == ops(model)["Mul"] + 2
    np.testing.assert_allclose(
        run_onnx(smooth, {"x": SAMPLES})[0], run_onnx(model, {"x": SAMPLES})[0], rtol=1e-4, atol=1e-4
    )
    assert int8_cosine(smooth) > int8_cosine(model)


def test_the_smoothing_pass_leaves_other_ops_alone(model: onnx.ModelProto, tmp_path: Path) -> None:
    smooth = smoothed(model, 0.5)
    assert {op: n for op, n in ops(smooth).items() if op != "Mul"} == {
        op: n for op, n in ops(model).items() if op != "Mul"
    }
