"""Stacked experts' weights in a weight format (passes/weight_formats/stacked.py): K found from the MatMul that
contracts each copy, blocks along it, and both layouts of one weight (the routed branch's [E, N, K], the
every-expert branch's [E, K, N]) quantized to the same values."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from tensorsmith.passes.weight_formats.stacked import StackedWeightOnly, stacked_weights
from tensorsmith.passes.weight_formats.table import FORMATS
from tests.passes.graphs import apply, run_onnx

E, N, K = 4, 24, 64


def _weight() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((E, N, K)) * 0.05).astype(np.float32)


def _model() -> onnx.ModelProto:
    """The routed branch's product (the chosen experts' [N, K] weights times x) and the every-expert one's
    (x times each expert's [K, N]) side by side, each from its own copy of the weight, as the export writes them."""
    gathered = numpy_helper.from_array(_weight(), "experts")
    every = numpy_helper.from_array(np.ascontiguousarray(_weight().transpose(0, 2, 1)), "experts_t")
    nodes = [
        helper.make_node("Gather", ["experts", "index"], ["chosen"], axis=0),
        helper.make_node("MatMul", ["chosen", "column"], ["routed"]),  # [P, N, K] @ [P, K, 1]
        helper.make_node("MatMul", ["row", "experts_t"], ["all"]),  # [1, T, K] @ [E, K, N]
    ]
    graph = helper.make_graph(
        nodes,
        "experts",
        [
            helper.make_tensor_value_info("index", TensorProto.INT64, [2]),
            helper.make_tensor_value_info("column", TensorProto.FLOAT, [2, K, 1]),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, [1, 3, K]),
        ],
        [
            helper.make_tensor_value_info("routed", TensorProto.FLOAT, [2, N, 1]),
            helper.make_tensor_value_info("all", TensorProto.FLOAT, [E, 3, N]),
        ],
        [gathered, every],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "index": np.array([3, 1]),
        "column": rng.standard_normal((2, K, 1)).astype(np.float32),
        "row": rng.standard_normal((1, 3, K)).astype(np.float32),
    }


def test_k_is_the_axis_each_copy_s_matmul_contracts() -> None:
    assert stacked_weights(gs.import_onnx(_model())) == {"experts": 2, "experts_t": 1}


@pytest.mark.parametrize("name", ["int4", "int8-weight", "nvfp4"])
def test_both_layouts_hold_the_same_quantized_weight(name: str) -> None:
    written, (report,) = apply(_model(), [StackedWeightOnly(FORMATS[name], block=32)])
    stored = {tensor.name: numpy_helper.to_array(tensor).astype(np.float32) for tensor in written.graph.initializer}
    for part in ("codes", "scales"):
        np.testing.assert_array_equal(stored[f"experts/{part}"], stored[f"experts_t/{part}"].transpose(0, 2, 1))
    assert report.counts == {"stacked_weights": 2}
    block = FORMATS[name].block_for(K, 32)
    assert report.details.as_json()["block_sizes"] == [block or K]
    # each expert's weight as the 2-D format computes it: the product the graph computes
    expected = np.stack([FORMATS[name].computed(np.ascontiguousarray(w.T), None, 32) for w in _weight()])
    feeds = _feeds()
    routed, every_expert = ReferenceEvaluator(written).run(None, feeds)
    np.testing.assert_allclose(routed, expected.transpose(0, 2, 1)[[3, 1]] @ feeds["column"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(every_expert, feeds["row"] @ expected, rtol=1e-5, atol=1e-5)
    dequantize = [node for node in written.graph.node if node.op_type == "DequantizeLinear"]
    assert sorted(helper.get_attribute_value(a) for n in dequantize for a in n.attribute if a.name == "axis") == [1, 2]


def test_the_measured_form_of_a_format_onnx_runtime_cannot_run_is_its_values() -> None:
    graph_pass = StackedWeightOnly(FORMATS["nvfp4"], block=16, measured=True)
    written, _ = apply(_model(), [graph_pass])
    assert not any(node.op_type == "DequantizeLinear" for node in written.graph.node)
    expected = np.stack([FORMATS["nvfp4"].computed(np.ascontiguousarray(w.T)) for w in _weight()])
    feeds = _feeds()
    _, every_expert = run_onnx(written, feeds)
    np.testing.assert_allclose(every_expert, feeds["row"] @ expected, rtol=1e-5, atol=1e-5)


def test_only_float_weights_a_matmul_contracts_are_taken() -> None:
    """A 3-D integer constant (GatherND's indices), a float table no MatMul contracts, and a weight whose K the
    format's block does not divide stay as they are; the last is reported with why."""
    model = _model()
    indices = numpy_helper.from_array(np.zeros((1, 2, 1), np.int64), "rows")
    table = numpy_helper.from_array(np.ones((4, 3, 5), np.float32), "table")
    narrow = numpy_helper.from_array(np.ones((E, 24, N), np.float32), "narrow")  # K = 24: no block of 32 divides it
    model.graph.initializer.extend([indices, table, narrow])
    model.graph.node.extend([
        helper.make_node("GatherND", ["table", "rows"], ["picked"]),
        helper.make_node("Gather", ["narrow", "index"], ["narrow_chosen"], axis=0),
        helper.make_node("MatMul", ["narrow_row", "narrow_chosen"], ["narrow_out"]),
    ])  # fmt: skip
    model.graph.input.append(helper.make_tensor_value_info("narrow_row", TensorProto.FLOAT, [2, 1, 24]))
    model.graph.output.extend([helper.make_tensor_value_info("picked", TensorProto.FLOAT, [1, 2, 3, 5]),
                               helper.make_tensor_value_info("narrow_out", TensorProto.FLOAT, [2, 1, N])])  # fmt: skip
    assert stacked_weights(gs.import_onnx(model)) == {"experts": 2, "experts_t": 1, "narrow": 1}
    written, (report,) = apply(model, [StackedWeightOnly(FORMATS["mxfp4"], block=32)])
    assert report.counts == {"stacked_weights": 2}
    assert list(report.details.as_json()["skipped"]) == ["narrow"]
    kept = {tensor.name for tensor in written.graph.initializer}
    assert {"rows", "table", "narrow"} <= kept
