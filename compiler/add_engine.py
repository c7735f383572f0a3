"""`tensorsmith build OUT --target`: add one target's engine to an existing artifact, from the variant compile
chose for it (or, for a target compile did not have, the variant compile's `--precision` gives it in the target
table). Builds run in parallel; the manifest update is serialised by a lock and written atomically."""

from __future__ import annotations

import logging
from pathlib import Path

from tensorsmith.compiler.artifact.staging import artifact_lock, locked, write_manifest
from tensorsmith.compiler.config import BuildConfig, DimRange
from tensorsmith.compiler.engines.records import build_engine_record, choose_builder
from tensorsmith.compiler.report.collect import write_report
from tensorsmith.compiler.targets import Builder, get_target
from tensorsmith.compiler.variants.precision_plan import PrecisionPlan
from tensorsmith.core.errors import BuildError
from tensorsmith.core.precisions import by_preference, precision
from tensorsmith.core.progress import LogReporter, Reporter
from tensorsmith.runtime.manifest import Manifest, TargetRecord, VariantRecord, read_manifest

logger = logging.getLogger(__name__)


def variant_for(manifest: Manifest, plan: PrecisionPlan | None, target: str) -> VariantRecord:
    """The target's variant as compile recorded it; else the one compile's `--precision` gives it."""
    for record in manifest.targets:
        if record.name == target:
            return manifest.variant(record.variant)
    names = [variant.name for variant in manifest.variants if variant.shipped]  # one measured, not shipped: none
    row = get_target(target)
    if plan is not None:
        decoder = manifest.generation is not None  # a decoder's auto
        wanted = row.recipe(plan.precision, decoder, precision(plan.fallback_float)).variant
        if wanted in names:
            return manifest.variant(wanted)
        raise BuildError(
            f"the artifact has no {wanted} variant, which --precision {plan.precision} gives {target} "
            f"(variants: {names})",
            hint=f"recompile with --target {target}",
        )
    for choice in by_preference():  # an artifact written before compile recorded its request: the most quantized
        if choice.name in names and row.runs_precision(choice):
            return manifest.variant(choice.name)
    raise BuildError(
        f"the artifact has no variant that {target} can run (variants: {names})",
        hint=f"recompile with --target {target}",
    )


def build_target(
    directory: Path,
    target: str,
    builder: Builder | None = None,
    options: BuildConfig | None = None,
    reporter: Reporter | None = None,
) -> TargetRecord:
    """Add `target`'s engine to the artifact at `directory`; concurrent builds for other targets all land."""
    get_target(target)
    read_manifest(directory)  # a clear error for a directory that is not an artifact, before any lock
    with artifact_lock(directory, shared=True):  # no compile may replace the artifact meanwhile
        manifest = read_manifest(directory)
        variant = variant_for(manifest, PrecisionPlan.read(directory), target)
        chosen = choose_builder(target, builder)
        (reporter or LogReporter()).stage(f"building the {target} engine from variant {variant.name} with {chosen}")
        record = build_engine_record(
            target,
            variant,
            manifest.inputs,
            {name: DimRange(**limits) for name, limits in manifest.dims.items()},
            directory,
            chosen,
            options or BuildConfig(),
            decoder=manifest.generation is not None,
        )
        with locked(directory):
            current = read_manifest(directory)
            current.targets = [t for t in current.targets if t.name != target] + [record]
            write_manifest(directory, current)
            write_report(directory)  # the engine table changed
    return record
