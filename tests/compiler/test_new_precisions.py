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


def compiled_tinylm(out: Path, precision: str, targets: list[str]) -> tuple[dict, dict]:
    """tinylm compiled with `precision` for `targets`: (variant name → record, target name → record)."""
    config = CompileConfig.create({"source": str(TINYLM / "checkpoint"), "targets": targets, "precision": precision,
                                   "evaluation": str(TINYLM / "heldout.txt"), "generation": GENERATION})  # fmt: skip
    manifest = compile(config, out).manifest
    return {v.name: v for v in manifest.variants}, {t.name: t for t in manifest.targets}


def initializer_types(path: Path) -> set[int]:
    return {tensor.data_type for tensor in onnx.load(path).graph.initializer}


@pytest.mark.slow
def test_bf16_variant_for_the_targets_that_run_it(tmp_path: Path) -> None:
    """sm_86 gets variants/bf16.onnx (bf16 tensors, measured on the same rounding in fp32) and its engine; sm_75,
    which has no bf16 kernels, gets fp16 and the manifest says why."""
    variants, targets = compiled_tinylm(tmp_path / "out", "bf16", ["sm_75", "sm_86"])
    assert targets["sm_86"].variant == "bf16" and targets["sm_86"].status == "built"
    assert targets["sm_75"].variant == "fp16" and "no bf16 kernels" in targets["sm_75"].reason
    bf16 = variants["bf16"]
    assert bf16.precisions == ["bf16", "fp32"] and "bf16 rounding simulated" in bf16.evaluated_on
    assert 1.0 <= bf16.accuracy["perplexity-ratio"] < 1.05 and bf16.accuracy["cosine"] > 0.99
    types = initializer_types(tmp_path / "out" / bf16.path)
    assert onnx.TensorProto.BFLOAT16 in types and onnx.TensorProto.FLOAT16 not in types


@pytest.mark.slow
def test_nvfp4_weight_only_for_blackwell(tmp_path: Path) -> None:
    """--precision nvfp4: FLOAT4E2M1 weights in blocks of 16 with FLOAT8E4M3FN block scales (two
    DequantizeLinear, opset 23), measured on the same values in fp32, built for sm_120; the cpu gets fp32."""
    variants, targets = compiled_tinylm(tmp_path / "out", "nvfp4", ["cpu", "sm_120"])
    assert targets["sm_120"].variant == "nvfp4" and targets["sm_120"].status == "built"
    assert targets["cpu"].variant == "fp32"
    nvfp4 = variants["nvfp4"]
    assert 1.0 <= nvfp4.accuracy["perplexity-ratio"] < 1.3, nvfp4.accuracy
    types = initializer_types(tmp_path / "out" / nvfp4.path)
    assert {onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT8E4M3FN} <= types
    plan = json.loads((tmp_path / "out" / "precision.json").read_text())["recipes"]["nvfp4"]
    assert plan["precision"] == "nvfp4" and plan["quantized_flops_fraction"] > 0.9
    generated = load(tmp_path / "out", backend="onnxruntime").generate(np.array([[1, 5, 9]]), max_new_tokens=3)
    assert generated.shape == (1, 6)
