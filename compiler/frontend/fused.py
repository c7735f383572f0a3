"""The fused-graph stage: export the source, canonicalize and fuse, save `model.onnx`, verify it against the
source on ONNX Runtime."""

from __future__ import annotations

import gc
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.frontend.export import export_source, factory_module
from tensorsmith.compiler.frontend.export_cache import (
    FROM_EXPORT_CACHE,
    CachedFusedGraph,
    cache_key,
    configured_cache,
    restore,
    store,
)
from tensorsmith.compiler.frontend.exported import ExportedModel
from tensorsmith.compiler.frontend.feeds import example_feeds, onnx_source_outputs
from tensorsmith.compiler.frontend.source import Source
from tensorsmith.compiler.frontend.source_digests import SourceDigests, source_files, source_record
from tensorsmith.compiler.frontend.verify import SourceRun, VerifiedRun, compare_outputs
from tensorsmith.compiler.targets import get_target
from tensorsmith.core.errors import VerificationError
from tensorsmith.core.importing import first_line
from tensorsmith.core.ir import io_records, load_onnx
from tensorsmith.core.layerwise import layerwise_segments
from tensorsmith.core.mapped_graph import mapped
from tensorsmith.core.mapped_save import save_mapped
from tensorsmith.core.module_paths import module_paths
from tensorsmith.core.narrow_twin import write_twin
from tensorsmith.core.precisions import reference_precision
from tensorsmith.core.progress import Reporter
from tensorsmith.core.sessions import run_onnx
from tensorsmith.core.tensor_ranges import TensorRange, outputs_and_ranges
from tensorsmith.passes import Canonicalize, GraphPass, PassReport, default_passes, run_passes
from tensorsmith.runtime.manifest import FileRecord, SourceRecord, TensorRecord, checkpoint_links_path, sha256_of

logger = logging.getLogger(__name__)
MODEL_NAME = "model.onnx"


@dataclass(frozen=True)
class FusedGraph:
    path: Path  # canonical and fused, node module paths attached, saved: MODEL_NAME in the artifact being written
    record: FileRecord
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    source: SourceRecord
    reports: list[PassReport]  # canonicalize and the graph passes, for the manifest
    accuracy: dict[str, float]  # against the source ({} with --no-verify)
    # whether the source ran at the sizes its engines are tuned for (feeds.py): the variants' measurements and
    # the cpu timing use the sizes verification could use
    tuned_sizes: bool = True
    # the verification feeds and this graph's outputs for them: what the float variants are measured against,
    # without opening a second fp32 session (at 1B, 6 GB more)
    verified: VerifiedRun | None = None
    # every float tensor's range in verification's run, where the compile asked (the fp16 variant's range check)
    ranges: list[TensorRange] | None = None

    @property
    def model(self) -> onnx.ModelProto:
        """The graph with its weights, read from its file on each call (not held: at 1B it is 6 GB). A stage that
        rewrites it reads it memory-mapped instead (core/mapped_graph.py)."""
        return load_onnx(self.path)

    def verification_inputs(self, config: CompileConfig) -> VerifiedRun:
        """The verification feeds and this graph's outputs for them: verification's own, or (with --no-verify)
        computed here at the sizes verification would have used."""
        if self.verified is not None:
            return self.verified
        feeds = example_feeds(config, seed=1, size_offset=1, tuned=self.tuned_sizes)
        return VerifiedRun(feeds, run_onnx(self.path, feeds))


def graph_passes(config: CompileConfig) -> list[GraphPass]:
    """The rewrite passes after canonicalize, in order: fusions, attention-scale folding, attention."""
    if not config.fuse:
        return []
    gpu = [name for name in config.targets if get_target(name).builders]
    # TensorRT for RTX 1.7 has no fp32 Attention kernel (measured)
    if config.precision == reference_precision().name and gpu:
        return default_passes(f"fp32 on {', '.join(gpu)}: TensorRT for RTX builds Attention in fp16 or lower only")
    return default_passes()


def fuse(path: Path, config: CompileConfig, module_paths: dict[str, str]) -> tuple[onnx.ModelProto, list[PassReport]]:
    """The graph passes after canonicalize, on onnx-graphsurgeon's IR over the graph saved at `path` (its weights
    memory-mapped), saved there again with the nodes' module paths; its structure, without the weights."""
    with mapped(path) as (graph, _):
        reports = run_passes(graph, graph_passes(config))
        return save_mapped(graph, path, module_paths, references=True), reports


def fused_graph(source: Source, directory: Path, reporter: Reporter, ranges: bool = False) -> FusedGraph:
    """Export, optimize, save and verify: the fp32 graph every variant starts from. `ranges`: verification's run
    also measures every float tensor's range (core/tensor_ranges.py), for the fp16 variant."""
    config = source.config
    cache = configured_cache(config.resolve(config.export_cache_dir) if config.export_cache_dir else None)
    # a factory's key is its module's (export_cache.py): built first, and exported from on a miss
    module = factory_module(config) if cache is not None and config.source_kind == "factory" else None
    files = source_files(config) if cache is not None else None  # hashed once: the key's and the manifest's
    key = cache_key(config, graph_passes(config), module, files) if cache is not None else None
    ranges = ranges or key is not None  # so that the entry serves a later fp16 compile (whose range check needs them)
    if cache is not None and key is not None:
        cached = restore(cache, key, directory / MODEL_NAME, ranges)
        if cached is not None:
            reporter.stage(f"exporting {config.source}: {FROM_EXPORT_CACHE}")
            return _from_cache(config, cached, directory / MODEL_NAME)
    reporter.stage(f"exporting {config.source}")
    scratch = directory / ".export"  # a large export's weights, read by canonicalize, then deleted
    scratch.mkdir()
    digests = SourceDigests(config) if files is None else None  # on the other core, while the export traces
    try:
        exported = export_source(source, example_feeds(config) if config.inputs else {}, scratch, module, reporter)
    except BaseException:
        if digests is not None:
            digests.stop()
        raise
    del module
    described = source_record(config, exported, digests.result() if digests is not None else files)
    # The source's outputs now, so that the source model (a torch module: the fp32 weights again) and the
    # exported graph go before the passes make their copies.
    expected = expected_outputs(config, exported) if config.verify else None
    paths = module_paths(exported.model)
    exported.reference = None
    gc.collect()  # transformers' modules hold reference cycles

    reporter.stage("running graph passes")
    model_path = directory / MODEL_NAME
    # canonical, saved, then fused over its memory-mapped weights and saved again: no second copy of them
    _, canonical = Canonicalize(opset=config.opset).to_file(exported.model, model_path, owned=scratch)
    exported.model = onnx.ModelProto()  # the last reference to the exported graph
    shutil.rmtree(scratch)
    structure, reports = fuse(model_path, config, paths)
    reports = [canonical, *reports]
    _measured_form(model_path)
    io = io_records(structure)
    inputs, outputs = io.inputs, io.outputs

    accuracy: dict[str, float] = {}
    computed: VerifiedRun | None = None
    measured: list[TensorRange] | None = None
    tuned = True
    if expected is not None:
        reporter.stage("verifying against the source on ONNX Runtime")
        feeds, reference, tuned = expected.feeds, expected.outputs, expected.tuned
        results, measured = _verification_run(model_path, feeds, ranges)
        computed = VerifiedRun(feeds, results)
        errors = verify(config, [o.name for o in outputs], reference, computed.outputs)
        accuracy = {"max_relative_error": float(np.max(list(errors.values()), initial=0.0))}
    record = FileRecord(path=MODEL_NAME, sha256=sha256_of(model_path))
    if cache is not None and key is not None and not checkpoint_links_path(model_path).exists():
        store(cache, key, model_path, record, described, reports, accuracy, tuned, computed, measured)
    elif cache is not None:  # an entry would hold the checkpoint's weights again, as fp32
        logger.info("export cache: a graph that reads its weights from the checkpoint's files is not stored")
    return FusedGraph(model_path, record, inputs, outputs, described, reports, accuracy, tuned, computed, measured)


def _from_cache(config: CompileConfig, cached: CachedFusedGraph, model_path: Path) -> FusedGraph:
    """The fused graph an earlier compile stored, as this compile's: its source as this config names it."""
    _measured_form(model_path)
    io = io_records(onnx.load(str(model_path), load_external_data=False))
    inputs, outputs = io.inputs, io.outputs
    if config.source_kind == "factory":  # the same module may come from a checkpoint elsewhere
        checkpoint = config.resolve(config.checkpoint) if config.checkpoint else None
        named = {
            "path": config.source,
            "checkpoint": str(checkpoint) if checkpoint else None,
            "sha256": sha256_of(checkpoint) if checkpoint else None,
        }
    else:
        named = {"path": str(config.resolve(config.source))}
    source = cached.source.model_copy(update=named)
    record = FileRecord(path=MODEL_NAME, sha256=cached.sha256)
    return FusedGraph(
        model_path,
        record,
        inputs,
        outputs,
        source,
        cached.reports,
        cached.accuracy,
        cached.tuned,
        cached.verified,
        cached.ranges,
    )


def _measured_form(path: Path) -> None:
    """The sessions that measure the graph at `path` hold its weights at the checkpoint's width (its narrow twin),
    unless they run it a layer at a time: then one layer is held, and the twin would only cost disk and time."""
    if layerwise_segments(path) is None:
        write_twin(path)


def _verification_run(
    path: Path, feeds: dict[str, np.ndarray], ranges: bool
) -> tuple[list[np.ndarray], list[TensorRange] | None]:
    """The graph's outputs on the verification feeds and, asked for, every float tensor's range in the same run;
    where ONNX Runtime cannot run the graph with the reductions, its outputs alone (the ranges measured later)."""
    if ranges:
        try:
            return outputs_and_ranges(path, feeds)
        except Exception as err:  # onnxruntime's own exception types: the plain run says what is wrong, if anything
            logger.info("verification: ranges not measured with the outputs: %s", first_line(err)[:200])
    return run_onnx(path, feeds), None


def expected_outputs(config: CompileConfig, exported: ExportedModel) -> SourceRun:
    """Verification's feeds, the source's outputs for them and whether the feeds are at the tuned sizes: a PyTorch
    source's module at the example sizes (feeds.py), an ONNX source's graph as read, on ONNX Runtime, at the sizes
    it runs on (`onnx_source_outputs`)."""
    if exported.reference is None:
        return onnx_source_outputs(config, exported.model)
    feeds = example_feeds(config, seed=1, size_offset=1)
    return SourceRun(feeds, exported.reference(feeds), tuned=True)


def verify(
    config: CompileConfig, names: list[str], reference: list[np.ndarray], compiled: list[np.ndarray]
) -> dict[str, float]:
    """Per-output error of the compiled graph's outputs against the source's; above `tolerance` is an error."""
    try:
        errors = compare_outputs(names, reference, compiled)
    except ValueError as err:
        raise VerificationError(f"the compiled graph does not match {config.source}: {err}") from err
    for index, name in enumerate(names):  # the same infinities on both sides (a mask's -inf) are no error
        if np.isnan(errors[name]) and _same_infinities(reference[index], compiled[index]):
            finite = np.isfinite(reference[index])
            errors[name] = compare_outputs([name], [reference[index][finite]], [compiled[index][finite]])[name]
    # a NaN error (NaN or infinity in one side's outputs only) is the worst of all, never under the tolerance
    worst = max(errors, key=lambda name: np.inf if np.isnan(errors[name]) else errors[name]) if errors else None
    if worst is not None and np.isnan(errors[worst]):
        side = "the source's" if not np.isfinite(reference[names.index(worst)]).all() else "the compiled graph's"
        raise VerificationError(
            f"output '{worst}' of {config.source} is not finite ({side} holds NaN or infinity)",
            hint="check the weights for NaN or infinity; compile with --no-verify to inspect the artifact anyway",
        )
    if worst is not None and errors[worst] > config.tolerance:
        raise VerificationError(
            f"output '{worst}' differs from {config.source} by {errors[worst]:.2e} of its scale "
            f"(tolerance {config.tolerance:g})",
            hint="compile with --no-verify to inspect the artifact anyway, or try --exporter torchscript",
        )
    return errors


def _same_infinities(expected: np.ndarray, got: np.ndarray) -> bool:
    """Whether the two arrays hold infinities at the same places and of the same signs, and no NaN."""
    if np.isnan(expected).any() or np.isnan(got).any():
        return False
    where = np.isinf(expected)
    return bool(np.array_equal(where, np.isinf(got)) and np.array_equal(expected[where], got[where]))
