"""The engines stage: one engine per GPU target, from the variant its recipe names, built where a builder for it
is installed (the target table's order), else recorded `pending` with the command to run on a matching machine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from tensorsmith.compiler.config import BuildConfig, DimRange
from tensorsmith.compiler.engines.builder import BUILDER_MODULES, build_engine
from tensorsmith.compiler.engines.engine_graph import engine_graph
from tensorsmith.compiler.engines.profiles import decoder_profiles, profile_for
from tensorsmith.compiler.targets import RTX_TARGETS, Builder, get_target
from tensorsmith.core.errors import BuildError
from tensorsmith.core.files import replace_file
from tensorsmith.core.progress import Reporter
from tensorsmith.runtime.device import detect_device, module_installed
from tensorsmith.runtime.manifest import EngineRecord, TargetRecord, TensorRecord, VariantRecord, sha256_of

logger = logging.getLogger(__name__)

ENGINES_DIR = "engines"

BACKEND_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}  # the cpu backends, as people write them


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
) -> list[TargetRecord]:
    """Build (or record) each target's engine from its variant (`variants`: target → variant) into
    `directory/engines/`. A failed build is recorded, so the other targets' engines are not lost."""
    records = []
    for name in targets:
        target, variant = get_target(name), variants[name]
        if not target.builders:
            records.append(
                TargetRecord(
                    name=name,
                    variant=variant.name,
                    builder="none",
                    status="not-needed",
                    reason=f"runs on {BACKEND_NAMES[variant.backend]}",
                )
            )
            continue
        try:
            builder = choose_builder(name, None if config.builder == "auto" else config.builder)
        except BuildError as err:
            reason = (
                f"{err.message}: on a {target.gpus} machine with TensorRT, run `tensorsmith build OUT --target {name}`"
            )
            records.append(
                TargetRecord(
                    name=name, variant=variant.name, builder=target.on_device_builder, status="pending", reason=reason
                )
            )
            continue
        reporter.stage(f"building the {name} engine with {builder}")
        try:
            records.append(build_engine_record(name, variant, inputs, dims, directory, builder, config, decoder))
        except BuildError as err:
            logger.info("the %s engine failed: %s", name, err)  # in its record; the compile's error names it
            records.append(
                TargetRecord(name=name, variant=variant.name, builder=builder, status="failed", reason=str(err))
            )
    return records


def build_engine_record(
    name: str,
    variant: VariantRecord,
    inputs: list[TensorRecord],
    dims: Mapping[str, DimRange],
    directory: Path,
    builder: Builder,
    options: BuildConfig,
    decoder: bool = False,
) -> TargetRecord:
    """Build `name`'s engine from `variant` into `directory/engines/NAME.engine` (+ NAME.json, with the build's
    warnings), and its manifest record."""
    profiles = decoder_profiles(inputs, dims, name) if decoder else [profile_for(inputs, dims, name)]
    with engine_graph(directory, variant, decoder) as (source, sha256):
        engine = build_engine(source, name, profiles, builder, options, onnx_sha256=sha256)
    engines = directory / ENGINES_DIR
    engines.mkdir(exist_ok=True)
    path = engines / f"{name}.engine"
    replace_file(path, engine.plan)
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
        "bytes": len(engine.plan),
        "timing_cache": engine.timing_cache,
        "engine_cache": engine.cache,
        "warnings": engine.warnings,
    }
    replace_file(engines / f"{name}.json", (json.dumps(details, indent=2) + "\n").encode())
    logger.info("built %s (%d bytes) in %.1f s", path.name, len(engine.plan), engine.seconds)
    return TargetRecord(name=name, variant=variant.name, builder=builder, status="built", engine=record)
