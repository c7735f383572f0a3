"""The fused-graph stage: export the source, canonicalize and fuse, save `model.onnx`, verify it against the
source on ONNX Runtime."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.export import ExportedModel, export_source
from tensorsmith.compiler.frontend.feeds import example_feeds
from tensorsmith.compiler.frontend.source import Source
from tensorsmith.compiler.frontend.verify import compare_outputs
from tensorsmith.compiler.targets import get_target
from tensorsmith.core.errors import ExportError, VerificationError
from tensorsmith.core.ir import ai_onnx_opset, io_records, save_onnx
from tensorsmith.core.module_paths import attach_module_paths, module_paths
from tensorsmith.core.precisions import FP32
from tensorsmith.core.progress import Reporter
from tensorsmith.core.sessions import run_onnx
from tensorsmith.passes import Canonicalize, GraphPass, PassReport, default_passes, run_passes
from tensorsmith.runtime.manifest import FileRecord, SourceRecord, TensorRecord, sha256_of

MODEL_NAME = "model.onnx"


@dataclass(frozen=True)
class FusedGraph:
    model: onnx.ModelProto  # canonical and fused, node module paths attached
    path: Path  # where it is saved: MODEL_NAME in the artifact being written
    record: FileRecord
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    source: SourceRecord
    reports: list[PassReport]  # canonicalize and the graph passes, for the manifest
    accuracy: dict[str, float]  # against the source ({} with --no-verify)


def graph_passes(config: CompileConfig) -> list[GraphPass]:
    """The rewrite passes after canonicalize, in order: fusions, attention-scale folding, attention."""
    if not config.fuse:
        return []
    gpu = [name for name in config.targets if get_target(name).builders]
    if config.precision == FP32.name and gpu:  # TensorRT for RTX 1.7 has no fp32 Attention kernel (measured)
        return default_passes(f"fp32 on {', '.join(gpu)}: TensorRT for RTX builds Attention in fp16 or lower only")
    return default_passes()


def optimize(model: onnx.ModelProto, config: CompileConfig) -> tuple[onnx.ModelProto, list[PassReport]]:
    """Canonicalize, then run the graph passes on onnx-graphsurgeon's IR."""
    model, canonical = Canonicalize(opset=config.opset)(model)
    passes = graph_passes(config)
    if not passes:
        return model, [canonical]
    graph = gs.import_onnx(model)
    reports = run_passes(graph, passes)
    return gs.export_onnx(graph), [canonical, *reports]


def fused_graph(source: Source, directory: Path, reporter: Reporter) -> FusedGraph:
    """Export, optimize, save and verify: the fp32 graph every variant starts from."""
    config = source.config
    reporter.stage(f"exporting {config.source}")
    exported = export_source(source, example_feeds(config) if config.inputs else {})

    reporter.stage("running graph passes")
    paths = module_paths(exported.model)
    model, reports = optimize(exported.model, config)
    attach_module_paths(model, paths)
    model_path = directory / MODEL_NAME
    save_onnx(model, model_path)
    inputs, outputs = io_records(model)

    accuracy: dict[str, float] = {}
    if config.verify:
        reporter.stage("verifying against the source on ONNX Runtime")
        errors = verify(config, exported, model_path, [o.name for o in outputs])
        accuracy = {"max_relative_error": max(errors.values(), default=0.0)}
    record = FileRecord(path=MODEL_NAME, sha256=sha256_of(model_path))
    return FusedGraph(model, model_path, record, inputs, outputs, source_record(config, exported), reports, accuracy)


def source_record(config: CompileConfig, exported: ExportedModel) -> SourceRecord:
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
            warnings=exported.warnings,
        )
    path = config.resolve(config.source)
    return SourceRecord(
        kind=config.source_kind,
        path=str(path),
        sha256=_directory_digest(path) if path.is_dir() else sha256_of(path),
        exporter=exported.exporter,
        fallback_reason=exported.fallback_reason,
        traced_layers=exported.traced_layers,
        opset=ai_onnx_opset(exported.model),
        warnings=exported.warnings,
    )


def _directory_digest(path: Path) -> str:
    """A model directory's: over its config and weights files' own sha256s, in name order."""
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    return hashlib.sha256("".join(f"{f.name}:{sha256_of(f)}\n" for f in files).encode()).hexdigest()


def verify(config: CompileConfig, exported: ExportedModel, compiled: Path, names: list[str]) -> dict[str, float]:
    """Per-output error of the compiled graph against the source (an ONNX source: the graph as read, on ONNX
    Runtime), at dynamic sizes one above the export's (so an exporter that baked in a dynamic dim is caught
    here); above `tolerance` is an error."""
    feeds = example_feeds(config, seed=1, size_offset=1)
    if exported.reference is not None:
        reference = exported.reference(feeds)
    else:
        try:
            reference = run_onnx(exported.model, feeds, origin=str(config.resolve(config.source)))
        except ExportError as err:  # the source itself fails: most often a dynamic dim's example size it rejects
            shapes = ", ".join(f"{name}{list(array.shape)}" for name, array in feeds.items())
            raise ExportError(err.message, hint=f"it ran on example inputs {shapes}; set [dims.NAME] opt to "
                              "sizes the model accepts, or [[inputs]] value_range for its values") from err  # fmt: skip
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
