"""A mixture of experts compiled to INT4: the GPU variant stores its stacked experts' weights in INT4 too (each
branch of the routed layer reads them through a DequantizeLinear) and its engine builds; the cpu variant keeps
them in float, and precision.json says both."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import load
from tests.families import save_family


def _branch_dequantizers(path: Path) -> list[tuple[list[int], int]]:
    """(codes' shape, their ONNX type) of each DequantizeLinear inside an If branch of the graph at `path`."""
    found = []

    def walk(graph: onnx.GraphProto, inside: bool) -> None:
        initializers = {tensor.name: tensor for tensor in graph.initializer}
        for node in graph.node:
            if inside and node.op_type == "DequantizeLinear" and node.input[0] in initializers:
                codes = initializers[node.input[0]]
                found.append((list(codes.dims), codes.data_type))
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    walk(attribute.g, True)

    walk(onnx.load(str(path), load_external_data=False).graph, False)
    return found


@pytest.mark.slow
def test_int4_reaches_the_stacked_experts_of_the_gpu_variant(tmp_path: Path) -> None:
    save_family("mixtral", tmp_path / "checkpoint")
    config = CompileConfig.create(
        {
            "source": str(tmp_path / "checkpoint"),
            "targets": ["cpu", "sm_86"],
            "precision": "int4",
            "int4_algorithm": "rtn",
        }
    )
    manifest = compile(config, tmp_path / "out").manifest
    assert {target.name: (target.variant, target.status) for target in manifest.targets} == {
        "cpu": ("cpu-int4", "not-needed"),
        "sm_86": ("int4", "built"),
    }
    variants = {variant.name: variant for variant in manifest.variants}
    stacked = _branch_dequantizers(tmp_path / "out" / variants["int4"].path)
    # two layers' gate/up and down projections (4 weights), each read in both branches: all INT4, [experts, ·, ·]
    assert len(stacked) == 8 and all(len(shape) == 3 and kind == onnx.TensorProto.INT4 for shape, kind in stacked)
    assert _branch_dequantizers(tmp_path / "out" / variants["cpu-int4"].path) == []
    recipes = json.loads((tmp_path / "out" / "precision.json").read_text())["recipes"]
    assert recipes["int4"]["stacked_experts"].startswith("4 stacked weights in int4")
    assert recipes["cpu-int4"]["stacked_experts"].startswith("float: ONNX Runtime would dequantize every expert")
    assert variants["int4"].accuracy["cosine"] > 0.8  # measured on ONNX Runtime, experts in INT4
    generated = load(tmp_path / "out", backend="onnxruntime").generate(np.array([[1, 5, 9]]), max_new_tokens=4)
    assert generated.shape == (1, 7)
