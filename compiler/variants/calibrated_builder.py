"""The calibrated family's builder (int8, fp8: weights and activations): calibrate the fused graph once (or
merge `tensorsmith calibrate`'s statistics), search once per precision under a budget, then write and verify one
variant per recipe; the cpu's int8 recipe also tries ONNX Runtime's dynamic quantization and keeps the faster."""

from __future__ import annotations

from dataclasses import replace

from tensorsmith.calibration import Observer, tensors_to_observe
from tensorsmith.calibration.layers import activation_shapes, list_layers
from tensorsmith.calibration.statistics import merged_statistics
from tensorsmith.compiler.variants.builders import BuildJob, FamilyVariants, calibration_split
from tensorsmith.compiler.variants.calibrated import calibrate_variants, collect_statistics
from tensorsmith.compiler.variants.cpu_choice import choose_cpu_variant
from tensorsmith.compiler.variants.cpu_dynamic import dynamic_source
from tensorsmith.compiler.variants.float_builder import reference_variant
from tensorsmith.compiler.variants.measure import Evaluation, with_text_metrics
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.compiler.variants.quantized import build_quantized, search_layers
from tensorsmith.compiler.variants.text_data import decode_timing_step
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.precisions import Family, precision
from tensorsmith.core.sessions import run_onnx
from tensorsmith.runtime.specs import Signature


def build_calibrated_variants(job: BuildJob) -> FamilyVariants:
    plan, fused, config, directory, reporter = job.plan, job.fused, job.config, job.directory, job.reporter
    for override in config.overrides:
        if precision(override.precision).family is Family.WEIGHT_ONLY:
            raise ConfigError(
                f"[[overrides]] match '{override.match}': {override.precision} pins the weight layers of a "
                f"decoder's auto or of a weight-only --precision; this compile quantizes activations ({plan.request})",
                hint="pin it to a precision that quantizes activations, or fp32",
            )
    split = calibration_split(config, fused)
    budget = config.accuracy_budget()
    if budget is not None and split.tokens is not None:
        budget = budget.on_tokens(split.tokens)
    by_precision = plan.by_precision()
    fused_model = fused.model  # read from its file once, for the statistics, the calibration and the cpu choice
    if config.calibration_stats is not None:
        reporter.stage(f"calibration statistics: merging {config.calibration_stats}")
        statistics = merged_statistics(config.calibration_stats, fused.record.sha256, config.base_dir)
    else:
        assert split.calibration is not None
        statistics = collect_statistics(fused_model, split.calibration, reporter)
    names = {record.name for record in by_precision}
    calibrated = calibrate_variants(fused_model, config, statistics, names, directory, reporter)
    model = calibrated.model
    one_sample = {name: array[:1] for name, array in split.evaluation.items()}
    shapes = activation_shapes(Observer(model, tensors_to_observe(model)).run(one_sample))
    layers = list_layers(model, shapes, config.overrides)
    reference_outputs = run_onnx(fused.path, split.evaluation, in_rows=True)
    timing = (
        None
        if split.tokens is None
        else decode_timing_step(split.tokens, fused.inputs, fused.outputs, reference_outputs)
    )
    evaluation = Evaluation(split.evaluation, reference_outputs, budget, split.evaluated_on, split.tokens, timing)

    reference = with_text_metrics(reference_variant(fused), evaluation, reference_outputs)
    records, by_target = [], {}
    reports = [calibrated.smoothing] if calibrated.smoothing is not None else []
    unmet, recipes, tuned = {}, {}, set()
    for record_of, shared in by_precision.items():
        scales = calibrated.scales(record_of.name)
        search = search_layers(model, record_of.name, scales, layers, evaluation, config.sensitivity_samples, reporter)
        for recipe, targets in shared.items():
            variant = build_quantized(model, recipe, scales, layers, search, evaluation, directory, reporter)
            record, recipe_plan = variant.record, variant.plan.model_copy(update={"targets": targets})
            reports.append(replace(variant.report, variant=record.name))
            by_target.update(dict.fromkeys(targets, record))
            if budget is not None and record_of.element.is_integer and recipe.on_cpu:
                reporter.stage("cpu: dynamic quantization within the budget, and the faster recipe")
                alpha = config.smoothing_alpha if config.smoothing else None
                source = dynamic_source(fused_model, calibrated.channel_amax, alpha)
                specs = Signature([r.spec() for r in fused.inputs], [r.spec() for r in fused.outputs])
                outcome = choose_cpu_variant(
                    source, layers, search.order, record, evaluation, budget, directory, specs, recipe_plan.met
                )
                tuned.add(outcome.chosen.name)
                records += [outcome.static] if outcome.chosen is outcome.static else [outcome.static, outcome.chosen]
                by_target.update(dict.fromkeys(targets, outcome.chosen))
                recipe_plan = recipe_plan.model_copy(update={"cpu": outcome.plan})
            else:
                records.append(record)
            recipes[record.name] = recipe_plan
            # unmet where its targets run it (a cpu on the dynamic variant runs one within the budget)
            if budget is not None and not recipe_plan.met and by_target[targets[0]].name == record.name:
                unmet[record.name] = f"{budget.metric} {recipe_plan.achieved:.6f} (budget {budget})"
    precision_plan = PrecisionPlan(
        precision=plan.request,
        evaluated_on=split.evaluated_on,
        budget=str(budget) if budget is not None else None,
        sensitivity_samples=config.sensitivity_samples if budget is not None else None,
        recipes=recipes,
    )
    return FamilyVariants(records, by_target, reference, reports, unmet, precision_plan, tuned)
