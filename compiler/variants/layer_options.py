"""A decoder's `--precision auto` search input: each INT4-able weight MatMul as every allowed level computes it,
and the bytes each level stores (compiler/variants/weight_mix.py searches over them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from tensorsmith.calibration.weight_search import FLOAT, INT4, INT8_WEIGHT, LEVELS, WITH_ACTIVATIONS, LayerOptions
from tensorsmith.compiler.variants.int4 import Int4Plan
from tensorsmith.compiler.variants.weight_matmuls import Pin, weight_array, weight_matmuls
from tensorsmith.core.precisions import INT8, NVFP4, Element, precision
from tensorsmith.passes.int4 import dequantize_int4, quantize_int4
from tensorsmith.passes.int8_weights import int8_weight
from tensorsmith.passes.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from tensorsmith.passes.quantize import quantize_weights


@dataclass(frozen=True)
class WeightLevels:
    """What the weight layers may take beyond float, for every target of the INT4 recipes, and the pins."""

    allowed: tuple[str, ...]  # the levels the search may move a layer to
    notes: dict[str, str]  # level → considered, or why not (precision.json)
    scales: dict[str, dict[str, float]] = field(default_factory=dict)  # W8A8 level → activation → scale
    pinned: dict[str, Pin] = field(default_factory=dict)  # layer → its pin


def layer_options(model: onnx.ModelProto, plan: Int4Plan, levels: WeightLevels) -> dict[str, LayerOptions]:
    """Each INT4-able weight MatMul as every allowed level computes it (int4 with the plan's AWQ scales folded
    back in), and the bytes each stores (fp16; one byte and a scale per column; int4 with its block scales; nvfp4
    with its fp8 block scales)."""
    options = {}
    for name, (activation, constant) in weight_matmuls(model, plan.block).chosen.items():
        if name not in plan.weights:
            continue
        weight = weight_array(constant)
        choice = plan.weights[name]
        scale = choice.input_scale if choice.input_scale is not None else np.ones(weight.shape[0], np.float32)
        block = plan.block_of(name)
        q, step = quantize_int4(weight * scale[:, None], block, choice.clip)
        weights = {INT4: dequantize_int4(q, step, block) / scale[:, None]}
        codes, scales = int8_weight(weight)
        weights[INT8_WEIGHT] = codes * scales
        activation_scales = {}
        for level in WITH_ACTIVATIONS:
            if level in levels.allowed and activation in levels.scales.get(level, {}):
                if level == INT8.name:  # W8A8's weights are the weight-only level's, a scale per column
                    weights[level] = weights[INT8_WEIGHT]
                else:
                    values, steps = quantize_weights(weight, 1, level)
                    weights[level] = values.astype(np.float32) * steps
                activation_scales[level] = levels.scales[level][activation]
        rows, columns = weight.shape
        if NVFP4.name in levels.allowed and NVFP4.block and rows % NVFP4.block == 0:
            weights[NVFP4.name] = dequantize_nvfp4(quantize_nvfp4(weight, NVFP4.block))
        # the records say what each level stores, in the GPU variants' fp16 regions (the engines' sizes)
        stored = {
            level: precision(level).stored_bytes(rows, columns, Element.FP16, block) for level in (FLOAT, *LEVELS)
        }
        pin = levels.pinned.get(name)
        pinned = pin.level if pin is not None else None
        options[name] = LayerOptions(
            {level: values.astype(np.float32) for level, values in weights.items()},
            stored,
            activation,
            activation_scales,
            pinned,
        )
    return options
