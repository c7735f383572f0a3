"""A pre-quantized checkpoint read as it is published: config.json's `quantization_config` and the packed INT4
tensors of each quantized Linear (core/grouped_int4.py has the layouts).

Taken: AutoAWQ's GEMM (`quant_method: awq`), GPTQ with its rows in order (`quant_method: gptq`, the original
format and `gptq_v2`) and compressed-tensors' `pack-quantized` INT4 weights (W4A16, symmetric or not). The export
reads each quantized weight dequantized as the format's own code computes it (in its scales' type), so the float
graph and its reference are the checkpoint as transformers runs it; `--precision int4` then takes the stored codes,
scales and zero points as they are (compiler/variants/stored_int4.py), nothing requantized. Every layout is checked from
the headers and config.json before the export, an error naming the field or the tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.grouped_int4 import GroupedInt4, awq_int4, compressed_tensors_int4, gptq_int4
from tensorsmith.core.precisions import INT4

if TYPE_CHECKING:
    import onnx_ir as ir
    import torch

logger = logging.getLogger(__name__)

FIELD = "quantization_config"
TAKEN = "awq (gemm), gptq (rows in order), compressed-tensors pack-quantized int4"
HINT = f"tensorsmith takes {TAKEN}; or give the unquantized bf16/fp16 checkpoint and --precision"
# a dequantized weight is rounded to its scales' type, as the formats' own code computes it
ROUNDING = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


@dataclass(frozen=True)
class Layout:
    """One format's tensors around a Linear `M`: the one naming it (`M.<marker>`) and how to read the rest."""

    marker: str  # e.g. "qweight"
    scales: str  # the group scales' tensor, stored beside it
    optional: tuple[str, ...]  # tensors that may be stored beside it (zero points, shapes, g_idx)
    features: tuple[int, int]  # (axis, codes per element) of the marker along the input features K
    columns: tuple[int, int]  # the same along the output features N
    groups_axis: int  # the scales' axis of the groups along K
    read: Callable[[CheckpointWeights, str], GroupedInt4]  # (weights, module) → its INT4 weight


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """The INT4 Linears of a pre-quantized checkpoint, by module name, read on demand."""

    method: str  # config.json's quant_method
    described: str  # for the summary and the manifest: e.g. "awq gemm int4, group 128"
    modules: tuple[str, ...]
    layout: Layout
    weights: CheckpointWeights

    def weight(self, module: str) -> GroupedInt4:
        return self.layout.read(self.weights, module)

    def stored_names(self, module: str) -> list[str]:
        """The checkpoint's tensors of `module`'s quantized weight (what its float `weight` stands in for)."""
        names = (self.layout.marker, self.layout.scales, *self.layout.optional)
        return [f"{module}.{name}" for name in names if f"{module}.{name}" in self.weights]

    def weight_shape(self, module: str) -> tuple[int, int]:
        """`module.weight`'s [N, K], from the packed tensor's header."""
        packed = self.weights.shape(f"{module}.{self.layout.marker}")
        (rows, per_row), (columns, per_column) = self.layout.features, self.layout.columns
        return packed[columns] * per_column, packed[rows] * per_row

    def rounding(self, module: str) -> type:
        """The type `module`'s dequantized weight is rounded through: its scales' (the format's own arithmetic)."""
        return ROUNDING.get(self.weights.dtype_code(f"{module}.{self.layout.scales}"), np.float32)

    def float_weight(self, module: str) -> np.ndarray:
        """`module.weight` [N, K] float32 as the format dequantizes it, rounded through its scales' type."""
        return np.ascontiguousarray(self.weight(module).dequantized(self.rounding(module)).T)


class DequantizedWeights(CheckpointWeights):
    """A pre-quantized checkpoint's tensors as the export reads a float checkpoint's: each INT4 Linear's `weight`
    [N, K] is there too, dequantized when read (never a reference to stored bytes), so that the export streams
    it a tensor at a time (checkpoint_weights.py) and the estimate counts it."""

    def __init__(self, quantized: QuantizedCheckpoint) -> None:
        super().__init__(quantized.weights.directory)
        self.quantized = quantized
        self._virtual = {f"{module}.weight": module for module in quantized.modules}
        for name, module in self._virtual.items():
            scales = f"{module}.{quantized.layout.scales}"
            self._files[name], self._codes[name] = self._files[scales], self._codes[scales]
            self._shapes[name] = quantized.weight_shape(module)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._virtual:
            return super().tensor(name)
        import torch

        self.on_read()
        weight = self.quantized.float_weight(self._virtual[name])
        if not np.isfinite(weight.sum()):  # a NaN or an infinity in the scales: named as a float weight's would be
            self._refuse_nonfinite(
                f"{self._virtual[name]}.{self.quantized.layout.scales}", int((~np.isfinite(weight)).sum())
            )
        return torch.from_numpy(weight)

    def lazy(self, name: str, graph_name: str, referable: bool = False) -> ir.TensorProtocol:
        return super().lazy(name, graph_name, referable and name not in self._virtual)


def checkpoint_weights(directory: Path) -> CheckpointWeights:
    """The directory's tensors by name, a pre-quantized checkpoint's INT4 weights among them as float weights."""
    config = json.loads((directory / "config.json").read_text())
    quantized = read_quantized_checkpoint(directory, config) if config.get(FIELD) else None
    return CheckpointWeights(directory) if quantized is None else DequantizedWeights(quantized)


def _awq(weights: CheckpointWeights, module: str) -> GroupedInt4:
    read = weights.array
    return awq_int4(read(f"{module}.qweight"), read(f"{module}.qzeros"), read(f"{module}.scales"))


def _gptq(stored_minus_one: bool) -> Callable[[CheckpointWeights, str], GroupedInt4]:
    def read(weights: CheckpointWeights, module: str) -> GroupedInt4:
        array = weights.array
        weight = gptq_int4(array(f"{module}.qweight"), array(f"{module}.qzeros"), array(f"{module}.scales"),
                           stored_minus_one)  # fmt: skip
        if weight.zero_points is not None and int(weight.zero_points.max()) > 7:
            raise ConfigError(f"{weights.directory}: {module}.qzeros stores 15, a zero point of 16 in the original "
                              "GPTQ format, outside INT4", hint=HINT)  # fmt: skip
        return weight

    return read


def _compressed(weights: CheckpointWeights, module: str) -> GroupedInt4:
    zero = f"{module}.weight_zero_point"
    return compressed_tensors_int4(weights.array(f"{module}.weight_packed"), weights.array(f"{module}.weight_scale"),
                                   weights.array(zero) if zero in weights else None)  # fmt: skip


def read_quantized_checkpoint(directory: Path, config: Mapping[str, Any]) -> QuantizedCheckpoint | None:
    """The directory's quantization, checked before any work; None for an unquantized checkpoint."""
    settings = config.get(FIELD)
    if not settings:
        return None
    where = f"{directory / 'config.json'} {FIELD}"
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} is not a mapping", hint=HINT)
    method = str(settings.get("quant_method", "unnamed"))
    layout, described = _layout(where, method, settings)
    weights = CheckpointWeights(directory)
    suffix = f".{layout.marker}"
    modules = tuple(sorted(name[: -len(suffix)] for name in weights.names() if name.endswith(suffix)))
    if not modules:
        raise ConfigError(f"{directory}: {where} says {method} but no tensor is named *{suffix}", hint=HINT)
    for module in modules:
        _check_tensors(weights, module, layout)
    return QuantizedCheckpoint(method, described, modules, layout, weights)


def _layout(where: str, method: str, settings: Mapping[str, Any]) -> tuple[Layout, str]:
    if method == "awq":
        version = str(settings.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{where}.version is {version!r}: tensorsmith takes AWQ's gemm packing", hint=HINT)
        _four_bits(where, settings.get("bits", settings.get("w_bit")))
        layout = Layout("qweight", "scales", ("qzeros",), (0, 1), (1, 8), 0, _awq)
        return layout, f"awq gemm int4, group {_group(where, settings)}"
    if method == "gptq":
        _four_bits(where, settings.get("bits"))
        checkpoint_format = str(settings.get("checkpoint_format", "gptq"))
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ConfigError(f"{where}.checkpoint_format is {checkpoint_format!r}: tensorsmith takes gptq and "
                              "gptq_v2", hint=HINT)  # fmt: skip
        reader = _gptq(stored_minus_one=checkpoint_format == "gptq")
        layout = Layout("qweight", "scales", ("qzeros", "g_idx"), (0, 8), (1, 1), 0, reader)
        return layout, f"gptq int4, group {_group(where, settings)}"
    if method == "compressed-tensors":
        for name, group in dict(settings.get("config_groups") or {}).items():
            scheme, weights = f"{where}.config_groups.{name}", dict(group.get("weights") or {})
            form = group.get("format") or settings.get("format")
            if form != "pack-quantized" or weights.get("type") != "int" or group.get("input_activations"):
                raise ConfigError(f"{scheme}: format {form!r}, weights {weights.get('type')!r}, activations "
                                  f"{'quantized' if group.get('input_activations') else 'none'}: tensorsmith takes "
                                  "pack-quantized int weights (W4A16)", hint=HINT)  # fmt: skip
            _four_bits(scheme + ".weights", weights.get("num_bits"))
        layout = Layout("weight_packed", "weight_scale", ("weight_zero_point", "weight_shape"), (1, 8), (0, 1), 1,
                        _compressed)  # fmt: skip
        return layout, "compressed-tensors pack-quantized int4"
    raise ConfigError(f"{where}.quant_method is {method!r}", hint=HINT)


def _four_bits(where: str, bits: object) -> None:
    if bits != 4:
        raise ConfigError(f"{where} gives {bits!r} bits: tensorsmith takes INT4 checkpoints", hint=HINT)


def _group(where: str, settings: Mapping[str, Any]) -> int:
    group = settings.get("group_size", settings.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise ConfigError(f"{where}.group_size is {group!r}: a positive group of rows is needed (-1, one group for "
                          "the whole input, is not taken)", hint=HINT)  # fmt: skip
    return group


def _check_tensors(weights: CheckpointWeights, module: str, layout: Layout) -> None:
    """The scales stored, and their groups a whole number of rows of the input features."""
    marker, scales = f"{module}.{layout.marker}", f"{module}.{layout.scales}"
    if scales not in weights:
        raise ConfigError(f"{weights.directory}: {scales} is missing beside {marker}", hint=HINT)
    axis, per_element = layout.features
    rows, groups = weights.shape(marker)[axis] * per_element, weights.shape(scales)[layout.groups_axis]
    if groups == 0 or rows % groups:
        raise ConfigError(f"{weights.directory}: {scales} has {groups} groups, which do not divide the {rows} input "
                          f"features of {module}", hint=HINT)  # fmt: skip
    if f"{module}.g_idx" in weights:  # GPTQ: each row's group, in row order unless quantized in act-order
        in_order = np.arange(rows) // (rows // groups)
        if not np.array_equal(np.asarray(weights.array(f"{module}.g_idx")), in_order):
            raise ConfigError(f"{weights.directory}: {module}.g_idx is not in row order (quantized in act-order, "
                              "desc_act); tensorsmith takes GPTQ with its rows in order", hint=HINT)  # fmt: skip


FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def stored_weights(directory: Path) -> str:
    """How a checkpoint directory stores its weights, for the manifest and the summary: its float type by most
    values ('bfloat16'), after its quantized format where it has one ('awq gemm int4, group 128; bfloat16')."""
    weights = CheckpointWeights(directory)
    counts: dict[str, int] = {}
    for name in weights.names():
        code = weights.dtype_code(name)
        if code in FLOAT_NAMES:
            counts[code] = counts.get(code, 0) + int(np.prod(weights.shape(name), dtype=np.int64))
    floats = FLOAT_NAMES[max(counts, key=counts.__getitem__)] if counts else "no float"
    config = json.loads((directory / "config.json").read_text())
    quantized = read_quantized_checkpoint(directory, config) if config.get(FIELD) else None
    return floats if quantized is None else f"{quantized.described}; the rest {floats}"


def source_checkpoint(config: CompileConfig) -> QuantizedCheckpoint:
    """The pre-quantized checkpoint `config.source` names (for `int4_algorithm` checkpoint; read from its headers)."""
    directory = config.resolve(config.source)
    found = read_quantized_checkpoint(directory, json.loads((directory / "config.json").read_text()))
    if found is None:
        raise ConfigError(f"--int4-algorithm checkpoint: {config.source} is not a pre-quantized checkpoint (its "
                          f"config.json has no {FIELD})", hint="use --int4-algorithm awq or rtn")  # fmt: skip
    return found


def checkpoint_precision(config: CompileConfig, quantized: QuantizedCheckpoint) -> CompileConfig:
    """The checkpoint's own INT4 codes unless the config asks otherwise: `precision` int4 where it gives none, and
    `int4_algorithm` checkpoint where it gives none; another precision or algorithm starts from the dequantized
    weights, said on the console."""
    given = config.model_fields_set
    update: dict[str, object] = {} if "precision" in given else {"precision": INT4.name}
    if update.get("precision", config.precision) == INT4.name and "int4_algorithm" not in given:
        update["int4_algorithm"] = "checkpoint"
    if update.get("int4_algorithm", config.int4_algorithm) == "checkpoint":
        logger.info("%s: %s, its INT4 codes taken as they are", config.source, quantized.described)
    else:
        asked = update.get("precision", config.precision)
        logger.warning("%s: %s, dequantized for --precision %s (--int4-algorithm %s)", config.source,
                       quantized.described, asked, config.int4_algorithm)  # fmt: skip
    return config.model_copy(update=update)
