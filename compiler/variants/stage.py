"""The variants stage: fused graph + variant plan → one verified variant file per recipe, and precision.json.

A recipe is a precision and the targets that run it (compiler/targets.py decides). The plan's recipes are
grouped by precision family and each family's builder (compiler/variants/builders.py) writes its variants:
float (the fp32 reference, fp16, bf16), calibrated (int8, fp8), weight-only (int4, nvfp4, a decoder's auto).
Then the cpu target's variant gets its backend and session settings by measurement. Targets that share a
variant share its file and engine input.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.feeds import example_feeds
from tensorsmith.compiler.frontend.fused import FusedGraph
from tensorsmith.compiler.variants.builders import BuildJob, FamilyVariants, VariantBuilder
from tensorsmith.compiler.variants.calibrated_builder import build_calibrated_variants
from tensorsmith.compiler.variants.cpu_choice import choose_cpu_backend
from tensorsmith.compiler.variants.fallback import cpu_float_instead
from tensorsmith.compiler.variants.float_builder import build_float_variants
from tensorsmith.compiler.variants.fp8_weight_builder import build_fp8_weight_variants
from tensorsmith.compiler.variants.plan import CPU_TARGET, VariantPlan
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.compiler.variants.resume import LayerRecords
from tensorsmith.compiler.variants.weight_only_builder import build_weight_only_variants
from tensorsmith.core.external_bytes import graph_bytes
from tensorsmith.core.ir import remove_onnx
from tensorsmith.core.layerwise import layerwise_segments
from tensorsmith.core.metrics import Budget
from tensorsmith.core.precisions import Family
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.runtime.manifest import VariantRecord, checkpoint_links_path
from tensorsmith.runtime.specs import Signature

logger = logging.getLogger(__name__)

# Each precision family's builder (builders.py): a new family is one module and one row.
BUILDERS: dict[Family, VariantBuilder] = {
    Family.FLOAT: build_float_variants,
    Family.CALIBRATED: build_calibrated_variants,
    Family.WEIGHT_ONLY: build_weight_only_variants,
    Family.FP8_WEIGHTS: build_fp8_weight_variants,
}


@dataclass(frozen=True)
class Variants:
    records: list[VariantRecord]  # the fp32 reference first
    by_target: dict[str, VariantRecord]
    reports: list[PassReport] = field(default_factory=list)  # smoothing and Q/DQ passes, for the manifest
    unmet: dict[str, str] = field(default_factory=dict)  # variant → its budget not held, with the figure
    notes: dict[str, str] = field(default_factory=dict)  # target → why it runs another variant than planned

    def with_records(self, records: list[VariantRecord]) -> Variants:
        """These variants with each record replaced by the one of the same name in `records`."""
        by_name = {record.name: record for record in records}
        records_ = [by_name.get(r.name, r) for r in self.records]
        by_target = {target: by_name.get(record.name, record) for target, record in self.by_target.items()}
        return Variants(records_, by_target, self.reports, self.unmet, self.notes)


def build_variants(
    plan: VariantPlan,
    fused: FusedGraph,
    config: CompileConfig,
    directory: Path,
    reporter: Reporter,
    written: Callable[[str, list[str], Path], None] | None = None,
    records: LayerRecords | None = None,
) -> Variants:
    """Write every variant the plan needs into `directory` (variants/, calibration files, precision.json);
    `written` is told of each variant file a builder has finished, before it is measured."""
    parts = [
        BUILDERS[family](BuildJob(part, fused, config, directory, reporter, written, records))
        for family, part in plan.by_family().items()
    ]
    variants, tuned = _merged(parts), {name for part in parts for name in part.tuned}
    plans = [part.plan for part in parts if part.plan is not None]
    written_plan = plans[0] if plans else PrecisionPlan(precision=plan.request)
    variants, written_plan = reference_on_cpu(variants, written_plan, config.accuracy_budget(), directory)
    written_plan.model_copy(update={"fallback_float": plan.floats.name}).write(directory)
    cpu = variants.by_target.get(CPU_TARGET)
    if cpu is None or cpu.name in tuned:  # its variant, backend and session chosen together (cpu_choice.py)
        return variants
    specs = Signature([record.spec() for record in fused.inputs], [record.spec() for record in fused.outputs])
    # a decoder's static KV cache runs on ONNX Runtime, which writes it in place; OpenVINO returns each step's cache
    # as a new tensor to copy back (runtime/openvino_ops.py), which a forward's timing would not show
    static_cache = config.generation.kv_cache != "dynamic" and any(
        r.name.startswith("past_key_values.") for r in fused.inputs
    )
    reporter.stage("cpu: timing ONNX Runtime's session settings and the cpu backends")
    feeds = example_feeds(config, tuned=fused.tuned_sizes)
    chosen = choose_cpu_backend(cpu, directory, feeds, specs, time_openvino=not static_cache)
    return variants.with_records([chosen])


def _merged(parts: list[FamilyVariants]) -> Variants:
    """One Variants from the families' parts: the reference once (as the family that measured it on its data
    recorded it: the last such part's), then each part's records in family order."""
    reference = [part.reference for part in parts if part.reference is not None][-1]
    records = [reference, *(record for part in parts for record in part.records)]
    by_target = {
        target: reference if record.name == reference.name else record
        for part in parts
        for target, record in part.by_target.items()
    }
    reports = [report for part in parts for report in part.reports]
    return Variants(records, by_target, reports, {name: text for part in parts for name, text in part.unmet.items()})


def reference_on_cpu(
    variants: Variants, plan: PrecisionPlan, budget: Budget | None, directory: Path
) -> tuple[Variants, PrecisionPlan]:
    """The cpu target on the fp32 reference where its quantized variant quantizes nothing or misses a budget the
    reference meets (fallback.py): the variant is not shipped (its file removed) and its unmet budget dropped
    unless another target runs it, and precision.json's recipe says what runs instead."""
    reference, cpu = variants.records[0], variants.by_target.get(CPU_TARGET)
    path = directory / reference.path
    if cpu is None or layerwise_segments(path) is not None or checkpoint_links_path(path).is_dir():
        return variants, plan
    instead = cpu_float_instead(cpu, reference, plan, budget, graph_bytes(directory / cpu.path), graph_bytes(path))
    if instead is None:
        return variants, plan
    logger.info("cpu: runs %s: %s", reference.name, instead.reason)
    by_target = {**variants.by_target, CPU_TARGET: reference}
    records, unmet = variants.records, variants.unmet
    if all(record.name != cpu.name for record in by_target.values()):
        remove_onnx(directory / cpu.path)
        records = [r.model_copy(update={"shipped": False}) if r.name == cpu.name else r for r in records]
        unmet = {name: text for name, text in unmet.items() if name != cpu.name}
    notes = {**variants.notes, CPU_TARGET: instead.reason}
    recipe = plan.recipes[cpu.name].model_copy(update={"float_instead": instead})
    plan = plan.model_copy(update={"recipes": {**plan.recipes, cpu.name: recipe}})
    return Variants(records, by_target, variants.reports, unmet, notes), plan
