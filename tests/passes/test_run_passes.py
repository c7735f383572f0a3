"""The pass framework's own checks, after every pass."""

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto

from tensorsmith.core.errors import PassError
from tensorsmith.passes import PassReport, run_passes
from tests.passes.graphs import GraphBuilder


@dataclass
class CopiesUnderOneName:
    """A broken pass: the output becomes the sum of two copies of the input, both named "copy"."""

    name: str = "copies_under_one_name"

    def __call__(self, graph: gs.Graph) -> PassReport:
        (x,), (out,) = graph.inputs, graph.outputs
        copies = [gs.Variable("copy", np.float32, x.shape) for _ in range(2)]
        graph.nodes += [gs.Node("Identity", inputs=[x], outputs=[copy]) for copy in copies]
        out.inputs.clear()
        graph.nodes.append(gs.Node("Add", inputs=copies, outputs=[out]))
        return PassReport(self.name, changed=True)


def test_a_pass_that_leaves_two_tensors_of_one_name_is_an_error_naming_both() -> None:
    g = GraphBuilder(20)
    out = g.op("Relu", "x")
    graph = gs.import_onnx(g.model({"x": (TensorProto.FLOAT, [2, 4])}, {out: TensorProto.FLOAT}))
    with pytest.raises(PassError, match="pass copies_under_one_name left two tensors named 'copy'"):
        run_passes(graph, [CopiesUnderOneName()])
