"""The precisions the table gained in one record each: bf16 (a float variant, sm_80 and up) and NVFP4 weight-only
(Blackwell), compiled end to end on the tinylm decoder with real tensorrt-rtx engines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.runtime import load
from tests.compiler.test_decoder_quantization import TINYLM

GENERATION = {"max_sequence_length": 128, "max_batch": 2}


@pytest.mark.slow
def test_bf16_variant_for_the_targets_that_run_it(tmp_path: Path) -> None:
    """sm_86 gets variants/bf16.onnx (bf16 tensors, measured on the same rounding in fp32) and its engine; sm_75,
    which has no bf16 kernels, gets fp16 and the manifest says why."""
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint"), "targets": ["sm_75", "sm_86"],
                                   "precision": "bf16", "evaluation": str(TINYLM / "heldout.txt"),
                                   "generation": GENERATION})  # fmt: skip
    result = compile(config, tmp_path / "out")
    variants = {variant.name: variant for variant in result.manifest.variants}
    targets = {target.name: target for target in result.manifest.targets}
    assert targets["sm_86"].variant == "bf16" and targets["sm_86"].status == "built"
    assert targets["sm_75"].variant == "fp16" and "no bf16 kernels" in targets["sm_75"].reason
    bf16 = variants["bf16"]
    assert bf16.precisions == ["bf16", "fp32"] and "bf16 rounding simulated" in bf16.evaluated_on
    assert 1.0 <= bf16.accuracy["perplexity-ratio"] < 1.05 and bf16.accuracy["cosine"] > 0.99
    graph = onnx.load(tmp_path / "out" / bf16.path)
    types = {tensor.data_type for tensor in graph.graph.initializer}
    assert onnx.TensorProto.BFLOAT16 in types and onnx.TensorProto.FLOAT16 not in types


@pytest.mark.slow
def test_nvfp4_weight_only_for_blackwell(tmp_path: Path) -> None:
    """--precision nvfp4: FLOAT4E2M1 weights in blocks of 16 with FLOAT8E4M3FN block scales (two
    DequantizeLinear, opset 23), measured on the same values in fp32, built for sm_120; the cpu gets fp32."""
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint"), "targets": ["cpu", "sm_120"],
                                   "precision": "nvfp4", "evaluation": str(TINYLM / "heldout.txt"),
                                   "generation": GENERATION})  # fmt: skip
    result = compile(config, tmp_path / "out")
    variants = {variant.name: variant for variant in result.manifest.variants}
    targets = {target.name: target for target in result.manifest.targets}
    assert targets["sm_120"].variant == "nvfp4" and targets["sm_120"].status == "built"
    assert targets["cpu"].variant == "fp32"
    nvfp4 = variants["nvfp4"]
    assert 1.0 <= nvfp4.accuracy["perplexity-ratio"] < 1.3, nvfp4.accuracy
    graph = onnx.load(tmp_path / "out" / nvfp4.path)
    types = {tensor.data_type for tensor in graph.graph.initializer}
    assert {onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT8E4M3FN} <= types
    plan = json.loads((tmp_path / "out" / "precision.json").read_text())["recipes"]["nvfp4"]
    assert plan["precision"] == "nvfp4" and plan["quantized_flops_fraction"] > 0.9
    generated = load(tmp_path / "out", backend="onnxruntime").generate(np.array([[1, 5, 9]]), max_new_tokens=3)
    assert generated.shape == (1, 6)
