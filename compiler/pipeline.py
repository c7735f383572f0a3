"""`compile()`: the stages, in order (docs/architecture.md):

    source ─▶ fused graph ─▶ variant plan ─▶ variants ─▶ engines ─▶ artifact
                                                  └─▶ early engines ─┘ (built beside the variants' measurements)

Each stage is a function of the typed values before it; none edits another's records.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tensorsmith.compiler.artifact.staging import check_replaceable, staged_artifact, write_manifest
from tensorsmith.compiler.artifact.tokenizer import copy_tokenizer
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.early_engines import EarlyEngines
from tensorsmith.compiler.engines.records import build_engines
from tensorsmith.compiler.frontend.decoder import generation_record
from tensorsmith.compiler.frontend.fused import FusedGraph, fused_graph
from tensorsmith.compiler.frontend.quantized_checkpoint import checkpoint_floats
from tensorsmith.compiler.frontend.source import Source, open_source
from tensorsmith.compiler.frontend.stamped_export import streams_weights
from tensorsmith.compiler.report.collect import write_report
from tensorsmith.compiler.resources import check_resources
from tensorsmith.compiler.variants.data import check_data
from tensorsmith.compiler.variants.kv_cache import CacheLayout, check_static_cache, generation_graphs
from tensorsmith.compiler.variants.plan import plan_variants
from tensorsmith.compiler.variants.resume import LayerRecords, resume_directory
from tensorsmith.compiler.variants.stage import Variants, build_variants
from tensorsmith.compiler.variants.text_data import check_text_data
from tensorsmith.compiler.version import __version__
from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import GraphIO, remove_onnx
from tensorsmith.core.layerwise import layerwise
from tensorsmith.core.mapped_save import without_references
from tensorsmith.core.narrow_twin import drop_twin
from tensorsmith.core.precisions import AUTO, precision
from tensorsmith.core.progress import LogReporter, Reporter, Step, TimedReporter
from tensorsmith.core.sessions import quiet_onnxruntime
from tensorsmith.runtime.manifest import (
    FileRecord,
    Manifest,
    PassRecord,
    StepRecord,
    TargetRecord,
    TensorRecord,
    checkpoint_links_path,
    external_data_path,
)

logger = logging.getLogger(__name__)


@dataclass
class CompileResult:
    out: Path
    manifest: Manifest
    seconds: float
    opset: int  # of the compiled graph (a decoder's default differs from the CLI's)
    unmet_budgets: list[str]  # with --precision auto: recipes whose variant misses the budget (written anyway)

    @property
    def budget_met(self) -> bool:
        return not self.unmet_budgets


def compile(config: CompileConfig, out: str | Path, reporter: Reporter | None = None) -> CompileResult:
    """Compile `config.source` into the artifact directory `out` (replaced atomically, never half-written)."""
    started = time.perf_counter()
    out = Path(out)
    timed = TimedReporter(reporter or LogReporter())

    quiet_onnxruntime()  # also for the sessions libraries open for us (onnx-graphsurgeon's constant folding)
    check_replaceable(out)  # before loading the source: an -o that is not ours fails at once (again under the lock)
    source = open_source(config)  # an ONNX file's inputs are declared here, once
    config = source.config
    # before the export: a wrong array name, a missing tokenizer or a budget the model cannot measure fails at once
    if source.is_decoder:
        check_text_data(config)
        check_static_cache(config)
    elif (config.precision == AUTO or not precision(config.precision).is_float) and config.inputs:
        check_data(config)
    budget = config.accuracy_budget()
    if config.precision == AUTO and "budget" not in config.model_fields_set:  # said, not silently assumed
        advice = "; a decoder's is usually perplexity-ratio, e.g. --budget 'perplexity-ratio<=1.02'"
        logger.warning(
            "--precision auto without --budget: the budget is %s (the default)%s",
            config.budget,
            advice if source.is_decoder else "",
        )
    if budget is not None and budget.is_language and not source.is_decoder:
        raise ConfigError(
            f"budget {budget} is a language-model metric, and {config.source} is no text-generation model",
            hint="use cosine, min-cosine, max-abs or sqnr-db",
        )
    floats = checkpoint_floats(source.huggingface.directory if source.huggingface is not None else None)
    plan = plan_variants(config, source.is_decoder, floats)
    if source.huggingface is not None and config.check_resources:  # a checkpoint too large fails here, in one line
        check_resources(
            source.huggingface.directory,
            plan,
            out,
            search=source.is_decoder and config.precision == AUTO,
            streamed=streams_weights(source.huggingface, config),
        )
    with (
        layerwise(config.layerwise, timed),
        staged_artifact(out) as staging,
        EarlyEngines(config, staging, source.huggingface) as early,
    ):
        fp16 = any(recipe.fp16_regions and recipe.quantized is None for recipe in plan.recipes())
        fused = fused_graph(source, staging, timed, ranges=fp16)  # the fp16 variant's range check, in verification
        config = _read_inputs(config, fused.inputs)
        early.fused(GraphIO(fused.inputs, fused.outputs))
        # what the calibration finishes is kept beside OUT until it is published: a killed compile resumes from it
        resumable = LayerRecords(resume_directory(out), [fused.record.sha256, config.model_dump_json(), __version__])
        variants = build_variants(plan, fused, config, staging, timed, early.written, resumable)
        # a large decoder's reference, measured against and run by no target, is left out of the artifact at the end
        left_out = (
            source.is_decoder
            and not plan.ships_reference
            and variants.records[0] not in variants.by_target.values()  # the cpu on it (variants/fallback.py)
            and (external_data_path(fused.path).is_file() or checkpoint_links_path(fused.path).is_dir())
        )
        if left_out:
            variants = variants.with_records([variants.records[0].model_copy(update={"shipped": False})])
        layout = None
        if source.huggingface is not None and source.is_decoder:  # its variant files become generation graphs
            records, layout = generation_graphs(
                variants.records,
                variants.by_target,
                source.huggingface,
                config,
                GraphIO(fused.inputs, fused.outputs),
                staging,
                timed,
                lambda: fused.verification_inputs(config).feeds,
                early.graphs,
            )
            variants = variants.with_records(records)
        inputs, dims = (layout.inputs, layout.dims) if layout else (fused.inputs, config.dims)
        targets = build_engines(
            config.build, config.targets, variants.by_target, inputs, dims, staging, timed, source.is_decoder, early
        )
        targets = [
            _with_note(target, plan.notes.get(target.name), variants.notes.get(target.name)) for target in targets
        ]
        drop_twin(fused.path)  # measuring is done: the twin is not part of the artifact
        if left_out:
            remove_onnx(fused.path)
        without_references(fused.path)  # what ships holds its weights; the links to the checkpoint go
        tokenizer = copy_tokenizer(source.huggingface, staging) if source.huggingface else []
        manifest = _manifest(source, fused, variants, targets, timed.finish(), tokenizer, layout)
        write_manifest(staging, manifest)
        timed.stage(f"writing the report and {out}")
        write_report(staging, out.resolve().name, manifest)  # the manifest as written, not read back
    resumable.remove()  # published: nothing is left to resume
    unmet = [f"{name}: {text}" for name, text in variants.unmet.items()]
    return CompileResult(out, manifest, round(time.perf_counter() - started, 3), config.opset, unmet)


def _read_inputs(config: CompileConfig, graph_inputs: list[TensorRecord]) -> CompileConfig:
    """`config` without the declared inputs the exported graph does not read (MPT's ALiBi takes no position_ids):
    nothing feeds them after the export, engine profiles included."""
    read = {record.name for record in graph_inputs}
    unread = [decl.name for decl in config.inputs if decl.name not in read]
    if not unread:
        return config
    logger.info("the graph does not read %s: not fed", ", ".join(unread))
    return config.model_copy(update={"inputs": [decl for decl in config.inputs if decl.name in read]})


def _with_note(target: TargetRecord, note: str | None, stage_note: str | None = None) -> TargetRecord:
    """A target that got another variant than asked (sm_75 for int4) says why, unless a failure says more; one the
    variants stage moved (the cpu onto fp32: variants/fallback.py) says why after its own reason."""
    said = [reason for reason in (target.reason, stage_note) if reason]
    if note and not target.reason:
        said = [note, *said]
    return target.model_copy(update={"reason": "; ".join(said)}) if said else target


def _manifest(
    source: Source,
    fused: FusedGraph,
    variants: Variants,
    targets: list[TargetRecord],
    steps: list[Step],
    tokenizer: list[FileRecord],
    layout: CacheLayout | None,
) -> Manifest:
    # the reference's file, rewritten to a generation graph for a decoder; none where it is not shipped
    model = next(
        (
            FileRecord(path=r.path, sha256=r.sha256) if r.shipped else None
            for r in variants.records
            if r.path == fused.record.path
        ),
        fused.record,
    )
    dims = layout.dims if layout else source.config.dims
    reports = [*fused.reports, *variants.reports, *(layout.reports if layout else [])]
    return Manifest(
        tensorsmith_version=__version__,
        source=fused.source,
        model=model,
        inputs=layout.inputs if layout else fused.inputs,
        outputs=layout.outputs if layout else fused.outputs,
        dims={name: limits.model_dump() for name, limits in dims.items()},
        dim_names=source.dim_names,
        default_dims=source.default_dims,
        tokenizer=tokenizer,
        generation=generation_record(
            source.huggingface,
            source.config,
            layout.kind,
            layout.reason,
            any(record.name == "position_ids" for record in layout.inputs),
        )
        if source.huggingface and layout
        else None,
        steps=[StepRecord(name=s.name, seconds=s.seconds, peak_rss_bytes=s.peak_rss_bytes) for s in steps],
        passes=[PassRecord(**{**vars(report), "details": report.details.as_json()}) for report in reports],
        variants=variants.records,
        targets=targets,
    )
