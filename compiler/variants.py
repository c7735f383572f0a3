"""Quantized variants: calibrate the fused fp32 graph once, choose each recipe's layers, insert Q/DQ, and
measure every variant against fp32 on held-out data.

A recipe is a precision and the targets that run it (`--precision int8|fp8`: one recipe for all targets;
`auto`: int8 for cpu, sm_75 and Ampere, fp8 from sm_89). Under a budget, one search per precision chooses the
layers. Each recipe yields one variant per kind of float region: GPUs compute the unquantized layers in fp16
(variant `int8`, `fp8`), the cpu in fp32 (`cpu-int8`, and `cpu-int8-dynamic` when ONNX Runtime's dynamic
quantization runs faster within the budget). Targets that share a variant share its file and engine input.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.calibration import CalibrationData, CalibrationTable, Observer, build_table, tensors_to_observe
from tensorsmith.calibration.data import Feeds
from tensorsmith.calibration.layers import Layer, Override, activation_shapes, list_layers
from tensorsmith.calibration.search import PrecisionSearch
from tensorsmith.calibration.statistics import HISTOGRAMS_NAME, save_histograms
from tensorsmith.compiler import cpu_recipe
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.ir import save_onnx
from tensorsmith.compiler.metrics import Budget, accuracy
from tensorsmith.compiler.module_paths import attach_module_paths, module_paths_recorded
from tensorsmith.compiler.progress import Reporter
from tensorsmith.compiler.targets import quantized_precision
from tensorsmith.compiler.verify import run_onnx
from tensorsmith.passes import GraphPass, PassReport, run_passes
from tensorsmith.passes.quantize import InsertQDQ, Precision
from tensorsmith.runtime.manifest import TensorRecord, VariantRecord, sha256_of

logger = logging.getLogger(__name__)

HELD_OUT_FRACTION = 4  # without --eval-data, the last quarter of the calibration samples is held out
MAX_VERIFY_RETRIES = 4


@dataclass
class Variants:
    records: list[VariantRecord] = field(default_factory=list)
    reports: list[PassReport] = field(default_factory=list)
    by_target: dict[str, str] = field(default_factory=dict)  # target → variant name
    unmet: list[str] = field(default_factory=list)  # recipes whose budget does not hold, with the figure
    session_tuned: set[str] = field(default_factory=set)  # variants whose ONNX Runtime settings were measured


def _concatenate(batches: list[Feeds]) -> Feeds:
    return {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]}


def split_data(config: CompileConfig, inputs: list[TensorRecord]) -> tuple[CalibrationData, Feeds, str]:
    """(calibration data, evaluation feeds, what the evaluation is): never the same samples in both."""
    assert config.calibration is not None
    specs = [record.spec() for record in inputs]
    source = config.resolve(config.calibration)
    if config.evaluation is not None:
        evaluation = config.resolve(config.evaluation)
        feeds = _concatenate(list(CalibrationData(evaluation, specs, batch_size=256).batches()))
        data = CalibrationData(source, specs, config.calibration_batch_size, config.calibration_samples)
        return data, feeds, str(evaluation)
    total = CalibrationData(source, specs, batch_size=256).count()
    if config.calibration_samples is not None:
        total = min(total, config.calibration_samples)
    held = max(1, total // HELD_OUT_FRACTION)
    if total - held < 1:
        data = CalibrationData(source, specs, config.calibration_batch_size, total)
        feeds = _concatenate(list(CalibrationData(source, specs, batch_size=256, limit=total).batches()))
        return data, feeds, f"the {total} calibration samples (too few to hold any out)"
    data = CalibrationData(source, specs, config.calibration_batch_size, limit=total - held)
    feeds = _concatenate(list(CalibrationData(source, specs, batch_size=256, limit=held, skip=total - held).batches()))
    return data, feeds, f"{held} calibration samples held out of calibration (the last of {total})"


def check_data(config: CompileConfig) -> None:
    """Check the calibration and evaluation data against the declared inputs before any slow work (export),
    so a wrong array name or dtype fails in a second, not after minutes."""
    from tensorsmith.runtime.specs import TensorSpec

    specs = [TensorSpec(decl.name, decl.dtype, tuple(decl.dims)) for decl in config.inputs]
    for path in (config.calibration, config.evaluation):
        if path is not None:
            CalibrationData(config.resolve(path), specs, batch_size=256).count()


def _recipes(config: CompileConfig) -> dict[Precision, dict[str, list[str]]]:
    """precision → float regions ("fp32" on the cpu, "fp16" on GPUs) → the targets that share that variant."""
    recipes: dict[Precision, dict[str, list[str]]] = {}
    for target in config.targets:
        precision = quantized_precision(target) if config.precision == "auto" else config.precision
        regions = "fp32" if target == "cpu" else "fp16"
        recipes.setdefault(precision, {}).setdefault(regions, []).append(target)
    return recipes


def variant_name(precision: str, regions: str) -> str:
    """GPU variants (fp16 regions) are named by their precision; the cpu's (fp32 regions) get a cpu- prefix."""
    return precision if regions == "fp16" else f"cpu-{precision}"


def rewrite(model: onnx.ModelProto, passes: list[GraphPass], path: Path) -> list[PassReport]:
    """Run `passes` on a copy of `model` and save the result at `path` (a variant file)."""
    graph = gs.import_onnx(model)
    reports = run_passes(graph, passes)
    path.parent.mkdir(exist_ok=True)
    save_onnx(gs.export_onnx(graph), path)
    return reports


def _write_variant(model: onnx.ModelProto, precision: Precision, scales: dict[str, float], nodes: list[str],
                   regions: str, path: Path, embeddings: bool = False) -> PassReport:  # fmt: skip
    """Q/DQ on `nodes`; with `embeddings`, vocabulary tables stored in int8 (weight-only); with fp16 regions,
    everything left in float computes in fp16 (LayerNorm in fp32)."""
    from tensorsmith.passes.embeddings import QuantizeEmbeddings
    from tensorsmith.passes.fp16 import ConvertToFp16

    passes: list[GraphPass] = [InsertQDQ(precision, scales, nodes=nodes)]
    if embeddings:
        passes.append(QuantizeEmbeddings(gather_first=regions == "fp32"))  # fp32 regions: the cpu, ONNX Runtime
    if regions == "fp16":
        passes.append(ConvertToFp16())
    return rewrite(model, passes, path)[0]


def _flops_fraction(layers: list[Layer], quantized: set[str]) -> float:
    """The share of the layers' FLOPs that `quantized` covers."""
    total = max(sum(layer.flops for layer in layers), 1)
    return sum(layer.flops for layer in layers if layer.name in quantized) / total


def build_variants(
    model: onnx.ModelProto,
    config: CompileConfig,
    inputs: list[TensorRecord],
    reference_path: Path,
    directory: Path,
    reporter: Reporter,
) -> Variants:
    """Write `variants/<precision>.onnx`, `calibration.json`, `calibration/int8.cache` and `precision.json`."""
    data, evaluation, evaluated_on = split_data(config, inputs)
    budget = Budget.parse(config.budget) if config.precision == "auto" else None
    fused = model
    # Per-channel ranges of the fused graph's MatMul inputs: smoothing needs them, and so does the cpu recipe's
    # dynamic-int8 graph (cpu_recipe.dynamic_source); one calibration pass serves both.
    channel_amax: dict[str, np.ndarray] = {}
    if "int8" in _recipes(config) and (config.smoothing or budget is not None):
        reporter.stage("measuring per-channel activation ranges (int8)")
        channel_amax = _channel_amax(fused, data, reporter)
    smoothing: PassReport | None = None
    if config.smoothing and "int8" in _recipes(config):
        reporter.stage("smoothing activation outliers into the weights (int8)")
        model, smoothing = _smooth(model, channel_amax, config.smoothing_alpha)
    reporter.stage(f"calibrating ({config.calibrator}) on {config.calibration}")
    observer = Observer(model, tensors_to_observe(model))
    statistics = observer.collect_histograms(data, observer.collect_ranges(data, reporter), reporter)
    table = build_table(statistics, config.calibrator, samples=observer.samples, percentile=config.percentile)
    table.write_json(directory / "calibration.json")
    (directory / "calibration").mkdir(exist_ok=True)
    table.write_tensorrt_cache(directory / "calibration" / "int8.cache", config.tensorrt_cache_version)
    save_histograms(statistics, directory / "calibration" / HISTOGRAMS_NAME)

    overrides = [Override(o.match, o.precision) for o in config.overrides]
    one_sample = {name: array[:1] for name, array in evaluation.items()}
    layers = list_layers(model, activation_shapes(observer.run(one_sample)), overrides)
    reference = run_onnx(reference_path, evaluation)

    variants = Variants()
    if smoothing is not None:
        variants.reports.append(smoothing)
    plan: dict[str, object] = {"precision": config.precision, "evaluated_on": evaluated_on, "recipes": {}}
    if budget is not None:
        plan.update(budget=str(budget), sensitivity_samples=config.sensitivity_samples)
    for precision, by_regions in _recipes(config).items():
        scales = table_scales(table, precision)
        search = _search(model, config, precision, scales, layers, evaluation, budget, reporter)
        for regions, targets in by_regions.items():
            record, report, summary = _build(
                model, precision, regions, scales, layers, search, evaluation, reference, budget, directory, reporter
            )
            record.evaluated_on = evaluated_on
            variants.records.append(record)
            variants.reports.append(report)
            variants.by_target.update({target: record.name for target in targets})
            summary["targets"] = targets
            plan["recipes"][record.name] = summary  # type: ignore[index]
            if budget is not None and not summary["met"]:
                variants.unmet.append(f"{record.name}: {budget.metric} {summary['achieved']:.6f} (budget {budget})")
            if budget is not None and precision == "int8" and "cpu" in targets:
                reporter.stage("cpu: dynamic quantization within the budget, and the faster recipe")
                alpha = config.smoothing_alpha if config.smoothing else None
                source = cpu_recipe.dynamic_source(fused, channel_amax, alpha)
                choice = _cpu_choice(source, layers, search.order, record, evaluation, reference, budget, directory)
                variants.session_tuned.add(choice.record.name)
                if choice.record is not record:
                    choice.record.evaluated_on = evaluated_on
                    variants.records.append(choice.record)
                    variants.by_target["cpu"] = choice.record.name
                summary["cpu"] = _cpu_summary(choice, source[1])
    (directory / "precision.json").write_text(json.dumps(plan, indent=2) + "\n")
    return variants


def _channel_amax(model: onnx.ModelProto, data: CalibrationData, reporter: Reporter) -> dict[str, np.ndarray]:
    """max |x| per channel of every activation read by a weight MatMul (passes/smooth.py)."""
    from tensorsmith.passes.smooth import smoothable_activations

    activations = list(smoothable_activations(gs.import_onnx(model)))
    return Observer(model, activations).collect_channel_amax(data, reporter) if activations else {}


def _smooth(model: onnx.ModelProto, amax: dict[str, np.ndarray], alpha: float) -> tuple[onnx.ModelProto, PassReport]:
    """The fused graph with SmoothQuant scaling (x/s, s·W): equal in fp32, kinder to per-tensor int8."""
    from tensorsmith.passes.smooth import SmoothActivations

    graph = gs.import_onnx(model)
    (report,) = run_passes(graph, [SmoothActivations(amax, alpha)])
    smoothed = gs.export_onnx(graph)
    attach_module_paths(smoothed, module_paths_recorded(model))  # onnx-graphsurgeon drops node metadata
    return smoothed, report


@dataclass
class Search:
    """Which candidates to quantize, cheapest first (`order`), and how many of them (`chosen`)."""

    order: list[str]
    chosen: list[str]
    sensitivity: dict[str, float] = field(default_factory=dict)
    evaluations: int = 0


def _search(
    model: onnx.ModelProto,
    config: CompileConfig,
    precision: Precision,
    scales: dict[str, float],
    layers: list[Layer],
    evaluation: Feeds,
    budget: Budget | None,
    reporter: Reporter,
) -> Search:
    candidates = [layer.name for layer in layers if layer.pinned is None]
    if budget is None:
        return Search(candidates, candidates)
    reporter.stage(f"{precision}: sensitivity of {len(candidates)} layers against {budget}")
    sample = {name: array[: config.sensitivity_samples] for name, array in evaluation.items()}
    flops = {layer.name: layer.flops for layer in layers}
    result = PrecisionSearch(model, precision, scales, candidates, sample, budget, flops).search(reporter)
    return Search(result.order, result.quantized, result.sensitivity, result.evaluations)


def _build(
    model: onnx.ModelProto,
    precision: Precision,
    regions: str,
    scales: dict[str, float],
    layers: list[Layer],
    search: Search,
    evaluation: Feeds,
    reference: list[np.ndarray],
    budget: Budget | None,
    directory: Path,
    reporter: Reporter,
) -> tuple[VariantRecord, PassReport, dict[str, object]]:
    """Write and verify one variant; under a budget, give back the costliest layers until it holds."""
    name = variant_name(precision, regions)
    pinned = [layer.name for layer in layers if layer.pinned == precision]
    chosen = search.chosen
    path = directory / "variants" / f"{name}.onnx"
    reporter.stage(f"{name}: building and verifying the variant")

    verifications = 0

    def write_and_measure(nodes: list[str], embeddings: bool) -> tuple[PassReport, list[np.ndarray], float | None]:
        nonlocal verifications
        verifications += 1
        report = _write_variant(model, precision, scales, [*pinned, *nodes], regions, path, embeddings)
        outputs = run_onnx(path, evaluation)
        return report, outputs, budget.measure(reference, outputs) if budget is not None else None

    # Under a budget the plan may store vocabulary tables in int8 too, if the verified variant still meets it;
    # without one, the policy keeps embeddings in higher precision.
    embeddings = budget is not None
    report, outputs, achieved = write_and_measure(chosen, embeddings)
    if budget is not None and achieved is not None and not budget.met(achieved):
        embeddings = False
        report, outputs, achieved = write_and_measure(chosen, embeddings)
    retries = 0
    while budget is not None and achieved is not None and not budget.met(achieved) and chosen:
        if retries == MAX_VERIFY_RETRIES:
            break
        # The switched graph's estimate was optimistic: give back the costliest layers and verify again.
        retries += 1
        chosen = search.order[: len(chosen) - max(1, len(chosen) // 8)]
        report, outputs, achieved = write_and_measure(chosen, embeddings)
    measured = accuracy(reference, outputs)

    quantized = set(pinned) | set(chosen)
    fraction = _flops_fraction(layers, quantized)
    higher = "fp16" if regions == "fp16" else "fp32"
    summary: dict[str, object] = {
        "precision": precision,
        "float_regions": regions,
        "met": bool(budget is None or (achieved is not None and budget.met(achieved))),
        "achieved": achieved,
        "quantized_flops_fraction": round(fraction, 4),
        "evaluations": search.evaluations + verifications,
        "embeddings": "int8, weight-only, a scale per row (within the budget)"
        if embeddings
        else "higher precision (policy)"
        if budget is None
        else "higher precision (int8 tables missed the budget)",
        "verify_retries": retries,
        "layers": [
            {
                "name": layer.name,
                "module": layer.module,
                "op": layer.op,
                "inputs": list(layer.inputs),
                "flops": layer.flops,
                "precision": precision if layer.name in quantized else (layer.pinned or higher),
                "sensitivity": search.sensitivity.get(layer.name),
                "reason": layer.reason
                or ("search" if budget is not None else f"--precision {precision}: every layer the policy allows"),
            }
            for layer in layers
        ],
    }
    logger.info("%s variant: %s, %.0f%% of FLOPs quantized", name, measured, 100 * fraction)
    record = VariantRecord(
        name=name,
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        precisions=[precision, higher],
        accuracy={**measured, "quantized_flops_fraction": fraction},
    )
    return record, report, summary


@dataclass
class CpuChoice:
    record: VariantRecord
    reason: str
    latency_ms: dict[str, float]  # per variant, ONNX Runtime defaults
    session_latency_ms: dict[str, float]  # the chosen variant, per session setting (cpu_recipe.tune_session)


def _cpu_choice(
    source: tuple[onnx.ModelProto, list[PassReport]],
    layers: list[Layer],
    order: list[str],
    static: VariantRecord,
    evaluation: Feeds,
    reference: list[np.ndarray],
    budget: Budget,
    directory: Path,
) -> CpuChoice:
    """Build the dynamic-quantization variant within the budget (weight MatMuls, in the search's order) from
    `source` (cpu_recipe.dynamic_source: the graph and what preparing it did); keep it for cpu if ONNX Runtime
    runs it faster than the static Q/DQ variant. Then choose ONNX Runtime's session settings for the winner."""
    model, _ = source
    weights = {initializer.name for initializer in model.graph.initializer}
    # The outlier branches' MatMuls are new nodes, not in `order`: they stay in fp32.
    weight_matmuls = {n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights}
    with tempfile.TemporaryDirectory(prefix="tensorsmith-cpu-", dir=directory) as scratch:
        path = Path(scratch) / "source.onnx"
        save_onnx(model, path)
        dynamic = cpu_recipe.build_dynamic_variant(
            path, [name for name in order if name in weight_matmuls], evaluation, reference, budget, directory
        )
    batch = {name: array[:8] for name, array in evaluation.items()}
    chosen, reason, latency = static, "no layer fits the budget with dynamic quantization", {}
    if dynamic is not None:
        dynamic.record.accuracy["quantized_flops_fraction"] = _flops_fraction(layers, set(dynamic.quantized))
        sessions = {record.name: cpu_recipe.cpu_session(directory / record.path) for record in (static, dynamic.record)}
        latency = cpu_recipe.latency_ms(sessions, batch)
        del sessions
        reason = "fastest within budget"
        if latency[dynamic.record.name] < latency[static.name]:
            chosen = dynamic.record
        else:
            (directory / dynamic.record.path).unlink()
    chosen.onnxruntime_disabled_optimizers, by_session = cpu_recipe.tune_session(directory / chosen.path, batch)
    return CpuChoice(chosen, reason, latency, by_session)


def _cpu_summary(choice: CpuChoice, prepared: list[PassReport]) -> dict[str, object]:
    """precision.json's account of the cpu choice, with what preparing the dynamic variant's graph did."""
    return {
        "variant": choice.record.name,
        "reason": choice.reason,
        "latency_ms_batch8": choice.latency_ms,
        "dynamic_preparation": {report.name: {**report.counts, **report.details} for report in prepared},
        "onnxruntime_session": {
            "disabled_optimizers": choice.record.onnxruntime_disabled_optimizers,
            "latency_ms_batch8": choice.session_latency_ms,
        },
    }


def build_fp16_variant(
    model: onnx.ModelProto, config: CompileConfig, reference_path: Path, directory: Path
) -> VariantRecord:
    """variants/fp16.onnx: the fused graph in fp16 with LayerNorm in fp32, measured against fp32 on the
    verification inputs."""
    from tensorsmith.compiler.feeds import example_feeds
    from tensorsmith.passes.fp16 import ConvertToFp16

    path = directory / "variants" / "fp16.onnx"
    rewrite(model, [ConvertToFp16()], path)
    feeds = example_feeds(config, seed=1, size_offset=1)
    measured = accuracy(run_onnx(reference_path, feeds), run_onnx(path, feeds))
    return VariantRecord(
        name="fp16",
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        precisions=["fp16", "fp32"],
        accuracy=measured,
        evaluated_on="the verification inputs",
    )


def table_scales(table: CalibrationTable, precision: Precision) -> dict[str, float]:
    return table.int8_scales() if precision == "int8" else table.fp8_scales()
