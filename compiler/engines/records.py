"""The engines stage: one engine per GPU target, from the variant its recipe names, built where a builder for it
is installed (the target table's order), else recorded `pending` with the command to run on a matching machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tensorsmith.compiler.config import BuildConfig, DimRange
from tensorsmith.compiler.engines.builder import BUILDER_MODULES, build_engine
from tensorsmith.compiler.engines.engine_graph import engine_graph
from tensorsmith.compiler.engines.profiles import decoder_profiles, profile_for
from tensorsmith.compiler.targets import RTX_TARGETS, Builder, get_target
from tensorsmith.core import memory
from tensorsmith.core.errors import BuildError
from tensorsmith.core.external_bytes import graph_bytes
from tensorsmith.core.files import replace_file
from tensorsmith.core.progress import Reporter
from tensorsmith.runtime.backends import backend_named
from tensorsmith.runtime.device import detect_device, module_installed
from tensorsmith.runtime.kv_cache import WRITE_INDICES
from tensorsmith.runtime.manifest import (
    EngineRecord,
    TargetRecord,
    TensorRecord,
    VariantRecord,
    sha256_of,
)

if TYPE_CHECKING:
    from tensorsmith.compiler.engines.builder import BuiltEngine
    from tensorsmith.compiler.engines.profile import Profile

logger = logging.getLogger(__name__)

ENGINES_DIR = "engines"

# An engine build's process holds TensorRT's own copy of the graph's weights (the file's pages it reads are let go:
# mapped_parse.py) and its working memory: 4.47 GB for the 1B shape's 2.48 GB graph (docs/benchmarks.md, "Real
# shapes"); these bound how many run side by side.
# Data-centre TensorRT may parse from the file (mapped_parse.py's fallback) and hold the weights twice (7.7 GB there).
BUILD_MEMORY_BASE = 1 << 30
BUILD_MEMORY_FACTOR: dict[Builder, int] = {"tensorrt-rtx": 2, "tensorrt": 3}


class EarlyBuilds(Protocol):
    """Builds started before the engines stage (compiler/early_engines.py)."""

    def take(self, target: str, sha256: str, profiles: list[Profile]) -> BuiltEngine | None: ...


def choose_builder(target: str, requested: Builder | None) -> Builder:
    """The builder for `target` here: `requested`, else the first in the table's order that can build it on this
    machine (TensorRT for RTX anywhere; data-centre TensorRT on a GPU of that architecture)."""
    if requested is not None:
        return requested
    row = get_target(target)
    if not row.builders:
        raise BuildError(f"{target} has no engine: it runs on ONNX Runtime", hint="build a GPU target instead")
    if "tensorrt-rtx" in row.builders and module_installed(BUILDER_MODULES["tensorrt-rtx"]):
        return "tensorrt-rtx"
    if "tensorrt" in row.builders and module_installed(BUILDER_MODULES["tensorrt"]):
        device = detect_device()
        if device.compute_capability == target:
            return "tensorrt"
        raise BuildError(
            f"data-centre TensorRT builds for the GPU it runs on ({device.compute_capability or device.reason}), "
            f"not {target}",
            hint=f"run tensorsmith build on a {row.gpus} machine",
        )
    rtx = f"pip install 'tensorsmith[rtx]' (covers {', '.join(RTX_TARGETS)})" if row.rtx_capability else ""
    on_device = f"install TensorRT on a {row.gpus} machine" if row.datacenter else ""
    raise BuildError(
        f"no builder for {target} is installed here", hint=" or ".join(part for part in (rtx, on_device) if part)
    )


def build_engines(
    config: BuildConfig,
    targets: list[str],
    variants: Mapping[str, VariantRecord],
    inputs: list[TensorRecord],
    dims: Mapping[str, DimRange],
    directory: Path,
    reporter: Reporter,
    decoder: bool = False,
    early: EarlyBuilds | None = None,
) -> list[TargetRecord]:
    """Build (or record) each target's engine from its variant (`variants`: target → variant) into
    `directory/engines/`. A failed build is recorded, so the other targets' engines are not lost. `early`: builds
    started before, taken where they were of the same graph."""
    records: dict[str, TargetRecord] = {}
    builds: dict[str, Builder] = {}
    for name in targets:
        target, variant = get_target(name), variants[name]
        if not target.builders:
            reason = f"runs on {backend_named(variant.backend).title}"
            records[name] = TargetRecord(
                name=name, variant=variant.name, builder="none", status="not-needed", reason=reason
            )
            continue
        try:
            builds[name] = choose_builder(name, config.requested_builder)
        except BuildError as err:
            reason = (
                f"{err.message}: on a {target.gpus} machine with TensorRT, run `tensorsmith build OUT --target {name}`"
            )
            records[name] = TargetRecord(
                name=name, variant=variant.name, builder=target.on_device_builder, status="pending", reason=reason
            )

    def build(name: str) -> TargetRecord:
        try:
            return build_engine_record(
                name, variants[name], inputs, dims, directory, builds[name], config, decoder, early
            )
        except BuildError as err:
            logger.info("the %s engine failed: %s", name, err)  # in its record; the compile's error names it
            return TargetRecord(
                name=name, variant=variants[name].name, builder=builds[name], status="failed", reason=str(err)
            )

    workers = parallel_builds(
        len(builds),
        max((graph_bytes(directory / variants[n].path) for n in builds), default=0),
        memory_factor(builds.values()),
    )
    if builds:
        names = ", ".join(builds)
        side_by_side = f", {workers} at a time" if workers > 1 else ""
        reporter.stage(
            f"building the {names} engine{'s' if len(builds) > 1 else ''} with "
            f"{'/'.join(sorted(set(builds.values())))}{side_by_side}"
        )
    # each build runs in its own process (isolated.py): threads here only wait for them
    with ThreadPoolExecutor(max_workers=max(workers, 1)) as pool:
        records.update(zip(builds, pool.map(build, builds), strict=True))
    return [records[name] for name in targets]


def parallel_builds(count: int, model_bytes: int, factor: int = BUILD_MEMORY_FACTOR["tensorrt"]) -> int:
    """How many engine builds to run side by side: one a core, as many as the available memory holds (at least one)."""
    return max(1, min(os.cpu_count() or 1, builds_that_fit(count, model_bytes, factor)))


def builds_that_fit(count: int, model_bytes: int, factor: int, reserve: int = 0) -> int:
    """How many of `count` builds the available memory, less `reserve`, holds at `factor` times the graph's bytes
    (plus BUILD_MEMORY_BASE) each; maybe none."""
    per_build = BUILD_MEMORY_BASE + factor * model_bytes
    return min(count, max(0, available_memory() - reserve) // per_build)


def memory_factor(builders: Iterable[Builder]) -> int:
    """BUILD_MEMORY_FACTOR of the hungriest of `builders`."""
    return max((BUILD_MEMORY_FACTOR[builder] for builder in builders), default=1)


def available_memory() -> int:
    """What this process may still take (core/memory.py); elsewhere as if one build fits."""
    available = memory.available_memory()
    return BUILD_MEMORY_BASE if available is None else available


def build_engine_record(
    name: str,
    variant: VariantRecord,
    inputs: list[TensorRecord],
    dims: Mapping[str, DimRange],
    directory: Path,
    builder: Builder,
    options: BuildConfig,
    decoder: bool = False,
    early: EarlyBuilds | None = None,
) -> TargetRecord:
    """Build `name`'s engine from `variant` into `directory/engines/NAME.engine` (+ NAME.json, with the build's
    warnings), and its manifest record; or take `early`'s build of the same graph."""
    profiles = decoder_profiles(inputs, dims, name) if decoder else [profile_for(inputs, dims, name)]
    # a static-cache decoder's variant is its generation graph already (compiler/variants/kv_cache.py)
    sliced = any(record.name == WRITE_INDICES for record in inputs)
    engines = directory / ENGINES_DIR
    engines.mkdir(exist_ok=True)
    path = engines / f"{name}.engine"
    with engine_graph(directory, variant, decoder and not sliced) as (source, sha256):
        engine = early.take(name, sha256, profiles) if early is not None else None
        if engine is not None and engine.plan_path is not None:
            os.replace(engine.plan_path, path)
            engine = dataclasses.replace(engine, plan_path=path)
        else:
            engine = build_engine(source, name, profiles, builder, options, onnx_sha256=sha256, destination=path)
    record = EngineRecord(
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        builder_version=engine.builder_version,
        compute_capability=name,
        profiles=engine.profiles,
        profile_names=engine.profile_names,
        cache=engine.cache,
    )
    details: Mapping[str, object] = {
        "builder": engine.builder,
        "builder_version": engine.builder_version,
        "compute_capability": name,
        "variant": variant.name,
        "profiles": engine.profiles,
        "profile_names": engine.profile_names,
        "build_seconds": engine.seconds,
        "sha256": record.sha256,
        "bytes": engine.size,
        "timing_cache": engine.timing_cache,
        "engine_cache": engine.cache,
        "warnings": engine.warnings,
    }
    replace_file(engines / f"{name}.json", (json.dumps(details, indent=2) + "\n").encode())
    logger.info("built %s (%d bytes) in %.1f s", path.name, engine.size, engine.seconds)
    return TargetRecord(name=name, variant=variant.name, builder=builder, status="built", engine=record)
