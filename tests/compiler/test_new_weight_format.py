"""Adding a weight format is one precision record and one module (passes/weight_formats/base.py): a format made
in a temporary directory, outside the package, compiles a tiny decoder and generates with it."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from tensorsmith.core import precisions
from tensorsmith.passes.weight_formats import table
from tensorsmith.runtime import load
from tests.compiler.test_decoder_quantization import TINYLM
from tests.conftest import run_cli

# int8 codes with a float32 scale per block of 32 rows of K and column: no format of the table stores that
FORMAT_MODULE = """
    import numpy as np

    from tensorsmith.core.elements import Element
    from tensorsmith.core.precisions import CPU_BACKENDS, Family, Precision, Quantizes, from_capability
    from tensorsmith.passes.weight_formats.base import Quantized, WeightFormat

    RECORD = Precision(
        "int8-block32",
        Element.INT8,
        Quantizes.WEIGHTS,
        Family.WEIGHT_ONLY,
        "int8 weights, a float32 scale per block of 32 rows of K and column",
        from_capability(80),
        CPU_BACKENDS,
        block=32,
        scale="float32 per block of 32 rows and column",
        min_opset=21,
    )


    class Int8Blocks(WeightFormat):
        def quantize(self, weight, block):
            rows, columns = weight.shape
            blocks = weight.reshape(rows // block, block, columns)
            scales = np.maximum(np.abs(blocks).max(axis=1), 1e-12) / 127
            codes = np.clip(np.rint(blocks / scales[:, None, :]), -127, 127)
            return Quantized(codes.reshape(rows, columns).astype(np.int8), scales.astype(np.float32))


    FORMAT = Int8Blocks(RECORD)
"""


@pytest.fixture
def int8_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    """The module above, imported from a file of its own, its record and format added to the two tables."""
    path = tmp_path / "int8_blocks.py"
    path.write_text(textwrap.dedent(FORMAT_MODULE))
    spec = importlib.util.spec_from_file_location("int8_blocks", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(precisions.PRECISIONS, module.RECORD.name, module.RECORD)
    monkeypatch.setitem(table.FORMATS, module.RECORD.name, module.FORMAT)
    return module


@pytest.mark.slow
def test_a_format_from_one_record_and_one_module_compiles_a_decoder(int8_blocks: object, tmp_path: Path) -> None:
    assert "int8-block32" in precisions.requestable()  # `--precision`'s choices ask the table
    out = tmp_path / "out"
    result = run_cli(
        "compile", TINYLM / "checkpoint", "-o", out, "--target", "cpu", "--precision", "int8-block32",
        "--eval-data", TINYLM / "heldout.txt", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    compiled = json.loads(result.stdout)
    variants = {variant["name"]: variant for variant in compiled["variants"]}
    variant = variants["cpu-int8-block32"]
    assert variant["shipped"] and variant["precisions"][0] == "int8-block32"
    graph = onnx.load(str(out / variant["path"]), load_external_data=False).graph
    weights = {tensor.name: tensor for tensor in graph.initializer}
    blocks = [node for node in graph.node if node.op_type == "DequantizeLinear" and node.input[0] in weights]
    assert blocks, "the weights are read through DequantizeLinear"
    for node in blocks:
        attributes = {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}
        codes = weights[node.input[0]]
        if codes.name.endswith("/weight_codes"):  # the new format's, not the vocabulary table's int8 rows
            assert codes.data_type == onnx.TensorProto.INT8 and attributes == {"axis": 0, "block_size": 32}
    assert sum(weights[node.input[0]].name.endswith("/weight_codes") for node in blocks) > 0
    plan = json.loads((out / "precision.json").read_text())["recipes"]["cpu-int8-block32"]
    stored = [layer for layer in plan["layers"] if layer["precision"] == "int8-block32"]
    assert stored and all(layer["reason"].startswith("int8-block32: int8 weights") for layer in stored)
    assert variant["accuracy"]["next-token-agreement"] > 0.9  # int8 in blocks of 32 barely moves the logits
    generated = load(out, backend="onnxruntime").generate(np.array([[1, 5, 9]]), max_new_tokens=4)
    assert generated.shape == (1, 7)
