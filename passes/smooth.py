"""SmoothQuant-style smoothing (Xiao et al., 2022) for int8: move activation outliers into the weights.

For an activation x feeding MatMuls with constant weights W [K, N], per input channel j:
    s_j = max|x_j|^α / max|W_j,:|^(1−α),    x' = x · (1/s),    W' = diag(s) · W,    so x'W' = xW.
The 1/s is an explicit Mul (shared by every MatMul that reads x), which TensorRT fuses into the producer and
ONNX Runtime runs as one elementwise op; per-tensor int8 then suits x' far better than x, whose LayerNorm and
GELU outputs carry a few channels with values 5–10x the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.matching import constant_value

SCALE_LIMITS = (1e-4, 1e4)


def smoothable_activations(graph: gs.Graph) -> dict[str, list[gs.Node]]:
    """Activations read by MatMuls with constant 2-D weights, with those MatMuls."""
    found: dict[str, list[gs.Node]] = {}
    for node in graph.nodes:
        if node.op != "MatMul" or constant_value(node.inputs[0]) is not None:
            continue
        weight = constant_value(node.inputs[1])
        if weight is not None and weight.ndim == 2 and weight.dtype == np.float32:
            found.setdefault(node.inputs[0].name, []).append(node)
    return found


class SmoothDetails(PassDetails):
    alpha: float


@dataclass
class SmoothActivations:
    """Smooth every activation in `channel_amax` (per-channel max |x| over the last axis, from calibration)."""

    channel_amax: Mapping[str, np.ndarray]
    alpha: float = 0.5
    name: str = "smooth_activations"

    def __call__(self, graph: gs.Graph) -> PassReport:
        tensors = graph.tensors()
        smoothed = 0
        for name, nodes in smoothable_activations(graph).items():
            amax = self.channel_amax.get(name)
            if amax is None:
                continue
            weights = [constant_value(node.inputs[1]) for node in nodes]
            weight_amax = np.max([np.max(np.abs(w), axis=1) for w in weights if w is not None], axis=0)
            if amax.shape != weight_amax.shape:
                continue
            scale = amax**self.alpha / np.maximum(weight_amax, 1e-8) ** (1 - self.alpha)
            scale = np.clip(np.where(amax > 0, scale, 1.0), *SCALE_LIMITS).astype(np.float32)
            (divided,) = graph.layer(
                op="Mul",
                name=f"{name}/Smooth",
                inputs=[tensors[name], gs.Constant(f"{name}/smooth_scale", (1 / scale).astype(np.float32))],
                outputs=[f"{name}/smoothed"],
            )
            divided.dtype = np.float32
            for node, weight in zip(nodes, weights, strict=True):
                assert weight is not None
                node.inputs[1] = gs.Constant(f"{node.name}/smoothed_weight", weight * scale[:, None])
                node.inputs[0] = divided
            smoothed += 1
        return PassReport(
            self.name,
            changed=smoothed > 0,
            counts={"activations_smoothed": smoothed},
            details=SmoothDetails(alpha=self.alpha),
        )
