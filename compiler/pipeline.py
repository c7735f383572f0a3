"""`compile()`: source → ONNX → passes → verified graph → artifact directory (DESIGN.md, "The pipeline")."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from tensorsmith.compiler.artifact import staged_artifact, write_manifest
from tensorsmith.compiler.config import CompileConfig, InputDecl
from tensorsmith.compiler.engines import target_records
from tensorsmith.compiler.errors import ConfigError, VerificationError
from tensorsmith.compiler.export import ExportedModel, export_source
from tensorsmith.compiler.feeds import example_feeds
from tensorsmith.compiler.ir import ai_onnx_opset, apply_input_decls, io_records, save_onnx
from tensorsmith.compiler.module_paths import attach_module_paths, module_paths
from tensorsmith.compiler.progress import LogReporter, Reporter, TimedReporter
from tensorsmith.compiler.report import write_report
from tensorsmith.compiler.targets import float_variant
from tensorsmith.compiler.variants import build_fp16_variant, build_variants, check_data
from tensorsmith.compiler.verify import compare_outputs, run_onnx
from tensorsmith.compiler.version import __version__
from tensorsmith.passes import Canonicalize, GraphPass, PassReport, default_passes, run_passes
from tensorsmith.runtime.manifest import (
    FileRecord,
    Manifest,
    PassRecord,
    SourceRecord,
    StepRecord,
    VariantRecord,
    sha256_of,
)

logger = logging.getLogger(__name__)

MODEL_NAME = "model.onnx"


@dataclass
class CompileResult:
    out: Path
    manifest: Manifest
    seconds: float
    unmet_budgets: list[str]  # with --precision auto: recipes whose variant misses the budget (written anyway)

    @property
    def budget_met(self) -> bool:
        return not self.unmet_budgets


def _declare_onnx_inputs(config: CompileConfig, model: onnx.ModelProto) -> CompileConfig:
    """An ONNX source: apply declared inputs to the graph, or declare the graph's own inputs."""
    origin = str(config.resolve(config.source))
    if config.inputs:
        apply_input_decls(model, config.inputs, origin)
        return config
    decls = []
    for record in io_records(model)[0]:
        if record.dtype == "unknown":
            raise ConfigError(f"input '{record.name}' of {origin} has no dtype", hint="declare it with --input")
        decls.append(InputDecl(name=record.name, dtype=record.dtype, dims=record.shape))
    return config.model_copy(update={"inputs": decls})


def _source_record(config: CompileConfig, exported: ExportedModel) -> SourceRecord:
    if config.source_kind == "factory":
        checkpoint = config.resolve(config.checkpoint) if config.checkpoint else None
        return SourceRecord(
            kind="factory",
            path=config.source,
            sha256=sha256_of(checkpoint) if checkpoint else None,
            checkpoint=str(checkpoint) if checkpoint else None,
            exporter=exported.exporter,
            fallback_reason=exported.fallback_reason,
            opset=ai_onnx_opset(exported.model),
        )
    path = config.resolve(config.source)
    return SourceRecord(
        kind=config.source_kind,
        path=str(path),
        sha256=sha256_of(path),
        exporter=exported.exporter,
        fallback_reason=exported.fallback_reason,
        opset=ai_onnx_opset(exported.model),
    )


def graph_passes(config: CompileConfig) -> list[GraphPass]:
    """The rewrite passes after canonicalize, in order: fusions, then attention-scale folding."""
    return default_passes() if config.fuse else []


def optimize(model: onnx.ModelProto, config: CompileConfig) -> tuple[onnx.ModelProto, list[PassReport]]:
    """Canonicalize, then run the graph passes on onnx-graphsurgeon's IR."""
    model, canonical = Canonicalize(opset=config.opset)(model)
    passes = graph_passes(config)
    if not passes:
        return model, [canonical]
    graph = gs.import_onnx(model)
    reports = run_passes(graph, passes)
    return gs.export_onnx(graph), [canonical, *reports]


def _verify(
    config: CompileConfig, exported: ExportedModel, source_path: Path | None, compiled: Path, names: list[str]
) -> dict[str, float]:
    # Sizes one above the export's, so an exporter that baked in a dynamic dim is caught here.
    feeds = example_feeds(config, seed=1, size_offset=1)
    if exported.reference is not None:
        reference = exported.reference(feeds)
    else:
        assert source_path is not None
        reference = run_onnx(source_path, feeds)
    try:
        errors = compare_outputs(names, reference, run_onnx(compiled, feeds))
    except ValueError as err:
        raise VerificationError(f"the compiled graph does not match {config.source}: {err}") from err
    worst = max(errors, key=errors.__getitem__) if errors else None
    if worst is not None and errors[worst] > config.tolerance:
        raise VerificationError(
            f"output '{worst}' differs from {config.source} by {errors[worst]:.2e} of its scale "
            f"(tolerance {config.tolerance:g})",
            hint="compile with --no-verify to inspect the artifact anyway, or try --exporter torchscript",
        )
    return errors


def _tune_cpu_session(variant: VariantRecord, directory: Path, feeds: dict[str, np.ndarray]) -> None:
    """Record in `variant` the ONNX Runtime optimizers that run it slower on this CPU (cpu_recipe.tune_session);
    the `--precision auto` recipe does this itself, on evaluation data."""
    from tensorsmith.compiler.cpu_recipe import MAX_TUNED_BYTES, tune_session

    path = directory / variant.path
    if path.stat().st_size > MAX_TUNED_BYTES:
        logger.info("cpu: ONNX Runtime's defaults kept for %s: too large to hold two sessions for timing", path.name)
        return
    variant.onnxruntime_disabled_optimizers, latency = tune_session(path, feeds)
    logger.info("cpu: %s ms per run by ONNX Runtime session setting; optimizers switched off: %s",
                latency, variant.onnxruntime_disabled_optimizers or "none")  # fmt: skip


def compile(config: CompileConfig, out: str | Path, reporter: Reporter | None = None) -> CompileResult:
    """Compile `config.source` into the artifact directory `out` (replaced atomically, never half-written)."""
    started = time.perf_counter()
    out = Path(out)
    reporter = TimedReporter(reporter or LogReporter())

    if config.precision not in ("fp32", "fp16") and config.inputs:
        check_data(config)
    with staged_artifact(out) as staging:
        reporter.stage(f"exporting {config.source}")
        exported = export_source(config, example_feeds(config) if config.inputs else {})
        if config.source_kind == "onnx":
            config = _declare_onnx_inputs(config, exported.model)
        source = _source_record(config, exported)
        source_path = None
        if config.verify and exported.reference is None:
            source_path = staging / "source.onnx"  # ONNX sources are verified against themselves on ORT
            save_onnx(exported.model, source_path)

        reporter.stage("running graph passes")
        paths = module_paths(exported.model)
        model, reports = optimize(exported.model, config)
        attach_module_paths(model, paths)
        model_path = staging / MODEL_NAME
        save_onnx(model, model_path)
        inputs, outputs = io_records(model)

        accuracy: dict[str, float] = {}
        if config.verify:
            reporter.stage("verifying against the source on ONNX Runtime")
            errors = _verify(config, exported, source_path, model_path, [o.name for o in outputs])
            accuracy = {"max_relative_error": max(errors.values(), default=0.0)}
            if source_path is not None:
                source_path.unlink()

        model_record = FileRecord(path=MODEL_NAME, sha256=sha256_of(model_path))
        reference = VariantRecord(
            name="fp32",
            precisions=["fp32"],
            accuracy=accuracy,
            evaluated_on="against the source" if accuracy else "",
            **model_record.model_dump(),
        )
        variants = [reference]
        by_target = dict.fromkeys(config.targets, reference)
        unmet: list[str] = []
        session_tuned: set[str] = set()
        if config.precision in ("fp32", "fp16"):
            wants_fp16 = [t for t in config.targets if float_variant(config.precision, t) == "fp16"]
            if wants_fp16:
                reporter.stage("building the fp16 variant")
                half = build_fp16_variant(model, config, model_path, staging)
                variants.append(half)
                by_target.update(dict.fromkeys(wants_fp16, half))
        else:
            quantized = build_variants(model, config, inputs, model_path, staging, reporter)
            variants += quantized.records
            reports += quantized.reports
            named = {record.name: record for record in quantized.records}
            by_target = {target: named[name] for target, name in quantized.by_target.items()}
            unmet = quantized.unmet
            session_tuned = quantized.session_tuned

        cpu = by_target.get("cpu")
        if cpu is not None and cpu.name not in session_tuned:
            reporter.stage("cpu: timing ONNX Runtime's session settings")
            _tune_cpu_session(cpu, staging, example_feeds(config))

        targets = target_records(config, by_target, inputs, staging, reporter)
        steps = [StepRecord(name=name, seconds=seconds) for name, seconds in reporter.finish()]
        manifest = Manifest(
            tensorsmith_version=__version__,
            source=source,
            model=model_record,
            inputs=inputs,
            outputs=outputs,
            dims={name: limits.model_dump() for name, limits in config.dims.items()},
            steps=steps,
            passes=[PassRecord(**vars(report)) for report in reports],
            variants=variants,
            targets=targets,
        )
        write_manifest(staging, manifest)
        reporter.stage(f"writing the report and {out}")
        write_report(staging, out.resolve().name)
    return CompileResult(out, manifest, round(time.perf_counter() - started, 3), unmet)
