"""RMSNorm decompositions → `RMSNormalization` (opset 23; ONNX Runtime 1.32 and TensorRT for RTX 1.7 take it).

Anchored, like LayerNorm, on the Sqrt, which every decomposition has once (torch's `rsqrt` exports as
Reciprocal(Sqrt)); what tells them apart is that RMSNorm squares x itself, not x minus its mean:

    x ──┬──► Pow(x, 2) | Mul(x, x) ──► ReduceMean [──► Unsqueeze] ──► Add(eps) ──► Sqrt
        └──► Div(x, rms) | Mul(x, Reciprocal(rms) | Div(1, rms)) ──► normalized [──► Cast] [──► Mul(γ)]

Fused only when the reduction is over trailing axes and γ varies only along them. A Cast between the
normalization and γ (transformers computes the statistics in fp32 for fp16 models) moves after the fused node.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from tensorsmith.passes.fusion import PREVIOUS, NodeSpec, Rewrite, Rule, op_is, replace
from tensorsmith.passes.layernorm import _affine, _trailing_count, mean_of_squares, static_normalized_shape
from tensorsmith.passes.matching import Miss, Walk, constant_value, expect_close


def match_rmsnorm(walk: Walk) -> Rewrite:
    sqrt = walk.anchor
    epsilon, axes, x = mean_of_squares(walk, "mean square", "square")
    if walk.maybe_producer(x, "Sub") is not None:
        raise Miss("the squared tensor is a difference: a LayerNorm's deviation, not an RMSNorm")
    rank = len(x.shape) if x.shape is not None else None
    count = _trailing_count(axes, rank)

    rms = sqrt.outputs[0]
    scale_node = walk.consumer(rms, ("Div", "Reciprocal"), "normalization")
    one = constant_value(scale_node.inputs[0]) if scale_node.op == "Div" else None
    if scale_node.op == "Div" and one is None:
        if scale_node.inputs[0] is not x or scale_node.inputs[1] is not rms:
            raise Miss("normalization: Div is not x / rms")
        output = scale_node.outputs[0]
    else:  # Reciprocal(rms), or Div(1, rms) (TorchScript's rsqrt), then Mul by x
        if one is not None:
            expect_close(one, 1.0, "reciprocal numerator", rtol=0)
        multiply = walk.consumer(scale_node.outputs[0], "Mul", "normalization")
        if walk.other_input(multiply, scale_node.outputs[0], "normalization") is not x:
            raise Miss("normalization: Mul is not x × 1/rms")
        output = multiply.outputs[0]

    cast = walk.maybe_consumer(output, "Cast")
    if cast is not None:
        output = cast.outputs[0]
    gamma = None
    scaled = walk.maybe_constant_consumer(output, "Mul", "γ")
    if scaled is not None:
        multiply_gamma, gamma = scaled
        output = multiply_gamma.outputs[0]

    normalized_shape, dtype = static_normalized_shape(x, count)
    scale = _affine(gamma, normalized_shape, rank, "γ") if gamma is not None else np.ones(normalized_shape)
    inputs = [x, gs.Constant(f"{output.name}/scale", scale.astype(dtype))]
    specs = [NodeSpec("RMSNormalization", list(inputs), {"axis": -count, "epsilon": epsilon}, dtype=dtype)]
    if cast is not None:
        specs.append(NodeSpec("Cast", [PREVIOUS], dict(cast.attrs)))
    return replace(walk, output, specs)


RMSNORM = Rule(
    name="rmsnorm",
    anchor="Sqrt",
    sketch=__doc__ or "",
    min_opset=23,
    match=match_rmsnorm,
    fused_form=op_is("RMSNormalization"),
)
