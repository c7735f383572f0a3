"""Fold attention's 1/√d scale into the Q projection's weights, anchored on Softmax.

    x ──► MatMul(x, W) [──► Add(b)] ──► Reshape/Transpose…/RotaryEmbedding ──► q ──┐
                                                      kᵀ ─────────────────────────┴─► MatMul ──► Div(√d) | Mul(1/√d)
                                                      [──► Add(mask) | Where(mask, ·, fill)] ──► Softmax

torch's SDPA decomposition splits the scale over both sides, MatMul(Mul(q, d^-¼), Mul(kᵀ, d^-¼)); both fold too.

becomes MatMul(x, W/√d) [──► Add(b/√d)] … ──► MatMul ──► [Add(mask)] ──► Softmax: one elementwise op over the
[batch, heads, seq, seq] scores tensor less per layer, and the same numbers up to rounding. The Q side must be a
constant-weight projection followed only by shape ops, each used once; otherwise the K side is tried.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.passes.base import unused_name
from tensorsmith.passes.fusion import Rewrite, Rule
from tensorsmith.passes.matching import Miss, Walk, constant_value, scalar

SHAPE_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Flatten")
# Linear in their first input, position by position: a scale passes through them exactly (up to rounding).
LINEAR_OPS = ("RotaryEmbedding",)


def _check_single_use(graph: gs.Graph, tensor: gs.Tensor, what: str) -> None:
    """Scaling `tensor` must change nothing but the scores: it may feed one value consumer, and any number of
    Shape ops (which read only its shape, as `x.view(batch, seq, …)` exports do), and is not a graph output."""
    if any(output is tensor for output in graph.outputs):
        raise Miss(f"{what}: '{tensor.name}' is a graph output")
    users = [user for user in tensor.outputs if user.op != "Shape"]
    if len(users) != 1:
        raise Miss(f"{what}: '{tensor.name}' is used by {len(users)} nodes besides Shape ops")


def _projection(graph: gs.Graph, tensor: gs.Tensor, what: str) -> list[tuple[gs.Node, int]]:
    """Walk back from `tensor` through single-use shape ops to MatMul(x, W) [+ b]; return the (node, input
    index) pairs of the constants that scale the projection: W, and b if there is a bias."""
    current = tensor
    node: gs.Node | None = None
    while node is None or node.op in SHAPE_OPS + LINEAR_OPS:
        _check_single_use(graph, current, what)
        if not current.inputs:
            raise Miss(f"{what}: reached a graph input before a projection")
        node = current.inputs[0]
        if node.op in SHAPE_OPS + LINEAR_OPS:
            current = node.inputs[0]
    constants: list[tuple[gs.Node, int]] = []
    if node.op == "Add":
        index = next((i for i, t in enumerate(node.inputs) if constant_value(t) is not None), None)
        if index is None:
            raise Miss(f"{what}: the Add before the head split has no constant bias")
        constants.append((node, index))
        current = node.inputs[1 - index]
        _check_single_use(graph, current, what)
        if not current.inputs:
            raise Miss(f"{what}: the bias is added to a graph input")
        node = current.inputs[0]
    if node.op != "MatMul" or constant_value(node.inputs[1]) is None:
        raise Miss(f"{what}: expected a MatMul with constant weights, found {node.op}")
    constants.append((node, 1))
    return constants


def _scale_constants(graph: gs.Graph, constants: list[tuple[gs.Node, int]], factor: float) -> None:
    for node, index in constants:
        tensor = node.inputs[index]
        value = constant_value(tensor)
        assert value is not None
        # A new constant, of a name of its own: the original may be shared with other layers (a fresh
        # checkpoint's zero biases are stored once), each of which gets its own scaled copy.
        scaled = (value.astype(np.float64) * factor).astype(value.dtype)
        node.inputs[index] = gs.Constant(unused_name(graph, f"{tensor.name}/attention_scaled"), scaled)


def _scaled_product(walk: Walk, scores: gs.Tensor) -> tuple[gs.Node, gs.Node, float]:
    """scores = Div(Q·Kᵀ, c) or Mul(Q·Kᵀ, c): (the scale node, the MatMul, the factor it multiplies by)."""
    scale_node = walk.producer(scores, ("Div", "Mul"), "attention scale")
    product, value = walk.split_constant(scale_node, "attention scale")
    number = scalar(value, "attention scale")
    if scale_node.op == "Div" and scale_node.inputs[0] is not product:
        raise Miss("attention scale: the constant is the numerator")
    matmul = walk.producer(product, "MatMul", "Q·Kᵀ")
    if len(product.outputs) != 1:
        raise Miss("Q·Kᵀ is used elsewhere than the scale")
    return scale_node, matmul, 1.0 / number if scale_node.op == "Div" else number


def _split_scale(walk: Walk, scores: gs.Tensor) -> Rewrite:
    """torch's SDPA decomposition scales both sides by √c: MatMul(Mul(q, √c), Mul(kᵀ, √c)). Fold c into one
    projection and read q and kᵀ unscaled."""
    matmul = walk.producer(scores, "MatMul", "Q·Kᵀ")
    scaled = []
    for side, what in ((0, "Q"), (1, "K")):
        multiply = walk.producer(matmul.inputs[side], "Mul", f"{what} scale")
        tensor, value = walk.split_constant(multiply, f"{what} scale")
        _check_single_use(walk.graph, matmul.inputs[side], f"{what} scale")
        scaled.append((multiply, tensor, scalar(value, f"{what} scale")))
    factor = scaled[0][2] * scaled[1][2]
    reasons = []
    for what, (_, tensor, _) in zip(("Q", "K"), scaled, strict=True):
        try:
            constants = _projection(walk.graph, tensor, what)
        except Miss as miss:
            reasons.append(str(miss))
            continue

        def fold(constants: list[tuple[gs.Node, int]] = constants) -> None:
            _scale_constants(walk.graph, constants, factor)
            matmul.inputs[0], matmul.inputs[1] = scaled[0][1], scaled[1][1]  # cleanup() drops both Muls

        return fold
    raise Miss("; ".join(reasons))


def match_attention_scale(walk: Walk) -> Rewrite:
    softmax = walk.anchor
    scores = softmax.inputs[0]
    # The scale comes before Softmax, or before the mask: an additive one (try each side of the Add), or one
    # applied with Where(condition, scores, fill) as transformers 5 does (try the two value inputs).
    mask_add = walk.maybe_producer(scores, "Add")
    mask_where = walk.maybe_producer(scores, "Where") if mask_add is None else None
    if mask_add is not None:
        candidates = list(mask_add.inputs)
    elif mask_where is not None:
        candidates = list(mask_where.inputs[1:])
    else:
        candidates = [scores]
    reasons = []
    for candidate in candidates:
        trial = Walk(softmax, walk.graph)
        trial.nodes = list(walk.nodes)
        try:
            scale_node, matmul, factor = _scaled_product(trial, candidate)
        except Miss as miss:
            reasons.append(str(miss))
            split = Walk(softmax, walk.graph)
            split.nodes = list(walk.nodes)
            try:
                fold = _split_scale(split, candidate)
            except Miss as split_miss:
                reasons.append(f"or the scale split over Q and K: {split_miss}")
                continue
            walk.nodes = split.nodes
            return fold
        walk.nodes = trial.nodes
        break
    else:
        raise Miss(reasons[-2] if len(reasons) > 1 and "split" in reasons[-1] else reasons[-1])

    reasons = []
    for side, what in ((0, "Q"), (1, "K")):
        try:
            constants = _projection(walk.graph, matmul.inputs[side], what)
        except Miss as miss:
            reasons.append(str(miss))
            continue
        return _folding(walk.graph, constants, factor, scale_node.outputs[0], matmul.outputs[0])
    raise Miss("; ".join(reasons))


def _folding(
    graph: gs.Graph, constants: list[tuple[gs.Node, int]], factor: float, scaled: gs.Tensor, product: gs.Tensor
) -> Rewrite:
    def fold() -> None:
        _scale_constants(graph, constants, factor)
        # The scale's consumers read Q·Kᵀ directly; cleanup() drops the now-dead Div/Mul.
        for user in list(scaled.outputs):
            user.inputs[user.inputs.index(scaled)] = product

    return fold


ATTENTION_SCALE = Rule(
    name="attention_scale", anchor="Softmax", sketch=__doc__ or "", min_opset=1, match=match_attention_scale
)
