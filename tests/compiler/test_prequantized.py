"""Pre-quantized checkpoints compile without requantizing: compressed-tensors' pack-quantized INT4 as
compressed-tensors itself writes it, AutoAWQ's GEMM and GPTQ's layouts as their packers define them; each
variant's codes are the checkpoint's, and the artifact generates transformers' tokens for the same checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from tensorsmith.compiler import CompileConfig, compile
from tensorsmith.compiler.frontend.quantized_checkpoint import QuantizedCheckpoint, read_quantized_checkpoint
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.grouped_int4 import AWQ_ORDER
from tests.compiler.test_decoders import COMMON, DECODER, assert_greedy_tokens_match
from tests.conftest import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**COMMON, **{**DECODER, "num_hidden_layers": layers})).to(dtype).eval()


def compressed_tensors_written(directory: Path, scheme: Any, form: str, set_scales: Callable[[Any], None]) -> None:
    """A tiny Llama's Linears quantized by `scheme` and packed in `form` by compressed-tensors' own compressor, as
    llm-compressor saves them: compressed-tensors computes nothing but the packing (its observers live in
    llm-compressor), so `set_scales` gives each quantized module its scales through compressed-tensors' own
    calculate_qparams."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = tiny_llama()
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            set_scales(module)
    compressor = ModelCompressor.from_pretrained_model(model, form)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))


def compressed_tensors_checkpoint(directory: Path, symmetric: bool) -> None:
    """W4A16 in groups of 32: min/max per group."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    arguments = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)

    def set_scales(module: Any) -> None:
        groups = module.weight.detach().float().unflatten(-1, (-1, GROUP))
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), arguments)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)

    scheme = QuantizationScheme(targets=["Linear"], weights=arguments)
    compressed_tensors_written(directory, scheme, "pack-quantized", set_scales)


def _grouped_codes(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric INT4 of `weight` [K, N] in groups of GROUP rows: (codes 0..15, zeros 0..15, fp16 scales)."""
    rows, columns = weight.shape
    groups = weight.reshape(rows // GROUP, GROUP, columns)
    low, high = np.minimum(groups.min(1), 0), np.maximum(groups.max(1), 0)
    scales = ((high - low) / 15).astype(np.float16)
    zeros = np.clip(np.round(-low / scales.astype(np.float32)), 0, 15).astype(np.int32)
    codes = np.round(groups / scales.astype(np.float32)[:, None] + zeros[:, None]).clip(0, 15).astype(np.int32)
    return codes.reshape(rows, columns), zeros, scales


def _pack(codes: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words along the last axis, word c holding columns 8c + order[i] in nibble i (the packers' loops)."""
    words = np.zeros((codes.shape[0], codes.shape[1] // 8), np.uint32)
    for nibble, column in enumerate(order):
        words |= codes[:, column::8].astype(np.uint32) << (4 * nibble)
    return np.ascontiguousarray(words).view(np.int32)


def packed_checkpoint(directory: Path, method: str, layers: int = 2, act_order: bool = False) -> dict[str, np.ndarray]:
    """AutoAWQ's GEMM or GPTQ's original layout of a tiny Llama's Linears; the codes [K, N] by module (in group
    order: GPTQ's act-order groups rows of a permutation, each row's group in `g_idx`, as GPTQ's packer does)."""
    model = tiny_llama(torch.float16, layers)
    model.save_pretrained(directory)
    tensors, stored = load_file(directory / "model.safetensors"), {}
    rng = np.random.default_rng(0)
    for name in [name for name in tensors if name.rsplit(".", 2)[-2] in LINEARS]:
        module = name.removesuffix(".weight")
        weight = tensors.pop(name).float().numpy().T
        order = rng.permutation(weight.shape[0]) if act_order else np.arange(weight.shape[0])
        grouped, zeros, scales = _grouped_codes(weight[order])
        codes, group_of_row = np.empty_like(grouped), np.empty(weight.shape[0], np.int32)
        codes[order], group_of_row[order] = grouped, np.arange(weight.shape[0]) // GROUP
        stored[module] = codes[np.argsort(group_of_row, kind="stable")] - 8  # each group's rows in row order
        if method == "awq":
            qweight, qzeros = _pack(codes, AWQ_ORDER), _pack(zeros, AWQ_ORDER)
        else:  # rows packed along K, zero points stored as zero - 1
            qweight, qzeros = np.ascontiguousarray(_pack(codes.T).T), _pack(zeros - 1)
            tensors[f"{module}.g_idx"] = torch.from_numpy(group_of_row)
        tensors |= {f"{module}.qweight": torch.from_numpy(qweight), f"{module}.qzeros": torch.from_numpy(qzeros),
                    f"{module}.scales": torch.from_numpy(np.ascontiguousarray(scales))}  # fmt: skip
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    settings = {"quant_method": method, "bits": 4, "group_size": GROUP}
    settings |= {"version": "gemm", "zero_point": True} if method == "awq" else {"desc_act": act_order, "sym": False}
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    return stored


def read(directory: Path) -> QuantizedCheckpoint:
    quantized = read_quantized_checkpoint(directory, json.loads((directory / "config.json").read_text()))
    assert quantized is not None
    return quantized


def dequantized_reference(directory: Path) -> Any:
    """transformers' module of the checkpoint with each INT4 weight dequantized by the format's definition."""
    quantized = read(directory)
    model = tiny_llama(torch.float32, json.loads((directory / "config.json").read_text())["num_hidden_layers"])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            module = name.removesuffix(".weight")
            if module in quantized.modules:
                parameter.copy_(torch.from_numpy(quantized.float_weight(module)))
            else:
                parameter.copy_(torch.from_numpy(quantized.weights.array(name)))
    return model


def variant_codes(artifact: Path, variant: str) -> dict[str, np.ndarray]:
    """Each INT4 DequantizeLinear's codes [K, N] in the variant, by the MatMul node that reads it."""
    model = onnx.load(str(artifact / "variants" / f"{variant}.onnx"))
    initializers = {tensor.name: tensor for tensor in model.graph.initializer}
    return {name.removesuffix("/weight_int4"): numpy_helper.to_array(tensor).astype(np.int8)
            for name, tensor in initializers.items() if name.endswith("/weight_int4")}  # fmt: skip


def fp32_activations(artifact: Path) -> Path:
    """The cpu variant's MatMulNBits with fp32 activations (accuracy level 1), whichever level the compile timed
    faster on a busy machine: int8 activations (level 4) move a random tiny model's greedy tokens."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    for variant in manifest["variants"]:
        if variant["name"] == "cpu-int4":
            variant["onnxruntime_session_config"] = {"session.qdq_matmulnbits_accuracy_level": "1"}
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    return artifact


def _assert_codes_are_the_checkpoint_s(artifact: Path, variant: str, stored: dict[str, np.ndarray]) -> None:
    codes = variant_codes(artifact, variant)
    assert len(codes) == len(stored)
    plan = json.loads((artifact / "precision.json").read_text())
    modules = {layer["name"]: layer["module"] for layer in plan["recipes"][variant]["layers"]}
    for node, value in codes.items():
        module = modules[node].removeprefix("model.")
        assert np.array_equal(value, stored[module]), module


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_layouts_unpack_to_the_codes_their_packers_wrote(method: str, tmp_path: Path) -> None:
    stored = packed_checkpoint(tmp_path, method)
    quantized = read(tmp_path)
    assert set(quantized.modules) == set(stored)
    for module, codes in stored.items():
        weight = quantized.weight(module)
        assert weight.group == GROUP and weight.zero_points is not None
        assert np.array_equal(weight.codes, codes), module


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero points"])
def test_compressed_tensors_weights_dequantize_as_transformers_decompresses_them(symmetric: bool,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    compressed_tensors_checkpoint(tmp_path, symmetric)
    decompressed = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.float32
    )
    quantized = read(tmp_path)
    assert len(quantized.modules) == 2 * len(LINEARS)
    parameters = dict(decompressed.named_parameters())
    for module in quantized.modules:
        assert (quantized.weight(module).zero_points is None) == symmetric
        assert np.array_equal(quantized.float_weight(module), parameters[f"{module}.weight"].detach().numpy())


@pytest.mark.slow
def test_a_compressed_tensors_checkpoint_compiles_to_its_own_codes_and_generates_its_tokens(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    compressed_tensors_checkpoint(tmp_path / "checkpoint", symmetric=False)
    quantized = read(tmp_path / "checkpoint")
    stored = {module: quantized.weight(module).codes for module in quantized.modules}
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", "sm_86"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.source.weights == "compressed-tensors pack-quantized int4; the rest bfloat16"
    variants = {target.name: target.variant for target in manifest.targets}
    assert variants == {"cpu": "cpu-int4", "sm_86": "int4"}
    assert {target.name: target.status for target in manifest.targets}["sm_86"] == "built"
    for variant in variants.values():
        _assert_codes_are_the_checkpoint_s(tmp_path / "out", variant, stored)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path / "checkpoint", quantization_config=CompressedTensorsConfig(run_compressed=False), dtype=torch.float32
    )
    assert_greedy_tokens_match(reference.eval(), fp32_activations(tmp_path / "out"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_checkpoints_compile_to_their_own_codes(method: str, tmp_path: Path) -> None:
    stored = packed_checkpoint(tmp_path / "checkpoint", method)
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu"]})
    compile(config, tmp_path / "out")
    _assert_codes_are_the_checkpoint_s(tmp_path / "out", "cpu-int4", stored)
    assert_greedy_tokens_match(dequantized_reference(tmp_path / "checkpoint"), fp32_activations(tmp_path / "out"))


@pytest.mark.slow
def test_a_gptq_act_order_checkpoint_reads_its_input_in_group_order(tmp_path: Path) -> None:
    """desc_act: the codes sorted by group (each group G rows, as stored), one Gather of the MatMul's input."""
    stored = packed_checkpoint(tmp_path / "checkpoint", "gptq", act_order=True)
    for module, codes in stored.items():
        weight = read(tmp_path / "checkpoint").weight(module)
        assert weight.rows is not None and np.array_equal(weight.codes, codes), module
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", "sm_86"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert {target.name: target.status for target in manifest.targets}["sm_86"] == "built"
    _assert_codes_are_the_checkpoint_s(tmp_path / "out", "cpu-int4", stored)
    variant = onnx.load(str(tmp_path / "out" / "variants" / "cpu-int4.onnx"), load_external_data=False)
    assert sum(node.op_type == "Gather" and node.name.endswith("/ActOrder") for node in variant.graph.node) == len(
        stored
    )
    assert_greedy_tokens_match(dequantized_reference(tmp_path / "checkpoint"), fp32_activations(tmp_path / "out"))


@pytest.mark.slow
def test_a_deeper_checkpoint_streams_its_dequantized_weights_into_the_stamped_export(tmp_path: Path) -> None:
    """Four layers: the export traces two and stamps the rest, each INT4 weight read dequantized when the graph
    is written (quantized_checkpoint.DequantizedWeights), never a float32 module of the whole checkpoint."""
    stored = packed_checkpoint(tmp_path / "checkpoint", "awq", layers=4)
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert manifest.source.traced_layers == 2 and len(stored) == 4 * len(LINEARS)
    _assert_codes_are_the_checkpoint_s(tmp_path / "out", "cpu-int4", stored)
    assert_greedy_tokens_match(dequantized_reference(tmp_path / "checkpoint"), fp32_activations(tmp_path / "out"))


def _without(tensor: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        del tensors[tensor]
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    return damage


def _unequal_groups(directory: Path) -> None:
    """A g_idx whose groups are not all G rows (no GPTQ packer writes it)."""
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.g_idx"
    tensors[name][0] = tensors[name][1] + 1
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def quantization_setting(**fields: object) -> Callable[[Path], None]:
    """A damage that sets `fields` in config.json's quantization_config."""

    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"] |= fields
        (directory / "config.json").write_text(json.dumps(config))

    return damage


@pytest.mark.parametrize(("method", "damage", "named"), [
    ("gptq", _unequal_groups, "model.layers.1.self_attn.o_proj.g_idx gives its groups unequal numbers of rows"),
    ("awq", _without("model.layers.0.mlp.up_proj.scales"), "model.layers.0.mlp.up_proj.scales is missing"),
    ("awq", quantization_setting(quant_method="bitsandbytes"), "quant_method is 'bitsandbytes'"),
    ("awq", quantization_setting(bits=8), "gives 8 bits"),
    ("awq", quantization_setting(version="gemv"), "version is 'gemv'"),
    ("awq", quantization_setting(group_size=-1), "group_size is -1"),
], ids=["unequal groups", "missing scales", "unknown method", "8 bits", "gemv packing", "no groups"])  # fmt: skip
def test_a_bad_layout_is_one_line_before_the_export(method: str, damage: Callable[[Path], None], named: str,
                                                     tmp_path: Path) -> None:  # fmt: skip
    packed_checkpoint(tmp_path / "checkpoint", method)
    damage(tmp_path / "checkpoint")
    result = run_cli("compile", tmp_path / "checkpoint", "-o", tmp_path / "out", "--target", "cpu")
    assert result.exit_code != 0 and named in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=named.split(" ")[0]):
        read(tmp_path / "checkpoint")


def test_the_benchmark_s_awq_checkpoints_read_back_within_one_step() -> None:
    """bench/prequantized.py writes AutoAWQ's layout at real shapes: read back, each weight is within one step of
    its group (its scale) of the weight it came from (half a step inside the range; a group's top may clip)."""
    from bench.prequantized import GROUP as BENCH_GROUP
    from bench.prequantized import awq_layout
    from tensorsmith.core.grouped_int4 import awq_int4

    weight = np.random.default_rng(0).standard_normal((96, 256)).astype(np.float32)  # [N, K]
    stored = awq_int4(**awq_layout(weight))
    assert stored.group == BENCH_GROUP and stored.codes.shape == (256, 96)
    steps = np.repeat(stored.scales, BENCH_GROUP, axis=0)
    assert np.all(np.abs(stored.dequantized() - weight.T) <= steps + 1e-6)


def test_requantizing_a_checkpoint_with_awq_still_asks_for_calibration_data(tmp_path: Path) -> None:
    packed_checkpoint(tmp_path, "awq")
    defaults = CompileConfig.create({"source": str(tmp_path), "precision": "int4"})  # the checkpoint's codes
    assert defaults.int4_algorithm == "awq"  # until the source is opened: checkpoint_precision sets "checkpoint"
    with pytest.raises(ConfigError, match="with awq needs calibration data"):
        CompileConfig.create({"source": str(tmp_path), "precision": "int4", "int4_algorithm": "awq"})
