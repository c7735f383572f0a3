"""`tensorsmith export-triton`: one target of an artifact as a Triton Inference Server model repository entry.

    REPO/NAME/config.pbtxt
    REPO/NAME/1/model.plan     a TensorRT engine (platform tensorrt_plan, instances on the GPU)
    REPO/NAME/1/model.onnx     the cpu variant   (platform onnxruntime_onnx, instances on the CPU)

config.pbtxt is protobuf text of Triton's `inference.ModelConfig` (model_config.proto); the tests parse it with
Triton's own schema. Triton batches on the first dimension when `max_batch_size > 0`, so the batch dim is left
out of `dims`, and the dynamic batcher's sizes come from the engine's optimization profile.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tensorsmith.compiler.artifact.staging import staged_artifact
from tensorsmith.compiler.targets import get_target
from tensorsmith.core.errors import ConfigError
from tensorsmith.runtime.manifest import (
    Manifest,
    TargetRecord,
    TensorRecord,
    external_data_path,
    read_manifest,
    verified_file,
)

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.pbtxt"
DEFAULT_QUEUE_DELAY_US = 15000
# numpy dtype names → model_config.proto DataType
TRITON_TYPES = {
    "bool": "TYPE_BOOL",
    "uint8": "TYPE_UINT8",
    "int8": "TYPE_INT8",  # dtypes, not precisions
    "int16": "TYPE_INT16",
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float16": "TYPE_FP16",
    "float32": "TYPE_FP32",
    "float64": "TYPE_FP64",
    "bfloat16": "TYPE_BF16",
}


@dataclass
class TritonModel:
    directory: Path
    platform: str
    model_file: str
    max_batch_size: int
    preferred_batch_sizes: list[int]
    warnings: list[str] = field(default_factory=list)


def _target(manifest: Manifest, artifact: Path, name: str) -> TargetRecord:
    for record in manifest.targets:
        if record.name == name:
            return record
    known = [record.name for record in manifest.targets]
    raise ConfigError(f"{artifact} has no target '{name}' (targets: {known})", hint=f"compile with --target {name}")


def _tensor(record: TensorRecord, batched: bool) -> str:
    if record.dtype not in TRITON_TYPES:
        raise ConfigError(f"tensor '{record.name}' has dtype {record.dtype}, which Triton has no type for")
    shape = record.shape[1:] if batched else record.shape
    dims = ", ".join(str(dim) if isinstance(dim, int) else "-1" for dim in shape)
    fields = [f"name: {json.dumps(record.name)}", f"data_type: {TRITON_TYPES[record.dtype]}", f"dims: [ {dims} ]"]
    return "  {\n" + "".join(f"    {line}\n" for line in fields) + "  }"


def render_config(
    name: str,
    platform: str,
    manifest: Manifest,
    max_batch_size: int,
    preferred: list[int],
    queue_delay_us: int,
    kind: str,
    instances: int,
    comment: str,
) -> str:
    batched = max_batch_size > 0
    lines = [
        f"# {comment}",
        f"name: {json.dumps(name)}",
        f'platform: "{platform}"',
        f"max_batch_size: {max_batch_size}",
    ]
    lines.append("input [\n" + ",\n".join(_tensor(r, batched) for r in manifest.inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(_tensor(r, batched) for r in manifest.outputs) + "\n]")
    if batched:
        sizes = ", ".join(str(size) for size in preferred)
        lines.append(
            f"dynamic_batching {{\n  preferred_batch_size: [ {sizes} ]\n"
            f"  max_queue_delay_microseconds: {queue_delay_us}\n}}"
        )
    lines.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]")
    return "\n".join(lines) + "\n"


def export_triton(
    artifact: Path,
    target: str,
    repository: Path,
    name: str | None = None,
    max_batch: int | None = None,
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
    instances: int = 1,
) -> TritonModel:
    """Write REPO/NAME (config.pbtxt and version 1's model file) for `target` of `artifact`, atomically."""
    runs_on_onnxruntime = not get_target(target).builders  # the target table: cpu, not an engine
    manifest = read_manifest(artifact)
    if manifest.generation is not None:  # one step of a stateful loop: Triton would batch and serve it wrong
        raise ConfigError(
            f"{artifact} is a decoder: Triton's ONNX and TensorRT backends would run one step of its generation "
            "loop with the cache declared as an input, not generate",
            hint=f"serve it with `tensorsmith serve {artifact}` (OpenAI's API, continuous batching, streaming)",
        )
    record = _target(manifest, artifact, target)
    name = name or artifact.resolve().name
    warnings = []
    if runs_on_onnxruntime:
        variant = manifest.variant(record.variant)
        source = verified_file(artifact, variant.path, variant.sha256)
        model_file, platform, kind = "model.onnx", "onnxruntime_onnx", "KIND_CPU"
        comment = f"tensorsmith export-triton: {artifact.resolve().name} target cpu, variant {variant.name}"
        if variant.onnxruntime_disabled_optimizers:
            warnings.append(
                f"the {variant.name} variant runs faster here with ONNX Runtime's "
                f"{', '.join(variant.onnxruntime_disabled_optimizers)} switched off (measured by compile), which "
                "the config cannot say: Triton runs it with ONNX Runtime's defaults"
            )
    else:
        if record.status != "built" or record.engine is None:
            raise ConfigError(
                f"target {target} of {artifact} is {record.status}: no engine to export",
                hint=f"build it first: tensorsmith build {artifact} --target {target}",
            )
        source = verified_file(artifact, record.engine.path, record.engine.sha256)
        model_file, platform, kind = "model.plan", "tensorrt_plan", "KIND_GPU"
        comment = (
            f"tensorsmith export-triton: {artifact.resolve().name} target {target}, variant {record.variant}, "
            f"built by {record.builder} {record.engine.builder_version}"
        )
        if record.builder == "tensorrt-rtx":
            warnings.append(
                f"the {target} engine was built by TensorRT for RTX {record.engine.builder_version}; Triton's "
                "tensorrt_plan backend deserializes with data-centre TensorRT, which cannot load it. For Triton, "
                f"rebuild on a {target} GPU runner: tensorsmith build {artifact} --target {target} --builder tensorrt "
                "(with the TensorRT version of your Triton release)"
            )

    batch = manifest.batch_dim()
    max_batch_size, preferred = 0, []
    if batch is not None:
        limit, tuned = manifest.batch_limits(record.engine)
        if max_batch is not None and limit is not None and max_batch > limit:
            raise ConfigError(
                f"--max-batch {max_batch} is larger than the {target} model's largest batch ({limit})",
                hint=f"use --max-batch {limit} or less, or recompile with a larger [dims.{batch}] max",
            )
        max_batch_size = max_batch if max_batch is not None else (limit or 8)
        preferred = sorted({size for size in (tuned or 1, max_batch_size) if 0 < size <= max_batch_size})
    elif max_batch:
        warnings.append(f"the model has no batch dim shared by all its tensors: --max-batch {max_batch} is ignored")

    text = render_config(name, platform, manifest, max_batch_size, preferred, queue_delay_us, kind, instances, comment)
    out = repository / name
    with staged_artifact(out, marker=CONFIG_NAME) as staging:
        (staging / CONFIG_NAME).write_text(text)
        (staging / "1").mkdir()
        shutil.copyfile(source, staging / "1" / model_file)
        sidecar = external_data_path(source)  # an ONNX model's external weights, under their own name
        if sidecar.is_file():
            shutil.copyfile(sidecar, staging / "1" / sidecar.name)
    for warning in warnings:
        logger.warning("%s", warning)
    return TritonModel(out, platform, model_file, max_batch_size, preferred, warnings)
