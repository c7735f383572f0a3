"""gpt-oss's MXFP4 checkpoints (`quant_method: mxfp4`) compile as published: the experts' e2m1 blocks and e8m0
scales read dequantized, bit for bit as transformers dequantizes them, and the artifact generates the tokens
transformers generates from the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.mxfp4_weights import E2M1_VALUES, E8M0_BIAS, Mxfp4Weights, dequantize_mxfp4
from tensorsmith.compiler.frontend.quantized_checkpoint import checkpoint_weights
from tensorsmith.core.errors import ConfigError, ExportError
from tests.compiler.test_decoders import assert_greedy_tokens_match
from tests.families import save_family

EXPERTS = ("gate_up_proj", "down_proj")


def quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, K, N] float32 → (blocks [E, N, K/32, 16] uint8, scales [E, N, K/32] uint8), as the OCP MX format
    rounds: a power of two per 32 values along K (their amax's exponent less e2m1's 2), each value to the nearest
    e2m1 code, saturated at ±6."""
    values = np.swapaxes(weight, -1, -2).reshape(*weight.shape[:-2], weight.shape[-1], -1, 32)
    amax = np.abs(values).max(axis=-1, keepdims=True)
    exponent = np.floor(np.log2(np.maximum(amax, 2.0**-100))) - 2
    scaled = np.clip(values / 2.0**exponent, -6.0, 6.0)
    codes = np.abs(np.abs(scaled)[..., None] - E2M1_VALUES[:8]).argmin(axis=-1).astype(np.uint8) | (
        scaled < 0
    ) * np.uint8(8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent[..., 0] + E8M0_BIAS).astype(np.uint8)


def mxfp4_checkpoint(directory: Path) -> None:
    """A tiny gpt-oss checkpoint as OpenAI publishes it: every expert weight in MXFP4, the rest bf16."""
    save_family("gpt_oss", directory)
    tensors = load_file(directory / "model.safetensors")
    for name in [name for name in tensors if name.endswith(tuple(f"experts.{part}" for part in EXPERTS))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).float().numpy())
        tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))


def transformers_dequantized(directory: Path) -> torch.nn.Module:
    """transformers' module of the checkpoint: on a machine without a GPU it dequantizes the MXFP4 experts."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def test_mxfp4_experts_dequantize_as_transformers_loads_them(tmp_path: Path) -> None:
    mxfp4_checkpoint(tmp_path)
    weights = checkpoint_weights(tmp_path)
    assert isinstance(weights, Mxfp4Weights) and len(weights.stands_for()) == 2 * len(EXPERTS)
    parameters = dict(transformers_dequantized(tmp_path).named_parameters())
    for name in weights.stands_for():
        assert weights.shape(name) == tuple(parameters[name].shape), name
        assert np.array_equal(weights.array(name), parameters[name].detach().numpy()), name


def test_an_exponent_of_255_is_nan_and_refused_naming_the_scales(tmp_path: Path) -> None:
    assert np.isnan(dequantize_mxfp4(np.zeros((1, 16), np.uint8), np.array([255], np.uint8))).all()
    mxfp4_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][0, 0, 0] = 255
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_scales .* 32 NaN"):
        checkpoint_weights(tmp_path).array("model.layers.1.mlp.experts.down_proj")
    # and the compile, which loads gpt-oss's module whole, never hands the checkpoint to transformers' own loader
    with pytest.raises(ExportError, match=r"down_proj_scales .* 32 NaN"):
        compile(CompileConfig.create({"source": str(tmp_path), "targets": ["cpu"]}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unstacked_weight_s_blocks_are_refused_by_name(tmp_path: Path) -> None:
    """A Linear's [N, K/32, 16] would read back transposed (square projections cannot tell): only stacked experts."""
    mxfp4_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for part in ("blocks", "scales"):
        tensors[f"model.layers.0.mlp.experts.down_proj_{part}"] = tensors[
            f"model.layers.0.mlp.experts.down_proj_{part}"
        ][0]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"down_proj_blocks \[64, 4, 16\] .* not stacked experts"):
        checkpoint_weights(tmp_path)


def test_blocks_without_their_scales_are_one_line(tmp_path: Path) -> None:
    mxfp4_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"gate_up_proj_scales is missing beside .*gate_up_proj_blocks"):
        compile(CompileConfig.create({"source": str(tmp_path), "targets": ["cpu"]}), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_mxfp4_checkpoint_compiles_and_generates_transformers_tokens(tmp_path: Path) -> None:
    """For the cpu and Ampere: the dequantized experts, the GPU variant in the checkpoint's bf16."""
    mxfp4_checkpoint(tmp_path / "checkpoint")
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", "sm_86"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.source.weights is not None and manifest.source.weights.startswith("mxfp4 experts")
    assert {target.name: (target.variant, target.status) for target in manifest.targets} == {
        "cpu": ("fp32", "not-needed"),
        "sm_86": ("bf16", "built"),
    }
    assert manifest.generation is not None  # gpt-oss keeps the dynamic cache here (the manifest says why)
    reference = transformers_dequantized(tmp_path / "checkpoint")
    assert_greedy_tokens_match(reference, tmp_path / "out", kv_cache=manifest.generation.kv_cache)


def _stacked_codes(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each FLOAT4E2M1 stacked weight a branch of the graph at `path` reads: (codes as float32, scales)."""
    from onnx import numpy_helper

    found = {}

    def walk(graph: onnx.GraphProto) -> None:
        initializers = {tensor.name: tensor for tensor in graph.initializer}
        for node in graph.node:
            codes = initializers.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
            if codes is not None and codes.data_type == onnx.TensorProto.FLOAT4E2M1:
                values = numpy_helper.to_array(codes).astype(np.float32)
                found[codes.name] = (values, numpy_helper.to_array(initializers[node.input[1]]))
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    walk(attribute.g)

    walk(onnx.load(str(path)).graph)
    return found


@pytest.mark.slow
def test_blackwell_keeps_the_experts_mxfp4_codes_as_published(tmp_path: Path) -> None:
    """sm_120 runs mxfp4: its variant reads the checkpoint's own e2m1 codes and power-of-two scales, nothing
    requantized, and its engine builds; the cpu computes the dequantized experts."""
    mxfp4_checkpoint(tmp_path / "checkpoint")
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", "sm_120"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert {target.name: (target.variant, target.status) for target in manifest.targets} == {
        "cpu": ("fp32", "not-needed"),
        "sm_120": ("mxfp4", "built"),
    }
    (variant,) = [variant for variant in manifest.variants if variant.name == "mxfp4"]
    stacked = _stacked_codes(tmp_path / "out" / variant.path)
    stored = load_file(tmp_path / "checkpoint" / "model.safetensors")
    assert len(stacked) == 2 * len(EXPERTS)  # two layers
    for name, (codes, scales) in stacked.items():
        checkpoint_name = name.removesuffix("/codes").removeprefix("model.")
        blocks, exponents = stored[f"{checkpoint_name}_blocks"].numpy(), stored[f"{checkpoint_name}_scales"].numpy()
        expected = np.empty((*blocks.shape[:-1], 32), np.float32)
        expected[..., 0::2], expected[..., 1::2] = E2M1_VALUES[blocks & 0x0F], E2M1_VALUES[blocks >> 4]
        np.testing.assert_array_equal(codes, np.swapaxes(expected.reshape(*blocks.shape[:-2], -1), -1, -2))
        np.testing.assert_array_equal(scales, np.swapaxes(np.exp2(exponents.astype(np.float32) - E8M0_BIAS), -1, -2))
    recipe = json.loads((tmp_path / "out" / "precision.json").read_text())["recipes"]["mxfp4"]
    assert recipe["stacked_experts"].endswith("the checkpoint's own codes and scales")
    assert variant.accuracy["cosine"] > 0.9999  # measured on the same values in float32
