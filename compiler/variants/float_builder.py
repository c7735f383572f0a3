"""The float family's builder: the fp32 reference, and variants whose whole graph computes in a narrower float
(fp16, bf16; LayerNorm kept in fp32), each measured against fp32.

bf16 has no ONNX Runtime CPU kernels (MatMul, among others), so a bf16 variant is measured on the graph that
rounds to bf16 where the engine computes in it, held in fp32 (passes/fp16.py `RoundToBf16`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from tensorsmith.compiler.frontend.fused import FusedGraph
from tensorsmith.compiler.variants.builders import BuildJob, FamilyVariants, registered
from tensorsmith.compiler.variants.language import text_evaluation, with_language_metrics
from tensorsmith.compiler.variants.records import variant_record
from tensorsmith.compiler.variants.rewrite import rewrite, rewritten, variant_path
from tensorsmith.core.metrics import accuracy
from tensorsmith.core.precisions import BF16, FP16, FP32, Family, Precision
from tensorsmith.core.sessions import run_onnx
from tensorsmith.runtime.manifest import VariantRecord


def reference_variant(fused: FusedGraph) -> VariantRecord:
    """The fused fp32 graph itself, as the variant every float target may run."""
    return VariantRecord(
        name=FP32.name,
        precisions=[FP32.name],
        accuracy=fused.accuracy,
        evaluated_on="against the source" if fused.accuracy else "",
        **fused.record.model_dump(),
    )


def build_float_variant(
    model: onnx.ModelProto,
    floats: Precision,
    reference: list[np.ndarray],
    feeds: dict[str, np.ndarray],
    directory: Path,
) -> tuple[VariantRecord, onnx.ModelProto | None]:
    """Write the `floats` (fp16 or bf16) variant of `model` and measure it against `reference`, the fp32 graph's
    outputs on `feeds` (the verification inputs). Also returns the graph it was measured on where that
    is not the file (bf16's)."""
    from tensorsmith.passes.fp16 import ConvertToBf16, ConvertToFp16, RoundToBf16

    path = variant_path(directory, floats.name)
    measured_on: onnx.ModelProto | None = None
    if floats is BF16:
        rewrite(model, [ConvertToBf16()], path)
        measured_on, _ = rewritten(model, [RoundToBf16()])  # the same values, in fp32: ONNX Runtime runs it
        outputs = run_onnx(measured_on, feeds)
    else:
        rewrite(model, [ConvertToFp16()], path)
        outputs = run_onnx(path, feeds)
    measured = accuracy(reference, outputs)
    described = "the verification inputs" + ("; bf16 rounding simulated in fp32" if measured_on is not None else "")
    return variant_record(directory, path, floats.name, [floats.name, FP32.name], measured, described), measured_on


@registered(Family.FLOAT)
def build_float_variants(job: BuildJob) -> FamilyVariants:
    fused, config, directory, reporter = job.fused, job.config, job.directory, job.reporter
    reference = reference_variant(fused)
    text = text_evaluation(config, fused.inputs)  # a decoder's held-out text, if it has one
    if text is not None:
        reference = with_language_metrics(reference, fused.path, directory, text)
    records: list[VariantRecord] = []
    by_target: dict[str, VariantRecord] = {}
    for recipe, targets in job.plan.recipes().items():
        record = reference
        if recipe.floats in (FP16, BF16):
            reporter.stage(f"building the {recipe.floats.name} variant")
            feeds, reference_outputs = fused.verification_inputs(config)
            record, measured_on = build_float_variant(fused.model, recipe.floats, reference_outputs, feeds, directory)
            if text is not None:
                record = with_language_metrics(record, fused.path, directory, text, measured_on)
            records.append(record)
        by_target.update(dict.fromkeys(targets, record))
    return FamilyVariants(records, by_target, reference)
