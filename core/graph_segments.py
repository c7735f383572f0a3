"""A graph's nodes cut into segments at its decoder layers' boundaries, for a run one segment at a time
(core/layerwise.py).

A node's layer is the first numbered part of its module path (`model.layers.7.mlp` → `model.layers.7`). Nodes that
read weights only (a weight's DequantizeLinear or Transpose) are moved to just before their first reader, so that a
segment holds the weights its own nodes read; nodes before the first layer go with it, those after the last with
it. Any cut of a topological order into contiguous runs is a valid one: a segment reads only graph inputs, its own
initializers and values earlier segments made.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from tensorsmith.core.checkpoint_references import held_bytes
from tensorsmith.core.module_paths import MODULE_KEY, module_path_from_name

UNNAMED_SEGMENTS = 16  # a graph without module paths is cut into about this many segments of equal weight
_NUMBERED = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")  # the module path up to its first numbered part


@dataclass(frozen=True)
class Segment:
    nodes: list[onnx.NodeProto]
    inputs: list[str]  # graph inputs and earlier segments' values it reads
    outputs: list[str]  # values later segments or the graph's outputs read
    initializers: list[onnx.TensorProto]  # without their data: it stays in the graph's external data file
    weight_bytes: int

    def narrowed(self, outputs: Iterable[str]) -> Segment:
        """The segment with only the nodes, inputs and weights that `outputs` need: a pass that observes the last
        layer's values need not compute the logits (at Llama-3.1-8B's shape, 2 GB of fp32 weights and 7.5 TFLOP
        over 56 windows). A segment with subgraphs (If, Loop) is kept whole: their outer reads are not walked."""
        if any(attribute.g.node or attribute.graphs for node in self.nodes for attribute in node.attribute):
            return self
        wanted = set(outputs)
        needed, kept = set(wanted), []
        for node in reversed(self.nodes):
            if any(name in needed for name in node.output):
                kept.append(node)
                needed.update(name for name in node.input if name)
        initializers = [tensor for tensor in self.initializers if tensor.name in needed]
        weights = sum(held_bytes(tensor) for tensor in initializers)
        inputs = [name for name in self.inputs if name in needed]
        return Segment(kept[::-1], inputs, [name for name in self.outputs if name in wanted], initializers, weights)


def layer_of(node: onnx.NodeProto) -> str | None:
    """The decoder layer (or any numbered module) `node` belongs to, from its module path; None where it has none."""
    path = next((entry.value for entry in node.metadata_props if entry.key == MODULE_KEY), None)
    if path is None and node.name.startswith("/"):
        path = module_path_from_name(node.name)
    match = _NUMBERED.match(path or "")
    return match.group(1) if match else None


def _read_names(node: onnx.NodeProto) -> set[str]:
    """Every value `node` reads, those its subgraphs (If, Loop, Scan) read from the enclosing scope included."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        graphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for graph in graphs:
            made = {name for inner in graph.node for name in inner.output} | {value.name for value in graph.input}
            made |= {tensor.name for tensor in graph.initializer}
            names |= {name for inner in graph.node for name in _read_names(inner)} - made
    return names


def _weights_beside_readers(graph: onnx.GraphProto, initializers: Iterable[str]) -> list[tuple[onnx.NodeProto, bool]]:
    """`graph`'s nodes in an order that is still topological, each node that reads weights only (a weight's
    DequantizeLinear or Transpose: ONNX Runtime folds them in a whole session) moved to just before its first
    reader, with whether it is one: a segment then holds the weights its own nodes read, not every layer's."""
    constant = set(initializers)
    weights_only = []
    for node in graph.node:
        alone = not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        weights_only.append(alone and all(name in constant for name in node.input if name))
        if weights_only[-1]:
            constant.update(node.output)
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output if name}
    order: list[int] = []
    placed: set[int] = set()

    def place(index: int) -> None:
        if index in placed:
            return
        for name in graph.node[index].input:
            if name in producer and weights_only[producer[name]]:
                place(producer[name])
        placed.add(index)
        order.append(index)

    for index in range(len(graph.node)):
        if not weights_only[index]:
            place(index)
    for index in range(len(graph.node)):
        place(index)
    return [(graph.node[index], weights_only[index]) for index in order]


def segments(structure: onnx.ModelProto, min_bytes: int, wanted: Iterable[str] = ()) -> list[Segment]:
    """`structure`'s nodes cut at layer boundaries into segments of at least `min_bytes` of weights each, as a session
    holds them (the last may hold less); `wanted`: values the caller asks for besides the graph's outputs."""
    graph = structure.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    order = _weights_beside_readers(graph, initializers.keys())
    layers = [layer_of(node) for node, _ in order]
    groups: list[list[onnx.NodeProto]] = []
    current: str | None = None
    waiting: list[onnx.NodeProto] = []  # nodes that read weights only, placed with the node that reads them
    for (node, weights_only), layer in zip(order, layers, strict=True):
        if weights_only:
            waiting.append(node)
            continue
        # a graph whose nodes name no module (a variant file: ONNX Runtime's own names) is cut by weight alone;
        # the nodes before the first layer (embedding, rotary tables, mask) go with it, those after with the last
        if not groups or (layer is not None and current is not None and layer != current) or not any(layers):
            groups.append([])
        current = layer if layer is not None else current
        groups[-1] += [*waiting, node]
        waiting = []
    if waiting:  # weights only, read by no node: a graph output
        groups.append(waiting) if not groups else groups[-1].extend(waiting)
    reads = [set().union(*(_read_names(node) for node in group)) for group in groups]
    weights = [sum(held_bytes(initializers[name]) for name in names if name in initializers) for names in reads]
    if not any(layers):
        min_bytes = max(min_bytes, sum(weights) // UNNAMED_SEGMENTS)
    joined: list[tuple[list[onnx.NodeProto], set[str], int]] = []
    for group, names, size in zip(groups, reads, weights, strict=True):
        if joined and joined[-1][2] < max(min_bytes, 1):  # a segment without weights joins the next
            nodes, read, held = joined[-1]
            joined[-1] = (nodes + group, read | names, held + size)
        else:
            joined.append((group, set(names), size))
    kept = {output.name for output in graph.output} | set(wanted)
    made_by = [{name for node in nodes for name in node.output if name} for nodes, _, _ in joined]
    read_later = [set().union(*(read for _, read, _ in joined[index + 1 :])) for index in range(len(joined))]
    result = []
    for (nodes, read, held), made, later in zip(joined, made_by, read_later, strict=True):
        inputs = sorted(read - made - initializers.keys())
        outputs = sorted(made & (later | kept))
        used = [initializers[name] for name in sorted(read) if name in initializers]
        result.append(Segment(nodes, inputs, outputs, used, held))
    return result
