"""LayerNorm decompositions → `LayerNormalization` (opset 17).

Anchored on the Sqrt of the variance, the op every decomposition has exactly once:

    x ──┬────────────────────────► Sub ──► d ──┬──► Pow(d, 2) | Mul(d, d) ──► ReduceMean ──► Add(eps) ──► Sqrt
        └──► ReduceMean [──► Unsqueeze] ──┘    │        (keepdims=0 forms put an Unsqueeze after a ReduceMean)
                                               └──► Div(d, std) | Mul(d, Reciprocal(std)) ──► normalized
    normalized [──► Cast] [──► Mul(γ)] [──► Add(β)]                     (commutative operands in either order)

Fused only when both reductions are over the same trailing axes and γ/β vary only along them. A Cast between
the normalization and γ/β (fp16 models computing the statistics in fp32) moves after the fused node, so the
LayerNormalization itself runs in fp32, as TensorRT needs (FP16 LayerNorm overflows).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.passes.fusion import PREVIOUS, NodeSpec, Rewrite, Rule, op_is, replace
from tensorsmith.passes.matching import Miss, Walk, constant_value, expect_close, scalar

MAX_EPSILON = 1e-2  # a LayerNorm epsilon is tiny; a larger constant is some other computation


def _axes(node: gs.Node) -> list[int]:
    """A ReduceMean's or Unsqueeze's axes, from the attribute (older opsets) or the second input (newer)."""
    if len(node.inputs) > 1:
        value = constant_value(node.inputs[1])
        if value is None:
            raise Miss(f"{node.op} '{node.name}' has computed axes")
        return [int(a) for a in value.reshape(-1)]
    axes = node.attrs.get("axes")
    if axes is None:
        raise Miss(f"{node.op} '{node.name}' has no axes (a ReduceMean over every axis)")
    return [int(a) for a in axes]


def _reduction(walk: Walk, tensor: gs.Tensor, what: str) -> tuple[gs.Node, list[int]]:
    """The ReduceMean computing `tensor`, through the Unsqueeze that restores a keepdims=0 reduction."""
    unsqueeze = walk.maybe_producer(tensor, "Unsqueeze")
    node = walk.producer(unsqueeze.inputs[0] if unsqueeze else tensor, "ReduceMean", what)
    keepdims = int(node.attrs.get("keepdims", 1))
    axes = _axes(node)
    if unsqueeze is not None:
        restored = _axes(unsqueeze)
        if keepdims != 0 or sorted(restored) != sorted(axes):
            raise Miss(f"{what}: Unsqueeze '{unsqueeze.name}' does not restore the reduced axes")
    elif keepdims == 0:
        raise Miss(f"{what}: ReduceMean '{node.name}' drops its axes (keepdims=0) and nothing restores them")
    return node, axes


def _trailing_count(axes: list[int], rank: int | None) -> int:
    """How many trailing axes `axes` are; Miss unless they are exactly the last k."""
    if rank is not None:
        normalized = sorted(a % rank for a in axes)
        if normalized != list(range(rank - len(axes), rank)):
            raise Miss(f"reduction axes {axes} are not the trailing axes of a rank-{rank} input")
    elif sorted(axes) != list(range(-len(axes), 0)):
        raise Miss(f"reduction axes {axes} on an input of unknown rank")
    return len(axes)


def _affine(value: np.ndarray, normalized: tuple[int, ...], rank: int | None, what: str) -> np.ndarray:
    """γ or β as an array of the normalized shape; Miss if it varies along an axis that is not normalized."""
    if rank is not None and value.ndim > rank:
        raise Miss(f"{what} has rank {value.ndim}, above the input's {rank}")
    leading = value.shape[: max(value.ndim - len(normalized), 0)]
    if any(size != 1 for size in leading):
        raise Miss(f"{what} of shape {list(value.shape)} varies along an axis that is not normalized")
    trailing = value.reshape(value.shape[len(leading) :])
    try:
        return np.ascontiguousarray(np.broadcast_to(trailing, normalized))
    except ValueError as err:
        raise Miss(f"{what} of shape {list(value.shape)} does not broadcast to {list(normalized)}") from err


def mean_of_squares(walk: Walk, mean: str, square: str) -> tuple[float, list[int], gs.Tensor]:
    """From the anchor Sqrt back through Add(eps) and the ReduceMean to Pow(t, 2) | Mul(t, t): (epsilon, the
    reduction's axes, t). LayerNorm's t is the deviation, RMSNorm's x itself; `mean` and `square` name the
    steps in misses."""
    add_epsilon = walk.producer(walk.anchor.inputs[0], "Add", f"{mean} + epsilon")
    mean_tensor, epsilon_value = walk.split_constant(add_epsilon, "epsilon")
    epsilon = scalar(epsilon_value, "epsilon")
    if not 0 < epsilon <= MAX_EPSILON:
        raise Miss(f"epsilon {epsilon:g} is not in (0, {MAX_EPSILON:g}]")
    mean_node, axes = _reduction(walk, mean_tensor, mean)
    squaring = walk.producer(mean_node.inputs[0], ("Pow", "Mul"), square)
    squared = squaring.inputs[0]
    if squaring.op == "Pow":
        exponent = constant_value(squaring.inputs[1])
        if exponent is None:
            raise Miss(f"{square}: Pow has a computed exponent")
        expect_close(exponent, 2.0, "exponent", rtol=0)
    elif squaring.inputs[1] is not squared:
        raise Miss(f"{square}: Mul of two different tensors")
    return epsilon, axes, squared


def static_normalized_shape(x: gs.Tensor, count: int) -> tuple[tuple[int, ...], np.dtype]:
    """The shape of `x`'s last `count` dims (Miss unless static), and its dtype (fp32 when unknown)."""
    shape = x.shape[-count:] if x.shape is not None else None
    if shape is None or not all(isinstance(size, int) for size in shape):
        raise Miss(f"the normalized dims {shape} are not static")
    return tuple(int(size) for size in shape), np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)


def match_layernorm(walk: Walk) -> Rewrite:
    sqrt = walk.anchor
    epsilon, variance_axes, deviation = mean_of_squares(walk, "variance", "squared deviation")

    subtract = walk.producer(deviation, "Sub", "deviation")
    x, mean = subtract.inputs
    mean_node, mean_axes = _reduction(walk, mean, "mean")
    if mean_node.inputs[0] is not x:
        raise Miss("the mean is not of the tensor it is subtracted from")
    if sorted(mean_axes) != sorted(variance_axes):
        raise Miss(f"mean over axes {mean_axes}, variance over {variance_axes}")
    rank = len(x.shape) if x.shape is not None else None
    count = _trailing_count(mean_axes, rank)

    # Forward from the standard deviation: divide, or multiply by its reciprocal.
    std = sqrt.outputs[0]
    scale_node = walk.consumer(std, ("Div", "Reciprocal"), "normalization")
    if scale_node.op == "Div":
        if scale_node.inputs[0] is not deviation or scale_node.inputs[1] is not std:
            raise Miss("normalization: Div is not deviation / std")
        normalized_tensor = scale_node.outputs[0]
    else:
        multiply = walk.consumer(scale_node.outputs[0], "Mul", "normalization")
        if walk.other_input(multiply, scale_node.outputs[0], "normalization") is not deviation:
            raise Miss("normalization: Mul is not deviation × 1/std")
        normalized_tensor = multiply.outputs[0]

    # Optional Cast, then optional γ and β (each a Mul/Add with a constant).
    output = normalized_tensor
    cast = walk.maybe_consumer(output, "Cast")
    if cast is not None:
        output = cast.outputs[0]
    gamma = beta = None
    scaled = walk.maybe_constant_consumer(output, "Mul", "γ")
    if scaled is not None:
        multiply_gamma, gamma = scaled
        output = multiply_gamma.outputs[0]
    shifted = walk.maybe_constant_consumer(output, "Add", "β")
    if shifted is not None:
        add_beta, beta = shifted
        output = add_beta.outputs[0]

    normalized_shape, dtype = static_normalized_shape(x, count)
    name = output.name
    scale = _affine(gamma, normalized_shape, rank, "γ") if gamma is not None else np.ones(normalized_shape)
    bias = _affine(beta, normalized_shape, rank, "β") if beta is not None else np.zeros(normalized_shape)
    inputs = [
        x,
        gs.Constant(f"{name}/scale", scale.astype(dtype)),
        gs.Constant(f"{name}/bias", bias.astype(dtype)),
    ]
    specs = [NodeSpec("LayerNormalization", list(inputs), {"axis": -count, "epsilon": epsilon}, dtype=dtype)]
    if cast is not None:
        specs.append(NodeSpec("Cast", [PREVIOUS], dict(cast.attrs)))
    return replace(walk, output, specs)


LAYERNORM = Rule(
    name="layernorm",
    anchor="Sqrt",
    sketch=__doc__ or "",
    min_opset=17,
    match=match_layernorm,
    fused_form=op_is("LayerNormalization"),
)
