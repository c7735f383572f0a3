"""A pre-quantized checkpoint's stored weights matched to the exported graph: which weight MatMul computes each
quantized module, and the stored weight as that MatMul reads it (any factor a graph pass folded into the weight
moved into its scales, the codes untouched). compiler/variants/stored_int4.py and fp8_weight_builder.py use them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.layout_record import StoredWeight
from tensorsmith.compiler.frontend.mxfp4_weights import CODES_PER_BLOCK, Mxfp4Weights
from tensorsmith.compiler.frontend.quantized_checkpoint import QuantizedCheckpoint, quantized_checkpoint_of
from tensorsmith.compiler.variants.weight_matmuls import WeightLayer
from tensorsmith.core.errors import ExportError
from tensorsmith.core.precisions import Element, Precision, storing
from tensorsmith.core.quantization_declared import MXFP4_METHOD, declared_method
from tensorsmith.passes.weight_formats.base import Quantized


def module_matmuls(layers: dict[str, WeightLayer], checkpoint: QuantizedCheckpoint) -> dict[str, str]:
    """Each quantized module's weight MatMul in the graph (the exported module holds the checkpoint's as `model`:
    kv_cache_module)."""
    by_module = {layer.module: name for name, layer in layers.items() if layer.module}
    found = {}
    for module in checkpoint.modules:
        name = by_module.get(module, by_module.get(f"model.{module}"))
        if name is None:
            raise ExportError(
                f"{checkpoint.weights.directory}: {module}'s {checkpoint.element.value} weight has no MatMul in the "
                "exported graph",
                hint="please report this with -v",
            )
        found[module] = name
    return found


def with_folded_factor(checkpoint: QuantizedCheckpoint, module: str, graph_weight: np.ndarray) -> StoredWeight:
    """The stored weight, its scales times the factor a graph pass folded into the weight (the attention scale
    into the query projection: passes/attention.py): the codes stay the checkpoint's. Anything else than one
    factor is refused: the graph would no longer compute the checkpoint's weight."""
    stored = checkpoint.weight(module)
    weight = stored.dequantized(checkpoint.rounding(module))  # as the export read it, unpacked once
    factor = float(np.vdot(graph_weight, weight) / max(float(np.vdot(weight, weight)), 1e-30))
    if np.abs(graph_weight - factor * weight).max() > 1e-5 * max(float(np.abs(graph_weight).max()), 1e-30):
        raise ExportError(
            f"{checkpoint.weights.directory}: the graph passes changed {module}'s weight beyond one factor; its "
            f"{checkpoint.element.value} codes no longer apply",
            hint="please report this with -v",
        )
    return stored if factor == 1.0 else stored.scaled(factor)


def stored_weights(
    layers: dict[str, WeightLayer], checkpoint: QuantizedCheckpoint
) -> tuple[dict[str, partial[StoredWeight]], dict[str, str]]:
    """Each weight MatMul of a module the checkpoint stores quantized: its stored weight as the MatMul reads it,
    made when a pass reaches it (from the graph's weight: with_folded_factor); and every weight MatMul's reason."""
    made = {
        name: partial(with_folded_factor, checkpoint, module)
        for module, name in module_matmuls(layers, checkpoint).items()
    }
    reasons = {name: f"the checkpoint's own codes and scales ({checkpoint.described})" for name in made}
    for name in layers:
        reasons.setdefault(name, f"not quantized in the checkpoint: {checkpoint.described}")
    return made, reasons


def stored_checkpoint(config: CompileConfig, element: Element) -> QuantizedCheckpoint | None:
    """The source's checkpoint where it stores `element` codes (taken as stored); None for any other source."""
    if config.source_kind != "huggingface":
        return None
    found = quantized_checkpoint_of(config.resolve(config.source))
    return found if found is not None and found.element is element else None


def stored_experts(config: CompileConfig, record: Precision) -> dict[str, Callable[[], Quantized]]:
    """A checkpoint's stacked experts' own codes where `record` is their format (gpt-oss's MXFP4_METHOD for the e2m1
    record in blocks of 32), made when the pass reaches them; none for any other source or record."""
    if config.source_kind != "huggingface":
        return {}
    directory = config.resolve(config.source)
    if declared_method(directory) != MXFP4_METHOD or record is not storing(Element.FP4_E2M1, CODES_PER_BLOCK):
        return {}
    return Mxfp4Weights(directory).stacked_codes()
