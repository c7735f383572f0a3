"""The fp8 weight-only family's builder (`fp8-weight`): every weight MatMul reads float8 e4m3 codes through one
blockwise DequantizeLinear (passes/fp8_weights.py). An FP8 checkpoint's codes and scales are taken as they are
stored (its default on Ada and newer targets: compiler/frontend/quantized_checkpoint.py); any other checkpoint is
rounded to nearest, amax / 448 per block of K and output column. One variant per recipe, measured against the
fp32 graph on the data a weight-only variant is measured on. Targets that cannot run it got float recipes: the
float builder writes theirs."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import cast

from tensorsmith.compiler.frontend.quantized_checkpoint import QuantizedCheckpoint
from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.builders import BuildJob, FamilyVariants
from tensorsmith.compiler.variants.measure import measure_variant
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan, RecipePlan
from tensorsmith.compiler.variants.records import variant_record
from tensorsmith.compiler.variants.rewrite import rewrite_file, variant_path
from tensorsmith.compiler.variants.stored_codes import stored_checkpoint, stored_weights
from tensorsmith.compiler.variants.weight_matmuls import WeightMatMuls, weight_matmuls
from tensorsmith.compiler.variants.weight_only_builder import weight_only_evaluation, without_gemm
from tensorsmith.core.budget_search import quantized_fraction
from tensorsmith.core.ir import remove_onnx
from tensorsmith.core.precisions import precision
from tensorsmith.core.scaled_fp8 import ScaledFp8, quantize_fp8
from tensorsmith.passes import GraphPass
from tensorsmith.passes.fp8_weights import Fp8Weights, WeightOnlyFp8
from tensorsmith.passes.fp16 import ConvertToFp16

SMALLEST_BLOCK = 16  # a stored checkpoint's grid divides its weights whatever their K


def build_fp8_weight_variants(job: BuildJob) -> FamilyVariants:
    plan, fused, config, directory, reporter = job.plan, job.fused, job.config, job.directory, job.reporter
    evaluation = weight_only_evaluation(config, fused, None)
    model = without_gemm(fused, directory)
    requested = precision(plan.request)  # the family's one record: its element and block
    checkpoint = stored_checkpoint(config, requested.element)
    block = SMALLEST_BLOCK if checkpoint else requested.block or SMALLEST_BLOCK
    found = weight_matmuls(model, block)
    weights, reasons = _plan(found, checkpoint, block)
    floats = {name: reason for name, reason in reasons.items() if name not in weights}
    records, by_target, reports, recipes = [], {}, [], {}
    for recipe, targets in plan.recipes().items():
        reporter.stage(f"{recipe.variant}: writing and measuring the variant")
        path = variant_path(directory, recipe.variant)
        passes: list[GraphPass] = [WeightOnlyFp8(weights, floats)]
        if recipe.fp16_regions:
            passes.append(ConvertToFp16())
        written = rewrite_file(model, passes, path)
        figures = measure_variant(path, evaluation)
        record = variant_record(
            directory, path, recipe.variant, [requested.name, recipe.floats.name], figures, evaluation.described
        )
        records.append(record)
        by_target.update(dict.fromkeys(targets, record))
        reports += [replace(report, variant=record.name) for report in written]
        recipes[record.name] = _recipe_plan(recipe, found, weights, reasons, targets)
    if model != fused.path:
        remove_onnx(model)
    precision_plan = PrecisionPlan(
        precision=plan.request, evaluated_on=evaluation.described, budget=None, recipes=recipes
    )
    return FamilyVariants(records, by_target, None, reports, {}, precision_plan)


def _plan(
    found: WeightMatMuls, checkpoint: QuantizedCheckpoint | None, block: int
) -> tuple[Fp8Weights, dict[str, str]]:
    """Each MatMul's fp8 weight (made from the graph's weight when the pass reaches it) and every weight MatMul's
    reason: the stored codes, rounding to nearest, or why it stays float."""
    if checkpoint is not None:  # its element is fp8 (stored_checkpoint): each made weight a ScaledFp8
        made, stored_reasons = stored_weights(found.layers, checkpoint)
        return cast(Fp8Weights, made), stored_reasons
    reasons = dict(found.skipped)
    weights: dict[str, partial[ScaledFp8]] = {}
    for name in found.chosen:
        own = found.blocks.get(name, block)
        weights[name] = partial(quantize_fp8, block=own)
        reasons[name] = f"rtn: round to nearest, amax / 448 per block of {own} rows"
    return weights, reasons


def _recipe_plan(
    recipe: Recipe, found: WeightMatMuls, weights: Fp8Weights, reasons: dict[str, str], targets: list[str]
) -> RecipePlan:
    """precision.json's entry: each weight MatMul's precision and why."""
    assert recipe.quantized is not None, "a quantized recipe"
    choices = [
        layer.choice(name, recipe.quantized.name if name in weights else recipe.floats.name, reasons[name])
        for name, layer in found.layers.items()
    ]
    flops = {choice.name: choice.flops for choice in choices}
    return RecipePlan(
        precision=recipe.quantized.name,
        float_regions=recipe.floats.name,
        met=True,
        quantized_flops_fraction=round(quantized_fraction(flops, set(weights)), 4),
        evaluations=1,
        embeddings="higher precision (the checkpoint's float tables)",
        layers=choices,
        targets=targets,
    )
