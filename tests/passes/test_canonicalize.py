import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorsmith.core.errors import PassError
from tensorsmith.passes import Canonicalize, PassReport, run_passes


def graph_with_constant_subexpressions(opset: int = 13) -> onnx.ModelProto:
    """y = x * (2 + 3) + reshape-size computed from a static Shape: everything but the Mul/Add on x folds."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    three = numpy_helper.from_array(np.array(3.0, np.float32), "three")
    nodes = [
        helper.make_node("Add", ["two", "three"], ["five"]),
        helper.make_node("Mul", ["x", "five"], ["scaled"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["shape_f"], ["total"], keepdims=0),
        helper.make_node("Add", ["scaled", "total"], ["y"]),
        helper.make_node("Relu", ["x"], ["unused"]),  # dead: removed by cleanup
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[two, three],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_folds_constants_removes_dead_nodes_upgrades_and_infers_shapes() -> None:
    model = graph_with_constant_subexpressions(opset=13)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    expected = run(model, x)

    canonical, report = Canonicalize(opset=20)(model)

    assert [node.op_type for node in canonical.graph.node] == ["Mul", "Add"]
    assert report.changed
    assert report.counts["nodes_before"] == 7 and report.counts["nodes_after"] == 2
    assert report.details.as_json() == {"opset_before": 13, "opset_after": 20, "folded_by": "onnxscript"}
    assert canonical.opset_import[0].version == 20
    output_shape = [d.dim_value for d in canonical.graph.output[0].type.tensor_type.shape.dim]
    assert output_shape == [2, 3]
    np.testing.assert_allclose(run(canonical, x), expected, rtol=0, atol=0)


def test_a_canonical_graph_is_unchanged() -> None:
    canonical, _ = Canonicalize(opset=20)(graph_with_constant_subexpressions())
    _, report = Canonicalize(opset=20)(canonical)
    assert not report.changed
    assert report.counts["nodes_before"] == report.counts["nodes_after"] == 2


def test_an_impossible_opset_conversion_is_a_pass_error_with_a_hint() -> None:
    node = helper.make_node("NoSuchOp", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(PassError, match="cannot convert the model from opset 13 to 20") as caught:
        Canonicalize(opset=20)(model)
    assert caught.value.hint == "compile with --opset 13 to keep its opset"


class RenameOutputs:
    name = "rename"

    def __call__(self, graph: gs.Graph) -> PassReport:
        for tensor in graph.outputs:
            tensor.name = f"renamed_{tensor.name}"
        return PassReport(self.name, changed=True, counts={"renamed": len(graph.outputs)})


def test_run_passes_times_each_pass_and_cleans_up() -> None:
    graph = gs.import_onnx(graph_with_constant_subexpressions())
    reports = run_passes(graph, [RenameOutputs()])
    assert reports[0].counts == {"renamed": 1}
    assert reports[0].seconds >= 0
    assert "Relu" not in [node.op for node in graph.nodes], "cleanup() ran after the pass"
    assert graph.outputs[0].name == "renamed_y"
