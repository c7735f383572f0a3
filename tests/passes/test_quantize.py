"""Q/DQ insertion as TensorRT's explicit quantization wants it, checked on ONNX Runtime and TensorRT for RTX."""

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from tensorsmith.calibration import CalibrationData, calibrate
from tensorsmith.calibration.table import float32_hex
from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core import precisions
from tensorsmith.core.errors import BuildError, PassError
from tensorsmith.core.metrics import mean_cosine
from tensorsmith.core.precisions import FP8, INT8
from tensorsmith.passes.quantize import InsertQDQ, quantize_weights
from tensorsmith.runtime.specs import TensorSpec
from tests.passes.graphs import apply, ops, run_onnx


class ConvMlp(torch.nn.Module):
    """Conv (weights axis 0), Linear as MatMul (axis 1) or Gemm (transB: axis 0), and an activation×activation
    MatMul."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.linear = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.conv(images)).mean(dim=(2, 3))  # [batch, 8]
        hidden = torch.relu(self.linear(features))  # [batch, 16]
        gram = hidden.unsqueeze(2) @ hidden.unsqueeze(1)  # [batch, 16, 16]: both inputs are activations
        return self.head(gram.mean(dim=1))


SPECS = [TensorSpec("images", "float32", ("batch", 3, 8, 8))]
IMAGES = np.random.default_rng(0).standard_normal((64, 3, 8, 8)).astype(np.float32)


def export(exporter: str, opset: int, path: Path) -> onnx.ModelProto:
    args = (torch.from_numpy(IMAGES[:2]),)
    if exporter == "dynamo":
        program = torch.onnx.export(
            ConvMlp().eval(), args, dynamo=True, opset_version=opset, input_names=["images"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
        )  # fmt: skip
        assert program is not None
        program.save(str(path))
    else:
        torch.onnx.export(
            ConvMlp().eval(), args, str(path), dynamo=False, opset_version=opset, input_names=["images"],
            dynamic_axes={"images": {0: "batch"}},
        )  # fmt: skip
    return onnx.load(str(path))


@pytest.fixture(scope="module", params=[("torchscript", 17), ("dynamo", 20)])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    return export(*request.param, tmp_path_factory.mktemp("quantize") / "model.onnx")


@pytest.fixture(scope="module")
def opset20(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    return export("dynamo", 20, tmp_path_factory.mktemp("quantize20") / "model.onnx")


def quantized(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    table = calibrate(model, CalibrationData([{"images": IMAGES}], SPECS), "entropy")
    scales = table.int8_scales() if precision == "int8" else table.fp8_scales()
    result, (report,) = apply(model, [InsertQDQ(precision, scales)])  # type: ignore[arg-type]
    assert report.counts["nodes_quantized"] == 4  # Conv, two Linear, the activation×activation MatMul
    assert report.counts["weights_quantized"] == 3
    assert report.counts["activations_quantized"] == 5  # the Gram MatMul takes two
    return result


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_qdq_layout_and_accuracy(exported: onnx.ModelProto, precision: str) -> None:
    if precision == "fp8" and exported.opset_import[0].version < 19:
        with pytest.raises(PassError, match="fp8 Q/DQ needs opset 19"):
            apply(exported, [InsertQDQ("fp8", {})])
        return
    model = quantized(exported, precision)
    counts = ops(model)
    assert counts["QuantizeLinear"] == 5 and counts["DequantizeLinear"] == 8
    element = onnx.TensorProto.INT8 if precision == "int8" else onnx.TensorProto.FLOAT8E4M3FN
    graph = gs.import_onnx(model)
    for node in graph.nodes:
        if node.op == "DequantizeLinear" and isinstance(node.inputs[0], gs.Constant):  # a weight
            consumer = node.outputs[0].outputs[0]
            expected_axis = 0 if consumer.op == "Conv" or int(consumer.attrs.get("transB", 0)) else 1
            assert node.attrs["axis"] == expected_axis, consumer.op
            assert node.inputs[1].values.shape == (node.inputs[0].values.shape[expected_axis],)
    for initializer in model.graph.initializer:
        if initializer.name.endswith("/weight/quantized"):
            assert initializer.data_type == element
        if initializer.name.endswith("zero_point"):
            assert not onnx.numpy_helper.to_array(initializer).astype(np.float32).any(), "zero points are 0"
    for node in model.graph.node:  # no Q/DQ on any output of a quantized op, biases never quantized
        if node.op_type in ("Conv", "Gemm", "MatMul"):
            assert all(not name.endswith("/quantized") for name in node.output)
    reference, actual = run_onnx(exported, {"images": IMAGES})[0], run_onnx(model, {"images": IMAGES})[0]
    assert mean_cosine(reference, actual) > 0.99


@pytest.mark.slow
def test_engines_build_for_the_architectures_that_run_them(opset20: onnx.ModelProto, tmp_path: Path) -> None:
    profile = Profile({"images": ((1, 3, 8, 8), (8, 3, 8, 8), (32, 3, 8, 8))})
    for precision, targets in (("int8", ["sm_80", "sm_86", "sm_89", "sm_120"]), ("fp8", ["sm_89", "sm_120"])):
        path = tmp_path / f"{precision}.onnx"
        onnx.save(quantized(opset20, precision), str(path))
        for target in targets:
            assert len(build_engine(path, target, profile).plan) > 0
    with pytest.raises(BuildError, match="could not build"):
        build_engine(tmp_path / "fp8.onnx", "sm_86", profile)


def test_weight_quantization_is_symmetric_per_channel() -> None:
    weights = np.array([[0.5, -2.0], [-1.0, 1.0]], np.float32)  # MatMul B [K=2, N=2]
    values, scales = quantize_weights(weights, axis=1, precision="int8")
    np.testing.assert_allclose(scales, [1.0 / 127, 2.0 / 127])
    np.testing.assert_array_equal(values, [[64, -127], [-127, 64]])
    values, scales = quantize_weights(weights, axis=1, precision="fp8")
    np.testing.assert_allclose(scales, [1.0 / 448, 2.0 / 448])
    np.testing.assert_allclose(values.astype(np.float32) * scales, weights, rtol=0.07)


def test_cache_scale_encoding() -> None:
    assert float32_hex(1 / 127) == "3c010204"  # REFERENCE.md §5


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_switched_graph_quantizes_exactly_the_nodes_switched_on(opset20: onnx.ModelProto, precision: str) -> None:
    """The precision search's graph (calibration/search.py): each node's Q/DQ in an If that runs only where its
    switch is on; all off gives the float graph's outputs, one on the graph with only that node quantized (to the
    last bits: a MatMul whose weight an If gives is not prepacked, so its sums may round otherwise)."""
    from tensorsmith.passes.quantize import SWITCHES, quantizable_nodes

    table = calibrate(opset20, CalibrationData([{"images": IMAGES}], SPECS), "entropy")
    scales = table.int8_scales() if precision == "int8" else table.fp8_scales()
    names = [node.name for node in quantizable_nodes(gs.import_onnx(opset20))]
    switched, (report,) = apply(opset20, [InsertQDQ(precision, scales, nodes=names, switched=True)])  # type: ignore[arg-type]
    assert report.counts["nodes_quantized"] == 4 and report.counts["activations_quantized"] == 5
    assert ops(switched)["If"] == 5 + 3  # one per quantized input: 5 activations, 3 weights
    assert "QuantizeLinear" not in ops(switched)  # only inside the branches
    (floats,) = run_onnx(opset20, {"images": IMAGES})
    off = np.zeros(len(names), np.float32)
    (unswitched,) = run_onnx(switched, {"images": IMAGES, SWITCHES: off})
    np.testing.assert_allclose(unswitched, floats, rtol=1e-5, atol=1e-7)
    for index, name in enumerate(names):
        alone, _ = apply(opset20, [InsertQDQ(precision, scales, nodes=[name])])  # type: ignore[arg-type]
        (expected,) = run_onnx(alone, {"images": IMAGES})
        (actual,) = run_onnx(switched, {"images": IMAGES, SWITCHES: np.eye(len(names), dtype=np.float32)[index]})
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7, err_msg=name)
        assert np.max(np.abs(actual - floats)) > 1e-4 * np.max(np.abs(floats)), name  # quantized: it moved


def test_weights_are_quantized_a_block_of_rows_at_a_time_as_a_whole() -> None:
    """Blocks of rows give the codes and scales the whole array would, for every rank and axis (the fp8 saturation
    and the int8 rounding included), and a weight without rows gives none."""
    rng = np.random.default_rng(3)
    for shape in [(7,), (3000, 700), (5, 600, 300), (0, 16)]:
        weights = (rng.standard_normal(shape) * 3).astype(np.float32)
        for axis in range(-1, len(shape)):
            for name in (INT8.name, FP8.name):
                if shape[0] == 0 and axis % len(shape) != 0:
                    continue  # no rows to take a maximum over
                element = precisions.precision(name).element
                codes, scales = quantize_weights(weights, axis, name)
                layout = [1] * weights.ndim
                layout[axis % weights.ndim] = -1
                whole = weights / scales.reshape(layout)
                if element.is_integer:
                    whole = np.rint(whole)
                expected = np.clip(whole, -element.maximum, element.maximum).astype(element.numpy_dtype())
                assert codes.tobytes() == expected.tobytes() and codes.shape == shape, (shape, axis, name)
