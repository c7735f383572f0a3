"""LayerNorm decompositions built by hand, one per variant the rule covers, and the ones it must refuse."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from tensorsmith.passes import LAYERNORM, Fuse
from tests.passes.graphs import GraphBuilder, apply, assert_same_outputs, ops

HIDDEN = 8
RNG = np.random.default_rng(0)
GAMMA = RNG.uniform(0.5, 1.5, HIDDEN).astype(np.float32)
BETA = RNG.uniform(-0.5, 0.5, HIDDEN).astype(np.float32)
X = RNG.standard_normal((2, 3, HIDDEN)).astype(np.float32) * 3 + 1


def layernorm(
    *,
    opset: int = 17,
    square: str = "pow",
    divide: str = "div",
    gamma: bool = True,
    beta: bool = True,
    swap: bool = False,
    keepdims: bool = True,
    axes: list[int] | None = None,
    epsilon: float = 1e-5,
    cast: bool = False,
    gamma_value: np.ndarray = GAMMA,
    mean_is_output: bool = False,
) -> onnx.ModelProto:
    g = GraphBuilder(opset)
    axes = axes or [-1]
    x = "x"
    if cast:
        x = g.op("Cast", "x", to=TensorProto.FLOAT)

    def reduce_mean(tensor: str, keep: bool = True) -> str:
        if opset >= 18:
            return g.op("ReduceMean", tensor, g.const(axes, np.int64), keepdims=int(keep))
        return g.op("ReduceMean", tensor, axes=axes, keepdims=int(keep))

    def ordered(a: str, b: str) -> tuple[str, str]:
        return (b, a) if swap else (a, b)

    if keepdims:
        mean = reduce_mean(x)
    else:
        reduced = reduce_mean(x, keep=False)
        mean = (
            g.op("Unsqueeze", reduced, g.const(axes, np.int64))
            if opset >= 13
            else g.op("Unsqueeze", reduced, axes=axes)
        )
    deviation = g.op("Sub", x, mean)
    squared = g.op("Pow", deviation, g.const(2.0)) if square == "pow" else g.op("Mul", deviation, deviation)
    variance = reduce_mean(squared)
    std = g.op("Sqrt", g.op("Add", *ordered(variance, g.const(epsilon))))
    out = g.op("Div", deviation, std) if divide == "div" else g.op("Mul", *ordered(deviation, g.op("Reciprocal", std)))
    dtype = np.float16 if cast else np.float32
    if cast:
        out = g.op("Cast", out, to=TensorProto.FLOAT16)
    if gamma:
        out = g.op("Mul", *ordered(out, g.const(gamma_value, dtype)))
    if beta:
        out = g.op("Add", *ordered(out, g.const(BETA, dtype)))
    elem = TensorProto.FLOAT16 if cast else TensorProto.FLOAT
    outputs = {out: elem}
    if mean_is_output:
        outputs[mean] = TensorProto.FLOAT
    return g.model({"x": (elem, [2, 3, HIDDEN])}, outputs)


VARIANTS = {
    "pow-div": {},
    "mul-square": {"square": "mul"},
    "reciprocal": {"divide": "reciprocal"},
    "no-affine": {"gamma": False, "beta": False},
    "gamma-only": {"beta": False},
    "beta-only": {"gamma": False},
    "operands-swapped": {"swap": True, "divide": "reciprocal"},
    "axes-as-input-opset18": {"opset": 18},
    "keepdims-0-unsqueeze": {"keepdims": False},
    "two-trailing-axes": {"axes": [-2, -1], "gamma_value": np.broadcast_to(GAMMA, (3, HIDDEN))},
    "positive-axes": {"axes": [2]},
    "fp16-cast-wrapped": {"cast": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_fuses_to_one_layernormalization(variant: str) -> None:
    options = VARIANTS[variant]
    model = layernorm(**options)  # type: ignore[arg-type]
    fused, (report,) = apply(model, [Fuse([LAYERNORM])])
    assert report.counts["layernorm.matched"] == 1, report.details
    counts = ops(fused)
    assert counts["LayerNormalization"] == 1
    for decomposed in ("ReduceMean", "Sub", "Pow", "Sqrt", "Div", "Reciprocal"):
        assert counts[decomposed] == 0, f"{decomposed} left: {counts}"
    # Whatever γ/β shape was matched, nothing of the affine part is left unfused.
    assert counts["Mul"] == 0 and counts["Add"] == 0, counts
    cast = options.get("cast", False)
    feeds = {"x": X.astype(np.float16) if cast else X}
    assert_same_outputs(model, fused, feeds, tolerance=1e-3 if cast else 1e-5)
    (node,) = [n for n in fused.graph.node if n.op_type == "LayerNormalization"]
    assert node.input[0] != "x" if cast else node.input[0] == "x"  # fp16 models: the LayerNorm runs in fp32
    if cast:
        assert fused.graph.node[-1].op_type == "Cast"


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"axes": [1]}, "are not the trailing axes"),
        ({"epsilon": 0.5}, "epsilon 0.5 is not in"),
        ({"gamma_value": np.ones((3, 1), np.float32)}, "varies along an axis that is not normalized"),
        ({"mean_is_output": True}, "is a graph output"),
    ],
)
def test_refusals_are_misses_with_a_reason(options: dict, reason: str) -> None:
    model = layernorm(**options)
    fused, (report,) = apply(model, [Fuse([LAYERNORM])])
    assert report.counts["layernorm.matched"] == 0
    assert report.counts["layernorm.missed"] == 1
    (miss,) = report.details.as_json()["misses"]["layernorm"]  # type: ignore[index]
    assert reason in miss["reason"]
    assert ops(fused) == ops(model), "a miss leaves the graph as it was"


def test_the_rule_waits_for_opset_17() -> None:
    model = layernorm(opset=16)
    fused, (report,) = apply(model, [Fuse([LAYERNORM])])
    assert report.counts == {"layernorm.skipped_opset": 1}
    assert ops(fused)["LayerNormalization"] == 0
