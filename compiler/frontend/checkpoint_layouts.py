"""Which published layout a pre-quantized checkpoint's config.json names (`quantization_config`): its
`quant_method` and settings, checked before the export, an error naming the field. The layouts themselves are
records (layout_record.py) in int4_layouts.py and float_layouts.py.

Taken: AutoAWQ's GEMM (`awq`), GPTQ in row order or act-order (`gptq`, the original format and `gptq_v2`),
compressed-tensors' `pack-quantized` INT4 (W4A16), `float-quantized` FP8 (per tensor, channel or block; static or
dynamic activations: the activations are the compile's to choose) and `nvfp4-pack-quantized`, block-scaled FP8 as
DeepSeek, Qwen3-FP8 and transformers' FineGrainedFP8 write it (`fp8`), and Model Optimizer's FP8 and NVFP4
exports (`modelopt`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tensorsmith.compiler.frontend.float_layouts import COMPRESSED_NVFP4, MODELOPT_NVFP4, SCALED_FP8, block_fp8_layout
from tensorsmith.compiler.frontend.int4_layouts import AWQ, COMPRESSED_INT4, gptq_layout
from tensorsmith.compiler.frontend.layout_record import HINT, Layout
from tensorsmith.core.errors import ConfigError
from tensorsmith.passes.nvfp4 import NVFP4_BLOCK


def published_layout(where: str, method: str, settings: Mapping[str, object]) -> tuple[Layout, str]:
    """The layout `quantization_config` names, and its words for the summary; a ConfigError naming the field."""
    if method == "awq":
        version = str(settings.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{where}.version is {version!r}: tensorsmith takes AWQ's gemm packing", hint=HINT)
        _bits(where, settings.get("bits", settings.get("w_bit")), 4)
        return AWQ, f"awq gemm int4, group {_group(where, settings)}"
    if method == "gptq":
        _bits(where, settings.get("bits"), 4)
        checkpoint_format = str(settings.get("checkpoint_format", "gptq"))
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ConfigError(
                f"{where}.checkpoint_format is {checkpoint_format!r}: tensorsmith takes gptq and gptq_v2", hint=HINT
            )
        return gptq_layout(stored_minus_one=checkpoint_format == "gptq"), f"gptq int4, group {_group(where, settings)}"
    if method == "fp8":  # quant_method, not a precision: transformers' FineGrainedFP8
        block = _block_fp8(where, settings)
        described = f"fp8 e4m3, blocks of {block[0]}x{block[1]}" if block else "fp8 e4m3"
        return block_fp8_layout(block), described
    if method == "compressed-tensors":
        return _compressed(where, settings)
    if method == "modelopt":
        return _modelopt(where, settings)
    raise ConfigError(f"{where}.quant_method is {method!r}", hint=HINT)


def _compressed(where: str, settings: Mapping[str, Any]) -> tuple[Layout, str]:
    """compressed-tensors: every scheme of `config_groups` one format, pack-quantized INT4 or float-quantized FP8.
    `settings` is JSON as published, its nested groups read as found (a field of another type fails as read)."""
    forms = set()
    for name, group in dict(settings.get("config_groups") or {}).items():
        scheme, weights = f"{where}.config_groups.{name}", dict(group.get("weights") or {})
        form, kind = group.get("format") or settings.get("format"), weights.get("type")
        if form == "pack-quantized" and kind == "int" and not group.get("input_activations"):
            _bits(scheme + ".weights", weights.get("num_bits"), 4)
            forms.add((COMPRESSED_INT4, "compressed-tensors pack-quantized int4"))
        elif form == "nvfp4-pack-quantized" and kind == "float":
            _bits(scheme + ".weights", weights.get("num_bits"), 4)
            forms.add((COMPRESSED_NVFP4, f"compressed-tensors nvfp4, blocks of {NVFP4_BLOCK}"))
        elif form == "float-quantized" and kind == "float":
            _bits(scheme + ".weights", weights.get("num_bits"), 8)
            strategy = str(weights.get("strategy", "tensor"))
            forms.add((SCALED_FP8, f"compressed-tensors fp8 e4m3, a scale per {strategy}"))
        else:
            quantized = "quantized" if group.get("input_activations") else "none"
            raise ConfigError(
                f"{scheme}: format {form!r}, weights {kind!r}, activations {quantized}: tensorsmith "
                "takes pack-quantized int weights (W4A16) and float-quantized fp8",
                hint=HINT,
            )
    if len(forms) != 1:
        raise ConfigError(
            f"{where}.config_groups: {len(forms)} formats; tensorsmith takes one per checkpoint", hint=HINT
        )
    return forms.pop()


MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")  # its per-tensor, per-channel and block FP8
MODELOPT_NVFP4_ALGORITHMS = ("NVFP4", "W4A16_NVFP4")  # NVFP4 weights (the activations are the compile's to choose)


def _modelopt(where: str, settings: Mapping[str, object]) -> tuple[Layout, str]:
    """Model Optimizer's Hugging Face export: `quant_algo` names the format (in config.json's `quantization_config`,
    or the older hf_quant_config.json's `quantization`: core/quantization_declared.py)."""
    algorithm = str(settings.get("quant_algo", "")).upper()
    if algorithm in MODELOPT_NVFP4_ALGORITHMS:
        return MODELOPT_NVFP4, f"modelopt {algorithm.lower()} (nvfp4, blocks of {NVFP4_BLOCK})"
    if algorithm not in MODELOPT_FP8:
        raise ConfigError(
            f"{where}.quant_algo is {algorithm!r}: tensorsmith takes Model Optimizer's "
            f"{', '.join((*MODELOPT_FP8, *MODELOPT_NVFP4_ALGORITHMS))}",
            hint=HINT,
        )
    return SCALED_FP8, f"modelopt {algorithm.lower()} (fp8 e4m3)"


def _block_fp8(where: str, settings: Mapping[str, object]) -> tuple[int, int] | None:
    """config.json's `weight_block_size` [bn, bk], checked (None: the blocks the scales' grid splits evenly)."""
    form = str(settings.get("fmt", "e4m3"))
    if form != "e4m3":
        raise ConfigError(f"{where}.fmt is {form!r}: tensorsmith takes float8 e4m3 weights", hint=HINT)
    block = settings.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{where}.weight_block_size is {block!r}: two positive sizes are needed", hint=HINT)
    return block[0], block[1]


def _bits(where: str, bits: object, expected: int) -> None:
    if bits != expected:
        raise ConfigError(f"{where} gives {bits!r} bits: tensorsmith takes {expected}-bit weights here", hint=HINT)


def _group(where: str, settings: Mapping[str, object]) -> int:
    group = settings.get("group_size", settings.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise ConfigError(
            f"{where}.group_size is {group!r}: a positive group of rows is needed (-1, one group for "
            "the whole input, is not taken)",
            hint=HINT,
        )
    return group
