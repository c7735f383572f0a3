"""INT4 weight-only variants: the form TensorRT takes (packed INT4, blockwise DequantizeLinear along K, zero points
0), AWQ against round-to-nearest on tinylm's held-out text, engines for the RTX targets that run INT4 (sm_75
gets fp16 and says why), a second decoder of another shape with block 64, and a decoder's auto."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.variants.cpu_backend import MIN_GAIN
from tensorsmith.compiler.variants.cpu_choice import within_tolerance
from tensorsmith.passes.int4 import dequantize_int4, quantize_int4
from tensorsmith.passes.int4_codes import INT4_MAX
from tensorsmith.runtime import load
from tests.compiler.test_decoder_quantization import TINYLM, calibration_text

GPU_INT4 = ["sm_86", "sm_89", "sm_120"]


def test_blockwise_int4_rounds_within_half_a_step() -> None:
    weight = np.random.default_rng(0).standard_normal((256, 48)).astype(np.float32)
    q, scale = quantize_int4(weight, 128)
    assert q.min() >= -8 and q.max() <= INT4_MAX and scale.shape == (2, 48)
    error = np.abs(dequantize_int4(q, scale, 128) - weight).reshape(2, 128, 48)
    assert (error <= scale[:, None, :] / 2 + 1e-6).all()
    _, smaller = quantize_int4(weight, 128, np.full((2, 48), 0.5, np.float32))
    assert np.allclose(smaller, scale * 0.5)


def _compile(out: Path, algorithm: str, text: Path, targets: list[str]) -> dict:
    config = CompileConfig.create(
        {"source": str(TINYLM / "checkpoint"), "targets": targets, "precision": "int4", "int4_algorithm": algorithm,
         "calibration": str(text), "calibration_samples": 32, "evaluation": str(TINYLM / "heldout.txt"),
         "generation": {"max_sequence_length": 256, "max_batch": 4}}
    )  # fmt: skip
    manifest = compile(config, out).manifest
    return {variant.name: variant for variant in manifest.variants} | {"targets": manifest.targets}


@pytest.mark.slow
def test_awq_beats_round_to_nearest_and_engines_build(tmp_path: Path) -> None:
    text = calibration_text(tmp_path / "calibration.txt")
    awq = _compile(tmp_path / "awq", "awq", text, ["cpu", "sm_75", *GPU_INT4])
    rtn = _compile(tmp_path / "rtn", "rtn", text, ["cpu"])  # (no engine needed to compare)
    assert 1.0 < awq["cpu-int4"].accuracy["perplexity-ratio"] < rtn["cpu-int4"].accuracy["perplexity-ratio"]
    # the GPU variant at most 30 % of the fp16 one (the sm_75 fallback), vocabulary table in INT4 too
    sizes = {name: os.path.getsize(tmp_path / "awq" / awq[name].path) for name in ("int4", "fp16")}
    assert sizes["int4"] <= 0.30 * sizes["fp16"], sizes
    model = onnx.load(str(tmp_path / "awq" / awq["int4"].path))
    weights = {t.name: t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT4}
    assert weights and all(len(t.raw_data) == int(np.prod(t.dims)) // 2 for t in weights.values())  # packed
    dequantize = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights]
    blocks = set()
    for node in dequantize:
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        blocks.add((attributes["axis"], attributes["block_size"]))
        zero = onnx.numpy_helper.to_array(weights[node.input[2]])
        assert not zero.astype(np.int8).any()
    assert blocks == {(0, 128), (1, 32)}  # weights along K; the vocabulary table along its rows
    # tinylm ties its output projection to the vocabulary table: one INT4 table serves both
    (table,) = [n for n in dequantize if n.input[0].endswith("/int4/quantized")]
    readers = [n.op_type for n in model.graph.node if table.output[0] in n.input]
    assert sorted(readers) == ["Gather", "Transpose"]
    by_target = {target.name: target for target in awq["targets"]}
    for name in GPU_INT4:
        target = by_target[name]
        assert target.status == "built" and target.variant == "int4", target.reason
        assert target.engine is not None and target.engine.profile_names == ["prefill", "decode"]
    assert by_target["sm_75"].variant == "fp16" and "no int4 kernels" in by_target["sm_75"].reason
    # the cpu variant's MatMulNBits accuracy level was measured, recorded, and the runtime's session has it
    level = awq["cpu-int4"].onnxruntime_session_config["session.qdq_matmulnbits_accuracy_level"]
    choice = json.loads((tmp_path / "awq" / "precision.json").read_text())["recipes"]["cpu-int4"]["cpu"]
    metric = choice["metric"]["perplexity-ratio"]
    fast, exact = metric["accuracy level 4"], metric["accuracy level 1"]
    latency = choice["latency_ms_batch8"]
    faster = latency["accuracy level 4"] < (1 - MIN_GAIN) * latency["accuracy level 1"]
    assert level == ("4" if faster and within_tolerance(fast, exact) else "1"), choice
    model = load(tmp_path / "awq", backend="onnxruntime")
    options = model._backend._session.get_session_options()  # type: ignore[attr-defined]
    assert options.get_session_config_entry("session.qdq_matmulnbits_accuracy_level") == level
    prompt = np.array([[1, 40, 41, 42, 43]], np.int64)
    assert model.generate(prompt, max_new_tokens=8).shape == (1, 13)


def _second_decoder(directory: Path) -> None:
    """A Llama of another shape than tinylm: hidden 256, one KV head for 4, vocab 1024, seeded weights; its MLP's
    intermediate size 544 is not a multiple of the block 64 (down_proj's K: block 32 there, as SmolLM's 576 at 128)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=544, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                      vocab_size=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.15)
    model.save_pretrained(str(directory))


@pytest.mark.slow
def test_a_second_decoder_with_another_shape_and_block(tmp_path: Path) -> None:
    """AWQ below RTN, the INT4 variant at most 30 % of fp16's, engines for sm_86/89/120 with both profiles, and
    generate on ONNX Runtime, for a decoder of another shape with block 64 and token ids as data; every weight
    MatMul in INT4, down_proj (K 544) in blocks of 32."""
    _second_decoder(tmp_path / "checkpoint")
    for name, seed in (("tokens", 0), ("evaluation", 1)):
        ids = np.random.default_rng(seed).integers(3, 1024, (32, 64)).astype(np.int64)
        np.savez(tmp_path / f"{name}.npz", input_ids=ids)
    results = {}
    for algorithm, targets in (("rtn", ["cpu"]), ("awq", ["cpu", "sm_75", *GPU_INT4])):
        config = CompileConfig.create(
            {"source": str(tmp_path / "checkpoint"), "targets": targets, "precision": "int4",
             "int4_algorithm": algorithm, "int4_block_size": 64, "calibration": str(tmp_path / "tokens.npz"),
             "evaluation": str(tmp_path / "evaluation.npz")}
        )  # fmt: skip
        results[algorithm] = compile(config, tmp_path / algorithm).manifest
    variants = {name: {v.name: v for v in manifest.variants} for name, manifest in results.items()}
    # a random model on random tokens: the ratio may fall below 1, but AWQ's stays below RTN's
    awq, rtn = (variants[name]["cpu-int4"].accuracy["perplexity-ratio"] for name in ("awq", "rtn"))
    assert awq < rtn
    sizes = {name: os.path.getsize(tmp_path / "awq" / variants["awq"][name].path) for name in ("int4", "fp16")}
    assert sizes["int4"] <= 0.30 * sizes["fp16"], sizes
    quantized = next(record for record in results["awq"].passes if record.name == "weight_only_int4")
    assert quantized.details["block_size"] == 64 and quantized.counts["skipped"] == 0
    plan = json.loads((tmp_path / "awq" / "precision.json").read_text())["recipes"]["int4"]
    assert plan["quantized_flops_fraction"] == 1.0
    down = [layer for layer in plan["layers"] if layer["module"].endswith("down_proj")]
    assert down and all(layer["precision"] == "int4" and "block 32" in layer["reason"] for layer in down)
    for target in results["awq"].targets[2:]:
        assert target.status == "built" and target.variant == "int4", target.reason
        assert target.engine is not None and target.engine.profile_names == ["prefill", "decode"]
    generated = load(tmp_path / "awq", backend="onnxruntime").generate(np.array([[1, 5, 9]]), max_new_tokens=5)
    assert generated.shape == (1, 8)


@pytest.mark.slow
def test_auto_chooses_each_weight_layer_within_a_perplexity_budget(tmp_path: Path) -> None:
    """A decoder's `auto`: int4 / int8 (weight-only or W8A8) / float per layer, the budget met on held-out text by
    the verified variant, every layer's choice and reason in precision.json (an override pins one); W8A8 (int8,
    fp8) and NVFP4 (every GPU target is Blackwell) for the GPU variant only, engines built with both profiles."""

    text = calibration_text(tmp_path / "calibration.txt")
    config = CompileConfig.create(
        {"source": str(TINYLM / "checkpoint"), "targets": ["cpu", "sm_120"], "precision": "auto",
         "budget": "perplexity-ratio<=1.03", "calibration": str(text), "calibration_samples": 32,
         "evaluation": str(TINYLM / "heldout.txt"), "generation": {"max_sequence_length": 256, "max_batch": 4},
         "overrides": [{"match": "*lm_head", "precision": "int8-weight"}]}
    )  # fmt: skip
    result = compile(config, tmp_path / "out")
    assert result.budget_met, result.unmet_budgets
    variants = {variant.name: variant for variant in result.manifest.variants}
    plan = json.loads((tmp_path / "out" / "precision.json").read_text())
    assert plan["budget"] == "perplexity-ratio<=1.03"
    for name in ("int4", "cpu-int4"):
        assert variants[name].accuracy["perplexity-ratio"] <= 1.03
        recipe = plan["recipes"][name]
        assert recipe["met"] and recipe["achieved"] <= 1.03
        assert all(recipe["weight_levels"][level].startswith("considered") for level in ("int8", "fp8", "nvfp4"))
        levels = {layer["precision"] for layer in recipe["layers"]}
        allowed = (
            {"int4", "int8-weight", "fp32"}
            if name == "cpu-int4"
            else {"int4", "nvfp4", "int8-weight", "int8", "fp8", "fp16"}
        )
        assert "int4" in levels and levels <= allowed, levels
        (head,) = [layer for layer in recipe["layers"] if layer["module"].endswith("lm_head")]
        assert head["precision"] == "int8-weight" and head["reason"] == "override '*lm_head'"
        others = [layer for layer in recipe["layers"] if layer is not head]
        assert all(layer["reason"].startswith("search") and layer["module"] for layer in others)
        assert any("at half a byte a weight" in layer["reason"] and "nvfp4" in layer["reason"] for layer in others)
    fp32_bytes = os.path.getsize(tmp_path / "out" / "model.onnx")
    assert os.path.getsize(tmp_path / "out" / variants["int4"].path) < 0.5 * fp32_bytes / 2  # under half of fp16's
    target = result.manifest.targets[1]
    assert target.status == "built" and target.variant == "int4" and target.engine is not None, target.reason
    assert target.engine.profile_names == ["prefill", "decode"]


def test_gemm_weights_become_matmuls_int4_can_take(tmp_path: Path) -> None:
    """GPT-2's Conv1D and TorchScript's nn.Linear export as Gemm; the int4 stage reads them as MatMul + Add."""
    import torch

    from tensorsmith.passes.int4 import GemmAsMatMul
    from tests.passes.graphs import apply, assert_same_outputs, ops

    path = tmp_path / "linear.onnx"
    torch.onnx.export(torch.nn.Linear(128, 64).eval(), (torch.randn(3, 128),), str(path), dynamo=False,
                      opset_version=17, input_names=["x"])  # fmt: skip
    source = onnx.load(str(path))
    assert ops(source)["Gemm"] == 1
    rewritten, (report,) = apply(source, [GemmAsMatMul()])
    assert report.counts["gemms_rewritten"] == 1 and ops(rewritten)["Gemm"] == 0 and ops(rewritten)["MatMul"] == 1
    assert_same_outputs(source, rewritten, {"x": np.random.default_rng(0).standard_normal((3, 128), np.float32)})
