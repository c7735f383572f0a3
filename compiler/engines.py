"""Engines in `compile`: one per GPU target, built where a builder for it is installed, else recorded pending."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from tensorsmith.compiler.artifact import artifact_lock, locked, replace_file, write_manifest
from tensorsmith.compiler.build import (
    BUILDER_MODULES,
    RTX_ARCHITECTURES,
    Builder,
    BuildOptions,
    build_engine,
    profile_for,
)
from tensorsmith.compiler.config import CompileConfig, DimRange
from tensorsmith.compiler.errors import BuildError
from tensorsmith.compiler.progress import LogReporter, Reporter
from tensorsmith.compiler.report import write_report
from tensorsmith.compiler.targets import get_target
from tensorsmith.runtime.device import detect_device, module_installed
from tensorsmith.runtime.manifest import (
    EngineRecord,
    Manifest,
    TargetRecord,
    TensorRecord,
    VariantRecord,
    read_manifest,
    sha256_of,
)

logger = logging.getLogger(__name__)


def _installed(builder: str) -> bool:
    return module_installed(BUILDER_MODULES[builder])


def target_records(
    config: CompileConfig,
    variants: Mapping[str, VariantRecord],
    inputs: list[TensorRecord],
    directory: Path,
    reporter: Reporter,
) -> list[TargetRecord]:
    """Build (or record) each target's engine from its variant (`variants`: target → variant); engines go to
    `directory/engines/`."""
    records = []
    for name in config.targets:
        target = get_target(name)
        variant = variants[name]
        if not target.builders:
            records.append(
                TargetRecord(
                    name=name, variant=variant.name, builder="none", status="not-needed", reason="runs on ONNX Runtime"
                )
            )
            continue
        requested = None if config.build.builder == "auto" else config.build.builder
        try:
            builder = _builder_for(name, requested)
        except BuildError:
            builder = None
        if builder is not None:
            reporter.stage(f"building the {name} engine with {builder}")
            try:
                options = config.build.options()
                records.append(_build_engine(name, variant, inputs, config.dims, directory, builder, options))
            except BuildError as err:  # recorded, so the other targets' engines are not lost
                logger.error("the %s engine failed: %s", name, err)
                records.append(
                    TargetRecord(name=name, variant=variant.name, builder=builder, status="failed", reason=str(err))
                )
            continue
        records.append(
            TargetRecord(
                name=name,
                variant=variant.name,
                builder="tensorrt",
                status="pending",
                reason=f"no builder for {name} here: on a {target.gpus} machine with TensorRT, run "
                f"`tensorsmith build OUT --target {name}`",
            )
        )
    return records


def _build_engine(
    name: str,
    variant: VariantRecord,
    inputs: list[TensorRecord],
    dims: Mapping[str, DimRange],
    directory: Path,
    builder: Builder,
    options: BuildOptions | None = None,
) -> TargetRecord:
    profile = profile_for(inputs, dims, name)
    engine = build_engine(
        directory / variant.path, name, profile, builder, options or BuildOptions(), onnx_sha256=variant.sha256
    )
    engines = directory / "engines"
    engines.mkdir(exist_ok=True)
    path = engines / f"{name}.engine"
    replace_file(path, engine.plan)
    record = EngineRecord(
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        builder_version=engine.builder_version,
        compute_capability=name,
        profiles=engine.profiles,
        cache=engine.cache,
    )
    details: Mapping[str, object] = {
        "builder": engine.builder,
        "builder_version": engine.builder_version,
        "compute_capability": name,
        "variant": variant.name,
        "profiles": engine.profiles,
        "build_seconds": engine.seconds,
        "sha256": record.sha256,
        "bytes": len(engine.plan),
        "timing_cache": engine.timing_cache,
        "engine_cache": engine.cache,
    }
    replace_file(engines / f"{name}.json", (json.dumps(details, indent=2) + "\n").encode())
    logger.info("built %s (%d bytes) in %.1f s", path.name, len(engine.plan), engine.seconds)
    return TargetRecord(name=name, variant=variant.name, builder=builder, status="built", engine=record)


def _variant_for(manifest: Manifest, target: str) -> VariantRecord:
    """The target's variant as compile recorded it; else the most quantized variant the target can run."""
    for record in manifest.targets:
        if record.name == target:
            return manifest.variant(record.variant)
    runs = get_target(target).precisions
    for name in ("fp8", "int8", "fp32"):
        if name in runs and any(v.name == name for v in manifest.variants):
            return manifest.variant(name)
    raise BuildError(
        f"the artifact has no variant that {target} can run (variants: {[v.name for v in manifest.variants]})",
        hint=f"recompile with --target {target}",
    )


def _builder_for(target: str, requested: Builder | None) -> Builder:
    if requested is not None:
        return requested
    if target in RTX_ARCHITECTURES and _installed("tensorrt-rtx"):
        return "tensorrt-rtx"
    if _installed("tensorrt"):
        device = detect_device()
        if device.compute_capability == target:
            return "tensorrt"
        raise BuildError(
            f"data-centre TensorRT builds for the GPU it runs on ({device.compute_capability or device.reason}), "
            f"not {target}",
            hint=f"run tensorsmith build on a {get_target(target).gpus} machine",
        )
    raise BuildError(
        f"no builder for {target} is installed here",
        hint=f"pip install 'tensorsmith[rtx]' (covers {', '.join(RTX_ARCHITECTURES)}) or install TensorRT "
        f"on a {get_target(target).gpus} machine",
    )


def build_target(
    directory: Path,
    target: str,
    builder: Builder | None = None,
    options: BuildOptions | None = None,
    reporter: Reporter | None = None,
) -> TargetRecord:
    """Add `target`'s engine to an existing artifact (`tensorsmith build`). Builds run in parallel; the manifest
    update is serialised by a lock and written atomically, so concurrent builds for other targets all land."""
    get_target(target)
    read_manifest(directory)  # a clear error for a directory that is not an artifact, before any lock
    with artifact_lock(directory, shared=True):  # no compile may replace the artifact meanwhile
        manifest = read_manifest(directory)
        variant = _variant_for(manifest, target)
        chosen = _builder_for(target, builder)
        (reporter or LogReporter()).stage(f"building the {target} engine from variant {variant.name} with {chosen}")
        record = _build_engine(
            target,
            variant,
            manifest.inputs,
            {name: DimRange(**limits) for name, limits in manifest.dims.items()},
            directory,
            chosen,
            options,
        )
        with locked(directory):
            current = read_manifest(directory)
            current.targets = [t for t in current.targets if t.name != target] + [record]
            write_manifest(directory, current)
            write_report(directory)  # the engine table changed
    return record
