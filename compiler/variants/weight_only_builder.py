"""The weight-only family's builder (int4, nvfp4, and a decoder's auto, which mixes int4 / one-byte / float per
weight layer): one INT4 plan (RTN, or AWQ on one pass over the calibration data), then one variant per recipe,
each measured against the fp32 graph; the cpu's INT4 variant gets MatMulNBits' accuracy level by measurement.
Targets that cannot run the request (sm_75) got float recipes: the float builder writes theirs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.calibration import CalibrationData
from tensorsmith.calibration.data import Feeds
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.fused import FusedGraph
from tensorsmith.compiler.frontend.quantized_checkpoint import source_checkpoint
from tensorsmith.compiler.variants.builders import BuildJob, FamilyVariants, calibration_split
from tensorsmith.compiler.variants.cpu_choice import choose_accuracy_level
from tensorsmith.compiler.variants.data import READ_BATCH, SplitData, concatenated
from tensorsmith.compiler.variants.int4 import build_int4_variant, int4_recipe_plan, plan_int4
from tensorsmith.compiler.variants.language import text_evaluation
from tensorsmith.compiler.variants.measure import Evaluation
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan, RecipePlan
from tensorsmith.compiler.variants.rewrite import rewrite_file
from tensorsmith.compiler.variants.stored_codes import stored_checkpoint, stored_experts
from tensorsmith.compiler.variants.stored_int4 import plan_float, plan_stored, plan_stored_nvfp4
from tensorsmith.compiler.variants.text_data import decode_timing_step
from tensorsmith.compiler.variants.weight_matmuls import Pin
from tensorsmith.compiler.variants.weight_mix import (
    build_mixed_variant,
    plan_weight_levels,
    recipe_levels,
    search_weights,
)
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import load_onnx, remove_onnx
from tensorsmith.core.layerwise import layerwise_segments
from tensorsmith.core.precisions import Calibration, storing, weight_only_request
from tensorsmith.core.sessions import run_onnx
from tensorsmith.core.spilled import spilled
from tensorsmith.passes import PassReport
from tensorsmith.passes.int4 import GemmAsMatMul
from tensorsmith.passes.weight_formats.base import StoredCodes
from tensorsmith.passes.weight_formats.stacked import StackedDetails


def build_weight_only_variants(job: BuildJob) -> FamilyVariants:
    plan, fused, config, directory, reporter = job.plan, job.fused, job.config, job.directory, job.reporter
    if config.calibration_stats is not None:
        raise ConfigError(
            "--calibration-stats serves int8 and fp8 calibration; weight-only precisions and a "
            "decoder's auto read the calibration data itself (AWQ's statistics are not in the files)",
            hint="pass --calibration PATH instead",
        )
    # named: at 8B it takes minutes, and the verification's stage took the blame
    reporter.stage("the fp32 graph's outputs on the evaluation data, what every variant is measured against")
    split = calibration_split(config, fused) if config.calibration is not None else None  # AWQ's, W8A8's scales
    evaluation = weight_only_evaluation(config, fused, split)
    model = without_gemm(fused, directory)  # the same function; Gemm weights become INT4-able
    # the requested format's record says whether AWQ applies and which block it takes (auto: int4's)
    requested = weight_only_request(plan.request)
    assert requested is not None, "the weight-only family's request"
    takes_awq = requested.calibration is Calibration.OPTIONAL_AWQ
    algorithm = config.int4_algorithm if takes_awq else "rtn"
    block = config.int4_block_size if requested.block_from_config else requested.block or config.int4_block_size
    awq_data = split.calibration if split is not None and algorithm == "awq" else None
    stored = source_checkpoint(config) if algorithm == "checkpoint" else None
    # a checkpoint's own codes where the request is the level that stores them (NVFP4's Linears, MXFP4's experts)
    takes_own = not takes_awq and storing(requested.element) is requested  # INT4's: --int4-algorithm checkpoint
    own = stored_checkpoint(config, requested.element) if takes_own else None
    experts_own = stored_experts(config, requested)
    stored_own: StoredCodes = {}
    if stored is not None:
        int4_plan = plan_stored(model, stored)
    elif experts_own:  # the checkpoint quantizes its experts only: every other layer stays as it stores it
        int4_plan = plan_float(model, block, "not quantized in the checkpoint (its mxfp4 experts are)")
    elif own is not None:
        int4_plan, stored_own = plan_stored_nvfp4(model, own)
    else:
        int4_plan = plan_int4(
            model, algorithm, block, awq_data, reporter, job.records, smaller_blocks=requested.block_from_config
        )
    data = split.calibration if split is not None else None
    levels = plan_weight_levels(model, int4_plan, config, data, list(plan.by_target), directory, reporter)
    budget = config.accuracy_budget()  # `auto`: each weight layer's precision against it
    search = None
    if budget is not None:
        tokens = split.tokens if split is not None else None
        evaluation = replace(evaluation, budget=budget.on_tokens(tokens) if tokens is not None else budget)
        search = search_weights(load_onnx(model), int4_plan, levels, evaluation, config.sensitivity_samples, reporter)
    records, by_target, reports, recipes, unmet = [], {}, [], {}, {}
    for recipe, targets in plan.recipes().items():
        reporter.stage(f"{recipe.variant}: writing and measuring the variant ({algorithm})")
        if search is None:
            assert recipe.quantized is not None
            chosen = dict.fromkeys(int4_plan.weights, recipe.quantized.name)
            assignment = recipe_levels(recipe, chosen | {name: pin.level for name, pin in levels.pinned.items()})
            record, passes = build_int4_variant(
                model,
                recipe,
                int4_plan,
                evaluation,
                directory,
                assignment,
                tables=stored is None and own is None and not experts_own,
                scales=levels.scales,
                stored_weights=stored_own,
                # a GPU's stacked experts in the request too (ONNX Runtime would dequantize every expert at every
                # step); a checkpoint's own codes stay as the checkpoint has them
                experts=not recipe.on_cpu and (int4_plan.algorithm != "checkpoint" or bool(experts_own)),
                stored_experts=experts_own,
            )
            pinned = {name: Pin(assignment[name], pin.reason) for name, pin in levels.pinned.items()}
            recipes[record.name] = int4_recipe_plan(recipe, int4_plan, targets, 1, pinned)
        else:
            mixed = build_mixed_variant(model, recipe, int4_plan, levels, search, evaluation, directory, targets)
            record, passes, recipes[record.name] = mixed.record, mixed.reports, mixed.plan
        if recipe.on_cpu:  # ONNX Runtime's: MatMulNBits' accuracy level by measurement
            record, recipes[record.name].cpu = choose_accuracy_level(record, directory, evaluation)
        if evaluation.budget is not None:  # the figure of the kernels that ship: one number in every place
            achieved = record.accuracy[evaluation.budget.metric]
            met = evaluation.budget.met(achieved)
            recipes[record.name] = recipes[record.name].model_copy(update={"achieved": achieved, "met": met})
            if not met:
                unmet[record.name] = f"{evaluation.budget} not met ({achieved:.6g})"
        records.append(record)
        by_target.update(dict.fromkeys(targets, record))
        reports += [replace(report, variant=record.name) for report in passes]
    if model != fused.path:
        remove_onnx(model)
    recipes = with_stacked_notes(recipes, reports)
    precision_plan = PrecisionPlan(
        precision=plan.request,
        evaluated_on=evaluation.described,
        budget=str(budget) if budget else None,
        recipes=recipes,
    )
    return FamilyVariants(records, by_target, None, reports, unmet, precision_plan)


def with_stacked_notes(recipes: dict[str, RecipePlan], reports: list[PassReport]) -> dict[str, RecipePlan]:
    """precision.json's words for each variant's stacked experts' weights (passes/weight_formats/stacked.py),
    from the stacked pass's reports: their format, or, for the cpu's where a GPU's are quantized, why float."""
    notes = {}
    for report in reports:
        details = report.details
        if isinstance(details, StackedDetails) and report.changed and report.variant is not None:
            blocks = ", ".join(map(str, details.block_sizes))
            how = "the checkpoint's own codes and scales" if details.stored else "rounded to nearest"
            notes[report.variant] = (
                f"{len(details.weights)} stacked weights in {details.precision}, blocks of {blocks} rows of K, {how}"
            )
    if not notes:
        return recipes
    floats = "float: ONNX Runtime would dequantize every expert at every step (the GPU variants store them quantized)"
    return {
        name: plan.model_copy(update={"stacked_experts": notes.get(name, floats if plan.cpu is not None else "")})
        for name, plan in recipes.items()
    }


def without_gemm(fused: FusedGraph, directory: Path) -> Path:
    """The fused graph with its Gemms as MatMuls, written beside it where it has any (removed after the variants:
    remove_onnx), else the fused graph's own file."""
    structure = onnx.load(str(fused.path), load_external_data=False)
    if not any(node.op_type == "Gemm" for node in structure.graph.node):
        return fused.path
    path = directory / ".weight-only-source.onnx"
    rewrite_file(fused.path, [GemmAsMatMul()], path)
    return path


def weight_only_evaluation(config: CompileConfig, fused: FusedGraph, split: SplitData | None) -> Evaluation:
    """What a weight-only variant is measured on: AWQ's held-out split, else the evaluation text or arrays, else
    the verification inputs."""

    def measured_on(feeds: Feeds, described: str, tokens: np.ndarray | None = None) -> Evaluation:
        reference = run_onnx(fused.path, feeds, in_rows=True)
        if layerwise_segments(fused.path) is not None:  # a model the machine's size: not held through AWQ
            reference = spilled(reference, fused.path.parent)
        timing = decode_timing_step(tokens, fused.inputs, fused.outputs, reference) if tokens is not None else None
        return Evaluation(feeds, reference, None, described, tokens, timing)

    if split is not None:
        return measured_on(split.evaluation, split.evaluated_on, split.tokens)
    text = text_evaluation(config, fused.inputs, fused.path)
    if text is not None:
        return measured_on(text.feeds, text.described, text.tokens)
    if config.evaluation is not None:
        path = config.resolve(config.evaluation)
        specs = [record.spec() for record in fused.inputs]
        return measured_on(concatenated(CalibrationData(path, specs, batch_size=READ_BATCH)), str(path))
    verified = fused.verification_inputs(config)
    feeds, outputs = verified.feeds, verified.outputs
    return Evaluation(feeds, outputs, None, "the verification inputs", None, None)
