"""Engines in `compile`: one per GPU target, built where a builder for it is installed, else recorded pending."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Mapping
from pathlib import Path

from tensorsmith.compiler.build import BUILDER_MODULES, RTX_ARCHITECTURES, build_engine, profile_for
from tensorsmith.compiler.config import CompileConfig
from tensorsmith.compiler.progress import Reporter
from tensorsmith.compiler.targets import get_target
from tensorsmith.runtime.manifest import EngineRecord, TargetRecord, TensorRecord, VariantRecord, sha256_of

logger = logging.getLogger(__name__)


def _installed(builder: str) -> bool:
    return importlib.util.find_spec(BUILDER_MODULES[builder]) is not None


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
        if name in RTX_ARCHITECTURES and _installed("tensorrt-rtx"):
            reporter.stage(f"building the {name} engine with tensorrt-rtx")
            records.append(_build(config, name, variant, inputs, directory))
            continue
        records.append(
            TargetRecord(
                name=name,
                variant=variant.name,
                builder="tensorrt",
                status="pending",
                reason=f"no builder for {name} here: data-centre TensorRT builds it on a {target.gpus} GPU",
            )
        )
    return records


def _build(
    config: CompileConfig, name: str, variant: VariantRecord, inputs: list[TensorRecord], directory: Path
) -> TargetRecord:
    engine = build_engine(directory / variant.path, name, profile_for(inputs, config.dims))
    engines = directory / "engines"
    engines.mkdir(exist_ok=True)
    path = engines / f"{name}.engine"
    path.write_bytes(engine.plan)
    record = EngineRecord(
        path=str(path.relative_to(directory)),
        sha256=sha256_of(path),
        builder_version=engine.builder_version,
        compute_capability=name,
        profiles=engine.profiles,
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
    }
    (engines / f"{name}.json").write_text(json.dumps(details, indent=2) + "\n")
    logger.info("built %s (%d bytes) in %.1f s", path.name, len(engine.plan), engine.seconds)
    return TargetRecord(name=name, variant=variant.name, builder="tensorrt-rtx", status="built", engine=record)
