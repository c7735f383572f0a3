"""INT8 weight-only: a weight MatMul reads int8 codes (a scale per output column) through DequantizeLinear, the
level a decoder's search gives a layer between INT4 and float."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.precisions import INT8
from tensorsmith.passes.base import PassReport
from tensorsmith.passes.matching import constant_value
from tensorsmith.passes.quantize import quantize_weights


def int8_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 weight-only, a scale per output column of `weight` [K, N]: (codes [K, N], scales [N])."""
    return quantize_weights(weight.astype(np.float32), 1, INT8.name)


@dataclass
class WeightOnlyInt8:
    """The MatMuls in `nodes` read an int8 weight (a scale per output column) through DequantizeLinear: the middle
    step between INT4 and float for a layer INT4 costs too much accuracy."""

    nodes: frozenset[str]
    name: str = "weight_only_int8"

    def __call__(self, graph: gs.Graph) -> PassReport:
        quantized = 0
        for node in [node for node in graph.nodes if node.name in self.nodes]:
            weight = constant_value(node.inputs[1])
            if weight is None or weight.ndim != 2:
                continue
            codes, scales = int8_weight(weight)
            prefix = f"{node.name}/weight_int8"
            inputs = [
                gs.Constant(prefix, codes),
                gs.Constant(f"{prefix}_scale", scales.astype(np.float32)),
                gs.Constant(f"{prefix}_zero", np.zeros_like(codes[0])),
            ]
            (dequantized,) = graph.layer(
                op="DequantizeLinear",
                name=f"{prefix}/DequantizeLinear",
                attrs={"axis": 1},
                inputs=inputs,
                outputs=[f"{prefix}_dequantized"],
            )
            dequantized.dtype = np.float32
            node.inputs[1] = dequantized
            quantized += 1
        return PassReport(self.name, changed=quantized > 0, counts={"matmuls_quantized": quantized})
