"""The cpu target's recipe: ONNX Runtime runs TensorRT-style Q/DQ (static activation scales) and its own
dynamic quantization (activation scales computed per call) at different speeds and accuracies, so under
`--precision auto` both are built within the budget and the faster one serves the cpu target.

Dynamic quantization covers MatMuls with constant weights (per-channel int8 weights), the least sensitive first
as ordered by the static search, and is bisected with real evaluations (its error is not the static one). It
starts from its own version of the fused graph (`dynamic_source`): outlier MLP units split off into a float
branch (passes/outlier_neurons.py), and SmoothQuant scaling only for activations that come out of a
normalization. Those carry per-channel outliers (LayerNorm's γ), which is what smoothing corrects; an MLP's
activation carries a few huge units, which the split removes exactly; smoothing them too added 12 Muls that ONNX
Runtime runs as separate ops, for no accuracy (measured on MiniLM: docs/benchmarks.md). Softmax logits are
floored at (row max − 80) so that masked keys keep ONNX Runtime's Softmax on its fast path
(passes/softmax_floor.py; no fp32 output changes).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.compiler.variants.rewrite import rewrite, variant_path
from tensorsmith.core.budget_search import largest_prefix
from tensorsmith.core.ir import load_onnx
from tensorsmith.core.metrics import Budget, accuracy
from tensorsmith.core.module_paths import attach_module_paths, module_paths_recorded
from tensorsmith.core.precisions import INT8, reference_precision
from tensorsmith.core.sessions import quiet_onnxruntime, run_onnx
from tensorsmith.passes import GraphPass, PassReport, run_passes
from tensorsmith.passes.embeddings import QuantizeEmbeddings
from tensorsmith.passes.outlier_neurons import SplitOutlierNeurons
from tensorsmith.passes.smooth import SmoothActivations, smoothable_activations
from tensorsmith.passes.softmax_floor import FloorSoftmaxLogits
from tensorsmith.runtime.manifest import VariantRecord, sha256_of

logger = logging.getLogger(__name__)

DYNAMIC_NAME = "cpu-int8-dynamic"
NORMALIZATIONS = frozenset({"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"})


@dataclass
class DynamicVariant:
    record: VariantRecord
    quantized: list[str]
    achieved: float
    evaluations: int


def dynamic_source(
    model: onnx.ModelProto, channel_amax: Mapping[str, np.ndarray], smoothing_alpha: float | None
) -> tuple[onnx.ModelProto, list[PassReport]]:
    """The fused fp32 graph prepared for dynamic int8 on ONNX Runtime: outlier MLP units split off, (unless
    smoothing is off) normalization outputs smoothed, Softmax logits floored. Equal to `model` in fp32.
    `channel_amax`: per-channel max |x| of the graph's weight-MatMul inputs, from calibration."""
    graph = gs.import_onnx(model)
    passes: list[GraphPass] = [SplitOutlierNeurons(channel_amax)]  # it reads the MLPs' hidden activations
    if smoothing_alpha is not None:
        tensors = graph.tensors()
        producers = {name: tensors[name].inputs[0].op for name in smoothable_activations(graph) if tensors[name].inputs}
        smooth = {name: amax for name, amax in channel_amax.items() if producers.get(name) in NORMALIZATIONS}
        passes.append(SmoothActivations(smooth, smoothing_alpha))
    passes.append(FloorSoftmaxLogits())
    reports = run_passes(graph, passes)
    prepared = gs.export_onnx(graph)
    attach_module_paths(prepared, module_paths_recorded(model))  # onnx-graphsurgeon drops node metadata
    return prepared, reports


def _no_preprocessing_advice(record: logging.LogRecord) -> bool:
    """ONNX Runtime's quantizer advises shape-inference pre-processing on the root logger at every call; our
    graphs are canonicalized (shapes inferred) already."""
    return not str(record.msg).startswith("Please consider to run pre-processing")


def _quantize_dynamic(source: Path, output: Path, nodes: list[str]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quiet_onnxruntime()
    root = logging.getLogger()
    root.addFilter(_no_preprocessing_advice)
    try:
        quantize_dynamic(
            str(source),
            str(output),
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes,
            per_channel=True,
        )
    finally:
        root.removeFilter(_no_preprocessing_advice)


def build_dynamic_variant(
    reference_path: Path,
    order: list[str],
    evaluation: dict[str, np.ndarray],
    reference: list[np.ndarray],
    budget: Budget,
    directory: Path,
) -> DynamicVariant | None:
    """The largest prefix of `order` (weight MatMuls, least sensitive first) whose dynamic quantization meets
    `budget`, written to variants/cpu-int8-dynamic.onnx; None if not even one layer fits."""
    path = variant_path(directory, DYNAMIC_NAME)
    evaluations = 0
    best: tuple[int, float] | None = None

    def achieved(count: int) -> float:
        nonlocal evaluations
        evaluations += 1
        with tempfile.TemporaryDirectory(prefix="tensorsmith-dynamic-") as scratch:
            trial = Path(scratch) / "trial.onnx"
            _quantize_dynamic(reference_path, trial, order[:count])
            value = budget.measure(reference, run_onnx(trial, evaluation))
            if budget.met(value) and (best is None or count > best[0]):
                trial.replace(path)
            return value

    path.parent.mkdir(exist_ok=True)
    value = achieved(len(order))  # the common case: every weight MatMul fits
    if budget.met(value):
        best = (len(order), value)
    else:  # the full set missed: the largest shorter prefix
        prefix = largest_prefix(len(order) - 1, achieved, budget.met, value)
        if prefix.length:
            best = (prefix.length, prefix.value)
    if best is None or best[0] == 0:
        path.unlink(missing_ok=True)
        return None
    count, value = best
    value = _with_int8_embeddings(path, evaluation, reference, budget, value)
    measured = accuracy(reference, run_onnx(path, evaluation))
    record = VariantRecord(
        name=DYNAMIC_NAME,
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        precisions=[INT8.name, reference_precision().name],
        accuracy=measured,
    )
    return DynamicVariant(record, order[:count], value, evaluations)


def _with_int8_embeddings(
    path: Path, evaluation: dict[str, np.ndarray], reference: list[np.ndarray], budget: Budget, value: float
) -> float:
    """Store the variant's vocabulary tables in int8 (passes/embeddings.py) if it still meets the budget."""
    trial = path.with_name(f".{path.name}.embeddings")
    (report,) = rewrite(load_onnx(path), [QuantizeEmbeddings(gather_first=True)], trial)
    if not report.changed:
        trial.unlink()
        return value
    smaller = budget.measure(reference, run_onnx(trial, evaluation))
    if not budget.met(smaller):
        trial.unlink()
        return value
    trial.replace(path)
    return smaller
