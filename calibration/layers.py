"""The layers a precision plan chooses for: every MatMul/Gemm/Conv (attention's activation × activation
MatMuls included), named by ONNX node and PyTorch module, with their FLOPs and any precision pinned by policy or
by an override."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.core.module_paths import MODULE_KEY, module_path_from_name
from tensorsmith.core.overrides import Override
from tensorsmith.core.precisions import reference_precision
from tensorsmith.passes.matching import constant_value
from tensorsmith.passes.quantize import activation_inputs, quantizable_nodes

# Ops a final projection's output may pass through on its way to a graph output.
PASS_THROUGH = ("Add", "Reshape", "Transpose", "Identity", "Flatten", "Squeeze", "Unsqueeze", "Cast")


@dataclass
class Layer:
    name: str
    op: str
    module: str
    flops: int
    pinned: str | None = None  # a precision fixed before any search
    reason: str = ""
    inputs: tuple[str, ...] = ()  # the activation tensors it quantizes (the report plots their histograms)


def _modules(model: onnx.ModelProto) -> dict[str, str]:
    paths = {}
    for node in model.graph.node:
        recorded = {entry.key: entry.value for entry in node.metadata_props}.get(MODULE_KEY)
        paths[node.name] = recorded if recorded is not None else module_path_from_name(node.name)
    return paths


def _flops(node: gs.Node, shapes: Mapping[str, Sequence[int]]) -> int:
    def shape(tensor: gs.Tensor) -> tuple[int, ...]:
        value = constant_value(tensor)
        return tuple(value.shape) if value is not None else tuple(shapes.get(tensor.name, ()))

    a, b = shape(node.inputs[0]), shape(node.inputs[1])
    if not a or not b:
        return 0
    if node.op == "Conv":  # output positions ≈ input positions / strides
        strides = node.attrs.get("strides", [1] * (len(a) - 2))
        positions = math.prod(a[2:]) // max(math.prod(strides), 1)
        return 2 * a[0] * positions * math.prod(b)
    if node.op == "Gemm":
        k = a[0] if node.attrs.get("transA", 0) else a[-1]
        n = b[0] if node.attrs.get("transB", 0) else b[-1]
        return 2 * (math.prod(a) // k) * k * n
    return 2 * (math.prod(a) // a[-1]) * a[-1] * b[-1]  # MatMul [..., M, K] × [..., K, N]


def _feeds_an_output(graph: gs.Graph, node: gs.Node) -> bool:
    """A final projection: its output reaches a graph output through pass-through ops only."""
    outputs = {id(tensor) for tensor in graph.outputs}
    frontier = list(node.outputs)
    while frontier:
        tensor = frontier.pop()
        if id(tensor) in outputs:
            return True
        for user in tensor.outputs:
            if user.op in PASS_THROUGH and (
                user.op != "Add" or any(constant_value(t) is not None for t in user.inputs)
            ):
                frontier.extend(user.outputs)
    return False


def list_layers(
    model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], overrides: Sequence[Override] = ()
) -> list[Layer]:
    """Every quantizable node, in graph order, with its pinned precision: overrides first, then the policy
    that keeps a final projection in higher precision."""
    graph = gs.import_onnx(model)
    modules = _modules(model)
    layers = []
    for node in quantizable_nodes(graph):
        if not activation_inputs(node):
            continue
        module = modules.get(node.name, "")
        layer = Layer(
            node.name, node.op, module, _flops(node, shapes), inputs=tuple(t.name for t in activation_inputs(node))
        )
        for override in overrides:
            if any(fnmatch.fnmatchcase(field, override.match) for field in (node.name, module, node.op)):
                layer.pinned, layer.reason = override.precision, f"override '{override.match}'"
                break
        else:
            if _feeds_an_output(graph, node):
                layer.pinned, layer.reason = reference_precision().name, "policy: final projection"
        layers.append(layer)
    return layers


def activation_shapes(values: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(array.shape) for name, array in values.items()}
