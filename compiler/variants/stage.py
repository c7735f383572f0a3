"""The variants stage: fused graph + variant plan → one verified variant file per recipe, and precision.json.

A recipe is a precision and the targets that run it (compiler/targets.py decides). Float requests give the fp32
reference and, where a target computes in fp16, variants/fp16.onnx. Quantized ones calibrate the fused graph
once; under a budget, one search per precision chooses the layers; each recipe then yields one variant per kind
of float region: GPUs compute the unquantized layers in fp16 (variant `int8`, `fp8`), the cpu in fp32
(`cpu-int8`, and `cpu-int8-dynamic` when ONNX Runtime's dynamic quantization runs faster within the budget).
Targets that share a variant share its file and engine input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tensorsmith.calibration import CalibrationData, Observer, tensors_to_observe
from tensorsmith.calibration.data import Feeds
from tensorsmith.calibration.layers import WEIGHT_ONLY, activation_shapes, list_layers
from tensorsmith.calibration.statistics import merged_statistics
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.feeds import example_feeds
from tensorsmith.compiler.frontend.fused import FusedGraph
from tensorsmith.compiler.variants.calibrated import calibrate_variants, collect_statistics
from tensorsmith.compiler.variants.cpu_choice import choose_accuracy_level, choose_cpu_variant, tuned
from tensorsmith.compiler.variants.cpu_dynamic import dynamic_source
from tensorsmith.compiler.variants.data import READ_BATCH, SplitData, concatenated, split_data
from tensorsmith.compiler.variants.fp16 import build_fp16_variant
from tensorsmith.compiler.variants.int4 import build_int4_variant, int4_recipe_plan, plan_int4
from tensorsmith.compiler.variants.language import text_evaluation, with_language_metrics
from tensorsmith.compiler.variants.plan import VariantPlan
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.compiler.variants.quantized import Evaluation, build_quantized, search_layers, with_text_metrics
from tensorsmith.compiler.variants.rewrite import rewritten
from tensorsmith.compiler.variants.text_data import is_decoder_graph, text_split
from tensorsmith.compiler.variants.weight_mix import (
    build_mixed_variant,
    plan_weight_levels,
    recipe_levels,
    search_weights,
)
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.progress import Reporter
from tensorsmith.core.sessions import run_onnx
from tensorsmith.passes import PassReport
from tensorsmith.passes.int4 import GemmAsMatMul
from tensorsmith.runtime.manifest import VariantRecord


@dataclass(frozen=True)
class Variants:
    records: list[VariantRecord]  # the fp32 reference first
    by_target: dict[str, VariantRecord]
    reports: list[PassReport] = field(default_factory=list)  # smoothing and Q/DQ passes, for the manifest
    unmet: list[str] = field(default_factory=list)  # recipes whose budget does not hold, with the figure


def reference_variant(fused: FusedGraph) -> VariantRecord:
    """The fused fp32 graph itself, as the variant every float target may run."""
    return VariantRecord(
        name="fp32",
        precisions=["fp32"],
        accuracy=fused.accuracy,
        evaluated_on="against the source" if fused.accuracy else "",
        **fused.record.model_dump(),
    )


def build_variants(
    plan: VariantPlan, fused: FusedGraph, config: CompileConfig, directory: Path, reporter: Reporter
) -> Variants:
    """Write every variant the plan needs into `directory` (variants/, calibration files, precision.json)."""
    if plan.quantized():
        variants, precision_plan, tuned_names = _quantized_variants(plan, fused, config, directory, reporter)
    elif plan.int4():  # --precision int4, or a decoder's auto
        (variants, precision_plan), tuned_names = _int4_variants(plan, fused, config, directory, reporter), set()
    else:
        variants, tuned_names = _float_variants(plan, fused, config, directory, reporter), set()
        precision_plan = PrecisionPlan(precision=plan.request)
    precision_plan.write(directory)
    cpu = variants.by_target.get("cpu")
    if cpu is None or cpu.name in tuned_names:
        return variants
    reporter.stage("cpu: timing ONNX Runtime's session settings")
    return _replaced(variants, tuned(cpu, directory, example_feeds(config)))


def _replaced(variants: Variants, record: VariantRecord) -> Variants:
    """`variants` with the record of the same name replaced by `record`."""
    return Variants(
        [record if r.name == record.name else r for r in variants.records],
        {t: record if r.name == record.name else r for t, r in variants.by_target.items()},
        variants.reports,
        variants.unmet,
    )


def _float_variants(
    plan: VariantPlan, fused: FusedGraph, config: CompileConfig, directory: Path, reporter: Reporter
) -> Variants:
    reference = reference_variant(fused)
    text = text_evaluation(config, fused.inputs)  # a decoder's held-out text, if it has one
    if text is not None:
        reference = with_language_metrics(reference, fused.path, directory, text)
    records, by_target = [reference], {}
    for recipe, targets in plan.recipes().items():
        record = reference
        if recipe.floats == "fp16":
            reporter.stage("building the fp16 variant")
            feeds = example_feeds(config, seed=1, size_offset=1)  # the verification inputs
            record = build_fp16_variant(fused.model, fused.path, feeds, directory)
            if text is not None:
                record = with_language_metrics(record, fused.path, directory, text)
            records.append(record)
        by_target.update(dict.fromkeys(targets, record))
    return Variants(records, by_target)


def _int4_variants(
    plan: VariantPlan, fused: FusedGraph, config: CompileConfig, directory: Path, reporter: Reporter
) -> tuple[Variants, PrecisionPlan]:
    """The float variants of targets that cannot run INT4 (sm_75: fp16), then one INT4 plan (RTN, or AWQ on one
    pass over the calibration data) written once per kind of float region."""
    floats = _float_variants(plan.without_int4(), fused, config, directory, reporter)
    if config.calibration_stats is not None:
        raise ConfigError("--calibration-stats serves int8 and fp8 calibration; INT4 and a decoder's auto read the "
                          "calibration data itself (AWQ's statistics are not in the files)",
                          hint="pass --calibration PATH instead")  # fmt: skip
    split = _split(config, fused) if config.calibration is not None else None  # AWQ's, and W8A8's scales
    evaluation = _int4_evaluation(config, fused, split)
    model, _ = rewritten(fused.model, [GemmAsMatMul()])  # the same function; Gemm weights become INT4-able
    awq_data = split.calibration if split is not None and config.int4_algorithm == "awq" else None
    int4_plan = plan_int4(model, config.int4_algorithm, config.int4_block_size, awq_data, reporter)
    int4_targets = [target for targets in plan.int4().values() for target in targets]
    data = split.calibration if split is not None else None
    levels = plan_weight_levels(model, int4_plan, config, data, int4_targets, directory, reporter)
    budget = config.accuracy_budget()  # `auto`: each weight layer's precision against it
    search = None
    if budget is not None:
        tokens = split.tokens if split is not None else None
        evaluation = replace(evaluation, budget=budget.on_tokens(tokens) if tokens is not None else budget)
        search = search_weights(model, int4_plan, levels, evaluation, config.sensitivity_samples, reporter)
    records, by_target, reports, recipes, unmet = list(floats.records), dict(floats.by_target), [], {}, []
    for recipe, targets in plan.int4().items():
        reporter.stage(f"{recipe.variant}: writing and measuring the variant ({config.int4_algorithm})")
        if search is None:
            assignment = dict.fromkeys(int4_plan.weights, "int4") | {n: lv for n, (lv, _) in levels.pinned.items()}
            assignment = recipe_levels(recipe, assignment)
            record, passes, _ = build_int4_variant(model, recipe, int4_plan, evaluation, directory, assignment,
                                                   scales=levels.scales)  # fmt: skip
            pinned = {n: (assignment[n], reason) for n, (_, reason) in levels.pinned.items()}
            recipes[record.name] = int4_recipe_plan(recipe, int4_plan, targets, 1, pinned)
        else:
            mixed = build_mixed_variant(model, recipe, int4_plan, levels, search, evaluation, directory, targets)
            record, passes, recipes[record.name] = mixed.record, mixed.reports, mixed.plan
            if not mixed.plan.met:
                unmet.append(f"{record.name}: {evaluation.budget} not met ({mixed.plan.achieved:.6f})")
        if recipe.floats == "fp32":  # the cpu's: MatMulNBits' accuracy level by measurement
            record, recipes[record.name].cpu = choose_accuracy_level(record, directory, evaluation)
        records.append(record)
        by_target.update(dict.fromkeys(targets, record))
        reports += passes
    precision_plan = PrecisionPlan(precision=plan.request, evaluated_on=evaluation.described,
                                   budget=str(budget) if budget else None, recipes=recipes)  # fmt: skip
    return Variants(records, by_target, reports, unmet), precision_plan


def _int4_evaluation(config: CompileConfig, fused: FusedGraph, split: SplitData | None) -> Evaluation:
    """What an INT4 variant is measured on: AWQ's held-out split, else the evaluation text or arrays, else the
    verification inputs."""

    def measured_on(feeds: Feeds, described: str, tokens: np.ndarray | None = None, timing: Feeds | None = None
                    ) -> Evaluation:  # fmt: skip
        return Evaluation(feeds, run_onnx(fused.path, feeds), None, described, tokens, timing)

    if split is not None:
        return measured_on(split.evaluation, split.evaluated_on, split.tokens, split.timing)
    text = text_evaluation(config, fused.inputs)
    if text is not None:
        return measured_on(text.feeds, text.described, text.tokens)
    if config.evaluation is not None:
        path = config.resolve(config.evaluation)
        specs = [record.spec() for record in fused.inputs]
        return measured_on(concatenated(CalibrationData(path, specs, batch_size=READ_BATCH)), str(path))
    return measured_on(example_feeds(config, seed=1, size_offset=1), "the verification inputs")


def _split(config: CompileConfig, fused: FusedGraph) -> SplitData:
    """Calibration and evaluation data: arrays for any graph, text (windows, prefill and decode) for a decoder."""
    if not is_decoder_graph(fused.inputs):
        return split_data(config, fused.inputs)
    text = text_split(config, fused.inputs, fused.path)
    return SplitData(text.calibration, text.evaluation, text.evaluated_on, text.tokens, text.decode_step)


def _quantized_variants(
    plan: VariantPlan, fused: FusedGraph, config: CompileConfig, directory: Path, reporter: Reporter
) -> tuple[Variants, PrecisionPlan, set[str]]:
    """Calibrate once, search once per precision, then write and verify one variant per recipe."""
    for override in config.overrides:
        if override.precision in WEIGHT_ONLY:
            raise ConfigError(
                f"[[overrides]] match '{override.match}': {override.precision} pins the weight layers of a "
                f"decoder's auto or of --precision int4; this compile quantizes activations ({plan.request})",
                hint="pin it to fp32, int8 or fp8",
            )
    split = _split(config, fused)
    budget = config.accuracy_budget()
    if budget is not None and split.tokens is not None:
        budget = budget.on_tokens(split.tokens)
    by_precision = plan.quantized()
    if config.calibration_stats is not None:
        reporter.stage(f"calibration statistics: merging {config.calibration_stats}")
        statistics = merged_statistics(config.calibration_stats, fused.record.sha256, config.base_dir)
    else:
        assert split.calibration is not None
        statistics = collect_statistics(fused.model, split.calibration, reporter)
    calibrated = calibrate_variants(fused.model, config, statistics, set(by_precision), directory, reporter)
    model = calibrated.model
    one_sample = {name: array[:1] for name, array in split.evaluation.items()}
    shapes = activation_shapes(Observer(model, tensors_to_observe(model)).run(one_sample))
    layers = list_layers(model, shapes, config.overrides)
    reference_outputs = run_onnx(fused.path, split.evaluation)
    evaluation = Evaluation(split.evaluation, reference_outputs, budget, split.evaluated_on, split.tokens, split.timing)

    records, by_target = [with_text_metrics(reference_variant(fused), evaluation, reference_outputs)], {}
    reports = [calibrated.smoothing] if calibrated.smoothing is not None else []
    unmet, recipes, tuned_names = [], {}, set()
    for precision, shared in by_precision.items():
        scales = calibrated.scales(precision)
        search = search_layers(model, precision, scales, layers, evaluation, config.sensitivity_samples, reporter)
        for recipe, targets in shared.items():
            variant = build_quantized(model, recipe, scales, layers, search, evaluation, directory, reporter)
            record, recipe_plan = variant.record, variant.plan.model_copy(update={"targets": targets})
            reports.append(variant.report)
            by_target.update(dict.fromkeys(targets, record))
            if budget is not None and not recipe_plan.met:
                unmet.append(f"{record.name}: {budget.metric} {recipe_plan.achieved:.6f} (budget {budget})")
            if budget is not None and precision == "int8" and "cpu" in targets:
                reporter.stage("cpu: dynamic quantization within the budget, and the faster recipe")
                alpha = config.smoothing_alpha if config.smoothing else None
                source = dynamic_source(fused.model, calibrated.channel_amax, alpha)
                outcome = choose_cpu_variant(source, layers, search.order, record, evaluation, budget, directory)
                tuned_names.add(outcome.chosen.name)
                records += [outcome.static] if outcome.chosen is outcome.static else [outcome.static, outcome.chosen]
                by_target["cpu"] = outcome.chosen
                recipe_plan = recipe_plan.model_copy(update={"cpu": outcome.plan})
            else:
                records.append(record)
            recipes[record.name] = recipe_plan
    precision_plan = PrecisionPlan(
        precision=plan.request,
        evaluated_on=split.evaluated_on,
        budget=str(budget) if budget is not None else None,
        sensitivity_samples=config.sensitivity_samples if budget is not None else None,
        recipes=recipes,
    )
    return Variants(records, by_target, reports, unmet), precision_plan, tuned_names
