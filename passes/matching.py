"""Matching subgraphs from an anchor node: the walker every fusion rule uses, and the shared safety check.

A rule walks from its anchor with `Walk.producer` / `Walk.consumer`; each step either returns the next node
(remembered as part of the match) or raises `Miss` with a reason, which the fusion report counts. Constants
are compared with a relative tolerance, so fp16 models (1.414 for √2) match too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.core.mapped_graph import values_unkept

Ops = str | tuple[str, ...]
DEFAULT_RELATIVE_TOLERANCE = 1e-3  # fp16 stores √2 as 1.4141, 1.5e-4 away


class Miss(Exception):
    """The pattern did not complete at this anchor; the message says where and why."""


class Unrelated(Miss):
    """The anchor is no start of the pattern at all (a BERT pooler's Tanh, for GELU's tanh form): the report
    counts it neither as a match nor as a miss."""


def _ops(ops: Ops) -> tuple[str, ...]:
    return (ops,) if isinstance(ops, str) else ops


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output; None for a computed tensor. A weight still in
    its file (core/mapped_graph.py) is read for this use only, not kept loaded by the graph: a pass that reads every
    weight (INT4's, the vocabulary tables') would otherwise hold them all, the model's size again."""
    if isinstance(tensor, gs.Constant):
        return values_unkept(tensor)
    if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
        value = tensor.inputs[0].attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
    return None


class Walk:
    """The nodes of one candidate match, collected while walking from the anchor."""

    def __init__(self, anchor: gs.Node, graph: gs.Graph) -> None:
        self.anchor = anchor
        self.graph = graph
        self.nodes: list[gs.Node] = [anchor]

    def take(self, node: gs.Node) -> gs.Node:
        if node not in self.nodes:
            self.nodes.append(node)
        return node

    def producer(self, tensor: gs.Tensor, ops: Ops, what: str) -> gs.Node:
        """The node of type `ops` that computes `tensor`."""
        node = tensor.inputs[0] if tensor.inputs else None
        if node is None or node.op not in _ops(ops):
            found = node.op if node is not None else "a graph input or constant"
            raise Miss(f"{what}: expected {'/'.join(_ops(ops))} computing '{tensor.name}', found {found}")
        return self.take(node)

    def maybe_producer(self, tensor: gs.Tensor, ops: Ops) -> gs.Node | None:
        node = tensor.inputs[0] if tensor.inputs else None
        return self.take(node) if node is not None and node.op in _ops(ops) else None

    def consumer(self, tensor: gs.Tensor, ops: Ops, what: str) -> gs.Node:
        """The one node that uses `tensor`, which must be of type `ops`."""
        users = list(tensor.outputs)
        if len(users) != 1 or users[0].op not in _ops(ops):
            found = ", ".join(user.op for user in users) or "nothing (a graph output)"
            raise Miss(f"{what}: expected '{tensor.name}' to feed one {'/'.join(_ops(ops))}, it feeds {found}")
        return self.take(users[0])

    def maybe_consumer(self, tensor: gs.Tensor, ops: Ops) -> gs.Node | None:
        """The one node that uses `tensor` if it is of type `ops` and `tensor` is not a graph output."""
        users = list(tensor.outputs)
        if len(users) == 1 and users[0].op in _ops(ops):
            return self.take(users[0])
        return None

    def maybe_constant_consumer(self, tensor: gs.Tensor, op: str, what: str) -> tuple[gs.Node, np.ndarray] | None:
        """The one `op` node using `tensor` with a constant on its other side (e.g. LayerNorm's γ Mul), taken
        into the match with that constant; None, taking nothing, if there is no such node."""
        users = list(tensor.outputs)
        if len(users) != 1 or users[0].op != op:
            return None
        try:
            _, value = self.split_constant(users[0], what)
        except Miss:
            return None
        return self.take(users[0]), value

    @staticmethod
    def split_constant(node: gs.Node, what: str) -> tuple[gs.Tensor, np.ndarray]:
        """For a binary node with one constant operand (either side): (the other operand, the constant)."""
        if len(node.inputs) != 2:
            raise Miss(f"{what}: {node.op} '{node.name}' has {len(node.inputs)} inputs")
        first, second = node.inputs
        for variable, constant in ((first, second), (second, first)):
            value = constant_value(constant)
            if value is not None and constant_value(variable) is None:
                return variable, value
        raise Miss(f"{what}: {node.op} '{node.name}' has no constant operand")

    @staticmethod
    def other_input(node: gs.Node, tensor: gs.Tensor, what: str) -> gs.Tensor:
        """For a binary node fed by `tensor` on one side: the tensor on the other side."""
        if len(node.inputs) != 2:
            raise Miss(f"{what}: {node.op} '{node.name}' has {len(node.inputs)} inputs")
        first, second = node.inputs
        if first is tensor:
            return second
        if second is tensor:
            return first
        raise Miss(f"{what}: '{tensor.name}' does not feed {node.op} '{node.name}'")


def scalar(value: np.ndarray, what: str) -> float:
    if value.size != 1:
        raise Miss(f"{what}: expected a scalar constant, found shape {list(value.shape)}")
    return float(value.reshape(()))


def expect_close(value: np.ndarray, expected: float, what: str, rtol: float = DEFAULT_RELATIVE_TOLERANCE) -> float:
    """A scalar constant within `rtol` of `expected`, else Miss."""
    number = scalar(value, what)
    if not np.isclose(number, expected, rtol=rtol, atol=0.0):
        raise Miss(f"{what}: constant {number:.6g} is not {expected:.6g}")
    return number


def check_removable(graph: gs.Graph, nodes: Sequence[gs.Node], kept_output: gs.Tensor) -> None:
    """The one safety check every fusion shares: no tensor computed inside the match, other than the output the
    replacement takes over, is used outside it or is a graph output."""
    inside = {id(node) for node in nodes}
    graph_outputs = {id(tensor) for tensor in graph.outputs}
    for node in nodes:
        for tensor in node.outputs:
            if tensor is kept_output:
                continue
            if id(tensor) in graph_outputs:
                raise Miss(f"intermediate '{tensor.name}' is a graph output")
            for user in tensor.outputs:
                if id(user) not in inside:
                    raise Miss(f"intermediate '{tensor.name}' is also used by {user.op} '{user.name}'")
