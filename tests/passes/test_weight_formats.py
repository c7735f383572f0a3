"""The weight formats' table (passes/weight_formats): a format per quantized precision, and each format's graph
computes the weight its `computed` says (the values the decoder search measures are the variant's)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from tensorsmith.core.precisions import PRECISIONS, Quantizes
from tensorsmith.passes import Canonicalize
from tensorsmith.passes.int4 import Int4Weight
from tensorsmith.passes.weight_formats.base import LayerWeights, Quantized, WeightOnly
from tensorsmith.passes.weight_formats.table import FORMATS, weight_format
from tests.passes.graphs import GraphBuilder, apply, run_onnx

K, N = 64, 24


def _weight() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((K, N)) * 0.05).astype(np.float32)


def _model(opset: int) -> onnx.ModelProto:
    builder = GraphBuilder(opset)
    output = builder.op("MatMul", "x", builder.const(_weight()))
    return builder.model({"x": (TensorProto.FLOAT, ["batch", K])}, {output: TensorProto.FLOAT})


def test_every_quantized_precision_has_a_format_and_a_float_one_none() -> None:
    for record in PRECISIONS.values():
        if record.quantizes is Quantizes.NOTHING:
            with pytest.raises(Exception, match="no weight format"):
                weight_format(record)
        else:
            assert weight_format(record).record is record, record.name
    assert set(FORMATS) <= set(PRECISIONS)


@pytest.mark.parametrize("name", [name for name, f in FORMATS.items() if not f.record.quantizes_activations])
def test_a_format_s_graph_computes_its_computed_weight(name: str) -> None:
    """The pass each format writes equals x @ computed(W), run by onnx's reference evaluator (ONNX Runtime fuses
    DequantizeLinear → MatMul into kernels that may quantize x too); the form a format ONNX Runtime cannot run is
    measured on (float32 values) on ONNX Runtime."""
    format = FORMATS[name]
    model, _ = Canonicalize(opset=max(format.record.min_opset, 21))(_model(21))
    node = next(node.name for node in model.graph.node if node.op_type == "MatMul")
    block = format.block_for(K, 32)
    layers = LayerWeights({node: Int4Weight(None, None)}, block or K)
    x = np.random.default_rng(1).standard_normal((3, K)).astype(np.float32)
    expected = x @ format.computed(_weight(), None, block)
    written, _ = apply(model, [format.graph_pass(layers)])
    assert any(n.op_type == "DequantizeLinear" for n in written.graph.node)
    np.testing.assert_allclose(ReferenceEvaluator(written).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)
    measured, _ = apply(model, [format.graph_pass(LayerWeights(layers.nodes, layers.block, measured=True))])
    if format.onnxruntime_runs:  # measured as written
        assert measured.graph.node == written.graph.node
    else:  # the same values in float32, which ONNX Runtime runs
        assert not any(n.op_type == "DequantizeLinear" for n in measured.graph.node)
        np.testing.assert_allclose(run_onnx(measured, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_the_shared_form_writes_codes_scales_and_its_report() -> None:
    """One DequantizeLinear per MatMul: per column (axis 1) where a scale covers K, blockwise otherwise."""
    model = _model(21)
    node = next(node.name for node in model.graph.node if node.op_type == "MatMul")
    graph_pass = WeightOnly(FORMATS["int8-weight"], LayerWeights({node: Int4Weight(None, None)}, K, {"other": "why"}))
    written, (report,) = apply(model, [graph_pass])
    (dequantize,) = [n for n in written.graph.node if n.op_type == "DequantizeLinear"]
    assert [(a.name, a.i) for a in dequantize.attribute] == [("axis", 1)]
    assert report.name == "weight_only_int8_weight" and report.counts == {"matmuls_quantized": 1, "skipped": 1}
    assert report.details.as_json() == {
        "precision": "int8-weight",
        "block_sizes": [K],
        "weight_bytes": K * N + 4 * N,
        "skipped": {"other": "why"},
    }


def test_quantized_reads_back_blocks_and_tensor_scales() -> None:
    codes = np.array([[1.0, -2.0], [3.0, 4.0], [5.0, 6.0], [-7.0, 8.0]], np.float32)
    blocked = Quantized(codes, np.array([[2.0, 1.0], [0.5, 4.0]], np.float32), tensor_scale=0.5)
    assert blocked.block == 2
    np.testing.assert_array_equal(blocked.dequantized(), codes * np.array([[1, 0.5], [1, 0.5], [0.25, 2], [0.25, 2]]))
    per_column = Quantized(codes, np.array([2.0, 3.0], np.float32))
    assert per_column.block is None
    np.testing.assert_array_equal(per_column.dequantized(), codes * np.array([2.0, 3.0]))


def test_mxfp4_rounds_as_the_ocp_mx_format() -> None:
    """A power of two per 32 values along K (the block's amax exponent less e2m1's 2), each value to its nearest
    e2m1 code: the same weight as the checkpoint writer of tests/compiler/test_mxfp4_checkpoint.py gives."""
    from tensorsmith.compiler.frontend.mxfp4_weights import dequantize_mxfp4
    from tests.compiler.test_mxfp4_checkpoint import quantize_mxfp4

    weight = (np.random.default_rng(2).standard_normal((2, 64, 24)) * 0.03).astype(np.float32)
    blocks, scales = quantize_mxfp4(weight)
    published = np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2)
    ours = np.stack([FORMATS["mxfp4"].computed(expert) for expert in weight])
    np.testing.assert_array_equal(ours, published)
    quantized = FORMATS["mxfp4"].quantize(weight[0], 32)
    assert quantized.block == 32 and set(np.unique(np.log2(quantized.scales) % 1)) == {0.0}  # powers of two
