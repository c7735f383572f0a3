"""The float family's builder: the fp32 reference, and variants whose whole graph computes in a narrower float
(fp16, bf16; LayerNorm kept in fp32), each measured against fp32. fp16's also keeps in fp32 the nodes whose weights
or activations leave its range (activations measured on the fp32 graph first: compiler/variants/fp16_range.py),
named in the manifest's pass record and in one log line.

bf16 has no ONNX Runtime CPU kernels (MatMul, among others), so a bf16 variant is measured on the graph that
rounds to bf16 where the engine computes in it, held in fp32 (passes/fp16.py `RoundToBf16`). An fp16 variant whose
MatMul weights reach a gigabyte is measured through its widened twin (core/narrow_twin), which keeps those weights
in 16 bits where ONNX Runtime would hold them in fp32.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.compiler.frontend.fused import FusedGraph
from tensorsmith.compiler.targets import get_target
from tensorsmith.compiler.variants.builders import BuildJob, FamilyVariants
from tensorsmith.compiler.variants.fp16_range import out_of_range_activations
from tensorsmith.compiler.variants.language import text_evaluation, with_language_metrics
from tensorsmith.compiler.variants.measure import token_figures
from tensorsmith.compiler.variants.records import variant_record
from tensorsmith.compiler.variants.rewrite import rewrite_file, rewritten, variant_path
from tensorsmith.core.elements import Element
from tensorsmith.core.ir import load_onnx
from tensorsmith.core.metrics import accuracy
from tensorsmith.core.module_paths import module_paths_recorded
from tensorsmith.core.narrow_twin import drop_twin, write_widened_twin
from tensorsmith.core.precisions import Precision, reference_precision
from tensorsmith.core.sessions import run_onnx
from tensorsmith.passes import PassReport
from tensorsmith.passes.fp16 import ConvertToBf16, ConvertToFp16, HalfDetails, RoundToBf16
from tensorsmith.passes.tied_projection import TiedProjection
from tensorsmith.runtime.manifest import VariantRecord

logger = logging.getLogger(__name__)
NAMED = 3  # nodes kept in fp32 for range named in the log line; the rest counted


@dataclass(frozen=True)
class FloatVariant:
    record: VariantRecord
    report: PassReport  # the conversion pass's, for the manifest
    measured_on: onnx.ModelProto | None  # the graph its accuracy was measured on where that is not the file (bf16's)
    tied: PassReport | None = None  # an engines-only variant's tied projection (passes/tied_projection.py)


def reference_variant(fused: FusedGraph) -> VariantRecord:
    """The fused fp32 graph itself, as the variant every float target may run."""
    return VariantRecord(
        name=reference_precision().name,
        precisions=[reference_precision().name],
        accuracy=fused.accuracy,
        evaluated_on="against the source" if fused.accuracy else "",
        **fused.record.model_dump(),
    )


def build_float_variant(
    model: Path,
    floats: Precision,
    reference: list[np.ndarray],
    feeds: dict[str, np.ndarray],
    directory: Path,
    out_of_range: Mapping[str, float] | None = None,
    written: Callable[[Path], None] | None = None,
    engines_only: bool = False,
) -> FloatVariant:
    """Write the `floats` (fp16 or bf16) variant of the graph saved at `model` and measure it against `reference`,
    the fp32 graph's outputs on `feeds` (the verification inputs). fp16 keeps the writers and readers of
    `out_of_range` activations (name → max |x|) in fp32, and the readers of weights beyond ±65504. `written` is
    told of the file before it is measured. A variant only engines run (`engines_only`) reads a tied embedding
    table through a Transpose, as its engines' graph will: that graph then adds no weight and shares this file's
    (core/mapped_save.py), and the table's copy is never written."""
    path = variant_path(directory, floats.name)
    measured_on: onnx.ModelProto | None = None
    tie = [TiedProjection()] if engines_only else []
    if floats.element is Element.BF16:
        report, *tied = rewrite_file(model, [ConvertToBf16(), *tie], path)
        if written is not None:
            written(path)
        measured_on, _ = rewritten(load_onnx(model), [RoundToBf16()])  # the same values, in fp32: ONNX Runtime runs it
        outputs = run_onnx(measured_on, feeds)
    else:
        report, *tied = rewrite_file(model, [ConvertToFp16(out_of_range=dict(out_of_range or {})), *tie], path)
        if written is not None:
            written(path)
        write_widened_twin(path)  # dropped by the caller once every measurement is made
        outputs = run_onnx(path, feeds)
    measured = accuracy(reference, outputs)
    described = "the verification inputs" + ("; bf16 rounding simulated in fp32" if measured_on is not None else "")
    stored = [floats.name, reference_precision().name]
    record = variant_record(directory, path, floats.name, stored, measured, described)
    tied_report = replace(tied[0], variant=record.name) if tied else None
    return FloatVariant(record, replace(report, variant=record.name), measured_on, tied_report)


def name_modules(report: PassReport, model: Path) -> PassReport:
    """The report with each node kept in fp32 for range given its module path (where the export recorded one):
    onnx-graphsurgeon, which the pass runs on, drops node metadata."""
    if not isinstance(report.details, HalfDetails) or not report.details.kept_fp32_for_range:
        return report
    kept = report.details.kept_fp32_for_range
    paths = module_paths_recorded(onnx.load(str(model), load_external_data=False))
    named = {
        node: why.model_copy(update={"module": paths[node]}) if node in paths else why for node, why in kept.items()
    }
    return replace(report, details=HalfDetails(kept_fp32_for_range=named))


def log_kept_for_range(report: PassReport) -> None:
    """One line naming the nodes kept in fp32 for range, if any: the first few, with the magnitude that did it."""
    if not isinstance(report.details, HalfDetails) or not report.details.kept_fp32_for_range:
        return
    kept = report.details.kept_fp32_for_range
    named = [
        f"{why.module or node} ({why.op}: {why.reason} {why.tensor} reaches {why.max_abs:.3g})"
        for node, why in list(kept.items())[:NAMED]
    ]
    more = f" and {len(kept) - NAMED} more" if len(kept) > NAMED else ""
    logger.info(
        "%s: %d nodes kept in fp32 for fp16's range: %s%s",
        report.variant or report.name,
        len(kept),
        "; ".join(named),
        more,
    )


def build_float_variants(job: BuildJob) -> FamilyVariants:
    fused, config, directory, reporter = job.fused, job.config, job.directory, job.reporter
    reference = reference_variant(fused)
    text = text_evaluation(config, fused.inputs, fused.path)  # a decoder's held-out text, if it has one
    expected = None  # the fp32 graph's figures on the text, measured once for every variant
    if text is not None:
        expected = token_figures(fused.path, text.feeds, text.tokens)
        reference = with_language_metrics(reference, text, expected, expected)
    records: list[VariantRecord] = []
    reports: list[PassReport] = []
    by_target: dict[str, VariantRecord] = {}
    for recipe, targets in job.plan.recipes().items():
        record = reference
        if not recipe.floats.reference:  # a 16-bit float; fp32 is the fused graph itself
            reporter.stage(f"building the {recipe.floats.name} variant")
            verified = fused.verification_inputs(config)
            feeds, reference_outputs = verified.feeds, verified.outputs
            out_of_range = {}
            if recipe.fp16_regions:  # from verification's run where it measured the ranges
                out_of_range = out_of_range_activations(fused.path, feeds, measured=fused.ranges)
            try:
                told = functools.partial(job.written, recipe.floats.name, list(targets)) if job.written else None
                engines_only = all(get_target(target).builders for target in targets)
                built = build_float_variant(
                    fused.path, recipe.floats, reference_outputs, feeds, directory, out_of_range, told, engines_only
                )
                record = built.record
                if text is not None and expected is not None:
                    measured_on = built.measured_on if built.measured_on is not None else directory / record.path
                    record = with_language_metrics(
                        record, text, expected, token_figures(measured_on, text.feeds, text.tokens)
                    )
            finally:
                drop_twin(variant_path(directory, recipe.floats.name))
            report = name_modules(built.report, fused.path)
            log_kept_for_range(report)
            records.append(record)
            reports.extend([report, built.tied] if built.tied else [report])
        by_target.update(dict.fromkeys(targets, record))
    return FamilyVariants(records, by_target, reference, reports)
