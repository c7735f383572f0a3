"""A decoder's `--precision auto` search input: each INT4-able weight MatMul as every allowed level computes it,
and the bytes each level stores (compiler/variants/weight_mix.py searches over them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from tensorsmith.calibration.weight_search import FLOAT, LayerOptions
from tensorsmith.compiler.variants.int4 import Int4Plan
from tensorsmith.compiler.variants.weight_matmuls import Pin, weight_array, weight_matmuls
from tensorsmith.core.precisions import Element, precision
from tensorsmith.passes.weight_formats.table import weight_format


@dataclass(frozen=True)
class WeightLevels:
    """What the weight layers may take beyond float, for every target of the INT4 recipes, and the pins."""

    allowed: tuple[str, ...]  # the levels the search may move a layer to
    notes: dict[str, str]  # level → considered, or why not (precision.json)
    scales: dict[str, dict[str, float]] = field(default_factory=dict)  # W8A8 level → activation → scale
    pinned: dict[str, Pin] = field(default_factory=dict)  # layer → its pin


def layer_options(model: onnx.ModelProto, plan: Int4Plan, levels: WeightLevels) -> dict[str, LayerOptions]:
    """Each INT4-able weight MatMul as every allowed level computes it (its format: passes/weight_formats; int4
    with the plan's AWQ scales folded back in; a level that quantizes activations where its input has a scale),
    and the bytes each stores, as the records say, in the GPU variants' fp16 regions (the engines' sizes)."""
    options = {}
    for name, (activation, constant) in weight_matmuls(model, plan.block).chosen.items():
        if name not in plan.weights:
            continue
        weight, choice, block = weight_array(constant), plan.weights[name], plan.block_of(name)
        rows, columns = weight.shape
        weights, activation_scales = {}, {}
        for level in levels.allowed:
            format = weight_format(level)
            if format.record.quantizes_activations:
                if activation not in levels.scales.get(level, {}):
                    continue
                activation_scales[level] = levels.scales[level][activation]
            elif format.block_for(rows, block) is None:
                continue
            weights[level] = format.computed(weight, choice, block).astype(np.float32)
        stored = {
            level: precision(level).stored_bytes(rows, columns, Element.FP16, block) for level in (FLOAT, *weights)
        }
        pin = levels.pinned.get(name)
        options[name] = LayerOptions(weights, stored, activation, activation_scales, pin.level if pin else None)
    return options
