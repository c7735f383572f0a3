"""`report.json` and `report.html`: what the compile did, read back from the artifact's own files.

Everything comes from the artifact directory (manifest, precision.json, calibration.json, the histograms, the
engine records), so `tensorsmith report OUT` regenerates the same report, and `tensorsmith build` refreshes its
engine table.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from tensorsmith.calibration.statistics import load_histograms
from tensorsmith.calibration.table import CalibrationTable
from tensorsmith.compiler.report.html import render_html
from tensorsmith.compiler.report.schema import (
    EngineRow,
    FusionRow,
    HistogramRow,
    Miss,
    PlanRow,
    Report,
    SensitivityRow,
    StepRow,
    VariantRow,
)
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan, RecipePlan
from tensorsmith.core.files import replace_file
from tensorsmith.core.metrics import budget_terms, loss
from tensorsmith.core.precisions import precision
from tensorsmith.passes.fusion import FusionDetails
from tensorsmith.runtime.manifest import Manifest, StepRecord, read_manifest, resolve_inside

logger = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
REPORT_SCHEMA = 1
CALIBRATION = "calibration.json"
HISTOGRAMS = "calibration/histograms.npz"
MOST_SENSITIVE = 6  # tensors whose histograms the report plots
PLOTTED_BINS = 512  # the 4096 calibration bins summed in eights: the same shape, an eighth of the page


def _read_json(directory: Path, name: str) -> Mapping[str, object] | None:
    path = directory / name
    if not path.is_file():
        return None
    loaded = json.loads(path.read_text())
    return loaded if isinstance(loaded, dict) else None


def _read_calibration(directory: Path) -> CalibrationTable | None:
    path = directory / CALIBRATION
    return CalibrationTable.model_validate_json(path.read_text()) if path.is_file() else None


def _step(step: StepRecord) -> StepRow:
    return {"name": step.name, "seconds": step.seconds, "peak_rss_bytes": step.peak_rss_bytes}


def _fusion(manifest: Manifest) -> list[FusionRow]:
    """Matches and misses per rule, from the passes' `RULE.matched` / `RULE.missed` counts and miss reasons."""
    rows: list[FusionRow] = []
    for record in manifest.passes:
        fusion = FusionDetails.read(record.details)
        misses: Mapping[str, list[Miss]] = fusion.misses if fusion is not None else {}
        for key, matched in record.counts.items():
            if not key.endswith(".matched"):
                continue
            rule = key.removesuffix(".matched")
            rows.append(
                {
                    "pass": record.name,
                    "rule": rule,
                    "matched": matched,
                    "missed": record.counts.get(f"{rule}.missed", 0),
                    "already_fused": record.counts.get(f"{rule}.already_fused", 0),  # the exporter wrote them
                    "misses": misses.get(rule, []),
                }
            )
    return rows


def _sensitivity(plan: PrecisionPlan | None) -> dict[str, list[SensitivityRow]]:
    """Per precision (its variants share one search), the layers with a measured sensitivity, most costly first,
    each with what quantizing it alone costs against the reference (`cost`: negative where it measured better;
    None for a metric without a lossless value, core/metrics.LOSSLESS)."""
    if plan is None:
        return {}
    terms = budget_terms(plan.budget or "")
    metric, higher_is_better = (terms.metric, terms.higher_is_better) if terms is not None else ("cosine", True)
    result: dict[str, list[SensitivityRow]] = {}
    for recipe in plan.recipes.values():
        rows: list[SensitivityRow] = [
            {
                "name": layer.name,
                "module": layer.module,
                "sensitivity": layer.sensitivity,
                "cost": loss(metric, higher_is_better, layer.sensitivity),
            }
            for layer in recipe.layers
            if layer.sensitivity is not None
        ]
        rows.sort(key=lambda row: -row["sensitivity"] if higher_is_better else row["sensitivity"], reverse=True)
        if rows and recipe.precision not in result:
            result[recipe.precision] = rows
    return result


def _sensitive_tensors(plan: PrecisionPlan | None, sensitivity: dict[str, list[SensitivityRow]]) -> list[str]:
    """The activation tensors of the most sensitive layers (else of the first layers), for histogram plots."""
    if plan is None or not plan.recipes:
        return []
    first = next(iter(plan.recipes.values()))
    inputs = {layer.name: layer.inputs for layer in first.layers}
    ranked = next(iter(sensitivity.values()), None)
    names = [layer["name"] for layer in ranked] if ranked else list(inputs)
    tensors = [tensor for name in names for tensor in inputs.get(name, [])]
    return list(dict.fromkeys(tensors))


def _quantized_activations(plan: PrecisionPlan | None) -> set[str]:
    """The activations some variant's plan quantizes: the inputs of its layers at a precision that quantizes
    activations (a weight-only plan's calibrated activations stay float)."""
    if plan is None:
        return set()
    return {
        tensor
        for recipe in plan.recipes.values()
        for layer in recipe.layers
        if precision(layer.precision).quantizes_activations
        for tensor in layer.inputs
    }


def _histograms(
    directory: Path, calibration: CalibrationTable | None, tensors: list[str], quantized: set[str]
) -> list[HistogramRow]:
    """Histogram summaries with the chosen thresholds: the most sensitive tensors that were calibrated, and
    whether a variant quantizes them."""
    path = directory / HISTOGRAMS
    if calibration is None or not path.is_file():
        return []

    statistics = load_histograms(path)
    chosen = [name for name in tensors if name in statistics and name in calibration.tensors]
    chosen = chosen or list(statistics)
    rows: list[HistogramRow] = []
    for name in chosen[:MOST_SENSITIVE]:
        entry = calibration.tensors[name]
        rows.append(
            {
                "tensor": name,
                "amax": entry.amax,
                "range": statistics[name].histogram_range,  # what the bins cover: [0, 2^e) ⊇ [0, amax]
                "threshold": entry.threshold,
                "method": entry.method,
                "quantized": entry.quantize and name in quantized,
                "counts": statistics[name].histogram.reshape(PLOTTED_BINS, -1).sum(axis=1).tolist(),
            }
        )
    return rows


def _plan_table(plan: PrecisionPlan | None) -> dict[str, list[PlanRow]]:
    if plan is None:
        return {}
    return {
        name: [
            {
                "name": layer.name,
                "module": layer.module,
                "op": layer.op,
                "precision": layer.precision,
                "sensitivity": layer.sensitivity,
                "reason": layer.reason,
            }
            for layer in recipe.layers
        ]
        for name, recipe in plan.recipes.items()
    }


def _cpu_choice(plan: PrecisionPlan | None) -> dict[str, object] | None:
    """precision.json's account of the cpu target's recipe (which variant, how its graph was prepared, which
    ONNX Runtime settings), if the compile made that choice."""
    for recipe in plan.recipes.values() if plan is not None else ():
        if recipe.cpu is not None:
            return recipe.cpu.model_dump(mode="json")
    return None


def _engines(directory: Path, manifest: Manifest) -> list[EngineRow]:
    rows = []
    for target in manifest.targets:
        row: EngineRow = {
            "target": target.name,
            "variant": target.variant,
            "status": target.status,
            "builder": target.builder,
            "reason": target.reason,
        }
        if target.engine is not None:
            path = resolve_inside(directory, target.engine.path)
            record = _read_json(directory, str(Path(target.engine.path).with_suffix(".json"))) or {}
            seconds = record.get("build_seconds")
            row["builder_version"] = target.engine.builder_version
            row["compute_capability"] = target.engine.compute_capability
            row["bytes"] = path.stat().st_size if path.is_file() else None
            row["build_seconds"] = seconds if isinstance(seconds, int | float) else None
            row["cache"] = target.engine.cache
        rows.append(row)
    return rows


def _variants(directory: Path, manifest: Manifest) -> list[VariantRow]:
    rows: list[VariantRow] = []
    for variant in manifest.variants:
        path = resolve_inside(directory, variant.path)
        rows.append(
            {
                "name": variant.name,
                "precisions": variant.precisions,
                "accuracy": variant.accuracy,
                "evaluated_on": variant.evaluated_on,
                "bytes": path.stat().st_size if path.is_file() else None,
            }
        )
    return rows


def collect_report(directory: Path, name: str | None = None, manifest: Manifest | None = None) -> Report:
    """The report's data (report.json), from the artifact at `directory` (named `name`: a compile writes the
    report in a temporary directory before it is renamed): its `manifest` as the compile holds it, else read."""
    manifest = manifest if manifest is not None else read_manifest(directory)
    plan = PrecisionPlan.read(directory)
    calibration = _read_calibration(directory)
    sensitivity = _sensitivity(plan)
    return {
        "schema_version": REPORT_SCHEMA,
        "artifact": name or directory.resolve().name,
        "tensorsmith_version": manifest.tensorsmith_version,
        "source": manifest.source.model_dump(mode="json"),
        "steps": [_step(step) for step in manifest.steps],
        "passes": [
            {"name": p.name, "changed": p.changed, "seconds": p.seconds, "variant": p.variant} for p in manifest.passes
        ],
        "fusion": _fusion(manifest),
        "calibration": (
            {"method": calibration.method, "samples": calibration.samples} if calibration is not None else None
        ),
        "histograms": _histograms(
            directory, calibration, _sensitive_tensors(plan, sensitivity), _quantized_activations(plan)
        ),
        "budget": plan.budget if plan is not None else None,
        "budget_outcomes": {
            name: {"met": recipe.met, "achieved": recipe.achieved, "instead": _instead(name, recipe)}
            for name, recipe in (plan.recipes.items() if plan is not None and plan.budget else ())
        },
        "float_instead": {
            name: said
            for name, recipe in (plan.recipes.items() if plan is not None else ())
            if recipe.float_instead is not None and (said := _instead(name, recipe))
        },
        "sensitivity": sensitivity,
        "plan": _plan_table(plan),
        "cpu": _cpu_choice(plan),
        "variants": _variants(directory, manifest),
        "engines": _engines(directory, manifest),
    }


def _instead(name: str, recipe: RecipePlan) -> str | None:
    """What the targets of variant `name` run instead, and why: the fp32 reference (variants/fallback.py), or the
    cpu's dynamic-quantization variant, built within the budget."""
    if recipe.float_instead is not None:
        return f"the cpu runs {recipe.float_instead.variant}: {recipe.float_instead.reason}"
    if recipe.cpu is not None and recipe.cpu.variant != name:
        return f"the cpu runs {recipe.cpu.variant}: {recipe.cpu.reason}"
    return None


def write_report(directory: Path, name: str | None = None, manifest: Manifest | None = None) -> Report:
    """Write report.json and report.html into the artifact at `directory` (each replaced atomically)."""
    report = collect_report(directory, name, manifest)
    replace_file(directory / REPORT_JSON, (json.dumps(report) + "\n").encode())  # compact: histograms are long
    replace_file(directory / REPORT_HTML, render_html(report).encode())
    logger.info("wrote %s and %s", directory / REPORT_JSON, directory / REPORT_HTML)
    return report
