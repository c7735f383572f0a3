"""INT4 weight-only variants (`--precision int4`): every weight MatMul whose input dimension is a multiple of the
block stored in INT4 (passes/int4.py), by round-to-nearest or AWQ (calibration/awq.py, the default), vocabulary
tables in int8 rows; one variant per kind of float region (`int4`: fp16 for GPUs, `cpu-int4`: fp32 for ONNX
Runtime), each measured against the fp32 graph, as a language model where the model is a decoder.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx_graphsurgeon as gs

from tensorsmith.calibration import CalibrationData
from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.awq_layers import awq_search, awq_statistics
from tensorsmith.compiler.variants.measure import Evaluation, measure_variant
from tensorsmith.compiler.variants.precision_plan import RecipePlan
from tensorsmith.compiler.variants.records import variant_record
from tensorsmith.compiler.variants.resume import LayerRecords
from tensorsmith.compiler.variants.rewrite import rewrite, rewrite_file, rewritten, variant_path
from tensorsmith.compiler.variants.weight_matmuls import (
    GraphSource,
    Pin,
    WeightLayer,
    source_graph,
    weight_array,
    weight_matmuls,
)
from tensorsmith.core.budget_search import quantized_fraction
from tensorsmith.core.ir import remove_onnx
from tensorsmith.core.precisions import INT4
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import GraphPass, PassReport
from tensorsmith.passes.embeddings import MIN_ROWS, QuantizeEmbeddings, row_block, tied_projections
from tensorsmith.passes.fp16 import ConvertToFp16
from tensorsmith.passes.int4 import Int4Weight
from tensorsmith.passes.weight_formats.base import LayerWeights, Quantized, StoredCodes
from tensorsmith.passes.weight_formats.stacked import StackedWeightOnly
from tensorsmith.passes.weight_formats.table import FORMATS, weight_format
from tensorsmith.runtime.manifest import VariantRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int4Plan:
    weights: dict[str, Int4Weight]  # MatMul node → its quantization
    algorithm: str
    block: int
    layers: dict[str, WeightLayer]  # every weight MatMul
    skipped: dict[str, str] = field(default_factory=dict)  # MatMul node → why it stays in float
    alphas: dict[str, float] = field(default_factory=dict)  # activation → AWQ's α
    error_vs_rtn: dict[str, float] = field(default_factory=dict)  # activation → AWQ's sample error / RTN's

    def block_of(self, name: str) -> int:
        """The block layer `name` is quantized in (smaller than `block` where that does not divide its K)."""
        return self.weights[name].block or self.block


def plan_int4(
    source: GraphSource,
    algorithm: str,
    block: int,
    data: CalibrationData | None,
    reporter: Reporter,
    records: LayerRecords | None = None,
    smaller_blocks: bool = True,
) -> Int4Plan:
    """Round-to-nearest, or AWQ's scales and clipping searched on one pass over the calibration data. `records`:
    each activation's statistics and search results kept as they are found, and read back where a killed compile
    found them already (compiler/variants/resume.py)."""
    found = weight_matmuls(source, block)
    matmuls, skipped, smaller = found.chosen, found.skipped, found.blocks
    if not smaller_blocks:  # a format whose block is its own (mxfp4's 32): a layer it does not divide stays float
        skipped = {**skipped, **{name: f"its K is not a multiple of {block}" for name in smaller}}
        matmuls = {name: matmul for name, matmul in matmuls.items() if name not in smaller}
        smaller = {}
    if smaller:
        logger.info(
            "int4: %d of %d weight layers take a smaller block than %d (their K is not a multiple of it)",
            len(smaller),
            len(matmuls),
            block,
        )
    for name, reason in skipped.items():  # said on the console: never silently float
        logger.warning("int4: %s stays in float: %s", found.layers[name].module or name, reason)
    if algorithm == "rtn":
        weights = {name: Int4Weight(None, None, smaller.get(name)) for name in matmuls}
        return Int4Plan(weights, algorithm, block, found.layers, skipped)
    assert data is not None, "awq needs calibration data (checked with the config)"
    activations = sorted({activation for activation, _ in matmuls.values()})
    statistics = awq_statistics(source, activations, data, reporter, records)
    weights, alphas, relative = {}, {}, {}
    with reporter.task("int4 awq: scale and clipping search", len(activations)) as advance:
        for activation in activations:
            readers = [name for name, (tensor, _) in matmuls.items() if tensor == activation]
            own = smaller.get(readers[0])  # readers of one activation share its K, and so the block
            done = records.get(f"awq/{activation}") if records is not None else None
            if done is None:
                done = awq_search(statistics[activation], [matmuls[name][1] for name in readers], own or block)
                if records is not None:
                    records.put(f"awq/{activation}", done)
            alphas[activation], relative[activation] = float(done["alpha"]), float(done["relative"])
            for index, name in enumerate(readers):
                weights[name] = Int4Weight(done["scale"], done[f"clip{index}"], own)
            advance(1)
    return Int4Plan(weights, algorithm, block, found.layers, skipped, alphas, relative)


def tied_projection_names(source: GraphSource) -> set[str]:
    """The output projections QuantizeEmbeddings(int4=True) makes read its INT4 table (tables it stores in INT4)."""
    with source_graph(source) as (graph, _):
        tables = [
            node.inputs[0]
            for node in graph.nodes
            if node.op == "Gather"
            and isinstance(node.inputs[0], gs.Constant)
            and len(node.inputs[0].shape) == 2
            and node.inputs[0].shape[0] >= MIN_ROWS
            and row_block(node.inputs[0].shape[1])
        ]
        return {node.name for table in tables for node in tied_projections(graph, weight_array(table))}


def build_int4_variant(
    model: GraphSource,
    recipe: Recipe,
    plan: Int4Plan,
    evaluation: Evaluation,
    directory: Path,
    assignment: Mapping[str, str] | None = None,
    tables: bool = True,
    scales: Mapping[str, Mapping[str, float]] | None = None,
    stored_weights: StoredCodes | None = None,
    experts: bool = False,
    stored_experts: Mapping[str, Callable[[], Quantized]] | None = None,
) -> tuple[VariantRecord, list[PassReport]]:
    """Write and measure the weight-only variant of `recipe` (fp16 or fp32 float regions): every layer of the plan
    in the requested format, or as `assignment` says per layer (any format of passes/weight_formats, those that
    quantize activations with the `scales` of that precision, or float); vocabulary tables quantized when `tables`;
    `stored_weights`: a checkpoint's own weights in the requested format (NVFP4's); `experts`: a mixture of
    experts' stacked weights in the requested format too (passes/weight_formats/stacked.py), `stored_experts` a
    checkpoint's own codes for them. Returns the record
    (its accuracy measure_variant's figures) and the passes' reports."""
    name = recipe.variant
    path = variant_path(directory, name)
    requested = recipe.quantized
    assert requested is not None, "a quantized recipe"
    levels = assignment if assignment is not None else dict.fromkeys(plan.weights, requested.name)
    # vocabulary tables: int8 rows gathered first on ONNX Runtime (it cannot Gather INT4); INT4 for TensorRT, where
    # an output projection tied to the table reads the same INT4 table when it is in INT4 itself
    cpu = recipe.on_cpu
    tied = set() if cpu or not tables else {n for n in tied_projection_names(model) if levels.get(n) == INT4.name}
    # the requested precision's pass counts the layers left in float as skipped (each of the others is quantized
    # by one pass): its report then agrees with precision.json
    floats = {
        node: plan.skipped.get(node, "kept in float by the plan")
        for node in plan.layers
        if levels.get(node) not in FORMATS
    }

    def format_passes(measured: bool) -> list[GraphPass]:
        """A pass per format the variant stores layers in (the requested one always), in the table's order."""
        passes = []
        for format in FORMATS.values():
            level, own = format.record.name, format.record is requested
            nodes = {node: plan.weights[node] for node, at in levels.items() if at == level and node not in tied}
            if nodes or own:
                activation_scales = (scales or {}).get(level, {})
                assert not nodes or not format.record.quantizes_activations or activation_scales, f"{level}: scales"
                stored = (stored_weights or {}) if own else {}
                layers = LayerWeights(nodes, plan.block, floats if own else {}, stored, activation_scales, measured)
                passes.append(format.graph_pass(layers))
        if experts:
            stacked = StackedWeightOnly(weight_format(requested), plan.block, measured, dict(stored_experts or {}))
            passes.append(stacked)
        return passes

    def with_tables(passes: list[GraphPass]) -> list[GraphPass]:
        if tables:
            passes.append(QuantizeEmbeddings(gather_first=cpu, int4=not cpu, tie=bool(tied)))
        if recipe.fp16_regions:
            passes.append(ConvertToFp16())
        return passes

    written = with_tables(format_passes(measured=False))
    reports = rewrite_file(model, written, path) if isinstance(model, Path) else rewrite(model, written, path)
    # a format ONNX Runtime cannot run (nvfp4, mxfp4), in a layer or in the stacked experts: measured on the same
    # weights held in fp32
    written_formats = {FORMATS[level] for level in set(levels.values()) & FORMATS.keys()}
    if experts:
        written_formats.add(weight_format(requested))
    simulated = any(not format.onnxruntime_runs for format in written_formats)
    if simulated and isinstance(model, Path):
        # written beside the variant, its weights mapped, and measured from the file: a graph the machine's size
        # is measured a layer at a time there (measure.py), where a copy in memory would hold every weight in fp32
        measured = path.with_name(f".{path.stem}-measured.onnx")
        rewrite_file(model, with_tables(format_passes(measured=True)), measured)
        try:
            figures = measure_variant(measured, evaluation)
        finally:
            remove_onnx(measured)
    elif simulated:
        assert not isinstance(model, Path)
        figures = measure_variant(rewritten(model, with_tables(format_passes(measured=True)))[0], evaluation)
    else:
        figures = measure_variant(path, evaluation)
    stored = sorted({requested.name, *levels.values()} & FORMATS.keys(), reverse=True)
    record = variant_record(directory, path, name, [*stored, recipe.floats.name], figures, evaluation.described)
    logger.info("%s variant (%s, block %d): %s", name, plan.algorithm, plan.block, record.accuracy)
    return record, reports


def tables_policy(recipe: Recipe, tables: bool) -> str:
    """What an INT4 variant does with its vocabulary tables (build_int4_variant), in precision.json's words."""
    if not tables:
        return "higher precision (the smallest variant within the budget keeps them)"
    if recipe.on_cpu:
        return "int8 rows, gathered first (ONNX Runtime cannot Gather INT4)"
    return "INT4 rows, blocks of 32 (a tied output projection in INT4 reads the same table)"


def int4_recipe_plan(
    recipe: Recipe,
    plan: Int4Plan,
    targets: list[str],
    evaluations: int,
    pinned: Mapping[str, Pin] | None = None,
) -> RecipePlan:
    """precision.json's entry: each weight MatMul's precision and why (AWQ's α and its error against RTN's, or the
    override that pins it)."""
    assert recipe.quantized is not None
    requested = recipe.quantized
    choices = []
    for name, layer in plan.layers.items():
        level = requested.name if name in plan.weights else recipe.floats.name
        if pinned and name in pinned:
            level, reason = pinned[name].level, pinned[name].reason
        elif name not in plan.weights:
            reason = plan.skipped.get(name, "policy")
        elif plan.algorithm == "checkpoint":
            reason = "the checkpoint's own codes and scales"
        elif plan.algorithm == "awq":
            alpha, relative = plan.alphas[layer.activation], plan.error_vs_rtn[layer.activation]
            reason = f"awq: α={alpha:g}, sample error {relative:.3f}× RTN's"
        else:
            reason = weight_format(requested).reason
        if name in plan.weights and plan.block_of(name) != plan.block:
            reason += f"; block {plan.block_of(name)} (its K is not a multiple of {plan.block})"
        choices.append(layer.choice(name, level if level in FORMATS else recipe.floats.name, reason))
    quantized = {choice.name for choice in choices if choice.precision != recipe.floats.name}
    fraction = quantized_fraction({choice.name: choice.flops for choice in choices}, quantized)
    return RecipePlan(
        precision=requested.name,
        float_regions=recipe.floats.name,
        met=True,
        quantized_flops_fraction=round(fraction, 4),
        evaluations=evaluations,
        embeddings=tables_policy(recipe, tables=True),
        layers=choices,
        targets=targets,
    )
