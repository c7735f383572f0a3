"""Which nodes and values of a decoder's trace belong to one layer (compiler/frontend/layer_stamping.py): by the
module path the dynamo exporter records on each node, and through the subgraphs of control flow (a mixture of
experts' If, whose branches read the layer's stacked experts from outside them)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

import onnx_ir as ir

from tensorsmith.core.module_paths import NAME_SCOPES


def scopes(node: ir.Node) -> list[str]:
    text = node.metadata_props.get(NAME_SCOPES, "")
    try:
        return [str(scope) for scope in ast.literal_eval(text)] if text else []
    except (ValueError, SyntaxError):
        return []


def in_layer(node: ir.Node, layer_path: str) -> bool:
    return layer_path in scopes(node)


def layer_nodes(graph: ir.Graph, layer_path: str) -> list[ir.Node]:
    """The nodes of the layer at `layer_path`, in order: those its module made, and those the optimizer made
    without a module path (a Split for a layer's Slices) from their values."""
    members: list[ir.Node] = []
    produced: set[int] = set()
    for node in graph:
        unscoped = NAME_SCOPES not in node.metadata_props
        if in_layer(node, layer_path) or (unscoped and any(id(v) in produced for v in node.inputs if v)):
            members.append(node)
            produced.update(id(output) for output in node.outputs)
    return members


def with_subgraphs(node: ir.Node) -> Iterator[ir.Node]:
    """`node` and the nodes of its subgraphs (an If's branches), theirs too."""
    yield node
    for attribute in node.attributes.values():
        graphs = [attribute.value] if attribute.type == ir.AttributeType.GRAPH else []
        graphs += list(attribute.value) if attribute.type == ir.AttributeType.GRAPHS else []
        for graph in graphs:
            for inner in graph:
                yield from with_subgraphs(inner)


def reads(node: ir.Node) -> Iterator[ir.Value]:
    """The values `node` reads, with those its subgraphs read, from outside them or not."""
    for member in with_subgraphs(node):
        yield from (value for value in member.inputs if value is not None)


def lent_to_next(first: list[ir.Node], second: list[ir.Node], weight_prefix: str) -> set[int]:
    """ids of layer 0's nodes that compute, from none of its weights, what layer 1 reads: the trace computed that
    arithmetic once (torch.export shares its symbolic sizes), and the clones read it as layer 1 does."""
    made_by = {id(output): node for node in first for output in node.outputs}
    weighted = depending_on(first, weight_prefix)
    pending = [value for node in second for value in reads(node) if id(value) in made_by]
    lent: set[int] = set()
    while pending:
        value = pending.pop()
        node = made_by[id(value)]
        if id(value) in weighted or id(node) in lent:
            continue
        lent.add(id(node))
        pending.extend(value for value in node.inputs if value is not None and id(value) in made_by)
    return lent


def depending_on(nodes: list[ir.Node], weight_prefix: str) -> set[int]:
    """ids of the values `nodes` (in order) compute from a weight named with `weight_prefix` (an initializer, or
    a graph input once `weights_as_inputs` lifted it), in their subgraphs too."""
    found: set[int] = set()
    for node in nodes:
        if any(
            id(value) in found
            or ((value.is_graph_input() or value.is_initializer()) and str(value.name).startswith(weight_prefix))
            for value in reads(node)
        ):
            found.update(id(output) for output in node.outputs)
    return found
