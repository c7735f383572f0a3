"""Float-coded checkpoints as they are published: DeepSeek's block-scaled FP8 (transformers' FineGrainedFP8,
written here by its definition), compressed-tensors' float-quantized FP8 and NVFP4 (written by compressed-tensors'
own compressors), Model Optimizer's FP8 and NVFP4 exports (by their definitions). Each reads back to the weights
transformers dequantizes (or the definition, where transformers does not load it on a CPU), and compiles to an
artifact that generates the same checkpoint's tokens, its codes kept where a target runs them."""

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
from tensorsmith.compiler.add_engine import variant_for
from tensorsmith.compiler.frontend.quantized_checkpoint import read_quantized_checkpoint
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.quantization_declared import declares_quantization
from tests.compiler.test_decoders import assert_greedy_tokens_match
from tests.compiler.test_prequantized import (
    LINEARS,
    compressed_tensors_written,
    dequantized_reference,
    quantization_setting,
    read,
    tiny_llama,
)
from tests.conftest import run_cli

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
BLOCK = 32  # the tiny model's sizes (64, 128; 32 for keys and values) in whole blocks, as 128 divides real ones
FP8_MAX = 448.0


def block_fp8_checkpoint(
    directory: Path, layers: int = 2, block: tuple[int, int] = (BLOCK, BLOCK)
) -> dict[str, np.ndarray]:
    """Every decoder-layer Linear in float8 e4m3 with a float32 `weight_scale_inv` per block [bn, bk] (amax / 448;
    a partial last block along N where bn does not divide it, as DeepSeek-V3's 576-row kv_a_proj_with_mqa has), as
    DeepSeek-V3 and transformers' FineGrainedFP8 store them; the codes [N, K] as float32, by module."""
    tiny_llama(torch.bfloat16, layers).save_pretrained(directory)
    tensors, stored = load_file(directory / "model.safetensors"), {}
    rows_block, columns_block = block
    for name in [name for name in tensors if name.rsplit(".", 2)[-2] in LINEARS]:
        weight = tensors[name].float()
        rows, columns = weight.shape
        padded = torch.nn.functional.pad(weight, (0, 0, 0, -rows % rows_block))
        blocks = padded.reshape(-1, rows_block, columns // columns_block, columns_block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        codes = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows].to(torch.float8_e4m3fn)
        tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = codes, scale.contiguous()
        stored[name.removesuffix(".weight")] = codes.float().numpy()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    settings = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    return stored


def modelopt_fp8_checkpoint(directory: Path, algorithm: str = "FP8_PB_WO") -> dict[str, np.ndarray]:
    """Model Optimizer's FP8 export as vLLM reads it: `weight` float8 [N, K] and `weight_scale` per tensor ([]),
    per output channel ([N]) or per block ([N/32, 1, K/32, 1]: its 4-D form); the dequantized weights by module."""
    tiny_llama(torch.bfloat16).save_pretrained(directory)
    tensors, dequantized = load_file(directory / "model.safetensors"), {}
    for name in [name for name in tensors if name.rsplit(".", 2)[-2] in LINEARS]:
        weight = tensors[name].float()
        rows, columns = weight.shape
        if algorithm == "FP8_PB_WO":
            blocks = weight.reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
            scale = (blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).transpose(1, 2).contiguous()
            spread = scale.transpose(1, 2).expand(-1, BLOCK, -1, BLOCK).reshape(rows, columns)
        else:
            scale = weight.abs().amax(dim=1) / FP8_MAX if algorithm != "FP8" else weight.abs().amax() / FP8_MAX
            spread = scale[:, None] if scale.ndim else scale
        codes = (weight / spread).to(torch.float8_e4m3fn)
        tensors[name], tensors[name.replace(".weight", ".weight_scale")] = codes, scale
        dequantized[name.removesuffix(".weight")] = (codes.float() * spread).numpy()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    settings = {"quant_method": "modelopt", "quant_algo": algorithm, "ignore": ["lm_head"]}
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    return dequantized


def per_tensor_modelopt(directory: Path) -> dict[str, np.ndarray]:
    return modelopt_fp8_checkpoint(directory, "FP8")


def older_modelopt(directory: Path, algorithm: str = "FP8") -> dict[str, np.ndarray]:
    """The same export in Model Optimizer's older form: config.json without `quantization_config`, the settings in
    `hf_quant_config.json` beside it (as vLLM and TensorRT-LLM read such a checkpoint)."""
    dequantized = modelopt_fp8_checkpoint(directory, algorithm)
    config = json.loads((directory / "config.json").read_text())
    settings = config.pop("quantization_config")
    (directory / "config.json").write_text(json.dumps(config))
    quantization = {"quant_algo": settings["quant_algo"], "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    published = {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": quantization}
    (directory / "hf_quant_config.json").write_text(json.dumps(published))
    return dequantized


def compressed_tensors_fp8_checkpoint(directory: Path) -> None:
    """llm-compressor's FP8_DYNAMIC scheme (a scale per output channel, activations quantized per token when
    run), packed by compressed-tensors' float-quantized compressor."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])

    def set_scales(module: Any) -> None:
        weight = module.weight.detach().float()
        scale, _ = calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), scheme.weights)
        module.weight_scale.data.copy_(scale)

    compressed_tensors_written(directory, scheme, "float-quantized", set_scales)


def compressed_tensors_nvfp4_checkpoint(directory: Path) -> None:
    """llm-compressor's NVFP4A16 scheme (e2m1 weights in groups of 16, fp8 group scales under a global scale),
    packed by compressed-tensors' nvfp4-pack-quantized compressor; the global scale from its generate_gparam."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])

    def set_scales(module: Any) -> None:
        weight = module.weight.detach().float()
        global_scale = generate_gparam(weight.amin(), weight.amax())
        module.weight_global_scale.data.copy_(global_scale.reshape(module.weight_global_scale.shape))
        groups = weight.unflatten(-1, (-1, 16))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))

    compressed_tensors_written(directory, scheme, "nvfp4-pack-quantized", set_scales)


def transformers_dequantized(directory: Path) -> Any:
    """transformers' own module of the checkpoint, its FP8 weights dequantized as it loads them on a CPU (Model
    Optimizer's, which transformers does not load, dequantized by its definition: the test above checks it)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    method = json.loads((directory / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    if method in ("modelopt", None):  # None: Model Optimizer's older hf_quant_config.json
        return dequantized_reference(directory)
    options = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if method != "fp8" else {}
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **options).eval()


@pytest.mark.parametrize("write", [block_fp8_checkpoint, compressed_tensors_fp8_checkpoint,
                                   compressed_tensors_nvfp4_checkpoint], ids=["blocks", "ct", "ct nvfp4"])  # fmt: skip
def test_fp8_weights_dequantize_as_transformers_loads_them(write: Callable[[Path], Any], tmp_path: Path) -> None:
    write(tmp_path)
    quantized = read(tmp_path)
    assert quantized.element.value in ("float8e4m3fn", "float4e2m1") and len(quantized.modules) == 2 * len(LINEARS)
    parameters = dict(transformers_dequantized(tmp_path).named_parameters())
    for module in quantized.modules:
        expected = parameters[f"{module}.weight"].detach().numpy()
        assert np.array_equal(quantized.float_weight(module), expected), module


@pytest.mark.parametrize("algorithm", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"])
def test_model_optimizer_fp8_dequantizes_by_its_definition(algorithm: str, tmp_path: Path) -> None:
    expected = modelopt_fp8_checkpoint(tmp_path, algorithm)
    quantized = read(tmp_path)
    assert quantized.described == f"modelopt {algorithm.lower()} (fp8 e4m3)" and quantized.modules == tuple(
        sorted(expected)
    )
    for module, weight in expected.items():
        assert np.array_equal(quantized.float_weight(module), weight), module


@pytest.mark.parametrize("algorithm", ["FP8", "FP8_PB_WO"])
def test_model_optimizer_s_older_hf_quant_config_is_read(algorithm: str, tmp_path: Path) -> None:
    """A checkpoint whose quantization is declared only in hf_quant_config.json reads as the config.json form does
    (it was read as unquantized, and its float8 tensors refused with the generic dtype message)."""
    expected = older_modelopt(tmp_path, algorithm)
    quantized = read(tmp_path)
    assert quantized.described == f"modelopt {algorithm.lower()} (fp8 e4m3)"
    for module, weight in expected.items():
        assert np.array_equal(quantized.float_weight(module), weight), module
    assert declares_quantization(tmp_path)  # its own codes are the compile's default, as for the config.json form


def test_an_hf_quant_config_without_weight_quantization_or_readable_json(tmp_path: Path) -> None:
    """Only the KV cache's quantization declared (`quant_algo` null): the weights are read as stored; a file that is
    not JSON: one line naming it."""
    tiny_llama(torch.bfloat16).save_pretrained(tmp_path)
    kv_only = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(kv_only))
    assert read_quantized_checkpoint(tmp_path, json.loads((tmp_path / "config.json").read_text())) is None
    assert not declares_quantization(tmp_path)
    (tmp_path / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="hf_quant_config.json is not readable JSON"):
        read_quantized_checkpoint(tmp_path, json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.slow
def test_partial_blocks_along_the_output_features_dequantize_and_build(tmp_path: Path) -> None:
    """Blocks of 48 output features over 64-, 128- and 32-wide projections: the last block partial, as DeepSeek's
    kernels take it (transformers' CPU dequantization refuses it): by the layout's definition, and built."""
    stored = block_fp8_checkpoint(tmp_path / "checkpoint", block=(48, BLOCK))
    quantized = read(tmp_path / "checkpoint")
    assert quantized.described == f"fp8 e4m3, blocks of 48x{BLOCK}"
    for module, codes in stored.items():
        scale = read(tmp_path / "checkpoint").weights.array(f"{module}.weight_scale_inv")
        spread = np.repeat(np.repeat(scale, 48, axis=0)[: codes.shape[0]], BLOCK, axis=1)
        assert np.array_equal(quantized.float_weight(module), codes * spread), module
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", "sm_89"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert {target.name: target.status for target in manifest.targets}["sm_89"] == "built"
    assert variant_fp8_codes(tmp_path / "out", "fp8-weight").keys() == stored.keys()
    assert_greedy_tokens_match(dequantized_reference(tmp_path / "checkpoint"), tmp_path / "out")


def test_block_fp8_codes_are_the_stored_codes(tmp_path: Path) -> None:
    stored = block_fp8_checkpoint(tmp_path)
    quantized = read(tmp_path)
    assert quantized.described == f"fp8 e4m3, blocks of {BLOCK}x{BLOCK}"
    for module, codes in stored.items():
        weight = quantized.weight(module)
        assert np.array_equal(weight.codes.astype(np.float32), codes.T), module
        assert weight.scales.shape == (codes.shape[1] // BLOCK, codes.shape[0] // BLOCK)


@pytest.mark.slow
@pytest.mark.parametrize(
    "write",
    [block_fp8_checkpoint, compressed_tensors_fp8_checkpoint, per_tensor_modelopt, older_modelopt],
    ids=["blocks", "ct", "modelopt", "modelopt hf_quant_config"],
)
def test_an_fp8_checkpoint_compiles_and_generates_its_tokens(write: Callable[[Path], Any], tmp_path: Path) -> None:
    """Each layout on Ampere (its dequantized weights, in the type of the rest of the checkpoint), the per-channel
    and per-tensor ones also on Ada, where one DequantizeLinear per axis (a block spanning K) builds."""
    write(tmp_path / "checkpoint")
    ada = write is not block_fp8_checkpoint
    targets = ["cpu", "sm_86", *(["sm_89"] if ada else [])]
    manifest = compile(CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": targets}),
                       tmp_path / "out").manifest  # fmt: skip
    assert manifest.source.weights is not None and manifest.source.weights.startswith(
        read(tmp_path / "checkpoint").described
    )
    variants = {target.name: (target.variant, target.status) for target in manifest.targets}
    assert variants == {"cpu": ("fp32", "not-needed"), "sm_86": ("bf16", "built"),
                        **({"sm_89": ("fp8-weight", "built")} if ada else {})}  # fmt: skip
    assert_greedy_tokens_match(transformers_dequantized(tmp_path / "checkpoint"), tmp_path / "out")


def variant_fp8_codes(artifact: Path, variant: str) -> dict[str, np.ndarray]:
    """Each FP8 DequantizeLinear's codes [K, N] as float32, by the module of the MatMul that reads it."""
    model = onnx.load(str(artifact / "variants" / f"{variant}.onnx"))
    plan = json.loads((artifact / "precision.json").read_text())
    modules = {layer["name"]: layer["module"] for layer in plan["recipes"][variant]["layers"]}
    return {modules[tensor.name.removesuffix("/weight_fp8")].removeprefix("model."):
            numpy_helper.to_array(tensor).astype(np.float32)
            for tensor in model.graph.initializer if tensor.name.endswith("/weight_fp8")}  # fmt: skip


@pytest.mark.slow
def test_an_fp8_checkpoint_keeps_its_codes_where_the_target_runs_fp8(tmp_path: Path) -> None:
    """Ada and Blackwell engines read the checkpoint's own float8 codes; Ampere and the cpu its dequantized weights."""
    stored = block_fp8_checkpoint(tmp_path / "checkpoint")
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"),
                                   "targets": ["cpu", "sm_86", "sm_89", "sm_120"]})  # fmt: skip
    manifest = compile(config, tmp_path / "out").manifest
    variants = {target.name: (target.variant, target.status) for target in manifest.targets}
    assert variants == {"cpu": ("fp32", "not-needed"), "sm_86": ("bf16", "built"), "sm_89": ("fp8-weight", "built"),
                        "sm_120": ("fp8-weight", "built")}  # fmt: skip
    reason = {target.name: target.reason for target in manifest.targets}["sm_86"]
    assert reason is not None and "no fp8-weight kernels: bf16 instead" in reason  # as sm_86 alone: the rest's type
    plan = PrecisionPlan.read(tmp_path / "out")
    assert plan is not None and variant_for(manifest, plan, "sm_80").name == "bf16"  # `tensorsmith build` agrees
    codes = variant_fp8_codes(tmp_path / "out", "fp8-weight")
    assert codes.keys() == stored.keys()
    variant = onnx.load(str(tmp_path / "out" / "variants" / "fp8-weight.onnx"))
    scales = [tensor for tensor in variant.graph.initializer if tensor.name.endswith("/weight_scale")]
    assert len(scales) == len(stored) and all(tensor.data_type == onnx.TensorProto.FLOAT for tensor in scales)
    for module, value in codes.items():
        assert np.array_equal(value, stored[module].T), module
    record = next(variant for variant in manifest.variants if variant.name == "fp8-weight")
    assert record.accuracy["cosine"] > 0.999  # the fp32 graph is the dequantized checkpoint: fp16 regions only
    assert_greedy_tokens_match(transformers_dequantized(tmp_path / "checkpoint"), tmp_path / "out")


@pytest.mark.slow
def test_fp8_weight_rounds_a_bf16_checkpoint_to_nearest_for_blackwell(tmp_path: Path) -> None:
    """`--precision fp8-weight` on a float checkpoint: a scale of amax / 448 per block of K rows (128, or the whole
    K where smaller) and column, so that every block's largest code is e4m3's largest value."""
    tiny_llama().save_pretrained(tmp_path / "checkpoint")
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "precision": "fp8-weight",
                                   "targets": ["cpu", "sm_120"]})  # fmt: skip
    manifest = compile(config, tmp_path / "out").manifest
    assert {target.name: target.variant for target in manifest.targets} == {"cpu": "fp32", "sm_120": "fp8-weight"}
    assert {target.name: target.status for target in manifest.targets}["sm_120"] == "built"
    codes = variant_fp8_codes(tmp_path / "out", "fp8-weight")
    assert len(codes) == 2 * len(LINEARS) + 1  # and the output projection
    for module, value in codes.items():
        rows = min(value.shape[0], 128)
        assert np.all(np.abs(value).reshape(-1, rows, value.shape[1]).max(axis=1) == FP8_MAX), module


def _scales_of(tensor: str, shape: tuple[int, ...]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        tensors = load_file(directory / "model.safetensors")
        tensors[tensor] = torch.ones(shape)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})

    return damage


def _codes_as_bf16(directory: Path) -> None:
    """A fake-quantized weight: the Linear's `weight` in bf16 beside its `weight_scale_inv`."""
    tensors = load_file(directory / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("damage", "named"), [
    (_scales_of("model.layers.0.mlp.up_proj.weight_scale_inv", (3, 2)), "model.layers.0.mlp.up_proj.weight_scale_inv"),
    (quantization_setting(fmt="e5m2"), "fmt is 'e5m2'"),
    (quantization_setting(weight_block_size=[128]), "weight_block_size is [128]"),
    (_codes_as_bf16, "model.layers.1.mlp.down_proj.weight is stored as BF16"),
], ids=["grid", "e5m2", "block size", "codes in bf16"])  # fmt: skip
def test_a_bad_fp8_layout_is_one_line_before_the_export(damage: Callable[[Path], None], named: str,
                                                         tmp_path: Path) -> None:  # fmt: skip
    block_fp8_checkpoint(tmp_path / "checkpoint")
    damage(tmp_path / "checkpoint")
    result = run_cli("compile", tmp_path / "checkpoint", "-o", tmp_path / "out", "--target", "cpu")
    assert result.exit_code != 0 and named in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=named.split(" ")[0].replace("[", r"\[")):
        read(tmp_path / "checkpoint")


def test_an_fp8_checkpoint_has_no_int4_codes_to_take(tmp_path: Path) -> None:
    block_fp8_checkpoint(tmp_path / "checkpoint")
    result = run_cli("compile", tmp_path / "checkpoint", "-o", tmp_path / "out", "--target", "cpu",
                     "--precision", "int4", "--int4-algorithm", "checkpoint")  # fmt: skip
    assert result.exit_code != 0 and "not INT4 codes" in result.stderr, result.stderr
    # int4 from its dequantized weights: awq by default, which needs calibration data, said before any work
    result = run_cli("compile", tmp_path / "checkpoint", "-o", tmp_path / "out", "--target", "cpu",
                     "--precision", "int4")  # fmt: skip
    assert result.exit_code != 0 and "--int4-algorithm rtn" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_fp8_weight_takes_no_overrides(tmp_path: Path) -> None:
    block_fp8_checkpoint(tmp_path / "checkpoint")
    with pytest.raises(ConfigError, match="overrides"):
        CompileConfig.create({"source": str(tmp_path / "checkpoint"), "precision": "fp8-weight", "targets": ["sm_89"],
                              "overrides": [{"match": "*down_proj*", "precision": "fp32"}]})  # fmt: skip


def modelopt_nvfp4_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    """Model Optimizer's NVFP4 export by its definition: `weight` uint8 [N, K/2] (two e2m1 codes a byte, the first
    in the low nibble), `weight_scale` float8 e4m3 [N, K/16], `weight_scale_2` float32; the codes [K, N] by module."""
    from tensorsmith.passes.nvfp4 import E2M1_VALUES, quantize_nvfp4

    tiny_llama(torch.bfloat16).save_pretrained(directory)
    tensors, stored = load_file(directory / "model.safetensors"), {}
    for name in [name for name in tensors if name.rsplit(".", 2)[-2] in LINEARS]:
        q = quantize_nvfp4(tensors[name].float().numpy().T)
        codes = q.codes.T  # [N, K]
        index = np.searchsorted(np.asarray(E2M1_VALUES, np.float32), np.abs(codes)) | np.where(codes < 0, 8, 0)
        packed = (index[:, 0::2] | (index[:, 1::2] << 4)).astype(np.uint8)
        module = name.removesuffix(".weight")
        tensors[name] = torch.from_numpy(packed)
        tensors[f"{module}.weight_scale"] = torch.from_numpy(q.block_scales.T.copy()).to(torch.float8_e4m3fn)
        tensors[f"{module}.weight_scale_2"] = torch.tensor(q.tensor_scale, dtype=torch.float32)
        stored[module] = q.codes
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    settings = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]}
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    return stored


@pytest.mark.slow
def test_a_model_optimizer_nvfp4_checkpoint_keeps_its_codes_on_blackwell(tmp_path: Path) -> None:
    stored = modelopt_nvfp4_checkpoint(tmp_path / "checkpoint")
    quantized = read(tmp_path / "checkpoint")
    assert quantized.described == "modelopt nvfp4 (nvfp4, blocks of 16)"
    for module, codes in stored.items():
        assert np.array_equal(quantized.weight(module).codes, codes), module
    config = CompileConfig.create({"source": str(tmp_path / "checkpoint"), "targets": ["cpu", "sm_120"]})
    manifest = compile(config, tmp_path / "out").manifest
    assert {t.name: (t.variant, t.status) for t in manifest.targets} == {"cpu": ("fp32", "not-needed"),
                                                                         "sm_120": ("nvfp4", "built")}  # fmt: skip
    variant = onnx.load(str(tmp_path / "out" / "variants" / "nvfp4.onnx"))
    plan = json.loads((tmp_path / "out" / "precision.json").read_text())
    modules = {layer["name"]: layer["module"].removeprefix("model.") for layer in plan["recipes"]["nvfp4"]["layers"]}
    written = {modules[t.name.removesuffix("/weight_fp4")]: numpy_helper.to_array(t).astype(np.float32)
               for t in variant.graph.initializer if t.name.endswith("/weight_fp4")}  # fmt: skip
    assert written.keys() == stored.keys()
    for module, codes in written.items():
        assert np.array_equal(codes, stored[module]), module
    assert_greedy_tokens_match(dequantized_reference(tmp_path / "checkpoint"), tmp_path / "out")
