"""The variant builders' interface: one builder per precision family (core/precisions.py `Family`), each
turning its recipes, the fused graph and the data into variant records, pass reports and precision.json rows.

    recipes of one family ─┐
    fused graph ───────────┼─▶ VariantBuilder ─▶ FamilyVariants (records, target → record, reports,
    config (data, budget) ─┘                      unmet budgets, precision.json recipes)

`compiler/variants/stage.py` groups the plan's recipes by family and calls each family's builder in turn, from its
table `BUILDERS` (a new family: one module and one row); a new precision of an existing family needs no new
builder, only its table record (and, where it stores weights its own way, a pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.fused import FusedGraph
from tensorsmith.compiler.variants.data import SplitData, split_data
from tensorsmith.compiler.variants.plan import VariantPlan
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.compiler.variants.resume import LayerRecords
from tensorsmith.compiler.variants.text_data import is_decoder_graph, text_split
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport
from tensorsmith.runtime.manifest import VariantRecord


@dataclass(frozen=True)
class BuildJob:
    """What a builder gets: the recipes of its family (a plan with only those targets) and the compile's inputs."""

    plan: VariantPlan
    fused: FusedGraph
    config: CompileConfig
    directory: Path
    reporter: Reporter
    # told of each variant file once it is final, before it is measured: (variant name, its targets, path)
    written: Callable[[str, list[str], Path], None] | None = None
    records: LayerRecords | None = None  # finished calibration results a killed compile resumes from (resume.py)


@dataclass(frozen=True)
class FamilyVariants:
    """What a builder made. `reference`: the fp32 reference's record as this family measured it (with its
    metrics on this family's evaluation data), or None to leave it to another family."""

    records: list[VariantRecord]
    by_target: dict[str, VariantRecord]
    reference: VariantRecord | None = None
    reports: list[PassReport] = field(default_factory=list)
    unmet: dict[str, str] = field(default_factory=dict)  # variant → its budget not held, with the figure
    plan: PrecisionPlan | None = None  # precision.json, for the families that choose per layer
    tuned: set[str] = field(default_factory=set)  # cpu variants whose backend and session are chosen already


VariantBuilder = Callable[[BuildJob], FamilyVariants]  # one per precision family, listed in stage.BUILDERS


def calibration_split(config: CompileConfig, fused: FusedGraph) -> SplitData:
    """Calibration and evaluation data: arrays for any graph, text (windows, prefill and decode) for a decoder."""
    if not is_decoder_graph(fused.inputs):
        return split_data(config, fused.inputs)
    text = text_split(config, fused.inputs, fused.path)
    return SplitData(text.calibration, text.evaluation, text.evaluated_on, text.tokens)
