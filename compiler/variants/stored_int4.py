"""The INT4 plan of a pre-quantized checkpoint (`--int4-algorithm checkpoint`, its default): each weight MatMul
of a module the checkpoint stores in INT4 takes the stored codes, scales and zero points, nothing computed
(compiler/frontend/quantized_checkpoint.py reads them; passes/int4.py writes them)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tensorsmith.compiler.frontend.quantized_checkpoint import QuantizedCheckpoint
from tensorsmith.compiler.variants.int4 import GraphSource, Int4Plan, WeightMatMuls, weight_array, weight_matmuls
from tensorsmith.core.errors import ExportError
from tensorsmith.core.grouped_int4 import GroupedInt4
from tensorsmith.passes.int4 import Int4Weight


def stored_plan(found: WeightMatMuls, checkpoint: QuantizedCheckpoint) -> Int4Plan:
    """Each weight MatMul of a module the checkpoint stores in INT4 takes its codes, scales and zero points as
    they are; the others (an output projection the checkpoint left in float) stay float."""
    by_module = {module: name for name, (module, _, _) in found.layers.items() if module}
    weights, skipped, block = {}, {}, 0
    for module in checkpoint.modules:  # the exported module holds the checkpoint's as `model` (kv_cache_module)
        name = by_module.get(module, by_module.get(f"model.{module}"))
        if name is None:
            raise ExportError(f"{checkpoint.weights.directory}: {module}'s INT4 weight has no MatMul in the exported "
                              "graph", hint="please report this with -v")  # fmt: skip
        stored = _with_folded_factor(checkpoint, module, weight_array(found.chosen[name][1]))
        weights[name], block = Int4Weight(None, None, stored.group, stored), stored.group
    for name in found.layers:
        if name not in weights:
            skipped[name] = f"not quantized in the checkpoint ({checkpoint.described})"
    return Int4Plan(weights, "checkpoint", block, found.layers, skipped)


def _with_folded_factor(checkpoint: QuantizedCheckpoint, module: str, graph_weight: np.ndarray) -> GroupedInt4:
    """The stored weight, its scales times the factor a graph pass folded into the weight (the attention scale
    into the query projection: passes/attention.py): the codes stay the checkpoint's. Anything else than one
    factor is refused: the graph would no longer compute the checkpoint's weight."""
    stored = checkpoint.weight(module)
    if not isinstance(stored, GroupedInt4):  # source_checkpoint took INT4 checkpoints only
        raise ExportError(
            f"{checkpoint.weights.directory}: {module} is not stored in INT4", hint="use --int4-algorithm rtn"
        )
    weight = stored.dequantized(checkpoint.rounding(module))  # as the export read it, unpacked once
    factor = float(np.vdot(graph_weight, weight) / max(float(np.vdot(weight, weight)), 1e-30))
    if np.abs(graph_weight - factor * weight).max() > 1e-5 * max(float(np.abs(graph_weight).max()), 1e-30):
        raise ExportError(f"{checkpoint.weights.directory}: the graph passes changed {module}'s weight beyond one "
                          "factor; its INT4 codes no longer apply", hint="please report this with -v")  # fmt: skip
    return stored if factor == 1.0 else replace(stored, scales=(stored.scales * np.float32(factor)))


def plan_stored(source: GraphSource, checkpoint: QuantizedCheckpoint) -> Int4Plan:
    """`source`'s weight MatMuls (any K: the checkpoint's groups divide it) planned from `checkpoint`."""
    return stored_plan(weight_matmuls(source, 16), checkpoint)
