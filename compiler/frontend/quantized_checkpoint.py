"""A pre-quantized checkpoint read as it is published: config.json's `quantization_config` and the stored codes
and scales of each quantized Linear (compiler/frontend/checkpoint_layouts.py has the layouts).

The export reads each quantized weight dequantized as the format's own code computes it (in its scales' type), so
the float graph and its reference are the checkpoint as transformers runs it. An INT4 checkpoint's `--precision
int4` then takes the stored codes, scales and zero points as they are (compiler/variants/stored_int4.py), nothing
requantized; an FP8 one's `fp8-weight` variants take its float8 codes and scales the same way
(compiler/variants/fp8_weight_builder.py) for the targets that run them, the others its dequantized weights.
Every layout is checked from the headers and config.json before the export, an error naming the field or tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.checkpoint_layouts import published_layout
from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.frontend.layout_record import HINT, Layout, StoredWeight
from tensorsmith.compiler.frontend.mxfp4_weights import Mxfp4Weights
from tensorsmith.compiler.targets import get_target
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.precisions import AUTO, BF16, FP16, Calibration, Element, Precision, precision, storing
from tensorsmith.core.quantization_declared import FIELD, MXFP4_METHOD, declared_method, declared_quantization

if TYPE_CHECKING:
    import onnx_ir as ir
    import torch

logger = logging.getLogger(__name__)

# a dequantized weight is rounded to its scales' type, as the formats' own code computes it
ROUNDING = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """The quantized Linears of a pre-quantized checkpoint, by module name, read on demand."""

    method: str  # config.json's quant_method
    described: str  # for the summary and the manifest: e.g. "awq gemm int4, group 128"
    modules: tuple[str, ...]
    layout: Layout
    weights: CheckpointWeights

    @property
    def element(self) -> Element:
        """What one stored code is (INT4, FP8 e4m3)."""
        return self.layout.element

    def weight(self, module: str) -> StoredWeight:
        return self.layout.read(self.weights, module)

    def stored_names(self, module: str) -> list[str]:
        """The checkpoint's tensors of `module`'s quantized weight (what its float `weight` stands in for)."""
        names = dict.fromkeys((self.layout.marker, self.layout.codes, self.layout.scales, *self.layout.optional))
        return [f"{module}.{name}" for name in names if f"{module}.{name}" in self.weights]

    def weight_shape(self, module: str) -> tuple[int, int]:
        """`module.weight`'s [N, K], from the codes' header."""
        return self.layout.weight_shape(self.weights, module)

    def rounding(self, module: str) -> type:
        """The type `module`'s dequantized weight is rounded through: the layout's, else its scales' (the format's
        own arithmetic)."""
        stored = self.layout.rounding or self.weights.dtype_code(f"{module}.{self.layout.scales}")
        return ROUNDING.get(stored, np.float32)

    def float_weight(self, module: str) -> np.ndarray:
        """`module.weight` [N, K] float32 as the format dequantizes it, rounded through its scales' type."""
        return np.ascontiguousarray(self.weight(module).dequantized(self.rounding(module)).T)


class DequantizedWeights(CheckpointWeights):
    """A pre-quantized checkpoint's tensors as the export reads a float checkpoint's: each quantized Linear's `weight`
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
        module = self._virtual[name]
        weight = self.quantized.float_weight(module)
        if not np.isfinite(weight.sum()):  # a NaN or an infinity in the codes (float8's) or the scales: named
            layout = self.quantized.layout
            codes = np.asarray(self.quantized.weight(module).codes, np.float32)
            part = layout.codes if not np.isfinite(codes.sum()) else layout.scales
            self._refuse_nonfinite(f"{module}.{part}", int((~np.isfinite(weight)).sum()))
        return torch.from_numpy(weight)

    def lazy(self, name: str, graph_name: str, referable: bool = False) -> ir.TensorProtocol:
        return super().lazy(name, graph_name, referable and name not in self._virtual)

    def stands_for(self) -> dict[str, tuple[str, ...]]:
        return {name: tuple(self.quantized.stored_names(module)) for name, module in self._virtual.items()}


def checkpoint_weights(directory: Path) -> CheckpointWeights:
    """The directory's tensors by name, a pre-quantized checkpoint's quantized weights among them as float weights
    (gpt-oss's MXFP4_METHOD experts too: mxfp4_weights.py)."""
    method = declared_method(directory)
    return weights_reader(directory, method, quantized_checkpoint_of(directory) if method != MXFP4_METHOD else None)


def weights_reader(directory: Path, method: str | None, quantized: QuantizedCheckpoint | None) -> CheckpointWeights:
    """checkpoint_weights for a directory whose declared `quant_method` and quantization are read already."""
    if method == MXFP4_METHOD:
        return Mxfp4Weights(directory)
    return CheckpointWeights(directory) if quantized is None else DequantizedWeights(quantized)


def quantized_checkpoint_of(directory: Path) -> QuantizedCheckpoint | None:
    """The quantization a checkpoint directory's config.json declares, read and checked; None for none."""
    return read_quantized_checkpoint(directory, json.loads((directory / "config.json").read_text()))


def read_quantized_checkpoint(directory: Path, config: Mapping[str, object]) -> QuantizedCheckpoint | None:
    """The directory's quantization, checked before any work; None for an unquantized checkpoint."""
    declared = declared_quantization(directory, config)
    if declared is None:
        return None
    settings, where = declared.settings, declared.where
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} is not a mapping", hint=HINT)
    method = str(settings.get("quant_method", "unnamed"))
    if (
        method == MXFP4_METHOD
    ):  # stacked experts, not Linears: read dequantized as a float checkpoint (checkpoint_weights)
        return None
    found, described = published_layout(where, method, settings)
    weights = CheckpointWeights(directory)
    suffix = f".{found.marker}"
    modules = tuple(sorted(name[: -len(suffix)] for name in weights.names() if name.endswith(suffix)))
    if not modules:
        raise ConfigError(f"{directory}: {where} says {method} but no tensor is named *{suffix}", hint=HINT)
    for module in modules:
        _check_tensors(weights, module, found)
    return QuantizedCheckpoint(method, described, modules, found, weights)


def _check_tensors(weights: CheckpointWeights, module: str, layout: Layout) -> None:
    """The codes and scales stored, and the scales' groups or blocks whole rows and columns of the weight."""
    marker = f"{module}.{layout.marker}"
    for part, dtypes in ((layout.codes, (layout.codes_dtype,)), (layout.scales, layout.scale_dtypes)):
        name = f"{module}.{part}"
        if name not in weights:
            raise ConfigError(f"{weights.directory}: {name} is missing beside {marker}", hint=HINT)
        if weights.dtype_code(name) not in dtypes:
            raise ConfigError(
                f"{weights.directory}: {name} is stored as {weights.dtype_code(name)}; its format stores "
                f"{' or '.join(dtypes)}",
                hint=HINT,
            )
    scales, (columns, rows) = f"{module}.{layout.scales}", layout.weight_shape(weights, module)
    if not layout.fits((columns, rows), weights.shape(scales)):
        raise ConfigError(
            f"{weights.directory}: {scales} {list(weights.shape(scales))} does not split {module}'s "
            f"weight [{columns}, {rows}] into its groups or blocks",
            hint=HINT,
        )
    if f"{module}.g_idx" in weights:  # GPTQ: each row's group (out of row order in act-order: G rows each still)
        groups = weights.shape(scales)[0]
        g_idx = np.asarray(weights.array(f"{module}.g_idx")).astype(np.int64)
        if g_idx.shape != (rows,) or g_idx.min() < 0 or g_idx.max() >= groups:
            raise ConfigError(
                f"{weights.directory}: {module}.g_idx does not give each of the {rows} input features one of the "
                f"{groups} groups",
                hint=HINT,
            )
        if not np.all(np.bincount(g_idx, minlength=groups) == rows // groups):
            raise ConfigError(
                f"{weights.directory}: {module}.g_idx gives its groups unequal numbers of rows; tensorsmith takes "
                f"groups of {rows // groups}",
                hint=HINT,
            )


FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def stored_float(directory: Path) -> str | None:
    """The float type holding most of a checkpoint directory's float values ('bfloat16'); None if it has none."""
    weights = CheckpointWeights(directory)
    counts: dict[str, int] = {}
    for name in weights.names():
        code = weights.dtype_code(name)
        if code in FLOAT_NAMES:
            counts[code] = counts.get(code, 0) + int(np.prod(weights.shape(name), dtype=np.int64))
    return FLOAT_NAMES[max(counts, key=counts.__getitem__)] if counts else None


def stored_weights(directory: Path) -> str:
    """How a checkpoint directory stores its weights, for the manifest and the summary: its float type by most
    values ('bfloat16'), after its quantized format where it has one ('awq gemm int4, group 128; bfloat16')."""
    floats = stored_float(directory) or "no float"
    if declared_method(directory) == MXFP4_METHOD:
        return f"mxfp4 experts (e2m1, an e8m0 scale per 32), read dequantized; the rest {floats}"
    quantized = quantized_checkpoint_of(directory)
    return floats if quantized is None else f"{quantized.described}; the rest {floats}"


def checkpoint_float_precision(config: CompileConfig, directory: Path) -> CompileConfig:
    """A bfloat16 checkpoint's GPU variants compute in bf16 where a target runs it (Ampere and newer; Turing gets
    fp16 with the range check, the manifest saying why), encoders as decoders, unless the config gives a precision:
    the checkpoint's own type, with float32's range, at the size fp16 would take."""
    if "precision" in config.model_fields_set or stored_float(directory) != "bfloat16":
        return config
    if not any(get_target(target).runs_precision(BF16) for target in config.targets):
        return config
    logger.info("%s: bfloat16 weights, so its GPU variants compute in bf16 (--precision fp16 for fp16)", config.source)
    return config.model_copy(update={"precision": BF16.name})


def checkpoint_floats(directory: Path | None) -> Precision:
    """The float type a target takes that cannot run a weight-only request (Target.recipe): a bfloat16
    checkpoint's bf16, as its GPU variants get by default (fp16 still where a target has no bf16), else fp16."""
    return BF16 if directory is not None and stored_float(directory) == "bfloat16" else FP16


def source_checkpoint(config: CompileConfig) -> QuantizedCheckpoint:
    """The pre-quantized checkpoint `config.source` names (for `int4_algorithm` checkpoint; read from its headers)."""
    directory = config.resolve(config.source)
    found = quantized_checkpoint_of(directory)
    if found is None:
        raise ConfigError(
            f"--int4-algorithm checkpoint: {config.source} has no codes to take as stored (its config.json has "
            f"no {FIELD}, or one whose weights are read dequantized: {MXFP4_METHOD})",
            hint="use --int4-algorithm awq or rtn",
        )
    if found.element is not Element.INT4:
        raise ConfigError(
            f"--int4-algorithm checkpoint: {config.source} stores {found.described}, not INT4 codes",
            hint="use --int4-algorithm awq or rtn (from its dequantized weights)",
        )
    return found


def checkpoint_precision(config: CompileConfig, quantized: QuantizedCheckpoint) -> CompileConfig:
    """The checkpoint's own codes unless the config asks otherwise: the weight-only precision that stores them
    (int4, fp8-weight) where the config gives none and a target runs it, its codes taken as stored (INT4's
    `int4_algorithm` checkpoint where the config gives no algorithm). Another precision or algorithm, and the
    targets that cannot run the codes, start from the dequantized weights; each choice said on the console."""
    stored, given = storing(quantized.element), config.model_fields_set
    runs = [target for target in config.targets if get_target(target).runs_precision(stored)]
    update: dict[str, object] = {"precision": stored.name} if "precision" not in given and runs else {}
    asked = update.get("precision", config.precision)
    chooses_algorithm = stored.calibration is Calibration.OPTIONAL_AWQ  # INT4: --int4-algorithm awq|rtn|checkpoint
    if asked == stored.name and chooses_algorithm and "int4_algorithm" not in given:
        update["int4_algorithm"] = "checkpoint"
    algorithm = update.get("int4_algorithm", config.int4_algorithm)
    requested = None if asked == AUTO else precision(str(asked))
    awq = requested is not None and requested.calibration is Calibration.OPTIONAL_AWQ and algorithm == "awq"
    if awq and requested is not stored and config.calibration is None:  # the checkpoint has no codes of its own
        raise ConfigError(
            f"{config.source} stores {quantized.described}: --precision {asked} requantizes its dequantized weights, "
            "with awq (the default) from calibration data",
            hint="add --int4-algorithm rtn, or --calibration PATH",
        )
    if asked == stored.name and (not chooses_algorithm or algorithm == "checkpoint"):
        logger.info("%s: %s, its codes taken as they are for %s", config.source, quantized.described, ", ".join(runs))
    else:
        what = f"--precision {asked}" if "precision" in given or "precision" in update else "each target's float type"
        how = (
            f" (--int4-algorithm {algorithm})"
            if requested is not None and requested.calibration is Calibration.OPTIONAL_AWQ
            else ""
        )
        logger.warning("%s: %s, dequantized for %s%s", config.source, quantized.described, what, how)
    return config.model_copy(update=update) if update else config
