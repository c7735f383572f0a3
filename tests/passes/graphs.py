"""Build small ONNX graphs in code for the pass tests, and compare them on ONNX Runtime."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime
from onnx import helper, numpy_helper

from tensorsmith.passes import PassReport, run_passes
from tensorsmith.passes.base import GraphPass


class GraphBuilder:
    def __init__(self, opset: int = 20) -> None:
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.count = 0

    def _name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, value: object, dtype: type = np.float32) -> str:
        name = self._name("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op: str, *inputs: str, **attrs: object) -> str:
        output = self._name(op.lower())
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=self._name(op), **attrs))
        return output

    def model(self, inputs: dict[str, tuple[int, list[int | str]]], outputs: dict[str, int]) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "test",
            [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in inputs.items()],
            [helper.make_tensor_value_info(name, dtype, None) for name, dtype in outputs.items()],
            initializer=self.initializers,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        onnx.checker.check_model(model)
        return model


def run_onnx(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return list(session.run(None, feeds))


def apply(model: onnx.ModelProto, passes: list[GraphPass]) -> tuple[onnx.ModelProto, list[PassReport]]:
    graph = gs.import_onnx(model)
    reports = run_passes(graph, passes)
    fused = gs.export_onnx(graph)
    onnx.checker.check_model(fused)
    return fused, reports


def ops(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


def assert_same_outputs(
    before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray], tolerance: float = 1e-5
) -> None:
    for expected, actual in zip(run_onnx(before, feeds), run_onnx(after, feeds), strict=True):
        expected = expected.astype(np.float64)
        error = np.max(np.abs(actual.astype(np.float64) - expected)) / max(np.max(np.abs(expected)), 1e-12)
        assert error <= tolerance, f"relative error {error:.2e} > {tolerance:g}"
