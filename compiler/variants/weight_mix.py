"""A decoder's `--precision auto`: each weight layer in int4, int8 (weight-only) or float, searched against the
budget on the switched graph (calibration/weight_search.py), then verified for real per variant, with and
without quantized vocabulary tables (which the search does not cover): the smallest verified file within the
budget is kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.calibration.weight_search import LayerOptions, WeightSearch, WeightSearchResult, assignment_of
from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.int4 import Int4Plan, build_int4_variant, tables_policy, weight_matmuls
from tensorsmith.compiler.variants.precision_plan import LayerChoice, RecipePlan
from tensorsmith.compiler.variants.quantized import MAX_VERIFY_RETRIES, Evaluation
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.passes.int4 import dequantize_int4, int8_weight, quantize_int4
from tensorsmith.runtime.manifest import VariantRecord

logger = logging.getLogger(__name__)


def layer_options(model: onnx.ModelProto, plan: Int4Plan) -> dict[str, LayerOptions]:
    """Each INT4-able weight MatMul as int4 (the plan's AWQ scales folded back in) and int8 compute it, and the
    bytes each stores (fp16 and int8 with fp16 scales; int4 with its block scales)."""
    options = {}
    for name, (_, weight) in weight_matmuls(model, plan.block).chosen.items():
        if name not in plan.weights:
            continue
        choice = plan.weights[name]
        scale = choice.input_scale if choice.input_scale is not None else np.ones(weight.shape[0], np.float32)
        q, step = quantize_int4(weight * scale[:, None], plan.block, choice.clip)
        int4 = dequantize_int4(q, step, plan.block) / scale[:, None]
        codes, scales = int8_weight(weight)
        rows, columns = weight.shape
        stored = {"fp16": 2 * rows * columns, "int8": rows * columns + 2 * columns,
                  "int4": rows * columns // 2 + 2 * (rows // plan.block) * columns}  # fmt: skip
        options[name] = LayerOptions(int4.astype(np.float32), (codes * scales).astype(np.float32), stored)
    return options


def search_weights(
    model: onnx.ModelProto, plan: Int4Plan, evaluation: Evaluation, samples: int, reporter: Reporter
) -> WeightSearchResult:
    assert evaluation.budget is not None
    reporter.stage(f"weight precision per layer (int4, int8, fp16) against {evaluation.budget}")
    feeds = {name: array[:samples] for name, array in evaluation.feeds.items()}
    return WeightSearch(model, layer_options(model, plan), feeds, evaluation.budget).search(reporter)


@dataclass(frozen=True)
class MixedVariant:
    record: VariantRecord
    reports: list[PassReport]
    plan: RecipePlan


def build_mixed_variant(
    model: onnx.ModelProto,
    recipe: Recipe,
    plan: Int4Plan,
    search: WeightSearchResult,
    evaluation: Evaluation,
    directory: Path,
    targets: list[str],
) -> MixedVariant:
    """The smallest verified variant within the budget among: the search's assignment with quantized vocabulary
    tables (never part of the search), the same without them, and with them but the costliest moves given back
    (an eighth at a time, up to MAX_VERIFY_RETRIES times); the most accurate of them if none holds."""
    budget = evaluation.budget
    assert budget is not None
    layers = list(search.assignment)
    tried: list[tuple[int, bool, float, int, bool]] = []  # (bytes, met, achieved, moves, tables)

    def attempt(chosen: int, tables: bool) -> tuple[VariantRecord, list[PassReport]]:
        assignment = assignment_of(search.moves[:chosen], layers)
        record, reports, outputs = build_int4_variant(model, recipe, plan, evaluation, directory, assignment, tables)
        achieved = budget.measure(evaluation.reference, outputs)
        tried.append(((directory / record.path).stat().st_size, budget.met(achieved), achieved, chosen, tables))
        return record, reports

    record, reports = attempt(search.chosen, True)
    if not tried[-1][1]:
        record, reports = attempt(search.chosen, False)
        chosen = search.chosen
        for _ in range(MAX_VERIFY_RETRIES):
            chosen -= max(1, chosen // 8)
            record, reports = attempt(chosen, True)
            if tried[-1][1] or chosen == 0:
                break
    held = [entry for entry in tried if entry[1]]
    best = min(held) if held else max(tried, key=lambda entry: entry[2] if budget.higher_is_better else -entry[2])
    if best is not tried[-1]:
        record, reports = attempt(best[3], best[4])  # write the chosen one again (the file holds the last tried)
    _, met, achieved, chosen, tables = tried[-1]
    assignment = assignment_of(search.moves[:chosen], layers)
    logger.info("%s: %s %.6f with %d of %d moves", record.name, budget.metric, achieved, chosen, len(search.moves))
    recipe_plan = RecipePlan(
        precision="int4",
        float_regions=recipe.floats,
        met=met,
        achieved=achieved,
        quantized_flops_fraction=round(_bytes_fraction(plan, assignment), 4),
        evaluations=search.evaluations + len(tried),
        embeddings=tables_policy(recipe, tables),
        verify_retries=len(tried) - 1,
        layers=_choices(plan, assignment, search, recipe),
        targets=targets,
    )
    return MixedVariant(record, reports, recipe_plan)


def _bytes_fraction(plan: Int4Plan, assignment: dict[str, str]) -> float:
    """The share of weight elements below float precision (the plan's `quantized_flops_fraction`)."""
    total = max(sum(elements for _, _, elements in plan.layers.values()), 1)
    return sum(plan.layers[name][2] for name, level in assignment.items() if level != "fp16") / total


def _choices(
    plan: Int4Plan, assignment: dict[str, str], search: WeightSearchResult, recipe: Recipe
) -> list[LayerChoice]:
    order = {move: index for index, move in enumerate(search.moves)}
    choices = []
    for name, (module, activation, elements) in plan.layers.items():
        level = assignment.get(name, "fp16")
        sensitivity = search.sensitivity.get(name, {})
        if name not in assignment:
            reason = plan.skipped.get(name, "not an INT4-able weight")
        elif level == "fp16":
            reason = "search: int8 costs more per byte than the budget leaves"
        else:
            reason = f"search: move {order[(name, level)] + 1} of {len(search.moves)} by metric lost per byte saved"
        choices.append(LayerChoice(name=name, module=module, op="MatMul", inputs=[activation], flops=elements,
                                   precision=recipe.floats if level == "fp16" else level,
                                   sensitivity=sensitivity.get("int4"), reason=reason))  # fmt: skip
    return choices
