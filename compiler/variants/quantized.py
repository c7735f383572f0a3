"""One quantized variant: the layers a search chose (or every one the policy allows), Q/DQ inserted, verified
against fp32 on held-out data; under a budget, the costliest layers are given back until the variant holds."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from tensorsmith.calibration.layers import Layer
from tensorsmith.calibration.search import PrecisionSearch
from tensorsmith.compiler.targets import Recipe
from tensorsmith.compiler.variants.measure import Evaluation, measure_variant
from tensorsmith.compiler.variants.precision_plan import LayerChoice, RecipePlan
from tensorsmith.compiler.variants.records import variant_record
from tensorsmith.compiler.variants.rewrite import variant_path, write_quantized
from tensorsmith.core.budget_search import give_back_until_met, quantized_fraction
from tensorsmith.core.metrics import Budget
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.passes.quantize import Precision
from tensorsmith.runtime.manifest import VariantRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Search:
    """Which candidates to quantize, cheapest first (`order`), and how many of them (`chosen`)."""

    order: list[str]
    chosen: list[str]
    sensitivity: dict[str, float] = field(default_factory=dict)
    evaluations: int = 0


@dataclass(frozen=True)
class QuantizedVariant:
    record: VariantRecord
    report: PassReport  # the Q/DQ pass's, for the manifest
    plan: RecipePlan


def search_layers(
    model: onnx.ModelProto,
    precision: Precision,
    scales: dict[str, float],
    layers: list[Layer],
    evaluation: Evaluation,
    samples: int,
    reporter: Reporter,
) -> Search:
    """Without a budget, every candidate; with one, the cheapest-first order and the largest set that holds."""
    candidates = [layer.name for layer in layers if layer.pinned is None]
    budget = evaluation.budget
    if budget is None:
        return Search(candidates, candidates)
    reporter.stage(f"{precision}: sensitivity of {len(candidates)} layers against {budget}")
    sample = {name: array[:samples] for name, array in evaluation.feeds.items()}
    flops = {layer.name: layer.flops for layer in layers}
    result = PrecisionSearch(model, precision, scales, candidates, sample, budget, flops).search(reporter)
    return Search(result.order, result.quantized, result.sensitivity, result.evaluations)


def flops_fraction(layers: list[Layer], quantized: set[str]) -> float:
    """The share of the layers' FLOPs that `quantized` covers."""
    return quantized_fraction({layer.name: layer.flops for layer in layers}, quantized)


def build_quantized(
    model: onnx.ModelProto,
    recipe: Recipe,
    scales: dict[str, float],
    layers: list[Layer],
    search: Search,
    evaluation: Evaluation,
    directory: Path,
    reporter: Reporter,
) -> QuantizedVariant:
    """Write and verify the variant of `recipe`; under a budget, give back the costliest layers until it holds."""
    assert recipe.quantized is not None
    precision, name, budget = recipe.quantized.name, recipe.variant, evaluation.budget
    pinned = [layer.name for layer in layers if layer.pinned == precision]
    path = variant_path(directory, name)
    reporter.stage(f"{name}: building and verifying the variant")
    verifications = 0

    def write_and_measure(nodes: list[str], embeddings: bool) -> tuple[PassReport, dict[str, float], float | None]:
        nonlocal verifications
        verifications += 1
        report = write_quantized(model, precision, scales, [*pinned, *nodes], recipe, path, embeddings)
        figures = measure_variant(path, evaluation)
        return report, figures, figures[budget.metric] if budget is not None else None

    # Under a budget the plan may store vocabulary tables in int8 too, if the verified variant still meets it;
    # without one, the policy keeps embeddings in higher precision.
    chosen, embeddings = search.chosen, budget is not None
    report, figures, achieved = write_and_measure(chosen, embeddings)
    if budget is not None and achieved is not None and not budget.met(achieved):
        embeddings = False
        report, figures, achieved = write_and_measure(chosen, embeddings)
    retries = 0
    if budget is not None and achieved is not None and not budget.met(achieved):
        # The switched graph's estimate was optimistic: give back the costliest layers and verify again.
        def holds(count: int) -> bool:
            nonlocal report, figures, achieved
            report, figures, achieved = write_and_measure(search.order[:count], embeddings)
            return achieved is not None and budget.met(achieved)

        given = give_back_until_met(len(chosen), holds)
        chosen, retries = search.order[: given.chosen] if given.tries else chosen, given.tries

    quantized = set(pinned) | set(chosen)
    fraction = flops_fraction(layers, quantized)
    plan = RecipePlan(
        precision=precision,
        float_regions=recipe.floats.name,
        met=bool(budget is None or (achieved is not None and budget.met(achieved))),
        achieved=achieved,
        quantized_flops_fraction=round(fraction, 4),
        evaluations=search.evaluations + verifications,
        embeddings=_embeddings_policy(embeddings, budget),
        verify_retries=retries,
        layers=_layer_choices(layers, quantized, recipe, search, budget),
    )
    logger.info("%s variant: %s, %.0f%% of FLOPs quantized", name, figures, 100 * fraction)
    record = variant_record(
        directory,
        path,
        name,
        [precision, recipe.floats.name],
        {**figures, "quantized_flops_fraction": fraction},
        evaluation.described,
    )
    return QuantizedVariant(record, report, plan)


def _embeddings_policy(embeddings: bool, budget: Budget | None) -> str:
    if embeddings:
        return "int8, weight-only, a scale per row (within the budget)"
    return "higher precision (policy)" if budget is None else "higher precision (int8 tables missed the budget)"


def _layer_choices(
    layers: list[Layer], quantized: set[str], recipe: Recipe, search: Search, budget: Budget | None
) -> list[LayerChoice]:
    assert recipe.quantized is not None
    precision = recipe.quantized.name
    default_reason = "search" if budget is not None else f"--precision {precision}: every layer the policy allows"

    def reason(layer: Layer) -> str:
        if layer.reason or budget is None or layer.name in quantized:
            return layer.reason or default_reason
        if layer.name in search.chosen:  # the search took it, verifying the variant gave it back
            return "search: given back, the verified variant missed the budget with it"
        return "search: past the longest prefix of the search order (least sensitive first) that meets the budget"

    return [
        LayerChoice(
            name=layer.name,
            module=layer.module,
            op=layer.op,
            inputs=list(layer.inputs),
            flops=layer.flops,
            precision=precision if layer.name in quantized else (layer.pinned or recipe.floats.name),
            sensitivity=search.sensitivity.get(layer.name),
            reason=reason(layer),
        )
        for layer in layers
    ]
