"""The weight formats, one row per quantized precision of the table (core/precisions.py) that stores weights:
the record and the module that quantizes in it. Adding a format is its record there and a row here."""

from __future__ import annotations

from tensorsmith.core.errors import ConfigError
from tensorsmith.core.precisions import (
    FP8,
    FP8_WEIGHT,
    INT4,
    INT8,
    INT8_WEIGHT,
    MXFP4,
    NVFP4,
    PRECISIONS,
    Precision,
    Quantizes,
)
from tensorsmith.passes.weight_formats.base import WeightFormat
from tensorsmith.passes.weight_formats.calibrated import CalibratedFormat
from tensorsmith.passes.weight_formats.fp8_weight import Fp8WeightFormat
from tensorsmith.passes.weight_formats.int4 import Int4Format
from tensorsmith.passes.weight_formats.int8_weight import Int8WeightFormat
from tensorsmith.passes.weight_formats.mxfp4 import Mxfp4Format
from tensorsmith.passes.weight_formats.nvfp4 import Nvfp4Format

FORMATS: dict[str, WeightFormat] = {
    format.record.name: format
    for format in (
        CalibratedFormat(INT8),
        CalibratedFormat(FP8),
        Int8WeightFormat(INT8_WEIGHT),
        Int4Format(INT4),
        Nvfp4Format(NVFP4),
        Mxfp4Format(MXFP4),
        Fp8WeightFormat(FP8_WEIGHT),
    )
}


def weight_format(record: Precision | str) -> WeightFormat:
    """The format of a quantized precision (a record or its name); a ConfigError for a float one."""
    name = record if isinstance(record, str) else record.name
    found = FORMATS.get(name)
    if found is None:
        stored = PRECISIONS.get(name)
        said = "a float precision" if stored is not None and stored.quantizes is Quantizes.NOTHING else "unknown"
        raise ConfigError(f"precision '{name}' has no weight format ({said})", hint=f"formats are {', '.join(FORMATS)}")
    return found
