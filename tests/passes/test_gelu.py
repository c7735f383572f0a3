"""GELU decompositions built by hand: both forms, every operand order, and functions that are not GELU."""

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from tensorsmith.passes import GELU_ERF, GELU_TANH, Fuse
from tests.passes.graphs import GraphBuilder, apply, assert_same_outputs, ops

X = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32) * 2


def half_x_times(g: GraphBuilder, s: str, order: str, swap: bool) -> str:
    """½·x·s in one of the orders exporters write it."""

    def mul(a: str, b: str) -> str:
        return g.op("Mul", b, a) if swap else g.op("Mul", a, b)

    if order == "half-last":  # (x·s)·½
        return mul(mul("x", s), g.const(0.5))
    if order == "half-on-s":  # (s·½)·x
        return mul(mul(s, g.const(0.5)), "x")
    return mul(mul("x", g.const(0.5)), s)  # (x·½)·s


def gelu_erf(
    order: str = "half-last", scale: str = "div", swap: bool = False, divisor: float = math.sqrt(2)
) -> onnx.ModelProto:
    g = GraphBuilder(20)
    scaled = g.op("Div", "x", g.const(divisor)) if scale == "div" else g.op("Mul", "x", g.const(1 / divisor))
    s = g.op("Add", g.op("Erf", scaled), g.const(1.0))
    out = half_x_times(g, s, order, swap)
    return g.model({"x": (TensorProto.FLOAT, [2, 5, 8])}, {out: TensorProto.FLOAT})


def gelu_tanh(order: str = "half-last", cube: str = "pow", swap: bool = False) -> onnx.ModelProto:
    g = GraphBuilder(20)
    cubed = g.op("Pow", "x", g.const(3.0)) if cube == "pow" else g.op("Mul", g.op("Mul", "x", "x"), "x")
    if swap:
        inner = g.op("Add", g.op("Mul", g.const(0.044715), cubed), "x")
    else:
        inner = g.op("Add", "x", g.op("Mul", cubed, g.const(0.044715)))
    s = g.op("Add", g.const(1.0), g.op("Tanh", g.op("Mul", inner, g.const(math.sqrt(2 / math.pi)))))
    out = half_x_times(g, s, order, swap)
    return g.model({"x": (TensorProto.FLOAT, [2, 5, 8])}, {out: TensorProto.FLOAT})


ORDERS = ["half-last", "half-on-s", "half-on-x"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("scale", ["div", "mul"])
@pytest.mark.parametrize("swap", [False, True])
def test_erf_form_fuses(order: str, scale: str, swap: bool) -> None:
    model = gelu_erf(order, scale, swap)
    fused, (report,) = apply(model, [Fuse([GELU_ERF])])
    assert report.counts["gelu_erf.matched"] == 1, report.details
    assert ops(fused) == {"Gelu": 1}
    assert fused.graph.node[0].attribute[0].s == b"none"
    assert_same_outputs(model, fused, {"x": X})


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("cube", ["pow", "mul"])
@pytest.mark.parametrize("swap", [False, True])
def test_tanh_form_fuses(order: str, cube: str, swap: bool) -> None:
    model = gelu_tanh(order, cube, swap)
    fused, (report,) = apply(model, [Fuse([GELU_TANH])])
    assert report.counts["gelu_tanh.matched"] == 1, report.details
    assert ops(fused) == {"Gelu": 1}
    assert fused.graph.node[0].attribute[0].s == b"tanh"
    assert_same_outputs(model, fused, {"x": X})


def test_sigmoid_approximation_is_not_gelu() -> None:
    """x·sigmoid(1.702·x) approximates GELU but is another function: it is left alone."""
    g = GraphBuilder(20)
    out = g.op("Mul", "x", g.op("Sigmoid", g.op("Mul", "x", g.const(1.702))))
    model = g.model({"x": (TensorProto.FLOAT, [2, 5, 8])}, {out: TensorProto.FLOAT})
    fused, (report,) = apply(model, [Fuse([GELU_ERF, GELU_TANH])])
    assert report.counts["gelu_erf.matched"] == report.counts["gelu_tanh.matched"] == 0
    assert ops(fused) == ops(model)


def test_a_wrong_constant_is_a_miss() -> None:
    model = gelu_erf(divisor=2.0)
    fused, (report,) = apply(model, [Fuse([GELU_ERF])])
    assert report.counts["gelu_erf.missed"] == 1
    assert "is not 1.41421" in report.details.as_json()["misses"]["gelu_erf"][0]["reason"]  # type: ignore[index]
    assert ops(fused) == ops(model)


def test_gelu_waits_for_opset_20() -> None:
    g = GraphBuilder(18)
    s = g.op("Add", g.op("Erf", g.op("Div", "x", g.const(math.sqrt(2)))), g.const(1.0))
    out = g.op("Mul", g.op("Mul", "x", s), g.const(0.5))
    model = g.model({"x": (TensorProto.FLOAT, [2, 5, 8])}, {out: TensorProto.FLOAT})
    _, (report,) = apply(model, [Fuse([GELU_ERF])])
    assert report.counts == {"gelu_erf.skipped_opset": 1}


def test_a_tanh_that_is_no_gelu_is_neither_matched_nor_missed() -> None:
    """BERT's pooler: tanh(x·W + b). The summary would call it a GELU the pass failed to fuse."""
    g = GraphBuilder(20)
    pooled = g.op("Tanh", g.op("Add", g.op("MatMul", "x", g.const(np.ones((8, 8)))), g.const(np.zeros(8))))
    model = g.model({"x": (TensorProto.FLOAT, [2, 5, 8])}, {pooled: TensorProto.FLOAT})
    fused, (report,) = apply(model, [Fuse([GELU_TANH])])
    assert report.counts == {"gelu_tanh.already_fused": 0, "gelu_tanh.matched": 0, "gelu_tanh.missed": 0}
    assert ops(fused) == ops(model)


def test_gelus_the_exporter_wrote_are_counted_by_form() -> None:
    g = GraphBuilder(20)
    out = g.op("Gelu", g.op("Gelu", "x"), approximate="tanh")
    model = g.model({"x": (TensorProto.FLOAT, [2, 5, 8])}, {out: TensorProto.FLOAT})
    _, (report,) = apply(model, [Fuse([GELU_ERF, GELU_TANH])])
    assert report.counts["gelu_erf.already_fused"] == report.counts["gelu_tanh.already_fused"] == 1
