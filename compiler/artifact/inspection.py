"""`tensorsmith inspect`: a summary of an artifact directory or of an ONNX file, as a dict for --json."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any, Literal, TypedDict

from tensorsmith.core.errors import ConfigError
from tensorsmith.core.ir import ai_onnx_opset, io_records, load_onnx
from tensorsmith.runtime.manifest import read_manifest

ArtifactSummary = dict[str, Any]  # the manifest's JSON, with the kind and path


class OnnxSummary(TypedDict):
    kind: Literal["onnx"]
    path: str
    opset: int
    producer: str
    nodes: int
    parameters: int
    bytes: int
    inputs: list[dict[str, object]]  # runtime/manifest.TensorRecord's fields
    outputs: list[dict[str, object]]
    ops: dict[str, int]  # op type → nodes, most used first


def inspect_onnx(path: Path) -> OnnxSummary:
    model = load_onnx(path)
    io = io_records(model)
    inputs, outputs = io.inputs, io.outputs
    parameters = sum(math.prod(init.dims) for init in model.graph.initializer)
    return {
        "kind": "onnx",
        "path": str(path),
        "opset": ai_onnx_opset(model),
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "nodes": len(model.graph.node),
        "parameters": parameters,
        "bytes": path.stat().st_size,
        "inputs": [record.model_dump() for record in inputs],
        "outputs": [record.model_dump() for record in outputs],
        "ops": dict(Counter(node.op_type for node in model.graph.node).most_common()),
    }


def inspect_artifact(directory: Path) -> ArtifactSummary:
    manifest = read_manifest(directory)
    return {"kind": "artifact", "path": str(directory), **manifest.model_dump(mode="json")}


def inspect_path(path: Path) -> OnnxSummary | ArtifactSummary:
    if path.is_dir():
        return inspect_artifact(path)
    if path.suffix == ".onnx":
        return inspect_onnx(path)
    raise ConfigError(f"{path} is neither an artifact directory nor an .onnx file", hint="pass OUT or MODEL.onnx")
