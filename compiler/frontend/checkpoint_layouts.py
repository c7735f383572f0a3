"""The published layouts of pre-quantized checkpoints: for each `quant_method` of config.json's
`quantization_config`, which tensors around a Linear `M` hold its codes and scales, and how to read them
(core/grouped_int4.py unpacks the INT4 ones, core/scaled_fp8.py the FP8 ones).

Taken: AutoAWQ's GEMM (`awq`), GPTQ in row order or act-order (`gptq`, the original format and `gptq_v2`),
compressed-tensors' `pack-quantized` INT4 (W4A16) and `float-quantized` FP8 (per tensor, channel or block;
static or dynamic activations: the activations are the compile's to choose), block-scaled FP8 as DeepSeek,
Qwen3-FP8 and transformers' FineGrainedFP8 write it (`fp8`), and Model Optimizer's FP8 exports (`modelopt`).
Every setting is checked here, before the export, an error naming the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.grouped_int4 import GroupedInt4, awq_int4, compressed_tensors_int4, gptq_int4
from tensorsmith.core.precisions import Element
from tensorsmith.core.scaled_fp8 import ScaledFp8, grid_block, scaled_fp8
from tensorsmith.passes.nvfp4 import NVFP4_BLOCK, Nvfp4Weight, stored_nvfp4

TAKEN = (
    "awq (gemm), gptq, compressed-tensors pack-quantized int4, float-quantized fp8 and nvfp4, fp8 blocks, "
    "modelopt fp8 and nvfp4"
)
HINT = f"tensorsmith takes {TAKEN}; or give the unquantized bf16/fp16 checkpoint and --precision"
STORED_CODES = {Element.INT4: "I32", Element.FP8_E4M3: "F8_E4M3", Element.FP4_E2M1: "U8"}
SCALE_DTYPES = ("F32", "F16", "BF16")  # a scale of another type (e8m0's U8) would be read as a number: refused
# a quantized Linear's weight [K, N] as stored: .dequantized() its floats, .scaled(factor) its scales times one
StoredWeight: TypeAlias = GroupedInt4 | ScaledFp8 | Nvfp4Weight


@dataclass(frozen=True)
class Layout:
    """One format's tensors around a Linear `M`: the one marking it quantized (`M.<marker>`) and how to read it."""

    element: Element  # what one stored code is
    marker: str  # e.g. "qweight": only a quantized Linear has it
    codes: str  # the tensor holding the codes (the marker, or `weight` where the scales mark the Linear)
    scales: str  # the scales' tensor, stored beside it
    optional: tuple[str, ...]  # tensors that may be stored beside it (zero points, shapes, g_idx, input scales)
    features: tuple[int, int]  # (axis, codes per element) of the codes along the input features K
    columns: tuple[int, int]  # the same along the output features N
    fits: Callable[[tuple[int, int], tuple[int, ...]], bool]  # (weight [N, K], scales' shape) → whole blocks
    read: Callable[[CheckpointWeights, str], StoredWeight]  # (weights, module) → its weight
    scale_dtypes: tuple[str, ...] = SCALE_DTYPES  # the scales' safetensors dtypes
    rounding: str | None = None  # the dtype code its own dequantization rounds through; None: its scales'

    @property
    def codes_dtype(self) -> str:
        """safetensors' dtype code of the codes' tensor: INT4 packed in int32 words, FP8 as float8 e4m3."""
        return STORED_CODES[self.element]

    def weight_shape(self, weights: CheckpointWeights, module: str) -> tuple[int, int]:
        """`module.weight`'s [N, K], from the codes' header."""
        packed = weights.shape(f"{module}.{self.codes}")
        (rows, per_row), (columns, per_column) = self.features, self.columns
        return packed[columns] * per_column, packed[rows] * per_row


def _groups_along(axis: int) -> Callable[[tuple[int, int], tuple[int, ...]], bool]:
    """INT4 groups: the scales' `axis` counts groups of whole rows of K."""
    return lambda weight, scales: len(scales) > axis and scales[axis] > 0 and weight[1] % scales[axis] == 0


def _awq(weights: CheckpointWeights, module: str) -> GroupedInt4:
    read = weights.array
    return awq_int4(read(f"{module}.qweight"), read(f"{module}.qzeros"), read(f"{module}.scales"))


def _gptq(stored_minus_one: bool) -> Callable[[CheckpointWeights, str], GroupedInt4]:
    def read(weights: CheckpointWeights, module: str) -> GroupedInt4:
        array = weights.array
        g_idx = f"{module}.g_idx"
        weight = gptq_int4(
            array(f"{module}.qweight"),
            array(f"{module}.qzeros"),
            array(f"{module}.scales"),
            stored_minus_one,
            array(g_idx) if g_idx in weights else None,
        )
        if weight.zero_points is not None and int(weight.zero_points.max()) > 7:
            raise ConfigError(
                f"{weights.directory}: {module}.qzeros stores 15, a zero point of 16 in the original "
                "GPTQ format, outside INT4",
                hint=HINT,
            )
        return weight

    return read


def _compressed_int4(weights: CheckpointWeights, module: str) -> GroupedInt4:
    zero = f"{module}.weight_zero_point"
    return compressed_tensors_int4(
        weights.array(f"{module}.weight_packed"),
        weights.array(f"{module}.weight_scale"),
        weights.array(zero) if zero in weights else None,
    )


def _fp8(scales: str, block: tuple[int, int] | None = None) -> Callable[[CheckpointWeights, str], ScaledFp8]:
    def read(weights: CheckpointWeights, module: str) -> ScaledFp8:
        return scaled_fp8(weights.array(f"{module}.weight"), weights.array(f"{module}.{scales}"), block)

    return read


def _fp8_grid(block: tuple[int, int] | None) -> Callable[[tuple[int, int], tuple[int, ...]], bool]:
    return lambda weight, scales: grid_block(weight, scales, block) is not None


AWQ = Layout(Element.INT4, "qweight", "qweight", "scales", ("qzeros",), (0, 1), (1, 8), _groups_along(0), _awq)
COMPRESSED_INT4 = Layout(
    Element.INT4,
    "weight_packed",
    "weight_packed",
    "weight_scale",
    ("weight_zero_point", "weight_shape"),
    (1, 8),
    (0, 1),
    _groups_along(1),
    _compressed_int4,
)
SCALED_FP8 = Layout(
    Element.FP8_E4M3,
    "weight_scale",
    "weight",
    "weight_scale",
    ("input_scale",),
    (1, 1),
    (0, 1),
    _fp8_grid(None),
    _fp8("weight_scale"),
)


def _nvfp4(second: str, inverse: bool) -> Callable[[CheckpointWeights, str], Nvfp4Weight]:
    """NVFP4 with its second-level scale `second`: Model Optimizer's `weight_scale_2` multiplies the block scales,
    compressed-tensors' `weight_global_scale` divides them."""

    def read(weights: CheckpointWeights, module: str) -> Nvfp4Weight:
        tensor = float(np.asarray(weights.array(f"{module}.{second}"), np.float32).reshape(-1)[0])
        packed = np.asarray(weights.array(f"{module}.{'weight_packed' if inverse else 'weight'}")).astype(np.uint8)
        scale = float(np.float32(1) / np.float32(tensor)) if inverse else tensor
        return stored_nvfp4(packed, weights.array(f"{module}.weight_scale"), scale)

    return read


def _nvfp4_grid(weight: tuple[int, int], scales: tuple[int, ...]) -> bool:
    return tuple(scales) == (weight[0], weight[1] // NVFP4_BLOCK) and weight[1] % NVFP4_BLOCK == 0


MODELOPT_NVFP4 = Layout(
    Element.FP4_E2M1,
    "weight_scale_2",
    "weight",
    "weight_scale",
    ("input_scale",),
    (1, 2),
    (0, 1),
    _nvfp4_grid,
    _nvfp4("weight_scale_2", inverse=False),
    ("F8_E4M3",),
)
COMPRESSED_NVFP4 = Layout(
    Element.FP4_E2M1,
    "weight_global_scale",
    "weight_packed",
    "weight_scale",
    ("input_global_scale",),
    (1, 2),
    (0, 1),
    _nvfp4_grid,
    _nvfp4("weight_global_scale", True),
    ("F8_E4M3",),
    "BF16",  # compressed-tensors decompresses NVFP4 into bfloat16 whatever the model's type
)


def block_fp8_layout(block: tuple[int, int] | None) -> Layout:
    """DeepSeek's layout, its blocks [bn, bk] as config.json declares them (a partial last block along N)."""
    return Layout(
        Element.FP8_E4M3,
        "weight_scale_inv",
        "weight",
        "weight_scale_inv",
        (),
        (1, 1),
        (0, 1),
        _fp8_grid(block),
        _fp8("weight_scale_inv", block),
    )


def gptq_layout(stored_minus_one: bool) -> Layout:
    return Layout(
        Element.INT4,
        "qweight",
        "qweight",
        "scales",
        ("qzeros", "g_idx"),
        (0, 8),
        (1, 1),
        _groups_along(0),
        _gptq(stored_minus_one),
    )


def published_layout(where: str, method: str, settings: Mapping[str, Any]) -> tuple[Layout, str]:
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
    """compressed-tensors: every scheme of `config_groups` one format, pack-quantized INT4 or float-quantized FP8."""
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


def _modelopt(where: str, settings: Mapping[str, Any]) -> tuple[Layout, str]:
    """Model Optimizer's Hugging Face export: `quant_algo` names the format (as config.json's `quantization_config`
    writes it; the older hf_quant_config.json alone is not read)."""
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


def _block_fp8(where: str, settings: Mapping[str, Any]) -> tuple[int, int] | None:
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


def _group(where: str, settings: Mapping[str, Any]) -> int:
    group = settings.get("group_size", settings.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise ConfigError(
            f"{where}.group_size is {group!r}: a positive group of rows is needed (-1, one group for "
            "the whole input, is not taken)",
            hint=HINT,
        )
    return group
