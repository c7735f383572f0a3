"""NVFP4 weight-only: the numerics against hand-computed cases and brute-force rounding, Model Optimizer's two
DequantizeLinear form checked by onnx and evaluated by onnx's reference evaluator, the simulated fp32 graph on ONNX
Runtime, and TensorRT for RTX building it for SM120 only (fp32 and after the fp16 pass)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core.errors import BuildError, PassError
from tensorsmith.passes import Canonicalize
from tensorsmith.passes.fp16 import ConvertToFp16
from tensorsmith.passes.nvfp4 import (
    E2M1_VALUES,
    NVFP4_MIN_OPSET,
    SimulatedNvfp4,
    WeightOnlyNvfp4,
    dequantize_nvfp4,
    quantize_nvfp4,
)
from tests.passes.graphs import GraphBuilder, apply, run_onnx

E2M1 = np.array(sorted({sign * value for value in E2M1_VALUES for sign in (1.0, -1.0)}), np.float32)
PROFILE = Profile({"x": ((1, 64), (4, 64), (8, 64))})


def _weight(rows: int = 64, columns: int = 32, seed: int = 0) -> np.ndarray:
    """Gaussian weights with blocks of very different ranges: the per-tensor and block scales both matter."""
    rng = np.random.default_rng(seed)
    ranges = rng.uniform(0.01, 0.2, size=(rows // 16, 1, columns)).astype(np.float32)
    return (rng.standard_normal((rows // 16, 16, columns)).astype(np.float32) * ranges).reshape(rows, columns)


def test_codes_are_nearest_e2m1_values_and_block_scales_are_fp8() -> None:
    weight = _weight()
    q = quantize_nvfp4(weight)
    assert q.codes.shape == (64, 32) and q.block_scales.shape == (4, 32) and q.block == 16
    assert np.isin(q.codes, E2M1).all()
    assert np.array_equal(q.block_scales.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), q.block_scales)
    assert q.tensor_scale == pytest.approx(float(np.abs(weight).max()) / (6 * 448), rel=1e-6)
    # each code is the e2m1 value nearest to w / (block scale · tensor scale), the block's amax near ±6
    scale = np.repeat(q.block_scales * np.float32(q.tensor_scale), 16, axis=0)
    scaled = weight / scale
    nearest = np.abs(E2M1[None, None, :] - np.clip(scaled, -6, 6)[..., None]).min(axis=-1)
    assert np.allclose(np.abs(q.codes - np.clip(scaled, -6, 6)), nearest, atol=1e-6)
    assert (np.abs(q.codes).reshape(4, 16, 32).max(axis=1) >= 4).all()


def test_a_hand_computed_column() -> None:
    """amax 6: tensor scale 6/(6·448), block scale 448 (exact in fp8), codes w rounded, ties to even."""
    column = np.array([6, 0.3, 2.5, -1.75, 5, 0.25, -0.74, 3.5, 1.25, -6, 0, 0.75, 1, 4.2, -3, 2], np.float32)
    q = quantize_nvfp4(column[:, None])
    assert q.block_scales.item() == 448.0
    expected = [6, 0.5, 2, -2, 4, 0, -0.5, 4, 1, -6, 0, 1, 1, 4, -3, 2]
    np.testing.assert_array_equal(q.codes[:, 0], expected)
    np.testing.assert_allclose(dequantize_nvfp4(q)[:, 0], expected, rtol=1e-6)


def test_dequantized_error_is_small_relative_to_each_blocks_amax() -> None:
    weight = _weight(seed=1)
    error = np.abs(dequantize_nvfp4(quantize_nvfp4(weight)) - weight).reshape(4, 16, 32)
    amax = np.abs(weight).reshape(4, 16, 32).max(axis=1)
    # at most half e2m1's widest step (2 of 6) times a block scale fp8 rounded up by at most 1/16
    assert (error.max(axis=1) <= amax * (1 / 6) * (1 + 1 / 16) + 1e-7).all()
    assert np.linalg.norm(error) / np.linalg.norm(weight) < 0.12


def test_zero_weights_stay_zero_without_nan() -> None:
    zero = quantize_nvfp4(np.zeros((32, 4), np.float32))
    assert zero.tensor_scale == 1.0 and not zero.codes.any() and (zero.block_scales == 1.0).all()
    assert not dequantize_nvfp4(zero).any()
    weight = _weight(32, 4)
    weight[:16, 0] = 0.0  # an all-zero block: scale 1, codes 0
    weight[:16, 1] = 1e-12  # a block whose fp8 scale underflows to 0: dequantizes to 0, not NaN
    q = quantize_nvfp4(weight)
    dequantized = dequantize_nvfp4(q)
    assert np.isfinite(q.codes).all() and np.isfinite(dequantized).all()
    assert q.block_scales[0, 0] == 1.0 and q.block_scales[0, 1] == 0.0
    assert not dequantized[:16, :2].any() and dequantized[16:, :2].any()


def test_k_must_be_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match=r"\[40, 8\]"):
        quantize_nvfp4(np.ones((40, 8), np.float32))
    with pytest.raises(ValueError, match=r"\[64\]"):
        quantize_nvfp4(np.ones(64, np.float32))


def _model(opset: int = 21) -> onnx.ModelProto:
    """x [batch, 64] → MatMul [64, 32] → MatMul [32, 40] (K 32 quantizes) → MatMul [40, 8] (K 40 cannot)."""
    builder = GraphBuilder(opset)
    first = builder.op("MatMul", "x", builder.const(_weight()))
    second = builder.op("MatMul", first, builder.const(_weight(32, 40, seed=2)))
    output = builder.op("MatMul", second, builder.const(np.random.default_rng(3).standard_normal((40, 8)) * 0.1))
    return builder.model({"x": (TensorProto.FLOAT, ["batch", 64])}, {output: TensorProto.FLOAT})


def _evaluate(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    """onnx's reference evaluator: it runs DequantizeLinear-23 of FLOAT4E2M1, which ONNX Runtime's CPU cannot."""
    return [np.asarray(output) for output in ReferenceEvaluator(model).run(None, {"x": x})]


def _matmuls(model: onnx.ModelProto) -> frozenset[str]:
    return frozenset(node.name for node in model.graph.node if node.op_type == "MatMul")


@pytest.fixture(scope="module")
def opset23() -> onnx.ModelProto:
    """The opset raise as the frontend does it for INT4 (Canonicalize to the precision's floor)."""
    model = _model()
    raised, _ = Canonicalize(opset=NVFP4_MIN_OPSET)(model)
    assert raised.opset_import[0].version == NVFP4_MIN_OPSET
    return raised


@pytest.fixture(scope="module")
def real(opset23: onnx.ModelProto) -> onnx.ModelProto:
    return apply(opset23, [WeightOnlyNvfp4(_matmuls(opset23))])[0]


def test_the_form_is_model_optimizers_two_dequantize_linear(opset23: onnx.ModelProto) -> None:
    model, reports = apply(opset23, [WeightOnlyNvfp4(_matmuls(opset23))])
    onnx.checker.check_model(model, full_check=True)
    (report,) = reports
    assert report.counts == {"matmuls_quantized": 2, "skipped": 1}
    assert report.details.as_json()["skipped"] == {"MatMul_9": "weight [40, 8]: not a constant [K, N] with K % 16 == 0"}
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    producers = {output: node for node in model.graph.node for output in node.output}
    quantized = [node for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in producers]
    assert len(quantized) == 2
    for matmul in quantized:
        weight_dq = producers[matmul.input[1]]
        scale_dq = producers[weight_dq.input[1]]
        assert weight_dq.op_type == scale_dq.op_type == "DequantizeLinear"
        assert {a.name: helper.get_attribute_value(a) for a in weight_dq.attribute} == {"axis": 0, "block_size": 16}
        assert not scale_dq.attribute and len(weight_dq.input) == len(scale_dq.input) == 2  # no zero points
        codes, block_scales, tensor_scale = (initializers[name] for name in (weight_dq.input[0], *scale_dq.input))
        k, n = codes.dims
        assert codes.data_type == TensorProto.FLOAT4E2M1 and len(codes.raw_data) == k * n // 2  # packed
        assert block_scales.data_type == TensorProto.FLOAT8E4M3FN and list(block_scales.dims) == [k // 16, n]
        assert tensor_scale.data_type == TensorProto.FLOAT and list(tensor_scale.dims) == []


def test_the_dequantize_chain_computes_the_simulated_weight(opset23: onnx.ModelProto, real: onnx.ModelProto) -> None:
    """The dequantized weights (extra graph outputs) equal SimulatedNvfp4's constants bit for bit."""
    simulated, _ = apply(opset23, [SimulatedNvfp4(_matmuls(opset23))])
    weights = [node.output[0] for node in real.graph.node if node.op_type == "DequantizeLinear" and node.attribute]
    probe = onnx.ModelProto()
    probe.CopyFrom(real)
    probe.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in weights)
    x = np.random.default_rng(4).standard_normal((4, 64)).astype(np.float32)
    *outputs, first, second = _evaluate(probe, x)
    constants = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in simulated.graph.initializer}
    np.testing.assert_array_equal(first, constants["MatMul_3/weight_nvfp4_simulated"])
    np.testing.assert_array_equal(second, constants["MatMul_6/weight_nvfp4_simulated"])
    np.testing.assert_allclose(outputs[0], _evaluate(simulated, x)[0], rtol=1e-6)


def test_the_simulated_graph_runs_on_onnx_runtime(opset23: onnx.ModelProto) -> None:
    simulated, (report,) = apply(opset23, [SimulatedNvfp4(_matmuls(opset23))])
    assert report.counts == {"matmuls_quantized": 2, "skipped": 1}
    initializers = {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in opset23.graph.initializer}
    weights = [initializers[node.input[1]] for node in opset23.graph.node if node.op_type == "MatMul"]
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    expected = x @ dequantize_nvfp4(quantize_nvfp4(weights[0]))
    expected = expected @ dequantize_nvfp4(quantize_nvfp4(weights[1])) @ weights[2]
    (actual,) = run_onnx(simulated, {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6)


def test_a_graph_below_opset_23_is_refused() -> None:
    model = _model(opset=21)
    with pytest.raises(PassError, match="opset 23"):
        WeightOnlyNvfp4(_matmuls(model))(gs.import_onnx(model))


@pytest.fixture(scope="module")
def real_path(tmp_path_factory: pytest.TempPathFactory, real: onnx.ModelProto) -> Path:
    path = tmp_path_factory.mktemp("nvfp4") / "nvfp4.onnx"
    onnx.save(real, str(path))
    return path


def test_tensorrt_rtx_builds_nvfp4_for_sm120(real_path: Path) -> None:
    assert len(build_engine(real_path, "sm_120", PROFILE).plan) > 0


@pytest.mark.parametrize("target", ["sm_86", "sm_89"])
def test_tensorrt_rtx_refuses_nvfp4_before_blackwell(real_path: Path, target: str) -> None:
    with pytest.raises(BuildError, match=f"Cannot compile for target.* {target.replace('_', '')}, because the model "
                                         "contains HW-specific datatypes: fp4_e2m1"):  # fmt: skip
        build_engine(real_path, target, PROFILE)


def test_after_the_fp16_pass_it_still_builds_for_sm120(tmp_path: Path, opset23: onnx.ModelProto) -> None:
    """ConvertToFp16 keeps the block-scale DequantizeLinear in fp32 (an fp16 tensor scale, amax / 2688, would turn
    subnormal) and casts its output to fp16: the weight's DequantizeLinear then outputs fp16, as the MatMul reads."""
    half, _ = apply(opset23, [WeightOnlyNvfp4(_matmuls(opset23)), ConvertToFp16()])
    onnx.checker.check_model(half, full_check=True)
    scales = [tensor for tensor in half.graph.initializer if tensor.name.endswith("_tensor_scale")]
    assert len(scales) == 2 and all(tensor.data_type == TensorProto.FLOAT for tensor in scales)
    x = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32)
    simulated, _ = apply(opset23, [SimulatedNvfp4(_matmuls(opset23))])
    (expected,) = _evaluate(simulated, x)
    (actual,) = _evaluate(half, x)
    assert np.abs(actual - expected).max() <= 1e-2 * np.abs(expected).max()
    path = tmp_path / "nvfp4_fp16.onnx"
    onnx.save(half, str(path))
    assert len(build_engine(path, "sm_120", PROFILE).plan) > 0
