"""Splitting outlier MLP units into a float branch: the same function in fp32, and a far better dynamic int8
model when one unit's activation dwarfs the others (as GELU unit 856 of MiniLM's first layer does)."""

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from tensorsmith.calibration import CalibrationData, Observer
from tensorsmith.core.metrics import mean_cosine
from tensorsmith.passes.outlier_neurons import SplitOutlierNeurons, find_mlps, outlier_units
from tensorsmith.runtime.specs import TensorSpec
from tests.passes.graphs import GraphBuilder, apply, ops, run_onnx

SPECS = [TensorSpec("x", "float32", ("batch", 16, 32))]  # 3-D, so Linear exports as MatMul
SAMPLES = np.random.default_rng(0).standard_normal((64, 16, 32)).astype(np.float32)
OUTLIER = 5  # the hidden unit made to reach ~30x the others


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)
        with torch.no_grad():  # one unit with a large input weight and bias, as trained transformers grow
            self.up.weight[OUTLIER] *= 12.0
            self.up.bias[OUTLIER] = 25.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("outliers") / "mlp.onnx"
    program = torch.onnx.export(
        Mlp().eval(), (torch.from_numpy(SAMPLES[:2]),), dynamo=True, input_names=["x"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
    )  # fmt: skip
    assert program is not None
    program.save(str(path))
    return onnx.load(str(path))


def hidden_amax(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    names = [mlp.hidden.name for mlp in find_mlps(gs.import_onnx(model))]
    return Observer(model, names).collect_channel_amax(CalibrationData([{"x": SAMPLES}], SPECS))


def dynamic_int8_cosine(model: onnx.ModelProto, tmp_path: Path, name: str) -> float:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source, quantized = tmp_path / f"{name}.onnx", tmp_path / f"{name}-int8.onnx"
    onnx.save(model, source)
    original = [n.name for n in model.graph.node if n.op_type == "MatMul" and "/outlier_" not in n.name]
    quantize_dynamic(
        source, quantized, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"], nodes_to_quantize=original,
        per_channel=True,
    )  # fmt: skip
    reference = run_onnx(model, {"x": SAMPLES})[0]
    return mean_cosine(reference, run_onnx(onnx.load(quantized), {"x": SAMPLES})[0])


def test_the_exported_mlp_is_found(model: onnx.ModelProto) -> None:
    (mlp,) = find_mlps(gs.import_onnx(model))
    assert (mlp.up.op, mlp.activation.op, mlp.down.op) == ("MatMul", "Gelu", "MatMul")
    assert mlp.bias is not None


def test_splitting_keeps_the_function_and_helps_dynamic_int8(model: onnx.ModelProto, tmp_path: Path) -> None:
    split, (report,) = apply(model, [SplitOutlierNeurons(hidden_amax(model))])
    assert report.counts == {"mlps_split": 1, "units_split": 1}
    assert list(report.details.as_json()["units"].values()) == [[OUTLIER]]  # type: ignore[attr-defined]
    assert ops(split)["MatMul"] == ops(model)["MatMul"] + 2 and ops(split)["Gelu"] == 2
    np.testing.assert_allclose(
        run_onnx(split, {"x": SAMPLES})[0], run_onnx(model, {"x": SAMPLES})[0], rtol=1e-5, atol=1e-5
    )
    before, after = dynamic_int8_cosine(model, tmp_path, "mlp"), dynamic_int8_cosine(split, tmp_path, "split")
    assert 1 - after < (1 - before) / 4, (before, after)


def test_no_outlier_no_change(model: onnx.ModelProto) -> None:
    flat = {name: np.ones_like(amax) for name, amax in hidden_amax(model).items()}
    unchanged, (report,) = apply(model, [SplitOutlierNeurons(flat)])
    assert not report.changed and ops(unchanged) == ops(model)


def test_outlier_units_are_the_largest_and_few() -> None:
    amax = np.ones(1000, np.float32)
    amax[[3, 500, 700]] = [9.0, 30.0, 20.0]
    amax[[10, 11]] = 7.9  # under 8x the median: kept
    assert outlier_units(amax).tolist() == [3, 500, 700]
    many = np.ones(1000, np.float32)
    many[:50] = np.arange(50) + 10.0
    assert outlier_units(many).tolist() == list(range(40, 50))  # at most 1 %: the ten largest
    assert outlier_units(np.zeros(8, np.float32)).size == 0


def test_an_activation_used_elsewhere_is_not_an_mlp() -> None:
    """Splitting changes the hidden size, so nothing else may read the hidden tensors."""
    b = GraphBuilder()
    hidden = b.op("Relu", b.op("MatMul", "x", b.const(np.ones((4, 8)))))
    down = b.op("MatMul", hidden, b.const(np.ones((8, 4))))
    side = b.op("ReduceSum", hidden)
    model = b.model({"x": (onnx.TensorProto.FLOAT, [2, 4])}, {down: onnx.TensorProto.FLOAT, side: 1})
    assert find_mlps(gs.import_onnx(model)) == []
