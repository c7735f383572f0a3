"""The INT4 plan of a pre-quantized checkpoint (`--int4-algorithm checkpoint`, its default): each weight MatMul
of a module the checkpoint stores in INT4 takes the stored codes, scales and zero points, nothing computed
(compiler/frontend/quantized_checkpoint.py reads them; passes/int4.py writes them)."""

from __future__ import annotations

from typing import cast

from tensorsmith.compiler.frontend.quantized_checkpoint import QuantizedCheckpoint
from tensorsmith.compiler.variants.int4 import Int4Plan
from tensorsmith.compiler.variants.stored_codes import module_matmuls, stored_weights, with_folded_factor
from tensorsmith.compiler.variants.weight_matmuls import GraphSource, WeightMatMuls, weight_array, weight_matmuls
from tensorsmith.core.errors import ExportError
from tensorsmith.core.grouped_int4 import GroupedInt4
from tensorsmith.passes.int4 import Int4Weight
from tensorsmith.passes.nvfp4 import NVFP4_BLOCK, StoredNvfp4


def stored_plan(found: WeightMatMuls, checkpoint: QuantizedCheckpoint) -> Int4Plan:
    """Each weight MatMul of a module the checkpoint stores in INT4 takes its codes, scales and zero points as
    they are; the others (an output projection the checkpoint left in float) stay float."""
    weights, skipped, block = {}, {}, 0
    for module, name in module_matmuls(found.layers, checkpoint).items():
        stored = with_folded_factor(checkpoint, module, weight_array(found.chosen[name][1]))
        if not isinstance(stored, GroupedInt4):  # source_checkpoint took INT4 checkpoints only
            raise ExportError(
                f"{checkpoint.weights.directory}: {module} is not stored in INT4", hint="use --int4-algorithm rtn"
            )
        weights[name], block = Int4Weight(None, None, stored.group, stored), stored.group
    for name in found.layers:
        if name not in weights:
            skipped[name] = f"not quantized in the checkpoint ({checkpoint.described})"
    return Int4Plan(weights, "checkpoint", block, found.layers, skipped)


def plan_stored(source: GraphSource, checkpoint: QuantizedCheckpoint) -> Int4Plan:
    """`source`'s weight MatMuls (any K: the checkpoint's groups divide it) planned from `checkpoint`."""
    return stored_plan(weight_matmuls(source, 16), checkpoint)


def plan_stored_nvfp4(source: GraphSource, checkpoint: QuantizedCheckpoint) -> tuple[Int4Plan, StoredNvfp4]:
    """An NVFP4 checkpoint's plan: the MatMuls of the modules it stores in NVFP4 (each weight made from the stored
    codes and scales when the pass reaches it), the others float, as the checkpoint left them."""
    found = weight_matmuls(source, NVFP4_BLOCK)
    made, reasons = stored_weights(found.layers, checkpoint)
    weights = {name: Int4Weight(None, None, NVFP4_BLOCK) for name in made}
    skipped = {name: reason for name, reason in reasons.items() if name not in made}
    return Int4Plan(weights, "checkpoint", NVFP4_BLOCK, found.layers, skipped), cast(StoredNvfp4, made)


def plan_float(source: GraphSource, block: int, reason: str) -> Int4Plan:
    """Every weight MatMul of `source` kept in float, with `reason` (a checkpoint that quantizes only its
    experts: passes/weight_formats/stacked.py takes those)."""
    found = weight_matmuls(source, block)
    return Int4Plan({}, "checkpoint", block, found.layers, dict.fromkeys(found.layers, reason))
