"""bf16 regions: ConvertToBf16's types, RoundToBf16's simulation of them on ONNX Runtime CPU, and tensorrt-rtx
building the bf16 graph for Ampere and newer but not Turing."""

import math
from collections import Counter
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tensorsmith.compiler.engines.builder import build_engine
from tensorsmith.compiler.engines.profiles import Profile
from tensorsmith.core.errors import BuildError
from tensorsmith.passes.fp16 import ConvertToBf16, ConvertToFp16, ConvertToHalf, RoundToBf16
from tensorsmith.passes.half_float import BF16_FLOAT, BF16_MAX
from tests.passes.graphs import GraphBuilder, apply, ops, run_onnx

BF16_EPS = float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps)  # 2^-7
X = np.random.default_rng(1).standard_normal((8, 32)).astype(np.float32)


def block() -> onnx.ModelProto:
    """x → MatMul → Add → LayerNormalization → Gelu → MatMul → y."""
    g = GraphBuilder(20)
    rng = np.random.default_rng(0)
    h = g.op("Add", g.op("MatMul", "x", g.const(rng.standard_normal((32, 64)) / 4)), g.const(rng.standard_normal(64)))
    scale, bias = g.const(1 + rng.standard_normal(64) / 10), g.const(rng.standard_normal(64) / 10)
    gelu = g.op("Gelu", g.op("LayerNormalization", h, scale, bias, axis=-1))
    g.nodes.append(onnx.helper.make_node("MatMul", [gelu, g.const(rng.standard_normal((64, 16)) / 8)], ["y"]))
    return g.model({"x": (TensorProto.FLOAT, ["batch", 32])}, {"y": TensorProto.FLOAT})


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    values = [*model.graph.input, *model.graph.output, *model.graph.value_info]
    return {value.name: value.type.tensor_type.elem_type for value in values}


class Gelu(OpRun):
    """Gelu computed in fp32 and rounded once to its input's type, as TensorRT's one activation layer does; the
    reference evaluator's own Gelu expands into its function body and rounds after every op of it in bf16."""

    op_domain = ""

    def _run(self, x: np.ndarray, approximate: str = "none") -> tuple[np.ndarray]:
        wide = x.astype(np.float32)
        erf = np.vectorize(math.erf, otypes=[np.float32])
        return ((0.5 * wide * (1 + erf(wide / np.float32(math.sqrt(2))))).astype(x.dtype),)


def test_names_and_constants() -> None:
    assert ConvertToFp16().name == "convert_to_fp16"
    assert ConvertToBf16().name == "convert_to_bf16"
    assert ConvertToHalf(half=BF16_FLOAT).name == "convert_to_bf16"
    # float32's extremes round to ±inf in bf16: clipped to its largest finite value first
    extremes = np.array([np.finfo(np.float32).min, np.finfo(np.float32).max, 1.0], np.float32)
    assert np.isinf(extremes.astype(ml_dtypes.bfloat16)[:2]).all()
    assert BF16_FLOAT.constant(extremes).astype(np.float32).tolist() == [-BF16_MAX, BF16_MAX, 1.0]


def test_bf16_tensors_layernorm_fp32_io_fp32() -> None:
    model = block()
    converted, (report,) = apply(model, [ConvertToBf16()])
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(converted, strict_mode=True), full_check=True)
    assert report.counts == {"constants_converted": 3, "casts_inserted": 4, "kept_fp32": 1}
    types = elem_types(converted)
    assert types["x"] == types["y"] == TensorProto.FLOAT
    (norm,) = [node for node in converted.graph.node if node.op_type == "LayerNormalization"]
    assert {types[name] for name in [*norm.input[:1], *norm.output]} == {TensorProto.FLOAT}
    bf16 = {name for name, elem in types.items() if elem == TensorProto.BFLOAT16}
    producers = {output: node for node in converted.graph.node for output in node.output}
    assert {producers[name].op_type for name in bf16} == {"Cast", "MatMul", "Add", "Gelu"}
    assert all(types[name] == TensorProto.BFLOAT16 for node in converted.graph.node for name in node.output
               if node.op_type in ("MatMul", "Add", "Gelu"))  # fmt: skip
    initializers = {i.name: i for i in converted.graph.initializer}
    original = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert {initializers[name].data_type for name in norm.input[1:]} == {TensorProto.FLOAT}  # read by LayerNorm only
    weights = [i for i in initializers.values() if i.data_type == TensorProto.BFLOAT16]
    assert len(weights) == 3
    for weight in weights:
        expected = original[weight.name].astype(ml_dtypes.bfloat16)
        assert np.array_equal(onnx.numpy_helper.to_array(weight).view(np.uint16), expected.view(np.uint16))


def test_constant_nodes_and_float_casts_become_bf16() -> None:
    """An additive mask from a Constant node holding finfo(float32).min and a Cast(to=FLOAT) of an int mask."""
    g = GraphBuilder(20)
    lowest = onnx.numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest")
    additive = g.op("Mul", g.op("Sub", g.const(1.0), g.op("Cast", "mask", to=TensorProto.FLOAT)),
                    g.op("Constant", value=lowest))  # fmt: skip
    out = g.op("Softmax", g.op("Add", "x", additive), axis=-1)
    model = g.model({"x": (TensorProto.FLOAT, [2, 5]), "mask": (TensorProto.INT64, [2, 5])}, {out: TensorProto.FLOAT})
    converted, (report,) = apply(model, [ConvertToBf16()])
    assert report.counts["constants_converted"] == 2
    nodes = {node.op_type: node for node in converted.graph.node if node.op_type in ("Constant", "Cast")}
    assert nodes["Constant"].attribute[0].t.data_type == TensorProto.BFLOAT16
    casts = [node.attribute[0].i for node in converted.graph.node if node.op_type == "Cast"]
    assert sorted(casts) == sorted([TensorProto.BFLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT])
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int64)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32), "mask": mask}
    (actual,) = ReferenceEvaluator(converted).run(None, feeds)
    assert np.isfinite(actual).all() and (actual[0, 3:] == 0).all()
    (simulated,) = run_onnx(apply(model, [RoundToBf16()])[0], feeds)
    # a few ulps: the reference evaluator's Softmax rounds its exponentials and their sum to bf16 too
    np.testing.assert_allclose(simulated, actual, rtol=4 * BF16_EPS, atol=1e-6)


def test_round_to_bf16_rounds_what_the_bf16_graph_holds_in_bf16() -> None:
    model = block()
    converted, _ = apply(model, [ConvertToBf16()])
    simulated, (report,) = apply(model, [RoundToBf16()])
    assert report.counts == {"constants_rounded": 3, "casts_inserted": 12, "kept_fp32": 1, "untyped_outputs": 0}
    assert ops(simulated) == ops(model) + Counter({"Cast": 12})
    types = elem_types(simulated)
    assert {elem for name, elem in types.items() if not name.endswith("/bf16")} == {TensorProto.FLOAT}
    casts = [node for node in simulated.graph.node if node.op_type == "Cast"]
    rounded = {node.output[0] for node in casts if node.attribute[0].i == TensorProto.FLOAT}
    held_in_bf16 = {name for name, elem in elem_types(converted).items() if elem == TensorProto.BFLOAT16}
    assert {name.removesuffix("/rounded") for name in rounded} == {name.removesuffix("/bf16") for name in held_in_bf16}
    norm_only = {name for node in model.graph.node if node.op_type == "LayerNormalization" for name in node.input[1:]}
    original = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for initializer in simulated.graph.initializer:
        values, before = onnx.numpy_helper.to_array(initializer), original[initializer.name]
        expected = before if initializer.name in norm_only else before.astype(ml_dtypes.bfloat16).astype(np.float32)
        assert values.dtype == np.float32 and np.array_equal(values, expected)


def test_round_to_bf16_runs_on_onnxruntime_and_matches_the_bf16_graph() -> None:
    model = block()
    (reference,) = run_onnx(model, {"x": X})
    (simulated,) = run_onnx(apply(model, [RoundToBf16()])[0], {"x": X})
    error = np.max(np.abs(simulated - reference)) / np.max(np.abs(reference))
    assert BF16_EPS / 64 < error < 4 * BF16_EPS, f"relative error {error:.2e}: not bf16's precision"
    converted, _ = apply(model, [ConvertToBf16()])
    (actual,) = ReferenceEvaluator(converted, new_ops=[Gelu]).run(None, {"x": X})  # bf16 MatMul, Add, Gelu
    np.testing.assert_allclose(simulated, actual, rtol=BF16_EPS, atol=1e-6)
    assert np.mean(simulated == actual) > 0.95  # the same roundings: equal but for fp32 summation order


@pytest.mark.parametrize("target", ["sm_86", "sm_89", "sm_120", "sm_75"])
def test_tensorrt_rtx_builds_bf16_for_ampere_and_newer(target: str, tmp_path: Path) -> None:
    path = tmp_path / "bf16.onnx"
    onnx.save(apply(block(), [ConvertToBf16()])[0], str(path))
    profile = Profile({"x": ((1, 32), (4, 32), (8, 32))})
    if target == "sm_75":  # parses, then the build returns None
        with pytest.raises(BuildError, match="HW-specific datatypes: b16"):
            build_engine(path, target, profile)
    else:
        assert len(build_engine(path, target, profile).plan) > 0
