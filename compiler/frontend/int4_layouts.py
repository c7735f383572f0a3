"""The INT4 layouts as their packers write them (core/grouped_int4.py unpacks them): AutoAWQ's GEMM, GPTQ (the
original format and gptq_v2, rows in order or act-order) and compressed-tensors' pack-quantized W4A16."""

from __future__ import annotations

from collections.abc import Callable

from tensorsmith.compiler.frontend.checkpoint_weights import CheckpointWeights
from tensorsmith.compiler.frontend.layout_record import HINT, Layout
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.grouped_int4 import GroupedInt4, awq_int4, compressed_tensors_int4, gptq_int4
from tensorsmith.core.precisions import Element


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
