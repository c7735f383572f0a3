"""Move an MLP's outlier hidden units into a side branch that stays in float (LLM.int8()'s decomposition,
Dettmers et al., 2022, with the outliers chosen once from calibration instead of detected on every call).

An MLP `act(x·W_in + b)·W_out` is a sum over its hidden units, so moving the few outlier units O (whose
activations reach many times the others': in MiniLM one GELU unit of layer 0 reaches 24.7 on the [CLS] token,
the median unit 1.3) into a branch of their own is exact:

    y = act(x·W_in° + b°)·W_out°  +  act(x·W_in[:, O] + b[O])·W_out[O, :]

where W_in°, b°, W_out° have the O units zeroed. The zeroed units compute act(0) and add nothing (their W_out°
rows are 0), so per-tensor int8 of the activation now suits the units that remain, and the branch (|O| columns)
stays in float: its MatMuls are new nodes, not among the quantization candidates.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import PassDetails, PassReport
from tensorsmith.passes.matching import constant_value

# Unary elementwise activations, for which splitting the hidden units is exact.
ACTIVATIONS = frozenset({"Gelu", "Relu", "Tanh", "Sigmoid", "Softplus", "Elu", "Selu", "LeakyRelu", "Mish"})
OUTLIER_RATIO = 8.0  # a unit is an outlier when its max |activation| exceeds this many times the median unit's
MAX_OUTLIER_FRACTION = 0.01  # the branch stays a sliver: at most 1 % of the units (the largest)


@dataclass
class Mlp:
    """`activation(x·W_in [+ bias])·W_out`; `hidden` is the activation's output, whose channels are the units."""

    up: gs.Node
    bias: gs.Node | None
    activation: gs.Node
    down: gs.Node

    @property
    def hidden(self) -> gs.Tensor:
        return self.activation.outputs[0]


def _only_user(tensor: gs.Tensor, graph_outputs: set[int]) -> gs.Node | None:
    users = list(tensor.outputs)
    return users[0] if len(users) == 1 and id(tensor) not in graph_outputs else None


def _weight(node: gs.Node, index: int) -> np.ndarray | None:
    value = constant_value(node.inputs[index]) if len(node.inputs) > index else None
    return value if value is not None and value.ndim == 2 and value.dtype == np.float32 else None


def find_mlps(graph: gs.Graph) -> list[Mlp]:
    """MatMul(x, W_in) → [Add(bias)] → activation → MatMul(·, W_out), each intermediate used only by the next."""
    outputs = {id(tensor) for tensor in graph.outputs}
    found = []
    for activation in graph.nodes:
        if activation.op not in ACTIVATIONS or len(activation.inputs) != 1:
            continue
        down = _only_user(activation.outputs[0], outputs)
        if down is None or down.op != "MatMul" or down.inputs[0] is not activation.outputs[0]:
            continue
        producer = activation.inputs[0].inputs[0] if activation.inputs[0].inputs else None
        bias, up = (producer, None) if producer is not None and producer.op == "Add" else (None, producer)
        if bias is not None and _only_user(bias.outputs[0], outputs) is activation:
            for side in (0, 1):
                source = bias.inputs[side].inputs[0] if bias.inputs[side].inputs else None
                value = constant_value(bias.inputs[1 - side])
                if source is not None and source.op == "MatMul" and value is not None and value.ndim == 1:
                    up = source
        if up is None or up.op != "MatMul" or _only_user(up.outputs[0], outputs) is not (bias or activation):
            continue
        w_in, w_out = _weight(up, 1), _weight(down, 1)
        if w_in is None or w_out is None or w_in.shape[1] != w_out.shape[0] or constant_value(up.inputs[0]) is not None:
            continue
        found.append(Mlp(up, bias, activation, down))
    return found


def outlier_units(amax: np.ndarray, ratio: float = OUTLIER_RATIO) -> np.ndarray:
    """Indices of the units whose max |activation| exceeds `ratio` × the median unit's (the largest first, at
    most MAX_OUTLIER_FRACTION of them)."""
    median = float(np.median(amax))
    if median <= 0:
        return np.zeros(0, np.int64)
    candidates = np.flatnonzero(amax > ratio * median)
    limit = max(1, int(len(amax) * MAX_OUTLIER_FRACTION))
    return np.sort(candidates[np.argsort(-amax[candidates])][:limit])


def _zeroed(values: np.ndarray, indices: np.ndarray, axis: int) -> np.ndarray:
    result = values.copy()
    result[(slice(None),) * axis + (indices,)] = 0
    return result


class OutlierDetails(PassDetails):
    ratio: float
    units: dict[str, list[int]]  # an MLP's down projection → the units split


@dataclass
class SplitOutlierNeurons:
    """Split the outlier units of every MLP in `hidden_amax` (per-unit max |activation|, from calibration)."""

    hidden_amax: Mapping[str, np.ndarray]
    ratio: float = OUTLIER_RATIO
    name: str = "split_outlier_neurons"

    def __call__(self, graph: gs.Graph) -> PassReport:
        split: dict[str, list[int]] = {}
        for mlp in find_mlps(graph):
            amax = self.hidden_amax.get(mlp.hidden.name)
            w_in, w_out = _weight(mlp.up, 1), _weight(mlp.down, 1)
            assert w_in is not None and w_out is not None
            if amax is None or amax.shape != (w_in.shape[1],):
                continue
            outliers = outlier_units(amax, self.ratio)
            if len(outliers) == 0:
                continue
            self._split(graph, mlp, w_in, w_out, outliers)
            split[mlp.down.name] = [int(unit) for unit in outliers]
        return PassReport(
            self.name,
            changed=bool(split),
            counts={"mlps_split": len(split), "units_split": sum(len(units) for units in split.values())},
            details=OutlierDetails(ratio=self.ratio, units=split),
        )

    @staticmethod
    def _split(graph: gs.Graph, mlp: Mlp, w_in: np.ndarray, w_out: np.ndarray, outliers: np.ndarray) -> None:
        prefix = mlp.down.name

        def constant(name: str, value: np.ndarray) -> gs.Constant:
            return gs.Constant(f"{prefix}/{name}", np.ascontiguousarray(value))

        def layer(op: str, name: str, inputs: list[gs.Tensor], **attrs: object) -> gs.Tensor:
            (output,) = graph.layer(
                op=op, name=f"{prefix}/{name}", inputs=inputs, outputs=[f"{prefix}/{name}"], attrs=attrs
            )
            return output

        # Zeroed rather than removed: the hidden size stays (a size like 1535 slows int8 GEMMs, which pack K in
        # groups), and the zeroed units contribute nothing: their W_out rows are 0.
        mlp.up.inputs[1] = constant("kept_units_in", _zeroed(w_in, outliers, axis=1))
        mlp.down.inputs[1] = constant("kept_units_out", _zeroed(w_out, outliers, axis=0))
        branch = layer("MatMul", "outlier_in", [mlp.up.inputs[0], constant("outlier_units_in", w_in[:, outliers])])
        if mlp.bias is not None:
            side = 0 if constant_value(mlp.bias.inputs[0]) is not None else 1
            bias = constant_value(mlp.bias.inputs[side])
            assert bias is not None
            mlp.bias.inputs[side] = constant("kept_units_bias", _zeroed(bias, outliers, axis=0))
            branch = layer("Add", "outlier_bias", [branch, constant("outlier_units_bias", bias[outliers])])
        branch = layer(mlp.activation.op, "outlier_activation", [branch], **mlp.activation.attrs)
        branch = layer("MatMul", "outlier_out", [branch, constant("outlier_units_out", w_out[outliers])])
        result = mlp.down.outputs[0]
        kept_sum = gs.Variable(f"{prefix}/kept_sum", dtype=result.dtype, shape=result.shape)
        mlp.down.outputs = [kept_sum]
        graph.layer(op="Add", name=f"{prefix}/outlier_add", inputs=[kept_sum, branch], outputs=[result])
