"""A decoder's generation graphs: every variant file rewritten to the static KV cache, once it has been measured.

The variants are measured (perplexity, the cpu backend's timing) on the dynamic-cache graph, which keeps every
position; the files written here are what generation runs: the static cache updated in place
(passes/static_cache.py) and the vocabulary projection at the last position only (passes/last_position.py), at
opset 24. Engines are built from these files as they are. `[generation] kv_cache = "dynamic"` keeps the dynamic
graph (Optimum's and ONNX Runtime GenAI's names) and slices the logits for the engines only, as before.

By default the static cache is taken where the graph allows it: its attention must have become ONNX Attention
(passes/attention.py), which the compile skips when a GPU target gets an fp32 variant (TensorRT for RTX has no
fp32 Attention kernel). Where it cannot be taken the compile says why and keeps the dynamic cache; asked for
explicitly (or implied by `kv_cache_precision = "fp8"`, compiler/variants/kv_fp8.py), it is an error naming
the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from tensorsmith.compiler.config import CompileConfig, DimRange
from tensorsmith.compiler.frontend.decoder import layer_windows, static_cache_io
from tensorsmith.compiler.frontend.model_directory import HuggingFaceModel
from tensorsmith.compiler.targets import get_target
from tensorsmith.compiler.variants.kv_fp8 import FP8_CACHE, cache_scales, check_cache_precision, with_fp8_perplexity
from tensorsmith.compiler.variants.language import text_evaluation
from tensorsmith.core import ir
from tensorsmith.core.errors import ConfigError, PassError
from tensorsmith.core.ir import GraphIO
from tensorsmith.core.mapped_graph import mapped
from tensorsmith.core.mapped_save import save_mapped
from tensorsmith.core.precisions import reference_precision
from tensorsmith.core.progress import Reporter
from tensorsmith.passes import PassReport, run_passes
from tensorsmith.passes.kv_quantize import QuantizedCache
from tensorsmith.passes.last_position import LastPositionLogits
from tensorsmith.passes.static_cache import CACHE_DIM, STATIC_CACHE_OPSET, StaticCache
from tensorsmith.passes.tied_projection import TiedProjection
from tensorsmith.runtime.manifest import TensorRecord, VariantRecord, external_data_path, sha256_of

logger = logging.getLogger(__name__)

STATIC, DYNAMIC = "static", "dynamic"


@dataclass(frozen=True)
class CacheLayout:
    """What the generation graphs take: their kind, inputs, outputs and dims, and why they are not static."""

    kind: str
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    dims: dict[str, DimRange]
    reason: str = ""
    reports: list[PassReport] = field(default_factory=list)


def check_static_cache(config: CompileConfig) -> None:
    """`--kv-cache static` (or an fp8 cache) refused before the export when the compile will leave attention
    decomposed."""
    check_cache_precision(config)
    if _wanted(config) != STATIC:
        return
    gpu = [name for name in config.targets if get_target(name).builders]
    reason = (
        "--no-fuse leaves attention decomposed"
        if not config.fuse
        else f"fp32 on {', '.join(gpu)} keeps attention decomposed (TensorRT for RTX builds ONNX Attention in fp16 "
        "or lower only)"
        if config.precision == reference_precision().name and gpu
        else None
    )
    if reason:
        raise ConfigError(f"no static KV cache: {reason}", hint="compile with --kv-cache dynamic, or fp16 for GPUs")


@dataclass(frozen=True)
class EarlyGraph:
    """A variant's generation graph written before the variant was measured (`early_graph`), to be linked into
    place by `generation_graphs`."""

    path: Path
    reports: list[PassReport]


def static_layout(config: CompileConfig, io: GraphIO) -> CacheLayout:
    """The layout the static-cache generation graphs take."""
    static = static_cache_io(io)
    inputs, outputs = static.inputs, static.outputs
    return CacheLayout(
        STATIC, inputs, outputs, {**config.dims, CACHE_DIM: DimRange(min=1, max=config.dims["total"].max)}
    )


def early_graph(
    path: Path, targets: list[str], model: HuggingFaceModel, config: CompileConfig, scratch: Path
) -> EarlyGraph | None:
    """The generation graph of the variant just written at `path` (run by `targets`), written into `scratch` under
    the same name: the very graph `generation_graphs` would write once the variant is measured, so its engines can
    be built meanwhile. None where that graph is not known yet: a variant a cpu target runs too, a dynamic cache,
    or an fp8 cache (its scales come from the measurements)."""
    if _wanted(config) == DYNAMIC or config.generation.kv_cache_precision == FP8_CACHE:
        return None
    if not targets or not all(get_target(target).builders for target in targets):
        return None
    try:
        windows = layer_windows(model)
    except ValueError:
        return None
    destination = scratch / path.name
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        reports = _rewrite(path, windows, config.dims["total"].max, {}, True, destination)
    except PassError:
        return None
    return EarlyGraph(destination, reports)


def generation_graphs(
    records: list[VariantRecord],
    by_target: Mapping[str, VariantRecord],
    model: HuggingFaceModel,
    config: CompileConfig,
    io: GraphIO,
    directory: Path,
    reporter: Reporter,
    verification: Callable[[], dict[str, np.ndarray]],
    early: Mapping[str, EarlyGraph] | None = None,
) -> tuple[list[VariantRecord], CacheLayout]:
    """`records` rewritten in place to the static cache (new sha256 each), with the layout they now take; or as
    they are, with the dynamic layout and the reason. A variant an engine is built from (`by_target`: target →
    its variant) has a cache of the longest request, a fixed size (TensorRT needs one); the others take the
    request's own length. With an fp8 cache, an engine's variant (none a cpu target runs) is measured with it
    (`verification`: the fp32 graph's feeds where the compile has no text) and its graph's caches become fp8.
    A variant whose graph was written `early` (variant name → early_graph's) has it linked into place."""
    early = early or {}
    inputs, outputs = io.inputs, io.outputs
    dynamic = CacheLayout(DYNAMIC, inputs, outputs, dict(config.dims))
    wanted = _wanted(config)
    if wanted == DYNAMIC:
        return records, dynamic
    try:
        windows = layer_windows(model)
    except ValueError as err:
        return _kept_dynamic(records, dynamic, str(err), wanted)
    reporter.stage("generation graphs: static KV cache, last-position logits")
    longest = config.dims["total"].max
    engines = {r.name for target, r in by_target.items() if get_target(target).builders}
    scales: dict[str, float] = {}
    engines_only = engines - {r.name for target, r in by_target.items() if not get_target(target).builders}
    if config.generation.kv_cache_precision == FP8_CACHE:
        reference = directory / records[0].path
        scales, described = cache_scales(config, reference, inputs, verification)
        logger.info("fp8 KV cache: %d scales from %s", len(scales), described)
        evaluation = text_evaluation(config, inputs, reference)
        records = [
            with_fp8_perplexity(r, reference, directory, evaluation, scales) if r.name in engines_only else r
            for r in records
        ]
    rewritten: list[VariantRecord] = []
    reports: list[PassReport] = []
    for record in records:
        if not record.shipped:  # measured against, left out of the artifact: not worth a rewrite (32 GB at 8B)
            rewritten.append(record)
            continue
        try:
            capacity = longest if record.name in engines else None
            own_scales = scales if record.name in engines_only else {}
            if record.name in early and not own_scales:
                report = _placed(early[record.name], directory / record.path)
            else:
                report = _rewrite(directory / record.path, windows, capacity, own_scales, record.name in engines_only)
        except PassError as err:
            # the variants come from one fused graph: one rewriting and another not is a bug
            if any(done.shipped for done in rewritten):
                raise
            return _kept_dynamic(records, dynamic, f"{record.name}: {err}", wanted)
        rewritten.append(record.model_copy(update={"sha256": sha256_of(directory / record.path)}))
        for one in report:
            one.variant = record.name
        reports.extend(report)
    return rewritten, replace(static_layout(config, io), reports=reports)


def _placed(graph: EarlyGraph, path: Path) -> list[PassReport]:
    """The early graph's files linked over the variant's (its weights first: the new structure reads them). Linked,
    not moved: an early build may not have read them yet (compiler/early_engines.py removes its own names)."""
    early_data, data = external_data_path(graph.path), external_data_path(path)
    if early_data.is_file():
        _link_over(early_data, data)
    else:
        data.unlink(missing_ok=True)
    _link_over(graph.path, path)
    return [replace(report) for report in graph.reports]


def _link_over(source: Path, destination: Path) -> None:
    if ir.same_file(source, destination):  # the early graph shares the variant's weights file already
        return
    partial = destination.with_name(f".{destination.name}.partial")
    partial.unlink(missing_ok=True)
    os.link(source, partial)
    os.replace(partial, destination)


def _kept_dynamic(
    records: list[VariantRecord], dynamic: CacheLayout, reason: str, wanted: str | None
) -> tuple[list[VariantRecord], CacheLayout]:
    if wanted == STATIC:
        raise ConfigError(f"no static KV cache: {reason}", hint="compile with --kv-cache dynamic")
    logger.info("generation graphs keep the dynamic KV cache: %s", reason)
    return records, CacheLayout(DYNAMIC, dynamic.inputs, dynamic.outputs, dynamic.dims, reason)


def _wanted(config: CompileConfig) -> str | None:
    """The cache asked for: an fp8 cache is a static one."""
    fp8 = config.generation.kv_cache_precision == FP8_CACHE
    return config.generation.kv_cache or (STATIC if fp8 else None)


def _rewrite(
    path: Path,
    windows: list[int | None],
    capacity: int | None,
    fp8_scales: dict[str, float],
    engines_only: bool = False,
    destination: Path | None = None,
) -> list[PassReport]:
    """The static cache's reports (and the fp8 cache's, given its scales; and, for a graph only engines are built
    from, the tied projection's: ONNX Runtime would fold its Transpose back into a copy). The graph is saved at
    `destination`, by default over itself."""
    with mapped(path) as (graph, _):
        logits = next(tensor for tensor in graph.outputs if tensor.name == "logits")
        batch, _, vocabulary = logits.shape
        quantized = [QuantizedCache(fp8_scales)] if fp8_scales else []
        tied = [TiedProjection()] if engines_only else []
        reports = run_passes(graph, [StaticCache(windows, capacity), *quantized, *tied, LastPositionLogits()])
        logits.shape = [batch, 1, vocabulary]  # the last position's: an output's shape is written, not inferred
        graph.opset = max(graph.opset, STATIC_CACHE_OPSET)
        for opset in graph.import_domains or []:  # onnx-graphsurgeon exports the imports it read
            if opset.domain in ("", "ai.onnx"):
                opset.version = max(opset.version, STATIC_CACHE_OPSET)
        save_mapped(graph, destination or path)
    # a float variant ties its projection when written (compiler/variants/float_builder.py): nothing left to say
    return [report for report in reports[:-1] if report.changed or report.name != TiedProjection.name]
