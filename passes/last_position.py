"""A decoder's engine computes the vocabulary projection for the last position only.

    hidden [B, S, H] ──► MatMul(·, W_vocab) ──► … ──► logits [B, S, V]
    hidden [B, S, H] ──► Gather(axis 1, [-1]) ──► MatMul(·, W_vocab) ──► … ──► logits [B, 1, V]

Generation reads only the last position's logits (prompts are left padded, so it is every row's newest token);
at prefill the full projection is S times the work and S × V values copied back (1.2 GB a row for a 151,936-token
vocabulary and a 2,048-token prompt, in fp32). The variants keep every position, since perplexity is measured on
them; the engines are built from the graph this pass writes. Elementwise ops between the projection and the output
(a bias, a softcap's Div/Tanh/Mul, a Cast) keep the shape and are walked through.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.errors import PassError
from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.matching import constant_value

ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Identity")
PROJECTIONS = ("MatMul", "Gemm")


class LastPositionDetails(PassDetails):
    projection: str  # the vocabulary projection that now reads the last position only
    walked: list[str]  # the ops between it and the logits output


@dataclass
class LastPositionLogits:
    output: str = "logits"
    name: str = "last_position_logits"

    def __call__(self, graph: gs.Graph) -> PassReport:
        outputs = [tensor for tensor in graph.outputs if tensor.name == self.output]
        if not outputs:
            raise PassError(f"the graph has no output '{self.output}'", hint="a decoder graph's logits output")
        tensor, walked = outputs[0], []
        while tensor.inputs and tensor.inputs[0].op in ELEMENTWISE:
            node = tensor.inputs[0]
            walked.append(node.op)
            tensor.shape = None  # its sequence dim changes: re-inferred on export
            variables = [value for value in node.inputs if constant_value(value) is None]
            if len(variables) != 1:
                break
            tensor = variables[0]
        projection = tensor.inputs[0] if tensor.inputs else None
        if projection is None or projection.op not in PROJECTIONS:
            found = projection.op if projection is not None else "a graph input"
            raise PassError(
                f"'{self.output}' does not come from a vocabulary projection (found {found})",
                hint="compile without last-position logits",
            )
        hidden = projection.inputs[0]
        tensor.shape = None
        last = gs.Variable(f"{hidden.name}/last_position", hidden.dtype, None)
        index = gs.Constant(f"{hidden.name}/last_index", np.array([-1], np.int64))
        graph.nodes.append(gs.Node("Gather", f"{hidden.name}/LastPosition", {"axis": 1}, [hidden, index], [last]))
        projection.inputs[0] = last
        for output in outputs:
            output.shape = None
        return PassReport(
            self.name,
            changed=True,
            counts={"projections_sliced": 1},
            details=LastPositionDetails(projection=projection.name, walked=walked),
        )
