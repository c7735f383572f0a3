"""A decoder's `--precision auto`: each weight layer in int4, one byte a weight (int8 weight-only, or int8 / fp8
with calibrated activations where every target runs them) or float, searched against the budget on the switched
graph (calibration/weight_search.py), then verified for real per variant, with and without quantized vocabulary
tables (which the search does not cover): the smallest verified file within the budget is kept.
`[[overrides]]` pin weight layers to a level (`--precision int4` and `auto` alike).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from tensorsmith.calibration import CalibrationData
from tensorsmith.calibration.weight_search import (
    FLOAT,
    WeightSearch,
    WeightSearchResult,
    by_bits,
    bytes_in_words,
)
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.targets import Recipe, get_target
from tensorsmith.compiler.variants.calibrated import collect_statistics, write_table
from tensorsmith.compiler.variants.int4 import Int4Plan, build_int4_variant, tables_policy
from tensorsmith.compiler.variants.layer_options import WeightLevels, layer_options
from tensorsmith.compiler.variants.measure import Evaluation
from tensorsmith.compiler.variants.precision_plan import LayerChoice, RecipePlan
from tensorsmith.compiler.variants.weight_matmuls import GraphSource, Pin
from tensorsmith.core.budget_search import give_back_until_met, quantized_fraction
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import load_onnx
from tensorsmith.core.overrides import Override
from tensorsmith.core.precisions import decoder_levels, overridable, precision, stored_on_cpu
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.runtime.manifest import VariantRecord

logger = logging.getLogger(__name__)

OVERRIDE_LEVELS = {name: FLOAT if precision(name).is_float else name for name in overridable()}  # fp32: float


@dataclass(frozen=True)
class _Tried:
    """One verified variant of the mix: its file's bytes, whether it met the budget, and how it was made."""

    bytes: int
    met: bool
    achieved: float
    moves: int  # the search's first `moves` taken
    tables: bool  # with the vocabulary tables quantized


def pinned_levels(plan: Int4Plan, overrides: Sequence[Override]) -> dict[str, Pin]:
    """Weight layers the `[[overrides]]` match (node name, module path or op), first match wins."""
    pinned = {}
    for name, layer in plan.layers.items():
        for override in overrides:
            if any(fnmatch.fnmatchcase(value, override.match) for value in (name, layer.module, "MatMul")):
                level = OVERRIDE_LEVELS[override.precision]
                if level != FLOAT and name not in plan.weights:
                    raise ConfigError(
                        f"[[overrides]] match '{override.match}' pins {name} to {override.precision}, but it stays "
                        f"in float: {plan.skipped.get(name, 'not a weight MatMul')}",
                        hint="narrow the match, or pin it to fp32",
                    )
                pinned[name] = Pin(level, f"override '{override.match}'")
                break
    return pinned


def plan_weight_levels(
    model: GraphSource,
    plan: Int4Plan,
    config: CompileConfig,
    data: CalibrationData | None,
    targets: list[str],
    directory: Path,
    reporter: Reporter,
) -> WeightLevels:
    """The levels every INT4-recipe target runs (int8 W8A8 and fp8 need calibrated activations, fp8 sm_89+), the
    pins, and, where a level quantizes activations, their scales from one calibration of the weight inputs."""
    allowed: list[str] = []
    notes: dict[str, str] = {}
    gpus = [name for name in targets if get_target(name).capability is not None]  # the cpu: see recipe_levels
    cpu = len(gpus) < len(targets)
    for record in sorted(decoder_levels(), key=lambda record: record.quantizes_activations):
        level, missing = record.name, [name for name in gpus if not get_target(name).runs_precision(record)]
        on_cpu = stored_on_cpu(record) if cpu or not gpus else record
        if missing:
            notes[level] = f"not considered: {', '.join(missing)} cannot run {level}"
        elif record.quantizes_activations and not gpus:
            notes[level] = "not considered: no GPU target (the cpu variant stores weights only)"
        elif not gpus and on_cpu is not record:
            notes[level] = "not considered: no GPU target"
        elif cpu and on_cpu is None:
            notes[level] = f"not considered: the cpu runs no weight-only level of {record.element.bits} bits"
        elif record.quantizes_activations and data is None:
            notes[level] = "not considered: no calibration data for activation scales"
        else:
            allowed.append(level)
            notes[level] = "considered"
            if record.quantizes_activations or on_cpu is not record:
                calibrated = " (activations calibrated on the calibration text)" if record.quantizes_activations else ""
                notes[level] += f" for the GPU variant{calibrated}"
            if cpu and on_cpu is not None and on_cpu is not record:
                notes[level] += f"; the cpu variant stores such layers {on_cpu.name}"
    pinned = pinned_levels(plan, config.overrides)
    for name, pin in pinned.items():
        if pin.level != FLOAT and pin.level not in allowed:
            raise ConfigError(
                f"{pin.reason} pins {name} to {pin.level}: {notes[pin.level]}",
                hint=f"pin it to one of {', '.join(allowed)}, or change the targets",
            )
    searching = config.accuracy_budget() is not None
    wanted = [level for level in allowed if precision(level).quantizes_activations]
    if not wanted or not (searching or any(pin.level in wanted for pin in pinned.values())):
        return WeightLevels(tuple(allowed), notes, {}, pinned)
    assert data is not None
    whole = load_onnx(model) if isinstance(model, Path) else model
    table = write_table(collect_statistics(whole, data, reporter, channels=()), config, directory)
    scales = {level: table.scales_in(precision(level).element) for level in wanted}
    for name, pin in pinned.items():
        activation = plan.layers[name].activation
        if pin.level in scales and activation not in scales[pin.level]:
            raise ConfigError(
                f"{pin.reason} pins {name} to {pin.level}, but its input {activation} has no activation scale: "
                f"{table.tensors[activation].reason if activation in table.tensors else 'not observed'}",
                hint="pin it to a weight-only level",
            )
    return WeightLevels(tuple(allowed), notes, scales, pinned)


def search_weights(
    model: onnx.ModelProto,
    plan: Int4Plan,
    levels: WeightLevels,
    evaluation: Evaluation,
    samples: int,
    reporter: Reporter,
) -> WeightSearchResult:
    assert evaluation.budget is not None
    named = ", ".join(level for group in reversed(by_bits(levels.allowed)) for level in group)
    reporter.stage(f"weight precision per layer ({named}, float) against {evaluation.budget}")
    feeds = {name: array[:samples] for name, array in evaluation.feeds.items()}
    return WeightSearch(model, layer_options(model, plan, levels), feeds, evaluation.budget).search(reporter)


@dataclass(frozen=True)
class MixedVariant:
    record: VariantRecord
    reports: list[PassReport]
    plan: RecipePlan


def build_mixed_variant(
    model: GraphSource,
    recipe: Recipe,
    plan: Int4Plan,
    levels: WeightLevels,
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
    tried: list[_Tried] = []

    def attempt(chosen: int, tables: bool) -> tuple[VariantRecord, list[PassReport]]:
        assignment = recipe_levels(recipe, search.assignment_at(chosen))
        record, reports = build_int4_variant(
            model, recipe, plan, evaluation, directory, assignment, tables, levels.scales
        )
        achieved = record.accuracy[budget.metric]
        tried.append(_Tried((directory / record.path).stat().st_size, budget.met(achieved), achieved, chosen, tables))
        return record, reports

    record, reports = attempt(search.chosen, True)
    if not tried[-1].met:
        record, reports = attempt(search.chosen, False)

        def holds(chosen: int) -> bool:
            nonlocal record, reports
            record, reports = attempt(chosen, True)
            return tried[-1].met

        give_back_until_met(search.chosen, holds)
    held = [entry for entry in tried if entry.met]
    best = (
        min(held, key=lambda entry: (entry.bytes, entry.achieved, entry.moves, entry.tables))
        if held
        else max(tried, key=lambda entry: entry.achieved if budget.higher_is_better else -entry.achieved)
    )
    if best is not tried[-1]:
        record, reports = attempt(best.moves, best.tables)  # write the chosen one again (the file holds the last)
    met, achieved, chosen, tables = tried[-1].met, tried[-1].achieved, tried[-1].moves, tried[-1].tables
    assignment = recipe_levels(recipe, search.assignment_at(chosen))
    logger.info("%s: %s %.6f with %d of %d moves", record.name, budget.metric, achieved, chosen, len(search.moves))
    assert recipe.quantized is not None
    sizes = {name: layer.elements for name, layer in plan.layers.items()}
    quantized = {name for name, level in assignment.items() if level != FLOAT}
    recipe_plan = RecipePlan(
        precision=recipe.quantized.name,
        float_regions=recipe.floats.name,
        met=met,
        achieved=achieved,
        quantized_flops_fraction=round(quantized_fraction(sizes, quantized), 4),
        evaluations=search.evaluations + len(tried),
        embeddings=tables_policy(recipe, tables),
        verify_retries=len(tried) - 1,
        layers=_choices(plan, assignment, search, levels, recipe, budget.metric, chosen),
        targets=targets,
        weight_levels=levels.notes,
    )
    return MixedVariant(record, reports, recipe_plan)


def recipe_levels(recipe: Recipe, assignment: Mapping[str, str]) -> dict[str, str]:
    """The levels `recipe`'s variant stores: as assigned, but the cpu variant's (fp32 regions) W8A8 layers int8
    weight-only (the same bytes). ONNX Runtime's CPU runs the static Q/DQ pairs around a decoder's small MatMuls
    as separate ops: a tinylm decode step took 2.8-3.7x as long with 11 W8A8 layers (bench/decoder_w8a8_cpu.py); fp8
    it does not run at all; nvfp4 neither (its layers int4 there, the same size class)."""
    if not recipe.on_cpu:
        return dict(assignment)
    stored = {level: stored_on_cpu(precision(level)) for level in set(assignment.values()) - {FLOAT}}
    names = {level: record.name for level, record in stored.items() if record is not None}
    assert len(names) == len(stored), f"a level the cpu stores nothing for was allowed: {stored}"
    return {name: level if level == FLOAT else names[level] for name, level in assignment.items()}


def _choices(
    plan: Int4Plan,
    assignment: dict[str, str],
    search: WeightSearchResult,
    levels: WeightLevels,
    recipe: Recipe,
    metric: str,
    chosen: int,
) -> list[LayerChoice]:
    order = {move: index for index, move in enumerate(search.moves)}
    choices = []
    for name, layer in plan.layers.items():
        level = assignment.get(name, FLOAT)
        measured = search.sensitivity.get(name, {})
        if name in levels.pinned:
            reason = levels.pinned[name].reason
        elif name not in assignment:
            reason = plan.skipped.get(name, "not an INT4-able weight")
        elif level == FLOAT and search.assignment_at(search.chosen)[name] != FLOAT:  # chosen, then given back
            reason = "search: given back, the verified variant missed the budget with it"
        elif level == FLOAT:
            reason = "search: one byte a weight costs more per byte than the budget leaves"
        else:
            searched = search.assignment_at(chosen)[name]
            reason = f"search: move {order[(name, searched)] + 1} of {len(search.moves)} by metric lost per byte saved"
            if searched != level:
                reason += f" ({searched} in the GPU variant; weight-only here, as ONNX Runtime's CPU runs it faster)"
        groups = by_bits(measured)
        for group in groups:
            if level != FLOAT and name not in levels.pinned and len(group) > 1:
                figures = ", ".join(f"{candidate} {measured[candidate]:.5f}" for candidate in group)
                reason += f"; at {bytes_in_words(group[0])} a weight, {metric} with it alone: {figures}"
        deepest = groups[-1][0] if groups else None  # a float layer's figure: the deepest level's
        stored = recipe.floats.name if level == FLOAT else level
        choices.append(layer.choice(name, stored, reason, measured.get(level if level != FLOAT else deepest or "")))
    return choices
