"""GELU decompositions → `Gelu` (opset 20), exact (erf) and tanh-approximated.

    erf form, anchored on Erf:
        x ──► Div(x, √2) | Mul(x, 1/√2) ──► Erf ──► Add(1) ──► s
    tanh form, anchored on Tanh:
        x ──► Pow(x, 3) | Mul(x, Mul(x, x)) ──► Mul(0.044715) ──► Add(x, ·) ──► Mul(√(2/π)) ──► Tanh ──► Add(1) ──► s
    then, in any of the orders exporters write ½·x·s:
        Mul(Mul(x, s), 0.5) | Mul(Mul(s, 0.5), x) | Mul(Mul(x, 0.5), s)

Constants are checked to a relative 1e-3 (fp16 models carry rounded ones). x·sigmoid(1.702·x), a different
function, has neither Erf nor Tanh and is never touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx_graphsurgeon as gs

from tensorsmith.passes.fusion import NodeSpec, Rewrite, Rule, replace
from tensorsmith.passes.matching import Miss, Unrelated, Walk, constant_value, expect_close

SQRT_2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC_COEFFICIENT = 0.044715


def _half_x_times(walk: Walk, s: gs.Tensor, x: gs.Tensor) -> gs.Tensor:
    """Match ½·x·s after `s` (= 1 + erf or 1 + tanh); return the tensor holding it."""
    first = walk.consumer(s, "Mul", "½·x·(1 + ·)")
    other = walk.other_input(first, s, "½·x·(1 + ·)")
    if other is x:  # (x·s)·½
        last = walk.consumer(first.outputs[0], "Mul", "·½")
        _, half = walk.split_constant(last, "½")
        expect_close(half, 0.5, "½")
        return last.outputs[0]
    known = constant_value(other)
    if known is not None:  # (s·½)·x
        expect_close(known, 0.5, "½")
        last = walk.consumer(first.outputs[0], "Mul", "·x")
        if walk.other_input(last, first.outputs[0], "·x") is not x:
            raise Miss("·x: the last Mul is not by the GELU's input")
        return last.outputs[0]
    half_x = walk.producer(other, "Mul", "½·x")  # (x·½)·s
    operand, half = walk.split_constant(half_x, "½")
    expect_close(half, 0.5, "½")
    if operand is not x:
        raise Miss("½·x: the halved tensor is not the GELU's input")
    return first.outputs[0]


def _plus_one(walk: Walk, tensor: gs.Tensor) -> gs.Tensor:
    add = walk.consumer(tensor, "Add", "1 + ·")
    _, one = walk.split_constant(add, "1")
    expect_close(one, 1.0, "1")
    return add.outputs[0]


def match_gelu_erf(walk: Walk) -> Rewrite:
    erf = walk.anchor
    scaled = walk.producer(erf.inputs[0], ("Div", "Mul"), "x/√2")
    x, value = walk.split_constant(scaled, "√2")
    if scaled.op == "Div":
        if scaled.inputs[0] is not x:
            raise Miss("x/√2: the constant is the numerator")
        expect_close(value, SQRT_2, "√2")
    else:
        expect_close(value, 1 / SQRT_2, "1/√2")
    output = _half_x_times(walk, _plus_one(walk, erf.outputs[0]), x)
    return replace(walk, output, [NodeSpec("Gelu", [x], {"approximate": "none"})])


def _cube_of(walk: Walk, tensor: gs.Tensor, x: gs.Tensor) -> None:
    """`tensor` is x³: Pow(x, 3), or Mul(x, Mul(x, x)) in either order."""
    node = walk.producer(tensor, ("Pow", "Mul"), "x³")
    if node.op == "Pow":
        exponent = constant_value(node.inputs[1])
        if node.inputs[0] is not x or exponent is None:
            raise Miss("x³: Pow is not of the GELU's input by a constant")
        expect_close(exponent, 3.0, "exponent", rtol=0)
        return
    for square, single in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        producer = square.inputs[0] if square.inputs else None
        if single is x and producer is not None and producer.op == "Mul" and list(producer.inputs) == [x, x]:
            walk.take(producer)
            return
    raise Miss("x³: Mul is not x·x·x")


def match_gelu_tanh(walk: Walk) -> Rewrite:
    tanh = walk.anchor
    try:
        scaled = walk.producer(tanh.inputs[0], "Mul", "√(2/π)·(x + 0.044715·x³)")
        inner, value = walk.split_constant(scaled, "√(2/π)")
        expect_close(value, SQRT_2_OVER_PI, "√(2/π)")
    except Miss as miss:  # a Tanh of anything but √(2/π)·(…): an activation (BERT's pooler), not a GELU
        raise Unrelated(str(miss)) from None
    add = walk.producer(inner, "Add", "x + 0.044715·x³")
    reasons = []
    for x, cubic in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        trial = Walk(tanh, walk.graph)
        trial.nodes = list(walk.nodes)
        try:
            term = trial.producer(cubic, "Mul", "0.044715·x³")
            cube, coefficient = trial.split_constant(term, "0.044715")
            expect_close(coefficient, CUBIC_COEFFICIENT, "0.044715")
            _cube_of(trial, cube, x)
        except Miss as miss:
            reasons.append(str(miss))
            continue
        walk.nodes = trial.nodes
        output = _half_x_times(walk, _plus_one(walk, tanh.outputs[0]), x)
        return replace(walk, output, [NodeSpec("Gelu", [x], {"approximate": "tanh"})])
    raise Miss(reasons[0])


def _gelu(approximate: str) -> Callable[[gs.Node], bool]:
    return lambda node: node.op == "Gelu" and node.attrs.get("approximate", "none") == approximate


GELU_ERF = Rule(
    name="gelu_erf", anchor="Erf", sketch=__doc__ or "", min_opset=20, match=match_gelu_erf, fused_form=_gelu("none")
)
GELU_TANH = Rule(
    name="gelu_tanh", anchor="Tanh", sketch=__doc__ or "", min_opset=20, match=match_gelu_tanh, fused_form=_gelu("tanh")
)
